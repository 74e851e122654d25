"""``wsb emit`` and ``wsb verify``: a converter that is a command-line tool, checked through
the files it reads and writes. The tool is simulated by a function that knows only the file
formats (safetensors, the HF index, vLLM's per-rank file names), not the harness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.breadth import breadth
from weight_sync_bench.cli.main import main

QKV = "model.layers.{i}.self_attn.qkv_proj.weight"


def hf_to_vllm_tool(src: Path, dst: Path, degree: int) -> None:
    """A converter tool as a user writes one: an HF directory in, vLLM's sharded-state files
    (``model-rank-{r}-part-0.safetensors``) out, for a bias-free Llama."""
    cfg = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    hf: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        hf.update(load_file(str(src / name)))
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vocab, padded = cfg["vocab_size"], -(-cfg["vocab_size"] // 64) * 64

    def vocab_shard(table, r):  # vLLM pads the vocabulary to a multiple of 64, then splits it
        full = torch.zeros(padded, table.shape[1], dtype=table.dtype)
        full[:vocab] = table
        return full.chunk(degree)[r].clone()

    dst.mkdir()
    for r in range(degree):
        out = {"model.embed_tokens.weight": vocab_shard(hf["model.embed_tokens.weight"], r),
               "lm_head.weight": vocab_shard(hf["lm_head.weight"], r),
               "model.norm.weight": hf["model.norm.weight"]}
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            heads = slice(r * nh // degree * hd, (r + 1) * nh // degree * hd)
            g = r * nkv // degree  # vLLM replicates KV head r * nkv // t past nkv ranks
            kv = (slice(g * hd, (g + 1) * hd) if degree > nkv
                  else slice(r * nkv // degree * hd, (r + 1) * nkv // degree * hd))
            out[QKV.format(i=i)] = torch.cat([hf[p + "self_attn.q_proj.weight"][heads],
                                              hf[p + "self_attn.k_proj.weight"][kv],
                                              hf[p + "self_attn.v_proj.weight"][kv]])
            out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(
                degree, dim=1)[r].clone()
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"].chunk(degree)[r],
                 hf[p + "mlp.up_proj.weight"].chunk(degree)[r]])
            out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(
                degree, dim=1)[r].clone()
            for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                out[p + norm] = hf[p + norm]
        save_file({n: x.contiguous() for n, x in out.items()},
                  str(dst / f"model-rank-{r}-part-0.safetensors"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``wsb emit`` of TOY as HF, and the tool's vllm:2 and vllm:4 output from it."""
    root = tmp_path_factory.mktemp("ckpt")
    assert main(["emit", "--convention", "hf", "--config", "toy", "-q", str(root / "hf")]) == 0
    hf_to_vllm_tool(root / "hf", root / "vllm2", 2)
    hf_to_vllm_tool(root / "hf", root / "vllm4", 4)  # TOY's 2 KV heads, each on 2 ranks
    return root


def verify(directory, where="vllm:2", *extra):
    return main(["verify", "--convention", where, "--from", "hf", "--config", "toy", *extra,
                 str(directory)])


def test_emit_then_verify_round_trips_in_every_convention(tmp_path, capsys):
    for where in ("hf", "meta:2"):  # per-rank files: the tool tests below
        directory = tmp_path / where.replace(":", "-")
        assert main(["emit", "--convention", where, "--config", "toy", str(directory)]) == 0
        assert f"toy seed 0 as {where if ':' in where else where + ':1'}" in \
            capsys.readouterr().out
        assert main(["verify", "--convention", where, "--config", "toy", str(directory)]) == 0
        assert "shards equal the declared layout byte for byte" in capsys.readouterr().out


# Both files a geometry is stated in by default: HF's config.json and Meta's params.json;
# vLLM's and Megatron's directories (a config.json too) in the long run
@pytest.mark.parametrize(("where", "config"), breadth(
    [("hf", "toy"), ("meta:2", "toy"), ("vllm:2", "toy_kv4"), ("megatron:2", "toy_moe")],
    keep={"hf", "meta:2"}, name=lambda case: case[0]))
def test_verify_takes_the_geometry_from_the_directory(tmp_path, capsys, where, config):
    """No --config: the geometry config.json (or params.json) states, and it says which."""
    directory = tmp_path / "out"
    assert main(["emit", "--convention", where, "--config", config, "-q", str(directory)]) == 0
    capsys.readouterr()
    assert main(["verify", "--convention", where, str(directory)]) == 0
    out = capsys.readouterr().out
    stated = "params.json" if where.startswith("meta") else "config.json"
    assert out.startswith(f"geometry: {config} (") and f"as {directory / stated} states it" in out
    # a flag overrides it, and a disagreement names both sides (here: the file and toy_kv4)
    other = "toy" if config != "toy" else "toy_kv4"
    assert main(["verify", "--convention", where, "--config", other, str(directory)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"wsb verify: {directory / stated}: ") and \
        f", the config checked ({other}) has " in err, err


def test_a_converter_tool_s_files_pass_verify(converted, capsys):
    assert verify(converted / "vllm2") == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS toy hf:1 -> vllm:2 (phase 1a)") and "1 passed, 0 failed" in out
    assert verify(converted / "vllm4", "vllm:4") == 0
    assert "PASS toy hf:1 -> vllm:4" in capsys.readouterr().out
    # over gloo, one process per rank, the replicated KV heads scattered as they are stored
    assert verify(converted / "vllm4", "vllm:4", "--backend", "gloo") == 0
    assert "PASS toy hf:1 -> vllm:4 (phase 1b)" in capsys.readouterr().out


def test_a_mutated_file_fails_with_exit_1_naming_the_parameter(converted, tmp_path, capsys):
    mutated = tmp_path / "mutated"
    mutated.mkdir()
    for path in (converted / "vllm2").iterdir():
        (mutated / path.name).write_bytes(path.read_bytes())
    r1 = mutated / "model-rank-1-part-0.safetensors"
    params = load_file(str(r1))
    qkv = params[QKV.format(i=0)]  # rank 1: Q heads 4-7 (128 rows), K head 1, V head 1
    params[QKV.format(i=0)] = torch.cat([qkv[32:64], qkv[:32], qkv[64:]])  # Q heads 4, 5 swapped
    save_file(params, str(r1))
    assert verify(mutated) == 1
    out = capsys.readouterr().out
    assert "first parameter that differs from the declared layout: " \
           "model.layers.0.self_attn.qkv_proj.weight (1 differ in all)" in out
    assert ("rank 1 model.layers.0.self_attn.qkv_proj.weight holds Q head 5, Q head 4, "
            "Q heads 6-7, K head 1, V head 1; declared Q heads 4-7, K head 1, V head 1") in out
    assert verify(mutated, "vllm:2", "--json") == 1  # the record names it too
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["first_mismatch"] == QKV.format(i=0) and records[0]["passed"] is False
    assert records[-1]["kind"] == "summary" and records[-1]["exit_code"] == 1


# A truncated file by default; a missing and a misnamed one in the long run: the CLI turns
# every CheckpointError into exit 2 naming its file alike (cli.main.run), and each kind is
# named through the API by default (tests/conventions/test_checkpoint.py's
# test_a_broken_rank_file_is_a_checkpoint_error_naming_it)
@pytest.mark.parametrize("kind", breadth(["truncated", "missing", "misnamed"],
                                         keep={"truncated"}))
def test_a_truncated_missing_or_misnamed_file_is_exit_2_naming_it(converted, tmp_path, kind,
                                                                  capsys):
    broken = tmp_path / kind
    broken.mkdir()
    for path in (converted / "vllm2").iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    assert verify(broken) == 0  # the twin: the same copy, before it is broken
    capsys.readouterr()
    r0 = broken / "model-rank-0-part-0.safetensors"
    if kind == "truncated":
        r0.write_bytes(r0.read_bytes()[:1000])
        named = r0
    elif kind == "missing":
        r0.unlink()
        named = r0
    else:
        named = broken / "rank0.safetensors"
        r0.rename(named)
    assert verify(broken) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"wsb verify: {named}: ")


def test_a_symlink_out_of_the_directory_is_exit_2_unless_its_root_is_allowed(converted,
                                                                           tmp_path, capsys):
    linked = tmp_path / "linked"
    linked.mkdir()
    for path in (converted / "vllm2").iterdir():  # rank 1 read through a link out of DIR
        target = linked / path.name if "rank-0" in path.name else path
        if target == path:
            (linked / path.name).symlink_to(path)
        else:
            target.write_bytes(path.read_bytes())
    assert verify(linked) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"wsb verify: {linked / 'model-rank-1-part-0.safetensors'}: a symlink")
    assert "--allow-root" in err
    assert verify(linked, "vllm:2", "--allow-root", str(converted / "vllm2")) == 0  # the twin


def test_an_hf_index_naming_a_file_outside_is_exit_2_and_the_file_is_never_read(converted,
                                                                                tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    for path in (converted / "hf").iterdir():
        (hf / path.name).write_bytes(path.read_bytes())
    assert main(["verify", "--convention", "hf", "--config", "toy", str(hf)]) == 0  # the twin
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (hf / first).rename(tmp_path / "outside.safetensors")  # it would verify if it were read
    index["weight_map"] = {t: "../outside.safetensors" if f == first else f
                           for t, f in index["weight_map"].items()}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert main(["verify", "--convention", "hf", "--config", "toy", str(hf)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"wsb verify: {hf / '../outside.safetensors'}: the entry "
                          "'../outside.safetensors'") and "outside" in err


def test_emit_refuses_a_directory_with_files_and_verify_a_directory_that_is_not_there(
        tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["emit", "--convention", "hf", "--config", "toy", str(tmp_path / "full")]) == 2
    assert "not a new or empty directory" in capsys.readouterr().err
    assert verify(tmp_path / "absent") == 2
    assert f"{tmp_path / 'absent'}: no such checkpoint directory" in capsys.readouterr().err
    assert main(["emit", "--convention", "hf:2", "--config", "toy", str(tmp_path / "n")]) == 2
    assert "hf: model.embed_tokens.weight needs t == 1" in capsys.readouterr().err


def test_a_real_geometry_is_emitted_and_verified_reduced(tmp_path, capsys, tolerance):
    """``--hf-config PATH --layers N --vocab V`` for emit and verify: the config.json emitted
    states the reduced geometry; verify refuses it until its floor is measured (naming the
    command), ``--measure-floor`` measures and caches it, and the next verify reads the cache."""
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "num_attention_heads": 8, "num_key_value_heads": 2,
              "num_hidden_layers": 28, "vocab_size": 152064, "rope_theta": 1e6,
              "rms_norm_eps": 1e-6}
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(config))
    model = ["--hf-config", str(tmp_path / "qwen" / "config.json"), "--layers", "1",
             "--vocab", "256"]
    assert main(["emit", "--convention", "hf", *model, "-q", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["architectures"], written["num_hidden_layers"], written["vocab_size"],
            written["head_dim"]) == (["Qwen2ForCausalLM"], 1, 256, 8)
    assert {n for n in json.loads((tmp_path / "out" / "model.safetensors.index.json")
                                  .read_text())["weight_map"] if n.endswith(".bias")} == {
        "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias"}  # Qwen2: q, k, v biases only
    capsys.readouterr()
    assert main(["verify", "--convention", "hf", *model, str(tmp_path / "out")]) == 2
    assert "python -m weight_sync_bench.tolerance geometry" in capsys.readouterr().err
    assert not (tolerance / "geometry").exists()
    assert main(["verify", "--convention", "hf", *model, "--measure-floor",
                 str(tmp_path / "out")]) == 0
    assert "PASS qwen hf:1 -> hf:1" in capsys.readouterr().out
    assert len(list((tolerance / "geometry").glob("*.json"))) == 1
    assert main(["verify", "--convention", "hf", *model, str(tmp_path / "out")]) == 0  # cached
    assert "PASS qwen hf:1 -> hf:1" in capsys.readouterr().out
    # without the flags: config.json states the geometry, named as emitted (its cached floor)
    assert written["_name_or_path"] == "qwen"
    assert main(["verify", "--convention", "hf", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("geometry: qwen (d_model 64, 1 layers)") and "PASS qwen hf:1" in out
    # the twin: the same files checked as another geometry name the config.json field
    other = [*model[:-1], "512"]
    assert main(["verify", "--convention", "hf", *other, str(tmp_path / "out")]) == 2
    assert "config.json: vocab is 256, the config checked (qwen) has 512" in \
        capsys.readouterr().err

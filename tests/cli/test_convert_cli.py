"""``wsb check --converter``, ``--hf-config PATH --layers N`` and ``wsb layout --convention``:
a user's converter between frameworks from the command line, under the exit-code contract
(0 pass, 1 a counterexample, 2 bad input, 4 the user's code)."""

from __future__ import annotations

import json
import textwrap

import pytest

from weight_sync_bench.cli.main import main

MODULE = "wsb_cli_converters"


@pytest.fixture
def converters(tmp_path, monkeypatch):
    """A user's module of converters beside them, as `python -m` would find it."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        from weight_sync_bench import convert

        def megatron_to_vllm(shards, degree):
            from weight_sync_bench import TOY_KV4
            return convert(shards, "megatron", f"vllm:{degree}", TOY_KV4)

        def meta_to_vllm(shards, degree):
            from weight_sync_bench import TOY_KV4
            return convert(shards, "meta", f"vllm:{degree}", TOY_KV4)

        def swapped(shards, degree):  # the twin: ranks 0 and 1 exchange their qkv_proj
            out = megatron_to_vllm(shards, degree)
            name = "model.layers.0.self_attn.qkv_proj.weight"
            out[0][name], out[1][name] = out[1][name], out[0][name]
            return out

        def broken(shards, degree):
            raise KeyError("decoder.layers.0.self_attention.linear_qkv.weight")
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return MODULE


# A user's module for the --weights checks: the correct converter and its twin, [up; gate]
# where [gate; up] is. Each takes the geometry as config=, so the checkpoints below hold
# TOY_KV4 with a vocabulary of 256 (_weights): the threshold is measured on the weights at
# every check, and TOY_KV4's 32000-row embedding and head made that most of each test's time.
WEIGHTS_CONVERTERS = textwrap.dedent("""
    import torch
    from weight_sync_bench import convert

    def megatron_to_vllm(shards, degree, *, config):
        return convert(shards, "megatron:2", f"vllm:{degree}", config)

    def up_gate(shards, degree, *, config):
        out = megatron_to_vllm(shards, degree, config=config)
        for rank in out:
            for name, x in rank.items():
                if name.endswith("gate_up_proj.weight"):
                    rank[name] = torch.cat(x.chunk(2)[::-1])
        return out
""")


def _weights(vocab=256):
    """TOY_KV4's heads, layers and widths with a small vocabulary, as bf16 weights no seed
    draws (the seed's, scaled)."""
    import torch

    from weight_sync_bench.model.config import TOY_KV4, init_params

    config = TOY_KV4.replace(name=f"toy_kv4_v{vocab}", vocab=vocab)
    return config, {n: (x * 1.5).to(torch.bfloat16) for n, x in init_params(config, 7).items()}


def test_a_converter_from_the_command_line_passes_and_its_twin_fails_naming_the_heads(
        converters, capsys):
    argv = ["check", "--config", "toy_kv4", "--from", "megatron:4", "--to", "vllm:2"]
    assert main([*argv, "--converter", f"{converters}:megatron_to_vllm"]) == 0
    out = capsys.readouterr().out
    assert "toy_kv4  megatron:4 -> vllm:2" in out and "1 passed, 0 failed" in out
    assert main([*argv, "--converter", f"{converters}:swapped"]) == 1
    out = capsys.readouterr().out
    assert ("first parameter that differs from the declared layout: "
            "model.layers.0.self_attn.qkv_proj.weight") in out
    assert ("rank 0 model.layers.0.self_attn.qkv_proj.weight holds Q heads 4-7, K heads 2-3, "
            "V heads 2-3; declared Q heads 0-3, K heads 0-1, V heads 0-1") in out


def test_a_converter_that_raises_is_the_users_code_and_bad_endpoints_are_bad_input(
        converters, capsys):
    common = ["check", "--config", "toy_kv4", "--converter"]
    assert main([*common, f"{converters}:broken", "--from", "megatron:4", "--to", "vllm:2"]) == 4
    assert "your converter" in capsys.readouterr().err
    assert main([*common, f"{converters}:megatron_to_vllm", "--to", "vllm:2"]) == 2
    assert "--converter needs --from NAME:T and --to NAME:T" in capsys.readouterr().err
    assert main([*common, f"{converters}:megatron_to_vllm", "--from", "megatron:4", "--to",
                 "vllm:2", "--dst", "2"]) == 2
    assert "--src and --dst are degrees of the harness's own convention" in capsys.readouterr().err
    assert main([*common, f"{converters}:megatron_to_vllm", "--from", "tensorrt:4", "--to",
                 "vllm:2"]) == 2
    assert "unknown convention 'tensorrt'" in capsys.readouterr().err
    assert main(["check", "--config", "toy", "--from", "megatron:2", "--to", "vllm:2"]) == 2
    assert "--from and --to are a converter's conventions" in capsys.readouterr().err


def test_over_every_config_a_converter_is_checked_where_both_conventions_store_it(
        converters, capsys):
    # TOY has 2 KV heads: Meta at t=4 rejects it (no KV replication), naming the rule;
    # TOY_KV4 is checked
    assert main(["check", "--converter", f"{converters}:meta_to_vllm", "--from",
                 "meta:4", "--to", "vllm:2"]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 0 failed" in out
    assert "skipped toy: meta: layers.0.attention.wk.weight needs n_kv_heads % t == 0" in out
    assert main(["check", "--config", "toy", "--converter", f"{converters}:meta_to_vllm",
                 "--from", "meta:4", "--to", "vllm:2"]) == 2
    assert "meta: layers.0.attention.wk.weight needs" in capsys.readouterr().err


def small_hf_config(tmp_path, **changes):
    """A Llama config.json of a small geometry (head_dim 8 given, 8 heads, 2 KV heads)."""
    data = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
            "num_hidden_layers": 32, "vocab_size": 32000, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, **changes}
    path = tmp_path / "small" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_a_real_geometry_is_checked_reduced_with_the_floor_measured_for_it(
        tmp_path, converters, tolerance, capsys):
    path = str(small_hf_config(tmp_path))
    model = ["--hf-config", path, "--layers", "1", "--vocab", "256"]
    # no floor covers it: refused, naming the command; --measure-floor measures and caches it
    assert main(["check", *model, "--src", "1", "--dst", "2"]) == 2
    assert (f"`python -m weight_sync_bench.tolerance geometry --hf-config {path} --layers 1 "
            "--vocab 256`") in capsys.readouterr().err
    assert main(["check", *model, "--src", "1", "--dst", "2", "--measure-floor"]) == 0
    out = capsys.readouterr().out
    assert "small   1 -> 2" in out and "1 passed, 0 failed" in out
    assert len(list((tolerance / "geometry").glob("small-1a-fp32-*.json"))) == 1
    # the harness's own invariant and a user's converter read that floor, measuring nothing
    (tmp_path / "wsb_cli_small.py").write_text(textwrap.dedent(f"""
        from weight_sync_bench import ModelConfig, convert
        SMALL = ModelConfig.from_hf_config({path!r}, n_layers=1, vocab=256)

        def hf_to_vllm(shards, degree):
            return convert(shards, "hf", f"vllm:{{degree}}", SMALL)

        def wrong(shards, degree):  # the twin: rank 0's KV replica left at head 1
            out = hf_to_vllm(shards, degree)
            name = "model.layers.0.self_attn.qkv_proj.weight"
            out[0][name], out[3][name] = out[3][name], out[0][name]
            return out
    """))
    argv = ["check", *model, "--from", "hf", "--to", "vllm:4", "--converter"]
    assert main([*argv, "wsb_cli_small:hf_to_vllm"]) == 0  # t=4 > 2 KV heads: replicated
    assert "small   hf:1 -> vllm:4" in capsys.readouterr().out
    assert main([*argv, "wsb_cli_small:wrong"]) == 1
    assert "holds Q heads 6-7, K head 1, V head 1; declared Q heads 0-1, K head 0, V head 0" \
        in capsys.readouterr().out


def test_an_hf_geometry_needs_its_layers_and_reducing_a_committed_config_is_refused(
        tmp_path, capsys):
    path = str(small_hf_config(tmp_path))
    assert main(["check", "--hf-config", path, "--src", "1", "--dst", "2"]) == 2
    assert f"--hf-config {path} needs --layers N" in capsys.readouterr().err
    assert main(["check", "--config", "toy", "--layers", "1"]) == 2
    assert "--layers and --vocab reduce an --hf-config geometry" in capsys.readouterr().err
    assert main(["check", "--hf-config", str(tmp_path / "nope.json"), "--layers", "1"]) == 2
    assert "no such HF config.json" in capsys.readouterr().err
    bad = str(small_hf_config(tmp_path, hidden_act="gelu"))
    assert main(["check", "--hf-config", bad, "--layers", "1"]) == 2
    assert "'hidden_act' is 'gelu'" in capsys.readouterr().err


def test_wsb_layout_of_vllm_states_the_replicated_kv_head_where_t_exceeds_the_kv_heads(capsys):
    assert main(["layout", "--config", "toy", "--convention", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.qkv_proj.weight" in out
    assert "[128, 256] HR(8,2,32)" in out  # t=4: 2 Q heads + a copy of 1 KV head, 4 x 32 rows
    assert "HR(8,2,32): Q heads split; rank r holds replicated KV head r*2/t" in out
    # the twin: at t=2 the 2 KV heads split, nothing is replicated
    assert main(["layout", "--config", "toy", "--convention", "vllm", "--degree", "2"]) == 0
    out = capsys.readouterr().out.split("\nplacements: ")[0]  # the table, not the legend
    assert "[192, 256] HP(8,2,32)" in out and "HR(" not in out and "replicated" not in out


def test_wsb_layout_of_a_degree_the_convention_rejects_names_the_rule(capsys):
    assert main(["layout", "--config", "toy", "--convention", "meta", "--degree", "4"]) == 2
    assert "meta: layers.0.attention.wk.weight needs n_kv_heads % t == 0" in \
        capsys.readouterr().err
    # Megatron at TP 4 over 2 KV heads: raw slices, gathered by the forward (said so)
    assert main(["layout", "--config", "toy", "--convention", "megatron", "--degree", "4"]) == 0
    assert "gathered: the forward all-gathers" in capsys.readouterr().out
    assert main(["layout", "--config", "toy", "--convention", "trt"]) == 2
    assert "unknown convention 'trt'" in capsys.readouterr().err
    assert main(["layout", "--hf-config", "mistral_nemo", "--convention", "meta",
                 "--degree", "8"]) == 0  # a shipped config by name; no parameters are built
    assert "tok_embeddings.weight" in capsys.readouterr().out


def test_a_converter_on_the_users_own_weights_from_the_command_line(tmp_path, monkeypatch,
                                                                    capsys):
    """``--weights DIR``: an HF directory of bf16 weights no seed draws; the geometry its
    config.json states; the converter passes on them and its twin fails (exit 1); flags that
    would judge other weights are refused (exit 2)."""
    from weight_sync_bench.conventions import endpoint, materialize
    from weight_sync_bench.conventions.checkpoint import write_checkpoint

    config, weights = _weights()
    hf = endpoint("hf")
    write_checkpoint(tmp_path / "w", materialize(hf.pieces(config), weights), hf, config)
    (tmp_path / "wsb_cli_weights.py").write_text(WEIGHTS_CONVERTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["check", "--from", "megatron:2", "--to", "vllm:2", "--weights", str(tmp_path / "w")]
    assert main([*base, "--converter", "wsb_cli_weights:megatron_to_vllm"]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 0 failed" in out, out
    assert main([*base, "--converter", "wsb_cli_weights:up_gate"]) == 1
    out = capsys.readouterr().out
    assert "gate_up_proj.weight" in out and "your weights: the threshold" in out, out
    assert main([*base, "--converter", "wsb_cli_weights:megatron_to_vllm", "--dtype",
                 "bf16"]) == 2
    assert "drop --dtype, --stream and --measure-floor" in capsys.readouterr().err


def test_a_converter_on_a_megatron_torch_dist_checkpoint(tmp_path, capsys, monkeypatch):
    """``wsb check --converter ... --weights DIR`` on the trainer's torch_dist checkpoint:
    the geometry from the model options (Megatron's args state sizes, not the whole model;
    without them, exit 2 saying so), checked against the args: ``--hf-config`` (TOY_KV4 with
    a vocabulary of 256, as the weights above) passes the converter and fails the wrong one
    (exit 1); ``--config toy`` is refused naming the args' field that differs."""
    from weight_sync_bench.conventions import endpoint
    from weight_sync_bench.conventions.checkpoint import write_megatron_dist

    config, weights = _weights()
    write_megatron_dist(tmp_path / "m", weights, endpoint("megatron:2"), config)
    hf_config = tmp_path / f"{config.name}.json"
    hf_config.write_text(json.dumps(config.to_hf_config()))
    (tmp_path / "wsb_cli_dist.py").write_text(WEIGHTS_CONVERTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["check", "--from", "megatron:2", "--to", "vllm:2", "--weights", str(tmp_path / "m")]
    model = ["--hf-config", str(hf_config), "--layers", str(config.n_layers), "--vocab",
             str(config.vocab)]
    assert main([*base, "--converter", "wsb_cli_dist:megatron_to_vllm"]) == 2
    assert "give --hf-config PATH or --config NAME (as Megatron-Bridge" in capsys.readouterr().err
    assert main([*base, *model, "--converter", "wsb_cli_dist:megatron_to_vllm"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main([*base, *model, "--converter", "wsb_cli_dist:up_gate"]) == 1
    assert "gate_up_proj.weight" in capsys.readouterr().out
    assert main([*base, "--config", "toy", "--converter", "wsb_cli_dist:megatron_to_vllm"]) == 2
    assert "args say num_query_groups=4, the config checked (toy) has" in capsys.readouterr().err


def test_a_splitter_and_a_resharder_on_an_hf_directory(tmp_path, capsys, monkeypatch):
    """``wsb check --splitter/--resharder ... --weights DIR``: the geometry from the
    directory, the user's function on its weights; the twin (o_proj of two ranks swapped)
    fails naming it; --weights without a function is refused (exit 2)."""
    from weight_sync_bench.conventions import endpoint, materialize
    from weight_sync_bench.conventions.checkpoint import write_checkpoint

    config, weights = _weights()
    hf = endpoint("hf")
    write_checkpoint(tmp_path / "w", materialize(hf.pieces(config), weights), hf, config)
    (tmp_path / "wsb_cli_split.py").write_text(textwrap.dedent("""
        from weight_sync_bench.layout.reshard import reshard, split
        from weight_sync_bench.model.plan import layout_for

        def splitter(full, degree, *, config):
            return split(full, layout_for(config), degree)

        def resharder(shards, degree, *, config):
            return reshard(shards, layout_for(config), degree)

        def swapped(shards, degree, *, config):
            out = reshard(shards, layout_for(config), degree)
            name = "layers.0.o_proj.weight"
            out[0][name], out[1][name] = out[1][name], out[0][name]
            return out
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    w = ["--weights", str(tmp_path / "w")]
    assert main(["check", "--splitter", "wsb_cli_split:splitter", "--dst", "2", *w]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main(["check", "--resharder", "wsb_cli_split:resharder", "--src", "1", "--dst", "2",
                 *w]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main(["check", "--resharder", "wsb_cli_split:swapped", "--src", "1", "--dst", "2",
                 *w]) == 1
    assert "layers.0.o_proj.weight" in capsys.readouterr().out
    assert main(["check", *w]) == 2
    assert "give --converter, --splitter or --resharder" in capsys.readouterr().err


def test_a_quantizing_converter_from_the_command_line(tmp_path, capsys, monkeypatch):
    """``wsb check --converter ... --to vllm:tp=2,fp8=block128``: a geometry with 128-wide
    heads (an HF config.json) passes the correct quantizer and fails its twin (a scale
    transposed); the built-in toy, whose 64-row KV part cannot be cut on 128-blocks, is
    refused with vLLM's rule (exit 2) before the converter runs."""
    import json

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
              "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "wsb_cli_fp8.py").write_text(textwrap.dedent("""
        from weight_sync_bench.conventions.fp8 import fp8_shards
        from weight_sync_bench.conventions.maps import gather_canonical

        def quantize(shards, degree, *, config, source, target):
            full = gather_canonical(shards, source.pieces(config), config.param_shapes())
            return fp8_shards(config, target, full)

        def transposed(shards, degree, *, config, source, target):
            out = quantize(shards, degree, config=config, source=source, target=target)
            name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
            out[0][name] = out[0][name].t().contiguous()
            return out
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["check", "--from", "megatron:2", "--to", "vllm:tp=2,fp8=block128", "--hf-config",
            str(tmp_path / "config.json"), "--layers", "2", "--dtype", "bf16", "--converter"]
    assert main([*base, "wsb_cli_fp8:quantize"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main([*base, "wsb_cli_fp8:transposed"]) == 1
    assert "the declared scale transposed" in capsys.readouterr().out
    assert main(["check", "--config", "toy", "--from", "megatron:2", "--to",
                 "vllm:tp=2,fp8=block128", "--converter", "wsb_cli_fp8:quantize"]) == 2
    assert "128-blocks" in capsys.readouterr().err

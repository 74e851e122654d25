"""Checkpoints on disk (``conventions.checkpoint``, ``check.convert.verify_checkpoint``): every
convention's files written and read back byte for byte, HF's sharded layout as
``save_pretrained`` cuts it, config.json / params.json as the frameworks state the geometry,
and every broken file a typed error naming it. Each detection has its twin: the intact
checkpoint reads and verifies."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from weight_sync_bench import (
    CheckpointError,
    ModelConfig,
    UnsupportedConvention,
    check_convert,
    convert,
    shards_for,
    verify_checkpoint,
)
from weight_sync_bench.check.convert import measure_threshold
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import (
    HF_INDEX,
    HF_SINGLE,
    hf_config_json,
    meta_ffn,
    meta_params,
    read_checkpoint,
    write_checkpoint,
)
from weight_sync_bench.model.config import HF_CONFIGS, shipped_hf_config

# 4 heads, 2 KV heads, head_dim 8 = d_model / n_heads (Meta can state it), ffn 48 != d_model
SMALL = ModelConfig(name="small", vocab=128, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, ffn=48)
QKV = "model.layers.0.self_attn.qkv_proj.weight"
ENDPOINTS = ["hf", "meta:2", "vllm:4", "megatron:2", "plain:2"]


@functools.cache
def threshold() -> float:
    return measure_threshold(SMALL, ENDPOINTS, seeds=range(2))


def emit(tmp_path, where, config=SMALL, **kwargs):
    ep = endpoint(where)
    directory = tmp_path / where.replace(":", "-")
    write_checkpoint(directory, shards_for(config, ep.convention, ep.degree), ep, config, **kwargs)
    return directory


def verify(directory, where, **kwargs):
    return verify_checkpoint(directory, SMALL, where, threshold=threshold(), **kwargs)


@pytest.mark.parametrize("where, files", [
    # a quarter of the model per file: the embedding and lm_head alone, the layer in 3
    ("hf", ["config.json", *(f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)),
            HF_INDEX]),
    ("meta:2", ["consolidated.00.pth", "consolidated.01.pth", "params.json"]),
    ("vllm:4", ["config.json", *(f"model-rank-{r}-part-0.safetensors" for r in range(4))]),
    ("megatron:2", ["config.json", "model-rank-0-part-0.safetensors",
                    "model-rank-1-part-0.safetensors"]),
    ("plain:2", ["config.json", "model-rank-0-part-0.safetensors",
                 "model-rank-1-part-0.safetensors"]),
])
def test_every_convention_is_written_in_its_frameworks_files_and_read_back_byte_for_byte(
        tmp_path, where, files):
    ep = endpoint(where)
    directory = emit(tmp_path, where)
    assert sorted(p.name for p in directory.iterdir()) == sorted(files)  # no temporary left
    read = read_checkpoint(directory, ep, SMALL)
    declared = shards_for(SMALL, ep.convention, ep.degree)
    assert [set(r) for r in read.shards] == [set(d) for d in declared]
    assert all(torch.equal(r[n], d[n]) and r[n].dtype == d[n].dtype
               for r, d in zip(read.shards, declared) for n in d)
    assert verify(directory, where).passed


def test_hf_files_are_cut_as_save_pretrained_cuts_them(tmp_path):
    """``split_state_dict_into_shards_factory``: tensors in order, a new file when the next
    would pass the limit, a tensor larger than the limit alone; one file: no index."""
    hf = endpoint("hf")
    params = shards_for(SMALL, "hf", 1)[0]
    sizes = {n: x.numel() * x.element_size() for n, x in params.items()}
    total = sum(sizes.values())
    single = emit(tmp_path / "a", "hf", max_shard_size=total)
    assert sorted(p.name for p in single.iterdir()) == ["config.json", HF_SINGLE]
    limit = sizes["model.layers.0.mlp.gate_proj.weight"]  # 48 x 32 x 4 bytes
    cut = emit(tmp_path / "b", "hf", max_shard_size=limit)
    index = json.loads((cut / HF_INDEX).read_text())
    assert index["metadata"] == {"total_size": total,
                                 "total_parameters": sum(x.numel() for x in params.values())}
    assert list(index["weight_map"]) == sorted(params)
    by_file: dict[str, list[str]] = {}
    for name in params:  # in the stored order
        by_file.setdefault(index["weight_map"][name], []).append(name)
    assert all(sum(sizes[n] for n in names) <= limit or len(names) == 1
               for names in by_file.values())
    assert by_file[index["weight_map"]["model.embed_tokens.weight"]] == [
        "model.embed_tokens.weight"]  # 128 x 32 x 4 bytes > limit: alone
    # an oversize tensor gets its own file while the open one stays open (the factory appends
    # it at once): lm_head's file comes before that of the final norm, which was open
    assert index["weight_map"]["lm_head.weight"] < index["weight_map"]["model.norm.weight"]
    files = sorted(by_file)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and len(files) > 3
    assert all(load_file(str(cut / f)).keys() == set(names) for f, names in by_file.items())
    assert read_checkpoint(cut, hf, SMALL).shards[0].keys() == params.keys()


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_config_json_is_the_inverse_of_from_hf_config(tmp_path, name):
    config = shipped_hf_config(name, shrink=16, n_layers=1, vocab=512)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_json(config)))
    assert ModelConfig.from_hf_config(path, name=config.name) == config
    assert hf_config_json(config)["architectures"] == (
        ["Qwen2ForCausalLM"] if name == "qwen2_5_7b" else ["LlamaForCausalLM"])


def test_params_json_states_llama_3_8bs_real_ffn_arguments_and_every_ffn():
    llama = shipped_hf_config("llama3_8b", n_layers=1, vocab=512)
    params = meta_params(llama)
    assert (params["multiple_of"], params["ffn_dim_multiplier"]) == (1024, 1.3)  # as shipped
    assert meta_ffn(4096, 1024, 1.3) == 14336
    for ffn in (48, 85, 86, 200, 1000):
        config = SMALL.replace(ffn=ffn)
        p = meta_params(config)
        assert meta_ffn(32, p["multiple_of"], p["ffn_dim_multiplier"]) == ffn
    nemo = shipped_hf_config("mistral_nemo", shrink=16, n_layers=1, vocab=512)
    with pytest.raises(UnsupportedConvention, match=r"^meta: params.json has no head_dim "
                       r"\(Llama's Attention uses dim // n_heads\), so it cannot state "
                       r"head_dim=8 != d_model / n_heads = 320 / 32$"):
        meta_params(nemo)


def test_dtypes_are_written_and_read_as_they_are(tmp_path):
    ep = endpoint("vllm:2")
    shards = [{n: x.to(torch.bfloat16) for n, x in s.items()}
              for s in shards_for(SMALL, "vllm", 2)]
    write_checkpoint(tmp_path / "bf16", shards, ep, SMALL)
    read = read_checkpoint(tmp_path / "bf16", ep, SMALL)
    assert all(x.dtype == torch.bfloat16 and torch.equal(x, shards[r][n])
               for r, s in enumerate(read.shards) for n, x in s.items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # ... and the check compares them exactly: a bf16 checkpoint of an fp32 model is named
    with pytest.raises(CheckpointError, match=r"model-rank-0-part-0.safetensors: vllm:2 rank 0 "
                       r"model.embed_tokens.weight: dtype torch.bfloat16, declared torch.float32"):
        verify(tmp_path / "bf16", "vllm:2")


def test_emit_refuses_a_directory_that_holds_files(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"x: not a new or empty directory"):
        write_checkpoint(tmp_path / "x", shards_for(SMALL, "hf", 1), endpoint("hf"), SMALL)
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["notes.txt"]
    # what the format cannot state is refused before the directory is made
    nemo = shipped_hf_config("mistral_nemo", shrink=16, n_layers=1, vocab=512)
    with pytest.raises(UnsupportedConvention, match=r"^meta: params.json has no head_dim"):
        write_checkpoint(tmp_path / "nemo", shards_for(nemo, "meta", 1), endpoint("meta"), nemo)
    with pytest.raises(CheckpointError, match=r"max_shard_size must be an int >= 1"):
        write_checkpoint(tmp_path / "zero", shards_for(SMALL, "hf", 1), endpoint("hf"), SMALL,
                         max_shard_size=0)
    assert not (tmp_path / "nemo").exists() and not (tmp_path / "zero").exists()


def _rank_file(directory, rank):
    return directory / f"model-rank-{rank}-part-0.safetensors"


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _break_rank_files(kind, d):
    """Each breakage of a vllm:2 checkpoint, and the file the error must name."""
    r1 = _rank_file(d, 1)
    if kind == "truncated":
        _truncate(r1)
        return r1, "not a readable safetensors file, truncated or corrupt"
    if kind == "missing":
        r1.unlink()
        return r1, r"missing \(no model-rank-1-part-\*.safetensors for rank 1 of t=2\)"
    if kind == "misnamed":
        r1.rename(d / "model-rank-01.safetensors")
        return d / "model-rank-01.safetensors", r"not named model-rank-\{rank\}-part-\{part\}"
    if kind == "extra rank":
        _rank_file(d, 2).write_bytes(_rank_file(d, 0).read_bytes())
        return _rank_file(d, 2), r"rank 2, but the checkpoint is checked at t=2"
    params = load_file(str(r1))
    if kind == "missing tensor":
        del params[QKV]
        message = rf"vllm:2 rank 1 is missing {QKV}"
    elif kind == "extra tensor":
        params["lm_head.bias"] = torch.zeros(64)
        message = r"vllm:2 rank 1 has no tensor lm_head.bias"
    else:  # wrong shape
        params[QKV] = params[QKV][:-1].clone()
        message = rf"vllm:2 rank 1 {QKV} has shape \[31, 32\], declared \[32, 32\]"
    save_file(params, str(r1))
    return r1, message


@pytest.mark.parametrize("kind", ["truncated", "missing", "misnamed", "extra rank",
                                  "missing tensor", "extra tensor", "wrong shape"])
def test_a_broken_rank_file_is_a_checkpoint_error_naming_it(tmp_path, kind):
    d = emit(tmp_path, "vllm:2")
    assert verify(d, "vllm:2").passed  # the twin: the intact checkpoint
    path, message = _break_rank_files(kind, d)
    with pytest.raises(CheckpointError, match=message) as info:
        verify(d, "vllm:2")
    assert str(info.value).startswith(str(path)) and info.value.path == str(path)


@pytest.mark.parametrize("kind", ["truncated shard", "missing shard", "misnamed shard",
                                  "tensor in another file", "no config", "wrong config",
                                  "no index"])
def test_a_broken_hf_directory_is_a_checkpoint_error_naming_the_file(tmp_path, kind):
    d = emit(tmp_path, "hf")
    assert verify(d, "hf").passed
    second = d / "model-00002-of-00005.safetensors"
    if kind == "truncated shard":
        _truncate(second)
        path, message = second, "truncated or corrupt"
    elif kind == "missing shard":
        second.unlink()
        path, message = second, r"missing \(model.safetensors.index.json maps \d+ tensors to it\)"
    elif kind == "misnamed shard":
        second.rename(d / "model-2-of-5.safetensors")
        path = d / "model-2-of-5.safetensors"
        message = "a .safetensors file the checkpoint does not name"
    elif kind == "tensor in another file":
        index = json.loads((d / HF_INDEX).read_text())
        moved = next(n for n, f in index["weight_map"].items() if f == second.name)
        index["weight_map"][moved] = "model-00001-of-00005.safetensors"
        (d / HF_INDEX).write_text(json.dumps(index))
        path, message = second, rf"holds {moved}, which model.safetensors.index.json maps to"
    elif kind == "no config":
        (d / "config.json").unlink()
        path, message = d / "config.json", "missing"
    elif kind == "wrong config":
        data = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**data, "num_key_value_heads": 4}))
        path, message = d / "config.json", (r"n_kv_heads is 4, the config checked \(small\) "
                                            r"has 2")
    else:
        (d / HF_INDEX).unlink()
        path, message = d / HF_INDEX, r"index.json: missing \(and no single model.safetensors\)"
    with pytest.raises(CheckpointError, match=message) as info:
        verify(d, "hf")
    assert info.value.path == str(path) and str(path) in str(info.value)


@pytest.mark.parametrize("kind", ["truncated", "missing", "misnamed", "params"])
def test_broken_meta_files_are_a_checkpoint_error_naming_the_file(tmp_path, kind):
    d = emit(tmp_path, "meta:2")
    assert verify(d, "meta:2").passed
    second = d / "consolidated.01.pth"
    if kind == "truncated":
        _truncate(second)
        path, message = second, "not a readable torch checkpoint, truncated or corrupt"
    elif kind == "missing":
        second.unlink()
        path, message = second, r"missing \(meta:2 has one consolidated file per"
    elif kind == "misnamed":
        second.rename(d / "consolidated.1.pth")
        path = d / "consolidated.1.pth"
        message = r"expected consolidated.00.pth .. consolidated.01.pth"
    else:
        data = json.loads((d / "params.json").read_text())
        (d / "params.json").write_text(json.dumps({**data, "dim": 64}))
        path, message = d / "params.json", r"d_model is 64, the config checked \(small\) has 32"
    with pytest.raises(CheckpointError, match=message) as info:
        verify(d, "meta:2")
    assert info.value.path == str(path)


def test_a_mutated_file_fails_the_verdict_naming_the_parameter_and_the_heads(tmp_path):
    d = emit(tmp_path, "vllm:2")
    r1 = _rank_file(d, 1)
    params = load_file(str(r1))
    q_rows = 2 * SMALL.head_dim  # rank 1's two Q heads, then its K head, then its V head
    qkv = params[QKV]
    params[QKV] = torch.cat([qkv[q_rows:q_rows + 8], qkv[8:q_rows], qkv[:8], qkv[q_rows + 8:]])
    save_file(params, str(r1))  # rank 1's rows of Q head 2 and K head 1 exchanged
    verdict = verify(d, "vllm:2")
    assert not verdict.passed and verdict.first_mismatch == QKV and verdict.ratio >= 10
    held, declared = "K head 1, Q head 3, Q head 2, V head 1", "Q heads 2-3, K head 1, V head 1"
    assert verdict.diagnosis == (f"rank 1 {QKV} holds {held}; declared {declared}",)


def test_verify_gives_the_verdict_check_convert_gives_the_same_tensors(tmp_path):
    def swapped(shards, degree):  # a converter with a bug: ranks 0 and 1 exchange qkv_proj
        out = convert(shards, "hf", f"vllm:{degree}", SMALL)
        out[0][QKV], out[1][QKV] = out[1][QKV], out[0][QKV]
        return out
    source = shards_for(SMALL, "hf", 1)
    written = swapped([dict(s) for s in source], 2)
    write_checkpoint(tmp_path / "out", written, endpoint("vllm:2"), SMALL)
    on_disk = verify(tmp_path / "out", "vllm:2", src="hf")
    in_memory = check_convert(swapped, SMALL, "hf", "vllm:2", threshold=threshold())
    assert on_disk == in_memory and not on_disk.passed and on_disk.route == "hf:1 -> vllm:2"


@pytest.mark.parametrize("max_shard_size", [None, 10**9])  # several files with an index; one
def test_hf_weights_assembles_each_canonical_parameter_when_asked_for(tmp_path, monkeypatch,
                                                                      max_shard_size):
    from weight_sync_bench.conventions.checkpoint import LazyTensors, hf_weights
    from weight_sync_bench.model.config import init_params

    directory = emit(tmp_path, "hf", max_shard_size=max_shard_size)
    reads = []
    original = LazyTensors.__getitem__
    monkeypatch.setattr(LazyTensors, "__getitem__",
                        lambda self, name: reads.append(name) or original(self, name))
    weights = hf_weights(directory, endpoint("hf"), SMALL)
    assert "layers.0.qkv.weight" in weights and "layers.9.qkv.weight" not in weights
    assert reads == []  # checked from the headers: nothing read yet, nor by `in`
    full = init_params(SMALL, 0)
    assert torch.equal(weights["layers.0.qkv.weight"], full["layers.0.qkv.weight"])
    assert sorted(reads) == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "kqv"]
    assert all(torch.equal(weights[n], x) for n, x in full.items())
    assert sorted(weights) == sorted(full)


def test_hf_weights_refuses_a_directory_that_is_not_the_geometry(tmp_path):
    from weight_sync_bench.conventions.checkpoint import hf_weights

    directory = emit(tmp_path, "hf", max_shard_size=10**9)
    held = load_file(str(directory / HF_SINGLE))
    held["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(held, str(directory / HF_SINGLE))
    with pytest.raises(CheckpointError, match=r"hf model.layers.0.mlp.down_proj.weight has "
                                              r"shape \[3, 3\], declared \[32, 48\]"):
        hf_weights(directory, endpoint("hf"), SMALL)
    with pytest.raises(CheckpointError, match="reads a Hugging Face directory, not vllm:2"):
        hf_weights(directory, endpoint("vllm:2"), SMALL)


def test_a_file_swapped_for_a_symlink_out_after_the_check_is_refused_when_read(tmp_path):
    """``hf_weights`` reads lazily: each open checks the file again, so a file replaced by a
    symlink leading out of the directory between the check and the read is refused."""
    from weight_sync_bench.conventions.checkpoint import hf_weights
    from weight_sync_bench.errors import UnsafeFile

    directory = emit(tmp_path, "hf", max_shard_size=10**9)
    weights = hf_weights(directory, endpoint("hf"), SMALL)
    outside = tmp_path / "outside.safetensors"
    (directory / HF_SINGLE).rename(outside)
    (directory / HF_SINGLE).symlink_to(outside)
    with pytest.raises(UnsafeFile):
        weights["norm.weight"]

"""How ``conventions.checkpoint`` writes and reads a Hugging Face, Meta or per-rank checkpoint
and checks what it holds (issue 30, the mutation pass over the reading and writing side of
``conventions/checkpoint.py``; its Megatron functions have their own file).

``wsb emit`` writes these files and ``wsb verify`` reads them back; a converter tool's output
is read the same way. The conventions followed: transformers 4.57
``PreTrainedModel.save_pretrained`` and huggingface_hub's
``split_state_dict_into_shards_factory`` (tensors in order, a new file when the next tensor
would pass ``max_shard_size``, a larger tensor alone, ``model-{i:05d}-of-{n:05d}``, the index
``{"metadata": {"total_size", "total_parameters"}, "weight_map"}``, safetensors metadata
``{"format": "pt"}``); Llama's ``params.json`` (``ModelArgs``) and ``FeedForward``'s hidden
size; vLLM's ``ShardedStateLoader`` pattern ``model-rank-{rank}-part-{part}.safetensors``;
Megatron-LM's ``args`` names for the degrees a legacy checkpoint was saved at. What is pinned:
each file's name and bytes, the HF cut against the factory's rule, each geometry field read
back, which built-in geometry a directory is, the fast path of the canonical assembly, and
every refusal's text, type and ``path`` whole, each beside the twin that reads."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from weight_sync_bench import ModelConfig, shards_for
from weight_sync_bench.conventions import checkpoint as K
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.maps import Piece
from weight_sync_bench.errors import CheckpointError, UnsafeFile, UnsupportedConvention
from weight_sync_bench.model.config import CONFIGS, MOE_CONFIGS, TOY, init_params

# 4 heads, 2 KV heads, head_dim 8 = d_model / n_heads (Meta can state it), ffn 48
SMALL = ModelConfig(name="small", vocab=128, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, ffn=48)
TIED = SMALL.replace(name="tied", tie_embeddings=True)
# tests/check/test_fp8_convert.py's TOY_FP8 on one layer: 128-row blocks at TP 2
FP8_CONFIG = ModelConfig(name="fp8", vocab=256, d_model=256, n_layers=1, n_heads=4,
                         n_kv_heads=2, head_dim=128, ffn=512)
INDEX = "model.safetensors.index.json"


def error(call, kind=CheckpointError):
    with pytest.raises(kind) as info:
        call()
    return info.value


def emit(directory: Path, where: str, config: ModelConfig = SMALL, **kwargs) -> Path:
    ep = endpoint(where)
    K.write_checkpoint(directory, shards_for(config, ep.convention, ep.degree), ep, config,
                       **kwargs)
    return directory


def files(root: Path) -> K._Files:
    return K._Files(root, ())


# -- what a layout is, and where a tensor came from


def test_hf_and_meta_are_their_own_layouts_every_other_convention_is_per_rank_files():
    assert [K.layout_of(endpoint(w)) for w in ("hf", "meta:2", "vllm:2", "megatron:2",
                                               "plain:2")] == [
        "hf", "meta", "ranks", "ranks", "ranks"]


def test_a_tensor_no_file_holds_is_named_by_the_directory(tmp_path):
    ck = K.Checkpoint(tmp_path, [{}], [{"a": tmp_path / "f.safetensors"}])
    assert ck.file_of(0, "a") == tmp_path / "f.safetensors"
    assert ck.file_of(0, "b") == tmp_path


# -- writing


def test_emit_refuses_a_file_a_full_directory_a_wrong_rank_count_or_a_bad_shard_size(tmp_path):
    shards = shards_for(SMALL, "hf", 1)
    hf = endpoint("hf")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    for name in ("file", "full"):
        e = error(lambda: K.write_checkpoint(tmp_path / name, shards, hf, SMALL))
        assert str(e) == (f"{tmp_path / name}: not a new or empty directory (emit does not "
                          "mix its files with others)") and e.path == str(tmp_path / name)
    e = error(lambda: K.write_checkpoint(tmp_path / "r", shards, endpoint("vllm:2"), SMALL))
    assert str(e) == "vllm:2: 1 rank dicts to write, expected 2"
    assert e.path == str(tmp_path / "r")
    for bad in (0, -1, True, 1.0, "8"):
        e = error(lambda: K.write_checkpoint(tmp_path / "s", shards, hf, SMALL,
                                             max_shard_size=bad))
        assert str(e) == f"max_shard_size must be an int >= 1 (bytes), got {bad!r}"
        assert e.path == str(tmp_path / "s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]
    # the twins: 1 byte is a size (every tensor alone in its file), an empty directory is new
    (tmp_path / "empty").mkdir()
    written = K.write_checkpoint(tmp_path / "empty", shards, hf, SMALL, max_shard_size=1)
    assert len(written) == 1 + len(shards[0]) + 1  # config.json, one file each, the index


def test_meta_is_params_json_then_one_consolidated_file_per_rank(tmp_path):
    ep = endpoint("meta:2")
    shards = shards_for(SMALL, "meta", 2)
    written = K.write_checkpoint(tmp_path / "m", shards, ep, SMALL)
    names = ["params.json", "consolidated.00.pth", "consolidated.01.pth"]
    assert written == [tmp_path / "m" / n for n in names]
    assert (tmp_path / "m" / "params.json").read_text() == json.dumps(
        K.meta_params(SMALL), indent=2) + "\n"
    for r in range(2):
        loaded = torch.load(tmp_path / "m" / names[1 + r], weights_only=True)
        assert loaded.keys() == shards[r].keys()
        assert all(torch.equal(loaded[n], x) for n, x in shards[r].items())


def test_rank_files_are_config_json_then_vllms_sharded_state_pattern(tmp_path):
    ep = endpoint("vllm:2")
    shards = shards_for(SMALL, "vllm", 2)
    written = K.write_checkpoint(tmp_path / "v", shards, ep, SMALL)
    names = ["config.json", "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    assert written == [tmp_path / "v" / n for n in names]
    assert (tmp_path / "v" / "config.json").read_text() == json.dumps(
        K.hf_config_json(SMALL), indent=2, sort_keys=True) + "\n"
    for r in range(2):
        with safe_open(str(tmp_path / "v" / names[1 + r]), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert set(f.keys()) == set(shards[r])


def test_config_json_states_the_dtype_the_weights_are_written_in(tmp_path):
    for where, dtype, said in (("vllm:2", torch.bfloat16, "bfloat16"),
                               ("hf", torch.float16, "float16")):
        ep = endpoint(where)
        shards = [{n: x.to(dtype) for n, x in s.items()}
                  for s in shards_for(SMALL, ep.convention, ep.degree)]
        out = tmp_path / where.replace(":", "-")
        K.write_checkpoint(out, shards, ep, SMALL)
        assert json.loads((out / "config.json").read_text()) == {
            **K.hf_config_json(SMALL), "torch_dtype": said}


def test_an_fp8_checkpoint_states_its_quantization_config(tmp_path):
    from weight_sync_bench.conventions.fp8 import fp8_shards, quantization_config, scheme_of

    for where in ("vllm:tp=2,fp8=block128", "hf:fp8=tensor"):
        ep = endpoint(where)
        shards = fp8_shards(FP8_CONFIG, ep, init_params(FP8_CONFIG, 0))
        out = tmp_path / where.replace(":", "-")
        K.write_checkpoint(out, shards, ep, FP8_CONFIG)
        stated = json.loads((out / "config.json").read_text())
        assert stated == {**K.hf_config_json(FP8_CONFIG),
                          "quantization_config": quantization_config(scheme_of(ep))}
        assert ("weight_block_size" in stated["quantization_config"]) == where.endswith("128")
        assert K.read_checkpoint(out, ep, FP8_CONFIG).shards[0].keys() == shards[0].keys()


def _bytes(sizes):
    """uint8 tensors of the given byte sizes, in order: a..."""
    return {chr(97 + i): torch.arange(n, dtype=torch.uint8) for i, n in enumerate(sizes)}


def test_hf_files_are_cut_by_the_factorys_rule_at_a_quarter_of_the_model(tmp_path):
    """13 bytes: the limit is ceil(13 / 4) = 4. a (3) opens a file; b (2) would pass 4: a new
    file; c (2) fills it to 4 exactly (not past: it stays); d (1) would pass: a new file; e (5)
    is over the limit: alone, at once, while d's file stays open and is closed last."""
    params = _bytes([3, 2, 2, 1, 5])
    out = tmp_path / "hf"
    out.mkdir()
    written = K._write_hf(out, params, {"x": 1, "b": [2]}, None)
    shard = "model-{:05d}-of-00004.safetensors"
    assert [p.name for p in written] == ["config.json", *(shard.format(i) for i in range(1, 5)),
                                         INDEX]
    assert (out / "config.json").read_text() == '{\n  "b": [\n    2\n  ],\n  "x": 1\n}\n'
    groups = [sorted(load_file(str(out / shard.format(i)))) for i in range(1, 5)]
    assert groups == [["a"], ["b", "c"], ["e"], ["d"]]
    index = {"metadata": {"total_parameters": 13, "total_size": 13},
             "weight_map": {"a": shard.format(1), "b": shard.format(2), "c": shard.format(2),
                            "d": shard.format(4), "e": shard.format(3)}}
    assert (out / INDEX).read_text() == json.dumps(index, indent=2, sort_keys=True) + "\n"
    for i in range(1, 5):
        with safe_open(str(out / shard.format(i)), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(torch.equal(f.get_tensor(n), params[n]) for n in f.keys())


def test_the_index_counts_parameters_and_bytes_apart(tmp_path):
    params = {"a": torch.zeros(3, dtype=torch.float32), "b": torch.zeros(5, dtype=torch.bfloat16)}
    out = tmp_path / "hf"
    out.mkdir()
    K._write_hf(out, params, {}, 12)  # a is 12 bytes, b 10: two files
    index = json.loads((out / INDEX).read_text())
    assert index["metadata"] == {"total_parameters": 8, "total_size": 22}
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors",
                                   "b": "model-00002-of-00002.safetensors"}


def test_one_file_holds_everything_at_or_over_the_models_size_and_has_no_index(tmp_path):
    params = _bytes([3, 2, 2, 1, 5])
    for limit, where in ((13, "at"), (100, "over")):
        out = tmp_path / where
        out.mkdir()
        written = K._write_hf(out, params, {}, limit)
        assert [p.name for p in written] == ["config.json", "model.safetensors"]
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == list("abcde")
    # the twin: one byte under the model's size, two files
    out = tmp_path / "under"
    out.mkdir()
    assert len(K._write_hf(out, params, {}, 12)) == 4
    # a one-byte model's default limit is 1 byte (ceil(1 / 4), at least 1): one file
    out = tmp_path / "tiny"
    out.mkdir()
    assert [p.name for p in K._write_hf(out, {"a": torch.zeros(1, dtype=torch.uint8)}, {},
                                        None)] == ["config.json", "model.safetensors"]
    # a two-byte model's is 1 byte too (ceil(2 / 4)): each tensor in its own file
    out = tmp_path / "two"
    out.mkdir()
    assert [p.name for p in K._write_hf(out, _bytes([1, 1]), {}, None)] == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        INDEX]


def test_config_json_states_the_geometry_the_dtype_and_the_name():
    assert K.hf_config_json(SMALL) == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 48, "num_hidden_layers": 1, "vocab_size": 128,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "mlp_bias": False,
        "torch_dtype": "float32", "_name_or_path": "small"}
    assert K.hf_config_json(SMALL, torch.bfloat16)["torch_dtype"] == "bfloat16"
    e = error(lambda: K.hf_config_json(SMALL.replace(o_bias=True)), UnsupportedConvention)
    assert str(e) == ("hf: config.json cannot state it: small: o_bias without qkv_bias has no "
                      "HF config field (attention_bias biases q, k, v and o_proj)")
    assert e.__cause__ is None and e.__suppress_context__


def test_metas_ffn_is_llamas_feedforward_rule():
    """``llama/model.py::FeedForward``: ``hidden_dim = int(2 * hidden_dim / 3)``, times
    ``ffn_dim_multiplier`` if given, rounded up to ``multiple_of``; the shipped models."""
    assert K.meta_ffn(4096, 256, None) == 11008  # Llama 2 7B
    assert K.meta_ffn(5120, 256, None) == 13824  # Llama 2 13B
    assert K.meta_ffn(8192, 4096, 1.3) == 28672  # Llama 2 70B
    assert K.meta_ffn(4096, 1024, 1.3) == 14336  # Llama 3 8B
    assert K.meta_ffn(3, 1, None) == 8  # int(24 / 3): exact, no rounding
    assert K.meta_ffn(3, 3, None) == 9  # 8 rounded up to a multiple of 3
    assert K.meta_ffn(3, 8, 0.99) == 8  # int(0.99 * 8) = 7, rounded up to 8
    assert K.meta_ffn(3, 1, 0.99) == 7


@pytest.mark.parametrize("ffn, choice", [
    (1024, (1024, None)),  # int(2 * 4 * 32 / 3) = 85, rounded up to 1024
    (2048, (1024, 2048 / 85)),  # neither 1024 nor 1.3 x 85 = 110 rounds to 2048: ffn / 85
    (256, (256, None)),  # 85 rounds to 1024 under 1024's multiples, to 256 under 256's
    (110, (110, None)),  # ffn itself as multiple_of
    (85, (85, None)),
])
def test_params_json_is_llamas_modelargs_with_the_first_ffn_arguments_that_give_ffn(ffn, choice):
    config = SMALL.replace(ffn=ffn, rope_theta=500000.0, norm_eps=1e-6)
    assert K.meta_params(config) == {
        "dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128,
        "multiple_of": choice[0], "ffn_dim_multiplier": choice[1], "norm_eps": 1e-6,
        "rope_theta": 500000.0}


def test_params_json_tries_256_before_ffn_itself_and_1_3_before_ffn_over_the_base():
    # d 128: int(2 * 512 / 3) = 341; 256's multiples give 512, as ffn itself (512) would
    wide = SMALL.replace(d_model=128, head_dim=32, ffn=512)
    assert (K.meta_params(wide)["multiple_of"], K.meta_params(wide)["ffn_dim_multiplier"]) == (
        256, None)
    # Llama 3 8B's sizes: 1.3 x 10922 = 14198 -> 14336 under 1024's multiples, as would
    # 14336 / 10922
    llama = SMALL.replace(d_model=4096, head_dim=1024, ffn=14336)
    assert (K.meta_params(llama)["multiple_of"], K.meta_params(llama)["ffn_dim_multiplier"]) == (
        1024, 1.3)


def test_params_json_cannot_state_a_head_dim_other_than_dim_over_heads():
    e = error(lambda: K.meta_params(SMALL.replace(head_dim=16)), UnsupportedConvention)
    assert str(e) == ("meta: params.json has no head_dim (Llama's Attention uses dim // "
                      "n_heads), so it cannot state head_dim=16 != d_model / n_heads = 32 / 4")


def test_the_stated_dtype_is_the_first_tensors_or_float32_when_there_is_none():
    assert K._dtype([]) == torch.float32
    assert K._dtype([{}]) == torch.float32
    assert K._dtype([{"a": torch.zeros(1, dtype=torch.bfloat16),
                      "b": torch.zeros(1)}, {"c": torch.zeros(1, dtype=torch.float16)}]) \
        == torch.bfloat16


def test_the_umask_is_read_from_proc_without_setting_it(monkeypatch):
    calls = []
    real = os.umask
    old = real(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda m: calls.append(m) or real(m))
        assert K._umask() == 0o027 and calls == []
    finally:
        monkeypatch.undo()
        os.umask(old)


@pytest.mark.parametrize("status", [None, "Name:\tpython\n", "Umask:\tzz\n"])
def test_without_proc_the_umask_is_set_and_restored(monkeypatch, status):
    import io

    def fake_open(path, *args, **kwargs):
        assert path == "/proc/self/status"
        if status is None:
            raise FileNotFoundError(path)
        return io.StringIO(status)

    old = os.umask(0o027)
    try:
        monkeypatch.setattr(K, "open", fake_open, raising=False)
        assert K._umask() == 0o027
        assert os.umask(0o027) == 0o027  # restored as it was
    finally:
        os.umask(old)


def test_a_text_file_ends_with_a_newline_and_tensors_are_stored_as_their_own(tmp_path):
    assert K._write_text(tmp_path / "t", "abc") == tmp_path / "t"
    assert (tmp_path / "t").read_text() == "abc\n"
    big = torch.arange(64.0, requires_grad=True)
    view = big[8:12]  # a view of a larger storage, needing grad
    t = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    assert K._write_torch(tmp_path / "p.pth", {"v": view}) == tmp_path / "p.pth"
    loaded = torch.load(tmp_path / "p.pth", weights_only=True)
    assert torch.equal(loaded["v"], torch.arange(8.0, 12.0)) and not loaded["v"].requires_grad
    assert loaded["v"].untyped_storage().nbytes() == 16  # the view alone, not the 64 floats
    assert K._write_safetensors(tmp_path / "s.safetensors", {"t": t, "v": view}) == \
        tmp_path / "s.safetensors"
    got = load_file(str(tmp_path / "s.safetensors"))
    assert torch.equal(got["t"], t) and torch.equal(got["v"], torch.arange(8.0, 12.0))


# -- reading: the directory, and its config.json / params.json


def test_a_directory_that_is_not_there_is_named_by_each_reader(tmp_path):
    gone = tmp_path / "gone"
    (tmp_path / "file").write_text("x")
    for d in (gone, tmp_path / "file"):
        for call, said in (
                (lambda: K.read_checkpoint(d, endpoint("hf"), SMALL), "no such checkpoint "
                                                                       "directory"),
                (lambda: K.read_rank_dumps(d, endpoint("vllm:2")), "no such directory of rank "
                                                                   "dumps"),
                (lambda: K.hf_weights(d, endpoint("hf"), SMALL), "no such checkpoint directory"),
                (lambda: K.checkpoint_geometry(d, endpoint("hf")), "no such checkpoint "
                                                                    "directory")):
            e = error(call)
            assert str(e) == f"{d}: {said}" and e.path == str(d)


def test_hf_weights_reads_only_a_hugging_face_directory(tmp_path):
    d = emit(tmp_path / "v", "vllm:2")
    for where in ("vllm:2", "meta:2"):
        e = error(lambda: K.hf_weights(d, endpoint(where), SMALL))
        assert str(e) == f"{d}: hf_weights reads a Hugging Face directory, not {where}"
        assert e.path == str(d)


def test_a_config_json_that_is_not_an_object_or_not_a_geometry_is_named(tmp_path):
    d = emit(tmp_path / "hf", "hf")
    path = d / "config.json"
    path.write_text("[1, 2]")
    e = error(lambda: K.read_checkpoint(d, endpoint("hf"), SMALL))
    assert str(e) == f"{path}: an HF config is a JSON object, got list" and e.path == str(path)
    # ModelConfig's refusal, named by the config checked (read_checkpoint) or by the name the
    # file states (checkpoint_geometry, which has no config)
    path.write_text(json.dumps({**K.hf_config_json(SMALL), "num_attention_heads": 3,
                                "_name_or_path": "elsewhere"}))
    rule = ("HF config fields 'num_attention_heads' and 'num_key_value_heads': GQA needs "
            "num_attention_heads % num_key_value_heads == 0 (num_attention_heads=3, "
            "num_key_value_heads=2)")
    e = error(lambda: K.read_checkpoint(d, endpoint("hf"), SMALL))
    assert str(e) == f"{path}: small: {rule}" and e.path == str(path)
    e = error(lambda: K.checkpoint_geometry(d, endpoint("hf")))
    assert str(e) == f"{path}: elsewhere: {rule}" and e.path == str(path)
    assert e.__cause__ is None


def test_the_geometry_of_a_config_json_is_named_by_name_or_path_else_the_directory(tmp_path):
    d = emit(tmp_path / "mine", "hf", SMALL.replace(name="given"))
    path = d / "config.json"
    stated = json.loads(path.read_text())
    assert K._hf_geometry(files(d), None) == SMALL.replace(name="given")
    assert K._hf_geometry(files(d), "other").name == "other"
    for name in ("  ", 5, None):
        path.write_text(json.dumps({**stated, "_name_or_path": name}))
        assert K._hf_geometry(files(d), None) == SMALL.replace(name="mine")
    del stated["_name_or_path"]
    path.write_text(json.dumps(stated))
    assert K._hf_geometry(files(d), None).name == "mine"
    assert K._read_hf_config(files(d), SMALL) == {f: getattr(SMALL, f) for f in K.GEOMETRY}


def test_a_config_json_that_disagrees_names_the_first_field_and_both_values(tmp_path):
    d = emit(tmp_path / "hf", "hf")
    path = d / "config.json"
    path.write_text(json.dumps({**K.hf_config_json(SMALL), "num_key_value_heads": 4,
                                "rope_theta": 5.0}))
    e = error(lambda: K.read_checkpoint(d, endpoint("hf"), SMALL))
    assert str(e) == f"{path}: n_kv_heads is 4, the config checked (small) has 2"
    assert e.path == str(path)
    e = error(lambda: K._check_geometry(path, {"d_model": 32, "rope_theta": 5.0}, SMALL))
    assert str(e) == f"{path}: rope_theta is 5.0, the config checked (small) has 10000.0"
    K._check_geometry(path, {"d_model": 32, "rope_theta": 10000.0}, SMALL)  # the twin


def test_rank_files_are_held_to_a_config_json_beside_them_and_read_without_one(tmp_path):
    d = emit(tmp_path / "v", "vllm:2")
    (d / "config.json").write_text(json.dumps({**K.hf_config_json(SMALL), "vocab_size": 64}))
    e = error(lambda: K.read_checkpoint(d, endpoint("vllm:2"), SMALL))
    assert str(e) == f"{d / 'config.json'}: vocab is 64, the config checked (small) has 128"
    (d / "config.json").unlink()
    assert len(K.read_checkpoint(d, endpoint("vllm:2"), SMALL).shards) == 2  # a tool wrote none
    (d / "config.json").symlink_to(tmp_path / "nowhere.json")  # a link is looked at, dangling
    e = error(lambda: K.read_checkpoint(d, endpoint("vllm:2"), SMALL), (CheckpointError,
                                                                          UnsafeFile))
    assert str(d / "config.json") in str(e)


def _params_json(d: Path, **change):
    path = d / "params.json"
    data = {**json.loads(path.read_text()), **change}
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not ...}))
    return path


def test_params_json_is_read_as_llamas_modelargs(tmp_path):
    d = emit(tmp_path / "m", "meta:2")
    want = {"vocab": 128, "d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
            "head_dim": 8, "ffn": 48, "norm_eps": 1e-05, "rope_theta": 10000.0}
    got = K._read_meta_params(files(d))
    assert got == want and [type(v) for v in got.values()] == [type(v) for v in want.values()]
    # ModelArgs' defaults: n_kv_heads None (absent, null or 0) is n_heads; rope_theta 10000;
    # no ffn_dim_multiplier
    _params_json(d, n_kv_heads=..., rope_theta=..., ffn_dim_multiplier=..., multiple_of=256,
                 dim="32", norm_eps="1e-6")
    assert K._read_meta_params(files(d)) == {**want, "n_kv_heads": 4, "ffn": 256,
                                             "norm_eps": 1e-6}
    for kv in (None, 0):
        _params_json(d, n_kv_heads=kv)
        assert K._read_meta_params(files(d))["n_kv_heads"] == 4
    _params_json(d, n_kv_heads=1, rope_theta=3, ffn_dim_multiplier=1.3, n_layers=2.0)
    assert K._read_meta_params(files(d)) == {**want, "n_kv_heads": 1, "ffn": 256,
                                             "norm_eps": 1e-6, "rope_theta": 3.0,
                                             "n_layers": 2}


@pytest.mark.parametrize("change, said", [
    ({"dim": ...}, "KeyError: 'dim'"),
    ({"n_heads": ...}, "KeyError: 'n_heads'"),
    ({"vocab_size": ...}, "KeyError: 'vocab_size'"),
    ({"n_layers": ...}, "KeyError: 'n_layers'"),
    ({"multiple_of": ...}, "KeyError: 'multiple_of'"),
    ({"norm_eps": ...}, "KeyError: 'norm_eps'"),
    ({"n_heads": 0}, "ZeroDivisionError: integer division or modulo by zero"),
    ({"dim": "wide"}, "ValueError: invalid literal for int() with base 10: 'wide'"),
    ({"rope_theta": [1]}, "TypeError: float() argument must be a string or a real number, "
                          "not 'list'"),
])
def test_a_params_json_that_is_not_llamas_is_named_with_why(tmp_path, change, said):
    d = emit(tmp_path / "m", "meta:2")
    path = _params_json(d, **change)
    e = error(lambda: K.read_checkpoint(d, endpoint("meta:2"), SMALL))
    assert str(e) == f"{path}: not a Llama params.json ({said})" and e.path == str(path)
    assert e.__cause__ is None and e.__suppress_context__


def test_a_params_json_that_is_not_an_object_is_named(tmp_path):
    d = emit(tmp_path / "m", "meta:2")
    (d / "params.json").write_text("[]")
    e = error(lambda: K._read_meta_params(files(d)))
    assert str(e) == (f"{d / 'params.json'}: not a Llama params.json (TypeError: a JSON "
                      "object expected, got list)")


# -- which geometry a directory states


def test_a_built_in_geometry_is_found_by_its_sizes_whatever_the_directory_says(tmp_path):
    # toy_moe_ds's DeepSeek routing has no HF config field: the other three
    for config in (*CONFIGS.values(), MOE_CONFIGS["toy_moe"]):
        hf = tmp_path / f"{config.name}-hf"
        hf.mkdir()
        stated = {**K.hf_config_json(config), "_name_or_path": "elsewhere"}
        (hf / "config.json").write_text(json.dumps(stated))
        assert K.checkpoint_geometry(hf, endpoint("hf")) is (CONFIGS | MOE_CONFIGS)[config.name]
        assert K.checkpoint_geometry(hf, endpoint("vllm:2")) is (
            CONFIGS | MOE_CONFIGS)[config.name]
    meta = tmp_path / "toy-meta"
    meta.mkdir()
    (meta / "params.json").write_text(json.dumps(K.meta_params(TOY)))
    assert K.checkpoint_geometry(meta, endpoint("meta:2")) is TOY


def test_another_geometry_is_named_by_its_config_json_or_its_directory(tmp_path):
    d = emit(tmp_path / "dir", "hf", SMALL.replace(name="stated"))
    assert K.checkpoint_geometry(d, endpoint("hf")) == SMALL.replace(name="stated")
    m = emit(tmp_path / "mdir", "meta:2")
    assert K.checkpoint_geometry(m, endpoint("meta:2")) == SMALL.replace(name="mdir")
    # a geometry ModelConfig refuses: named as the params.json's
    _params_json(m, n_heads=3, dim=33)
    e = error(lambda: K.checkpoint_geometry(m, endpoint("meta:2")))
    assert str(e).startswith(f"{m / 'params.json'}: states no geometry the harness can check (")
    assert e.path == str(m / "params.json") and e.__cause__ is None
    # a config.json that is missing is named
    (d / "config.json").unlink()
    e = error(lambda: K.checkpoint_geometry(d, endpoint("hf")))
    assert str(e) == f"{d / 'config.json'}: missing"


# -- an HF directory's files


def _cut(tmp_path, name="cut"):
    """SMALL's HF directory cut into files of at most gate_proj's 6144 bytes (nine: the
    second holds the input norm and q_proj), and its index."""
    d = emit(tmp_path / name, "hf", max_shard_size=6144)
    return d, json.loads((d / INDEX).read_text())["weight_map"]


def test_an_hf_directory_reads_as_one_rank_each_tensor_named_by_its_file(tmp_path):
    d, weight_map = _cut(tmp_path)
    ck = K.read_checkpoint(d, endpoint("hf"), SMALL)
    declared = shards_for(SMALL, "hf", 1)[0]
    assert len(ck.shards) == 1 and ck.shards[0].keys() == declared.keys()
    assert all(torch.equal(ck.shards[0][n], x) for n, x in declared.items())
    assert ck.files == [{n: d / f for n, f in weight_map.items()}] and ck.directory == d
    shards, where = K._read_hf(files(d), lazy=True)
    (lazy,) = shards
    assert isinstance(lazy, K.LazyTensors) and lazy.where == weight_map
    assert where == [{n: d / f for n, f in weight_map.items()}]
    assert torch.equal(lazy["lm_head.weight"], declared["lm_head.weight"])
    # one file: no index
    one = emit(tmp_path / "one", "hf", max_shard_size=10**9)
    ck = K.read_checkpoint(one, endpoint("hf"), SMALL)
    assert ck.files == [dict.fromkeys(declared, one / "model.safetensors")]
    (lazy,), where = K._read_hf(files(one), lazy=True)
    assert lazy.where == dict.fromkeys(declared, "model.safetensors")
    assert where == [dict.fromkeys(declared, one / "model.safetensors")]
    assert torch.equal(lazy["model.norm.weight"], declared["model.norm.weight"])


def test_an_hf_directory_without_its_weights_is_named_by_its_index(tmp_path):
    d = emit(tmp_path / "one", "hf", max_shard_size=10**9)
    (d / "model.safetensors").unlink()
    e = error(lambda: K._read_hf(files(d)))
    assert str(e) == f"{d / INDEX}: missing (and no single model.safetensors)"
    assert e.path == str(d / INDEX)
    # a dangling link under either name is looked at, not taken for no file
    (d / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    e = error(lambda: K._read_hf(files(d)), (CheckpointError, UnsafeFile))
    assert "index.json: missing (and no single" not in str(e)
    (d / "model.safetensors").unlink()
    (d / INDEX).symlink_to(tmp_path / "gone.json")
    e = error(lambda: K._read_hf(files(d)), (CheckpointError, UnsafeFile))
    assert "(and no single" not in str(e)


def test_a_single_file_beside_another_safetensors_file_is_refused(tmp_path):
    d = emit(tmp_path / "one", "hf", max_shard_size=10**9)
    save_file({"x": torch.zeros(1)}, str(d / "extra.safetensors"))
    for lazy in (False, True):
        e = error(lambda: K._read_hf(files(d), lazy=lazy))
        assert str(e) == (f"{d / 'extra.safetensors'}: a .safetensors file the checkpoint does "
                          "not name (expected model.safetensors)")
        assert e.path == str(d / "extra.safetensors")


@pytest.mark.parametrize("index", [[], {"weight_map": []}, {"weight_map": {"a": 1}},
                                   {"metadata": {}}, "x"])
def test_an_index_without_a_map_of_names_to_files_is_named(tmp_path, index):
    d, _ = _cut(tmp_path)
    (d / INDEX).write_text(json.dumps(index))
    for lazy in (False, True):
        e = error(lambda: K._read_hf(files(d), lazy=lazy))
        assert str(e) == f"{d / INDEX}: no weight_map of tensor name -> file name"
        assert e.path == str(d / INDEX)


def test_a_file_of_the_index_missing_is_named_with_how_many_tensors_it_holds(tmp_path):
    d, weight_map = _cut(tmp_path)
    gone = "model-00002-of-00009.safetensors"
    n = sum(v == gone for v in weight_map.values())
    (d / gone).unlink()
    for lazy in (False, True):
        e = error(lambda: K._read_hf(files(d), lazy=lazy))
        assert str(e) == f"{d / gone}: missing ({INDEX} maps {n} tensors to it)"
        assert e.path == str(d / gone)


def test_an_index_entry_leading_out_refuses_the_directory_before_any_file_is_read(tmp_path):
    d, weight_map = _cut(tmp_path)
    outside = tmp_path / "outside.safetensors"
    save_file({"lm_head.weight": torch.zeros(1)}, str(outside))
    (d / "model-00002-of-00009.safetensors").unlink()  # would be "missing", were it looked at
    name = "../outside.safetensors"
    (d / INDEX).write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": name}}))
    for lazy in (False, True):
        e = error(lambda: K._read_hf(files(d), lazy=lazy), UnsafeFile)
        assert f"({INDEX} maps 1 tensors to it)" in str(e)


def test_a_safetensors_file_the_index_does_not_name_is_refused(tmp_path):
    d, weight_map = _cut(tmp_path)
    save_file({"x": torch.zeros(1)}, str(d / "zz.safetensors"))
    names = sorted(set(weight_map.values()))
    e = error(lambda: K._read_hf(files(d)))
    assert str(e) == (f"{d / 'zz.safetensors'}: a .safetensors file the checkpoint does not "
                      f"name (expected one of the files {INDEX} names: {', '.join(names)})")


def test_a_tensor_in_another_file_than_the_index_says_or_missing_from_its_file_is_named(
        tmp_path):
    d, weight_map = _cut(tmp_path)
    first, second = "model-00001-of-00009.safetensors", "model-00002-of-00009.safetensors"
    moved = next(n for n, f in weight_map.items() if f == second)
    for lazy in (False, True):
        (d / INDEX).write_text(json.dumps({"weight_map": {**weight_map, moved: first}}))
        e = error(lambda: K._read_hf(files(d), lazy=lazy))
        assert str(e) == f"{d / second}: holds {moved}, which {INDEX} maps to '{first}'"
        assert e.path == str(d / second)
        unmapped = {n: f for n, f in weight_map.items() if n != moved}
        (d / INDEX).write_text(json.dumps({"weight_map": unmapped}))
        e = error(lambda: K._read_hf(files(d), lazy=lazy))
        assert str(e) == f"{d / second}: holds {moved}, which {INDEX} maps to None"
        (d / INDEX).write_text(json.dumps({"weight_map": {**weight_map, "extra.weight": first}}))
        e = error(lambda: K._read_hf(files(d), lazy=lazy))
        assert str(e) == f"{d / first}: has no extra.weight ({INDEX} maps it there)"
        assert e.path == str(d / first)


def test_hf_weights_names_a_declared_tensor_missing_or_of_the_wrong_shape(tmp_path):
    d = emit(tmp_path / "one", "hf", max_shard_size=10**9)
    path = d / "model.safetensors"
    held = load_file(str(path))
    save_file({n: x for n, x in held.items() if n != "model.norm.weight"}, str(path))
    e = error(lambda: K.hf_weights(d, endpoint("hf"), SMALL))
    assert str(e) == f"{d}: hf is missing model.norm.weight" and e.path == str(d)
    save_file({**held, "model.norm.weight": torch.zeros(3, 3)}, str(path))
    e = error(lambda: K.hf_weights(d, endpoint("hf"), SMALL))
    assert str(e) == f"{path}: hf model.norm.weight has shape [3, 3], declared [32]"
    assert e.path == str(path)
    save_file(held, str(path))
    (d / "config.json").write_text(json.dumps({**K.hf_config_json(SMALL), "vocab_size": 64}))
    e = error(lambda: K.hf_weights(d, endpoint("hf"), SMALL))
    assert str(e) == f"{d / 'config.json'}: vocab is 64, the config checked (small) has 128"


# -- Meta's consolidated files


def test_meta_reads_one_consolidated_file_per_rank_in_rank_order(tmp_path):
    d = emit(tmp_path / "m", "meta:2")
    shards, where = K._read_meta(files(d), 2)
    declared = shards_for(SMALL, "meta", 2)
    assert [s.keys() for s in shards] == [s.keys() for s in declared]
    assert all(torch.equal(shards[r][n], x) for r in range(2) for n, x in declared[r].items())
    assert where == [dict.fromkeys(declared[r], d / f"consolidated.0{r}.pth") for r in range(2)]


def test_a_consolidated_file_missing_stray_or_not_tensors_is_named(tmp_path, monkeypatch):
    d = emit(tmp_path / "m", "meta:2")
    second = d / "consolidated.01.pth"
    saved = second.read_bytes()
    second.rename(d / "consolidated.1.pth")
    e = error(lambda: K._read_meta(files(d), 2))
    assert str(e) == (f"{d / 'consolidated.1.pth'}: a .pth file the checkpoint does not name "
                      "(expected consolidated.00.pth .. consolidated.01.pth, one per rank at "
                      "t=2)")
    (d / "consolidated.1.pth").unlink()
    e = error(lambda: K._read_meta(files(d), 2))
    assert str(e) == (f"{second}: missing (meta:2 has one consolidated file per model-parallel "
                      "rank)") and e.path == str(second)
    for bad in ([torch.zeros(1)], {1: torch.zeros(1)}, {"a": 1}, {"a": torch.zeros(1), "b": 2}):
        torch.save(bad, second)
        e = error(lambda: K._read_meta(files(d), 2))
        assert str(e) == f"{second}: not a dict of tensor name -> tensor"
        assert e.path == str(second)
    second.write_bytes(saved)
    assert len(K._read_meta(files(d), 2)[0]) == 2  # the twin

    def gone(*args, **kwargs):  # removed between the check and the load
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(torch, "load", gone)
    e = error(lambda: K._read_meta(files(d), 2))
    assert str(e) == (f"{d / 'consolidated.00.pth'}: missing (meta:2 has one consolidated file "
                      "per model-parallel rank)") and e.path == str(d / "consolidated.00.pth")
    assert e.__cause__ is None and e.__suppress_context__


class _Evil:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_consolidated_file_that_is_a_pickle_or_truncated_is_refused_naming_it(tmp_path):
    d = emit(tmp_path / "m", "meta:1")
    path = d / "consolidated.00.pth"
    saved = path.read_bytes()
    torch.save({"a": _Evil()}, path)
    e = error(lambda: K._read_meta(files(d), 1))
    assert str(e) == (f"{path}: refused, its pickle holds more than tensors, which the "
                      "harness never loads (Unsupported global: GLOBAL print)")
    assert e.path == str(path) and e.__cause__ is None
    for cut, said in ((saved[:len(saved) // 2], "OSError: [Errno 22] Invalid argument"),
                      (b"", "EOFError: EOFError"),
                      (b"PK\x03\x04garbage", "RuntimeError: PytorchStreamReader failed reading "
                                              "zip archive: not a ZIP archive")):
        path.write_bytes(cut)
        e = error(lambda: K._read_meta(files(d), 1))
        assert str(e).startswith(f"{path}: not a readable torch checkpoint, truncated or "
                                 f"corrupt ({said}")
        assert e.path == str(path) and e.__cause__ is None


# -- rank dumps, read lazily


def test_rank_dumps_are_each_ranks_tensors_read_when_asked(tmp_path):
    d = emit(tmp_path / "v", "vllm:2")
    declared = shards_for(SMALL, "vllm", 2)
    dumps = K.read_rank_dumps(d, endpoint("vllm:2"))
    assert [type(x) for x in dumps] == [K.LazyTensors] * 2
    assert [set(x) for x in dumps] == [set(s) for s in declared]
    assert torch.equal(dumps[1]["lm_head.weight"], declared[1]["lm_head.weight"])
    (d / "model-rank-1-part-0.safetensors").unlink()
    assert [len(x) for x in K.read_rank_dumps(d, endpoint("vllm:2"), ranks=[0])] == [
        len(declared[0]), 0]
    e = error(lambda: K.read_rank_dumps(d, endpoint("vllm:2"), ranks=[1]))
    assert str(e).startswith(f"{d / 'model-rank-1-part-0.safetensors'}: missing")
    e = error(lambda: K.read_rank_dumps(d, endpoint("vllm:2")))
    assert str(e).startswith(f"{d / 'model-rank-1-part-0.safetensors'}: missing")
    outside = tmp_path / "out"
    outside.mkdir()
    save_file(declared[1], str(outside / "r1.safetensors"))
    (d / "model-rank-1-part-0.safetensors").symlink_to(outside / "r1.safetensors")
    error(lambda: K.read_rank_dumps(d, endpoint("vllm:2")), UnsafeFile)
    assert len(K.read_rank_dumps(d, endpoint("vllm:2"), roots=[outside])[1]) == len(declared[1])


# -- what each rank holds


def _ranks(tmp_path, where="vllm:2", config=SMALL):
    d = emit(tmp_path / "v", where, config)
    return d, [load_file(str(d / f"model-rank-{r}-part-0.safetensors"))
               for r in range(endpoint(where).world)]


def _rewrite(d, rank, params, part=0):
    save_file(params, str(d / f"model-rank-{rank}-part-{part}.safetensors"))


def test_missing_tensors_are_named_four_then_how_many_more(tmp_path):
    d, shards = _ranks(tmp_path)
    declared = list(endpoint("vllm:2").convention.local_shapes(SMALL, endpoint("vllm:2"))[1])
    path = d / "model-rank-1-part-0.safetensors"
    for gone, said in ((6, f"{', '.join(declared[:4])} and 2 more"),
                       (5, f"{', '.join(declared[:4])} and 1 more"),
                       (4, ", ".join(declared[:4])), (1, declared[0])):
        _rewrite(d, 1, {n: shards[1][n] for n in declared[gone:]})
        e = error(lambda: K.read_checkpoint(d, endpoint("vllm:2"), SMALL))
        assert str(e) == f"{path}: vllm:2 rank 1 is missing {said}" and e.path == str(path)


def test_a_rank_over_several_files_is_named_by_all_of_them(tmp_path):
    d, shards = _ranks(tmp_path)
    names = sorted(shards[0])
    _rewrite(d, 0, {n: shards[0][n] for n in names[:3]})
    _rewrite(d, 0, {n: shards[0][n] for n in names[3:-1]}, part=1)
    ck_files = [d / "model-rank-0-part-0.safetensors", d / "model-rank-0-part-1.safetensors"]
    e = error(lambda: K.read_checkpoint(d, endpoint("vllm:2"), SMALL))
    assert str(e) == (f"{ck_files[0]}, {ck_files[1]}: vllm:2 rank 0 is missing {names[-1]}")
    assert e.path == str(ck_files[0])
    _rewrite(d, 0, {n: shards[0][n] for n in names[3:]}, part=1)
    ck = K.read_checkpoint(d, endpoint("vllm:2"), SMALL)  # the twin: all of them, over two
    assert ck.files[0] == {n: ck_files[0] if n in names[:3] else ck_files[1] for n in names}


def test_a_rank_with_no_file_is_named_by_the_directory():
    ck = K.Checkpoint(Path("/nowhere"), [{}, {}], [{}, {}])
    e = error(lambda: K._check_names_and_shapes(ck, endpoint("vllm:2"), SMALL))
    assert str(e).startswith("/nowhere: vllm:2 rank 0 is missing ") and e.path == "/nowhere"


def test_an_extra_tensor_is_named_and_a_tied_models_output_layer_says_why(tmp_path):
    d, shards = _ranks(tmp_path)
    path = d / "model-rank-1-part-0.safetensors"
    _rewrite(d, 1, {**shards[1], "model.extra": torch.zeros(1)})
    e = error(lambda: K.read_checkpoint(d, endpoint("vllm:2"), SMALL))
    assert str(e) == f"{path}: vllm:2 rank 1 has no tensor model.extra" and e.path == str(path)
    t, tied = _ranks(tmp_path / "t", config=TIED)
    assert "lm_head.weight" not in tied[0]
    _rewrite(t, 0, {**tied[0], "lm_head.weight": shards[0]["lm_head.weight"]})
    path = t / "model-rank-0-part-0.safetensors"
    e = error(lambda: K.read_checkpoint(t, endpoint("vllm:2"), TIED))
    assert str(e) == (f"{path}: vllm:2 rank 0 has no tensor lm_head.weight (tied embeddings: "
                      "the output layer reads the embedding table, not a stored copy)")


def test_a_wrong_shape_is_named_with_both_shapes(tmp_path):
    d, shards = _ranks(tmp_path)
    path = d / "model-rank-0-part-0.safetensors"
    name = "model.norm.weight"
    _rewrite(d, 0, {**shards[0], name: torch.zeros(2, 16)})
    e = error(lambda: K.read_checkpoint(d, endpoint("vllm:2"), SMALL))
    assert str(e) == f"{path}: vllm:2 rank 0 {name} has shape [2, 16], declared [32]"
    assert e.path == str(path)


def _fp8(tmp_path, where):
    from weight_sync_bench.conventions.fp8 import fp8_shards

    ep = endpoint(where)
    d = tmp_path / where.replace(":", "-").replace(",", "_")
    K.write_checkpoint(d, fp8_shards(FP8_CONFIG, ep, init_params(FP8_CONFIG, 0)), ep,
                       FP8_CONFIG)
    return d, ep


def test_an_fp8_tensor_of_another_dtype_is_named(tmp_path):
    d, ep = _fp8(tmp_path, "vllm:tp=2,fp8=block128")
    path = d / "model-rank-1-part-0.safetensors"
    held = load_file(str(path))
    name = next(n for n, x in held.items() if x.dtype == torch.float8_e4m3fn)
    save_file({**held, name: held[name].float()}, str(path))
    e = error(lambda: K.read_checkpoint(d, ep, FP8_CONFIG))
    assert str(e) == (f"{path}: {ep} rank 1 {name} is torch.float32, declared "
                      "torch.float8_e4m3fn") and e.path == str(path)
    scale = next(n for n in held if n.endswith("weight_scale_inv"))
    save_file({**held, scale: held[scale].double()}, str(path))
    e = error(lambda: K.read_checkpoint(d, ep, FP8_CONFIG))
    assert str(e) == f"{path}: {ep} rank 1 {scale} is torch.float64, declared torch.float32"
    # a tensor of no declared dtype (a norm, in the weights' dtype) is not held to one
    norm = "model.norm.weight"
    save_file({**held, norm: held[norm].to(torch.bfloat16)}, str(path))
    assert K.read_checkpoint(d, ep, FP8_CONFIG).shards[1][norm].dtype == torch.bfloat16
    # and a missing one is named as missing, not looked up for its dtype
    save_file({n: x for n, x in held.items() if n != name}, str(path))
    e = error(lambda: K.read_checkpoint(d, ep, FP8_CONFIG))
    assert str(e).startswith(f"{path}: {ep} rank 1 is missing {name}")


def test_an_fp8_config_json_states_the_schemes_quantization_config(tmp_path):
    d, ep = _fp8(tmp_path, "hf:fp8=block128")
    path = d / "config.json"
    stated = json.loads(path.read_text())
    want = {"activation_scheme": "dynamic", "quant_method": "fp8",
            "weight_block_size": [128, 128]}
    for qc in (None, [1], {**want, "weight_block_size": [64, 64]},
               {k: v for k, v in want.items() if k != "activation_scheme"}):
        path.write_text(json.dumps({**stated, "quantization_config": qc}))
        ck = K.Checkpoint(d, [], [])
        e = error(lambda: K._check_fp8_config(ck, ep))
        assert str(e) == (f"{path}: hf:fp8=block128 expects quantization_config {want}, the "
                          f"file states {qc!r}") and e.path == str(path)
    path.write_text(json.dumps({**stated, "quantization_config": {**want, "fmt": "e5m2"}}))
    K._check_fp8_config(K.Checkpoint(d, [], []), ep)  # vLLM does not read fmt
    t, tensor = _fp8(tmp_path, "hf:fp8=tensor")
    tpath = t / "config.json"
    qc = json.loads(tpath.read_text())["quantization_config"]
    K._check_fp8_config(K.Checkpoint(t, [], []), tensor)
    tpath.write_text(json.dumps({"quantization_config": {**qc, "weight_block_size": None}}))
    K._check_fp8_config(K.Checkpoint(t, [], []), tensor)  # null is no block size
    tpath.write_text(json.dumps({"quantization_config": {**qc, "weight_block_size": [128, 128]}}))
    e = error(lambda: K._check_fp8_config(K.Checkpoint(t, [], []), tensor))
    assert "hf:fp8=tensor expects quantization_config" in str(e)
    tpath.write_text(json.dumps([qc]))
    e = error(lambda: K._check_fp8_config(K.Checkpoint(t, [], []), tensor))
    assert str(e).endswith("the file states None")
    tpath.write_text("{")
    e = error(lambda: K._check_fp8_config(K.Checkpoint(t, [], []), tensor))
    assert str(e) == (f"{tpath}: not readable JSON (Expecting property name enclosed in double "
                      "quotes: line 1 column 2 (char 1))") and e.path == str(tpath)
    assert e.__cause__ is None
    tpath.unlink()
    K._check_fp8_config(K.Checkpoint(t, [], []), tensor)  # no config.json: nothing to check
    tpath.mkdir()
    K._check_fp8_config(K.Checkpoint(t, [], []), tensor)  # not a file: nothing to check


# -- canonical parameters assembled on demand

MOE = SMALL.replace(name="moe", n_experts=2, top_k=1, expert_ffn=16, qk_norm=True)  # Qwen3-MoE


def _canonical(where, config=SMALL):
    from weight_sync_bench.conventions import materialize

    full = init_params(config, 0)
    (pieces,) = endpoint(where).pieces(config)
    (stored,) = materialize([pieces], full)
    return full, stored, K.CanonicalWeights(stored, pieces, config.param_shapes())


def _no_gather(monkeypatch):
    def gather(*args, **kwargs):
        raise AssertionError("gather_canonical called")

    monkeypatch.setattr(K, "gather_canonical", gather)


@pytest.mark.parametrize("where, config", [("hf", SMALL), ("meta:1", SMALL), ("hf", MOE),
                                           ("hf:experts=fused", MOE), ("hf", TIED)])
def test_canonical_weights_are_each_parameter_as_the_check_starts_from_it(where, config):
    full, _, weights = _canonical(where, config)
    assert list(weights) == list(config.param_shapes()) and len(weights) == len(full)
    assert sorted(weights) == sorted(full)
    for name, x in full.items():
        assert name in weights and torch.equal(weights[name], x), name
    assert "layers.9.qkv.weight" not in weights and 3 not in weights


def test_stored_tensors_that_tile_a_parameter_are_taken_as_they_are(monkeypatch):
    full, stored, weights = _canonical("hf")
    _no_gather(monkeypatch)
    assert weights["norm.weight"] is stored["model.norm.weight"]  # one tensor: itself
    assert torch.equal(weights["layers.0.qkv.weight"], full["layers.0.qkv.weight"])
    assert torch.equal(weights["layers.0.gate_up.weight"], full["layers.0.gate_up.weight"])
    full, stored, weights = _canonical("meta:1")
    # Meta's embedding is cut on the hidden dimension (dim 1): one piece spans all 32
    assert weights["tok_embeddings.weight"] is stored["tok_embeddings.weight"]
    assert weights["layers.0.down.weight"] is stored["layers.0.feed_forward.w2.weight"]


def test_stored_tensors_that_do_not_tile_it_are_gathered(monkeypatch):
    calls = []
    real = K.gather_canonical
    monkeypatch.setattr(K, "gather_canonical", lambda *a: calls.append(a[3]) or real(*a))
    full, _, weights = _canonical("meta:1")  # wq, wk in Meta's interleaved order: no span
    assert torch.equal(weights["layers.0.qkv.weight"], full["layers.0.qkv.weight"])
    assert calls == [["layers.0.qkv.weight"]]
    full, _, weights = _canonical("hf:experts=fused", MOE)
    experts = [n for n in full if "experts" in n]
    for name in experts:  # stacked experts: never taken as they are
        assert torch.equal(weights[name], full[name])
    assert calls[1:] == [[n] for n in experts]


def _pieces(shape, *cuts):
    """Pieces of a parameter ``p`` of ``shape``: (dim, start, stop) each, and their tensors."""
    x = torch.arange(float(math.prod(shape))).reshape(shape) + 1
    pieces = {f"s{i}": Piece("p", dim, torch.arange(a, b)) for i, (dim, a, b) in enumerate(cuts)}
    stored = {n: p.take(x) for n, p in pieces.items()}
    return x, K.CanonicalWeights(stored, pieces, {"p": shape})


@pytest.mark.parametrize("cuts, covered", [
    ([(0, 0, 2), (0, 2, 4)], slice(0, 4)),  # a tile: as they are
    ([(0, 2, 4), (0, 0, 2)], slice(0, 4)),  # the same, stored in the other order
    ([(0, 0, 2), (0, 2, 3)], slice(0, 3)),  # the last row not stored: zeros there
    ([(0, 1, 4)], slice(1, 4)),  # the first row not stored
    ([(0, 0, 1), (0, 2, 4)], [0, 2, 3]),  # a gap
])
def test_a_parameter_is_its_stored_rows_and_zeros_where_none_is_stored(cuts, covered):
    x, weights = _pieces((4, 3), *cuts)
    want = torch.zeros(4, 3)
    want[covered] = x[covered]
    assert torch.equal(weights["p"], want)


def test_pieces_on_different_dims_are_gathered_not_concatenated():
    x, weights = _pieces((4, 4), (0, 0, 2), (1, 2, 4))  # rows 0-1, then columns 2-3
    want = torch.zeros(4, 4)
    want[:2] = x[:2]
    want[:, 2:] = x[:, 2:]
    assert torch.equal(weights["p"], want)


# -- which weights a check starts from


def _legacy(tmp_path, where="megatron:2", config=SMALL):
    from weight_sync_bench.conventions import materialize

    at = endpoint(where)
    d = tmp_path / "mg"
    K.write_megatron_legacy(d, materialize(at.pieces(config), init_params(config, 0)), at,
                            config)
    return d, at


def test_read_weights_reads_a_megatron_checkpoint_as_megatron_and_any_other_as_hf(tmp_path):
    full = init_params(SMALL, 0)
    hf = emit(tmp_path / "hf", "hf")
    mg, at = _legacy(tmp_path)
    for directory, where in ((hf, None), (hf, endpoint("hf")), (mg, None), (mg, at)):
        got = K.read_weights(directory, SMALL, where=where)
        assert isinstance(got, K.CanonicalWeights) == (directory == hf)
        assert sorted(got) == sorted(full)
        assert all(torch.equal(got[n], x) for n, x in full.items())
    e = error(lambda: K.read_weights(hf, SMALL, where=at))  # said to be Megatron's: it is not
    assert "latest_checkpointed_iteration.txt: missing" in str(e)
    e = error(lambda: K.read_weights(mg, SMALL, where=endpoint("hf")))
    assert str(e) == f"{mg / 'config.json'}: missing"
    from weight_sync_bench.conventions import materialize

    fused, at = tmp_path / "fused", endpoint("hf:experts=fused")
    K.write_checkpoint(fused, materialize(at.pieces(MOE), init_params(MOE, 0)), at, MOE)
    got = K.read_weights(fused, MOE, where=endpoint("hf:experts=fused"))
    assert all(torch.equal(got[n], x) for n, x in init_params(MOE, 0).items())
    e = error(lambda: K.read_weights(fused, MOE))  # the default, per-expert names: not these
    assert "hf is missing" in str(e)


def test_virtual_stages_are_saved_as_model0_model1_without_their_prefix():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    at = endpoint("megatron:tp=1,pp=2,vpp=3")
    assert K._chunks({"model0.x": a, "model2.y.z": b, "model2.w": c}, at) == {
        "model0": {"x": a}, "model1": {}, "model2": {"y.z": b, "w": c}}
    import types

    held = types.MappingProxyType({"x": a})
    out = K._chunks(held, endpoint("megatron:2"))
    assert out == {"model": {"x": a}} and type(out["model"]) is dict


# -- the degrees a legacy Megatron checkpoint was saved at


def _saved(tmp_path, step="iter_0000001", rank_dir="mp_rank_00", **args):
    path = tmp_path / step / rank_dir / "model_optim_rng.pt" if step else \
        tmp_path / rank_dir / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": argparse.Namespace(**args), "model": {}}, path)
    return path


def _at(tmp_path, step="iter_0000001"):
    return K.saved_at(files(tmp_path), step)


@pytest.mark.parametrize("args, said", [
    ({"tensor_model_parallel_size": 2}, "megatron:tp=2"),
    ({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
      "expert_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
      "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
      "expert_tensor_parallel_size": None, "account_for_embedding_in_pipeline_split": False,
      "account_for_loss_in_pipeline_split": False}, "megatron:tp=1"),
    ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
      "expert_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2,
      "decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3},
     "megatron:tp=2,pp=2,ep=4,vpp=2,pp_first=1,pp_last=3"),
    # what is no size is no degree: 0, negative, not an int
    ({"tensor_model_parallel_size": 0, "pipeline_model_parallel_size": -2,
      "expert_model_parallel_size": "4", "virtual_pipeline_model_parallel_size": 2.0,
      "decoder_first_pipeline_num_layers": 0}, "megatron:tp=1"),
    ({"tensor_model_parallel_size": None, "decoder_last_pipeline_num_layers": 1},
     "megatron:tp=1,pp_last=1"),
    # expert TP is said where it differs from TP
    ({"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, "megatron:tp=2,etp=1"),
    ({"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2}, "megatron:tp=2"),
    ({"tensor_model_parallel_size": None, "expert_tensor_parallel_size": 1}, "megatron:tp=1"),
    ({"tensor_model_parallel_size": None, "expert_tensor_parallel_size": 2},
     "megatron:tp=1,etp=2"),
    ({"tensor_model_parallel_size": 4, "expert_tensor_parallel_size": 0}, "megatron:tp=4"),
    # the embedding and the loss counted as pipeline layers
    ({"tensor_model_parallel_size": 1, "account_for_embedding_in_pipeline_split": True},
     "megatron:tp=1,pp_account=embedding"),
    ({"tensor_model_parallel_size": 1, "account_for_loss_in_pipeline_split": 1},
     "megatron:tp=1,pp_account=loss"),
    ({"tensor_model_parallel_size": 1, "account_for_embedding_in_pipeline_split": True,
      "account_for_loss_in_pipeline_split": True, "pipeline_model_parallel_size": 2},
     "megatron:tp=1,pp=2,pp_account=both"),
])
def test_the_endpoint_a_checkpoint_was_saved_at_is_read_from_its_args(tmp_path, args, said):
    _saved(tmp_path, **args)
    assert _at(tmp_path) == said


def test_the_first_rank_file_states_the_degrees(tmp_path):
    _saved(tmp_path, rank_dir="mp_rank_00_001", tensor_model_parallel_size=4)
    _saved(tmp_path, rank_dir="mp_rank_00_000", tensor_model_parallel_size=2)
    _saved(tmp_path, rank_dir="mp_rank_01_000", tensor_model_parallel_size=8)
    assert _at(tmp_path) == "megatron:tp=2"
    # a checkpoint's root that is the iteration itself: no step directory
    _saved(tmp_path / "flat", step="", tensor_model_parallel_size=2,
           pipeline_model_parallel_size=2)
    assert _at(tmp_path / "flat", "") == "megatron:tp=2,pp=2"


def test_a_checkpoint_whose_first_rank_states_no_degrees_is_named(tmp_path):
    path = _saved(tmp_path, pipeline_model_parallel_size=2)
    for state in ({"args": argparse.Namespace(pipeline_model_parallel_size=2)}, {"args": None},
                  {"args": {"tensor_model_parallel_size": 2}}, {}, [1]):
        torch.save(state, path)
        e = error(lambda: _at(tmp_path))
        assert str(e) == (f"{path}: no args stating the degrees it was saved at; say them "
                          "(--weights-from megatron:tp=2,pp=2)") and e.path == str(path)
    flat = _saved(tmp_path / "flat", step="")
    torch.save({"args": None}, flat)
    e = error(lambda: _at(tmp_path / "flat", ""))
    assert str(e).startswith(f"{tmp_path / 'flat' / 'mp_rank_00' / 'model_optim_rng.pt'}: no "
                             "args")


def test_a_checkpoint_without_a_first_rank_directory_is_named(tmp_path):
    base = tmp_path / "iter_0000001"
    base.mkdir()
    (base / "mp_rank_00").write_text("a file, not a rank's directory")
    _saved(tmp_path, rank_dir="mp_rank_01", tensor_model_parallel_size=2)
    e = error(lambda: _at(tmp_path))
    assert str(e) == (f"{base}: no mp_rank_00* directory (a legacy Megatron checkpoint holds "
                      "one per rank)") and e.path == str(base)
    (base / "mp_rank_00").unlink()
    (base / "mp_rank_00").mkdir()  # there, without its file
    e = error(lambda: _at(tmp_path))
    assert str(e) == f"{base / 'mp_rank_00' / 'model_optim_rng.pt'}: missing"


def test_a_legacy_checkpoint_written_by_the_harness_states_where_it_was_saved(tmp_path):
    for where in ("megatron:2", "megatron:tp=2,pp=2"):
        d, at = _legacy(tmp_path / where.replace(":", "-").replace(",", "_"), where,
                        SMALL.replace(n_layers=4))
        assert endpoint(_at(d)) == at


# -- found by the first pass: what the tests above left open


def test_a_meta_directory_reads_back_checked_against_its_params_json(tmp_path):
    d = emit(tmp_path / "m", "meta:2")
    ck = K.read_checkpoint(d, endpoint("meta:2"), SMALL)
    declared = shards_for(SMALL, "meta", 2)
    assert [s.keys() for s in ck.shards] == [s.keys() for s in declared]
    assert all(torch.equal(ck.shards[r][n], x) for r in range(2) for n, x in declared[r].items())
    assert ck.files == [dict.fromkeys(declared[r], d / f"consolidated.0{r}.pth")
                        for r in range(2)]
    path = _params_json(d, dim=64, n_heads=8)
    e = error(lambda: K.read_checkpoint(d, endpoint("meta:2"), SMALL))
    assert str(e) == f"{path}: d_model is 64, the config checked (small) has 32"
    assert e.path == str(path)


def test_read_checkpoint_holds_the_tensors_not_the_files(tmp_path):
    """What read_checkpoint returns is in memory (``hf_weights`` is the lazy reader): the
    files may go once it returns."""
    d, _ = _cut(tmp_path)
    ck = K.read_checkpoint(d, endpoint("hf"), SMALL)
    for p in d.glob("*.safetensors"):
        p.unlink()
    assert type(ck.shards[0]) is dict
    declared = shards_for(SMALL, "hf", 1)[0]
    assert all(torch.equal(ck.shards[0][n], x) for n, x in declared.items())


def test_two_virtual_stages_are_model0_and_model1():
    a, b = torch.zeros(1), torch.ones(1)
    assert K._chunks({"model0.x": a, "model1.y": b}, endpoint("megatron:tp=1,pp=2,vpp=2")) == {
        "model0": {"x": a}, "model1": {"y": b}}


def test_a_first_rank_file_that_is_not_a_torch_checkpoint_is_named(tmp_path):
    path = _saved(tmp_path, tensor_model_parallel_size=2)
    path.write_bytes(b"PK\x03\x04garbage")
    e = error(lambda: _at(tmp_path))
    assert str(e).startswith(f"{path}: not a readable torch checkpoint, truncated or corrupt")
    assert e.path == str(path)


_AS_CUDA = [False, False]  # tagging now; the tagger registered


def _cuda_tag(obj):  # while set, a CPU storage is saved as torch tags a CUDA one
    return "cuda:0" if _AS_CUDA[0] and getattr(obj, "device", None) == torch.device("cpu") \
        else None


def test_a_consolidated_file_saved_from_gpus_loads_on_a_machine_without_one(tmp_path):
    """Meta's files were saved from GPUs (each storage tagged ``cuda:N``); loaded onto the
    CPU (``map_location``), they read here (as tests/conventions/
    test_checkpoint_files_mutants.py shows for Megatron's)."""
    from torch import serialization

    if not _AS_CUDA[1]:  # once a process: torch keeps a registered package for good
        serialization.register_package(2, _cuda_tag, lambda obj, location: None)
        _AS_CUDA[1] = True
    d = emit(tmp_path / "m", "meta:1")
    path = d / "consolidated.00.pth"
    held = torch.load(path, weights_only=True)
    _AS_CUDA[0] = True
    try:
        torch.save(held, path)
    finally:
        _AS_CUDA[0] = False
    assert b"cuda:0" in path.read_bytes()
    (shard,), _ = K._read_meta(files(d), 1)
    assert all(torch.equal(shard[n], x) and x.device.type == "cpu" for n, x in held.items())
    if not torch.cuda.is_available():  # the twin: torch's default location needs the GPU
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)


RAN = []


def _ran(*args):
    RAN.append(args)


class _Recorded:
    def __reduce__(self):
        return (_ran, ("ran",))


def test_a_consolidated_pickle_never_runs_even_where_torchs_default_would(tmp_path,
                                                                           monkeypatch):
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns torch's default to unsafe loads; the
    harness asks for ``weights_only=True`` itself."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    d = emit(tmp_path / "m", "meta:1")
    path = d / "consolidated.00.pth"
    torch.save({"a": _Recorded()}, path)
    RAN.clear()
    e = error(lambda: K._read_meta(files(d), 1))
    assert "Unsupported global" in str(e) and RAN == []
    with pytest.warns(UserWarning, match="forcing weights_only=False"):  # the twin
        torch.load(path, map_location="cpu")
    assert RAN == [("ran",)]


def test_read_weights_passes_the_degrees_and_the_allowed_roots_on(tmp_path):
    full = init_params(SMALL, 0)
    mg, at = _legacy(tmp_path)
    for rank in ("mp_rank_00", "mp_rank_01"):  # no args: only the degrees given say them
        path = mg / "iter_0000001" / rank / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        torch.save({**state, "args": None}, path)
    got = K.read_weights(mg, SMALL, where=at)
    assert all(torch.equal(got[n], x) for n, x in full.items())
    error(lambda: K.read_weights(mg, SMALL))  # the twin: without them, no degrees
    # a file linked out of the directory reads under an allowed root, and only there
    outside = tmp_path / "outside"
    outside.mkdir()
    rank0 = mg / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    rank0.rename(outside / "r0.pt")
    rank0.symlink_to(outside / "r0.pt")
    error(lambda: K.read_weights(mg, SMALL, where=at), UnsafeFile)
    got = K.read_weights(mg, SMALL, where=at, roots=[outside])
    assert all(torch.equal(got[n], x) for n, x in full.items())
    hf = emit(tmp_path / "hf", "hf", max_shard_size=10**9)
    (hf / "model.safetensors").rename(outside / "model.safetensors")
    (hf / "model.safetensors").symlink_to(outside / "model.safetensors")
    error(lambda: K.read_weights(hf, SMALL), UnsafeFile)
    got = K.read_weights(hf, SMALL, roots=[outside])
    assert all(torch.equal(got[n], x) for n, x in full.items())


def test_a_directory_with_no_name_is_named_checkpoint(tmp_path, monkeypatch):
    """``/`` resolves to a name of ""; the geometry it states is then named "checkpoint" (a
    directory is faked as resolving there: the tests write nothing outside tmp_path)."""
    m = emit(tmp_path / "m", "meta:2")
    h = emit(tmp_path / "h", "hf")
    stated = json.loads((h / "config.json").read_text())
    del stated["_name_or_path"]
    (h / "config.json").write_text(json.dumps(stated))
    real = Path.resolve

    def resolve(self, strict=False):
        return Path("/") if self in (m, h) else real(self, strict)

    monkeypatch.setattr(Path, "resolve", resolve)
    assert K.checkpoint_geometry(m, endpoint("meta:2")) == SMALL.replace(name="checkpoint")
    assert K._hf_geometry(files(h), None) == SMALL.replace(name="checkpoint")

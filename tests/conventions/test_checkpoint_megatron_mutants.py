"""Megatron-LM's checkpoints as ``conventions.checkpoint`` writes and reads them (issue 30,
the mutation pass over its Megatron side).

Two formats, both Megatron-Core's own:

- legacy ``torch``: a tracker file ``latest_checkpointed_iteration.txt`` (the iteration, or
  ``release``), and per (TP, PP, EP) rank ``iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}]
  [_{ep:03d}]/model_optim_rng.pt`` (Megatron-LM ``training/checkpointing.py::
  get_checkpoint_name``, restated below), a ``torch.save``d dict of ``args`` (an argparse
  Namespace, ``training/arguments.py`` names), ``checkpoint_version`` 3.0, ``iteration`` and
  ``model`` (``model0``, ``model1``, ... per virtual stage); TE's ``_extra_state`` is not a
  weight;
- ``torch_dist``: ``metadata.json`` stating ``sharded_backend``, DCP's ``.metadata`` and
  ``__<rank>_<n>.distcp`` files, every tensor whole under its global key (a homogeneous
  decoder's layers stacked on a leading axis, the experts on the next), the vocabulary as
  the saving run padded it, the common state a ``common_state`` object (or an older
  ``common.pt``).

Pinned here: each rank directory's name, the ``args`` recorded and checked field by field,
each file's contents and mode, every refusal's full text and the path it names, the tracker's
readings, which directories count as a checkpoint, the chunk tiling check, the staging
siblings a killed writer leaves, and the padding rows of a written torch_dist embedding;
each refusal beside its twin that reads."""

from __future__ import annotations

import argparse
import io
import os
import pickle
import signal
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.conventions import checkpoint as K
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.coordinates import rank_coordinates
from weight_sync_bench.errors import CheckpointError
from weight_sync_bench.model.config import init_params

DENSE = tiny(2, n_layers=2).replace(name="tiny_meg")
MOE = tiny(4, n_layers=2, n_experts=4, top_k=2, expert_ffn=16).replace(name="tiny_meg_moe")


def error(call, kind=CheckpointError):
    with pytest.raises(kind) as info:
        call()
    return info.value


def files(root: Path):
    return K._Files(root, ())


def get_checkpoint_name(tensor_rank, pipeline_rank, expert_rank, pipeline_parallel,
                        expert_parallel):
    """Megatron-LM ``megatron/training/checkpointing.py::get_checkpoint_name``, restated:
    ``mp_rank_{tp:02d}`` or, with pipeline parallelism, ``mp_rank_{tp:02d}_{pp:03d}``; with
    expert parallelism ``_{ep:03d}`` appended."""
    if not pipeline_parallel:
        common = f"mp_rank_{tensor_rank:02d}"
    else:
        common = f"mp_rank_{tensor_rank:02d}_{pipeline_rank:03d}"
    if expert_parallel:
        common = common + f"_{expert_rank:03d}"
    return common


def save_legacy(tmp_path, config, where, **kwargs):
    at = endpoint(where)
    out = tmp_path / "ckpt"
    shards = materialize(at.pieces(config), init_params(config, 0))
    return K.write_megatron_legacy(out, shards, at, config, **kwargs), at, shards


# -- rank directories and args


@pytest.mark.parametrize(("config", "where", "names"), [
    (DENSE, "megatron:2", ["mp_rank_00", "mp_rank_01"]),
    (DENSE, "megatron:tp=1,pp=2", ["mp_rank_00_000", "mp_rank_00_001"]),
    (MOE, "megatron:tp=1,ep=2", ["mp_rank_00_000", "mp_rank_00_001"]),
    (MOE, "megatron:tp=2,pp=2,ep=2", ["mp_rank_00_000_000", "mp_rank_01_000_000",
                                      "mp_rank_00_000_001", "mp_rank_01_000_001",
                                      "mp_rank_00_001_000", "mp_rank_01_001_000",
                                      "mp_rank_00_001_001", "mp_rank_01_001_001"]),
], ids=str)
def test_rank_directories_are_named_as_megatrons_get_checkpoint_name_names_them(config, where,
                                                                                 names):
    at = endpoint(where)
    got = [K.megatron_rank_dir(config, at, r) for r in range(at.world)]
    assert got == names
    for r in range(at.world):
        c = rank_coordinates(config, at, r)
        assert got[r] == get_checkpoint_name(c.tp, c.pp, c.ep, at.pp > 1, at.ep > 1)


def test_the_args_state_the_degrees_and_the_sizes_under_megatrons_names():
    at = endpoint("megatron:tp=2,pp=2,ep=2")
    args = K.megatron_args(MOE, at, ckpt_format="torch", seed=3)
    assert vars(args) == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 2, "num_layers": 2, "hidden_size": 32,
        "num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4,
        "kv_channels": 8, "ffn_hidden_size": 64, "num_experts": 4, "moe_ffn_hidden_size": 16,
        "expert_tensor_parallel_size": 2, "virtual_pipeline_model_parallel_size": None,
        "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
        "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False, "ckpt_format": "torch", "seed": 3}
    assert isinstance(args, argparse.Namespace)
    dense = vars(K.megatron_args(DENSE.replace(n_kv_heads=8), endpoint("megatron:2")))
    assert dense["group_query_attention"] is False and dense["num_query_groups"] == 8
    assert dense["num_experts"] is None and dense["moe_ffn_hidden_size"] is None
    assert dense["tensor_model_parallel_size"] == 2 and dense["pipeline_model_parallel_size"] == 1
    assert dense["expert_model_parallel_size"] == 1


def test_args_of_another_geometry_are_refused_naming_the_field_and_both_values(tmp_path):
    path = tmp_path / "f.pt"
    ok = K.megatron_args(MOE, endpoint("megatron:2"))
    K._check_args(path, ok, MOE)  # the twin: its own geometry
    K._check_args(path, None, MOE)  # no args: nothing to check
    K._check_args(path, object.__new__(type("Slots", (), {"__slots__": ()})), MOE)
    mixed = MOE.replace(dense_layers=1)  # a dense first layer: its ffn is checked too
    for field, value, want in [("num_layers", 3, 2), ("hidden_size", 64, 32),
                               ("num_attention_heads", 4, 8), ("kv_channels", 4, 8),
                               ("ffn_hidden_size", 32, 64), ("num_experts", 8, 4),
                               ("moe_ffn_hidden_size", 8, 16), ("num_query_groups", 2, 4)]:
        args = argparse.Namespace(**{**vars(ok), field: value})
        e = error(lambda: K._check_args(path, args, mixed))
        assert str(e) == (f"{path}: its args say {field}={value!r}, the config checked "
                          f"(tiny_meg_moe) has {want!r}")
        assert e.path == str(path)
    # without group_query_attention, the query groups are the attention heads
    mha = argparse.Namespace(group_query_attention=False, num_attention_heads=8,
                             num_query_groups=1)
    e = error(lambda: K._check_args(path, mha, MOE))
    assert str(e).endswith("its args say num_query_groups=8, the config checked "
                           "(tiny_meg_moe) has 4")
    K._check_args(path, mha, MOE.replace(n_kv_heads=8))
    gqa = argparse.Namespace(num_attention_heads=8, num_query_groups=4)  # GQA by default
    K._check_args(path, gqa, MOE)
    # a field left None is not checked; the expert sizes only where the model has experts,
    # the dense ffn only where it has a dense MLP
    K._check_args(path, argparse.Namespace(num_layers=None, num_experts=8,
                                           moe_ffn_hidden_size=3), DENSE)
    K._check_args(path, argparse.Namespace(ffn_hidden_size=1), MOE)
    e = error(lambda: K._check_args(path, argparse.Namespace(ffn_hidden_size=1), DENSE))
    assert str(e) == f"{path}: its args say ffn_hidden_size=1, the config checked (tiny_meg) has 64"


# -- the legacy writer


def test_a_legacy_checkpoint_holds_per_rank_the_args_version_iteration_and_model(tmp_path):
    old = os.umask(0o027)
    try:
        step, at, shards = save_legacy(tmp_path, DENSE, "megatron:tp=2,pp=2", iteration=42)
    finally:
        os.umask(old)
    out = tmp_path / "ckpt"
    assert step == out / "iter_0000042"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no stage left
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000042", K.MEGATRON_TRACKER]
    assert (out / K.MEGATRON_TRACKER).read_text() == "42\n"
    assert (out / K.MEGATRON_TRACKER).stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in step.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001",
                                                      "mp_rank_01_000", "mp_rank_01_001"]
    assert {oct(p.stat().st_mode & 0o777) for p in step.iterdir()} == {"0o750"}
    for rank in range(at.world):
        path = step / K.megatron_rank_dir(DENSE, at, rank) / K.MEGATRON_FILE
        assert sorted(p.name for p in path.parent.iterdir()) == [K.MEGATRON_FILE]
        assert path.stat().st_mode & 0o777 == 0o640
        state = torch.load(path, weights_only=False)
        assert sorted(state) == ["args", "checkpoint_version", "iteration", "model"]
        assert state["checkpoint_version"] == 3.0 and state["iteration"] == 42
        assert vars(state["args"]) == vars(K.megatron_args(DENSE, at, ckpt_format="torch"))
        assert sorted(state["model"]) == sorted(shards[rank])
        assert all(torch.equal(state["model"][n], x) for n, x in shards[rank].items())


def test_virtual_stages_are_written_without_their_model_prefix(tmp_path):
    config = DENSE.replace(n_layers=4)
    step, at, shards = save_legacy(tmp_path, config, "megatron:tp=1,pp=2,vpp=2")
    assert (tmp_path / "ckpt" / K.MEGATRON_TRACKER).read_text() == "1\n"
    state = torch.load(step / "mp_rank_00_001" / K.MEGATRON_FILE, weights_only=False)
    assert sorted(k for k in state if k.startswith("model")) == ["model0", "model1"]
    for v in (0, 1):
        want = {n.partition(".")[2]: x for n, x in shards[1].items()
                if n.startswith(f"model{v}.")}
        assert want and sorted(state[f"model{v}"]) == sorted(want)
        assert all(torch.equal(state[f"model{v}"][n], x) for n, x in want.items())
    back = K.megatron_weights(tmp_path / "ckpt", at, config)
    full = init_params(config, 0)
    assert all(torch.equal(back[n], x) for n, x in full.items())


def test_the_legacy_writer_refuses_another_convention_a_used_directory_or_a_world_short(
        tmp_path):
    at = endpoint("megatron:2")
    shards = materialize(at.pieces(DENSE), init_params(DENSE, 0))
    vllm = endpoint("vllm:2")
    e = error(lambda: K.write_megatron_legacy(tmp_path / "a", shards, vllm, DENSE))
    assert str(e) == f"{vllm}: Megatron's legacy format holds a megatron endpoint"
    assert e.path == str(tmp_path / "a") and not (tmp_path / "a").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    e = error(lambda: K.write_megatron_legacy(tmp_path / "used", shards, at, DENSE))
    assert str(e) == f"{tmp_path / 'used'}: not a new or empty directory"
    assert e.path == str(tmp_path / "used")
    (tmp_path / "file").write_text("")
    e = error(lambda: K.write_megatron_legacy(tmp_path / "file", shards, at, DENSE))
    assert str(e) == f"{tmp_path / 'file'}: not a new or empty directory"
    e = error(lambda: K.write_megatron_legacy(tmp_path / "b", shards[:1], at, DENSE))
    assert str(e) == f"{at}: 1 rank dicts to write, expected 2"
    assert e.path == str(tmp_path / "b") and not (tmp_path / "b").exists()
    (tmp_path / "empty").mkdir()  # the twin: an empty directory is filled
    step = K.write_megatron_legacy(tmp_path / "empty", shards, at, DENSE, iteration=3)
    assert step == tmp_path / "empty" / "iter_0000003"


# -- the legacy reader


def test_the_tracker_names_the_iteration_or_release_or_the_root_holds_the_ranks(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    e = error(lambda: K._megatron_step(files(root)))
    assert str(e) == (f"{root / K.MEGATRON_TRACKER}: missing (a Megatron checkpoint directory "
                      "has it, or is an iter_* directory holding mp_rank_*)")
    assert e.path == str(root / K.MEGATRON_TRACKER)
    for said, step in [("7\n", "iter_0000007"), (" 12 \n", "iter_0000012"),
                       ("1234567", "iter_1234567")]:
        (root / K.MEGATRON_TRACKER).write_text(said)
        assert K._megatron_step(files(root)) == step
    for said in ["latest", "-3", "x" * 60]:
        (root / K.MEGATRON_TRACKER).write_text(said + "\n")
        e = error(lambda: K._megatron_step(files(root)))
        assert str(e).startswith(f"{root / K.MEGATRON_TRACKER}: ")
        assert str(e).endswith("' is neither an iteration nor 'release'")
        assert f"{said[:40]}'" in str(e) and "x" * 41 not in str(e)  # the first 40 only
        assert e.path == str(root / K.MEGATRON_TRACKER)
    (root / "mp_rank_00").mkdir()  # the iteration directory itself: read in place
    assert K._megatron_step(files(root)) == ""
    dist = tmp_path / "d"
    dist.mkdir()
    (dist / K.DIST_CONFIG).write_text('{"sharded_backend": "torch_dist"}')
    assert K._megatron_step(files(dist)) == ""


def test_which_directories_are_megatron_checkpoints(tmp_path):
    def make(name, *entries):
        d = tmp_path / name
        d.mkdir()
        for entry, text in entries:
            if text is None:
                (d / entry).mkdir()
            else:
                (d / entry).write_text(text)
        return d

    assert K.is_megatron_checkpoint(make("tracker", (K.MEGATRON_TRACKER, "1")))
    assert K.is_megatron_checkpoint(make("ranks", ("mp_rank_03_001", None)))
    assert K.is_megatron_checkpoint(make("rankfile", ("mp_rank_x", "")))
    assert K.is_megatron_checkpoint(make("dist", (K.DIST_CONFIG, '{"sharded_backend": "x"}')))
    assert not K.is_megatron_checkpoint(make("empty"))
    assert not K.is_megatron_checkpoint(make("other", ("rank_00", None), ("xmp_rank_00", None)))
    assert not K.is_megatron_checkpoint(make("hf", (K.DIST_CONFIG, '{"format": "pt"}')))
    assert not K.is_megatron_checkpoint(tmp_path / "absent")
    (tmp_path / "file").write_text("")
    assert not K.is_megatron_checkpoint(tmp_path / "file")


@pytest.mark.parametrize(("text", "dist"), [
    ('{"sharded_backend": "torch_dist"}', True),
    ('{"sharded_backend": "zarr", "sharded_backend_version": 1}', True),
    ('{"sharded_backend": 1}', False),  # not a backend's name
    ('{"format": "pt"}', False),  # another metadata.json (an HF directory's)
    ('["sharded_backend"]', False),  # not an object
    ("{not json", False),
    (b'{"sharded_backend": "\xff"}', False),  # not UTF-8
], ids=str)
def test_a_distributed_checkpoint_is_one_whose_metadata_json_names_a_backend(tmp_path, text,
                                                                             dist):
    path = tmp_path / K.DIST_CONFIG
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert K.is_dist_checkpoint(tmp_path) is dist
    assert K.is_dist_checkpoint(str(tmp_path)) is dist


def test_a_metadata_json_that_is_a_link_or_a_directory_is_not_read(tmp_path):
    real = tmp_path / "real.json"
    real.write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / K.DIST_CONFIG).symlink_to(real)
    assert not K.is_dist_checkpoint(tmp_path / "a")
    (tmp_path / "b" / K.DIST_CONFIG).mkdir(parents=True)
    assert not K.is_dist_checkpoint(tmp_path / "b")
    assert not K.is_dist_checkpoint(tmp_path / "absent")


def rank_file(tmp_path, state, name="mp_rank_00"):
    path = tmp_path / name / K.MEGATRON_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return f"{name}/{K.MEGATRON_FILE}", path


def test_a_rank_files_model_is_read_without_transformer_engines_extra_state(tmp_path):
    at = endpoint("megatron:2")
    w = torch.arange(6.0).reshape(2, 3)
    rel, _path = rank_file(tmp_path, {"args": None, "model": {
        "a.weight": w, "a._extra_state": io.BytesIO(b"fp8"), "_extra_state": None,
        "b._extra_state_x": w}})
    got = K._megatron_model(files(tmp_path), rel, at, DENSE)
    assert list(got) == ["a.weight", "b._extra_state_x"] and torch.equal(got["a.weight"], w)
    vpp = endpoint("megatron:tp=1,pp=2,vpp=2")
    rel, _ = rank_file(tmp_path, {"model0": {"x": w}, "model1": {"y": w, "_extra_state": 1}},
                       "v")
    assert list(K._megatron_model(files(tmp_path), rel, vpp, DENSE)) == ["model0.x", "model1.y"]


def test_a_rank_file_without_its_model_or_with_more_than_tensors_is_refused(tmp_path):
    at = endpoint("megatron:2")
    f = files(tmp_path)
    e = error(lambda: K._megatron_model(f, "mp_rank_00/" + K.MEGATRON_FILE, at, DENSE))
    path = tmp_path / "mp_rank_00" / K.MEGATRON_FILE
    assert str(e) == f"{path}: missing ({at} saves one per (TP, PP, EP) rank)"
    for state in ([1, 2], {"model": [1]}, {"optimizer": {}}):
        rel, path = rank_file(tmp_path, state)
        e = error(lambda: K._megatron_model(f, rel, at, DENSE))
        assert str(e) == (f"{path}: no model state dict (saved at another virtual-stage count "
                          f"than {at}, or not Megatron's)")
        assert e.path == str(path)
    vpp = endpoint("megatron:tp=1,pp=2,vpp=2")
    rel, path = rank_file(tmp_path, {"model0": {}, "model": {}})
    e = error(lambda: K._megatron_model(f, rel, vpp, DENSE))
    assert str(e).startswith(f"{path}: no model0 and model1 state dict (saved at another "
                             f"virtual-stage count than {vpp}")
    rel, path = rank_file(tmp_path, {"model": {"a": torch.zeros(1), "b": 3}})
    e = error(lambda: K._megatron_model(f, rel, at, DENSE))
    assert str(e) == f"{path}: model['b'] is a int, not a tensor" and e.path == str(path)
    rel, path = rank_file(tmp_path, {"args": argparse.Namespace(hidden_size=7), "model": {}})
    e = error(lambda: K._megatron_model(f, rel, at, DENSE))
    assert str(e) == f"{path}: its args say hidden_size=7, the config checked (tiny_meg) has 32"


def test_megatron_weights_refuses_a_missing_directory_or_another_convention(tmp_path):
    e = error(lambda: K.megatron_weights(tmp_path / "absent", None, DENSE))
    assert str(e) == f"{tmp_path / 'absent'}: no such checkpoint directory"
    assert e.path == str(tmp_path / "absent")
    (tmp_path / "file").write_text("")
    e = error(lambda: K.megatron_weights(tmp_path / "file", None, DENSE))
    assert str(e) == f"{tmp_path / 'file'}: no such checkpoint directory"
    _step, at, _ = save_legacy(tmp_path, DENSE, "megatron:2")
    e = error(lambda: K.megatron_weights(str(tmp_path / "ckpt"), endpoint("vllm:2"), DENSE))
    assert str(e) == (f"{tmp_path / 'ckpt'}: a Megatron checkpoint is read as a megatron "
                      "endpoint, not vllm:2")
    assert e.path == str(tmp_path / "ckpt")
    full = init_params(DENSE, 0)
    for where in (at, None):  # the twin; None: the degrees its args state
        back = K.megatron_weights(str(tmp_path / "ckpt"), where, DENSE)
        assert sorted(back) == sorted(full)
        assert all(torch.equal(back[n], x) for n, x in full.items())


def test_a_wrong_tensor_is_named_by_the_rank_file_that_holds_it(tmp_path):
    step, at, _ = save_legacy(tmp_path, DENSE, "megatron:tp=2,pp=2")
    path = step / "mp_rank_01_001" / K.MEGATRON_FILE
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.final_layernorm.weight"] = torch.zeros(3)
    torch.save(state, path)
    for where in (tmp_path / "ckpt", step):  # from the root, or the iteration itself
        e = error(lambda: K.megatron_weights(where, at, DENSE))
        assert str(e).startswith(f"{path}: {at} rank 3 decoder.final_layernorm.weight has "
                                 "shape [3]")
        assert e.path == str(path)


def test_a_megatron_object_keeps_what_it_was_built_with_and_runs_nothing():
    o = K.MegatronObject(1, "a", k=2)
    assert o.args == (1, "a") and o.kwargs == {"k": 2}
    o.__setstate__({"s": 3})
    assert o.state == {"s": 3}


# -- the staging siblings a killed writer leaves


def test_only_the_stages_of_writers_that_no_longer_run_are_removed(tmp_path):
    out = tmp_path / "ck[1]"  # glob's special characters in the name: escaped
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    alive = subprocess.Popen(["sleep", "30"],  # a live writer: asked (signal 0), never hit
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        names = {
            "dead": f".ck[1].wsb-partial-{dead}",
            "mine": f".ck[1].wsb-partial-{os.getpid()}",
            "alive": f".ck[1].wsb-partial-{alive.pid}",
            "not a pid": ".ck[1].wsb-partial-12x",
            "another's": f".ck1.wsb-partial-{dead}",
            "other checkpoint": f".ck[2].wsb-partial-{dead}",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "f").write_text("")
        K._stale_stages(out)
        with pytest.raises(subprocess.TimeoutExpired):  # still running: not signalled
            alive.wait(timeout=0.3)
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for k, n in names.items() if k != "dead")
    K._stale_stages(tmp_path / "ck1")
    assert not (tmp_path / names["another's"]).exists()


# -- per-rank safetensors files (vLLM's sharded-state pattern, as Megatron's ranks are kept)


def rank_files(root: Path, held: dict[str, dict[str, torch.Tensor]]):
    root.mkdir(parents=True, exist_ok=True)
    for name, tensors in held.items():
        safetensors.torch.save_file(tensors, str(root / name))


def test_each_ranks_parts_are_read_in_part_order_and_named_per_tensor(tmp_path):
    a, b, c = torch.zeros(2), torch.ones(3), torch.full((1,), 2.0)
    rank_files(tmp_path, {"model-rank-0-part-10.safetensors": {"c": c},
                          "model-rank-0-part-2.safetensors": {"b": b},
                          "model-rank-1-part-0.safetensors": {"a": a}})
    shards, found = K._read_ranks(files(tmp_path), 2)
    assert [list(s) for s in shards] == [["b", "c"], ["a"]]  # part 2 before part 10
    assert torch.equal(shards[0]["c"], c) and torch.equal(shards[1]["a"], a)
    assert found == [{"b": tmp_path / "model-rank-0-part-2.safetensors",
                      "c": tmp_path / "model-rank-0-part-10.safetensors"},
                     {"a": tmp_path / "model-rank-1-part-0.safetensors"}]
    lazy, found_lazy = K._read_ranks(files(tmp_path), 2, lazy=True)
    assert all(isinstance(s, K.LazyTensors) for s in lazy) and found_lazy == found
    assert [list(s) for s in lazy] == [["b", "c"], ["a"]]
    assert torch.equal(lazy[0]["c"], c) and lazy[0].file_of("c") == found[0]["c"]


def test_rank_files_that_are_misnamed_out_of_range_missing_or_overlapping_are_refused(tmp_path):
    x = {"w": torch.zeros(1)}
    rank_files(tmp_path / "a", {"model-rank-0-part-0.safetensors": x, "rank-1.safetensors": x})
    e = error(lambda: K._read_ranks(files(tmp_path / "a"), 2))
    path = tmp_path / "a" / "rank-1.safetensors"
    assert str(e) == (f"{path}: not named model-rank-{{rank}}-part-{{part}}.safetensors (one "
                      "file per rank, vLLM's sharded-state pattern)")
    assert e.path == str(path)
    rank_files(tmp_path / "b", {"model-rank-0-part-0.safetensors": x,
                                "model-rank-2-part-0.safetensors": x})
    e = error(lambda: K._read_ranks(files(tmp_path / "b"), 2))
    path = tmp_path / "b" / "model-rank-2-part-0.safetensors"
    assert str(e) == f"{path}: rank 2, but the checkpoint is checked at t=2 (ranks 0..1)"
    assert e.path == str(path)
    # the twin: t=3 has a rank 2 (rank 1's file not needed)
    assert len(K._read_ranks(files(tmp_path / "b"), 3, needed=[0, 2])[0]) == 3
    e = error(lambda: K._read_ranks(files(tmp_path / "b"), 3, lazy=True, needed=[1]))
    path = tmp_path / "b" / "model-rank-1-part-0.safetensors"
    assert str(e) == (f"{path}: missing (no model-rank-1-part-*.safetensors for rank 1 of "
                      "t=3)")
    assert e.path == str(path)
    rank_files(tmp_path / "c", {"model-rank-0-part-0.safetensors": x,
                                "model-rank-0-part-1.safetensors": x})
    e = error(lambda: K._read_ranks(files(tmp_path / "c"), 1))
    path = tmp_path / "c" / "model-rank-0-part-1.safetensors"
    assert str(e) == f"{path}: w is also in model-rank-0-part-0.safetensors"
    assert e.path == str(path)
    e = error(lambda: K._read_ranks(files(tmp_path / "c"), 1, lazy=True))
    assert str(e) == f"{path}: w is also in model-rank-0-part-0.safetensors"


def test_only_the_needed_ranks_files_must_be_there(tmp_path):
    x = {"w": torch.zeros(1)}
    rank_files(tmp_path, {"model-rank-1-part-0.safetensors": x,
                          "model-rank-3-part-0.safetensors": x})
    shards, found = K._read_ranks(files(tmp_path), 4, lazy=True, needed=[1, 3])
    assert [list(s) for s in shards] == [[], ["w"], [], ["w"]]
    assert all(isinstance(s, K.LazyTensors) for s in shards) and found[0] == found[2] == {}
    shards, found = K._read_ranks(files(tmp_path), 4, needed=(3, 1))
    assert shards[0] == {} and type(shards[0]) is dict and list(shards[3]) == ["w"]
    assert found == [{}, {"w": tmp_path / "model-rank-1-part-0.safetensors"}, {},
                     {"w": tmp_path / "model-rank-3-part-0.safetensors"}]
    e = error(lambda: K._read_ranks(files(tmp_path), 4, needed=[0, 1]))
    assert "model-rank-0-part-0.safetensors: missing (no model-rank-0-part-*" in str(e)
    e = error(lambda: K._read_ranks(files(tmp_path), 4))  # default: every rank needed
    assert "model-rank-0-part-0.safetensors: missing" in str(e)


# -- torch_dist: keys


@pytest.mark.parametrize(("name", "stacked", "key"), [
    ("decoder.layers.3.self_attention.linear_qkv.weight", True,
     ("decoder.layers.self_attention.linear_qkv.weight", (3,))),
    ("decoder.layers.3.self_attention.linear_qkv.weight", False,
     ("decoder.layers.3.self_attention.linear_qkv.weight", ())),
    ("decoder.layers.12.mlp.experts.linear_fc1.weight10", True,
     ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (12, 10))),
    ("decoder.layers.12.mlp.experts.linear_fc2.weight10", False,
     ("decoder.layers.12.mlp.experts.experts.linear_fc2.weight", (10,))),
    ("decoder.layers.0.mlp.experts.local_experts.11.linear_fc2.weight", True,
     ("decoder.layers.mlp.experts.experts.linear_fc2.weight", (0, 11))),
    ("decoder.layers.5.mlp.experts.local_experts.7.linear_fc1.weight", False,
     ("decoder.layers.5.mlp.experts.experts.linear_fc1.weight", (7,))),
    ("decoder.layers.1.mlp.router.weight", True, ("decoder.layers.mlp.router.weight", (1,))),
    ("embedding.word_embeddings.weight", True, ("embedding.word_embeddings.weight", ())),
    ("decoder.final_layernorm.weight", False, ("decoder.final_layernorm.weight", ())),
    ("model0.decoder.layers.1.mlp.linear_fc1.weight", True,  # not a decoder key: as it is
     ("model0.decoder.layers.1.mlp.linear_fc1.weight", ())),
], ids=lambda v: str(v))
def test_a_tensor_is_kept_under_megatron_cores_torch_dist_key(name, stacked, key):
    """TransformerBlock.sharded_state_dict (layers on a leading axis when homogeneous),
    TEGroupedMLP's weight{j} / SequentialMLP's local_experts.{j} (the expert axis next)."""
    assert K.dist_key(name, stacked=stacked) == key
    if stacked:
        assert K.dist_key(name) == key


def test_torch_dist_tensors_are_megatrons_at_tp_1_with_the_vocabulary_unpadded():
    config = DENSE.replace(vocab=200)
    for where in ("megatron:2", "megatron:tp=2,pp=2", "megatron"):
        pieces = K._dist_pieces(endpoint(where), config)
        (want,) = endpoint("megatron:tp=1,vocab=unpadded").pieces(config)
        assert list(pieces) == list(want)
        shapes = config.param_shapes()
        assert pieces["embedding.word_embeddings.weight"].local_shape(
            shapes["tok_embeddings.weight"]) == (200, 32)
        assert {n: p.local_shape(shapes[p.source]) for n, p in pieces.items()} == {
            n: p.local_shape(shapes[p.source]) for n, p in want.items()}


# -- torch_dist: the chunk tiling check


def chunks(*boxes):
    return [types.SimpleNamespace(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in boxes]


def test_chunks_must_tile_the_tensor_exactly(tmp_path):
    path, key = tmp_path, "k"
    K._check_chunks(path, key, (4, 6), chunks(((0, 0), (4, 6))))
    K._check_chunks(path, key, (4, 6), chunks(((0, 0), (2, 6)), ((2, 0), (2, 3)),
                                              ((2, 3), (2, 3))))
    K._check_chunks(path, key, (4, 6), chunks(((2, 0), (2, 6)), ((0, 0), (2, 6))))
    K._check_chunks(path, key, (0, 6), [])
    outside = [(((0,), (4,)), "[0] of [4]"), (((0, 0, 0), (4, 6, 1)), "[0, 0, 0] of [4, 6, 1]"),
               (((-1, 0), (4, 6)), "[-1, 0] of [4, 6]"), (((0, 0), (5, -1)), "[0, 0] of [5, -1]"),
               (((1, 0), (4, 6)), "[1, 0] of [4, 6]"), (((0, 1), (4, 6)), "[0, 1] of [4, 6]")]
    for box, said in outside:
        e = error(lambda: K._check_chunks(path, key, (4, 6), chunks(box)))
        assert str(e) == f"{path}: torch_dist k: a chunk at {said} lies outside its shape [4, 6]"
        assert e.path == str(path)
    e = error(lambda: K._check_chunks(path, key, (4, 6), chunks(((0, 0), (4, 5)))))
    assert str(e) == f"{path}: torch_dist k: its chunks hold 20 elements of 24"
    assert e.path == str(path)
    e = error(lambda: K._check_chunks(path, key, (4, 6), chunks(
        ((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 3), (2, 2)))))
    assert str(e) == f"{path}: torch_dist k: its chunks hold 22 elements of 24"
    # the volumes sum to the tensor's, yet two overlap and leave a gap
    for boxes, a, b in [((((0, 0), (3, 6)), ((2, 0), (1, 6))), "[0, 0]", "[2, 0]"),
                        ((((0, 0), (2, 4)), ((0, 2), (2, 4)), ((2, 0), (2, 4))),
                         "[0, 0]", "[0, 2]"),
                        ((((1, 1), (1, 1)), ((0, 0), (2, 2)), ((2, 0), (2, 6)), ((0, 2), (2, 3)),
                          ((0, 5), (1, 1))), "[0, 0]", "[1, 1]")]:
        e = error(lambda: K._check_chunks(path, key, (4, 6), chunks(*boxes)))
        assert str(e) == f"{path}: torch_dist k: chunks at {a} and {b} overlap"
        assert e.path == str(path)


# -- torch_dist: the writer


VOCAB = DENSE.replace(vocab=200, name="tiny_meg_v200")  # Megatron pads 200 to 256 at TP 2


def dist_files(step: Path):
    return files(step.parent), step.name


def test_a_torch_dist_checkpoint_holds_the_tracker_megatrons_keys_and_the_common_state(
        tmp_path):
    at = endpoint("megatron:2")
    p = init_params(VOCAB, 1)
    old = os.umask(0o027)
    try:
        step = K.write_megatron_dist(tmp_path / "ckpt", p, at, VOCAB, iteration=3)
    finally:
        os.umask(old)
    out = tmp_path / "ckpt"
    assert step == out / "iter_0000003"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]
    assert (out / K.MEGATRON_TRACKER).read_text() == "3\n"
    assert (step / K.DIST_CONFIG).read_text() == (
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}\n')
    assert {x.name: oct(x.stat().st_mode & 0o777) for x in step.iterdir()} == {
        ".metadata": "0o640", "__0_0.distcp": "0o640", K.DIST_CONFIG: "0o640"}
    f, name = dist_files(step)
    held = K._dist_reader(f, name).read_metadata().state_dict_metadata
    sizes = {k: list(v.size) for k, v in held.items() if hasattr(v, "size")}
    assert sizes == {
        "embedding.word_embeddings.weight": [256, 32],  # 200 rows padded to 128 x 2
        "output_layer.weight": [256, 32],
        "decoder.final_layernorm.weight": [32],
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": [2, 32],
        "decoder.layers.self_attention.linear_qkv.weight": [2, 96, 32],
        "decoder.layers.self_attention.linear_proj.weight": [2, 32, 64],
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": [2, 32],
        "decoder.layers.mlp.linear_fc1.weight": [2, 128, 32],
        "decoder.layers.mlp.linear_fc2.weight": [2, 32, 64],
    }
    assert set(held) == {*sizes, K.DIST_COMMON}
    emb = K._dist_load(f, name, {"embedding.word_embeddings.weight": torch.empty(256, 32)})[
        "embedding.word_embeddings.weight"]
    assert torch.equal(emb[:200], p["tok_embeddings.weight"])
    assert torch.equal(emb[200:], torch.full((56, 32), 7.0))  # the padding rows: 7, not 0
    common = K.dist_common(f, name)
    assert sorted(common) == ["args", "checkpoint_version", "iteration"]
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 3
    assert vars(common["args"]) == vars(K.megatron_args(VOCAB, at, ckpt_format="torch_dist",
                                                        padded_vocab_size=256))
    back = K.megatron_weights(out, None, VOCAB)
    assert all(torch.equal(back[n], x) for n, x in p.items())


def test_unpadded_or_per_layer_a_torch_dist_checkpoint_keeps_its_rows_and_layers(tmp_path):
    p = init_params(VOCAB, 1)
    step = K.write_megatron_dist(tmp_path / "u", p, endpoint("megatron:tp=2,vocab=unpadded"),
                                 VOCAB, stacked=False)
    f, name = dist_files(step)
    held = K._dist_reader(f, name).read_metadata().state_dict_metadata
    assert list(held["embedding.word_embeddings.weight"].size) == [200, 32]
    assert list(held["decoder.layers.1.self_attention.linear_qkv.weight"].size) == [96, 32]
    assert not any(k.startswith("decoder.layers.self") for k in held)
    assert vars(K.dist_common(f, name)["args"])["padded_vocab_size"] == 200
    back = K.megatron_weights(step, endpoint("megatron:2"), VOCAB)
    assert all(torch.equal(back[n], x) for n, x in p.items())
    moe = init_params(MOE, 2)
    step = K.write_megatron_dist(tmp_path / "m", moe, endpoint("megatron:tp=1,ep=2"), MOE)
    f, name = dist_files(step)
    held = K._dist_reader(f, name).read_metadata().state_dict_metadata
    assert list(held["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == [
        2, 4, 32, 32]
    assert list(held["decoder.layers.mlp.experts.experts.linear_fc2.weight"].size) == [
        2, 4, 32, 16]
    fc2 = K._dist_load(f, name, {"decoder.layers.mlp.experts.experts.linear_fc2.weight":
                                 torch.empty(2, 4, 32, 16)})[
        "decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    for i, j in ((0, 0), (1, 3), (1, 1)):  # (layer, expert); canonical down is [d, E * F]
        assert torch.equal(fc2[i, j], moe[f"layers.{i}.experts.down.weight"][:, 16 * j:][:, :16])
    back = K.megatron_weights(tmp_path / "m", None, MOE)
    assert all(torch.equal(back[n], x) for n, x in moe.items())


def test_the_torch_dist_writer_refuses_another_convention_or_a_used_directory(tmp_path):
    p = init_params(DENSE, 0)
    vllm = endpoint("vllm:2")
    e = error(lambda: K.write_megatron_dist(tmp_path / "a", p, vllm, DENSE))
    assert str(e) == f"{vllm}: Megatron's torch_dist format holds a megatron endpoint"
    assert e.path == str(tmp_path / "a") and not (tmp_path / "a").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    e = error(lambda: K.write_megatron_dist(tmp_path / "used", p, endpoint("megatron"), DENSE))
    assert str(e) == f"{tmp_path / 'used'}: not a new or empty directory"
    assert e.path == str(tmp_path / "used")
    (tmp_path / "file").write_text("")
    e = error(lambda: K.write_megatron_dist(tmp_path / "file", p, endpoint("megatron"), DENSE))
    assert str(e) == f"{tmp_path / 'file'}: not a new or empty directory"
    (tmp_path / "empty").mkdir()  # the twin
    assert K.write_megatron_dist(tmp_path / "empty", p, endpoint("megatron"), DENSE) == (
        tmp_path / "empty" / "iter_0000001")


# -- torch_dist: the reader's refusals


def dcp_save(directory: Path, state, common=None):
    """``state`` saved as Megatron saves a torch_dist iteration: DCP's files, the common
    state object (``common``: its BytesIO, default ``[{"args": Namespace(), ...}]``),
    ``metadata.json``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    directory.mkdir(parents=True)
    if common is None:
        common = io.BytesIO()
        torch.save([{"args": argparse.Namespace(), "iteration": 7}], common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**state, **({K.DIST_COMMON: common} if common is not False else {})},
                 storage_writer=FileSystemWriter(str(directory)),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    (directory / K.DIST_CONFIG).write_text('{"sharded_backend": "torch_dist"}')
    return directory


def dist_state(tmp_path, config, **kwargs):
    """Every tensor of a torch_dist checkpoint the harness wrote, by key."""
    step = K.write_megatron_dist(tmp_path / "src", init_params(config, 0),
                                 endpoint("megatron"), config, **kwargs)
    f, name = dist_files(step)
    held = K._dist_reader(f, name).read_metadata().state_dict_metadata
    wanted = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
              for k, v in held.items() if k != K.DIST_COMMON}
    return K._dist_load(f, name, wanted)


def refusal(step, config=DENSE):
    e = error(lambda: K.megatron_weights(step, None, config))
    assert e.path == str(step)
    return str(e)


def test_a_torch_dist_checkpoint_missing_a_key_or_holding_bytes_for_a_tensor_is_refused(
        tmp_path):
    state = dist_state(tmp_path, DENSE)
    fc2 = "decoder.layers.mlp.linear_fc2.weight"
    step = dcp_save(tmp_path / "a", {k: v for k, v in state.items() if k != fc2})
    assert refusal(step) == (f"{step}: torch_dist holds no {fc2} (nor decoder.layers.0.mlp."
                             "linear_fc2.weight), where decoder.layers.0.mlp.linear_fc2.weight "
                             "is kept")
    step = dcp_save(tmp_path / "b", {**state, fc2: io.BytesIO(b"x")})
    assert refusal(step) == f"{step}: {fc2} is not a tensor"
    # the twin: per layer, each key is found under its own name
    per_layer = {k: v for k, v in state.items() if k != fc2}
    per_layer.update({f"decoder.layers.{i}.mlp.linear_fc2.weight": state[fc2][i]
                      for i in range(2)})
    back = K.megatron_weights(dcp_save(tmp_path / "c", per_layer), None, DENSE)
    assert torch.equal(back["layers.1.down.weight"], init_params(DENSE, 0)["layers.1.down.weight"])
    step = dcp_save(tmp_path / "d", state)
    (step / K.DIST_CONFIG).write_text('{"sharded_backend": "zarr"}')
    e = error(lambda: K.megatron_weights(step, None, DENSE))
    assert str(e) == (f"{step / K.DIST_CONFIG}: sharded_backend 'zarr'; the harness reads "
                      "torch_dist (Megatron's zarr format is deprecated there)")
    assert e.path == str(step / K.DIST_CONFIG)


def test_a_torch_dist_tensor_of_another_shape_is_refused_naming_the_key_and_the_parameter(
        tmp_path):
    state = dist_state(tmp_path, DENSE)
    fc2, emb = "decoder.layers.mlp.linear_fc2.weight", "embedding.word_embeddings.weight"
    cases = [
        ({fc2: torch.zeros(3, 32, 64)}, (f"torch_dist {fc2} has shape [3, 32, 64]; decoder.layers."
         "0.mlp.linear_fc2.weight declares [32, 64] at index [0], on leading axes of [2] (the "
         "layers, the experts)")),
        ({fc2: torch.zeros(2, 32, 63)}, (f"torch_dist {fc2} has shape [2, 32, 63]; decoder.layers."
         "0.mlp.linear_fc2.weight declares [32, 64] at index [0], on leading axes of [2] (the "
         "layers, the experts)")),
        ({emb: torch.zeros(255, 32)}, (f"torch_dist {emb} has shape [255, 32]; {emb} declares "
         "[256, 32]")),
        ({emb: torch.zeros(256, 31)}, (f"torch_dist {emb} has shape [256, 31]; {emb} declares "
         "[256, 32]")),
        ({"decoder.final_layernorm.weight": torch.zeros(33)}, ("torch_dist decoder.final_"
         "layernorm.weight has shape [33]; decoder.final_layernorm.weight declares [32]")),
    ]
    for i, (changed, said) in enumerate(cases):
        step = dcp_save(tmp_path / f"c{i}", {**state, **changed})
        assert refusal(step) == f"{step}: {said}"
    # the twin: more vocabulary rows than the model's (the saving run's padding) are read
    # and left out, up to 128 x 1024 of them
    p = init_params(DENSE, 0)
    padded = torch.cat([state[emb], torch.full((1, 32), 5.0)])
    back = K.megatron_weights(dcp_save(tmp_path / "rows", {**state, emb: padded}), None, DENSE)
    assert torch.equal(back["tok_embeddings.weight"], p["tok_embeddings.weight"])
    for rows, read in ((256 + 128 * 1024 - 1, True), (256 + 128 * 1024, False)):
        step = dcp_save(tmp_path / f"rows{rows}", state)  # its index says more rows
        index = pickle.loads((step / K.DIST_METADATA).read_bytes())
        md = index.state_dict_metadata[emb]
        md.size = torch.Size([rows, 32])
        md.chunks[0].sizes = md.size
        (step / K.DIST_METADATA).write_bytes(pickle.dumps(index))
        said = refusal(step)
        if read:  # past the shape check: DCP finds the data short
            assert said.startswith(f"{step}: not a readable torch_dist checkpoint")
        else:
            assert said == (f"{step}: torch_dist {emb} has shape [{rows}, 32]; {emb} declares "
                            "[256, 32]")


def test_per_layer_expert_keys_are_checked_on_the_expert_axis(tmp_path):
    state = dist_state(tmp_path, MOE, stacked=False)
    fc1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    assert list(state[fc1].shape) == [4, 32, 32]
    step = dcp_save(tmp_path / "a", {**state, fc1: state[fc1][:3]})  # three experts of four
    assert refusal(step, MOE) == (
        f"{step}: torch_dist {fc1} has shape [3, 32, 32]; decoder.layers.1.mlp.experts."
        "linear_fc1.weight3 declares [32, 32] at index [3]")
    stacked = dist_state(tmp_path / "s", MOE)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    step = dcp_save(tmp_path / "b", {**stacked, key: stacked[key][:, :3]})
    assert refusal(step, MOE) == (
        f"{step}: torch_dist {key} has shape [2, 3, 32, 32]; decoder.layers.0.mlp.experts."
        "linear_fc1.weight0 declares [32, 32] at index [0, 0], on leading axes of [2, 4] (the "
        "layers, the experts)")
    wide = torch.cat([stacked[key], stacked[key][:, :1]], dim=1)  # five experts of four
    step = dcp_save(tmp_path / "c", {**stacked, key: wide})
    assert refusal(step, MOE).endswith("on leading axes of [2, 4] (the layers, the experts)")


# -- torch_dist: the common state, DCP's index and its loads


def common_bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf


def test_the_common_state_is_read_from_its_object_or_an_older_common_pt(tmp_path):
    state = {"decoder.final_layernorm.weight": torch.ones(32)}
    args = argparse.Namespace(hidden_size=32)
    for i, common in enumerate([common_bytes([{"args": args, "iteration": 7}]),
                                common_bytes({"args": args, "iteration": 7})]):
        step = dcp_save(tmp_path / f"c{i}", state, common)
        got = K.dist_common(*dist_files(step))
        assert sorted(got) == ["args", "iteration"] and vars(got["args"]) == vars(args)
        f, name = dist_files(step)
        reader = K._dist_reader(f, name)
        assert K.dist_common(f, name, reader)["iteration"] == 7  # a reader given is used
    old = dcp_save(tmp_path / "old", state, False)  # no object: Megatron's older common.pt
    torch.save({"args": args, "iteration": 9}, old / K.DIST_COMMON_LEGACY)
    assert K.dist_common(*dist_files(old))["iteration"] == 9
    f = files(old)  # the iteration itself as the root: step ""
    assert K.dist_common(f, "")["iteration"] == 9
    (old / K.DIST_COMMON_LEGACY).write_bytes(b"not a pickle")
    e = error(lambda: K.dist_common(*dist_files(old)))
    assert str(e).startswith(f"{old / K.DIST_COMMON_LEGACY}: not a readable torch checkpoint")


def test_a_common_state_missing_or_not_a_dict_is_refused(tmp_path):
    state = {"decoder.final_layernorm.weight": torch.ones(32)}
    step = dcp_save(tmp_path / "none", state, False)
    e = error(lambda: K.dist_common(*dist_files(step)))
    assert str(e) == (f"{step}: no common state (neither common.pt nor a "
                      "common_state/shard_0_1 object)")
    assert e.path == str(step)
    for i, held in enumerate([[], [3], (1, 2)]):
        step = dcp_save(tmp_path / f"c{i}", state, common_bytes(held))
        e = error(lambda: K.dist_common(*dist_files(step)))
        kind = type(held[0] if held and isinstance(held, list) else held).__name__
        assert str(e) == f"{step}: the common state is a {kind}, not a dict"
        assert e.path == str(step)
    step = dcp_save(tmp_path / "evil", state, common_bytes([{"args": types.SimpleNamespace(
        f=K.MegatronObject)}]))
    e = error(lambda: K.dist_common(*dist_files(step)))
    assert str(e).startswith(f"{step / K.DIST_COMMON}: refused, its pickle holds more than "
                             "tensors and Megatron's own records (Unsupported global: GLOBAL "
                             "weight_sync_bench.conventions.checkpoint.MegatronObject")


def test_dcps_index_is_read_once_per_reader_and_names_only_its_own_records(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    step = dcp_save(tmp_path / "a", {"w": torch.ones(2, dtype=torch.bfloat16)})
    f, name = dist_files(step)
    reader = K._dist_reader(f, name)
    first = reader.read_metadata()
    assert isinstance(first, Metadata) and reader.read_metadata() is first  # parsed once
    assert (reader.files, reader.step, Path(reader.path)) == (f, name, step)
    reader.load_id = "x"
    assert reader.read_metadata().storage_meta.load_id == "x"
    assert K._dist_load(f, name, {"w": torch.zeros(2, dtype=torch.bfloat16)})["w"].tolist() == [
        1.0, 1.0]
    metadata = (step / K.DIST_METADATA).read_bytes()
    cases = [
        (pickle.dumps({"a": 1}), f"{step / K.DIST_METADATA}: not DCP's metadata (a dict)"),
        (pickle.dumps(Metadata(state_dict_metadata={}, storage_data=None)),
         f"{step / K.DIST_METADATA}: not DCP's metadata (a Metadata)"),
        (pickle.dumps(torch.load), (f"{step / K.DIST_METADATA}: refused, not DCP's metadata "
         "(Unsupported global: GLOBAL torch.serialization.load)")),
        (pickle.dumps(torch.Tensor), (f"{step / K.DIST_METADATA}: refused, not DCP's metadata "
         "(Unsupported global: GLOBAL torch.Tensor)")),  # of torch, only its dtypes
        (pickle.dumps([torch.bfloat16, torch.Size([2])]),
         f"{step / K.DIST_METADATA}: not DCP's metadata (a list)"),  # the twin: they load
        (b"", None),
    ]
    for data, said in cases:
        (step / K.DIST_METADATA).write_bytes(data)
        e = error(lambda: K._dist_reader(f, name).read_metadata())
        if said is not None:
            assert str(e) == said
        else:
            assert str(e).startswith(f"{step / K.DIST_METADATA}: refused, not DCP's metadata (")
        assert e.path == str(step / K.DIST_METADATA)
    (step / K.DIST_METADATA).unlink()
    e = error(lambda: K._dist_reader(f, name).read_metadata())
    assert str(e) == f"{step / K.DIST_METADATA}: missing (DCP's index of the tensors)"
    (step / K.DIST_METADATA).write_bytes(metadata)
    (step / "__0_0.distcp").rename(step / "kept")
    e = error(lambda: K._dist_reader(f, name).read_metadata())
    assert str(e) == f"{step / '__0_0.distcp'}: missing (.metadata names it)"
    (step / "kept").rename(step / "__0_0.distcp")
    assert K._dist_reader(files(step), "").read_metadata()  # the iteration as the root


def test_an_index_without_storage_meta_gets_one_and_bytes_are_loaded_as_bytes(tmp_path):
    step = dcp_save(tmp_path / "a", {"w": torch.ones(2)})
    f, name = dist_files(step)
    metadata = pickle.loads((step / K.DIST_METADATA).read_bytes())
    metadata.storage_meta = None
    (step / K.DIST_METADATA).write_bytes(pickle.dumps(metadata))
    assert K._dist_reader(f, name).read_metadata().storage_meta is not None
    raw = K._dist_load(f, name, {K.DIST_COMMON: io.BytesIO(b"z" * 10000)})[K.DIST_COMMON]
    assert not raw.getvalue().startswith(b"z")  # the BytesIO given, emptied and filled
    held = K._megatron_pickle(K._megatron_pickle(raw, step), step)
    assert held[0]["iteration"] == 7


def test_a_failed_dcp_load_is_a_checkpoint_error_naming_the_iteration(tmp_path):
    step = dcp_save(tmp_path / "a", {"w": torch.ones(2)})
    f, name = dist_files(step)
    e = error(lambda: K._dist_load(f, name, {"v": torch.zeros(2)}))
    assert str(e).startswith(f"{step}: not a readable torch_dist checkpoint, truncated or "
                             "corrupt (")
    assert e.path == str(step)
    data = step / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:8])
    e = error(lambda: K._dist_load(f, name, {"w": torch.zeros(2)}))
    assert str(e).startswith(f"{step}: not a readable torch_dist checkpoint, truncated or "
                             "corrupt (")
    data.unlink()
    e = error(lambda: K._dist_load(f, name, {"w": torch.zeros(2)}))
    assert str(e).startswith(f"{step}: not a readable torch_dist checkpoint, truncated or "
                             "corrupt (AssertionError: ")
    assert f"{data}: missing (.metadata names it)" in str(e)
    e = error(lambda: K._dist_load(f, name, {"w": torch.zeros(2)}, K._dist_reader(f, name)))
    assert f"{data}: missing (.metadata names it)" in str(e)


def test_a_stage_another_cleanup_removed_meanwhile_is_no_error(tmp_path, monkeypatch):
    """Two writers cleaning up at once: the stage the other removed between the listing and
    the removal is no error."""
    gone = tmp_path / ".ck.wsb-partial-999999999"
    gone.mkdir()

    def kill(pid, sig):  # the other writer's cleanup got there first
        gone.rmdir()
        raise ProcessLookupError

    monkeypatch.setattr(os, "kill", kill)
    K._stale_stages(tmp_path / "ck")
    assert not gone.exists()


def test_under_a_group_writable_umask_files_and_directories_get_the_modes_it_gives(tmp_path):
    old = os.umask(0o002)
    try:
        step, at, _ = save_legacy(tmp_path / "l", DENSE, "megatron:2")
        dist = K.write_megatron_dist(tmp_path / "d", init_params(DENSE, 0), at, DENSE)
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in step.iterdir()} == {"0o775"}
    assert {oct(p.stat().st_mode & 0o777) for p in step.rglob("*.pt")} == {"0o664"}
    assert {oct(p.stat().st_mode & 0o777) for p in dist.iterdir()} == {"0o664"}
    assert oct((tmp_path / "d" / K.MEGATRON_TRACKER).stat().st_mode & 0o777) == "0o664"


def test_a_tracker_over_the_bound_is_named_as_the_directory_names_it(tmp_path, monkeypatch):
    from weight_sync_bench import files as wsb_files
    from weight_sync_bench.errors import UnsafeFile

    (tmp_path / "real.txt").write_text("1234567\n")
    (tmp_path / K.MEGATRON_TRACKER).symlink_to(tmp_path / "real.txt")
    assert K._megatron_step(files(tmp_path)) == "iter_1234567"  # the twin: inside, it reads
    monkeypatch.setattr(wsb_files, "JSON_LIMIT", 4)
    e = error(lambda: K._megatron_step(files(tmp_path)), UnsafeFile)
    assert str(e).startswith(f"{tmp_path / K.MEGATRON_TRACKER}: ")


def test_a_rank_file_that_is_truncated_refused_or_empty_is_named(tmp_path):
    step, at, _ = save_legacy(tmp_path, DENSE, "megatron:2")
    path = step / "mp_rank_01" / K.MEGATRON_FILE
    state = torch.load(path, weights_only=False)
    torch.save({**state, "model": {}}, path)
    e = error(lambda: K.megatron_weights(tmp_path / "ckpt", at, DENSE))
    # a rank with no tensors at all: named by the checkpoint's directory
    assert str(e).startswith(f"{tmp_path / 'ckpt'}: {at} rank 1 is missing ")
    torch.save({**state, "model": {"x": K.MegatronObject}}, path)
    e = error(lambda: K.megatron_weights(tmp_path / "ckpt", at, DENSE))
    assert str(e).startswith(f"{path}: refused, its pickle holds more than tensors")
    path.write_bytes(path.read_bytes()[:100])
    e = error(lambda: K.megatron_weights(tmp_path / "ckpt", at, DENSE))
    assert str(e).startswith(f"{path}: not a readable torch checkpoint") and e.path == str(path)


def test_a_rank_not_needed_reads_as_an_empty_mapping_that_answers_like_one(tmp_path):
    rank_files(tmp_path, {"model-rank-1-part-0.safetensors": {"w": torch.zeros(1)}})
    shards, _ = K._read_ranks(files(tmp_path), 2, lazy=True, needed=[1])
    assert shards[0].get("w") is None and "w" not in shards[0] and len(shards[0]) == 0
    with pytest.raises(KeyError):
        shards[0]["w"]
    assert shards[1].file_of("w") == tmp_path / "model-rank-1-part-0.safetensors"


def test_rank_tensors_are_a_plain_dict_unless_read_lazily(tmp_path):
    rank_files(tmp_path, {"model-rank-0-part-0.safetensors": {"w": torch.zeros(1)}})
    assert type(K._read_ranks(files(tmp_path), 1)[0][0]) is dict
    assert type(K._read_ranks(files(tmp_path), 1, lazy=True)[0][0]) is K.LazyTensors


def test_the_data_files_dcps_index_names_are_checked_by_name_and_storage(tmp_path):
    """Each ``relative_path`` a plain ``__<rank>_<n>.distcp`` in the directory, stored plain,
    a regular file there; each refusal in full, naming ``.metadata``; the twin reads."""
    from dataclasses import replace as dc_replace

    from weight_sync_bench.errors import UnsafeFile

    step = dcp_save(tmp_path / "a", {"w": torch.ones(2)})
    f, name = dist_files(step)
    metadata = (step / K.DIST_METADATA).read_bytes()
    index = pickle.loads(metadata)
    assert K._dist_reader(f, name).read_metadata().storage_meta.save_id == (
        index.storage_meta.save_id)  # the saver's record kept, not replaced
    for rel, said in [("../00.distcp", "'../00.distcp'"), ("x.distcp", "'x.distcp'"),
                      ("__0_0.distcpx", "'__0_0.distcpx'"), (None, "None"), (5, "None")]:
        edited = pickle.loads(metadata)
        edited.storage_data = {k: 5 if rel == 5 else dc_replace(v, relative_path=rel)
                               for k, v in edited.storage_data.items()}  # 5: no record at all
        (step / K.DIST_METADATA).write_bytes(pickle.dumps(edited))
        e = error(lambda: K._dist_reader(f, name).read_metadata())
        assert str(e) == (f"{step / K.DIST_METADATA}: names the data file {said}; DCP's are "
                          "__<rank>_<n>.distcp inside the directory")
        assert e.path == str(step / K.DIST_METADATA)
    edited = pickle.loads(metadata)
    edited.storage_data = {k: dc_replace(v, transform_descriptors=["zstd", "x"])
                           for k, v in edited.storage_data.items()}
    (step / K.DIST_METADATA).write_bytes(pickle.dumps(edited))
    e = error(lambda: K._dist_reader(f, name).read_metadata())
    assert str(e) == (f"{step / K.DIST_METADATA}: __0_0.distcp is stored through ['zstd', 'x']; "
                      "the harness reads plain DCP data only (Megatron writes it)")
    assert e.path == str(step / K.DIST_METADATA)
    (step / K.DIST_METADATA).write_bytes(metadata)
    outside = tmp_path.parent / f"{tmp_path.name}-out.distcp"  # outside the root
    (step / "__0_0.distcp").rename(outside)
    (step / "__0_0.distcp").symlink_to(outside)
    e = error(lambda: K._dist_reader(f, name).read_metadata(), UnsafeFile)
    assert str(e).startswith(f"{step / '__0_0.distcp'}: a symlink (.metadata names it) to ")


def test_a_common_state_whose_bytes_are_corrupt_is_named_by_its_object(tmp_path):
    step = dcp_save(tmp_path / "a", {"w": torch.ones(2)})
    index = pickle.loads((step / K.DIST_METADATA).read_bytes())
    (info,) = [v for k, v in index.storage_data.items() if k.fqn == K.DIST_COMMON]
    data = bytearray((step / info.relative_path).read_bytes())
    data[info.offset:info.offset + info.length] = b"\0" * info.length
    (step / info.relative_path).write_bytes(bytes(data))
    e = error(lambda: K.dist_common(*dist_files(step)))
    assert str(e).startswith(f"{step / K.DIST_COMMON}: refused, its pickle holds more than "
                             "tensors and Megatron's own records (Unsupported operand 0)")
    assert e.path == str(step / K.DIST_COMMON)


def test_a_torch_dist_checkpoints_args_and_chunks_are_checked_naming_the_iteration(tmp_path):
    state = dist_state(tmp_path, DENSE)
    step = dcp_save(tmp_path / "a", state, common_bytes([{"args": argparse.Namespace(
        hidden_size=64)}]))
    assert refusal(step) == (f"{step}: its args say hidden_size=64, the config checked "
                             "(tiny_meg) has 32")
    step = dcp_save(tmp_path / "b", state)
    index = pickle.loads((step / K.DIST_METADATA).read_bytes())
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    index.state_dict_metadata[qkv].chunks = []
    (step / K.DIST_METADATA).write_bytes(pickle.dumps(index))
    assert refusal(step) == f"{step}: torch_dist {qkv}: its chunks hold 0 elements of 6144"


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
def test_the_local_specs_pre_mlp_norm_is_read_where_it_saves_it(tmp_path, stacked):
    """megatron-core's local layer spec saves an MoE layer's pre-MLP norm under
    ``mlp.linear_fc1.layer_norm_weight`` (``get_gpt_layer_local_spec``'s
    ``sharded_state_dict_keys_map``): read from there, layer by layer."""
    state = dist_state(tmp_path, MOE, stacked=stacked)
    moved = {}
    for key, x in state.items():
        if "pre_mlp_layernorm" in key:
            key = key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        moved[key] = x
    assert moved.keys() != state.keys()
    back = K.megatron_weights(dcp_save(tmp_path / "a", moved), None, MOE)
    p = init_params(MOE, 0)
    assert not torch.equal(p["layers.0.ffn_norm.weight"], p["layers.1.ffn_norm.weight"])
    assert all(torch.equal(back[n], x) for n, x in p.items())


def test_chunk_tilings_at_the_edges_of_the_overlap_check(tmp_path):
    """Boxes that only touch tile; an empty chunk is no chunk (a rank holding none of the
    tensor); offsets and sizes each of the tensor's rank; an overlap after a box the sorted
    scan leaves early is still found."""
    path, key = tmp_path, "k"
    K._check_chunks(path, key, (4, 6), chunks(((0, 0), (2, 6)), ((2, 0), (1, 3)),
                                              ((2, 3), (2, 3)), ((3, 0), (1, 3))))
    K._check_chunks(path, key, (4, 6), chunks(((0, 0), (4, 6)), ((0, 0), (0, 6)),
                                              ((4, 6), (0, 0))))
    for box, said in [(((0, 0, 0), (4, 6)), "[0, 0, 0] of [4, 6]"),
                      (((0, 0), (4, 6, 1)), "[0, 0] of [4, 6, 1]")]:
        e = error(lambda: K._check_chunks(path, key, (4, 6), chunks(box)))
        assert str(e) == f"{path}: torch_dist k: a chunk at {said} lies outside its shape [4, 6]"
    for boxes, a, b in [
            ((((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 3), (1, 3)), ((3, 0), (1, 3))),
             "[2, 0]", "[3, 0]"),
            ((((0, 0), (3, 1)), ((0, 1), (2, 5)), ((2, 0), (1, 6)), ((3, 0), (1, 5))),
             "[0, 0]", "[2, 0]")]:
        e = error(lambda: K._check_chunks(path, key, (4, 6), chunks(*boxes)))
        assert str(e) == f"{path}: torch_dist k: chunks at {a} and {b} overlap"


def test_a_torch_dist_tensor_is_read_in_its_stored_dtype_or_refused_if_none_can_hold_it(
        tmp_path, monkeypatch):
    p = {n: x.to(torch.bfloat16) for n, x in init_params(DENSE, 0).items()}
    step = K.write_megatron_dist(tmp_path / "bf16", p, endpoint("megatron"), DENSE)
    back = K.megatron_weights(step, None, DENSE)
    assert {x.dtype for x in back.values()} == {torch.bfloat16}
    assert all(torch.equal(back[n], x) for n, x in p.items())
    real = torch.empty

    def empty(*size, **kwargs):  # a machine without the memory for the final norm
        if size == ((32,),) and kwargs.get("dtype") == torch.bfloat16:
            raise MemoryError
        return real(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    norm = "decoder.final_layernorm.weight"
    assert refusal(step) == f"{step}: torch_dist {norm} of shape [32] cannot be held (MemoryError)"


def test_a_vocabulary_padded_to_more_rows_than_the_hidden_size_is_padded(tmp_path):
    config = DENSE.replace(vocab=64, d_model=160, name="tiny_meg_wide")  # 64 -> 128 rows < 160
    step = K.write_megatron_dist(tmp_path / "w", init_params(config, 0), endpoint("megatron"),
                                 config)
    held = K._dist_reader(*dist_files(step)).read_metadata().state_dict_metadata
    assert list(held["embedding.word_embeddings.weight"].size) == [128, 160]


def test_an_index_record_that_is_not_dcps_storage_info_is_read_as_one_and_refused_on_load(
        tmp_path):
    """A crafted ``.metadata`` whose storage records are another allowed class with a
    plain ``relative_path``: the index parses (no transform stated), and the load is a
    ``CheckpointError`` naming the iteration, never a bare AttributeError."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    step = dcp_save(tmp_path / "a", {"w": torch.ones(2)})
    f, name = dist_files(step)
    index = pickle.loads((step / K.DIST_METADATA).read_bytes())

    def record():
        r = StorageMeta()
        r.relative_path = "__0_0.distcp"
        return r

    index.storage_data = {k: record() for k in index.storage_data}
    (step / K.DIST_METADATA).write_bytes(pickle.dumps(index))
    assert K._dist_reader(f, name).read_metadata().storage_data
    e = error(lambda: K._dist_load(f, name, {"w": torch.zeros(2)}))
    assert str(e).startswith(f"{step}: not a readable torch_dist checkpoint")


# ---- three bugs the pass found, and the stage options the args did not record -------------

def test_a_release_checkpoint_is_read_from_release(tmp_path):
    """Megatron-LM ``training/checkpointing.py::read_metadata``: the tracker's text,
    stripped, is an iteration or ``release`` (then the directory is ``release/``). It was
    compared as bytes with the str "release", so every release checkpoint was refused
    ("b'release' is neither an iteration nor 'release'")."""
    at = endpoint("megatron:2")
    step = K.write_megatron_legacy(tmp_path / "ckpt",
                                   materialize(at.pieces(DENSE), init_params(DENSE, 0)),
                                   at, DENSE)
    step.rename(step.parent / "release")
    (tmp_path / "ckpt" / K.MEGATRON_TRACKER).write_text("release\n")
    back = K.megatron_weights(tmp_path / "ckpt", at, DENSE)
    assert all(torch.equal(back[n], x) for n, x in init_params(DENSE, 0).items())
    (tmp_path / "ckpt" / K.MEGATRON_TRACKER).write_text("relea5e\n")  # the twin
    with pytest.raises(K.CheckpointError, match="'relea5e' is neither an iteration"):
        K.megatron_weights(tmp_path / "ckpt", at, DENSE)
    (tmp_path / "ckpt" / K.MEGATRON_TRACKER).write_bytes(b"\xff7\n")  # not UTF-8: named
    with pytest.raises(K.CheckpointError, match="'\ufffd7' is neither an iteration"):
        K.megatron_weights(tmp_path / "ckpt", at, DENSE)


def test_the_iteration_directory_is_traversable(tmp_path):
    """Both writers' ``iter_*`` directory: it was given the file mode (0o644 under umask
    022), with no x bit, so only root could open the files in it."""
    at = endpoint("megatron:2")
    old = os.umask(0o022)
    try:
        legacy = K.write_megatron_legacy(
            tmp_path / "l", materialize(at.pieces(DENSE), init_params(DENSE, 0)), at, DENSE)
        dist = K.write_megatron_dist(tmp_path / "d", init_params(DENSE, 0), at, DENSE)
    finally:
        os.umask(old)
    assert oct(legacy.stat().st_mode & 0o777) == "0o755"
    assert oct(dist.stat().st_mode & 0o777) == "0o755"
    assert oct((tmp_path / "l" / K.MEGATRON_TRACKER).stat().st_mode & 0o777) == "0o644"


def test_expert_tp_wider_than_tp_is_refused_in_the_legacy_format(tmp_path):
    """``megatron:tp=1,ep=2,etp=2``: ranks 0 and 1 have one (TP, PP, EP) rank, hence one
    ``mp_rank_00_000`` file, but hold different expert-TP halves. The writer kept rank 0's
    file only and the reader handed it to rank 1 too: four expert parameters read back
    wrong, with no error. Both now refuse the endpoint; data-parallel replicas (``tp=2,
    ep=2,etp=1``: ranks sharing a file hold the same tensors) still write and read."""
    at = endpoint("megatron:tp=1,ep=2,etp=2")
    full = init_params(MOE, 0)
    want = "ranks 0 and 1 hold different tensors, but Megatron's legacy format names both"
    with pytest.raises(K.CheckpointError, match=want) as info:
        K.write_megatron_legacy(tmp_path / "c", materialize(at.pieces(MOE), full), at, MOE)
    assert info.value.path == str(tmp_path / "c")
    assert not (tmp_path / "c").exists()
    ok = endpoint("megatron:2")
    K.write_megatron_legacy(tmp_path / "ok", materialize(ok.pieces(MOE), full), ok, MOE)
    with pytest.raises(K.CheckpointError, match=want) as info:
        K.megatron_weights(tmp_path / "ok", at, MOE)
    assert info.value.path == str(tmp_path / "ok")
    replicas = endpoint("megatron:tp=2,ep=2,etp=1")
    K.write_megatron_legacy(tmp_path / "r", materialize(replicas.pieces(MOE), full),
                            replicas, MOE)
    back = K.megatron_weights(tmp_path / "r", None, MOE)
    assert all(torch.equal(back[n], x) for n, x in full.items())


@pytest.mark.parametrize("where", ["megatron:tp=1,pp=2,vpp=2", "megatron:tp=2,ep=2,etp=1",
                                   "megatron:tp=1,pp=2,pp_first=1",
                                   "megatron:tp=1,pp=2,pp_last=1",
                                   "megatron:tp=1,pp=2,pp_account=both"])
def test_a_harness_written_checkpoint_reads_back_at_the_degrees_it_states(tmp_path, where):
    """The args record every option ``saved_at`` reads (Megatron's names): virtual stages,
    an uneven first stage, the embedding and loss counted, expert-TP. Before, a checkpoint
    written at ``vpp=2`` read back as saved at ``megatron:tp=1,pp=2`` and was refused."""
    config = MOE if "ep=" in where else DENSE.replace(n_layers=4)
    at = endpoint(where)
    full = init_params(config, 0)
    step = K.write_megatron_legacy(tmp_path / "c", materialize(at.pieces(config), full), at,
                                   config)
    assert endpoint(K.saved_at(K._Files(tmp_path / "c", ()), step.name)) == at
    back = K.megatron_weights(tmp_path / "c", None, config)
    assert all(torch.equal(back[n], x) for n, x in full.items())

"""How ``conventions.checkpoint`` opens a checkpoint's files (issue 30, the mutation pass over
the untrusted-file side of ``conventions/checkpoint.py``).

A checkpoint directory is untrusted input: every file is opened only once
``files.inside`` allows it, a file that is missing, not JSON, not safetensors or not a
torch checkpoint is a ``CheckpointError`` naming it and why, and a pickle is loaded with
``weights_only=True``: Megatron's own classes become inert ``MegatronObject`` stand-ins,
the stdlib and numpy types Megatron's ``safe_globals.SAFE_GLOBALS`` allows load, any other
global is refused by name and nothing in the file runs. Each error is read whole, each
refusal beside its twin that reads."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import re
import signal
import sys
import types
from pathlib import Path

import numpy
import pytest
import safetensors.torch
import torch

from weight_sync_bench.conventions import checkpoint as K
from weight_sync_bench.errors import CheckpointError, UnsafeFile

RAN = []


def ran(*args):  # what a malicious pickle would call: recorded, if it ever ran
    RAN.append(args)


class Evil:
    def __reduce__(self):
        return (ran, ("evil",))


def files(root: Path, *roots: Path):
    return K._Files(root, tuple(roots))


def error(call, kind=CheckpointError):
    with pytest.raises(kind) as info:
        call()
    return info.value


def test_a_file_is_checked_inside_its_directory_and_a_missing_one_says_why(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    f = files(tmp_path)
    assert f.checked("a.json") == (tmp_path / "a.json").resolve()
    e = error(lambda: f.checked("b.json"))
    assert str(e) == f"{tmp_path / 'b.json'}: missing" and e.path == str(tmp_path / "b.json")
    e = error(lambda: f.checked("b.json", missing="hf stores its config there"))
    assert str(e) == f"{tmp_path / 'b.json'}: missing (hf stores its config there)"
    outside = tmp_path.parent / f"{tmp_path.name}-out.json"
    outside.write_text("{}")
    (tmp_path / "link.json").symlink_to(outside)
    e = error(lambda: f.checked("link.json", what="the index names it"), UnsafeFile)
    assert "link.json: a symlink (the index names it) to" in str(e)
    # the twin: under an allowed root, the same link is read
    assert files(tmp_path, tmp_path.parent).checked("link.json") == outside.resolve()


def test_unsafe_refuses_only_a_file_that_exists_and_may_not_be_read(tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-out.bin"
    outside.write_bytes(b"x")
    (tmp_path / "link.bin").symlink_to(outside)
    (tmp_path / "in.bin").write_bytes(b"x")
    f = files(tmp_path)
    e = error(lambda: f.unsafe("link.bin", what="a rank file"), UnsafeFile)
    assert str(e).startswith(f"{tmp_path / 'link.bin'}: a symlink (a rank file) to ")
    assert f.unsafe("in.bin") is None and f.unsafe("absent.bin") is None
    assert files(tmp_path, tmp_path.parent).unsafe("link.bin") is None


def test_json_reads_a_file_and_names_one_that_is_missing_or_not_json(tmp_path):
    f = files(tmp_path)
    (tmp_path / "ok.json").write_text(json.dumps({"a": [1, 2]}))
    assert f.json("ok.json") == {"a": [1, 2]}
    assert str(error(lambda: f.json("no.json"))) == f"{tmp_path / 'no.json'}: missing"
    (tmp_path / "bad.json").write_text("{not json")
    e = error(lambda: f.json("bad.json"))
    assert str(e).startswith(f"{tmp_path / 'bad.json'}: not readable JSON (Expecting ")
    assert e.path == str(tmp_path / "bad.json")
    (tmp_path / "latin.json").write_bytes(b'{"a": "\xff"}')
    e = error(lambda: f.json("latin.json"))
    assert str(e).startswith(f"{tmp_path / 'latin.json'}: not readable JSON ('utf-8' codec")
    os.mkfifo(tmp_path / "fifo.json")
    e = error(lambda: f.json("fifo.json"), UnsafeFile)  # never opened: it would block
    assert "not a regular file" in str(e)


def test_safetensors_reads_a_file_and_names_one_that_is_missing_or_corrupt(tmp_path):
    f = files(tmp_path)
    t = {"w": torch.arange(6.0).reshape(2, 3)}
    safetensors.torch.save_file(t, str(tmp_path / "ok.safetensors"))
    got = f.safetensors("ok.safetensors")
    assert list(got) == ["w"] and torch.equal(got["w"], t["w"])
    e = error(lambda: f.safetensors("no.safetensors", missing="rank 1's shard"))
    assert str(e) == f"{tmp_path / 'no.safetensors'}: missing (rank 1's shard)"
    whole = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:len(whole) - 4])
    e = error(lambda: f.safetensors("cut.safetensors"))
    assert str(e).startswith(f"{tmp_path / 'cut.safetensors'}: not a readable safetensors "
                             "file, truncated or corrupt (")
    assert e.path == str(tmp_path / "cut.safetensors")
    outside = tmp_path.parent / f"{tmp_path.name}-out.safetensors"
    outside.write_bytes(whole)
    (tmp_path / "link.safetensors").symlink_to(outside)
    e = error(lambda: f.safetensors("link.safetensors", what="the index maps w to it"),
              UnsafeFile)
    assert "(the index maps w to it)" in str(e)


def saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf


def test_a_megatron_pickle_loads_tensors_and_megatrons_allowed_types_as_they_are(tmp_path):
    ns = argparse.Namespace(tensor_model_parallel_size=2, seq_length=8)
    # numpy's RNG state, as Megatron saves it: a uint32 array
    obj = {"model": {"w": torch.arange(4.0)}, "args": ns,
           "rng": numpy.arange(3, dtype=numpy.uint32), "u32": numpy.dtype("uint32"),
           "simple": types.SimpleNamespace(a=1), "where": Path("/ckpt"),
           "signal": signal.SIGTERM, "buf": io.BytesIO(b"ab"),
           "gen": torch.Generator().manual_seed(3)}
    for source in (saved(obj), tmp_path / "rank.pt"):
        if isinstance(source, Path):
            torch.save(obj, source)
        got = K._megatron_pickle(source, tmp_path / "shown.pt")
        assert torch.equal(got["model"]["w"], torch.arange(4.0))
        assert got["args"] == ns and numpy.array_equal(got["rng"], numpy.arange(3))
        assert got["rng"].dtype == numpy.uint32 and got["u32"] == numpy.dtype("uint32")
        assert got["simple"].a == 1 and got["where"] == Path("/ckpt")
        assert got["signal"] == signal.SIGTERM and got["buf"].getvalue() == b"ab"
    buf = saved(obj)
    buf.seek(5)  # read from the start, wherever the stream was left
    assert K._megatron_pickle(buf, tmp_path / "shown.pt")["args"] == ns


@contextlib.contextmanager
def classes_named(module: str, *names: str):
    """Classes importable as ``module.name`` (as pickling them by reference needs) while
    inside: what Megatron's own classes are to a pickle, without Megatron."""
    parts = module.split(".")
    added = [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
             if m not in sys.modules]
    for m in added:
        sys.modules[m] = types.ModuleType(m)
    made = [type(n, (), {"__module__": module, "__init__": _keep}) for n in names]
    for cls in made:
        setattr(sys.modules[module], cls.__name__, cls)
    try:
        yield made
    finally:
        for m in added:
            del sys.modules[m]


def _keep(self, value=None):
    self.value = value


def test_megatrons_own_classes_become_inert_stand_ins_and_any_other_global_is_refused(tmp_path):
    shown = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    with classes_named("megatron.core.enums", "ModelType") as (kind,):
        got = K._megatron_pickle(saved({"kind": kind(7)}), shown)
    stand_in = got["kind"]
    assert type(stand_in) is K.MegatronObject and stand_in.state == {"value": 7}
    # two of Megatron's classes in two modules: each gets its stand-in
    with classes_named("megatron.core.enums", "ModelType") as (kind,), \
            classes_named("megatron.core.transformer.enums", "AttnBackend") as (backend,):
        two = saved({"a": kind(1), "b": backend(2)})
    got = K._megatron_pickle(two, shown)
    assert type(got["a"]) is type(got["b"]) is K.MegatronObject
    assert got["b"].state == {"value": 2}

    RAN.clear()
    e = error(lambda: K._megatron_pickle(saved({"x": Evil()}), shown))
    assert str(e) == (f"{shown}: refused, its pickle holds more than tensors and Megatron's "
                      f"own records (Unsupported global: GLOBAL {__name__}.ran)")
    assert e.path == str(shown) and RAN == []  # nothing in it ran
    with classes_named("megatronx.evil", "Thing") as (thing,):
        evil = saved({"x": thing(1)})
    e = error(lambda: K._megatron_pickle(evil, shown))
    assert "Unsupported global: GLOBAL megatronx.evil.Thing" in str(e)
    assert "weights_only=False" not in str(e)  # torch's advice to run it is not repeated


def test_a_truncated_torch_checkpoint_is_named_not_loaded(tmp_path):
    whole = saved({"w": torch.arange(3.0)}).getvalue()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole[:len(whole) // 2])
    e = error(lambda: K._megatron_pickle(cut, tmp_path / "shown.pt"))
    assert str(e).startswith(f"{tmp_path / 'shown.pt'}: not a readable torch checkpoint, "
                             "truncated or corrupt (")
    # the exception's type and torch's own reason, not a placeholder
    assert re.search(r"corrupt \((RuntimeError|EOFError|OSError|ValueError): \w", str(e)), e
    assert not str(e).endswith("None)")
    assert e.path == str(tmp_path / "shown.pt")
    assert K._megatron_pickle(io.BytesIO(whole), cut)["w"].tolist() == [0.0, 1.0, 2.0]


def test_a_refused_pickle_is_said_by_what_it_calls_without_torchs_advice():
    exc = pickle.UnpicklingError(
        "Weights only load failed. This file can still be loaded, to do so you have two "
        "options, do those steps only if you trust the source of the checkpoint.\n"
        " (1) In PyTorch 2.6, we changed the default value of the `weights_only` argument\n"
        "WeightsUnpickler error: Unsupported global: GLOBAL os.system was not an allowed "
        "global by default. Unsupported global: GLOBAL os.system again; Unsupported "
        "operand 149\n Check the documentation of torch.load")
    assert K._refused_pickle(exc) == ("Unsupported global: GLOBAL os.system; "
                                      "Unsupported operand 149")
    plain = RuntimeError("PytorchStreamReader failed reading zip archive\nweights_only stuff\n"
                         "   \nsee the documentation")
    assert K._refused_pickle(plain) == "PytorchStreamReader failed reading zip archive"
    advice = RuntimeError("first reason\nThis file can still be loaded, in two ways\n"
                          "only if you trust the source\nsecond reason")
    assert K._refused_pickle(advice) == "first reason; second reason"
    assert K._refused_pickle(EOFError()) == "EOFError"


def test_without_what_or_why_a_refusal_and_a_missing_file_say_nothing_more(tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-out.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(outside))
    (tmp_path / "link.safetensors").symlink_to(outside)
    f = files(tmp_path)
    shown = tmp_path / "link.safetensors"
    for call in (lambda: f.checked("link.safetensors"), lambda: f.unsafe("link.safetensors"),
                 lambda: f.safetensors("link.safetensors")):
        assert str(error(call, UnsafeFile)).startswith(f"{shown}: a symlink to ")
    e = error(lambda: f.safetensors("no.safetensors"))
    assert str(e) == f"{tmp_path / 'no.safetensors'}: missing"


def test_a_file_gone_between_its_check_and_its_read_is_missing_not_a_crash(tmp_path,
                                                                         monkeypatch):
    """The window between ``files.inside``'s check and the read: a file removed there."""
    import safetensors.torch as st

    (tmp_path / "a.json").write_text("{}")
    safetensors.torch.save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))

    def gone(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(K, "read_bounded", gone)
    monkeypatch.setattr(st, "load_file", gone)
    f = files(tmp_path)
    for name, call in (("a.json", lambda: f.json("a.json")),
                       ("a.safetensors", lambda: f.safetensors("a.safetensors"))):
        e = error(call)
        assert str(e) == f"{tmp_path / name}: missing" and e.path == str(tmp_path / name)


def test_a_json_file_over_the_bound_is_named_as_the_directory_names_it(tmp_path, monkeypatch):
    from weight_sync_bench import files as F

    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps({"pad": "x" * 64}))
    (tmp_path / "ckpt").symlink_to(real, target_is_directory=True)
    monkeypatch.setattr(F, "JSON_LIMIT", 16)
    e = error(lambda: files(tmp_path / "ckpt").json("config.json"), UnsafeFile)
    assert str(e).startswith(f"{tmp_path / 'ckpt' / 'config.json'}: ")  # not real/...
    monkeypatch.setattr(F, "JSON_LIMIT", 1 << 20)  # the twin: within the bound, read
    assert files(tmp_path / "ckpt").json("config.json")["pad"] == "x" * 64


def test_lazy_tensors_list_their_names_without_reading_a_file(tmp_path):
    safetensors.torch.save_file({"a": torch.ones(2), "b": torch.zeros(3)},
                                str(tmp_path / "m.safetensors"))
    lazy = K.LazyTensors({"b": "m.safetensors", "a": "m.safetensors"}, files(tmp_path))
    assert list(lazy) == ["b", "a"] and len(lazy) == 2 and "a" in lazy and "c" not in lazy
    assert lazy.shape("b") == (3,) and torch.equal(lazy["a"], torch.ones(2))


def test_an_array_pickled_under_numpy_1s_name_of_its_reconstructor_loads(tmp_path):
    """numpy 1 pickles an array through ``numpy.core.multiarray._reconstruct``, numpy 2
    through ``numpy._core``: a checkpoint saved under either loads (the legacy format's
    pickle names it in plain text, so the older name is written in here)."""
    buf = io.BytesIO()
    torch.save({"rng": numpy.arange(3, dtype=numpy.uint32)}, buf,
               _use_new_zipfile_serialization=False)
    new = buf.getvalue()
    assert b"numpy._core.multiarray" in new
    old = new.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    for data in (new, old):
        got = K._megatron_pickle(io.BytesIO(data), tmp_path / "rank.pt")
        assert got["rng"].tolist() == [0, 1, 2]


def test_an_environment_that_forces_unsafe_loads_still_runs_nothing(tmp_path, monkeypatch):
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns torch's default to unsafe loads; the
    harness asks for ``weights_only=True`` itself, so a pickle's code still never runs."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    RAN.clear()
    e = error(lambda: K._megatron_pickle(saved({"x": Evil()}), tmp_path / "r.pt"))
    assert "Unsupported global" in str(e) and RAN == []
    # the twin: torch's own default under that environment would have run it
    buf = saved({"x": Evil()})
    buf.seek(0)
    with pytest.warns(UserWarning, match="forcing weights_only=False"):
        torch.load(buf, map_location="cpu")
    assert RAN == [("evil",)]


def many_megatron_classes(n: int) -> io.BytesIO:
    """A pickle naming ``n`` distinct classes of Megatron's (``megatron.fake.C{i}``)."""
    with classes_named("megatron.fake", *(f"C{i}" for i in range(n))) as made:
        return saved([cls() for cls in made])


def test_at_most_65_of_megatrons_classes_are_stood_in_for(tmp_path):
    """Each class Megatron's pickle names costs one more load; a file naming more than 65
    is refused rather than loaded again and again."""
    got = K._megatron_pickle(many_megatron_classes(65), tmp_path / "r.pt")
    assert len(got) == 65 and all(type(x) is K.MegatronObject for x in got)
    e = error(lambda: K._megatron_pickle(many_megatron_classes(66), tmp_path / "r.pt"))
    assert "Unsupported global: GLOBAL megatron.fake.C65" in str(e)



_AS_CUDA = [False, False]  # tagging now; the tagger registered


def _cuda_tag(obj):  # while set, a CPU storage is saved as torch tags a CUDA one
    return "cuda:0" if _AS_CUDA[0] and getattr(obj, "device", None) == torch.device("cpu") \
        else None


def test_a_checkpoint_saved_from_gpus_loads_on_a_machine_without_one(tmp_path):
    """Megatron saves from GPUs: each storage tagged ``cuda:N``. Loaded onto the CPU
    (``map_location``), it reads here; torch's default would ask for a GPU."""
    from torch import serialization

    if not _AS_CUDA[1]:  # once a process: torch keeps a registered package for good
        serialization.register_package(1, _cuda_tag, lambda obj, location: None)
        _AS_CUDA[1] = True
    _AS_CUDA[0] = True
    try:
        buf = saved({"w": torch.arange(3.0)})
    finally:
        _AS_CUDA[0] = False
    assert b"cuda:0" in buf.getvalue()
    assert K._megatron_pickle(buf, tmp_path / "r.pt")["w"].tolist() == [0.0, 1.0, 2.0]
    if not torch.cuda.is_available():  # the twin: torch's default location needs the GPU
        buf.seek(0)
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(buf, weights_only=True)

"""Megatron's legacy ``torch`` checkpoint format as the weights a sync sends: written as
Megatron-LM's ``get_checkpoint_name`` lays it out (``iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}]
[_{ep:03d}]/model_optim_rng.pt``, the tracker file) and read back to the canonical parameters
byte for byte at every kind of endpoint; the pickle loaded with ``weights_only=True``:
Megatron's own enums and configs in its ``args`` become inert stand-ins, anything else is
refused naming it (and never runs); a missing rank file or a wrong shape is a
``CheckpointError`` naming the file."""

from __future__ import annotations

import argparse
import enum
import sys
import types

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.checkpoint import (
    MEGATRON_FILE,
    MEGATRON_TRACKER,
    is_megatron_checkpoint,
    megatron_weights,
    write_megatron_legacy,
)
from weight_sync_bench.errors import CheckpointError
from weight_sync_bench.model.config import init_params

DENSE = tiny(2, n_layers=4).replace(name="tiny_deep")
MOE = tiny(4, n_layers=2, n_experts=4, top_k=2, expert_ffn=16).replace(name="tiny_moe")


def save(tmp_path, config, where, **kwargs):
    at = endpoint(where)
    directory = tmp_path / where.replace(":", "-").replace(",", "_")
    write_megatron_legacy(directory, materialize(at.pieces(config), init_params(config, 0)),
                          at, config, **kwargs)
    return directory, at


@pytest.mark.parametrize(("config", "where", "files"), [
    (DENSE, "megatron:2", ["mp_rank_00", "mp_rank_01"]),
    (DENSE, "megatron:tp=2,pp=2", ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                   "mp_rank_01_001"]),
    (DENSE, "megatron:tp=1,pp=2,vpp=2", ["mp_rank_00_000", "mp_rank_00_001"]),
    (MOE, "megatron:tp=2,ep=2", ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                 "mp_rank_01_001"]),
    (MOE, "megatron:tp=1,pp=2,ep=2", ["mp_rank_00_000_000", "mp_rank_00_000_001",
                                      "mp_rank_00_001_000", "mp_rank_00_001_001"]),
], ids=lambda v: getattr(v, "name", str(v)))
def test_a_legacy_checkpoint_reads_back_to_the_canonical_parameters(tmp_path, config, where,
                                                                   files):
    directory, at = save(tmp_path, config, where, iteration=42)
    assert (directory / MEGATRON_TRACKER).read_text().strip() == "42"
    assert is_megatron_checkpoint(directory) and is_megatron_checkpoint(directory / "iter_0000042")
    assert not is_megatron_checkpoint(directory / "iter_0000042" / files[0])
    assert sorted(p.name for p in (directory / "iter_0000042").iterdir()) == files
    full = init_params(config, 0)
    read = megatron_weights(directory, at, config)
    assert sorted(read) == sorted(full)
    assert all(torch.equal(read[n], x) for n, x in full.items())
    again = megatron_weights(directory / "iter_0000042", at, config)  # the iteration itself
    assert all(torch.equal(again[n], x) for n, x in full.items())


def test_virtual_stages_are_model0_and_model1_as_megatron_saves_them(tmp_path):
    directory, _ = save(tmp_path, DENSE, "megatron:tp=1,pp=2,vpp=2")
    state = torch.load(directory / "iter_0000001" / "mp_rank_00_001" / MEGATRON_FILE,
                       weights_only=False)
    assert sorted(k for k in state if k.startswith("model")) == ["model0", "model1"]
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in state["model1"]
    assert state["checkpoint_version"] == 3.0 and state["args"].pipeline_model_parallel_size == 2


def _megatron_module(name):
    """A module named like Megatron's own, holding an enum, importable while saving only."""
    module = types.ModuleType(name)

    class AttnBackend(enum.Enum):
        auto = 5

    AttnBackend.__module__, AttnBackend.__qualname__ = name, "AttnBackend"
    module.AttnBackend = AttnBackend
    return module


def test_megatrons_own_classes_load_as_stand_ins_and_anything_else_is_refused(
        tmp_path, monkeypatch):
    directory, at = save(tmp_path, DENSE, "megatron:2")
    path = directory / "iter_0000001" / "mp_rank_00" / MEGATRON_FILE
    state = torch.load(path, weights_only=False)
    name = "megatron.core.transformer.enums"
    for parent in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, name, _megatron_module(name))
    state["args"] = argparse.Namespace(**vars(state["args"]),
                                       attention_backend=sys.modules[name].AttnBackend.auto)
    torch.save(state, path)
    for module in ("megatron", "megatron.core", "megatron.core.transformer", name):
        monkeypatch.delitem(sys.modules, module)  # as on a machine without Megatron
    full = init_params(DENSE, 0)
    read = megatron_weights(directory, at, DENSE)
    assert all(torch.equal(read[n], x) for n, x in full.items())
    # the twin: a global that is not Megatron's is refused, named, and never called
    ran = []
    evil = types.ModuleType("evil")

    def run(*args):
        ran.append(args)

    run.__module__, run.__qualname__ = "evil", "run"
    evil.run = run
    evil.Payload = type("Payload", (), {"__reduce__": lambda self: (evil.run, ("ran",))})
    evil.Payload.__module__ = "evil"
    monkeypatch.setitem(sys.modules, "evil", evil)
    state["args"] = evil.Payload()
    torch.save(state, path)
    ran.clear()
    with pytest.raises(CheckpointError, match=r"mp_rank_00/model_optim_rng.pt: refused, its "
                                              r"pickle holds more than tensors and Megatron's own records \(Unsupported "
                                              r"global: GLOBAL evil.run\)"):
        megatron_weights(directory, at, DENSE)
    assert ran == []


def test_a_missing_rank_or_a_wrong_shape_is_named(tmp_path):
    directory, at = save(tmp_path, DENSE, "megatron:tp=2,pp=2")
    (directory / "iter_0000001" / "mp_rank_01_001" / MEGATRON_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"mp_rank_01_001/model_optim_rng.pt: missing"):
        megatron_weights(directory, at, DENSE)
    directory, at = save(tmp_path / "b", DENSE, "megatron:2")
    path = directory / "iter_0000001" / "mp_rank_01" / MEGATRON_FILE
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.final_layernorm.weight"] = torch.zeros(3)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"megatron:2 rank 1 decoder.final_layernorm.weight "
                                              r"has shape \[3\]"):
        megatron_weights(directory, at, DENSE)
    (directory / MEGATRON_TRACKER).write_text("latest\n")
    with pytest.raises(CheckpointError, match="'latest' is neither an iteration nor 'release'"):
        megatron_weights(directory, at, DENSE)

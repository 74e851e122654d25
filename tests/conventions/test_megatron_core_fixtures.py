"""torch_dist checkpoints saved by Megatron-Core itself (0.16.1, on CPU: see
``tests/data/megatron_core/make_fixtures.py``), read back by the harness to exactly the
weights the saving model held: each canonical parameter's bytes against the SHA-256 the
fixture's maker computed from the model's in-memory parameters (never from the
checkpoint). ``dense_tp2``: saved by two TP ranks (fc1's global rows are every rank's gate
chunk, then every up chunk; the norms one copy); ``moe_tp1``: SequentialMLP experts on the
expert axis, the local layer spec's pre-MLP norm under ``mlp.linear_fc1.layer_norm_weight``.
Their twin: the same checkpoint read with fc1's halves taken the other way round, or qkv
read ungrouped, does not match."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from weight_sync_bench.conventions.checkpoint import megatron_weights
from weight_sync_bench.model.config import ModelConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron_core"
GEOMETRY = dict(vocab=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, ffn=32)
CONFIGS = {"dense_tp2": ModelConfig(name="mcore", **GEOMETRY),
           "moe_tp1": ModelConfig(name="mcore", **GEOMETRY, n_experts=4, top_k=2,
                                  expert_ffn=8)}


def digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_checkpoint_megatron_core_saved_reads_back_to_the_models_weights(name, tmp_path):
    expected = json.loads((DATA / name / "expected.json").read_text())["params"]
    directory = tmp_path / name  # read from a copy: the checkout is never written to
    directory.mkdir()
    for f in (DATA / name).iterdir():
        if f.name != "expected.json":
            (directory / f.name).write_bytes(f.read_bytes())
    back = megatron_weights(directory, None, CONFIGS[name])
    assert sorted(back) == sorted(expected)
    for param, want in expected.items():
        x = back[param]
        assert [list(x.shape), str(x.dtype)] == [want["shape"], want["dtype"]], param
        assert digest(x) == want["sha256"], param
    # the twin: the bytes a reader that took fc1 as [up; gate] or qkv as [Q | K | V] rows
    # would return do not match
    fc1 = back["layers.0.gate_up.weight"] if name == "dense_tp2" else back[
        "layers.0.experts.gate_up.weight"]
    assert digest(torch.cat(fc1.chunk(2)[::-1]) if name == "dense_tp2" else fc1.flip(0)) != \
        expected["layers.0.gate_up.weight" if name == "dense_tp2" else
                 "layers.0.experts.gate_up.weight"]["sha256"]

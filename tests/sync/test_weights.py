"""Phase 2 on the user's own weights (``SyncSession(weights=DIR)``, ``wsb sync --weights``):
the values moved are the checkpoint's (in float32, each rank reading its own regions), the
element check compares every destination element with the checkpoint's, and the
destination forward is judged by a threshold measured on those weights over gloo (its note
says so), never by a floor of the seed's. Each failure has its twin: the same session's
correct run passes."""

from __future__ import annotations

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.cli.main import main
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.checkpoint import write_checkpoint, write_megatron_dist
from weight_sync_bench.model.config import TOY_KV4, init_params
from weight_sync_bench.sync.mutations import gate_up_swapped
from weight_sync_bench.sync.session import SyncSession
from weight_sync_bench.sync.values import WeightValues
from weight_sync_bench.sync.verify import generated


def hf_dir(tmp_path, config, seed=9):
    """An HF directory of bf16 weights no seed draws."""
    w = {n: (x * 3 + 0.01).to(torch.bfloat16) for n, x in init_params(config, seed).items()}
    hf = endpoint("hf")
    write_checkpoint(tmp_path / "w", materialize(hf.pieces(config), w), hf, config)
    return tmp_path / "w", w


def test_the_values_moved_are_the_checkpoints(tmp_path):
    """What a source rank holds (``generated``) is its declared cut of the checkpoint's
    weights, in float32; a seed's values are not."""
    from weight_sync_bench.sync.layouts import sync_layout

    config = tiny(2)
    directory, w = hf_dir(tmp_path, config)
    layout = sync_layout(config, "megatron:2")
    want = materialize(endpoint("megatron:2").pieces(config), {n: x.float() for n, x in w.items()})
    for rank in range(2):
        got = generated(layout, rank, WeightValues(str(directory), config))
        assert set(got) == set(want[rank])
        assert all(torch.equal(got[n], want[rank][n]) for n in got)
    seeded = generated(layout, 0, 9)
    assert not torch.equal(seeded["decoder.layers.0.mlp.linear_fc2.weight"],
                           want[0]["decoder.layers.0.mlp.linear_fc2.weight"])


# 10 s: the long run; by default test_wsb_sync_weights syncs real weights, passes them
# and fails a mutation
@pytest.mark.slow
@pytest.mark.parametrize("into", ["fresh", "existing"])
def test_a_sync_of_real_weights_passes_and_a_mutated_plan_fails(tmp_path, pool, into):
    directory, _ = hf_dir(tmp_path, TOY_KV4)
    with SyncSession(TOY_KV4, "megatron:2", "vllm:2", pool=pool, weights=directory) as s:
        assert any("measured on them" in n and "over gloo" in n for n in s.notes), s.notes
        good = s.run(into=into)
        assert good.passed and good.elements_passed and good.verdict.passed, good.summary()
        bad = s.run(plan=gate_up_swapped(s.plan), into=into)
    assert not bad.passed and not bad.elements_passed
    assert bad.verdict.first_mismatch.endswith("gate_up_proj.weight")
    assert "holds up rows" in bad.summary()


# On tiny_kv4 (TOY_KV4's 8 query and 4 KV heads at width 32, vocabulary 256): the command's
# path on a user's directory (the geometry read from its config.json, the threshold measured
# on the weights over gloo, the element check, the refusal) is the same at any width, and
# TOY_KV4's 19M parameters made it 8.5 s. megatron:2 -> vllm:2 regroups the qkv rows of the
# same 4 KV heads over the same 2 ranks, as it did on TOY_KV4.
def test_wsb_sync_weights(tmp_path, capsys):
    config = tiny(4)
    directory, w = hf_dir(tmp_path, config)
    base = ["sync", "--from", "megatron:2", "--to", "vllm:2", "--weights", str(directory)]
    assert main([*base, "-q"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and "measured on them" in out, out
    assert f"PASS {config.name} megatron:2 -> vllm:2 (phase 2)" in out, out
    # the mutated plan fails the element check on these weights; --no-forward: the threshold
    # measured on them above is not measured again, and the forward's verdict on a
    # mutated plan of real weights is test_a_sync_of_real_weights_passes_and_a_mutated_plan_fails'
    # (the long run; by default the forward fails each planner mutation in
    # tests/sync/test_mutations.py)
    assert main([*base, "--mutation", "gate_up_swapped", "--no-forward", "-q"]) == 1
    capsys.readouterr()
    write_megatron_dist(tmp_path / "m", w, endpoint("megatron:2"), config)
    assert main(["sync", "--weights", str(tmp_path / "m"), "--no-forward"]) == 2
    assert "give --config NAME or --hf-config PATH" in capsys.readouterr().err
    # a geometry no --config names: the HF config.json beside the weights
    assert main(["sync", "--weights", str(tmp_path / "m"), "--hf-config",
                 str(directory / "config.json"), "--layers", "1", "--from", "megatron:2",
                 "--to", "vllm:2", "--no-forward", "-q"]) == 0


def test_the_session_moves_the_checkpoint_not_a_seed(tmp_path, pool):
    """A resharder that reads each destination rank's tensors straight from the checkpoint
    passes the element check; the twin reading ``init_params`` instead fails it."""
    import functools

    from tests.sync.resharders import read_from_checkpoint

    directory, _ = hf_dir(tmp_path, tiny(2))
    with SyncSession(tiny(2), "megatron:2", "vllm:2", pool=pool, forward=False,
                     weights=directory) as s:
        right = s.run(functools.partial(read_from_checkpoint, directory=str(directory)))
        wrong = s.run(functools.partial(read_from_checkpoint, directory=str(directory),
                                        seed=9))
    assert right.elements_passed, right.summary()
    assert not wrong.elements_passed


def test_without_a_forward_the_driver_never_reads_the_whole_checkpoint(tmp_path, pool,
                                                                        monkeypatch):
    """``forward=False``: the ranks read their regions, the driver holds no model (its
    whole-model reader is never called); the element check still passes."""
    from weight_sync_bench.sync import session

    directory, _ = hf_dir(tmp_path, tiny(2))
    calls = []
    monkeypatch.setattr(session, "held_weights", lambda *a, **k: calls.append(a))
    with SyncSession(tiny(2), "megatron:2", "vllm:2", pool=pool, forward=False,
                     weights=directory) as s:
        assert s.run().elements_passed
    assert calls == []

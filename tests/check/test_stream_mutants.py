"""``check.stream`` at its seams (issue 30, the mutation pass over ``check/stream.py``):
``stream_check`` hands ``stream_run`` every argument it is given, and ``stream_run`` judges
by the floor of the phase its backend runs (1a in process, 1b over gloo, measured only when
asked), runs the pass it names with what it was given, and refuses what it does not take,
saying what it takes. The passes themselves stand in here (``run_inprocess``, ``run_gloo``):
what they compute is ``test_stream.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from weight_sync_bench import TOY
from weight_sync_bench.check import stream
from weight_sync_bench.check.naming import NONE
from weight_sync_bench.check.streaming import StreamRun
from weight_sync_bench.errors import InvalidNumber


def test_stream_check_hands_stream_run_every_argument_and_its_defaults(monkeypatch):
    got = []
    monkeypatch.setattr(stream, "stream_run", lambda *a, **k: got.append((a, k)) or ("v", ()))

    def fn(*a):
        return None

    def progress(p):
        return None
    pool = object()
    assert stream.stream_check(TOY, 2, fn=fn, src=1, per="parameter", seed=3, dtype="bf16",
                               threshold=0.5, measure_floor=True, progress=progress,
                               backend="gloo", pool=pool) == "v"
    assert got.pop() == ((TOY, 2), dict(fn=fn, src=1, per="parameter", seed=3, dtype="bf16",
                                        threshold=0.5, measure_floor=True, progress=progress,
                                        backend="gloo", pool=pool))
    stream.stream_check(TOY, 4)
    assert got.pop() == ((TOY, 4), dict(fn=None, src=None, per="layer", seed=0,
                                        dtype=torch.float32, threshold=None,
                                        measure_floor=False, progress=None,
                                        backend="inprocess", pool=None))


@pytest.fixture
def passes(monkeypatch):
    """The two passes and the floor, standing in: each records what it was asked."""
    asked = SimpleNamespace(floor=[], inprocess=[], gloo=[])
    logits = torch.zeros(1, 2, TOY.vocab)
    run = StreamRun([], [], NONE, logits, logits + 1e-4)

    def resolve_floor(config, phase, name, *, measure, **forward):
        asked.floor.append((config, phase, name, measure, sorted(forward)))
        return SimpleNamespace(threshold=0.25, artifact={}, source="committed")
    monkeypatch.setattr(stream, "resolve_floor", resolve_floor)
    monkeypatch.setattr(stream, "environment_notes",
                        lambda floor, config, phase, name: (f"<{config.name} {phase} {name}>",))
    monkeypatch.setattr(stream, "run_inprocess",
                        lambda *a, **k: asked.inprocess.append((a, k)) or run)
    monkeypatch.setattr(stream, "run_gloo", lambda *a: asked.gloo.append(a) or run)
    return asked


def test_in_process_by_default_judged_by_the_phase_1a_floor_never_measured_unasked(passes):
    verdict, rss = stream.stream_run(TOY, 2)
    assert passes.floor == [(TOY, "1a", "fp32", False, [])]
    [(args, kwargs)] = passes.inprocess
    assert (args[0], args[2:]) == (TOY, (2, None, None, "layer", 0, torch.float32, None))
    assert kwargs == {"route_bound": 0.25} and passes.gloo == []
    assert (verdict.threshold, verdict.src, verdict.dst, verdict.dtype) == (0.25, None, 2,
                                                                          "fp32")
    assert rss == () and verdict.passed and verdict.notes == ("<toy 1a fp32>",)


def test_across_processes_judged_by_the_phase_1b_floor_of_the_pools_forward(passes,
                                                                            monkeypatch):
    pool, forwards = object(), []
    monkeypatch.setattr(stream, "gloo_forward", lambda p: forwards.append(p) or "forward")

    def fn(*a):
        return None
    verdict, _ = stream.stream_run(TOY, 2, fn=fn, src=1, per="parameter", seed=5,
                                   dtype="bf16", measure_floor=True, backend="gloo", pool=pool)
    assert verdict.notes == ("<toy 1b bf16>",) and forwards == [pool]
    assert passes.floor == [(TOY, "1b", "bf16", True, ["forward"])]
    assert passes.gloo == [(TOY, 2, fn, 1, "parameter", 5, torch.bfloat16, pool)]
    assert passes.inprocess == []
    # a threshold given: no floor read
    stream.stream_run(TOY, 2, threshold=0.5, backend="gloo")
    assert len(passes.floor) == 1


def test_what_a_streamed_check_does_not_take_is_refused_saying_what_it_takes(passes):
    with pytest.raises(ValueError) as info:
        stream.stream_run(TOY, 2, backend="mpi")
    assert str(info.value) == "backend='mpi': a streamed check runs 'inprocess' or 'gloo'"
    with pytest.raises(ValueError) as info:
        stream.stream_run(TOY, 2, per="rank")
    assert str(info.value) == "per='rank': a streamed check calls fn per layer or per parameter"
    with pytest.raises(InvalidNumber) as info:
        stream.stream_run(TOY, 2, seed=-1)
    assert str(info.value) == "seed must be an int in 0..2^63-1, got -1"
    assert passes.floor == []  # refused before any floor is read


def test_a_streamed_moe_check_across_processes_is_refused_saying_where_it_runs(passes):
    from weight_sync_bench.errors import UnsupportedLayout
    from weight_sync_bench.model.config import TOY_MOE
    with pytest.raises(UnsupportedLayout) as info:
        stream.stream_run(TOY_MOE, 2, threshold=0.5, backend="gloo")
    assert str(info.value) == (
        "toy_moe: a streamed MoE check runs in process (phase 1a): the routing guard lives "
        "beside the reference on rank 0; check it whole over gloo, or streamed in process")
    assert passes.gloo == []


def test_an_moe_streamed_verdict_says_its_near_ties_and_their_bound(monkeypatch):
    logits = torch.zeros(1, 2, TOY.vocab)
    routed = StreamRun([], [], NONE, logits, logits, near_ties=(3, 40))
    monkeypatch.setattr(stream, "run_inprocess", lambda *a, **k: routed)
    verdict, _ = stream.stream_run(TOY, 2, threshold=0.25)
    assert (verdict.near_ties, verdict.route_bound) == ((3, 40), 0.25)
    # the twin: a dense pass routes nothing and says nothing of it
    monkeypatch.setattr(stream, "run_inprocess",
                        lambda *a, **k: StreamRun([], [], NONE, logits, logits))
    verdict, _ = stream.stream_run(TOY, 2, threshold=0.25)
    assert (verdict.near_ties, verdict.route_bound) == (None, None)

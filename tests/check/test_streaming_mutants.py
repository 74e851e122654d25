"""``check.streaming`` at its seams (issue 30, the mutation pass over ``check/streaming.py``):
the sizes a streamed peak is reported against, what ``stream_deviation`` asks of the pass,
and the catalogue a pass narrows. What the pass computes is ``test_stream.py``'s and
``test_stream_views.py``'s."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch

from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import TOY, layout_for
from weight_sync_bench.check import streaming
from weight_sync_bench.check.naming import NONE, layout_naming
from weight_sync_bench.check.streaming import StreamRun

# a geometry whose largest parameter is not its first, last or smallest one
WIDE = TOY.replace(name="wide", vocab=40, d_model=16, n_layers=1, ffn=96, n_heads=2,
                   n_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), ("bf16", 2), (torch.float16, 2)])
def test_a_streamed_peak_is_reported_against_the_largest_parameter_and_the_model(dtype, size):
    shapes = WIDE.param_shapes()
    largest = max(math.prod(s) for s in shapes.values())
    assert largest not in (math.prod(s) for s in list(shapes.values())[::len(shapes) - 1])
    assert streaming.largest_param_bytes(WIDE, dtype) == largest * size
    assert streaming.model_bytes(WIDE, dtype) == WIDE.n_params * size
    assert WIDE.n_params == sum(math.prod(s) for s in shapes.values())


def test_both_sizes_default_to_fp32():
    assert streaming.largest_param_bytes(WIDE) == streaming.largest_param_bytes(WIDE, "fp32")
    assert streaming.model_bytes(WIDE) == WIDE.n_params * 4


def test_a_shapes_element_count_is_the_product_of_its_sizes():
    assert streaming._numel(()) == 1
    assert streaming._numel((7,)) == 7
    assert streaming._numel((3, 5, 2)) == 30


@pytest.fixture
def asked(monkeypatch):
    """``run_inprocess`` standing in: records what it was asked, returns known logits."""
    asked = []
    logits = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    run = StreamRun([], [], NONE, logits, torch.tensor([[1.5, -2.0], [1.0, 0.5]]),
                    route_deviation=0.125)
    monkeypatch.setattr(streaming, "run_inprocess", lambda *a, **k: asked.append((a, k)) or run)
    return asked


def test_stream_deviation_asks_for_the_declared_split_by_layer_with_what_it_was_given(asked):
    def progress(p):
        return None
    route: list[float] = []
    got = streaming.stream_deviation(TOY, 2, seed=3, dtype="bf16", progress=progress,
                                     route=route)
    assert asked.pop() == ((TOY, layout_for(TOY), 2, None, None, "layer", 3, torch.bfloat16,
                            progress), {})
    assert torch.equal(got, torch.tensor([0.5, 0.0, 2.0, 0.0]))  # |logits - expected|, flat
    assert route == [0.125]  # the run's own selection-score deviation


def test_stream_deviation_defaults_to_seed_0_fp32_no_progress_and_no_route(asked):
    streaming.stream_deviation(TOY, 1)
    assert asked.pop() == ((TOY, layout_for(TOY), 1, None, None, "layer", 0, torch.float32,
                            None), {})


def test_stream_deviation_refuses_a_degree_the_layout_does_not_take(asked):
    from weight_sync_bench.errors import UnsupportedLayout
    with pytest.raises(UnsupportedLayout):
        streaming.stream_deviation(TOY, 3)
    assert not asked


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16, torch.float16])
def test_a_pass_narrows_the_catalogue_of_its_own_dtype(weights):
    layout = layout_for(TOY)
    found = streaming.Found.of(TOY, layout, 2, weights)
    names = [c.name for c in found.naming.alive]
    assert names == [c.name for c in layout_naming(TOY, layout, 2, weights).alive]
    # a round trip through the weights' own dtype changes nothing: not a candidate (nor
    # bf16 through fp16: not declared either way, ``mutations._exact_for``)
    assert ("bf16_round_trip" in names) == (weights != torch.bfloat16)
    assert ("fp16_round_trip" in names) == (weights == torch.float32)
    # and of its own degree: one rank's shards are the whole tensors, no layout moves a row
    one = [c.name for c in streaming.Found.of(TOY, layout, 1, weights).naming.alive]
    assert one == [c.name for c in layout_naming(TOY, layout, 1, weights).alive]
    assert "contiguous_qkv" in names and "contiguous_qkv" not in one


def test_a_pass_that_found_a_difference_narrows_on_what_it_found_equal_before_it(monkeypatch):
    layout = layout_for(TOY)
    found = streaming.Found.of(TOY, layout, 2, torch.bfloat16)
    asked = []
    monkeypatch.setattr(streaming, "observe_redrawn", lambda *a: asked.append(a))
    assert found.named(TOY, layout, 2, 5, torch.bfloat16) is NONE  # nothing differs
    assert not asked
    assert found.compared("tok_embeddings.weight", True) is False
    assert found.compared("layers.0.attention_norm.weight", False) is True
    named = found.named(TOY, layout, 2, 5, torch.bfloat16)
    assert asked == [(found.naming, ["tok_embeddings.weight"], TOY, layout, 2, 5,
                      torch.bfloat16)]
    assert named == found.naming.named()


def test_a_streamed_moe_split_keeps_the_references_near_tied_choices_as_the_whole_check():
    """In process an MoE pass routes under the reference's guard (its near ties, its
    routing deviation), as the whole-model check does: the same verdict."""
    from weight_sync_bench import check_split
    from weight_sync_bench.model.config import TOY_MOE

    split = streaming.stage_split(layout_for(TOY_MOE))
    whole, streamed = check_split(split, TOY_MOE, 2), check_split(split, TOY_MOE, 2,
                                                                  stream="layer")
    assert whole.passed and streamed.passed and streamed.near_ties is not None
    assert (streamed.max_abs_error, streamed.threshold, streamed.near_ties, streamed.route) == (
        whole.max_abs_error, whole.threshold, whole.near_ties, whole.route)


@pytest.mark.parametrize("per", ["layer", "parameter"])
def test_progress_reports_a_stages_bytes_whole_however_it_is_taken(per):
    from weight_sync_bench.check.stream import stages, stream_check

    reports = []
    began = time.perf_counter()
    stream_check(WIDE, 2, per=per, dtype="bf16", threshold=1.0, progress=reports.append)
    took = time.perf_counter() - began
    shapes = WIDE.param_shapes()
    assert [(r.label, r.bytes) for r in reports] == [
        (label, sum(math.prod(shapes[n]) for n in names) * 2) for label, names in stages(WIDE)]
    # seconds since the check began: measured against this test's own clock, no bound of its own
    assert all(0 <= a.elapsed <= b.elapsed <= took for a, b in zip(reports, reports[1:]))


def test_a_streamed_verdict_at_another_seed_is_the_whole_checks_at_that_seed():
    from weight_sync_bench import check_split

    split = streaming.stage_split(layout_for(WIDE))
    # a seed whose error is not seed 0's on this CPU (on an AMD EPYC, seeds 0 and 3 round
    # alike), so a streamed check that drops the seed is seen
    at_0 = check_split(split, WIDE, 2, threshold=1.0).max_abs_error
    seed = next(s for s in range(3, 20)
                if check_split(split, WIDE, 2, seed=s, threshold=1.0).max_abs_error != at_0)
    whole = check_split(split, WIDE, 2, seed=seed, threshold=1.0)
    streamed = check_split(split, WIDE, 2, seed=seed, threshold=1.0, stream="parameter")
    assert streamed.max_abs_error == whole.max_abs_error > 0
    assert whole.max_abs_error != at_0


def test_a_streamed_bf16_check_names_only_what_its_own_dtypes_catalogue_holds():
    """bf16 weights sent through fp16 and back: not declared a mutation either way for bf16
    weights (``mutations._exact_for``), so no verdict names it, whole or streamed. On TOY
    over a 512-word vocabulary (its embedding and head are most of TOY's bytes; the naming
    does not depend on them), judged by explicit thresholds: no floor is committed for it."""
    from weight_sync_bench import check_split

    narrow = narrowed(TOY)
    split = streaming.stage_split(layout_for(narrow))

    def via_fp16(full, degree):
        return [{n: x.to(torch.float16).to(x.dtype) for n, x in rank.items()}
                for rank in split(full, degree)]
    whole = check_split(via_fp16, narrow, 2, dtype="bf16", threshold=1e-3)
    streamed = check_split(via_fp16, narrow, 2, dtype="bf16", threshold=1e-3, stream="layer")
    assert not whole.passed and not streamed.passed  # TOY's draws hold values below 2^-17
    assert streamed.named_mutation == whole.named_mutation != "fp16_round_trip"
    fp32 = check_split(via_fp16, narrow, 2, threshold=THRESHOLD, stream="layer")
    assert fp32.named_mutation == "fp16_round_trip"  # the twin: fp32 weights' catalogue


def test_an_moe_pass_guards_its_forward_with_the_references_routings_at_the_bound(
        sharded_guards):
    from weight_sync_bench.model.config import TOY_MOE
    from weight_sync_bench.model.sharded import RoutingGuard

    layout = layout_for(TOY_MOE)
    run = streaming.run_inprocess(TOY_MOE, layout, 2, None, None, "layer", 0, torch.float32,
                                  None, route_bound=0.25)
    guard, = sharded_guards
    assert isinstance(guard, RoutingGuard) and guard.bound == 0.25
    assert sorted(guard.routings) == list(range(TOY_MOE.n_layers))  # the reference's, filled
    assert run.near_ties == guard.near_ties() and run.near_ties[1] > 0
    streaming.run_inprocess(TOY_MOE, layout, 2, None, None, "layer", 0, torch.float32, None)
    assert sharded_guards[-1].bound == math.inf  # unbounded: the floor of the continuous part
    dense = streaming.run_inprocess(WIDE, layout_for(WIDE), 2, None, None, "layer", 0,
                                    torch.float32, None)
    assert sharded_guards[-1] is None and dense.near_ties is None  # the twin: a dense model's


def test_an_moe_streamed_deviation_reports_its_own_routing_deviation():
    from weight_sync_bench.model.config import TOY_MOE

    route: list[float] = []
    streaming.stream_deviation(TOY_MOE, 2, route=route)
    deviation, = route
    assert isinstance(deviation, float) and 0 < deviation < 1e-3  # rounding, not a flip


def test_a_pass_names_from_the_catalogue_of_its_own_degree_seed_and_dtype(monkeypatch):
    made, named = [], []
    of, name = streaming.Found.of, streaming.Found.named
    monkeypatch.setattr(streaming.Found, "of",
                        classmethod(lambda cls, *a: made.append(a) or of(*a)))
    monkeypatch.setattr(streaming.Found, "named",
                        lambda self, *a: named.append(a) or name(self, *a))
    layout = layout_for(WIDE)
    streaming.run_inprocess(WIDE, layout, 2, None, None, "parameter", 4, torch.bfloat16, None)
    assert made == [(WIDE, layout, 2, torch.bfloat16)]
    assert named == [(WIDE, layout, 2, 4, torch.bfloat16)]


def module_level(shards, dst):
    """A streamed fn a rank process can unpickle (by reference)."""
    return shards


class Pool:
    """A rank pool standing in: records the task it is asked to run, returns rank outcomes.
    (The tests that use it do not say "gloo" in their names: the mutation runs deselect
    ``-k "not gloo"``.)"""

    def __init__(self):
        self.asked = []
        self.logits, self.expected = torch.ones(1, 2, 3), torch.zeros(1, 2, 3)

    def run(self, task, degree, *, kwargs):
        self.asked.append((task, degree, kwargs))
        first = {"differ": ["x"], "diagnosis": ["why"], "named": NONE, "logits": self.logits,
                 "expected": self.expected, "rss": (1, 2)}
        return [first, *({"rss": (10 * r, 10 * r + 1)} for r in range(1, degree))]


def test_a_pass_in_rank_processes_runs_the_stream_task_on_every_rank_with_what_it_is_given():
    pool = Pool()
    run = streaming.run_gloo(WIDE, 3, module_level, 2, "parameter", 5, torch.bfloat16, pool)
    assert pool.asked == [(streaming.stream_task, 3,
                           dict(config=WIDE, fn=module_level, src=2, per="parameter", seed=5,
                                dtype="bf16"))]
    assert (run.differ, run.diagnosis, run.named) == (["x"], ["why"], NONE)
    assert run.logits is pool.logits and run.expected is pool.expected  # rank 0's
    assert run.rank_rss == ((1, 2), (10, 11), (20, 21))  # every rank's, in rank order
    streaming.run_gloo(WIDE, 2, None, None, "layer", 0, torch.float32, pool)
    assert pool.asked[-1][1:] == (2, dict(config=WIDE, fn=None, src=None, per="layer", seed=0,
                                          dtype="fp32"))


def test_a_pass_in_rank_processes_refuses_a_fn_a_rank_cannot_unpickle_before_any_runs():
    pool = Pool()
    with pytest.raises(TypeError, match=r"^a streamed check over gloo runs fn <function .*"
                                        r"<lambda>.*> on rank 0, so it must be picklable by "
                                        r"reference \(a module-level function\): "):
        streaming.run_gloo(WIDE, 2, lambda shards, dst: shards, 1, "layer", 0, torch.float32,
                           pool)
    assert not pool.asked


@pytest.mark.parametrize("dst,size", [(2, 4), (4, 4), (6, 6)])
def test_a_pass_in_rank_processes_takes_the_shared_pool_of_at_least_four_ranks(monkeypatch, dst, size):
    pool, sized = Pool(), []
    monkeypatch.setattr(streaming, "shared_pool", lambda n: sized.append(n) or pool)
    streaming.run_gloo(WIDE, dst, None, None, "layer", 0, torch.float32, None)
    assert sized == [size] and pool.asked[0][1] == dst


@pytest.mark.parametrize("src,role,what", [(None, "splitter", "splitting"),
                                           (1, "resharder", "resharding 1 -> 2")])
def test_a_streamed_fns_error_names_its_role_what_it_was_doing_and_to_which_parameters(
        src, role, what):
    from weight_sync_bench.errors import UserCodeError

    def raises(given, dst):
        if len(given if src is None else given[0]) > 1:  # the first layer's stage
            raise RuntimeError("no")
        return (streaming.stage_split if src is None else streaming.stage_reshard)(
            layout_for(WIDE))(given, dst)
    stage = ", ".join(next(names for label, names in streaming.stages(WIDE)
                           if label == "layers.0"))
    pattern = (rf"^your {role} `.*raises` raised RuntimeError while {what} wide "
               rf"\({re.escape(stage)}\): no\n")
    with pytest.raises(UserCodeError, match=pattern):
        streaming.run_inprocess(WIDE, layout_for(WIDE), 2, raises, src, "layer", 0,
                                torch.float32, None)


@pytest.mark.parametrize("src", [None, 2])
def test_a_streamed_fn_that_asks_for_the_config_gets_the_checks(src):
    seen = []
    split, reshard = streaming.stage_split(layout_for(WIDE)), streaming.stage_reshard(
        layout_for(WIDE))

    def fn(given, dst, *, config):
        seen.append(config)
        return (split if src is None else reshard)(given, dst)
    run = streaming.run_inprocess(WIDE, layout_for(WIDE), 2, fn, src, "layer", 0,
                                  torch.float32, None)
    assert not run.differ and seen == [WIDE] * len(streaming.stages(WIDE))


def test_a_streamed_reshard_onto_one_rank_compares_its_whole_tensors():
    reshard = streaming.stage_reshard(layout_for(WIDE))
    run = streaming.run_inprocess(WIDE, layout_for(WIDE), 1, reshard, 2, "parameter", 0,
                                  torch.float32, None)
    assert not run.differ

    def scaled(shards, dst):  # the twin: one element of the last parameter doubled
        out = reshard(shards, dst)
        if "lm_head.weight" in out[0]:
            out[0]["lm_head.weight"] = out[0]["lm_head.weight"].clone()
            out[0]["lm_head.weight"][-1, -1] *= 2
        return out
    run = streaming.run_inprocess(WIDE, layout_for(WIDE), 1, scaled, 2, "parameter", 0,
                                  torch.float32, None)
    assert run.differ == ["lm_head.weight"]


def test_a_shard_of_too_few_dimensions_is_not_the_declared_one():
    layout = layout_for(WIDE)
    spec = layout["layers.0.down.weight"]  # cut along dim 1
    full = torch.arange(16 * 96, dtype=torch.float32).reshape(16, 96)
    assert spec.ranges(2, 0)[0] == 1
    assert streaming.declared_shard(full[:, :48], full, spec, 2, 0)
    assert not streaming.declared_shard(full[:, 48:], full, spec, 2, 0)
    assert not streaming.declared_shard(full[0, :48], full, spec, 2, 0)  # 1-D: no dim 1
    assert not streaming.declared_shard(full[:, :47], full, spec, 2, 0)

"""Every planner mutation is caught twice: by the element check (bit-exact, no gather), on
tiny geometries where it costs little, and by the destination forward (over gloo, against
the reference, within the phase 1b threshold), on TOY / TOY_KV4 / TOY_MOE, whose floors
are measured.
The twin of each: the unmutated plan passes both checks in the same session."""

from __future__ import annotations

import pytest

from tests.sync.conftest import tiny
from tests.breadth import breadth
from weight_sync_bench.model.config import TOY, TOY_KV4, TOY_MOE
from weight_sync_bench.sync import SyncSession, plan_for, sync_layout
from weight_sync_bench.sync.mutations import PLAN_MUTATIONS, NotApplicable

# (config, source, destination, the mutations that apply there)
FORWARD_CASES = [
    (TOY_KV4, "megatron:4", "vllm:2", ["qk_swapped", "gate_up_swapped", "dst_ranks_swapped",
                                       "box_overlap", "dropped_transfer"]),
    (TOY, "megatron:2", "vllm:4", ["kv_replica_off_by_one"]),  # 2 KV heads on 4 ranks
    (TOY, "megatron:tp=2,pp=2", "vllm:4", ["stages_publish_local_indices"]),
    # vLLM's stacked experts (w13_weight [4, 2F, d] per rank, EP 2), judged by TOY_MOE's 1b
    # floor's expert-parallel cell; the plan's other kinds of bug too (the default run's case)
    (TOY_MOE, "megatron:tp=2,ep=2", "vllm:tp=2,ep=2", ["experts_swapped", "dst_ranks_swapped",
                                                      "box_overlap", "dropped_transfer"]),
]
ELEMENT_CASES = [(tiny(4), "megatron:4", "vllm:2"), (tiny(4), "plain:1", "meta:2"),
                 (tiny(2), "megatron:2", "vllm:4"), (tiny(4), "fsdp:4", "plain:2"),
                 (tiny(2, n_layers=2), "megatron:tp=2,pp=2", "vllm:2"),
                 (tiny(4, n_experts=4, top_k=2, expert_ffn=16), "megatron:tp=2,ep=2",
                  "vllm:tp=2,ep=2")]
# What each mutation does wrong: the kinds of bug the forward is shown to catch.
KIND = {"qk_swapped": "rows exchanged within a tensor",
        "gate_up_swapped": "rows exchanged within a tensor",
        "experts_swapped": "rows exchanged within a tensor",
        "dst_ranks_swapped": "a shard on the wrong rank",
        "box_overlap": "a write over another's", "dropped_transfer": "a write missing",
        "kv_replica_off_by_one": "the wrong KV replica",
        "stages_publish_local_indices": "the wrong layer"}
# The forward's default case: one TOY_MOE session (its twin: vLLM's expert-parallel forward
# passing) with one mutation of each kind of bug but the two below: rows exchanged within a
# stored tensor (experts_swapped), a shard on the wrong rank, a write over another's, a write
# missing. In the long run: the TOY_KV4 case (3.4 s: a session of its own; its mutations
# are of the same kinds on the dense plan) and the replicated-KV and staged cases; every
# mutation fails the element check by default (below).
FORWARD_DEFAULT = {"toy_moe:experts_swapped+dst_ranks_swapped+box_overlap+dropped_transfer"}


def _forward_id(case):
    return f"{case[0].name}:{'+'.join(case[3])}"


# By default the four cases that between them try every mutation (the TP regrouping, KV
# replication, pipeline stages and stacked experts: each kind of plan a mutation applies to);
# plain:1 -> meta:2 and fsdp:4 -> plain:2 (0.2-0.5 s each) in the long run: the mutations
# they apply to fail the element check on the default cases too
# (test_every_mutation_is_tried_by_both_checks), and their plans move B_min bytes with every
# element exact by default in tests/sync/test_transport.py.
ELEMENT_DEFAULT = {"tiny_kv4-megatron:4-vllm:2", "tiny_kv2-megatron:2-vllm:4",
                   "tiny_kv2-megatron:tp=2,pp=2-vllm:2",
                   "tiny_kv4-megatron:tp=2,ep=2-vllm:tp=2,ep=2"}


def _element_id(case):
    return "-".join(getattr(v, "name", str(v)) for v in case)


def _applicable(plan):
    out = {}
    for name, mutation in PLAN_MUTATIONS.items():
        try:
            out[name] = mutation(plan)
        except NotApplicable:
            pass
    return out


def test_every_mutation_is_tried_by_both_checks():
    assert {m for *_, ms in FORWARD_CASES for m in ms} == set(PLAN_MUTATIONS) == set(KIND)
    # the forward's default case catches every kind of bug but the two whose cases are the
    # long run's (a replica, a layer: TOY's 2 KV heads at 4 ranks, TOY's stages)
    forward = {KIND[m] for case in FORWARD_CASES if _forward_id(case) in FORWARD_DEFAULT
               for m in case[3]}
    assert forward == set(KIND.values()) - {KIND["kv_replica_off_by_one"],
                                            KIND["stages_publish_local_indices"]}
    tried = {name for c, a, b in ELEMENT_CASES
             for name in _applicable(plan_for(sync_layout(c, a), sync_layout(c, b)))}
    assert tried == set(PLAN_MUTATIONS)
    # the default run's cases alone try every mutation: the long run's add none
    by_default = {name for c, a, b in ELEMENT_CASES if _element_id((c, a, b)) in ELEMENT_DEFAULT
                  for name in _applicable(plan_for(sync_layout(c, a), sync_layout(c, b)))}
    assert by_default == set(PLAN_MUTATIONS)


# By default FORWARD_DEFAULT (above: one mutation of each kind of bug but a replica's and a
# layer's); the rest in the long run (their mutations fail the element check by default,
# below).
@pytest.mark.parametrize(("config", "src", "dst", "names"), breadth(
    FORWARD_CASES, keep=FORWARD_DEFAULT, name=_forward_id),
    ids=lambda v: getattr(v, "name", str(v)))
def test_each_planner_mutation_fails_the_forward(config, src, dst, names, pool):
    with SyncSession(config, src, dst, pool=pool) as session:
        twin = session.run()
        assert twin.passed and twin.verdict.passed, twin.summary()
        for name in names:
            plan = PLAN_MUTATIONS[name](session.plan)
            assert plan.mutation == name and plan.transfers != session.plan.transfers
            verdict = session.run(plan=plan, elements=False).verdict
            assert verdict.ratio > 10 and not verdict.passed, f"{name}: {verdict}"
            assert verdict.mutation == name


@pytest.mark.parametrize(("config", "src", "dst"), breadth(
    ELEMENT_CASES, keep=ELEMENT_DEFAULT, name=_element_id),
    ids=lambda v: getattr(v, "name", str(v)))
def test_each_planner_mutation_fails_the_element_check(config, src, dst, pool):
    with SyncSession(config, src, dst, pool=pool, forward=False) as session:
        assert session.run(bucket_bytes=4096).elements_passed
        for name, plan in _applicable(session.plan).items():
            result = session.run(plan=plan, bucket_bytes=4096)
            assert not result.elements_passed and not result.passed, name
            assert any(e.differ for e in result.elements), name


def test_a_mutation_with_nothing_to_break_says_so():
    plan = plan_for(sync_layout(tiny(4), "plain:2"), sync_layout(tiny(4), "plain:2"))
    with pytest.raises(NotApplicable, match=r"plain:2 -> plain:2: no transfer between ranks"):
        PLAN_MUTATIONS["dropped_transfer"](plan)
    with pytest.raises(NotApplicable, match=r"plain:2 replicates no KV head \(HP\(8,4,8\)\)"):
        PLAN_MUTATIONS["kv_replica_off_by_one"](plan)

"""Phase 2 between layouts with pipeline stages (and experts): a Megatron ``tp x pp`` source
(with virtual stages, data-parallel replicas, expert parallelism) to vLLM and back, planned
and executed with no full tensor anywhere, bytes counted at the transport equal to B_min,
every destination element checked; a plan whose stages claim one layer is named a coverage
failure (``Plan.writes``: the tensors written twice, with their writers, and those never
written), and fails the element check too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.breadth import breadth
from tests.sync.conftest import tiny
from weight_sync_bench.model.config import TOY, TOY_MOE
from weight_sync_bench.sync import SyncSession, minimum_bytes, plan_for, sync_layout
from weight_sync_bench.sync import session as session_module
from weight_sync_bench.sync.mutations import PLAN_MUTATIONS, NotApplicable
from weight_sync_bench.tolerance.rules import floor_for

DEEP = tiny(2, n_layers=4).replace(name="tiny_deep")
DEEP_MOE = tiny(4, n_layers=4, n_experts=4, top_k=2, expert_ffn=16).replace(name="tiny_deep_moe")


# 2 s (TOY's 19M parameters and vLLM's forward at tp 4): the long run. Its equivalent in the
# default run: staged sources move B_min bytes with every element checked into vLLM and
# between staged layouts on DEEP (test_between_staged_layouts_every_element_arrives_once,
# test_two_stages_claiming_one_layer_is_a_coverage_failure: megatron:tp=2,pp=2 -> vllm:2),
# and vLLM's forward at tp 4 reads TOY's megatron:tp=2,pp=2 converted by the harness in
# tests/conventions/test_pipeline.py::test_check_convert_over_stages_passes_a_correct_converter
# (the same floor's forward); the forward after a phase 2 sync runs by default in
# tests/sync/test_mutations.py and test_verify.py.
@pytest.mark.slow
def test_megatron_tp2_pp2_to_vllm_tp4_moves_b_min_and_checks_every_element(pool):
    with SyncSession(TOY, "megatron:tp=2,pp=2", "vllm:4", pool=pool) as session:
        result = session.run()
    assert result.passed, result.summary()
    assert result.bytes_moved == result.b_min == minimum_bytes(session.src, session.dst)
    assert result.coverage == 1.0 and result.elements_passed and not result.writes
    assert result.verdict is not None and result.verdict.passed  # vLLM's forward ran


@pytest.mark.parametrize(("config", "src", "dst", "dp"), [
    # 12 s at TOY's width: the long run; by default virtual stages arrive from DEEP's below
    pytest.param(TOY, "vllm:4", "megatron:tp=2,pp=2,vpp=2", 1, marks=pytest.mark.slow),
    (DEEP, "megatron:tp=1,pp=2,vpp=2", "vllm:2", 2),
    (DEEP, "megatron:tp=2,pp=2,pp_last=3", "megatron:tp=1,pp=4", 1),
    (DEEP_MOE, "megatron:tp=1,pp=2,ep=2", "hf", 1),
    (DEEP_MOE, "megatron:tp=2,ep=2", "megatron:tp=1,pp=2,ep=2,experts=sequential", 1),
], ids=lambda v: str(v))
def test_between_staged_layouts_every_element_arrives_once(config, src, dst, dp, pool):
    with SyncSession(config, src, dst, dp=dp, pool=pool, forward=False) as session:
        result = session.run(bucket_bytes=4096)
        stale = session.run(into="existing")
    assert result.passed and stale.passed, result.summary()
    assert result.bytes_moved == result.b_min and result.coverage == 1.0
    assert not session.plan.writes()


def test_two_stages_claiming_one_layer_is_a_coverage_failure(pool):
    with SyncSession(DEEP, "megatron:tp=2,pp=2", "vllm:2", pool=pool, forward=False) as session:
        assert session.run().passed  # the twin: the harness's plan
        plan = PLAN_MUTATIONS["stages_publish_local_indices"](session.plan)
        result = session.run(plan=plan)
        stale = session.run(plan=plan, into="existing")
    assert not result.passed and not stale.passed and not stale.elements_passed
    head, *lines = result.writes
    # layers 2-3 on stage 1 (6 tensors each, both destination ranks) land in layers 0-1
    assert head == "24 destination tensors written twice, 24 with elements never written"
    text = "\n".join(lines)
    assert ("rank 0 model.layers.0.self_attn.qkv_proj.weight: written twice: local: "
            "layers.0.qkv.weight") in text
    assert "rank 2 -> rank 0: layers.2.qkv.weight" in text  # the second writer, named
    assert "model.layers.2.input_layernorm.weight: 32 of 32 elements never written" in text
    summary = result.summary()
    assert "coverage: the plan writes 24 destination tensors written twice" in summary


def test_plan_writes_names_what_the_planner_mutations_break():
    plan = plan_for(sync_layout(tiny(4), "megatron:4"), sync_layout(tiny(4), "vllm:2"))
    assert plan.writes() == ()
    dropped = PLAN_MUTATIONS["dropped_transfer"](plan).writes()
    assert dropped[0] == "0 destination tensors written twice, 1 with elements never written"
    overlap = PLAN_MUTATIONS["box_overlap"](plan).writes()
    assert overlap[0].startswith("1 destination tensors written twice") and \
        "written twice: rank" in overlap[1]
    # the bugs that move bytes to the wrong place keep one write per element: the element
    # check and the forward find those
    assert PLAN_MUTATIONS["qk_swapped"](plan).writes() == ()
    with pytest.raises(NotApplicable, match="megatron:4 has no pipeline stages"):
        PLAN_MUTATIONS["stages_publish_local_indices"](plan)


# By default one pair into vLLM's stacked experts and one out of them (0.4-0.6 s each):
# megatron:tp=2,ep=2 -> vllm:tp=4,ep=4 (the pair whose forward runs in the long run below;
# its stacks split over both TP and EP) and vllm:tp=2,ep=2 -> megatron:tp=1,pp=2,ep=2 (out
# of the stacks into staged experts). The pipeline-staged source, the data-parallel replicas
# and vLLM to vLLM in the long run: staged experts arrive by default in
# test_between_staged_layouts_every_element_arrives_once, data-parallel sources in
# tests/sync/test_transport.py, and each member is a view of the same stored tensor whatever
# the other end.
@pytest.mark.parametrize(("src", "dst", "dp"), breadth([
    ("megatron:tp=1,pp=2,ep=2", "vllm:tp=2,ep=2", 1),
    ("megatron:tp=1,pp=2", "vllm:tp=2,ep=2", 2),  # over data-parallel replicas
    ("megatron:tp=2,ep=2", "vllm:tp=4,ep=4", 1),
    ("vllm:tp=2,ep=2", "megatron:tp=1,pp=2,ep=2", 1),  # and back
    ("vllm:tp=4,ep=4", "vllm:2", 1),
], keep={"megatron:tp=2,ep=2-vllm:tp=4,ep=4-1", "vllm:tp=2,ep=2-megatron:tp=1,pp=2,ep=2-1"},
    name=lambda case: "-".join(map(str, case))), ids=str)
def test_into_and_out_of_vllms_stacked_experts_every_element_arrives_once(src, dst, dp, pool):
    """vLLM's fused-MoE tensors stack a rank's experts (``w13_weight [E_local, 2F/t, d]``,
    ``w2_weight [E_local, d, F/t]``): phase 2 moves each member as a view of the stored
    tensor, into fresh and into existing storage, B_min bytes, every element checked."""
    with SyncSession(DEEP_MOE, src, dst, dp=dp, pool=pool, forward=False) as session:
        result = session.run(bucket_bytes=4096)
        stale = session.run(into="existing")
    assert result.passed and stale.passed, result.summary()
    assert result.bytes_moved == result.b_min == stale.bytes_moved and result.coverage == 1.0
    assert not session.plan.writes()


def test_a_stacked_member_is_named_where_a_plan_breaks_it(pool):
    layout = sync_layout(DEEP_MOE, "vllm:tp=2,ep=2")
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert [n for n in layout.parts[0] if n.startswith(w13)] == [f"{w13}[0]", f"{w13}[1]"]
    with SyncSession(DEEP_MOE, "megatron:tp=2,ep=2", layout, pool=pool, forward=False) as session:
        assert session.run().passed  # the twin
        swapped = session.run(plan=PLAN_MUTATIONS["experts_swapped"](session.plan))
        into = [t for t in session.plan.transfers if t.dst_rank == 1 and t.dst_name == f"{w13}[1]"]
        dropped = session.run(plan=session.plan.with_transfers(
            [t for t in session.plan.transfers if t not in into], "dropped"))
    assert not swapped.passed and swapped.elements[0].differ[0] == w13  # the stored tensor
    assert "holds" in swapped.summary() and "expert" in swapped.summary(), swapped.summary()
    assert not dropped.passed
    assert f"rank 1 {w13}[1]: " in "\n".join(dropped.writes), dropped.writes  # the member


# 4 s (TOY_MOE's 20M parameters, then vLLM's expert-parallel forward): the long run. By
# default vLLM's expert-parallel forward passes, and fails experts_swapped, from
# megatron:tp=2,ep=2 at vllm:tp=2,ep=2 (the same floor's expert-parallel cell) in
# tests/sync/test_mutations.py::test_each_planner_mutation_fails_the_forward[toy_moe-...],
# and this pair moves B_min bytes with every element checked on DEEP_MOE in
# test_into_and_out_of_vllms_stacked_experts_every_element_arrives_once.
@pytest.mark.slow
def test_megatron_tp2_ep2_to_vllm_tp4_ep4_runs_vllms_expert_parallel_forward(pool):
    with SyncSession(TOY_MOE, "megatron:tp=2,ep=2", "vllm:tp=4,ep=4", pool=pool) as session:
        assert session.forward  # TOY_MOE's phase 1b floor has an expert-parallel cell at 4
        result = session.run()
    assert result.passed and result.verdict is not None and result.verdict.passed, \
        result.summary()
    assert result.bytes_moved == result.b_min


def test_a_forward_the_floor_never_measured_is_not_run(monkeypatch, pool):
    """A phase 1b floor without a cell of the destination's forward at its degree (here
    TOY_MOE's, its expert-parallel cells taken out) judges no forward: the elements are
    checked and a note says why, naming the command that measures the cell."""
    floor = floor_for(TOY_MOE, "1b")
    cells = [c for c in floor.artifact["cells"] if c.get("forward") != "expert-parallel"]
    assert len(cells) < len(floor.artifact["cells"])
    plain = replace(floor, artifact={**floor.artifact, "cells": cells})
    monkeypatch.setattr(session_module, "floor_for", lambda config, phase: plain)
    with SyncSession(TOY_MOE, "megatron:tp=2,ep=2", "vllm:tp=2,ep=2", pool=pool) as session:
        assert not session.forward
        result = session.run()
    assert result.passed and result.verdict is None
    note = next(n for n in result.notes if n.startswith("no forward: "))
    assert "toy_moe: no measured floor covers the forward of vllm:tp=2,ep=2" in note
    assert "runs the expert-parallel forward" in note and "Measure it with `" in note


def test_a_staged_destination_states_what_each_stage_holds():
    layout = sync_layout(DEEP, "megatron:tp=2,pp=2")
    assert layout.world == 4 and layout.replica == 4 and not layout.runs_forward
    assert layout.stated_ranges("layers.3.qkv.weight", 0)[1] == []
    assert layout.stated_ranges("layers.3.qkv.weight", 3)[1] != []
    assert layout.stated_ranges("tok_embeddings.weight", 2)[1] == []
    assert layout.stated_ranges("lm_head.weight", 2)[1] != []
    tied = sync_layout(DEEP.replace(tie_embeddings=True), "megatron:tp=2,pp=2")
    assert tied.stated_ranges("tok_embeddings.weight", 2)[1] != []  # the last stage's copy


def test_a_destination_written_twice_with_the_same_bytes_still_fails(pool):
    # every element arrives right, so only the write count shows it: a duplicated transfer
    with SyncSession(DEEP, "megatron:tp=2,pp=2", "vllm:2", pool=pool, forward=False) as session:
        first = next(t for t in session.plan.transfers if not t.local)
        twice = session.plan.with_transfers([*session.plan.transfers, first], "duplicated")
        result = session.run(plan=twice)
    assert result.elements_passed and not result.passed
    assert result.writes[0] == "1 destination tensors written twice, 0 with elements never written"


def test_the_element_check_says_which_layer_a_tensor_holds(pool):
    with SyncSession(DEEP, "megatron:tp=2,pp=2", "vllm:2", pool=pool, forward=False) as session:
        plan = PLAN_MUTATIONS["stages_publish_local_indices"](session.plan)
        result = session.run(plan=plan)
    assert any("holds layer 2's attn_norm.weight (its declared cut) byte for byte; declared "
               "layer 0's" in line for e in result.elements for line in e.lines), result.summary()

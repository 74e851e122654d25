"""The planner's outputs read exactly (issue 30's mutation testing of ``sync/planner.py``).

``Plan.writes``, the coverage the plan promises before a byte moves: each kind of break (never
written, written twice by a partial overlap or a whole duplicate, with and without any writer)
named with its rank, tensor and counts, padding left out of what a tensor needs, and the line
limit splitting the lines between the kinds. Each has its twin: the correct plan, and
transfers that touch without overlapping, report nothing. Then the build time and a lone
``Run``, both data the summary and the ranks read.

Pure (no rank pool): a plan is data, so the mutations below are edits of its transfers."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tests.sync.conftest import tiny
from weight_sync_bench.sync import plan_for, sync_layout
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.planner import (
    Plan,
    Run,
    Transfer,
    _overlap,
    build_plan,
    runs,
)

QKV = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return plan_for(sync_layout(tiny(4), "megatron:4"), sync_layout(tiny(4), "vllm:2"))


def _edit(plan: Plan, transfers: list[Transfer]) -> tuple[str, ...]:
    return plan.with_transfers(transfers, "edited").writes()


def _into(plan: Plan, rank: int, name: str) -> list[int]:
    return [i for i, t in enumerate(plan.transfers) if (t.dst_rank, t.dst_name) == (rank, name)]


def test_a_correct_plan_writes_every_element_once(plan):
    assert plan.writes() == ()
    # the twin of the partial-overlap case below: the plan's own transfers into one tensor
    # touch along dim 0 and never overlap
    first, second = (plan.transfers[i] for i in _into(plan, 0, QKV)[:2])
    assert first.dst_at[0] + first.region[0][1] - first.region[0][0] == second.dst_at[0]
    assert not _overlap(first, second) and not _overlap(second, first)


def test_a_dropped_piece_is_counted_and_a_tensor_no_transfer_writes_says_so(plan):
    qkv = _into(plan, 0, QKV)
    want = sum(plan.transfers[i].numel for i in qkv)  # rank 0's qkv rows, every column
    dropped = plan.transfers[qkv[-1]]
    kept = [t for i, t in enumerate(plan.transfers) if i != qkv[-1]]
    assert _edit(plan, kept) == (
        "0 destination tensors written twice, 1 with elements never written",
        f"rank 0 {QKV}: {dropped.numel} of {want} elements never written")
    none = [t for i, t in enumerate(plan.transfers) if i not in qkv]
    assert _edit(plan, none) == (
        "0 destination tensors written twice, 1 with elements never written",
        f"rank 0 {QKV}: {want} of {want} elements never written (no transfer writes it)")


def test_a_duplicate_and_a_one_row_overlap_are_written_twice_naming_both_writers(plan):
    qkv = _into(plan, 1, QKV)
    a, b = plan.transfers[qkv[0]], plan.transfers[qkv[1]]
    assert _edit(plan, [*plan.transfers, b]) == (
        "1 destination tensors written twice, 0 with elements never written",
        f"rank 1 {QKV}: written twice: {b} and {b}")
    # b moved up one row: it overlaps a's last row (and leaves its own last row unwritten,
    # which the twice line already covers: one line a tensor)
    up = replace(b, dst_at=(b.dst_at[0] - 1, *b.dst_at[1:]))
    edited = [up if t is b else t for t in plan.transfers]
    assert _overlap(a, up) and _overlap(up, a)
    assert _edit(plan, edited) == (
        "1 destination tensors written twice, 0 with elements never written",
        f"rank 1 {QKV}: written twice: {a} and {up}")


@pytest.mark.parametrize("shift", [(0, 1), (1, 0), (0, -1), (-1, 0)])
def test_overlap_is_a_common_element_in_every_dim_of_the_destination(shift):
    """Two 4 x 3 blocks of one destination tensor, at local corners a second block's region
    and corner both differ from (so a mix-up of region and corner, or of a and b, shows)."""
    a = Transfer("w", 0, "s", 1, "d", ((10, 14), (5, 8)), (0, 0), (2, 3))
    inside = replace(a, region=((20, 22), (0, 1)), dst_at=(3, 4))  # 2 x 1 inside a
    assert _overlap(a, inside) and _overlap(inside, a)
    # one row (or column) past a's far edge or before its near edge: they touch, no more
    dr, dc = shift
    corner = (2 + (4 if dr > 0 else -4 if dr < 0 else 0), 3 + (3 if dc > 0 else -3 if dc < 0 else 0))
    touching = replace(a, region=((30, 34), (40, 43)), dst_at=corner)
    assert not _overlap(a, touching) and not _overlap(touching, a)
    # one element further in: a common element in both dims
    deeper = replace(touching, dst_at=(corner[0] - dr, corner[1] - dc))
    assert _overlap(a, deeper) and _overlap(deeper, a)


def test_padding_is_not_an_element_a_tensor_needs():
    """vLLM pads the vocabulary to a multiple of 64 per rank: rank 1's 128 embedding rows hold
    122 of the 250 and 6 rows of zeros, which no transfer writes."""
    config = tiny(4, vocab=250)
    padded = plan_for(sync_layout(config, "megatron:2"), sync_layout(config, "vllm:2"))
    assert padded.writes() == ()
    name = "model.embed_tokens.weight"
    rows = [padded.transfers[i] for i in _into(padded, 1, name)]
    assert [t.numel for t in rows] == [122 * config.d_model]  # one transfer, 122 rows
    assert _edit(padded, [t for t in padded.transfers if t is not rows[-1]]) == (
        "0 destination tensors written twice, 1 with elements never written",
        (f"rank 1 {name}: {122 * config.d_model} of {122 * config.d_model} elements never "
         "written (no transfer writes it)"))


def test_the_limit_splits_the_lines_between_the_kinds_and_counts_the_rest(plan):
    # every tensor of rank 0 left unwritten, every transfer into rank 1 doubled
    rank0 = {t.dst_name for t in plan.transfers if t.dst_rank == 0}
    rank1 = {t.dst_name for t in plan.transfers if t.dst_rank == 1}
    kept = [t for t in plan.transfers if t.dst_rank != 0]
    broken = plan.with_transfers(kept + [t for t in kept if t.dst_rank == 1], "edited")
    head, *lines = broken.writes()
    twice, never = len(rank1), len(rank0)
    assert head == (f"{twice} destination tensors written twice, {never} with elements never "
                    "written")
    assert [line.split(":")[0] for line in lines[:4]] == [f"rank 1 {n}" for n in
                                                          _order(broken, 1)[:4]]
    assert all("written twice" in line for line in lines[:4])
    assert all("never written" in line for line in lines[4:8])
    assert lines[8:] == [f"... and {twice + never - 8} more"] and len(lines) == 9
    # a limit of 3: one of each kind, then the larger share to the kind that has lines left
    head3, *lines3 = broken.writes(limit=3)
    assert head3 == head and len(lines3) == 4
    assert "written twice" in lines3[0] and all("never" in x for x in lines3[1:3])
    assert lines3[3] == f"... and {twice + never - 3} more"
    # only one kind: the whole limit is its
    only = plan.with_transfers(kept, "edited").writes(limit=2)
    assert only[1:] == (*(x for x in only[1:3]), f"... and {never - 2} more")
    assert len(only) == 4 and all("never written" in x for x in only[1:3])
    everything = broken.writes(limit=twice + never)
    assert len(everything) == 1 + twice + never and "more" not in everything[-1]


def _order(plan: Plan, rank: int) -> list[str]:
    """The destination tensors of ``rank`` in the order ``writes`` visits them (its cover)."""
    return list(cover_of(plan.dst, validate=False).ranks[rank])


def test_the_build_time_is_the_time_build_plan_took_and_prints_in_milliseconds():
    config = tiny(2)
    src, dst = cover_of(sync_layout(config, "megatron:2")), cover_of(sync_layout(config, "vllm:1"))
    before = time.perf_counter()
    built = build_plan(src, dst)
    took = time.perf_counter() - before
    assert 0 < built.build_seconds <= took  # measured inside the call, not a clock reading
    head = replace(built, build_seconds=1.5).summary().split("\n")[0]
    assert head.endswith(", built in 1500.00 ms")


def test_a_lone_block_is_a_run_of_one_with_zero_steps():
    """What the ranks receive is the ``Run`` itself: its steps are data, zero for a run of one."""
    (lone,) = runs([("a", (4, 1), "b", (2, 0), (3, 5))])
    assert lone == Run("a", "b", (3, 5), (4, 1), (2, 0), (0, 0), (0, 0), 1, 0)



@pytest.mark.parametrize(("config", "a", "b", "dp", "sent"), [
    (tiny(4), "megatron:2", "vllm:1", 2, [0, 28672, 0, 28672]),
    (tiny(4), "megatron:2", "vllm:4", 2, [14336] * 4),
    (tiny(4), "megatron:4", "vllm:2", 2, [0, 6144, 6144, 6144, 0, 6144, 6144, 6144]),
    # three replicas, and rows of 64, 32 and 1 elements in one plan (250 vocabulary rows)
    (tiny(2, vocab=250), "fsdp:2", "vllm:1", 3, [0, 18240, 0, 18240, 0, 18240]),
], ids=str)
def test_replicas_share_the_bytes_sent_to_the_byte(config, a, b, dp, sent):
    """Over DP replicas each sending replica sends the same bytes (test_planner.py allows
    10% on TOY_KV4; here, exactly): the load the planner levels is bytes, each parameter's
    rows times its row's width, so the replicas of a plan mixing widths still come out even."""
    plan = plan_for(sync_layout(config, a, dp=dp), sync_layout(config, b))
    assert plan.sent() == sent


@pytest.mark.parametrize(("n_kv", "spec"), [(1, "vllm:2"), (1, "vllm:4"), (2, "megatron:2"),
                                             (4, "meta:2"), (4, "fsdp:4"), (4, "hf")])
def test_a_layout_to_itself_is_one_local_copy_per_box(n_kv, spec):
    """Every box copied whole from the rank's own copy, one transfer each: the sweep's
    segments of one (box, box) pair are coalesced. vLLM's replicated KV rows put another
    rank's box boundary inside a rank's own qkv box (kv 1), which without the coalescing
    is two transfers."""
    layout = sync_layout(tiny(n_kv), spec)
    plan = plan_for(layout, layout)
    boxes = sorted((b.rank, b.name, b.start, b.stop)
                   for stored in cover_of(layout).ranks for s in stored.values()
                   for b in s.boxes if b.source is not None)
    assert all(t.local for t in plan.transfers)
    assert sorted((t.dst_rank, t.dst_name, *t.region[_dim(layout, t)])
                  for t in plan.transfers) == boxes


def _dim(layout, t: Transfer) -> int:
    return cover_of(layout).ranks[t.dst_rank][t.dst_name].dim

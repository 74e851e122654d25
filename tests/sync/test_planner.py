"""The planner moves exactly the minimum: bytes between ranks equal ``B_min``, computed by an
oracle that shares no code with it (boolean masks over the canonical tensors), over a matrix
of layout pairs; replicated sources share the load; the plan is data, cached, and timed.

These are the planner's own figures; ``test_transport.py`` counts the bytes on the wire."""

from __future__ import annotations

import pytest

from tests.breadth import breadth
from tests.sync.conftest import tiny
from weight_sync_bench.errors import InvalidNumber, UnsupportedLayout
from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.sync import minimum_bytes, naive_bytes, plan_for, sync_layout, time_bound
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.planner import ELEMENT_SIZE, build_plan

TP = [1, 2, 4, 8]
# (geometry, source, destination, source dp)
PAIRS = (
    # plain TP a -> b, fused qkv and gate_up included (kv 8: every degree up to 8)
    [(tiny(8), f"plain:{a}", f"plain:{b}", 1) for a in TP for b in TP]
    # vLLM's KV replication: 1, 2 and 8 KV heads (8 replicates at t = 16)
    + [(tiny(1), f"vllm:{a}", f"vllm:{b}", 1) for a in TP for b in TP]
    + [(tiny(2), f"megatron:{a}", f"vllm:{b}", 1) for a in (1, 2) for b in TP]
    + [(tiny(8, n_heads=16), "megatron:8", "vllm:16", 1),
       (tiny(8, n_heads=16), "vllm:16", "megatron:2", 1)]
    # FSDP Shard(0) over a DP group -> TP, and back
    + [(tiny(4), f"fsdp:{d}", f"vllm:{b}", 1) for d in (2, 4, 8) for b in (1, 2, 4)]
    + [(tiny(4), "megatron:2", "fsdp:4", 1)]
    # DP x TP -> TP: each source shard held by dp replicas
    + [(tiny(4), f"megatron:{a}", f"vllm:{b}", dp) for a in (2, 4) for b in (1, 2, 4)
       for dp in (2,)]
    # Megatron's grouped qkv, vLLM, HF, Meta's pair-ordered rows and hidden-split embedding
    + [(tiny(4), "megatron:4", "vllm:2", 1), (tiny(4), "megatron:2", "meta:2", 1),
       (tiny(4), "meta:4", "megatron:1", 1), (tiny(4), "hf", "vllm:4", 1),
       (tiny(4), "meta:2", "hf", 1), (TOY_KV4, "megatron:4", "vllm:2", 1),
       (TOY, "megatron:2", "vllm:4", 1), (TOY_KV4, "megatron:4", "vllm:2", 2)]
)


def _id(case):
    config, a, b, dp = case
    return f"{config.name}-{a}{'x' + str(dp) if dp > 1 else ''}-{b}"


# Every pair by default but two of TOY's width (0.2-0.6 s each, the oracle's masks over 19M
# parameters): toy-megatron:2-vllm:4 is tiny_kv2-megatron:2-vllm:4's pair (2 KV heads
# replicated at 4) and toy_kv4-megatron:4x2-vllm:2 is tiny_kv4-megatron:4x2-vllm:2's (two
# data-parallel replicas of the source); TOY's width stays by default in
# toy_kv4-megatron:4-vllm:2, the pair the issue lists.
@pytest.mark.parametrize("case", breadth(
    [pytest.param(c, id=_id(c)) for c in PAIRS],
    keep={_id(c) for c in PAIRS} - {"toy-megatron:2-vllm:4", "toy_kv4-megatron:4x2-vllm:2"},
    name=lambda p: p.id))
def test_the_plan_moves_exactly_b_min_between_ranks(case):
    config, a, b, dp = case
    src, dst = sync_layout(config, a, dp=dp), sync_layout(config, b)
    plan = plan_for(src, dst)
    assert plan.bytes_between_ranks == minimum_bytes(src, dst)
    assert sum(plan.sent()) == sum(plan.received()) == plan.bytes_between_ranks
    # every destination element is written exactly once (padding: by the zeros)
    for rank in range(dst.world):
        stored = cover_of(dst).ranks[rank]
        want = sum(sum(b.length for b in s.boxes if b.source is not None)
                   * (s.numel // s.shape[s.dim]) for s in stored.values())
        assert sum(t.numel for t in plan.transfers if t.dst_rank == rank) == want


def test_the_matrix_has_what_the_issue_lists():
    names = {_id(c) for c in PAIRS}
    assert all(f"tiny_kv8-plain:{a}-plain:{b}" in names for a in TP for b in TP)
    assert {"tiny_kv1-vllm:1-vllm:4", "tiny_kv2-megatron:2-vllm:4", "tiny_kv8-megatron:8-vllm:16",
            "tiny_kv4-fsdp:4-vllm:2", "tiny_kv4-megatron:4x2-vllm:2",
            "toy_kv4-megatron:4-vllm:2"} <= names


def test_a_layout_the_geometry_cannot_hold_is_rejected_naming_the_rule():
    # vLLM at t = 3 over 2 KV heads: 3 % 2 != 0, so no replication count exists
    with pytest.raises(UnsupportedLayout, match=r"t % n_kv_heads == 0 when t > n_kv_heads"):
        sync_layout(tiny(2, n_heads=6), "vllm:3")
    # FSDP's Shard(0) divides evenly or is rejected, as every placement here is
    with pytest.raises(UnsupportedLayout, match=r"Shard needs shape\[0\] % t == 0"):
        sync_layout(tiny(2), "fsdp:3")


@pytest.mark.parametrize(("a", "b", "dp"), [("megatron:4", "vllm:2", 2), ("megatron:2", "vllm:1", 4),
                                            ("megatron:4", "vllm:1", 2)])
def test_replicated_sources_share_the_bytes_sent_within_ten_percent(a, b, dp):
    plan = plan_for(sync_layout(TOY_KV4, a, dp=dp), sync_layout(TOY_KV4, b))
    senders = [s for s in plan.sent() if s]
    assert max(senders) / (sum(senders) / len(senders)) <= 1.1, plan.sent()
    # and the copy a destination rank holds itself is never fetched
    assert all(t.src_rank != t.dst_rank or t.local for t in plan.transfers)


def test_a_replicated_piece_is_taken_from_the_local_copy_first():
    # DP replicas of what each destination rank already holds: nothing crosses
    plan = plan_for(sync_layout(TOY_KV4, "megatron:4", dp=2), sync_layout(TOY_KV4, "megatron:4"))
    assert plan.bytes_between_ranks == 0 and all(t.local for t in plan.transfers)
    # but Megatron pads the vocabulary to 128 t and vLLM to 64: the vocab boundaries move
    moved = plan_for(sync_layout(TOY_KV4, "megatron:4", dp=2), sync_layout(TOY_KV4, "vllm:4"))
    assert moved.bytes_between_ranks == minimum_bytes(moved.src, moved.dst) > 0


def test_the_naive_gather_then_scatter_moves_more_than_b_min_for_tp4_to_tp2():
    src, dst = sync_layout(TOY_KV4, "plain:4"), sync_layout(TOY_KV4, "plain:2")
    # gather 3/4 of the model to rank 0, scatter 1/2: 5/4 M, against B_min 3/4 M (norms aside)
    assert 1.6 < naive_bytes(src, dst) / minimum_bytes(src, dst) < 1.7


def test_t_min_is_the_busiest_ranks_larger_direction_over_the_bandwidth():
    """Per rank, the larger of what it sends and receives (both directions run at once);
    the largest over ranks, over the pair bandwidth. Each direction wins once."""
    assert time_bound([10, 4], [3, 12], 2.0) == 6.0  # rank 1's receiving
    assert time_bound([10, 4], [3, 2], 2.0) == 5.0  # rank 0's sending
    assert time_bound([0], [0], 1e9) == 0.0


def test_the_plan_prints_is_cached_per_layout_pair_and_reports_its_build_time():
    src, dst = sync_layout(tiny(2), "megatron:2"), sync_layout(tiny(2), "vllm:4")
    plan = plan_for(src, dst)
    assert plan_for(sync_layout(tiny(2), "megatron:2"), sync_layout(tiny(2), "vllm:4")) is plan
    text = str(plan)
    assert text.startswith("plan megatron:2 -> vllm:4 for tiny_kv2: world 4, ")
    assert f"{plan.bytes_between_ranks} bytes between ranks" in text and "built in" in text
    assert plan.build_seconds > 0
    first = plan.describe(limit=1).splitlines()
    assert first[0].startswith(("local: ", "rank ")) and first[1].startswith("... ")
    # another geometry is another plan
    assert plan_for(sync_layout(tiny(2, d_model=64), "megatron:2"),
                    sync_layout(tiny(2, d_model=64), "vllm:4")) is not plan


def test_messages_respect_the_bucket_and_cover_every_remote_element():
    plan = plan_for(sync_layout(tiny(2), "megatron:2"), sync_layout(tiny(2), "vllm:4"))
    for bucket in (ELEMENT_SIZE * 32, 1024, 1 << 20):
        messages = plan.messages(bucket)
        assert all(m.numel * ELEMENT_SIZE <= bucket for ms in messages.values() for m in ms)
        assert sum(m.numel for ms in messages.values() for m in ms) * ELEMENT_SIZE == \
            plan.bytes_between_ranks


def test_a_bucket_smaller_than_one_row_is_refused_naming_the_parameter():
    plan = plan_for(sync_layout(tiny(2), "plain:1"), sync_layout(tiny(2), "plain:2"))
    with pytest.raises(ValueError, match=r"bucket_bytes=64 is smaller than one row of "
                                         r"tok_embeddings.weight \(32 elements = 128 bytes"):
        plan.messages(64)


def test_the_sweep_scales_with_the_boxes_not_their_pairs(monkeypatch):
    # Meta's pair-ordered q and k rows are one box per row: about 650 boxes per TOY rank.
    # The work is counted, not timed (a loaded machine fails any wall-clock bound): the
    # sweep asks for holders once per (segment, needing box), as many as the boxes, never
    # one per pair of boxes.
    from weight_sync_bench.sync import planner

    src, dst = cover_of(sync_layout(TOY, "meta:2")), cover_of(sync_layout(TOY, "megatron:1"))
    boxes = sum(len(s.boxes) for r in src.ranks for s in r.values())
    needs = sum(len(s.boxes) for r in dst.ranks for s in r.values())
    assert boxes > 1200
    asked = []
    choose = planner._choose
    monkeypatch.setattr(planner, "_choose", lambda *a: asked.append(1) or choose(*a))
    plan = build_plan(src, dst)
    assert len(asked) <= 2 * (boxes + needs) < boxes * needs // 20  # pairs: 61,946
    assert plan.bytes_between_ranks == minimum_bytes(src.layout, dst.layout)


def test_the_plan_prints_its_summary_and_its_transfers_as_data():
    config = tiny(2)
    plan = plan_for(sync_layout(config, "megatron:2"), sync_layout(config, "vllm:1"))
    remote = plan.remote()
    assert (len(plan.transfers), len(remote)) == (21, 9)
    assert plan.pairs() == {(1, 0): plan.bytes_between_ranks} == {(1, 0): 55296}
    head, table = plan.summary().split("\n", 1)
    assert head.startswith("plan megatron:2 -> vllm:1 for tiny_kv2: world 2, 21 transfers "
                           "(12 local copies, 9 between ranks over 1 rank pairs), 55296 bytes "
                           "between ranks, built in ")
    assert table.split("\n") == ["  rank  sent bytes  received bytes  local copy bytes",
                                 "  0     0           55296           55680",
                                 "  1     55296       0               0"]
    assert head.endswith(f"built in {plan.build_seconds * 1e3:.2f} ms")
    assert str(plan) == plan.summary()
    assert plan.describe().split("\n")[20:] == ["... 1 more"]  # 20 lines unless told
    lines = plan.describe(limit=2).split("\n")
    assert lines == [
        ("local: tok_embeddings.weight[0-127, 0-31] from embedding.word_embeddings.weight at "
         "[0, 0] into model.embed_tokens.weight at [0, 0] (4096 elements)"),
        ("rank 1 -> rank 0: tok_embeddings.weight[128-255, 0-31] from "
         "embedding.word_embeddings.weight at [0, 0] into model.embed_tokens.weight at "
         "[128, 0] (4096 elements)"),
        "... 19 more"]
    assert len(plan.describe(limit=None).split("\n")) == 21 and "more" not in plan.describe(None)


def test_with_transfers_is_a_copy_with_those_transfers_and_that_mutation():
    config = tiny(2)
    plan = plan_for(sync_layout(config, "megatron:2"), sync_layout(config, "vllm:1"))
    fewer = plan.with_transfers(list(plan.transfers[1:]), "dropped")
    assert fewer.transfers == plan.transfers[1:] and fewer.mutation == "dropped"
    assert fewer.label == "megatron:2 -> vllm:1 (mutation dropped)"
    assert (fewer.src, fewer.dst) == (plan.src, plan.dst) and plan.mutation is None


def test_building_a_plan_leaves_the_garbage_collector_as_it_found_it():
    import gc

    config = tiny(2)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            build_plan(cover_of(sync_layout(config, "megatron:2")),
                       cover_of(sync_layout(config, "vllm:1")))
            assert gc.isenabled() == enabled
        finally:
            gc.enable()


def test_a_replicated_segment_goes_in_equal_parts_the_largest_to_the_least_loaded():
    from weight_sync_bench.sync.boxes import Box
    from weight_sync_bench.sync.planner import _choose

    holders = [(s, Box(rank, "w", "w", 0, 0, 10, 0)) for s, rank in enumerate((1, 2, 3))]
    load = {1: 50, 2: 0, 3: 20}
    parts = _choose(holders, 0, 0, 7, load, 4)  # 7 rows over 3 holders: 3, 2, 2
    assert parts == [(1, 0, 3), (2, 3, 5), (0, 5, 7)]  # rank 2, then 3, then 1
    assert load == {1: 58, 2: 12, 3: 28}
    assert _choose(holders, 0, 0, 1, {1: 5, 2: 5, 3: 0}, 4) == [(2, 0, 1)]  # one row
    assert _choose(holders, 0, 0, 2, {1: 0, 2: 0, 3: 0}, 4) == [(0, 0, 1), (1, 1, 2)]  # ties
    assert _choose(holders, 2, 0, 7, load, 4) == [(1, 0, 7)]  # rank 2 holds it: a local copy


def test_a_bucket_below_one_element_or_one_row_is_refused_naming_the_numbers():
    plan = plan_for(sync_layout(tiny(2), "megatron:2"), sync_layout(tiny(2), "vllm:1"))
    for bucket in (0, 3):
        with pytest.raises(InvalidNumber, match=f"^bucket_bytes must be an int >= 4, got {bucket}$"):
            plan.with_transfers(list(plan.transfers), None).messages(bucket)
    with pytest.raises(InvalidNumber, match=r"^bucket_bytes=64 is smaller than one row of "
                       r"tok_embeddings.weight \(32 elements = 128 bytes, rank 1 -> rank 0\)$"):
        plan.with_transfers(list(plan.transfers), None).messages(64)
    assert plan.with_transfers(list(plan.transfers), None).messages(128)  # one row fits

"""The executor's destination storage and its exchanges: only what the plan leaves unwritten
is zeroed (padding; whatever a mutated plan drops), and a rank pair's messages are grouped
into exchanges both ends agree on, within the staging bound, from the layouts' shapes alone
(a region's contiguity computed, not read off a tensor); the executor before the staging
arenas still runs (``staging="per_message"``, the bench's before)."""

from __future__ import annotations

import functools
import random

import torch

from tests.sync.conftest import tiny
from weight_sync_bench.sync import SyncSession, execute_plan, plan_for, sync_layout
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.execute import (
    DEFAULT_BUCKET,
    _contiguous,
    _staging,
    exchanges,
    unwritten_rows,
)
from weight_sync_bench.sync.mutations import dropped_transfer
from weight_sync_bench.sync.session import INTO


def _padding_rows(layout, rank):
    """The dim-0 padding runs of each of ``rank``'s stored tensors, from the cover."""
    out = {}
    for name, stored in cover_of(layout, validate=False).ranks[rank].items():
        runs = [(b.offset, b.offset + b.length) for b in stored.boxes
                if b.source is None and stored.dim == 0]
        if runs:
            out[name] = runs
    return out


def test_a_correct_plan_leaves_exactly_the_padding_rows_unwritten():
    config = tiny(4)
    plan = plan_for(sync_layout(config, "vllm:2"), sync_layout(config, "megatron:4"))
    padded = [_padding_rows(plan.dst, r) for r in range(plan.dst.world)]
    assert any(padded)  # Megatron pads the vocab to 128 t rows: there is padding to keep zero
    assert [unwritten_rows(plan, r) for r in range(plan.dst.world)] == padded


def test_a_dropped_transfer_s_rows_are_zeroed_too():
    config = tiny()
    plan = plan_for(sync_layout(config, "megatron:2"), sync_layout(config, "vllm:1"))
    dropped = next(t for t in plan.transfers if t not in dropped_transfer(plan).transfers)
    before = unwritten_rows(plan, dropped.dst_rank)
    after = unwritten_rows(dropped_transfer(plan), dropped.dst_rank)
    start = dropped.dst_at[0]
    stop = start + dropped.region[0][1] - dropped.region[0][0]
    assert dropped.dst_name not in before
    assert any(a <= start and stop <= b for a, b in after[dropped.dst_name])


def test_exchanges_keep_every_message_in_order_and_stage_at_most_a_bucket_per_end():
    config = tiny(8)
    for src, dst in (("plain:1", "plain:2"), ("megatron:4", "vllm:2"), ("fsdp:4", "vllm:2")):
        plan = plan_for(sync_layout(config, src), sync_layout(config, dst))
        bucket = 4096  # small, so that a pair has several messages
        for pair, messages in plan.messages(bucket).items():
            groups = exchanges(plan, messages, bucket)
            assert [m for g in groups for m in g] == messages
            for g in groups:
                for side in ("src", "dst"):
                    assert sum(_staging(plan, m, side) for m in g) <= bucket
            direct = [m for m in messages if not _staging(plan, m, "src")
                      and not _staging(plan, m, "dst")]
            if len(direct) == len(messages):  # nothing staged: one exchange for the pair
                assert len(groups) == 1, pair
        assert DEFAULT_BUCKET >= bucket


def test_contiguity_from_the_shapes_is_what_torch_says_of_the_view():
    rng = random.Random(0)
    cases = 0
    for shape in ((4,), (3, 5), (2, 3, 4), (1, 4, 1), (2, 1, 3, 2)):
        x = torch.empty(shape, device="meta")
        for _ in range(200):
            region = []
            for size in shape:
                a = rng.randrange(size)
                region.append((a, rng.randrange(a, size) + 1))
            view = x[tuple(slice(a, b) for a, b in region)]
            assert _contiguous(shape, tuple(region)) == view.is_contiguous(), (shape, region)
            cases += 1
    assert cases == 1000


def test_the_executor_before_the_arena_still_moves_b_min_exactly(pool):
    per_message = functools.partial(execute_plan, staging="per_message")
    for config, src, dst in ((tiny(8), "megatron:4", "vllm:2"), (tiny(4), "plain:1", "plain:2")):
        with SyncSession(config, src, dst, pool=pool, forward=False) as session:
            for into in INTO:
                result = session.run(per_message, bucket_bytes=4096, into=into)
                assert result.passed and result.bytes_moved == result.b_min, result.summary()
                assert all(r.staging_peak <= 2 * 4096 for r in result.ranks)

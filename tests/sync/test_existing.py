"""Into existing destination storage (``SyncSession.run(into="existing")``): the tensors an
inference engine already holds when a sync arrives, allocated and filled with stale values
before the timed region, received into in place. The same bytes (exactly ``B_min``), every
element checked; a transfer a planner mutation drops leaves the stale values, and the
element check sees them (the twin: the unmutated plan passes into the same storage, before
and after). And ``calibrate_pattern``: the executor's wire pattern replayed at its own
concurrency moves exactly the bytes the executor moved, rank by rank."""

from __future__ import annotations

import pytest
import torch

from tests.breadth import breadth
from tests.sync import resharders
from tests.sync.conftest import tiny
from weight_sync_bench.errors import InvalidShards
from weight_sync_bench.sync import SyncSession, gather_scatter, plan_for, sync_layout
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.execute import existing_storage
from weight_sync_bench.sync.mutations import PLAN_MUTATIONS
from weight_sync_bench.sync.session import INTO, stale_values
from weight_sync_bench.sync.verify import expected

BUCKET = 4096
# megatron:4 pads the vocabulary (padding the executor must zero in the stale storage);
# vllm:2's down_proj and o_proj are column shards (staged, unpacked into the storage)
CASES = [(tiny(4), "megatron:4", "vllm:2"), (tiny(4), "vllm:2", "megatron:4"),
         (tiny(4), "fsdp:4", "plain:2")]


# By default the two pairs above (padding zeroed in the storage, column shards unpacked into
# it); fsdp:4 -> plain:2 (0.3 s) in the long run: an FSDP source moves B_min bytes with every
# element exact by default in tests/sync/test_transport.py, and the storage it fills is
# plain:2's row shards, which the other two pairs' storage holds too.
@pytest.mark.parametrize(("config", "src", "dst"), breadth(
    CASES, keep={"megatron:4-vllm:2", "vllm:2-megatron:4"}, name=lambda c: f"{c[1]}-{c[2]}"),
    ids=lambda v: getattr(v, "name", str(v)))
def test_into_existing_storage_moves_b_min_and_every_element_is_exact(config, src, dst, pool):
    with SyncSession(config, src, dst, pool=pool, forward=False) as session:
        for fn in (resharders.insists_on_in_place, gather_scatter,
                   resharders.returns_fresh_tensors):
            result = session.run(fn, bucket_bytes=BUCKET, into="existing")
            assert result.into == "existing" and result.passed, result.summary()
            assert result.coverage == 1.0
            if fn is resharders.insists_on_in_place:
                assert result.bytes_moved == result.b_min == sum(r.received for r in result.ranks)
                assert all(r.staging_peak <= 2 * BUCKET for r in result.ranks)
        fresh = session.run(bucket_bytes=BUCKET)
        assert fresh.into == "fresh" and fresh.passed and fresh.bytes_moved == fresh.b_min


def test_a_dropped_transfer_leaves_stale_values_that_the_element_check_catches(pool):
    config, src, dst = tiny(4), "megatron:4", "vllm:2"
    with SyncSession(config, src, dst, pool=pool, forward=False) as session:
        assert session.run(bucket_bytes=BUCKET, into="existing").passed  # the twin, before
        dropped = PLAN_MUTATIONS["dropped_transfer"](session.plan)
        result = session.run(plan=dropped, bucket_bytes=BUCKET, into="existing")
        assert not result.passed and not result.elements_passed, result.summary()
        lines = [line for e in result.elements for line in e.lines]
        assert len(lines) == 1, lines
        held, declared = lines[0].split(" holds ")[1].split("; declared ")
        assert "? x" in held and "?" not in declared, lines  # stale values, found nowhere
        # the same storage again, now holding what the mutated plan left: a correct sync
        # into it passes (nothing of the failed run survives a correct one)
        assert session.run(bucket_bytes=BUCKET, into="existing").passed


def test_stale_values_differ_from_the_expected_in_every_element():
    plan = plan_for(sync_layout(tiny(4), "vllm:2"), sync_layout(tiny(4), "megatron:4"))
    padded = 0
    for rank in range(plan.dst.world):
        stale = stale_values(plan, rank, seed=3)
        for name, stored in cover_of(plan.dst, validate=False).ranks[rank].items():
            want = expected(plan.dst, rank, name, 3).view(torch.int32)
            assert bool(((stale[name].view(torch.int32) ^ want) == 1).all()), name
            padded += sum(b.length for b in stored.boxes if b.source is None)
    assert padded  # padding is stale too (not zero) before the sync


def test_existing_storage_zeroes_only_padding_and_refuses_what_is_not_the_destination():
    plan = plan_for(sync_layout(tiny(4), "vllm:2"), sync_layout(tiny(4), "megatron:4"))
    storage = stale_values(plan, 1, seed=0)
    before = {n: x.clone() for n, x in storage.items()}
    out = existing_storage(plan, 1, storage)
    cover = cover_of(plan.dst, validate=False).ranks[1]
    for name, x in out.items():
        assert x is storage[name]
        stored = cover[name]
        for box in stored.boxes:
            part = x.narrow(stored.dim, box.offset, box.length)
            if box.source is None:
                assert not bool(part.any()), name
            else:
                assert torch.equal(part, before[name].narrow(stored.dim, box.offset, box.length))
    name = next(iter(storage))
    with pytest.raises(InvalidShards, match=rf"megatron:4 rank 1: the existing destination "
                                            rf"storage lacks {name}"):
        existing_storage(plan, 1, {n: x for n, x in storage.items() if n != name})
    wrong = {**storage, name: storage[name].double()}
    with pytest.raises(InvalidShards, match=rf"rank 1: the existing destination storage {name}: "
                                            r"torch.float64 \[\d+, 32\], declared contiguous "
                                            r"torch.float32 \[\d+, 32\]"):
        existing_storage(plan, 1, wrong)


def test_rss_into_existing_storage_does_not_count_the_storage_itself(pool):
    config = tiny(4, vocab=16384)  # a 2 MB embedding: storage well above the heap's noise
    with SyncSession(config, "megatron:2", "vllm:1", pool=pool, forward=False) as session:
        result = session.run(into="existing")
        assert result.passed
        for r in result.ranks:
            assert r.rss_extra is not None and 0 <= r.rss_extra, result.summary()


def test_the_pattern_replay_moves_the_executor_s_bytes_rank_by_rank(pool):
    with SyncSession(tiny(4), "megatron:4", "vllm:2", pool=pool, forward=False) as session:
        result = session.run(bucket_bytes=BUCKET, calibrate=True)
        pattern = session.calibrate_pattern(bucket_bytes=BUCKET, repeats=1)
        assert pattern.sent == tuple(r.sent for r in result.ranks)
        assert pattern.received == tuple(r.received for r in result.ranks)
        assert pattern.messages == tuple(r.messages for r in result.ranks)  # the same sends
        assert pattern.seconds > 0 and pattern.bandwidth > 0
        assert result.bound(pattern.bandwidth) == pytest.approx(pattern.seconds)


def test_the_plan_reaches_the_ranks_with_its_messages_already_cut(pool):
    with SyncSession(tiny(4), "megatron:4", "vllm:2", pool=pool, forward=False) as session:
        for into in INTO:  # a copy of the plan each time, never cut before
            plan = session.plan.with_transfers(list(session.plan.transfers), mutation=None)
            assert not plan._messages and not plan._local
            result = session.run(resharders.insists_on_the_cached_cut, plan=plan,
                                 bucket_bytes=BUCKET, into=into)
            assert result.passed, result.summary()


def test_an_unknown_destination_storage_is_refused(pool):
    with SyncSession(tiny(2), "plain:1", "plain:2", pool=pool, forward=False) as session, \
            pytest.raises(ValueError, match=r"into='reused', expected one of \('fresh', "
                                            r"'existing'\)"):
        session.run(into="reused")

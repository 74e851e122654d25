"""The executor copies by runs (``planner.runs``): consecutive blocks whose corners advance by
the same step are one strided copy. Each copy by runs must leave every destination element
exactly as copying transfer by transfer (and segment by segment) does; a per-row cover
(Meta's interleaved RoPE rows) must become one run per (head, half); and where a mutated
plan's destination blocks overlap, the order of the writes is kept."""

from __future__ import annotations

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.sync import plan_for, sync_layout
from weight_sync_bench.sync.execute import _blocks, _pack, _unpack
from weight_sync_bench.sync.planner import Plan, runs

BUCKET = 4096  # bytes: several messages per pair at the tiny widths, so runs end at cuts
PAIRS = [(tiny(4), "megatron:2", "meta:2"), (tiny(4), "megatron:4", "meta:2"),
         (tiny(4), "meta:4", "megatron:1"), (tiny(4), "megatron:4", "vllm:2"),
         (tiny(1), "megatron:1", "vllm:4"), (tiny(4), "plain:1", "plain:4"),
         (tiny(4), "fsdp:4", "vllm:2"), (tiny(4), "meta:2", "hf")]


def _region(x: torch.Tensor, at: tuple[int, ...], region, origin) -> torch.Tensor:
    """The oracle: canonical ``region`` of a stored tensor whose corner ``at`` holds the
    canonical corner of ``origin``, as plain slices."""
    return x[tuple(slice(c + a - o, c + b - o) for c, (a, b), (o, _) in zip(at, region, origin))]


def _sources(plan: Plan, rank: int, *, strided: bool) -> dict[str, torch.Tensor]:
    """Distinct values in every element of ``rank``'s source tensors (column-major storage
    when ``strided``: the runs must read through any strides)."""
    if rank >= plan.src.world:
        return {}
    shapes = plan.src.config.param_shapes()
    out = {}
    for k, (name, piece) in enumerate(sorted(plan.src.pieces[rank].items())):
        shape = piece.local_shape(shapes[piece.source])
        x = torch.arange(k * 10**6, k * 10**6 + torch.Size(shape).numel(),
                         dtype=torch.float32).view(shape)
        if strided:  # column-major where 2-D, and 7 elements into a larger storage
            base = torch.full((x.numel() + 7,), float("nan"))
            y = base[7:].view(x.shape[::-1]).t() if x.dim() == 2 else base[7:].view(shape)
            x = y.copy_(x)
        out[name] = x
    if strided:
        assert any(not x.is_contiguous() for x in out.values())
        assert all(x.storage_offset() == 7 for x in out.values())
    return out


def _destinations(plan: Plan, rank: int) -> dict[str, torch.Tensor]:
    shapes = plan.dst.config.param_shapes()
    return {name: torch.full(piece.local_shape(shapes[piece.source]), -1.0)
            for name, piece in plan.dst.pieces[rank].items()} if rank < plan.dst.world else {}


def _copy_by_transfers(plan: Plan, rank: int, local, out) -> None:
    """The oracle: ``rank``'s local copies, one transfer after another, in plan order."""
    for t in plan.local_copies(rank):
        _region(out[t.dst_name], t.dst_at, t.region, t.region).copy_(
            _region(local[t.src_name], t.src_at, t.region, t.region))


def _copy_by_runs(plan: Plan, rank: int, local, out) -> None:
    """What ``execute_plan``'s local copies do: ``rank``'s runs."""
    for run in plan.local_runs(rank):
        _blocks(out[run.dst_name], run.dst_at, run.dst_step, run).copy_(
            _blocks(local[run.src_name], run.src_at, run.src_step, run))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-source"])
@pytest.mark.parametrize(("config", "src", "dst"), PAIRS, ids=[f"{s}->{d}" for _, s, d in PAIRS])
def test_copying_by_runs_writes_what_copying_transfer_by_transfer_writes(config, src, dst,
                                                                         strided):
    plan = plan_for(sync_layout(config, src), sync_layout(config, dst))
    messages = plan.messages(BUCKET)
    for rank in range(plan.world):
        local = _sources(plan, rank, strided=strided)
        want, got = _destinations(plan, rank), _destinations(plan, rank)
        _copy_by_transfers(plan, rank, local, want)
        _copy_by_runs(plan, rank, local, got)
        assert all(torch.equal(want[n], got[n]) for n in want), f"rank {rank}: local copies"
        for (frm, to), pair in messages.items():  # every message sent by this rank, received
            if frm != rank:
                continue
            theirs_want, theirs_got = _destinations(plan, to), _destinations(plan, to)
            for message in pair:
                for seg in message.segments:
                    t = plan.transfers[seg.index]
                    _region(theirs_want[t.dst_name], t.dst_at, seg.region, t.region).copy_(
                        _region(local[t.src_name], t.src_at, seg.region, t.region))
                buf = torch.full((message.numel,), float("nan"))
                _pack(plan, message, local, buf)
                assert not buf.isnan().any()  # every staged element packed
                _unpack(plan, message, theirs_got, buf)
            assert all(torch.equal(theirs_want[n], theirs_got[n]) for n in theirs_want), (
                f"{frm} -> {to}")


def test_meta_s_interleaved_rope_rows_are_about_one_run_per_head_half():
    """Meta's row 2i of a head is HF's row i, row 2i + 1 is HF's row i + head_dim/2: one
    transfer per row (the planner coalesces only where a head's last row meets the next
    head's first), one run of rows stepping 1 in the source and 2 in the destination per
    (head, half)."""
    config = tiny(4, head_dim=16)
    plan = plan_for(sync_layout(config, "megatron:2"), sync_layout(config, "meta:2"))
    heads, half = config.n_heads // 2, config.head_dim // 2  # per rank
    for rank in range(2):
        copies = [t for t in plan.local_copies(rank) if t.dst_name.endswith("attention.wq.weight")]
        wq = [r for r in plan.local_runs(rank) if r.dst_name.endswith("attention.wq.weight")]
        assert len(copies) >= heads * 2 * (half - 1)  # about one transfer per row
        assert len(wq) <= heads * 3  # a run per (head, half), and the rows coalesced between
        assert sum(r.count for r in wq if r.count > 1) >= heads * 2 * (half - 2)
        assert {(r.src_step, r.dst_step) for r in wq if r.count > 1} == {((1, 0), (2, 0))}
        assert sum(r.numel for r in wq) == sum(t.numel for t in copies)


def test_blocks_advancing_by_one_step_are_one_run_with_consecutive_staging():
    blocks = [("a", (i, 3), "b", (2 * i + 1, 0), (1, 4)) for i in range(5)]
    blocks += [("a", (9, 0), "b", (20, 0), (1, 4))]  # breaks the step: a run of its own
    (first, second) = runs(blocks)
    assert (first.count, first.src_at, first.dst_at, first.src_step, first.dst_step,
            first.buf_at) == (5, (0, 3), (1, 0), (1, 0), (2, 0), 0)
    assert (second.count, second.src_at, second.buf_at) == (1, (9, 0), 20)


def test_the_copy_order_is_the_source_order_where_destinations_are_disjoint():
    backwards = [("a", (3 - i,), "b", (i,), (1,)) for i in range(4)]
    assert [r.src_at for r in runs(backwards)] == [(0,), (1,), (2,), (3,)]  # sorted by source
    assert all(r.count == 1 for r in runs(backwards))  # a negative step is not a run
    empty = [("a", (1,), "b", (2,), (0,))]  # writes nothing, so overlaps nothing
    assert [r.src_at for r in runs(backwards + empty)] == [(0,), (1,), (1,), (2,), (3,)]


def test_overlapping_destination_blocks_keep_the_given_order():
    """A mutated plan's box one index too long overlaps its neighbour; the later write must
    still win, as it did transfer by transfer."""
    overlapping = [("a", (5,), "b", (0,), (3,)), ("a", (0,), "b", (2,), (3,))]
    assert [r.src_at for r in runs(overlapping)] == [(5,), (0,)]
    beside = [("a", (5,), "b", (0,), (2,)), ("a", (0,), "b", (2,), (3,))]  # touching only
    assert [r.src_at for r in runs(beside)] == [(0,), (5,)]
    apart_in_columns = [("a", (5, 0), "b", (0, 0), (3, 2)), ("a", (0, 0), "b", (2, 2), (3, 2))]
    assert [r.src_at for r in runs(apart_in_columns)] == [(0, 0), (5, 0)]
    ending_where_the_other_begins = [("a", (5, 2), "b", (0, 2), (3, 2)),
                                     ("a", (0, 0), "b", (2, 0), (3, 2))]  # columns 2-3, 0-1
    assert [r.src_at for r in runs(ending_where_the_other_begins)] == [(0, 0), (5, 2)]


def test_overlapping_local_copies_write_as_the_transfers_did():
    """Meta's row 1 comes from HF's row ``head_dim/2``, row 2 from row 1. Row 1's copy made one
    row longer overlaps row 2's: plan order (row 1's first) lets row 2's copy win, source
    order would let the longer one win."""
    from dataclasses import replace

    config = tiny(4)
    plan = plan_for(sync_layout(config, "megatron:2"), sync_layout(config, "meta:2"))
    transfers = list(plan.transfers)
    wq = "layers.0.attention.wq.weight"
    one, two = (next(i for i, t in enumerate(transfers) if t.local and t.dst_rank == 0
                     and t.dst_name == wq and t.dst_at == (row, 0)) for row in (1, 2))
    assert transfers[one].src_at[0] > transfers[two].src_at[0] and one < two
    (a, b), rest = transfers[one].region[0], transfers[one].region[1:]
    transfers[one] = replace(transfers[one], region=((a, b + 1), *rest))
    longer = plan.with_transfers(transfers, "local_overlap")
    local = _sources(longer, 0, strided=False)
    want, got = _destinations(longer, 0), _destinations(longer, 0)
    _copy_by_transfers(longer, 0, local, want)
    _copy_by_runs(longer, 0, local, got)
    assert all(torch.equal(want[n], got[n]) for n in want)
    t2 = transfers[two]
    assert torch.equal(got[wq][2], _region(local[t2.src_name], t2.src_at, t2.region,
                                           t2.region)[0])  # row 2's own copy won


def test_prepare_makes_the_cut_and_every_rank_s_runs_before_the_plan_is_shipped():
    config = tiny(4)
    cached = plan_for(sync_layout(config, "megatron:4"), sync_layout(config, "meta:2"))
    plan = cached.with_transfers(list(cached.transfers), mutation=None)  # nothing made yet
    assert not plan._messages and not plan._local
    assert plan.prepare(BUCKET) is plan
    assert set(plan._messages) == {BUCKET} and set(plan._local) == set(range(plan.world))
    assert plan._messages[BUCKET] == cached.messages(BUCKET)
    assert all(plan._local[r] == cached.local_runs(r) for r in range(plan.world))

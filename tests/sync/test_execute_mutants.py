"""Phase 2's executor read exactly, in process (issue 30's mutation testing of
``sync/execute.py``): ``execute_plan``, ``gather_scatter``, ``calibrate`` and
``calibrate_pattern`` run on every rank of a job at once, one thread per rank, over a wire
that stands in for gloo's (``torch.distributed``'s ``P2POp``, ``batch_isend_irecv``,
``barrier``, ``broadcast`` and ``all_reduce`` replaced for the test: per ordered rank pair a
FIFO of what was sent, matched to the receives in the order they were posted, refusing what
gloo refuses: a non-contiguous tensor, a receive of another size or dtype than the send).
The harness's own ``CountingP2P`` and ``Meter`` run on top of it, so what they count is
what the executor made them count.

Pinned: every destination element, bit for bit, into fresh storage (uninitialised only
where the plan writes whole rows: the rest zero, seen by making ``torch.empty`` NaN) and
into existing storage (written in place, padding zeroed, stale values where a mutated plan
writes nothing), with the arena and per-message staging; the bytes and messages counted per
peer (the plan's); the exchanges each rank posts (the shift steps, ``rank + j`` and
``rank - j`` mod world, their breadcrumb tags, the local copies run during the first one
that moves bytes); which messages are sent from and received into the tensors themselves
(a contiguous region, decided from the shapes; checked against what torch says of the
view) and which staged, at which offsets of the arena; the staging allocated (each arena
the largest exchange's staging on its side) and all of it freed; the exchanges' greedy
grouping within the bucket; ``existing_storage``'s refusals, word for word;
``padding``'s boxes and its bounded cache; ``huge_pages``' ``madvise`` of the 2 MiB-aligned
part (a stand-in libc); ``CountingP2P.exchange`` (sends then receives in one batch, the
work of ``during`` between posting and waiting, the breadcrumb around both, a send to
itself refused); ``Meter``'s arithmetic; ``gather_scatter``'s naive bytes (``naive_bytes``)
and its staging; the calibrations' figures from a scripted clock (best of the repeats, the
slowest rank's time, the busiest rank's bytes, rank 0's figure broadcast)."""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.sync.conftest import MOE_FEW, tiny
from weight_sync_bench.errors import InvalidNumber, InvalidShards
from weight_sync_bench.sync import execute, plan_for, sync_layout
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.execute import (
    DEFAULT_BUCKET,
    HUGE_PAGE,
    CountingP2P,
    Meter,
    SyncContext,
    Traffic,
    calibrate,
    calibrate_pattern,
    destination_storage,
    execute_plan,
    exchanges,
    existing_storage,
    gather_scatter,
    huge_pages,
    padding,
    planned_storage,
    rss_reset,
    schedule,
    unwritten_rows,
)
from weight_sync_bench.sync.minimum import naive_bytes
from weight_sync_bench.sync.mutations import PLAN_MUTATIONS, NotApplicable
from weight_sync_bench.sync.session import stale_values
from weight_sync_bench.sync.verify import generated

SEED = 5
BUCKET = 4096  # bytes: several messages and exchanges per pair at the tiny widths
WAIT = 3.0  # seconds a rank waits for a peer before the test fails (a mutant's deadlock)


# -- the stand-in wire: one job's process group over threads


class Net:
    """One job's ranks: a FIFO of sent tensors per ordered pair, a barrier, and a log."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.boxes: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(world, timeout=WAIT)
        self.slots: dict[int, torch.Tensor] = {}
        self.log: list[tuple] = []  # (rank, what, ...)
        self.groups = [Group(self, r) for r in range(world)]

    def box(self, frm: int, to: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((frm, to), queue.Queue())

    def get(self, frm: int, to: int) -> torch.Tensor:
        """The next tensor ``frm`` sent ``to``; fails at once when another rank failed."""
        box = self.box(frm, to)
        for _ in range(int(WAIT / 0.01)):
            if self.barrier.broken:
                raise RuntimeError(f"rank {to}: another rank failed")
            with contextlib.suppress(queue.Empty):
                return box.get(timeout=0.01)
        raise RuntimeError(f"rank {to}: nothing from rank {frm} in {WAIT} s")


class Group:
    """A rank's process group: the job and the rank's number in it."""

    def __init__(self, net: Net, rank: int) -> None:
        self.net, self.rank = net, rank


def _group(group: object) -> Group:
    if not isinstance(group, Group):
        raise RuntimeError(f"not the job's process group: {group!r}")
    return group


def _p2p_op(op, tensor, peer, group=None):
    return SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group)


class _Work:
    def __init__(self, rank: int, op) -> None:
        self.rank, self.op = rank, op

    def wait(self) -> None:
        op, net = self.op, self.op.group.net
        net.log.append((self.rank, "wait", op.op.__name__, op.peer))
        if op.op is torch.distributed.irecv:
            got = net.get(op.peer, self.rank)
            if got.numel() != op.tensor.numel() or got.dtype != op.tensor.dtype:
                raise RuntimeError(f"rank {self.rank}: received {got.dtype} {got.numel()} "
                                   f"into {op.tensor.dtype} {op.tensor.numel()}")
            op.tensor.view(-1).copy_(got.view(-1))


def _batch_isend_irecv(ops):
    group = _group(ops[0].group)
    assert all(op.group is group for op in ops)
    for op in ops:
        if not op.tensor.is_contiguous():  # gloo: "Tensors must be contiguous"
            raise RuntimeError("gloo: tensors must be contiguous")
        if not 0 <= op.peer < group.net.world or op.peer == group.rank:
            raise RuntimeError(f"rank {group.rank}: no peer {op.peer}")
    group.net.log.append((group.rank, "batch", [(op.op.__name__, op.peer) for op in ops]))
    for op in ops:
        if op.op is torch.distributed.isend:
            group.net.box(group.rank, op.peer).put(op.tensor.clone())
    return [_Work(group.rank, op) for op in ops]


def _barrier(group=None):
    g = _group(group)
    g.net.log.append((g.rank, "barrier"))
    g.net.barrier.wait()


def _gathered(g: Group, x: torch.Tensor) -> list[torch.Tensor]:
    g.net.slots[g.rank] = x.clone()
    g.net.barrier.wait()
    out = [g.net.slots[r] for r in range(g.net.world)]
    g.net.barrier.wait()
    return out


def _broadcast(tensor, src, group=None):
    g = _group(group)
    g.net.log.append((g.rank, "broadcast", src))
    tensor.copy_(_gathered(g, tensor)[src])


def _all_reduce(tensor, op=None, group=None):
    g = _group(group)
    g.net.log.append((g.rank, "all_reduce"))
    assert op == torch.distributed.ReduceOp.MAX
    tensor.copy_(torch.stack(_gathered(g, tensor)).amax(0))


@pytest.fixture
def wire(monkeypatch):
    for name, fn in (("P2POp", _p2p_op), ("batch_isend_irecv", _batch_isend_irecv),
                     ("barrier", _barrier), ("broadcast", _broadcast),
                     ("all_reduce", _all_reduce)):
        monkeypatch.setattr(execute.dist, name, fn)
    return Net


def on_ranks(net: Net, fn) -> list:
    """``fn(rank)`` on every rank of ``net`` at once, one thread each: the results, or the
    first rank's exception raised."""
    results: list = [None] * net.world
    errors: list = [None] * net.world

    def go(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = e
            net.barrier.abort()

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(net.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    for e in errors:
        if e is not None:
            raise e
    return results


class Recording(CountingP2P):
    """``CountingP2P``, recording each exchange: its tag, whether work was given to run
    during it, and each send's and receive's (peer, numel, storage, offset)."""

    def __init__(self, group, rank, tracer=None) -> None:
        super().__init__(group, rank, tracer)
        self.calls: list[dict] = []

    def exchange(self, sends, recvs, tag, during=None):
        def where(t):
            return (t.untyped_storage().data_ptr(), t.storage_offset())

        self.calls.append({"tag": tag, "during": during is not None,
                           "sends": [(p, t.numel(), *where(t)) for p, t in sends],
                           "recvs": [(p, t.numel(), *where(t)) for p, t in recvs]})
        super().exchange(sends, recvs, tag, during)


class Allocs(Meter):
    """``Meter``, keeping every buffer it allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[torch.Tensor] = []

    def allocate(self, numel, device="cpu"):
        buf = super().allocate(numel, device)
        self.buffers.append(buf)
        return buf


class Crumbs:
    """A rank's tracer: the collectives it was told it is inside."""

    def __init__(self, events: list | None = None) -> None:
        self.events = [] if events is None else events

    @contextlib.contextmanager
    def collective(self, op, tag):
        self.events.append(("inside", op, tag))
        yield
        self.events.append(("after", op, tag))


def _context(net: Net, rank: int, **kw) -> SyncContext:
    return SyncContext(rank=rank, world=net.world, group=net.groups[rank],
                       p2p=Recording(net.groups[rank], rank, Crumbs()), meter=Allocs(), **kw)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


# -- execute_plan over the pairs

PAIRS = {  # id: (config, src, dst, src dp)
    "megatron:4->vllm:2": (tiny(4), "megatron:4", "vllm:2", 1),  # column shards staged
    "vllm:2->megatron:4": (tiny(4), "vllm:2", "megatron:4", 1),  # padding in the destination
    "megatron:2->meta:2": (tiny(4), "megatron:2", "meta:2", 1),  # per-row runs
    "plain:2->plain:2": (tiny(4), "plain:2", "plain:2", 1),  # local copies alone
    "megatron:2xdp2->vllm:2": (tiny(4), "megatron:2", "vllm:2", 2),  # ranks 2, 3: no dst
    "megatron:1->vllm:tp2ep2": (MOE_FEW, "megatron:1", "vllm:tp=2,ep=2", 1),  # stacked
    "hf->vllm:2": (tiny(4), "hf", "vllm:2", 1),  # column blocks: staged to send, not to receive
    "megatron:pp2->vllm:2": (MOE_FEW, "megatron:tp=1,pp=2", "vllm:2", 1),  # stage-local names
}


def _plan(key: str):
    config, src, dst, dp = PAIRS[key]
    return plan_for(sync_layout(config, src, dp=dp), sync_layout(config, dst))


def _sources(plan, rank: int, *, strided: bool = False) -> dict[str, torch.Tensor]:
    out = generated(plan.src, rank, SEED)
    if strided:  # the same values, stored column-major where 2-D
        out = {n: x.t().contiguous().t() if x.dim() == 2 else x for n, x in out.items()}
    return out


def _staged(plan, message, side: str, tensors) -> int:
    """The oracle of a message's staging on ``side``: none when it is one region whose view
    of the stored part torch calls contiguous."""
    if len(message.segments) == 1:
        seg = message.segments[0]
        t = plan.transfers[seg.index]
        x = tensors[t.src_name if side == "src" else t.dst_name]
        at = t.src_at if side == "src" else t.dst_at
        view = x[tuple(slice(c + a - o, c + b - o)
                       for c, (a, b), (o, _) in zip(at, seg.region, t.region))]
        if view.is_contiguous():
            return 0
    return message.numel * 4


def _run(plan, *, into: str = "fresh", staging: str = "arena", bucket: int = BUCKET,
         strided: bool = False):
    net = Net(plan.world)
    sources = [_sources(plan, r, strided=strided) for r in range(plan.world)]
    existing = [stale_values(plan, r, SEED) for r in range(plan.world)]
    held = [dict(x) for x in existing]
    ctxs = [_context(net, r, bucket_bytes=bucket,
                     destination=existing[r] if into == "existing" else None)
            for r in range(plan.world)]
    outs = on_ranks(net, lambda r: execute_plan(ctxs[r], r, sources[r], plan, staging=staging))
    return SimpleNamespace(net=net, ctxs=ctxs, outs=outs, sources=sources, held=held)


CASES = [(k, into, staging) for k in PAIRS for into in ("fresh", "existing")
         for staging in ("arena", "per_message")
         if staging == "arena" or k in ("megatron:4->vllm:2", "vllm:2->megatron:4")]


@pytest.mark.parametrize(("key", "into", "staging"), CASES,
                         ids=[f"{k}-{i}-{s}" for k, i, s in CASES])
def test_every_rank_holds_exactly_its_declared_tensors_and_counts_the_plans_bytes(
        wire, key, into, staging):
    plan = _plan(key)
    run = _run(plan, into=into, staging=staging)
    pairs = plan.pairs()
    messages = plan.messages(BUCKET)
    for r, (out, ctx) in enumerate(zip(run.outs, run.ctxs)):
        want = generated(plan.dst, r, SEED)
        assert list(out) == list(want), f"rank {r}"
        for name, x in want.items():
            assert out[name].dtype == torch.float32
            assert torch.equal(_bits(out[name]), _bits(x)), f"rank {r} {name}"
            if into == "existing":  # written in place: the tensors handed over, returned
                assert out[name] is run.held[r][name]
        traffic = ctx.p2p.traffic
        assert dict(traffic.sent) == {d: b for (s, d), b in pairs.items() if s == r}
        assert dict(traffic.received) == {s: b for (s, d), b in pairs.items() if d == r}
        assert traffic.bytes_sent == sum(b for (s, _), b in pairs.items() if s == r)
        assert traffic.messages == sum(len(m) for (s, _), m in messages.items() if s == r)
        assert ctx.meter.live == 0  # every staging buffer freed
        assert ctx.meter.peak <= 2 * BUCKET


def test_a_rank_past_the_destination_returns_an_empty_dict(wire):
    plan = _plan("megatron:2xdp2->vllm:2")
    assert plan.world == 4 and plan.dst.world == 2
    run = _run(plan)
    assert run.outs[2] == {} and run.outs[3] == {}
    assert all(torch.equal(run.outs[r][n], x) for r in (0, 1)
               for n, x in generated(plan.dst, r, SEED).items())


def test_a_source_stored_with_other_strides_is_sent_as_its_bytes(wire):
    """A direct message's region of a column-major source is copied contiguous before the
    send (gloo refuses a non-contiguous tensor); every element still arrives."""
    plan = _plan("hf->vllm:2")
    run = _run(plan, strided=True)
    assert any(not x.is_contiguous() for x in run.sources[0].values())
    direct = [m for m in plan.messages(BUCKET)[(0, 1)] if execute._direct(plan, m, "src")]
    assert direct and all(len(m.segments) == 1 for m in direct)  # sent from views of rows
    for r, out in enumerate(run.outs):
        want = generated(plan.dst, r, SEED)
        assert all(torch.equal(out[n], want[n]) for n in want)


def _oracle_exchanges(plan, rank, bucket, staging, sources, stored):
    """What rank ``rank`` must post, exchange by exchange, from the schedule."""
    calls = []
    first = True
    for step, to, frm, outgoing, incoming in schedule(plan, rank, bucket):
        for k in range(max(len(outgoing), len(incoming))):
            out = outgoing[k] if k < len(outgoing) else []
            inc = incoming[k] if k < len(incoming) else []
            moves = bool(out or inc)
            calls.append({"tag": f"sync step {step} exchange {k}", "during": moves and first,
                          "sends": [(to, m.numel, _staged(plan, m, "src", sources[rank]))
                                    for m in out],
                          "recvs": [(frm, m.numel, _staged(plan, m, "dst", stored[rank]))
                                    for m in inc]})
            first = first and not moves
    return calls


@pytest.mark.parametrize("staging", ["arena", "per_message"])
@pytest.mark.parametrize("key", ["megatron:4->vllm:2", "vllm:2->megatron:4",
                                 "megatron:1->vllm:tp2ep2", "hf->vllm:2"])
def test_each_exchange_sends_direct_regions_in_place_and_stages_the_rest(wire, key, staging):
    """Per exchange: the tag a breadcrumb names, the local copies handed over as the work
    done during the first exchange that moves bytes, each message sent from (received into)
    the stored tensor itself where its region is contiguous there, and otherwise from (into)
    staging: the arena's consecutive slices from 0, or a fresh buffer of its own."""
    plan = _plan(key)
    run = _run(plan, into="existing", staging=staging)
    assert max(_check_exchanges(plan, run, staging)) >= 1


def _check_exchanges(plan, run, staging: str) -> list[int]:
    """``run``'s exchanges against the oracle; the most staged messages of one exchange,
    sends and receives."""
    src_parts = [plan.src.members(r, run.sources[r]) for r in range(plan.world)]
    dst_parts = [plan.dst.members(r, run.held[r]) for r in range(plan.world)]
    most = [0, 0]
    for r, ctx in enumerate(run.ctxs):
        want = _oracle_exchanges(plan, r, BUCKET, staging, src_parts, dst_parts)
        got = ctx.p2p.calls
        assert [(c["tag"], c["during"]) for c in got] == [(c["tag"], c["during"]) for c in want]
        arenas = {_ptr(b) for b in ctx.meter.buffers} if staging == "arena" else set()
        own = {_ptr(x) for x in run.sources[r].values()}
        dest = {_ptr(x) for x in run.held[r].values()}
        fresh = []
        for c, w in zip(got, want):
            for i, (side, mine) in enumerate((("sends", own), ("recvs", dest))):
                at = 0
                assert [(p, n) for p, n, *_ in c[side]] == [(p, n) for p, n, _ in w[side]]
                most[i] = max(most[i], sum(1 for *_, staged in w[side] if staged))
                for (_, n, ptr, offset), (_, _, staged) in zip(c[side], w[side]):
                    if not staged:
                        assert ptr in mine, f"rank {r} {c['tag']}: not in place"
                        continue
                    assert ptr not in mine
                    if staging == "arena":
                        assert ptr in arenas and offset == at, f"rank {r} {c['tag']}"
                        at += n
                    else:
                        assert ptr not in arenas and offset == 0
                        fresh.append(ptr)
                        arenas.add(ptr)
        if staging == "per_message":
            assert len(fresh) == len(ctx.meter.buffers)
    return most


@pytest.mark.parametrize("staging", ["arena", "per_message"])
@pytest.mark.parametrize(("key", "side"), [("megatron:4->vllm:2", 1), ("hf->vllm:2", 0)],
                         ids=["staged-receives", "staged-sends"])
def test_messages_cut_finer_than_the_bucket_share_an_exchange_at_consecutive_offsets(
        wire, key, side, staging):
    """The planner fills each message to the bucket, so one exchange stages at most one
    message per side; a cut four times finer (as a planner cutting for pipelining would)
    puts several staged messages in one exchange: each packs into (unpacks from) its own
    slice of the arena, one after another, and every element still arrives."""
    cached = _plan(key)
    plan = cached.with_transfers(list(cached.transfers), mutation=None)
    plan._messages[BUCKET] = plan.messages(BUCKET // 4)
    for into in ("fresh", "existing"):
        run = _run(plan, into=into, staging=staging)
        for r, out in enumerate(run.outs):
            want = generated(plan.dst, r, SEED)
            assert all(torch.equal(_bits(out[n]), _bits(want[n])) for n in want), f"rank {r}"
            assert run.ctxs[r].meter.live == 0
        if into == "existing":
            assert _check_exchanges(plan, run, staging)[side] >= 2
        src_parts = [plan.src.members(r, run.sources[r]) for r in range(plan.world)]
        dst_parts = [plan.dst.members(r, destination_storage(plan, r))
                     for r in range(plan.world)]
        for r, ctx in enumerate(run.ctxs):
            if staging == "arena":
                need = _arena_needs(plan, r, BUCKET, src_parts[r], dst_parts[r])
                assert [b.numel() * 4 for b in ctx.meter.buffers] == [
                    need[s] for s in ("src", "dst") if need[s]]


def _arena_needs(plan, rank, bucket, sources, stored):
    need = {"src": 0, "dst": 0}
    for _, _, _, outgoing, incoming in schedule(plan, rank, bucket):
        for side, groups, tensors in (("src", outgoing, sources), ("dst", incoming, stored)):
            for g in groups:
                need[side] = max(need[side], sum(_staged(plan, m, side, tensors) for m in g))
    return need


@pytest.mark.parametrize("key", ["megatron:4->vllm:2", "vllm:2->megatron:4", "plain:2->plain:2",
                                 "hf->vllm:2"])
def test_the_arenas_are_the_largest_exchanges_staging_on_each_side_allocated_once(wire, key):
    plan = _plan(key)
    run = _run(plan)
    src_parts = [plan.src.members(r, run.sources[r]) for r in range(plan.world)]
    dst_parts = [plan.dst.members(r, destination_storage(plan, r)) for r in range(plan.world)]
    for r, ctx in enumerate(run.ctxs):
        need = _arena_needs(plan, r, BUCKET, src_parts[r], dst_parts[r])
        sizes = [b.numel() * 4 for b in ctx.meter.buffers]
        assert sizes == [need[s] for s in ("src", "dst") if need[s]], f"rank {r}"
        assert all(b.dtype == torch.float32 for b in ctx.meter.buffers)
        assert ctx.meter.peak == need["src"] + need["dst"]
        assert ctx.meter.largest == max(need.values()) and ctx.meter.live == 0
        if key == "hf->vllm:2" and r == 0:  # the two ends stage different messages
            assert need["src"] > 0 and need["dst"] == 0


def test_per_message_staging_frees_each_exchanges_buffers_after_it(wire):
    plan = _plan("megatron:4->vllm:2")
    run = _run(plan, staging="per_message")
    src_parts = [plan.src.members(r, run.sources[r]) for r in range(plan.world)]
    dst_parts = [plan.dst.members(r, destination_storage(plan, r)) for r in range(plan.world)]
    for r, ctx in enumerate(run.ctxs):
        calls = _oracle_exchanges(plan, r, BUCKET, "per_message", src_parts, dst_parts)
        staged = [[s for *_, s in c["sends"] + c["recvs"] if s] for c in calls]
        assert [b.numel() * 4 for b in ctx.meter.buffers] == [s for c in staged for s in c]
        assert ctx.meter.peak == max([sum(c) for c in staged] + [0]), f"rank {r}"
        assert ctx.meter.live == 0


def test_one_bucket_of_default_size_is_one_exchange_per_step(wire):
    plan = _plan("megatron:4->vllm:2")
    run = _run(plan, bucket=DEFAULT_BUCKET)
    pairs = plan.pairs()
    for r, out in enumerate(run.outs):
        want = generated(plan.dst, r, SEED)
        assert all(torch.equal(out[n], want[n]) for n in want)
        w = plan.world
        assert [c["tag"] for c in run.ctxs[r].p2p.calls] == [
            f"sync step {j} exchange 0" for j in range(1, w)
            if (r, (r + j) % w) in pairs or ((r - j) % w, r) in pairs]
    assert sum(len(c.p2p.calls) for c in run.ctxs) > plan.world


def test_the_executor_refuses_a_bucket_below_one_element_and_an_unknown_staging(wire):
    plan = _plan("plain:2->plain:2")
    net = Net(2)
    for bucket in (3, 0, 2.5, True):
        with pytest.raises(InvalidNumber) as e:
            execute_plan(_context(net, 0, bucket_bytes=bucket), 0, _sources(plan, 0), plan)
        assert str(e.value) == f"bucket_bytes must be an int >= 4, got {bucket!r}"
    assert execute_plan(_context(net, 0, bucket_bytes=4), 0, _sources(plan, 0), plan)
    with pytest.raises(ValueError) as e:
        execute_plan(_context(net, 0), 0, _sources(plan, 0), plan, staging="pooled")
    assert str(e.value) == ("execute_plan: staging='pooled', expected one of "
                            "('arena', 'per_message')")
    assert net.log == []


def test_the_staging_default_is_the_arena(wire):
    plan = _plan("megatron:4->vllm:2")
    net = Net(plan.world)
    ctxs = [_context(net, r) for r in range(plan.world)]
    on_ranks(net, lambda r: execute_plan(ctxs[r], r, _sources(plan, r), plan))
    assert all(len(c.meter.buffers) <= 2 for c in ctxs)
    assert execute.STAGING == ("arena", "per_message")


# -- destination storage


def _rows_oracle(plan, rank) -> dict[str, list[tuple[int, int]]]:
    """Rows (dim 0) of each part of ``rank`` that the plan's transfers do not write whole,
    by painting every transfer's region into a mask."""
    shapes = plan.dst.config.param_shapes()
    out = {}
    for name, piece in plan.dst.parts[rank].items():
        mask = torch.zeros(piece.local_shape(shapes[piece.source]), dtype=torch.bool)
        for t in plan.transfers:
            if t.dst_rank == rank and t.dst_name == name:
                mask[tuple(slice(a, a + b - c) for a, (c, b) in zip(t.dst_at, t.region))] = True
        whole = mask.reshape(mask.shape[0], -1).all(1).tolist()
        runs, start = [], None
        for i, w in enumerate([*whole, True]):
            if not w and start is None:
                start = i
            if w and start is not None:
                runs.append((start, i))
                start = None
        if runs:
            out[name] = runs
    return out


def _mutated_plans():
    base = [_plan(k) for k in ("vllm:2->megatron:4", "megatron:2->meta:2",
                               "megatron:1->vllm:tp2ep2")]
    out = list(base)
    for plan in base:
        for mutation in PLAN_MUTATIONS.values():
            try:
                out.append(mutation.apply(plan))
            except NotApplicable:
                continue
    return out


def test_unwritten_rows_are_the_rows_no_transfer_writes_whole_in_every_mutated_plan():
    plans = _mutated_plans()
    assert len(plans) > 8
    seen_partial = False
    for plan in plans:
        for rank in range(plan.world + 1):
            want = _rows_oracle(plan, rank) if rank < plan.dst.world else {}
            assert unwritten_rows(plan, rank) == want, f"{plan.label} rank {rank}"
            seen_partial |= bool(want)
    assert seen_partial


def test_a_row_written_in_part_is_zeroed_whole(wire):
    from dataclasses import replace

    plan = _plan("plain:2->plain:2")
    i, t = next((i, t) for i, t in enumerate(plan.transfers)
                if len(t.region) == 2 and t.region[0][1] - t.region[0][0] > 2)
    (a, b), (c, d) = t.region
    transfers = list(plan.transfers)
    transfers[i] = replace(t, region=((a, b), (c, d - 1)))  # every row one column short
    short = plan.with_transfers(transfers, "short")
    rows = unwritten_rows(short, t.dst_rank)[t.dst_name]
    assert (t.dst_at[0], t.dst_at[0] + b - a) in rows


@pytest.fixture
def nan_empty(monkeypatch):
    """``torch.empty`` in the executor gives NaN: what storage leaves unwritten shows."""
    real = torch.empty
    monkeypatch.setattr(execute.torch, "empty", lambda *a, **k: real(*a, **k).fill_(math.nan))


@pytest.mark.parametrize("key", ["vllm:2->megatron:4", "megatron:1->vllm:tp2ep2",
                                 "megatron:2xdp2->vllm:2"])
def test_planned_storage_zeroes_exactly_the_unwritten_rows(nan_empty, key):
    plan = _plan(key)
    plans = [plan]
    with contextlib.suppress(NotApplicable):
        plans.append(PLAN_MUTATIONS["dropped_transfer"].apply(plan))
    for p in plans:
        for rank in range(p.world):
            out = planned_storage(p, rank)
            if rank >= p.dst.world:
                assert out == {}
                continue
            want = destination_storage(p, rank)
            assert list(out) == list(want)
            assert all(out[n].shape == want[n].shape and out[n].dtype == torch.float32
                       for n in want)
            parts = p.dst.members(rank, out)
            zero = _rows_oracle(p, rank)
            for name, x in parts.items():
                rows = torch.zeros(x.shape[0], dtype=torch.bool)
                for a, b in zero.get(name, []):
                    rows[a:b] = True
                flat = x.reshape(x.shape[0], -1)
                assert (flat[rows] == 0).all() and not torch.signbit(flat[rows]).any()
                assert flat[~rows].isnan().all(), f"{p.label} rank {rank} {name}"


def test_fresh_storage_is_made_on_the_device_asked_for():
    plan = _plan("vllm:2->megatron:4")
    for rank in range(plan.world):
        for make in (planned_storage, destination_storage):
            out = make(plan, rank, "meta")
            assert out and all(x.device.type == "meta" and x.dtype == torch.float32
                               for x in out.values())
    zeros = destination_storage(plan, 1)
    assert list(zeros) == list(plan.dst.pieces[1])
    assert all((x == 0).all() for x in zeros.values())
    assert destination_storage(plan, 4) == {} and planned_storage(plan, 4) == {}


# -- existing storage


def _destination(plan, rank):
    return {n: x.clone() for n, x in stale_values(plan, rank, SEED).items()}


def test_existing_storage_zeroes_the_padding_and_touches_nothing_else():
    plan = _plan("vllm:2->megatron:4")
    found = False
    for rank in range(plan.dst.world):
        dest = _destination(plan, rank)
        before = {n: x.clone() for n, x in dest.items()}
        out = existing_storage(plan, rank, dest)
        assert out is not dest and out == dest  # a new dict of the same tensors
        assert all(out[n] is dest[n] for n in dest)
        pad = {n: torch.zeros(x.shape, dtype=torch.bool) for n, x in dest.items()}
        for name, stored in cover_of(plan.dst, validate=False).ranks[rank].items():
            for box in stored.boxes:
                if box.source is None:
                    pad[name].narrow(stored.dim, box.offset, box.length).fill_(True)
                    found = True
        for n, x in out.items():
            assert (x[pad[n]] == 0).all()
            assert torch.equal(_bits(x)[~pad[n]], _bits(before[n])[~pad[n]])
    assert found


def test_existing_storage_refuses_tensors_not_the_destinations_naming_each():
    plan = _plan("vllm:2->megatron:4")
    where = f"{plan.dst} rank 1: the existing destination storage"
    names = list(plan.dst.pieces[1])
    first, second, last = names[0], names[1], names[-1]

    def refused(dest) -> str:
        with pytest.raises(InvalidShards) as e:
            existing_storage(plan, 1, dest)
        return str(e.value)

    dest = _destination(plan, 1)
    del dest[first], dest[second]
    assert refused(dest) == f"{where} lacks {first}, {second}"
    dest = _destination(plan, 1)
    dest["zz.extra"], dest["aa.extra"] = torch.zeros(1), torch.zeros(1)
    assert refused(dest) == f"{where} has unexpected aa.extra, zz.extra"
    dest = _destination(plan, 1)
    dest["b.extra"] = dest.pop(first)
    assert refused(dest) == f"{where} lacks {first}; has unexpected b.extra"
    shape = list(plan.dst.pieces[1][last].local_shape(
        plan.dst.config.param_shapes()[plan.dst.pieces[1][last].source]))
    declared = f"declared contiguous torch.float32 {shape}"
    for bad, got in ((torch.zeros(shape, dtype=torch.float64), f"torch.float64 {shape}"),
                     (torch.zeros([shape[0] + 1, *shape[1:]]),
                      f"torch.float32 {[shape[0] + 1, *shape[1:]]}"),
                     (torch.zeros(shape[::-1]).t(), f"torch.float32 {shape} non-contiguous"),
                     ([0.0], "list")):
        dest = _destination(plan, 1)
        dest[last] = bad
        assert refused(dest) == f"{where} {last}: {got}, {declared}"
    assert existing_storage(plan, 5, {}) == {}
    with pytest.raises(InvalidShards) as e:
        existing_storage(plan, 5, {"x": torch.zeros(1)})
    assert str(e.value) == (f"{plan.dst} rank 5: the existing destination storage "
                            "has unexpected x")


def test_padding_boxes_come_from_the_cover_per_rank_and_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(execute, "_PADDING", {})
    layout = _plan("vllm:2->megatron:4").dst
    padded = set()
    for rank in (3, 0, 1, 2, 0, 3):
        want = [(name, stored.dim, box.offset, box.length)
                for name, stored in cover_of(layout, validate=False).ranks[rank].items()
                for box in stored.boxes if box.source is None]
        assert padding(layout, rank) == want
        padded |= {rank} if want else set()
    assert len(padded) >= 1 and len(padded) < 4  # the ranks differ
    assert padding(layout, 4) == []
    assert len(execute._PADDING) == 5
    for rank in range(5, 257):
        padding(layout, rank)
    assert len(execute._PADDING) == 257
    padding(layout, 300)  # the 258th: the cache is emptied first
    assert list(execute._PADDING) == [(layout.key, 300)]


# -- contiguity, messages, exchanges, the schedule


def test_contiguity_of_empty_and_partial_regions_is_what_torch_says():
    x = torch.empty((3, 4, 2), device="meta")
    cases = [((0, 0), (0, 4), (0, 2)), ((1, 2), (2, 2), (0, 2)), ((0, 3), (1, 3), (0, 0)),
             ((1, 2), (1, 3), (0, 2)), ((0, 2), (0, 4), (0, 2)), ((0, 3), (0, 4), (1, 2)),
             ((1, 3), (0, 4), (0, 2)), ((1, 2), (1, 2), (1, 2)), ((0, 3), (0, 1), (0, 2))]
    for region in cases:
        view = x[tuple(slice(a, b) for a, b in region)]
        assert execute._contiguous((3, 4, 2), region) == view.is_contiguous(), region


def test_direct_and_staging_follow_torchs_contiguity_of_each_messages_view():
    for key in ("megatron:4->vllm:2", "vllm:2->megatron:4", "megatron:2->meta:2",
                "megatron:1->vllm:tp2ep2"):
        plan = _plan(key)
        src = [plan.src.members(r, generated(plan.src, r, SEED)) for r in range(plan.world)]
        dst = [plan.dst.members(r, destination_storage(plan, r)) for r in range(plan.world)]
        for (frm, to), messages in plan.messages(BUCKET).items():
            for m in messages:
                for side, tensors in (("src", src[frm]), ("dst", dst[to])):
                    want = _staged(plan, m, side, tensors)
                    assert execute._staging(plan, m, side) == want
                    assert execute._direct(plan, m, side) == (want == 0)


@pytest.mark.parametrize("bucket", [4096, 8192, 1 << 20])
def test_exchanges_are_greedy_runs_of_messages_within_the_bucket_on_both_ends(bucket):
    for key in ("megatron:4->vllm:2", "vllm:2->megatron:4", "megatron:2->meta:2"):
        plan = _plan(key)
        for messages in plan.messages(bucket).values():
            groups = exchanges(plan, messages, bucket)
            assert [m for g in groups for m in g] == messages and all(groups)

            def staged(g, side):
                return sum(execute._staging(plan, m, side) for m in g)

            for g in groups:
                assert len(g) == 1 or max(staged(g, "src"), staged(g, "dst")) <= bucket
            for g, nxt in zip(groups, groups[1:]):  # the next message did not fit
                assert max(staged([*g, nxt[0]], "src"), staged([*g, nxt[0]], "dst")) > bucket
    assert exchanges(_plan("plain:2->plain:2"), [], 4096) == []


def test_a_message_staging_exactly_a_bucket_closes_its_exchange_only_past_it():
    plan = _plan("megatron:4->vllm:2")
    messages = max(plan.messages(BUCKET).values(), key=len)
    sizes = [max(execute._staging(plan, m, s) for s in ("src", "dst")) for m in messages]
    two = next(i for i in range(len(sizes) - 1) if sizes[i] and sizes[i + 1])
    pair = messages[two:two + 2]
    fits = sum(execute._staging(plan, m, "src") for m in pair)
    fits = max(fits, sum(execute._staging(plan, m, "dst") for m in pair))
    assert len(exchanges(plan, pair, fits)) == 1
    assert len(exchanges(plan, pair, fits - 4)) == 2


def test_the_schedule_sends_to_rank_plus_j_and_receives_from_rank_minus_j():
    plan = _plan("megatron:2xdp2->vllm:2")
    messages = plan.messages(BUCKET)
    for rank in range(4):
        steps = schedule(plan, rank, BUCKET)
        assert [(s, to, frm) for s, to, frm, *_ in steps] == [
            (j, (rank + j) % 4, (rank - j) % 4) for j in (1, 2, 3)]
        for _, to, frm, outgoing, incoming in steps:
            assert outgoing == exchanges(plan, messages.get((rank, to), []), BUCKET)
            assert incoming == exchanges(plan, messages.get((frm, rank), []), BUCKET)
    assert schedule(_plan("plain:2->plain:2"), 0, BUCKET)[0][:3] == (1, 1, 1)
    one = plan_for(sync_layout(tiny(4), "plain:1"), sync_layout(tiny(4), "plain:1"))
    assert schedule(one, 0, BUCKET) == []


# -- the transport, the meter, the pages


class _Ops:
    """A stand-in ``batch_isend_irecv`` recording its ops and when each is waited for."""

    def __init__(self, events: list) -> None:
        self.events = events

    def __call__(self, ops):
        self.events.append(("batch", [(op.op.__name__, op.peer, op.group, op.tensor)
                                      for op in ops]))
        return [SimpleNamespace(wait=lambda op=op: self.events.append(("wait", op.peer)))
                for op in ops]


def test_an_exchange_posts_sends_then_receives_works_during_the_wire_and_counts_bytes(
        monkeypatch):
    events: list = []
    monkeypatch.setattr(execute.dist, "P2POp", _p2p_op)
    monkeypatch.setattr(execute.dist, "batch_isend_irecv", _Ops(events))
    group = object()
    p2p = CountingP2P(group, 1, Crumbs(events))
    a, b = torch.zeros(3, dtype=torch.float64), torch.zeros(5)
    c = torch.zeros(2, 2)
    p2p.exchange([(0, a), (2, b)], [(2, c)], tag="t 1", during=lambda: events.append("during"))
    (batch,) = [e for e in events if e[0] == "batch"]
    assert [(op, peer, g) for op, peer, g, _ in batch[1]] == [
        ("isend", 0, group), ("isend", 2, group), ("irecv", 2, group)]
    assert [t for *_, t in batch[1]] == [a, b, c] and batch[1][2][3] is c
    assert [e if e[0] != "batch" else "batch" for e in events] == [
        ("inside", "batch_isend_irecv", "t 1"), "batch", "during", ("wait", 0), ("wait", 2),
        ("wait", 2), ("after", "batch_isend_irecv", "t 1")]
    assert (dict(p2p.traffic.sent), dict(p2p.traffic.received)) == ({0: 24, 2: 20}, {2: 16})
    assert p2p.traffic.messages == 2
    p2p.exchange([(0, b)], [], tag="t 2")
    assert p2p.traffic.sent[0] == 44 and p2p.traffic.messages == 3
    assert p2p.traffic.bytes_sent == 64 and p2p.traffic.bytes_received == 16


def test_an_empty_exchange_posts_nothing_and_still_runs_its_work(monkeypatch):
    events: list = []
    monkeypatch.setattr(execute.dist, "batch_isend_irecv", _Ops(events))
    p2p = CountingP2P(object(), 0, Crumbs(events))
    p2p.exchange([], [], tag="nothing", during=lambda: events.append("during"))
    p2p.exchange([], [], tag="nothing")
    assert events == ["during"]
    assert p2p.traffic.messages == 0 and not p2p.traffic.sent and not p2p.traffic.received


def test_a_send_to_itself_is_refused_before_anything_is_posted(monkeypatch):
    events: list = []
    monkeypatch.setattr(execute.dist, "P2POp", _p2p_op)
    monkeypatch.setattr(execute.dist, "batch_isend_irecv", _Ops(events))
    p2p = CountingP2P(object(), 3, None)
    with pytest.raises(ValueError) as e:
        p2p.exchange([(3, torch.zeros(2))], [], tag="sync step 1 exchange 0")
    assert str(e.value) == "rank 3: a send to itself (sync step 1 exchange 0)"
    assert events == []
    untraced = CountingP2P(object(), 0)  # no tracer: no breadcrumb, the exchange still runs
    untraced.exchange([(1, torch.zeros(2))], [], tag="x")
    assert untraced.tracer is None and untraced.traffic.sent == {1: 8}
    assert (untraced.group, untraced.rank) != (None, None) and untraced.rank == 0


def test_traffic_starts_empty_and_sums_per_peer():
    a, b = Traffic(), Traffic()
    assert (a.bytes_sent, a.bytes_received, a.messages) == (0, 0, 0)
    a.sent[1] += 8
    a.received[2] += 4
    a.received[0] += 12
    assert (a.bytes_sent, a.bytes_received) == (8, 16) and b.sent == {} and b.received == {}


def test_the_meter_counts_live_staging_its_peak_and_the_largest_buffer():
    m = Meter()
    assert (m.live, m.peak, m.largest) == (0, 0, 0)
    x = m.allocate(10)
    assert x.dtype == torch.float32 and x.shape == (10,) and x.device.type == "cpu"
    y = m.allocate(6, "meta")
    assert y.device.type == "meta" and (m.live, m.peak, m.largest) == (64, 64, 40)
    m.free(x)
    assert (m.live, m.peak) == (24, 64)
    m.hold(100)
    assert (m.live, m.peak, m.largest) == (124, 124, 100)
    m.release(100)
    m.hold(8)
    m.free(y)
    assert (m.live, m.peak, m.largest) == (8, 124, 100)


def test_storage_and_staging_are_float32_whatever_torchs_default_dtype():
    """The wire carries float32, 4 bytes an element: a user's code on the rank may have set
    another default dtype (``torch.set_default_dtype``), and the executor's tensors must not
    follow it."""
    plan = _plan("vllm:2->megatron:4")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        made = [Meter().allocate(3), *destination_storage(plan, 3).values(),
                *planned_storage(plan, 3).values()]
    finally:
        torch.set_default_dtype(default)
    assert len(made) > 1 and all(x.dtype == torch.float32 for x in made)


class _Libc:
    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.madvise = SimpleNamespace()
        outer = self

        class Madvise:
            argtypes = None

            def __call__(self, *args):
                outer.calls.append(("madvise", self.argtypes, args))
                return 0

        self.madvise = Madvise()


def test_huge_pages_advises_the_2_mib_aligned_part_of_a_large_cpu_tensor(monkeypatch):
    import ctypes

    calls: list = []

    def cdll(name, use_errno=False):
        calls.append(("CDLL", name, use_errno))
        return _Libc(calls)

    monkeypatch.setattr(execute.ctypes, "CDLL", cdll)
    x = torch.empty((5 * HUGE_PAGE + 4096) // 4)
    assert huge_pages(x) is x
    start = -(-x.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    stop = (x.data_ptr() + x.numel() * 4) // HUGE_PAGE * HUGE_PAGE
    assert start >= x.data_ptr() and start % HUGE_PAGE == 0 and stop % HUGE_PAGE == 0
    assert calls == [("CDLL", "libc.so.6", True),
                     ("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
                      (start, stop - start, 14))]
    calls.clear()
    exact = torch.empty(2 * HUGE_PAGE // 4)  # two huge pages' bytes: advised
    huge_pages(exact)
    huge_pages(torch.empty(2 * HUGE_PAGE // 8, dtype=torch.float64))  # bytes, not elements
    assert [c[0] for c in calls] == ["CDLL", "madvise"] * 2
    calls.clear()
    for small in (torch.empty(2 * HUGE_PAGE // 4 - 1), torch.empty(HUGE_PAGE, device="meta"),
                  torch.empty(2 * HUGE_PAGE // 8 - 1, dtype=torch.float64)):
        assert huge_pages(small) is small
    assert calls == []


@pytest.mark.parametrize("error", [OSError, AttributeError])
def test_huge_pages_without_libc_or_madvise_is_a_no_op(monkeypatch, error):
    def cdll(*a, **k):
        raise error("no libc here")

    monkeypatch.setattr(execute.ctypes, "CDLL", cdll)
    x = torch.empty(HUGE_PAGE)
    assert huge_pages(x) is x


@pytest.mark.parametrize(("trim", "reset", "want"), [(True, True, True), (True, False, False),
                                                     (False, True, False)])
def test_rss_reset_needs_both_the_trim_and_the_reset(monkeypatch, trim, reset, want):
    calls = []
    monkeypatch.setattr(execute, "trim", lambda: calls.append("trim") or trim)
    monkeypatch.setattr(execute, "reset_peak", lambda: calls.append("reset") or reset)
    assert rss_reset() is want
    assert calls[0] == "trim"


# -- gather_scatter


def _naive_staging(plan, source) -> int:
    shapes = plan.src.config.param_shapes()
    incoming = sum(math.prod(p.local_shape(shapes[source]))
                   for r in range(1, plan.src.world)
                   for p in plan.src.pieces[r].values() if p.source == source)
    return 4 * (incoming + math.prod(shapes[source]))


@pytest.mark.parametrize("into", ["fresh", "existing"])
@pytest.mark.parametrize("key", ["megatron:4->vllm:2", "vllm:2->megatron:4",
                                 "megatron:2xdp2->vllm:2", "hf->vllm:2", "megatron:pp2->vllm:2"])
def test_gather_scatter_moves_the_naive_bytes_through_rank_0(wire, key, into):
    plan = _plan(key)
    net = Net(plan.world)
    existing = [_destination(plan, r) for r in range(plan.world)]
    held = [dict(x) for x in existing]
    ctxs = [_context(net, r, destination=existing[r] if into == "existing" else None)
            for r in range(plan.world)]
    outs = on_ranks(net, lambda r: gather_scatter(ctxs[r], r, _sources(plan, r), plan))
    for r, out in enumerate(outs):
        want = generated(plan.dst, r, SEED)
        assert list(out) == list(want)
        for n in want:
            assert torch.equal(_bits(out[n]), _bits(want[n])), f"rank {r} {n}"
            if into == "existing":
                assert out[n] is held[r][n]
        assert ctxs[r].meter.live == 0
    assert sum(c.p2p.traffic.bytes_sent for c in ctxs) == naive_bytes(plan.src, plan.dst)
    assert ctxs[0].p2p.traffic.bytes_sent == 4 * sum(
        x.numel() for r in range(1, plan.dst.world) for x in generated(plan.dst, r, 0).values())
    sources = list(plan.src.config.param_shapes())
    assert ctxs[0].meter.peak == max(_naive_staging(plan, s) for s in sources)
    assert all(c.meter.peak == 0 for c in ctxs[1:])
    tags = [f"{kind} {s}" for s in sources for kind in ("gather", "scatter")]
    assert [c["tag"] for c in ctxs[0].p2p.calls] == tags
    for r in range(1, plan.world):
        want = [f"gather {s}" if k == "gather" else f"scatter {s}" for s in sources
                for k in (("gather", "scatter") if r < plan.dst.world else ("gather",))]
        assert [c["tag"] for c in ctxs[r].p2p.calls] == want


# -- the calibrations


def _clocks(monkeypatch, durations: dict[int, list[float]]):
    """A scripted ``perf_counter`` per rank thread: each call pair lasts the next duration."""
    local = threading.local()

    def perf_counter():
        ticks = local.__dict__.setdefault("ticks", [])
        if not ticks:
            for d in durations[local.rank]:
                ticks += [1000.0, 1000.0 + d]
        return ticks.pop(0)

    monkeypatch.setattr(execute, "time", SimpleNamespace(perf_counter=perf_counter))
    return local


def test_calibrate_is_rank_0_s_best_exchange_with_rank_1_broadcast(wire, monkeypatch):
    net = Net(3)
    local = _clocks(monkeypatch, {0: [5.0, 3.0, 4.0, 6.0], 1: [1.0, 1.0, 1.0, 1.0]})
    ctxs = [_context(net, r) for r in range(3)]

    def go(r):
        local.rank = r
        return calibrate(ctxs[r], nbytes=4000, repeats=3)

    assert on_ranks(net, go) == [4000 / 3.0] * 3  # float64: not float32's rounding
    for r in range(3):
        mine = [e for e in net.log if e[0] == r]
        assert mine[0] == (r, "barrier") and mine[-1] == (r, "broadcast", 0)
        batches = [e[2] for e in mine if e[1] == "batch"]
        assert batches == ([[("isend", 1 - r), ("irecv", 1 - r)]] * 4 if r < 2 else [])
        assert ctxs[r].p2p.traffic.bytes_sent == 0 and ctxs[r].p2p.calls == []
    assert ctxs[0].p2p.tracer.events == [("inside", "batch_isend_irecv", "calibrate"),
                                         ("after", "batch_isend_irecv", "calibrate")] * 4


def test_calibrate_moves_8_mib_each_way_and_one_rank_alone_measures_nothing(wire, monkeypatch):
    sizes = []
    real = execute.CountingP2P.exchange

    def exchange(self, sends, recvs, tag, during=None):
        sizes.append((self.rank, [t.numel() * t.element_size() for _, t in sends + recvs],
                      [float(t.sum()) for _, t in sends]))
        return real(self, sends, recvs, tag, during)

    monkeypatch.setattr(execute.CountingP2P, "exchange", exchange)
    local = _clocks(monkeypatch, {0: [2.0] * 4, 1: [2.0] * 4})
    net = Net(2)
    ctxs = [_context(net, r) for r in range(2)]

    def go(r):
        local.rank = r
        return calibrate(ctxs[r])

    # a user's code on the rank may have set another default dtype: the probe still moves
    # 8 MiB of float32, the bytes its bandwidth is computed from (it moved 16 MiB, as
    # float64, before the dtype was stated)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert on_ranks(net, go) == [(8 << 20) / 2.0] * 2
    finally:
        torch.set_default_dtype(default)
    assert sorted(s[:2] for s in sizes) == [(0, [8 << 20] * 2)] * 4 + [(1, [8 << 20] * 2)] * 4
    assert all(s[2] == [float(2 << 20)] for s in sizes)  # ones are sent
    alone = Net(1)
    assert calibrate(_context(alone, 0)) == 0.0
    assert [e[1] for e in alone.log] == ["barrier", "broadcast"]


def test_the_pattern_replay_moves_the_executors_bytes_in_its_exchanges(wire, monkeypatch):
    plan = _plan("megatron:4->vllm:2")
    executed = _run(plan)
    net = Net(plan.world)
    durations = {0: [9.0, 4.1, 6.0, 5.0], 1: [1.0, 3.0, 7.0, 2.0],
                 2: [1.0, 1.0, 1.0, 1.0], 3: [1.0, 2.0, 1.0, 4.5]}  # slowest: 4.1, 7, 5
    local = _clocks(monkeypatch, durations)
    ctxs = [_context(net, r, bucket_bytes=BUCKET) for r in range(plan.world)]

    def go(r):
        local.rank = r
        return calibrate_pattern(ctxs[r], plan)

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the replay's buffers are float32 all the same
    try:
        got = on_ranks(net, go)
    finally:
        torch.set_default_dtype(default)
    busiest = max(max(c.p2p.traffic.bytes_sent, c.p2p.traffic.bytes_received)
                  for c in executed.ctxs)
    for r, figures in enumerate(got):
        done = executed.ctxs[r].p2p
        seconds = (1000.0 + 4.1) - 1000.0  # float64, not float32's 4.1
        assert all(type(figures[k]) is int for k in ("sent", "received", "messages"))
        assert figures == {"seconds": seconds, "bandwidth": busiest / seconds,
                           "sent": done.traffic.bytes_sent,
                           "received": done.traffic.bytes_received,
                           "messages": done.traffic.messages}
        replay = [e for e in net.log if e[0] == r and e[1] == "batch"]
        executor = [c for c in done.calls if c["sends"] or c["recvs"]]
        assert len(replay) == 4 * len(executor)
        assert [e[2] for e in replay[:len(executor)]] == [
            [("isend", p) for p, *_ in c["sends"]] + [("irecv", p) for p, *_ in c["recvs"]]
            for c in executor]
        assert ctxs[r].p2p.traffic.bytes_sent == 0  # counted on a transport of its own
        tags = [t for k, _, t in ctxs[r].p2p.tracer.events if k == "inside"]
        assert tags == [c["tag"].replace("sync", "calibrate pattern") for c in executor] * 4
        assert [e[1] for e in net.log if e[0] == r and e[1] != "batch" and e[1] != "wait"] == (
            ["barrier"] * 4 + ["all_reduce"] * 2)


def test_the_pattern_replay_sends_the_executors_message_sizes(wire, monkeypatch):
    plan = _plan("vllm:2->megatron:4")
    executed = _run(plan)
    sizes: dict[int, list] = {r: [] for r in range(plan.world)}
    real = execute.CountingP2P.exchange

    def exchange(self, sends, recvs, tag, during=None):
        if tag.startswith("calibrate"):
            sizes[self.rank].append(([t.numel() for _, t in sends],
                                     [t.numel() for _, t in recvs],
                                     [float(t.sum()) for _, t in sends]))
        return real(self, sends, recvs, tag, during)

    monkeypatch.setattr(execute.CountingP2P, "exchange", exchange)
    local = _clocks(monkeypatch, {r: [1.0, 2.0] for r in range(plan.world)})
    net = Net(plan.world)
    ctxs = [_context(net, r, bucket_bytes=BUCKET) for r in range(plan.world)]

    def go(r):
        local.rank = r
        return calibrate_pattern(ctxs[r], plan, repeats=1)

    got = on_ranks(net, go)
    assert all(g["seconds"] == 2.0 for g in got)
    for r in range(plan.world):
        executor = [([n for _, n, *_ in c["sends"]], [n for _, n, *_ in c["recvs"]])
                    for c in executed.ctxs[r].p2p.calls]
        assert [s[:2] for s in sizes[r]] == executor * 2
        assert all(total == float(sum(s[0])) for s in sizes[r] for total in [sum(s[2])])


def test_the_pattern_replay_refuses_a_bad_bucket_or_repeats_and_reports_no_time_as_0(
        wire, monkeypatch):
    plan = _plan("plain:2->plain:2")
    net = Net(2)
    for repeats in (3, 0):  # the bucket is checked first, before anything is made
        with pytest.raises(InvalidNumber) as e:
            calibrate_pattern(_context(net, 0, bucket_bytes=3), plan, repeats=repeats)
        assert str(e.value) == "bucket_bytes must be an int >= 4, got 3"
    with pytest.raises(InvalidNumber) as e:
        calibrate_pattern(_context(net, 0), plan, repeats=0)
    assert str(e.value) == "repeats must be an int >= 1, got 0"
    assert net.log == []
    local = _clocks(monkeypatch, {0: [0.0] * 4, 1: [0.0] * 4})

    def go(r):
        local.rank = r
        return calibrate_pattern(_context(net, r), plan)

    assert on_ranks(net, go) == [{"seconds": 0.0, "bandwidth": 0.0, "sent": 0, "received": 0,
                                  "messages": 0}] * 2


class _Devices:
    """``torch`` as the executor sees it, recording the device each tensor factory is asked
    for (``cuda:LOCAL_RANK`` under torchrun: a tensor left on the default device there is
    one NCCL refuses)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, object]] = []

    def __getattr__(self, name: str):
        real = getattr(torch, name)
        if name not in ("ones", "empty", "zeros", "tensor"):
            return real

        def make(*args, **kwargs):
            self.asked.append((name, kwargs.get("device", "unset")))
            return real(*args, **kwargs)

        return make


def test_every_tensor_the_executor_and_the_calibrations_make_is_on_the_contexts_device(
        wire, monkeypatch):
    devices = _Devices()
    monkeypatch.setattr(execute, "torch", devices)
    local = _clocks(monkeypatch, {r: [1.0] * 8 for r in range(4)})
    plan = _plan("megatron:4->vllm:2")
    net = Net(plan.world)
    ctxs = [_context(net, r, device="cpu:0") for r in range(plan.world)]  # not the default

    def go(r):
        local.rank = r
        execute_plan(ctxs[r], r, _sources(plan, r), plan)
        execute_plan(ctxs[r], r, _sources(plan, r), plan, staging="per_message")
        gather_scatter(ctxs[r], r, _sources(plan, r), plan)
        calibrate(ctxs[r], nbytes=64, repeats=1)
        calibrate_pattern(ctxs[r], plan, repeats=1)

    on_ranks(net, go)
    assert {name for name, _ in devices.asked} == {"ones", "empty", "zeros", "tensor"}
    assert {device for _, device in devices.asked} == {"cpu:0"}
    assert Meter().allocate(1).device.type == "cpu"


def test_padding_reads_the_cover_without_validating_it_again_inside_the_timed_region(
        monkeypatch):
    """A plan's layouts were validated when it was planned; ``padding`` runs inside the
    timed region and reads the boxes alone: a cover that validation refuses still gives
    its padding boxes."""
    from tests.sync.conftest import with_piece
    from weight_sync_bench.errors import InvalidCover

    monkeypatch.setattr(execute, "_PADDING", {})
    layout = _plan("vllm:2->megatron:4").dst
    name = next(n for n, p in layout.pieces[0].items() if p.dim == 0 and len(p.idx) > 1)
    broken = with_piece(layout, 0, name, [0, 0])  # one row twice, the rest missing
    with pytest.raises(InvalidCover):
        cover_of(broken)
    rank = next(r for r in range(4) if padding(layout, r))
    execute._PADDING.clear()
    assert padding(broken, rank) == [
        (n, stored.dim, box.offset, box.length)
        for n, stored in cover_of(broken, validate=False).ranks[rank].items()
        for box in stored.boxes if box.source is None]

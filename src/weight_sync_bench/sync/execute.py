"""Phase 2 on the ranks: a plan executed among processes that hold only their source shards.

Every function here runs on one rank and has the signature a user's distributed resharder
has (``ReshardFn``): ``fn(ctx, rank, local_shards, plan) -> destination shards`` of that
rank (an empty dict on a rank past the destination's world).

``execute_plan``, the harness's executor:

1. destination storage: fresh (``planned_storage``, when ``ctx.destination`` is None):
   uninitialised where the plan writes whole rows, zeros elsewhere (padding is zero;
   whatever a mutated plan leaves unwritten too); or existing (``existing_storage``): the
   tensors the consumer already holds, as an inference engine holds its loaded weights
   when a sync arrives, handed over as ``ctx.destination`` (``SyncSession.run(...,
   into="existing")`` allocates and fills them before the timed region), checked to be the
   destination's, padding zeroed, every other element written in place by the plan and
   nothing else touched (what a mutated plan leaves unwritten keeps its stale value);
2. the rest in ``world - 1`` shift steps: at step j rank r sends to ``r + j`` and receives
   from ``r - j`` (mod world), every pair's transfers cut into messages of at most
   ``bucket_bytes`` (``Plan.messages``, cached on the plan: ``SyncSession.run`` makes the
   cut before the plan reaches the ranks, so their timed region does not). A message that
   is one contiguous region is sent from, or received into, the tensor itself (rows of a
   dim-0 box: received in place into destination storage); any other is packed into
   staging: one outgoing and one incoming arena per call, each the size of the largest
   exchange's staging on its side, reused by every exchange (``staging="per_message"``: a
   fresh buffer per message instead).
   Consecutive messages of a pair are posted together, one ``batch_isend_irecv`` and one
   wait per exchange (``exchanges``: while neither end stages more than ``bucket_bytes``
   for it, decided from the layouts' shapes so both ends agree; a run of in-place messages
   is one exchange): a wait per 4 MiB message costs three times the wire time of the bytes
   (``bench/bench_sync.py``'s profile);
3. local copies for what stays on the rank, done while the first exchange is on the wire.

Copies (local, packing into staging, unpacking from it) go by runs (``Plan.local_runs``,
``Message.runs``, made with the plan's cut before the timed region): blocks whose corners
advance by one step are one strided copy, so a per-row cover (Meta's RoPE rows) costs a
copy per (head, half), not per row (``bench/bench_sync.py``: megatron:2 -> meta:2, 795
copies a rank -> 91).

Memory: the staging alive at once is at most one outgoing and one incoming exchange's (the
two arenas), so the executor's extra memory is at most ``2 * bucket_bytes`` (``Meter``
counts every buffer it allocates; ``rss_peak`` reads the kernel's high-water mark
independently). ``DEFAULT_BUCKET`` is 4 MiB: 8 MiB of staging at most, a quarter of TOY's
largest parameter (the 32.8 MB embedding).

Into fresh storage a rank pays a first-touch page fault per 4 KiB of what it receives and
copies (``bench/bench_sync.py`` measures both storages side by side); into existing
storage it does not. ``calibrate_pattern`` replays the executor's own wire pattern (every
rank at once, the same steps, messages and exchanges, warm buffers): the bandwidth at the
run's concurrency, beside ``calibrate``'s one pair (the issue's ``T_min``).

``gather_scatter`` is the naive resharder production syncs use (every source rank sends its
tensors whole to rank 0, which assembles each full parameter and sends every destination
rank its tensors whole): the baseline of the figures, checked by the same harness, into
fresh or existing storage alike.

Bytes are counted at the transport (``CountingP2P``), the only path to the wire here, never
taken from the plan.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync_bench.conventions.maps import gather_canonical
from weight_sync_bench.errors import InvalidNumber, InvalidShards
from weight_sync_bench.memory import reset_peak, trim
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.planner import ELEMENT_SIZE, Message, Plan, Run

if TYPE_CHECKING:
    from weight_sync_bench.collectives.gloo.breadcrumbs import Tracer
    from weight_sync_bench.sync.layouts import SyncLayout

Params = dict[str, torch.Tensor]
DEFAULT_BUCKET = 4 << 20  # bytes per message; the executor's staging is at most twice this


@dataclass
class Traffic:
    """Bytes and messages this rank sent to and received from each peer (at the transport)."""

    sent: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    messages: int = 0

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.received.values())


class CountingP2P:
    """Batched point-to-point over one process group, counting every byte it moves.

    ``exchange(sends, recvs)`` posts every ``(peer, tensor)`` send and receive as one
    ``batch_isend_irecv`` and waits for all of them, inside a breadcrumb (so the watchdog
    names a rank stuck in it). Peers are ranks of ``group`` (the pool's groups are prefixes
    of its world, so they are also global ranks)."""

    def __init__(self, group: Any, rank: int, tracer: Tracer | None = None) -> None:
        self.group, self.rank, self.tracer = group, rank, tracer
        self.traffic = Traffic()

    def exchange(self, sends: list[tuple[int, torch.Tensor]],
                 recvs: list[tuple[int, torch.Tensor]], tag: str,
                 during: Callable[[], None] | None = None) -> None:
        """Post every send and receive, run ``during`` (work of this rank's own that needs
        none of these buffers, done while gloo's threads move the bytes), wait for all."""
        if not sends and not recvs:
            if during is not None:
                during()
            return
        ops = ([dist.P2POp(dist.isend, t, peer, group=self.group) for peer, t in sends]
               + [dist.P2POp(dist.irecv, t, peer, group=self.group) for peer, t in recvs])
        for peer, t in sends:
            if peer == self.rank:
                raise ValueError(f"rank {self.rank}: a send to itself ({tag})")
            self.traffic.sent[peer] += t.numel() * t.element_size()
        with self._crumb(tag):
            works = dist.batch_isend_irecv(ops)
            if during is not None:
                during()
            for work in works:
                work.wait()
        for peer, t in recvs:
            self.traffic.received[peer] += t.numel() * t.element_size()
        self.traffic.messages += len(sends)

    def _crumb(self, tag: str) -> contextlib.AbstractContextManager[None]:
        if self.tracer is None:
            return contextlib.nullcontext()
        return self.tracer.collective("batch_isend_irecv", tag)


class Meter:
    """Staging bytes alive at once on a rank, and their peak: what a resharder allocates
    besides its inputs and outputs (it reports each buffer it allocates and frees)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.largest = 0

    def allocate(self, numel: int, device: str | torch.device = "cpu") -> torch.Tensor:
        buf = huge_pages(torch.empty(numel, dtype=torch.float32, device=device))
        self.live += numel * ELEMENT_SIZE
        self.peak = max(self.peak, self.live)
        self.largest = max(self.largest, numel * ELEMENT_SIZE)
        return buf

    def free(self, buf: torch.Tensor) -> None:
        self.live -= buf.numel() * ELEMENT_SIZE

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` made otherwise (a tensor assembled by a library call) as live."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.largest = max(self.largest, nbytes)

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


@dataclass
class SyncContext:
    """What a distributed resharder gets besides its shards: its rank, the job's world and
    gloo group, the counting transport (``p2p``: move bytes through it and they are counted),
    a staging ``meter``, the ``bucket_bytes`` the harness asks for and the ``device`` tensors
    live on (``cpu`` over gloo; ``cuda:LOCAL_RANK`` over NCCL under torchrun).

    ``destination``: None, or the consumer's existing destination tensors of this rank
    (``SyncSession.run(into="existing")``: allocated and filled before the timed region, as
    an inference engine's loaded weights are): write into them in place and return them."""

    rank: int
    world: int
    group: Any
    p2p: CountingP2P
    meter: Meter
    bucket_bytes: int = DEFAULT_BUCKET
    device: str = "cpu"
    destination: Params | None = None


ReshardFn = Callable[[SyncContext, int, Mapping[str, torch.Tensor], Plan], Params]


def _view(x: torch.Tensor, at: tuple[int, ...], region: tuple[tuple[int, int], ...],
          origin: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The local view of canonical ``region`` in a tensor whose corner ``at`` holds the
    corner of canonical ``origin`` (a transfer's region)."""
    return x[tuple(slice(c + a - o, c + b - o) for c, (a, b), (o, _) in zip(at, region, origin))]


def destination_storage(plan: Plan, rank: int, device: str = "cpu") -> Params:
    """Zeros of each of ``rank``'s destination tensors (padding is zero by declaration)."""
    if rank >= plan.dst.world:
        return {}
    shapes = plan.dst.config.param_shapes()
    return {name: torch.zeros(piece.local_shape(shapes[piece.source]), dtype=torch.float32,
                              device=device)
            for name, piece in plan.dst.pieces[rank].items()}


HUGE_PAGE = 2 << 20


def huge_pages(x: torch.Tensor) -> torch.Tensor:
    """Ask Linux for transparent huge pages under ``x``'s memory (``madvise(MADV_HUGEPAGE)``
    on the 2 MiB-aligned part of a fresh CPU tensor) before anything touches it: first-touch
    page faults, which a receive into fresh destination memory pays on every 4 KiB page, come
    512 times fewer (zeroing 38.7 MB of fresh pages: about 4x faster here, ``bench_sync``).
    Under ``defrag=madvise`` a process's first huge-page faults wait for the kernel to
    compact memory (1 GB: 0.7-1.5 s the first time, 0.06-0.13 s after, 0.26-0.35 s without
    the advice; the README's phase 2 limits). A no-op where the call or THP is missing; the
    values are unaffected either way."""
    if x.device.type != "cpu" or x.numel() * x.element_size() < 2 * HUGE_PAGE:
        return x
    start = -(-x.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    stop = (x.data_ptr() + x.numel() * x.element_size()) // HUGE_PAGE * HUGE_PAGE
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, stop - start, 14)  # MADV_HUGEPAGE
    except (OSError, AttributeError):
        pass
    return x


def planned_storage(plan: Plan, rank: int, device: str = "cpu") -> Params:
    """``rank``'s destination tensors, uninitialised where the plan writes every element of a
    row (dim 0) and zero everywhere else (``unwritten_rows``): padding, and whatever a
    (mutated) plan leaves unwritten, so nothing the plan does not write holds stale memory.
    Saves zeroing the rows that the local copies and the receives overwrite anyway (a pass
    over the whole destination before the first receive could be posted)."""
    if rank >= plan.dst.world:
        return {}
    shapes = plan.dst.config.param_shapes()
    out = {name: huge_pages(torch.empty(piece.local_shape(shapes[piece.source]),
                                        dtype=torch.float32, device=device))
           for name, piece in plan.dst.pieces[rank].items()}
    parts = plan.dst.members(rank, out)
    for name, runs in unwritten_rows(plan, rank).items():
        for start, stop in runs:
            parts[name][start:stop].zero_()
    return out


def unwritten_rows(plan: Plan, rank: int) -> dict[str, list[tuple[int, int]]]:
    """Per destination part of ``rank`` (``SyncLayout.parts``), the row runs ``[start, stop)``
    along dim 0 that no transfer of ``plan`` into it writes whole (every column of the row):
    what ``planned_storage`` zeroes. A row only partly written is zeroed whole."""
    if rank >= plan.dst.world:
        return {}
    shapes = plan.dst.config.param_shapes()
    stored = {name: piece.local_shape(shapes[piece.source])
              for name, piece in plan.dst.parts[rank].items()}
    written: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for t in plan.transfers:
        if t.dst_rank != rank:
            continue
        shape = stored[t.dst_name]
        extents = [b - a for a, b in t.region]
        if all(t.dst_at[d] == 0 and extents[d] == shape[d] for d in range(1, len(shape))):
            written[t.dst_name].append((t.dst_at[0], t.dst_at[0] + extents[0]))
    out: dict[str, list[tuple[int, int]]] = {}
    for name, shape in stored.items():
        at, runs = 0, []
        for start, stop in sorted(written[name]) + [(shape[0], shape[0])]:
            if start > at:
                runs.append((at, start))
            at = max(at, stop)
        if runs:
            out[name] = runs
    return out


def existing_storage(plan: Plan, rank: int, destination: Mapping[str, torch.Tensor]) -> Params:
    """``rank``'s existing destination tensors (``SyncContext.destination``), checked to be
    exactly the destination's (names, shapes, float32, one device), their padding zeroed and
    nothing else touched: the plan's transfers then write every other element in place.
    What a (mutated) plan leaves unwritten keeps what the tensors held before, as it would
    in an engine's weights: the element check must see that (the harness fills them with
    other values first, ``SyncSession.run``). Padding is zeroed on every sync as vLLM's
    ``VocabParallelEmbedding.weight_loader`` does (``param[loaded_weight.shape[0]:]
    .data.fill_(0)`` after copying the loaded rows into the existing parameter).
    ``InvalidShards`` names the rank and the tensor that does not fit."""
    want = plan.dst.pieces[rank] if rank < plan.dst.world else {}
    where = f"{plan.dst} rank {rank}: the existing destination storage"
    if set(destination) != set(want):
        missing = [n for n in want if n not in destination]
        extra = sorted(str(n) for n in destination if n not in want)
        raise InvalidShards(f"{where} " + "; ".join(
            ([f"lacks {', '.join(missing)}"] if missing else [])
            + ([f"has unexpected {', '.join(extra)}"] if extra else [])))
    shapes = plan.dst.config.param_shapes()
    for name, piece in want.items():
        x, shape = destination[name], piece.local_shape(shapes[piece.source])
        if (not isinstance(x, torch.Tensor) or tuple(x.shape) != shape
                or x.dtype != torch.float32 or not x.is_contiguous()):
            got = (f"{x.dtype} {list(x.shape)}{'' if x.is_contiguous() else ' non-contiguous'}"
                   if isinstance(x, torch.Tensor) else type(x).__name__)
            raise InvalidShards(f"{where} {name}: {got}, declared contiguous torch.float32 "
                                f"{list(shape)}")
    out = dict(destination)
    parts = plan.dst.members(rank, out)
    for name, dim, offset, length in padding(plan.dst, rank):
        parts[name].narrow(dim, offset, length).zero_()
    return out


_PADDING: dict[tuple[object, int], list[tuple[str, int, int, int]]] = {}


def padding(layout: SyncLayout, rank: int) -> list[tuple[str, int, int, int]]:
    """``(name, dim, offset, length)`` of every padding box of ``rank``'s stored tensors,
    cached per (layout label and geometry, rank): a plan reaches a rank process pickled, a
    new layout object each time, which ``cover_of``'s per-object cache would miss (its
    boxes cost 7 ms for TOY_KV4 plain:2, inside the timed region)."""
    key = (layout.key, rank)
    if key not in _PADDING:
        if len(_PADDING) > 256:
            _PADDING.clear()
        _PADDING[key] = [] if rank >= layout.world else [
            (name, stored.dim, box.offset, box.length)
            for name, stored in cover_of(layout, validate=False).ranks[rank].items()
            for box in stored.boxes if box.source is None]
    return _PADDING[key]


def _contiguous(shape: tuple[int, ...], region: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``region`` is a contiguous view of a contiguous tensor of ``shape`` (what
    ``Tensor.is_contiguous`` says of the view, without making one): every dim after the
    last one not whole is whole, and every dim before it has extent 1 (or it is empty)."""
    extents = [b - a for a, b in region]
    if 0 in extents:
        return True
    partial = [d for d, (e, size) in enumerate(zip(extents, shape)) if e != size]
    return not partial or all(e == 1 for e in extents[:partial[-1]])


def _shape(layout: SyncLayout, rank: int, name: str) -> tuple[int, ...]:
    piece = layout.parts[rank][name]
    return piece.local_shape(layout.config.param_shapes()[piece.source])


def _direct(plan: Plan, message: Message, side: str) -> bool:
    """Whether ``message`` is one region that is a contiguous view of its stored tensor on
    ``side`` ("src": sent from it, "dst": received into it), decided from the layouts'
    shapes alone (arithmetic, no tensor made), so both ends of a pair agree."""
    if len(message.segments) != 1:
        return False
    seg = message.segments[0]
    t = plan.transfers[seg.index]
    shape = (_shape(plan.src, t.src_rank, t.src_name) if side == "src"
             else _shape(plan.dst, t.dst_rank, t.dst_name))
    return _contiguous(shape, seg.region)


def _staging(plan: Plan, message: Message, side: str) -> int:
    """Bytes one end of ``message`` stages (``side`` "src": the sender packs, "dst": the
    receiver unpacks): 0 when it is sent from or received into the stored tensor itself."""
    return 0 if _direct(plan, message, side) else message.numel * ELEMENT_SIZE


def exchanges(plan: Plan, messages: list[Message], bucket: int) -> list[list[Message]]:
    """One rank pair's messages grouped into the exchanges both ends post together:
    consecutive messages while neither end stages more than ``bucket`` bytes for the group
    (a message sent from and received into the tensors themselves stages nothing, so a run
    of those is one exchange). Every exchange ends in a wait, so one synchronisation per
    exchange instead of one per message."""
    out: list[list[Message]] = []
    send = recv = 0
    for m in messages:
        s, r = _staging(plan, m, "src"), _staging(plan, m, "dst")
        if not out or send + s > bucket or recv + r > bucket:
            out.append([])
            send = recv = 0
        out[-1].append(m)
        send, recv = send + s, recv + r
    return out


STAGING = ("arena", "per_message")  # execute_plan's staging: STAGING[0] unless told


def execute_plan(ctx: SyncContext, rank: int, local: Mapping[str, torch.Tensor], plan: Plan,
                 *, staging: str = "arena") -> Params:
    """The harness's executor (module docstring): ``rank``'s destination shards.

    ``staging``: ``"arena"`` (the default): one outgoing and one incoming staging buffer per
    call, each the size of the largest exchange's staging on its side, allocated once and
    reused by every exchange (as checkpoint-engine's ``ParameterServer._update_per_bucket_p2p``
    allocates one ``torch.empty(bucket_size * 2)`` per update and reuses it for every
    bucket): a 4 KiB page of staging faults once per call, not once per exchange.
    ``"per_message"``: a fresh buffer per staged message, freed after its exchange (the
    executor before; ``bench/bench_sync.py`` runs both)."""
    bucket = InvalidNumber.count("bucket_bytes", ctx.bucket_bytes, minimum=ELEMENT_SIZE)
    if staging not in STAGING:
        raise ValueError(f"execute_plan: staging={staging!r}, expected one of {STAGING}")
    stored = (planned_storage(plan, rank, ctx.device) if ctx.destination is None
              else existing_storage(plan, rank, ctx.destination))
    # the plan addresses parts: a stacked tensor's members as views of it (SyncLayout.parts)
    out, local = plan.dst.members(rank, stored), plan.src.members(rank, local)
    pending = [plan.local_runs(rank)]  # done while the first exchange is on the wire

    def local_copies() -> None:
        for run in pending.pop() if pending else ():
            _blocks(out[run.dst_name], run.dst_at, run.dst_step, run).copy_(
                _blocks(local[run.src_name], run.src_at, run.src_step, run))

    steps = schedule(plan, rank, bucket)
    arenas: dict[str, torch.Tensor] = {}
    if staging == "arena":
        for side, which in (("src", 3), ("dst", 4)):
            need = max([sum(_staging(plan, m, side) for m in g)
                        for step in steps for g in step[which]] + [0])
            if need:
                arenas[side] = ctx.meter.allocate(need // ELEMENT_SIZE, ctx.device)

    def staging_buffer(side: str, at: int, numel: int) -> torch.Tensor:
        if side in arenas:
            return arenas[side][at:at + numel]
        buf = ctx.meter.allocate(numel, ctx.device)
        staged.append(buf)
        return buf

    for step, to, frm, outgoing, incoming in steps:
        for k in range(max(len(outgoing), len(incoming))):
            sends, recvs, unpacks, staged = [], [], [], []
            at = 0
            for message in outgoing[k] if k < len(outgoing) else []:
                if _direct(plan, message, "src"):
                    sends.append((to, _region(plan, message, local, "src")))
                    continue
                buf = staging_buffer("src", at, message.numel)
                at += message.numel
                _pack(plan, message, local, buf)
                sends.append((to, buf))
            at = 0
            for message in incoming[k] if k < len(incoming) else []:
                if _direct(plan, message, "dst"):
                    recvs.append((frm, _region(plan, message, out, "dst")))
                    continue
                buf = staging_buffer("dst", at, message.numel)
                at += message.numel
                unpacks.append((message, buf))
                recvs.append((frm, buf))
            ctx.p2p.exchange(sends, recvs, tag=f"sync step {step} exchange {k}",
                             during=local_copies if pending and (sends or recvs) else None)
            for message, buf in unpacks:
                _unpack(plan, message, out, buf)
            for buf in staged:
                ctx.meter.free(buf)
    local_copies()  # a rank that exchanged nothing
    for buf in arenas.values():
        ctx.meter.free(buf)
    return stored


def _region(plan: Plan, message: Message, tensors: Mapping[str, torch.Tensor], side: str
            ) -> torch.Tensor:
    """A direct message's one region of its stored tensor on ``side``, flat: a view, sent
    from or received into in place (a source tensor that is itself not contiguous is
    copied: the bytes are the same, so the send still meets its receive)."""
    seg = message.segments[0]
    t = plan.transfers[seg.index]
    x = tensors[t.src_name if side == "src" else t.dst_name]
    view = _view(x, t.src_at if side == "src" else t.dst_at, seg.region, t.region)
    if not view.is_contiguous():
        if side == "dst":  # destination storage is contiguous (planned, or checked existing)
            raise AssertionError(f"{t}: a non-contiguous destination view")  # pragma: no cover
        view = view.contiguous()
    return view.view(-1)


def _blocks(x: torch.Tensor, at: tuple[int, ...], step: tuple[int, ...], run: Run
            ) -> torch.Tensor:
    """``run``'s blocks in ``x`` (block i at local index ``at + i * step``) as one view of
    shape ``(count, *extents)``, whatever ``x``'s strides."""
    strides = x.stride()
    return x.as_strided((run.count, *run.extents),
                        (sum(d * s for d, s in zip(step, strides)), *strides),
                        x.storage_offset() + sum(a * s for a, s in zip(at, strides)))


def _staged(buf: torch.Tensor, run: Run) -> torch.Tensor:
    """``run``'s blocks in a message's staging, one after another from ``run.buf_at``."""
    return buf[run.buf_at:run.buf_at + run.numel].view(run.count, *run.extents)


def _pack(plan: Plan, message: Message, local: Mapping[str, torch.Tensor],
          buf: torch.Tensor) -> None:
    """The message's runs, from the source tensors, one after another into ``buf``."""
    for run in message.runs:
        _staged(buf, run).copy_(_blocks(local[run.src_name], run.src_at, run.src_step, run))


def _unpack(plan: Plan, message: Message, out: Params, buf: torch.Tensor) -> None:
    """``buf``, received, into the destination tensors, run after run."""
    for run in message.runs:
        _blocks(out[run.dst_name], run.dst_at, run.dst_step, run).copy_(_staged(buf, run))


def gather_scatter(ctx: SyncContext, rank: int, local: Mapping[str, torch.Tensor], plan: Plan
                   ) -> Params:
    """The naive resharder (module docstring): one canonical parameter at a time, every
    source rank's tensors of it sent whole to rank 0, assembled there into the full
    parameter, and every destination rank's tensors of it sent whole from rank 0."""
    src, dst = plan.src, plan.dst
    shapes = src.config.param_shapes()
    out = (destination_storage(plan, rank, ctx.device) if ctx.destination is None
           else existing_storage(plan, rank, ctx.destination))
    for source, shape in shapes.items():
        names = {r: [n for n, p in src.pieces[r].items() if p.source == source]
                 for r in range(src.world)}
        if rank == 0:
            incoming = {r: {n: _buffer(ctx, src.pieces[r][n].local_shape(shape))
                            for n in names[r]} for r in range(1, src.world)}
            ctx.p2p.exchange([], [(r, x) for r, d in incoming.items() for x in d.values()],
                             tag=f"gather {source}")
            shards = [{n: local[n] for n in names[0]}] + [incoming[r] for r in range(1, src.world)]
            full = gather_canonical(shards, [{n: src.pieces[r][n] for n in names[r]}
                                             for r in range(src.world)], {source: shape})[source]
            ctx.meter.hold(full.numel() * ELEMENT_SIZE)  # the full parameter, on rank 0
            for d in incoming.values():
                for x in d.values():
                    ctx.meter.free(x)
            sends = []
            for r in range(dst.world):
                for n, piece in dst.pieces[r].items():
                    if piece.source == source:
                        if r == 0:
                            out[n].copy_(piece.take(full))
                        else:
                            sends.append((r, piece.take(full)))
            ctx.p2p.exchange(sends, [], tag=f"scatter {source}")
            ctx.meter.release(full.numel() * ELEMENT_SIZE)
        else:
            ctx.p2p.exchange([(0, local[n].contiguous()) for n in names.get(rank, [])], [],
                             tag=f"gather {source}")
            if rank < dst.world:
                ctx.p2p.exchange([], [(0, out[n]) for n, p in dst.pieces[rank].items()
                                      if p.source == source], tag=f"scatter {source}")
    return out


def _buffer(ctx: SyncContext, shape: tuple[int, ...]) -> torch.Tensor:
    return ctx.meter.allocate(math.prod(shape), ctx.device).view(shape)


# -- memory, read from the kernel


def rss_reset() -> bool:
    """Return freed heap pages to the kernel (``memory.trim``), so that what a resharder
    allocates next shows up as new resident pages, and reset this process's resident-set
    high-water mark (``memory.reset_peak``). False where either is missing."""
    return trim() and reset_peak()


def calibrate(ctx: SyncContext, nbytes: int = 8 << 20, repeats: int = 3) -> float:
    """Point-to-point bandwidth (bytes per second, each direction at once) between ranks 0
    and 1 of the group, over this transport's path (``batch_isend_irecv``): the best of
    ``repeats`` exchanges of ``nbytes`` each way. Every rank calls it; ranks past 1 wait."""
    dist.barrier(group=ctx.group)
    best = float("inf")
    if ctx.rank < 2 and ctx.world >= 2:
        peer = 1 - ctx.rank
        out = torch.ones(nbytes // ELEMENT_SIZE, dtype=torch.float32, device=ctx.device)
        into = torch.empty(nbytes // ELEMENT_SIZE, dtype=torch.float32, device=ctx.device)
        probe = CountingP2P(ctx.group, ctx.rank, ctx.p2p.tracer)
        for _ in range(repeats + 1):  # the first exchange warms the pair's connection up
            started = time.perf_counter()
            probe.exchange([(peer, out)], [(peer, into)], tag="calibrate")
            best = min(best, time.perf_counter() - started)
    result = torch.tensor([nbytes / best if best < float("inf") else 0.0], dtype=torch.float64,
                          device=ctx.device)
    dist.broadcast(result, src=0, group=ctx.group)
    return float(result.item())



Step = tuple[int, int, int, list[list[Message]], list[list[Message]]]


def schedule(plan: Plan, rank: int, bucket: int) -> list[Step]:
    """``rank``'s ``world - 1`` shift steps: ``(step, to, from, outgoing, incoming)``, at step
    j sending to ``rank + j`` and receiving from ``rank - j`` (mod world), each side's
    messages (``plan.messages(bucket)``) grouped into exchanges (``exchanges``). What
    ``execute_plan`` runs and ``calibrate_pattern`` replays."""
    messages, world = plan.messages(bucket), plan.world
    out = []
    for step in range(1, world):
        to, frm = (rank + step) % world, (rank - step) % world
        out.append((step, to, frm, exchanges(plan, messages.get((rank, to), []), bucket),
                    exchanges(plan, messages.get((frm, rank), []), bucket)))
    return out


def calibrate_pattern(ctx: SyncContext, plan: Plan, repeats: int = 3) -> dict[str, Any]:
    """The bandwidth of ``plan``'s own wire pattern: every rank at once, the executor's
    ``world - 1`` shift steps, the same messages (``plan.messages(ctx.bucket_bytes)``) in
    the same exchanges (``exchanges``), sent from and received into warm contiguous buffers
    allocated and touched beforehand: nothing packed, unpacked or copied locally, no fresh
    page. ``calibrate`` measures one pair alone; this measures the pair traffic of the run
    at the run's concurrency (``world`` ranks sharing the machine's cores). Every rank calls
    it; each returns ``{"seconds": best over repeats of the slowest rank's time from a
    common barrier, "bandwidth": the busiest rank's max(sent, received) over that,
    "sent", "received": this rank's bytes per replay, counted at its transport, "messages":
    the sends it posts per replay}``."""
    bucket = InvalidNumber.count("bucket_bytes", ctx.bucket_bytes, minimum=ELEMENT_SIZE)
    repeats = InvalidNumber.count("repeats", repeats)
    rank = ctx.rank
    # (step, to, from, [[numel per message] per exchange] out, ... in): the executor's own
    steps = [(step, to, frm, [[m.numel for m in g] for g in sent],
              [[m.numel for m in g] for g in got])
             for step, to, frm, sent, got in schedule(plan, rank, bucket)]
    size = max([1] + [sum(map(sum, groups)) for *_, o, i in steps for groups in (o, i)])
    source = torch.ones(size, dtype=torch.float32, device=ctx.device)  # ELEMENT_SIZE bytes
    into = torch.zeros(size, dtype=torch.float32, device=ctx.device)  # touched: warm pages
    p2p = CountingP2P(ctx.group, rank, ctx.p2p.tracer)
    times = []
    for _ in range(repeats + 1):  # the first warms the connections up
        dist.barrier(group=ctx.group)
        started = time.perf_counter()
        for step, to, frm, outgoing, incoming in steps:
            at_out = at_in = 0
            for k in range(max(len(outgoing), len(incoming))):
                sends, recvs = [], []
                for n in outgoing[k] if k < len(outgoing) else []:
                    sends.append((to, source[at_out:at_out + n]))
                    at_out += n
                for n in incoming[k] if k < len(incoming) else []:
                    recvs.append((frm, into[at_in:at_in + n]))
                    at_in += n
                p2p.exchange(sends, recvs, tag=f"calibrate pattern step {step} exchange {k}")
        times.append(time.perf_counter() - started)
    slowest = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx.group)
    sent = p2p.traffic.bytes_sent // (repeats + 1)
    received = p2p.traffic.bytes_received // (repeats + 1)
    busiest = torch.tensor([max(sent, received)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=ctx.group)
    seconds = float(slowest[1:].min())
    return {"seconds": seconds, "bandwidth": float(busiest.item()) / seconds if seconds else 0.0,
            "sent": sent, "received": received,
            "messages": p2p.traffic.messages // (repeats + 1)}


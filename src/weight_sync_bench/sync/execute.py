"""Phase 2 on the ranks: a plan executed among processes that hold only their source shards.

Every function here runs on one rank and has the signature a user's distributed resharder
has (``ReshardFn``): ``fn(ctx, rank, local_shards, plan) -> destination shards`` of that
rank (an empty dict on a rank past the destination's world).

``execute_plan``, the harness's executor:

1. destination storage (``planned_storage``): uninitialised where the plan writes whole
   rows, zeros elsewhere (padding is zero; whatever a mutated plan leaves unwritten too);
2. the rest in ``world - 1`` shift steps: at step j rank r sends to ``r + j`` and receives
   from ``r - j`` (mod world), every pair's transfers cut into messages of at most
   ``bucket_bytes`` (``Plan.messages``). A message that is one contiguous region is sent
   from, or received into, the tensor itself (rows of a dim-0 box: received in place into
   destination storage); any other is packed into a staging buffer of its size.
   Consecutive messages of a pair are posted together, one ``batch_isend_irecv`` and one
   wait per exchange (``exchanges``: while neither end stages more than ``bucket_bytes``
   for it, decided from the layouts' shapes so both ends agree; a run of in-place messages
   is one exchange): a wait per 4 MiB message costs three times the wire time of the bytes
   (``bench/bench_sync.py``'s profile);
3. local copies for what stays on the rank, done while the first exchange is on the wire.

Memory: the staging buffers alive at once are at most one outgoing and one incoming
exchange's, so the executor's extra memory is at most ``2 * bucket_bytes`` (``Meter`` counts
every buffer it allocates; ``rss_peak`` reads the kernel's high-water mark independently).
``DEFAULT_BUCKET`` is 4 MiB: 8 MiB of staging at most, a quarter of TOY's largest
parameter (the 32.8 MB embedding).

``gather_scatter`` is the naive resharder production syncs use (every source rank sends its
tensors whole to rank 0, which assembles each full parameter and sends every destination
rank its tensors whole): the baseline of the figures, checked by the same harness.

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
from weight_sync_bench.errors import InvalidNumber
from weight_sync_bench.sync.planner import ELEMENT_SIZE, Message, Plan

if TYPE_CHECKING:
    from weight_sync_bench.collectives.gloo.breadcrumbs import Tracer

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
    live on (``cpu`` over gloo; ``cuda:LOCAL_RANK`` over NCCL under torchrun)."""

    rank: int
    world: int
    group: Any
    p2p: CountingP2P
    meter: Meter
    bucket_bytes: int = DEFAULT_BUCKET
    device: str = "cpu"


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
    A no-op where the call or THP is missing; the values are unaffected either way."""
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
    for name, runs in unwritten_rows(plan, rank).items():
        for start, stop in runs:
            out[name][start:stop].zero_()
    return out


def unwritten_rows(plan: Plan, rank: int) -> dict[str, list[tuple[int, int]]]:
    """Per destination tensor of ``rank``, the row runs ``[start, stop)`` along dim 0 that no
    transfer of ``plan`` into it writes whole (every column of the row): what
    ``planned_storage`` zeroes. A row only partly written is zeroed whole."""
    if rank >= plan.dst.world:
        return {}
    shapes = plan.dst.config.param_shapes()
    stored = {name: piece.local_shape(shapes[piece.source])
              for name, piece in plan.dst.pieces[rank].items()}
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


def _staging(plan: Plan, message: Message, side: str) -> int:
    """Bytes one end of ``message`` stages (``side`` "src": the sender packs, "dst": the
    receiver unpacks): 0 when its one region is a contiguous view of the stored tensor,
    decided from the layouts' shapes alone, so both ends of a pair agree."""
    if len(message.segments) == 1:
        seg = message.segments[0]
        t = plan.transfers[seg.index]
        layout, at, name, owner = ((plan.src, t.src_at, t.src_name, t.src_rank) if side == "src"
                                   else (plan.dst, t.dst_at, t.dst_name, t.dst_rank))
        piece = layout.pieces[owner][name]
        stored = torch.empty(piece.local_shape(layout.config.param_shapes()[piece.source]),
                             device="meta")
        if _view(stored, at, seg.region, t.region).is_contiguous():
            return 0
    return message.numel * ELEMENT_SIZE


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


def execute_plan(ctx: SyncContext, rank: int, local: Mapping[str, torch.Tensor], plan: Plan
                 ) -> Params:
    """The harness's executor (module docstring): ``rank``'s destination shards."""
    bucket = InvalidNumber.count("bucket_bytes", ctx.bucket_bytes, minimum=ELEMENT_SIZE)
    out = planned_storage(plan, rank, ctx.device)
    pending = [plan.local_copies(rank)]  # done while the first exchange is on the wire

    def local_copies() -> None:
        for t in pending.pop() if pending else []:
            _view(out[t.dst_name], t.dst_at, t.region, t.region).copy_(
                _view(local[t.src_name], t.src_at, t.region, t.region))

    messages = plan.messages(bucket)
    world = plan.world
    for step in range(1, world):
        to, frm = (rank + step) % world, (rank - step) % world
        outgoing = exchanges(plan, messages.get((rank, to), []), bucket)
        incoming = exchanges(plan, messages.get((frm, rank), []), bucket)
        for k in range(max(len(outgoing), len(incoming))):
            sends, recvs, unpacks, staged = [], [], [], []
            for message in outgoing[k] if k < len(outgoing) else []:
                buf, packed = _pack(plan, message, local, ctx)
                if packed:
                    staged.append(buf)
                sends.append((to, buf))
            for message in incoming[k] if k < len(incoming) else []:
                buf, unpack = _target(plan, message, out, ctx)
                if unpack is not None:
                    staged.append(buf)
                    unpacks.append(unpack)
                recvs.append((frm, buf))
            ctx.p2p.exchange(sends, recvs, tag=f"sync step {step} exchange {k}",
                             during=local_copies if pending and (sends or recvs) else None)
            for unpack in unpacks:
                unpack()
            for buf in staged:
                ctx.meter.free(buf)
    local_copies()  # a rank that exchanged nothing
    return out


def _single(plan: Plan, message: Message, tensor: torch.Tensor, side: str) -> torch.Tensor | None:
    """The message's one region as a contiguous view of ``tensor``, if it is one."""
    if len(message.segments) != 1:
        return None
    seg = message.segments[0]
    t = plan.transfers[seg.index]
    view = _view(tensor, t.src_at if side == "src" else t.dst_at, seg.region, t.region)
    return view.view(-1) if view.is_contiguous() else None


def _pack(plan: Plan, message: Message, local: Mapping[str, torch.Tensor], ctx: SyncContext
          ) -> tuple[torch.Tensor, bool]:
    """The message's bytes: a view of the source tensor (False) or a packed buffer (True)."""
    first = plan.transfers[message.segments[0].index]
    direct = _single(plan, message, local[first.src_name], "src")
    if direct is not None:
        return direct, False
    buf = ctx.meter.allocate(message.numel, ctx.device)
    at = 0
    for seg in message.segments:
        t = plan.transfers[seg.index]
        view = _view(local[t.src_name], t.src_at, seg.region, t.region)
        buf[at:at + seg.numel].view(view.shape).copy_(view)
        at += seg.numel
    return buf, True


def _target(plan: Plan, message: Message, out: Params, ctx: SyncContext
            ) -> tuple[torch.Tensor, Callable[[], None] | None]:
    first = plan.transfers[message.segments[0].index]
    direct = _single(plan, message, out[first.dst_name], "dst")
    if direct is not None:
        return direct, None  # received in place into destination storage
    buf = ctx.meter.allocate(message.numel, ctx.device)

    def unpack() -> None:
        at = 0
        for seg in message.segments:
            t = plan.transfers[seg.index]
            view = _view(out[t.dst_name], t.dst_at, seg.region, t.region)
            view.copy_(buf[at:at + seg.numel].view(view.shape))
            at += seg.numel

    return buf, unpack


def gather_scatter(ctx: SyncContext, rank: int, local: Mapping[str, torch.Tensor], plan: Plan
                   ) -> Params:
    """The naive resharder (module docstring): one canonical parameter at a time, every
    source rank's tensors of it sent whole to rank 0, assembled there into the full
    parameter, and every destination rank's tensors of it sent whole from rank 0."""
    src, dst = plan.src, plan.dst
    shapes = src.config.param_shapes()
    out = destination_storage(plan, rank, ctx.device)
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
    """Return freed heap pages to the kernel (glibc ``malloc_trim``), so that what a
    resharder allocates next shows up as new resident pages, and reset this process's
    resident-set high-water mark (Linux ``clear_refs`` 5). False where either is missing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss() -> tuple[int, int] | None:
    """``(VmRSS, VmHWM)`` of this process in bytes, or None where /proc has no status."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return None
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def calibrate(ctx: SyncContext, nbytes: int = 8 << 20, repeats: int = 3) -> float:
    """Point-to-point bandwidth (bytes per second, each direction at once) between ranks 0
    and 1 of the group, over this transport's path (``batch_isend_irecv``): the best of
    ``repeats`` exchanges of ``nbytes`` each way. Every rank calls it; ranks past 1 wait."""
    dist.barrier(group=ctx.group)
    best = float("inf")
    if ctx.rank < 2 and ctx.world >= 2:
        peer = 1 - ctx.rank
        out = torch.ones(nbytes // ELEMENT_SIZE, device=ctx.device)
        into = torch.empty(nbytes // ELEMENT_SIZE, device=ctx.device)
        probe = CountingP2P(ctx.group, ctx.rank, ctx.p2p.tracer)
        for _ in range(repeats + 1):  # the first exchange warms the pair's connection up
            started = time.perf_counter()
            probe.exchange([(peer, out)], [(peer, into)], tag="calibrate")
            best = min(best, time.perf_counter() - started)
    result = torch.tensor([nbytes / best if best < float("inf") else 0.0], dtype=torch.float64,
                          device=ctx.device)
    dist.broadcast(result, src=0, group=ctx.group)
    return float(result.item())


"""Phase 1b, rank side: ``GlooCollective``, a rank's breadcrumbs and test faults, and the
rank process itself (``rank_main``, forked by ``rankpool.RankPool``).

A rank process (started by ``rankpool.RankPool``) runs tasks with a ``RankContext``: its
rank, the degree and gloo group of the task, and a ``Tracer`` that numbers every
collective of the task and writes a breadcrumb before and after it into a shared-memory
board, which the parent reads while the rank is stuck, or after it died.

``GlooCollective`` holds one rank (``ranks == (rank,)``, activation lists of length 1) and
implements the ``sharded.Collective`` protocol over ``torch.distributed``, so that phase 1b
runs the very ``ShardedModel.forward`` phase 1a runs. Both operations are autograd
Functions: all-reduce's backward is an all-reduce, all-gather's backward is this rank's
slice of the gradient summed over ranks (reduce-scatter semantics, done as an all-reduce
and a slice because gloo has no reduce-scatter), and reduce-scatter (the same all-reduce
and slice, traced as ``reduce_scatter``) has an all-gather as its backward.

Faults are injected through the tracer (``Fault``, a test hook passed to ranks
explicitly), so the code paths a fault test exercises are the real ones.
"""

from __future__ import annotations

import faulthandler
import io
import json
import mmap
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync_bench.errors import PeerAborted

if TYPE_CHECKING:
    from collections.abc import Iterator
    from multiprocessing.connection import Connection
    from pathlib import Path

Tensors = list[torch.Tensor]

FAULT_ACTIONS = ("skip_rendezvous", "stall", "raise", "kill", "wrong_shape")
FAULT_PHASES = ("rendezvous", "transport", "forward", "backward")


class InjectedFault(RuntimeError):
    """Raised by a ``Fault(action="raise")``; never by the harness on its own."""


@dataclass(frozen=True)
class Fault:
    """A fault a test injects into one rank (a test hook, never monkeypatching).

    - ``skip_rendezvous``: rank ``rank`` never arrives at the process-group rendezvous.
    - ``stall`` / ``raise`` / ``kill``: just before its ``index``-th collective (1-based) of
      ``phase``, rank ``rank`` sleeps forever / raises ``InjectedFault`` / SIGKILLs itself.
    - ``wrong_shape``: rank 0 would send rank ``rank`` a shard of the transport's
      ``index``-th parameter one row short (``GlooTransport`` must refuse to send it).
    """

    action: str
    rank: int
    phase: str = "forward"
    index: int = 1

    def __post_init__(self) -> None:
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"Fault: action={self.action!r} is not one of {FAULT_ACTIONS}")
        if self.phase not in FAULT_PHASES:
            raise ValueError(f"Fault: phase={self.phase!r} is not one of {FAULT_PHASES}")
        if (self.action == "skip_rendezvous") != (self.phase == "rendezvous"):
            raise ValueError(f"Fault: action={self.action!r} does not fire in phase={self.phase!r}; "
                             "skip_rendezvous is the only rendezvous fault")
        if self.action == "wrong_shape" and self.phase != "transport":
            raise ValueError(f"Fault: wrong_shape fires in the transport, got phase={self.phase!r}")
        if self.rank < 0 or self.index < 1:
            raise ValueError(f"Fault: needs rank >= 0 and index >= 1 (rank={self.rank}, "
                             f"index={self.index})")

@dataclass(frozen=True)
class Breadcrumb:
    """Where a rank is: its phase, how many collectives its task has entered (``seq``), the
    last one's op and tag (parameter or layer), and whether it is ``inside`` it, waiting
    for peers, or past it (``after``). Set-up phases (start, rendezvous, idle) have seq 0."""

    phase: str
    seq: int = 0
    op: str = ""
    tag: str = ""
    state: str = "after"
    task: int = 0

    @property
    def progress(self) -> tuple[int, int, int]:
        """Orders ranks of one task: a rank inside collective n is ahead of one after n-1."""
        setup = {"start": 0, "rendezvous": 1}.get(self.phase, 2)
        return (setup, self.seq, 1 if self.state == "inside" else 2)

    def __str__(self) -> str:
        if self.seq == 0:
            return {"start": "started, not yet at rendezvous",
                    "rendezvous": "waiting in init_process_group for the other ranks",
                    "idle": "idle, waiting for a task"}.get(self.phase, f"{self.phase}, no collective yet")
        where = f"collective #{self.seq} {self.op}({self.tag})"
        if self.state == "inside":
            return f"{self.phase}: inside {where}, waiting for peers"
        return f"{self.phase}: after {where}, before #{self.seq + 1}"


_SLOT = 256  # bytes of one rank's breadcrumb (a JSON line, NUL-padded)


class BreadcrumbBoard:
    """One shared-memory slot per rank, a file mapped by the parent and every rank.

    A rank writes its slot with a memory copy, no system call, before and after every
    collective; the parent reads any slot at any time, including after the rank died.
    """

    def __init__(self, path: Path, size: int, *, create: bool = False) -> None:
        if create:
            path.write_bytes(b"\0" * (_SLOT * size))
        self._file = open(path, "r+b")  # noqa: SIM115 - the mapping outlives any with-block
        self._map = mmap.mmap(self._file.fileno(), _SLOT * size)
        self.size = size

    def write(self, rank: int, crumb: Breadcrumb) -> None:
        data = json.dumps(asdict(crumb), separators=(",", ":")).encode()[:_SLOT]
        self._map[rank * _SLOT:(rank + 1) * _SLOT] = data.ljust(_SLOT, b"\0")

    def read(self, rank: int) -> Breadcrumb:
        """The rank's slot, read until two reads agree (a write may be in flight)."""
        previous = None
        for _ in range(100):
            raw = bytes(self._map[rank * _SLOT:(rank + 1) * _SLOT])
            if raw == previous:
                break
            previous = raw
        text = raw.rstrip(b"\0")
        if not text:
            return Breadcrumb(phase="start")
        try:
            return Breadcrumb(**json.loads(text))
        except (ValueError, TypeError):
            return Breadcrumb(phase=f"unreadable breadcrumb {text[:60]!r}")

    def close(self) -> None:
        self._map.close()
        self._file.close()


class Tracer:
    """Numbers a rank's collectives per task, writes its breadcrumbs, fires its fault."""

    def __init__(self, rank: int, board: BreadcrumbBoard | None = None) -> None:
        self.rank = rank
        self.board = board
        self.fault: Fault | None = None
        self.crumb = Breadcrumb(phase="start")
        self.phase_seq = 0  # collectives entered in the current phase

    def mark(self, phase: str, *, task: int | None = None) -> None:
        """Enter a phase; a new task (``task=``) restarts the collective count."""
        crumb = self.crumb
        if task is not None:
            crumb = Breadcrumb(phase=phase, task=task)
        self.phase_seq = 0
        self._write(Breadcrumb(phase, crumb.seq, crumb.op, crumb.tag, "after", crumb.task))

    def begin_task(self, task: int, fault: Fault | None) -> None:
        self.fault = fault
        self.mark("task", task=task)

    @contextmanager
    def collective(self, op: str, tag: str) -> Iterator[None]:
        """Around one collective: fire the fault due here, then ``inside``, then ``after``.
        An exception inside leaves the ``inside`` breadcrumb: that is where it happened."""
        self.phase_seq += 1
        self._fire()
        c = self.crumb
        self._write(Breadcrumb(c.phase, c.seq + 1, op, tag, "inside", c.task))
        yield
        self._write(Breadcrumb(c.phase, c.seq + 1, op, tag, "after", c.task))

    @property
    def inside(self) -> bool:
        return self.crumb.state == "inside"

    def fault_due(self, action: str, index: int) -> Fault | None:
        """The fault of this action due at ``index`` of the current phase, if any (for faults
        that change data rather than control flow, such as ``wrong_shape``)."""
        f = self.fault
        if f is not None and f.action == action and f.phase == self.crumb.phase and f.index == index:
            return f
        return None

    def _fire(self) -> None:
        f = self.fault
        if (f is None or f.rank != self.rank or f.phase != self.crumb.phase
                or f.index != self.phase_seq):
            return
        where = f"rank {self.rank}, {f.phase} collective {f.index}"
        if f.action == "stall":
            while True:
                time.sleep(3600)  # the watchdog's stack dump shows this line
        if f.action == "raise":
            raise InjectedFault(f"injected fault: raise at {where}")
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    def _write(self, crumb: Breadcrumb) -> None:
        self.crumb = crumb
        if self.board is not None:
            self.board.write(self.rank, crumb)


@dataclass
class RankContext:
    """What a task running on one rank gets: its rank (equal in the task's group and the
    pool's world, since groups are prefixes of the world), the task's degree and gloo
    group, and the tracer that records its breadcrumbs."""

    rank: int
    degree: int
    group: dist.ProcessGroup | None
    tracer: Tracer


class GlooCollective:
    """One rank of a gloo group: the ``Collective`` of phase 1b. Lists have length 1."""

    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx

    @property
    def degree(self) -> int:
        return self._ctx.degree

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self._ctx.rank,)

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        (x,) = self._one(xs, "all_reduce", tag)
        return [_AllReduce.apply(x, self._ctx, tag)]

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        (x,) = self._one(xs, "all_gather", tag)
        return [_AllGather.apply(x, self._ctx, dim, tag)]

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        (x,) = self._one(xs, "reduce_scatter", tag)
        if x.shape[dim] % self._ctx.degree:
            raise ValueError(f"reduce_scatter {tag}: dim {dim} of size {x.shape[dim]} does not "
                             f"split evenly over degree {self._ctx.degree}")
        return [_ReduceScatter.apply(x, self._ctx, dim, tag)]

    def _one(self, xs: Tensors, op: str, tag: str) -> Tensors:
        if len(xs) != 1:
            raise ValueError(f"{op} {tag}: GlooCollective holds rank {self._ctx.rank} only, "
                             f"got {len(xs)} tensors")
        return xs


def all_reduce_sum(x: torch.Tensor, ctx: RankContext, tag: str) -> torch.Tensor:
    """A new tensor: ``x`` summed over the group, traced as ``all_reduce(tag)``."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    with ctx.tracer.collective("all_reduce", tag):
        dist.all_reduce(out, group=ctx.group)
    return out


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: RankContext, tag: str) -> torch.Tensor:  # type: ignore[override]
        fctx.rank_ctx, fctx.tag = ctx, tag
        return all_reduce_sum(x, ctx, tag)

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return all_reduce_sum(grad, fctx.rank_ctx, fctx.tag), None, None


def all_gather_cat(x: torch.Tensor, ctx: RankContext, dim: int, tag: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, traced as ``all_gather``."""
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.degree)]
    with ctx.tracer.collective("all_gather", tag):
        dist.all_gather(parts, x, group=ctx.group)
    return torch.cat(parts, dim=dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: RankContext, dim: int, tag: str) -> torch.Tensor:  # type: ignore[override]
        fctx.rank_ctx, fctx.dim, fctx.tag, fctx.width = ctx, dim, tag, x.shape[dim]
        return all_gather_cat(x, ctx, dim, tag)

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        # Reduce-scatter: every rank's loss saw every slice; this rank's input owns one.
        total = all_reduce_sum(grad, fctx.rank_ctx, fctx.tag)
        return total.narrow(fctx.dim, fctx.rank_ctx.rank * fctx.width, fctx.width), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Sum over the group, keep this rank's chunk along ``dim`` (an all-reduce and a slice
    on the wire: gloo has no reduce-scatter); backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: RankContext, dim: int, tag: str) -> torch.Tensor:  # type: ignore[override]
        fctx.rank_ctx, fctx.dim, fctx.tag = ctx, dim, tag
        out = x.detach().clone(memory_format=torch.contiguous_format)
        with ctx.tracer.collective("reduce_scatter", tag):
            dist.all_reduce(out, group=ctx.group)
        width = x.shape[dim] // ctx.degree
        return out.narrow(dim, ctx.rank * width, width).contiguous()

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return all_gather_cat(grad, fctx.rank_ctx, fctx.dim, fctx.tag), None, None, None


# -- messages between the parent and a rank: pickle, with CPU tensors as numpy arrays, copied
# through the pipe (about 5x faster than torch's own reduction of a tensor; torch's
# shared-memory reduction would tie a tensor's lifetime to the process that sent it)

def _tensor_from_numpy(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad
                and obj.layout == torch.strided and obj.dtype != torch.bfloat16):
            return _tensor_from_numpy, (obj.contiguous().numpy(),)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(dumps(obj))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# -- the rank side

def rank_main(rank: int, world: int, directory: Path, conn: Connection, pg_timeout: float,
              fault: Fault | None) -> None:
    """A rank process: join the pool's process group, then run tasks until told to stop."""
    log = os.open(directory / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    faulthandler.enable()  # a fatal signal leaves its stack in the rank's log
    stacks = open(directory / f"rank{rank}.stacks", "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    tracer = Tracer(rank, BreadcrumbBoard(directory / "breadcrumbs", world))
    tracer.mark("start")
    if fault is not None and fault.action == "skip_rendezvous" and fault.rank == rank:
        while True:
            time.sleep(3600)  # never arrives: the parent must name this rank
    groups = _join(rank, world, directory, conn, pg_timeout, tracer)
    tracer.mark("idle", task=0)
    send(conn, ("ready", os.getpid()))
    while True:
        try:
            message = recv(conn)
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone
        if message[0] == "close":  # leave at once: the peers are leaving too
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _, task_id, task, degree, kwargs, task_fault = message
        ctx = RankContext(rank, degree, groups[degree], tracer)
        tracer.begin_task(task_id, task_fault)
        try:
            result = task(ctx, **kwargs)
            data = dumps(("ok", task_id, tracer.crumb.seq, result))
        except Exception as exc:  # noqa: BLE001 - every failure goes to the parent
            data = dumps(("error", task_id, tracer.crumb.seq, _error_payload(exc, tracer)))
        tracer.mark("idle", task=task_id)
        conn.send_bytes(data)


def _join(rank: int, world: int, directory: Path, conn: Connection, pg_timeout: float,
          tracer: Tracer) -> dict[int, Any]:
    tracer.mark("rendezvous")
    send(conn, ("arrived", os.getpid()))
    timeout = timedelta(seconds=pg_timeout)
    store = dist.FileStore(str(directory / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    groups: dict[int, Any] = {world: dist.group.WORLD}
    for degree in range(1, world):
        groups[degree] = dist.new_group(list(range(degree)), timeout=timeout)
    return groups


def _error_payload(exc: BaseException, tracer: Tracer) -> dict[str, Any]:
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - the text below still reaches the parent
        pickled = None
    return {"type": type(exc).__qualname__, "message": str(exc),
            "traceback": traceback.format_exc(), "pickled": pickled,
            "inside": tracer.inside, "consequence": isinstance(exc, PeerAborted),
            "crumb": str(tracer.crumb), "raised_at": time.time()}


def _exit_when_orphaned(parent: int) -> None:
    """A rank whose parent died exits, even while blocked in a collective."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(70)

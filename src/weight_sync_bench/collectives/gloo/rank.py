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
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync_bench.collectives.gloo.breadcrumbs import (
    BreadcrumbBoard,
    Fault,
    Tracer,
)
from weight_sync_bench.errors import PeerAborted

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess
    from pathlib import Path


@dataclass
class RankContext:
    """What a task running on one rank gets: its rank (equal in the task's group and the
    pool's world, since groups are prefixes of the world), the task's degree and gloo
    group, and the tracer that records its breadcrumbs."""

    rank: int
    degree: int
    group: dist.ProcessGroup | None
    tracer: Tracer


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


def rank_main(rank: int, world: int, directory: Path, conn: Connection, pg_timeout: float,
              fault: Fault | None) -> None:
    """A rank process: join the pool's process group, then run tasks until told to stop."""
    try:
        log = os.open(directory / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except FileNotFoundError:  # the pool was torn down (interrupted) before this rank started
        os._exit(0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    faulthandler.enable()  # a fatal signal leaves its stack in the rank's log
    # Ctrl-C in a terminal reaches every process of the group: the parent decides, and tears
    # the ranks down itself (a rank's KeyboardInterrupt would read as a crash of its own)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stacks = open(directory / f"rank{rank}.stacks", "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    exit_when_orphaned(f"rank {rank}", "the forkserver", multiprocessing.parent_process())
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
            data = dumps(("error", task_id, tracer.crumb.seq, error_payload(exc, tracer)))
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


def error_payload(exc: BaseException, tracer: Tracer) -> dict[str, Any]:
    """What a rank sends its parent about an exception its task raised: the type, message
    and traceback as text, the exception pickled where it round-trips, and where the tracer
    was (a pool rank and a torchrun rank report the same way)."""
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - the text below still reaches the parent
        pickled = None
    return {"type": type(exc).__qualname__, "message": str(exc),
            "traceback": traceback.format_exc(), "pickled": pickled,
            "inside": tracer.inside, "consequence": isinstance(exc, PeerAborted),
            "crumb": str(tracer.crumb), "raised_at": time.time()}


ORPHAN_EXIT = 70  # a rank whose forkserver or owner is gone (os.EX_SOFTWARE)


def exit_when_orphaned(who: str, parent_is: str, owner: BaseProcess | None = None) -> None:
    """From now on, this process (``who``, e.g. ``rank 1``) exits ``ORPHAN_EXIT`` within half
    a second of its parent going away (``parent_is`` names it: ``the forkserver``,
    ``torchrun's agent``), or of ``owner`` dying, even while blocked in a collective or in
    rendezvous, where nothing else would end it. Before it exits it says on stderr (a pool
    rank's log, which the pool quotes; a torchrun rank's terminal) which one went away.

    A pool rank's owner is the process that made the pool (``multiprocessing
    .parent_process()``, whose sentinel closes when it dies), not the forkserver that forked
    the rank: every rank holds the forkserver's "alive" pipe open, so a forkserver outlives
    its owner for as long as any rank does, and a rank that watched only its immediate
    parent would wait on itself. A torchrun rank's parent is the agent, which starts its
    workers in sessions of their own: killed by SIGKILL, it takes none of them with it."""
    _watched.append((who, os.getppid(), parent_is, owner))
    threading.Thread(target=_watch, daemon=True, name="wsb-orphan-watch").start()


def exit_if_orphaned() -> None:
    """Exit as the watch would, now, where what ``exit_when_orphaned`` watches is gone: for a
    rank about to report an error that is only the consequence (a peer that left first
    because the same parent went away closes its connection, before this rank's own watch
    looks again)."""
    gone = _gone()
    if gone is not None:
        who = _watched[0][0]
        # a process's last words before os._exit, as faulthandler's are: straight to fd 2 (a
        # pool rank's log, a torchrun rank's terminal), there being no caller left to return
        # them to
        os.write(2, f"{who}: {gone}; exiting {ORPHAN_EXIT}\n".encode())
        os._exit(ORPHAN_EXIT)


# what this process watches (``exit_when_orphaned``): who it is, its parent's pid and name,
# the pool's owner
_watched: list[tuple[str, int, str, BaseProcess | None]] = []


def _gone() -> str | None:
    """What went away of what this process watches, or None."""
    if not _watched:
        return None
    _, parent, parent_is, owner = _watched[0]
    if os.getppid() != parent:
        return f"its parent, {parent_is} (pid {parent}), is gone"
    if owner is not None and not owner.is_alive():
        return f"the process that owns the pool (pid {owner.pid}) is gone"
    return None


def _watch() -> None:
    while True:
        time.sleep(0.5)
        exit_if_orphaned()

"""Breadcrumbs and fault hooks of the rank processes.

Every rank writes where it is (phase, collective number, op, tag) into a shared memory
slot before each collective, so the parent's watchdog can say which rank is behind and
where the others wait. ``Fault`` is the test hook that injects a missing, stalled, raising,
killed, stopped or wrong-shaped rank.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


FAULT_ACTIONS = ("skip_rendezvous", "stall", "raise", "kill", "stop", "wrong_shape")
FAULT_PHASES = ("rendezvous", "transport", "forward", "backward")


class InjectedFault(RuntimeError):
    """Raised by a ``Fault(action="raise")``; never by the harness on its own."""


@dataclass(frozen=True)
class Fault:
    """A fault a test injects into one rank (a test hook, never monkeypatching).

    - ``skip_rendezvous``: rank ``rank`` never arrives at the process-group rendezvous.
    - ``stall`` / ``raise`` / ``kill``: just before its ``index``-th collective (1-based) of
      ``phase``, rank ``rank`` sleeps forever / raises ``InjectedFault`` / SIGKILLs itself.
    - ``stop``: inside its ``index``-th collective of ``phase`` (its breadcrumb already says
      ``inside``, as its waiting peers' do), rank ``rank`` SIGSTOPs itself: a process that
      cannot answer the watchdog's stack request.
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
        if self._due() == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
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

    def _due(self) -> str | None:
        """The action of this rank's fault if it is due at the current collective."""
        f = self.fault
        if (f is None or f.rank != self.rank or f.phase != self.crumb.phase
                or f.index != self.phase_seq):
            return None
        return f.action

    def _fire(self) -> None:
        f = self.fault
        if f is None or self._due() is None:
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

"""Phase 1b, parent side: a pool of rank processes, its launcher and its watchdog (the rank
side, ``rank_main``, is in ``distributed``).

``RankPool(size)`` starts ``size`` rank processes once and runs many tasks on them
(different seeds, geometries and degrees up to ``size``), so a fuzz run pays the process
start-up once. Each rank is a process forked by multiprocessing's forkserver, which has
imported torch and this package once for the whole parent process, so a pool (re)starts in
a fraction of a second instead of a torch import per rank. A rank runs one torch thread,
gloo on 127.0.0.1 through ``lo``, writes its output to a log file, and talks to the parent
over a pipe. (Importing this module sets the forkserver's preload list.)

Degrees below the pool size: a task of degree t runs on ranks 0..t-1 over a prefix
subgroup made at start-up (every rank makes the groups of sizes 1..size-1, since
``new_group`` is collective over the world), so a rank's group rank is its pool rank;
ranks t..size-1 stay idle, blocked reading their pipe.

Rendezvous cannot collide: the ``FileStore`` lives in a private ``mkdtemp`` directory and
gloo binds its own sockets to port 0, so concurrent pools (pytest-xdist workers) share
nothing but the loopback interface.

The parent is the watchdog. It waits for the task's replies with a deadline well below the
process-group timeout (so the watchdog, not gloo, sees a stuck rank), and then:

- a rank reports an exception: its id and traceback reach the caller within ``grace``
  seconds, with every rank's breadcrumb (``RankFailure``);
- a rank's pipe closes without a reply: a crash, named by signal, with the rank's log
  tail (``RankCrash``); unless the forkserver that forked the ranks is gone (killed, say,
  by SIGKILL): then every rank exits because its parent went away, multiprocessing reports
  each as "exit code 255", and the report names the forkserver, its pid and how it ended
  instead of blaming rank 0 (``LauncherCrash``);
- the deadline passes: every live rank of the task dumps its stacks (faulthandler on
  SIGUSR1), and the ranks behind the others are named with their breadcrumbs
  (``RankTimeout``). First the watchdog reads each unfinished rank's process state from
  /proc: a rank that is not running (stopped by SIGSTOP, traced, in uninterruptible sleep)
  cannot answer the stack request, and is named as such (``RankStopped``), whatever its
  breadcrumb says (a rank stopped inside a collective looks like its waiting peers).

After any of these every rank is killed (SIGKILL, then reaped) and the pool starts afresh
on its next task. The exception: when every rank of the task reported back after the same
number of collectives (an error all ranks agreed on, such as a refused transport), the
group is consistent, the pool is kept, and the original exception is raised in the caller.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weight_sync_bench.collectives.gloo.breadcrumbs import BreadcrumbBoard, Fault
from weight_sync_bench.collectives.gloo.rank import dumps, rank_main, recv, send
from weight_sync_bench.errors import (
    InvalidNumber,
    LauncherCrash,
    RankCrash,
    RankFailure,
    RankStopped,
    RankTimeout,
    TooManyRanks,
    UnguardedMain,
    WsbError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

_FORKSERVER = multiprocessing.get_context("forkserver")
# Imported once by the forkserver, not once per rank: torch and the whole forward. Set when a
# pool first starts, not at import, so merely importing this module changes nothing of the
# caller's multiprocessing. The "__main__" entry is multiprocessing's own default: a script
# using the pool needs the usual `if __name__ == "__main__":` guard.
_PRELOAD = ["__main__", "weight_sync_bench.check.forwards"]
# A rank's exit status when it re-imported a script that starts ranks at import time
MAIN_REIMPORTED = 86


def _main_path() -> str:
    """The script the parent runs as ``__main__`` (what each rank re-imports)."""
    return getattr(sys.modules.get("__main__"), "__file__", None) or "__main__"


# The most rank processes a pool starts (``max_ranks``): every degree and world the harness
# checks or measures fits (degrees up to 8, a vLLM world of 16, training's GLOO_WORLD 8),
# and on a larger machine twice its cores. Each rank is a forked torch process with its own
# heap and gloo sockets, so ``--from plain:100000`` would fork until the machine gave out.
MIN_RANK_CAP = 16
RANKS_PER_CPU = 2
MAX_RANKS_ENV = "WSB_MAX_RANKS"


def max_ranks() -> tuple[int, str]:
    """The most rank processes one pool starts, and its arithmetic in words: ``WSB_MAX_RANKS``
    where set (an int >= 1), else ``max(RANKS_PER_CPU x os.cpu_count(), MIN_RANK_CAP)``."""
    given = os.environ.get(MAX_RANKS_ENV)
    if given is not None:
        try:
            cap = int(given)
        except ValueError:
            raise InvalidNumber(f"{MAX_RANKS_ENV} must be an int >= 1, got {given!r}") from None
        return InvalidNumber.count(MAX_RANKS_ENV, cap), f"{MAX_RANKS_ENV}={cap}"
    cpus = os.cpu_count() or 1
    cap = max(RANKS_PER_CPU * cpus, MIN_RANK_CAP)
    return cap, f"max({RANKS_PER_CPU} x {cpus} CPUs, {MIN_RANK_CAP}) = {cap}"


def check_ranks(size: int) -> None:
    """``TooManyRanks`` where ``size`` rank processes are over ``max_ranks()``: the one
    check, made before any rank of a pool starts."""
    cap, why = max_ranks()
    if size > cap:
        raise TooManyRanks(f"{size} rank processes asked for (one per rank of the degree, "
                           f"world or mesh): at most {why} start on this machine; "
                           f"{MAX_RANKS_ENV}=N raises the cap")


@dataclass
class _Rank:
    rank: int
    proc: BaseProcess
    conn: Connection
    log: Path
    stacks: Path


@dataclass
class _Reply:
    kind: str  # "ok" | "error" | "crash"
    rank: int
    seq: int = -1  # collectives the rank's task entered; -1 for a crash
    value: Any = None  # the result (ok) or the error payload (error)


@dataclass
class _Live:
    """What the finalizer must clean up if the pool is never closed."""

    procs: list[BaseProcess] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.exitcode is not None:
                proc.close()
        self.procs.clear()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs.clear()


class RankPool:
    """``size`` rank processes over gloo, started once, reused by ``run`` for many tasks.

    ``deadline`` bounds one task (watchdog); it must be at most half of ``pg_timeout``, the
    process-group timeout, so that a stuck rank is seen by the watchdog, not by gloo.
    ``start_deadline`` bounds start-up; once one rank has arrived at rendezvous the others
    get ``rendezvous_deadline`` to arrive. ``grace`` is how long the parent waits after a
    first failure for the report of its root cause (a crash closes a pipe before the
    peers' "connection closed" errors arrive). Use as a context manager, or call ``close``.
    One task at a time: a pool is not for concurrent use from several threads.
    """

    def __init__(self, size: int, *, deadline: float = 60.0, pg_timeout: float = 300.0,
                 start_deadline: float = 120.0, rendezvous_deadline: float = 20.0,
                 grace: float = 0.25) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"RankPool: size must be a positive int, got size={size!r}")
        check_ranks(size)
        _check_deadline(deadline, pg_timeout)
        self.size, self.deadline, self.pg_timeout = size, deadline, pg_timeout
        self.start_deadline, self.rendezvous_deadline, self.grace = (
            start_deadline, rendezvous_deadline, grace)
        self.starts = 0  # how many times the ranks were (re)started
        self._ranks: list[_Rank] = []
        self._board: BreadcrumbBoard | None = None
        self._dir: Path | None = None
        self._task = 0
        self._armed: Fault | None = None
        self._forkserver: int | None = None  # the ranks' parent, which forked them
        self._live = _Live()
        self._finalizer = weakref.finalize(self, self._live.kill)

    # -- lifecycle

    @property
    def running(self) -> bool:
        return bool(self._ranks)

    @property
    def directory(self) -> Path | None:
        """The running pool's private directory: rendezvous store, breadcrumbs, rank logs and
        stacks. Removed with the ranks."""
        return self._dir

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(r.proc.pid for r in self._ranks)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, *, fault: Fault | None = None) -> None:
        """Start the ranks and wait until every one has joined the process group and made
        its subgroups. A no-op when running. ``fault`` is a test hook (rendezvous faults)."""
        if self._ranks:
            return
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # this process is a rank (or the forkserver) importing the user's script as
            # __mp_main__ to start, and the script is starting ranks of its own: leave with
            # the code the parent reads as UnguardedMain, before anything is forked
            os._exit(MAIN_REIMPORTED)
        _FORKSERVER.set_forkserver_preload(_PRELOAD)
        _start_forkserver()
        self._dir = Path(tempfile.mkdtemp(prefix="wsb-ranks-"))
        self._live.dirs.append(self._dir)
        self._board = BreadcrumbBoard(self._dir / "breadcrumbs", self.size, create=True)
        try:
            for rank in range(self.size):
                with _signals_deferred():  # never a rank forked that the pool does not know
                    self._ranks.append(self._spawn(rank, fault))
            # read now, while the rank is its child: once the forkserver dies, the ranks'
            # parent is init (or a subreaper), and their exit codes all read 255
            self._forkserver = parent_pid(self._ranks[0].proc.pid)
            self._await_ready()
        except BaseException:
            self._teardown()
            raise
        self.starts += 1

    def close(self) -> None:
        """Ask every rank to leave, kill what has not within a second, remove the files."""
        for r in self._ranks:
            try:
                send(r.conn, ("close",))
            except OSError:
                pass
        stop_by = time.monotonic() + 1.0
        for r in self._ranks:
            r.proc.join(timeout=max(0.0, stop_by - time.monotonic()))
        self._teardown()

    def _spawn(self, rank: int, fault: Fault | None) -> _Rank:
        assert self._dir is not None
        ours, theirs = _FORKSERVER.Pipe()
        log, stacks = self._dir / f"rank{rank}.log", self._dir / f"rank{rank}.stacks"
        proc = _FORKSERVER.Process(
            target=rank_main, name=f"wsb-rank-{rank}", daemon=True,
            args=(rank, self.size, self._dir, theirs, self.pg_timeout, fault))
        proc.start()
        theirs.close()
        self._live.procs.append(proc)
        return _Rank(rank, proc, ours, log, stacks)

    def _await_ready(self) -> None:
        arrived: set[int] = set()
        ready: set[int] = set()
        started = time.monotonic()
        first_arrival: float | None = None
        while len(ready) < self.size:
            limit = started + self.start_deadline
            if first_arrival is not None:
                limit = min(limit, first_arrival + self.rendezvous_deadline)
            waiting = [r for r in self._ranks if r.rank not in ready]
            timeout = limit - time.monotonic()
            if timeout <= 0:
                raise self._start_timeout(arrived, ready, time.monotonic() - started,
                                          first_arrival is not None)
            for conn in wait([r.conn for r in waiting], timeout):
                r = next(r for r in waiting if r.conn is conn)
                try:
                    message = recv(conn)
                except (EOFError, OSError):
                    reply = self._crash_reply(r)
                    raise self._crash_error(reply, "start-up", self._ranks) from None
                if message[0] == "arrived":
                    arrived.add(r.rank)
                    first_arrival = first_arrival or time.monotonic()
                elif message[0] == "ready":
                    ready.add(r.rank)

    def _teardown(self) -> None:
        """SIGKILL every rank, reap it, close the sockets, remove the private directory."""
        for r in self._ranks:
            r.conn.close()
        self._live.kill()
        if self._board is not None:
            self._board.close()
        self._ranks, self._board, self._dir, self._forkserver = [], None, None, None

    def arm(self, fault: Fault) -> None:
        """Test hook: the next task this pool runs carries ``fault``, for faults injected
        under code that does not pass one down (a fuzz run's forward, ``wsb check``)."""
        self._armed = fault

    # -- running a task

    def run(self, task: Callable[..., Any], degree: int, *,
            kwargs: Mapping[str, Any] | None = None,
            rank_kwargs: Sequence[Mapping[str, Any]] | None = None,
            deadline: float | None = None, fault: Fault | None = None) -> list[Any]:
        """``task(ctx, **kwargs, **rank_kwargs[rank])`` on ranks ``0..degree-1``; returns their
        results in rank order. ``task`` must be picklable by reference (a module-level
        function). Starts (or restarts) the ranks if needed. ``fault`` is a test hook."""
        if not isinstance(degree, int) or not 1 <= degree <= self.size:
            raise ValueError(f"RankPool.run: degree must be in 1..{self.size} (the pool size), "
                             f"got degree={degree!r}")
        if rank_kwargs is not None and len(rank_kwargs) != degree:
            raise ValueError(f"RankPool.run: rank_kwargs has {len(rank_kwargs)} entries for "
                             f"degree={degree}")
        deadline = self.deadline if deadline is None else deadline
        _check_deadline(deadline, self.pg_timeout)
        if fault is None and self._armed is not None:
            fault, self._armed = self._armed, None
        self._task += 1
        messages = []  # pickled before anything is sent: a rank never gets half a task
        for rank in range(degree):
            payload = {**(kwargs or {}), **(rank_kwargs[rank] if rank_kwargs else {})}
            try:
                messages.append(dumps(("task", self._task, task, degree, payload, fault)))
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise TypeError(f"RankPool.run: the task for rank {rank} cannot be pickled "
                                f"({exc}); pass module-level functions and plain data") from exc
        self.start()
        ranks = self._ranks[:degree]
        for r, message in zip(ranks, messages, strict=True):
            try:
                r.conn.send_bytes(message)
            except OSError:
                break  # that rank died; its closed socket is read as a crash below
        return self._collect(ranks, getattr(task, "__name__", repr(task)), deadline)

    def _collect(self, ranks: list[_Rank], name: str, deadline: float) -> list[Any]:
        pending = {r.rank: r for r in ranks}
        replies: dict[int, _Reply] = {}
        until = time.monotonic() + deadline
        grace_until: float | None = None
        try:
            while pending:
                limit = until if grace_until is None else min(until, grace_until)
                timeout = limit - time.monotonic()
                if timeout <= 0:
                    break
                for conn in wait([r.conn for r in pending.values()], timeout):
                    r = next(r for r in pending.values() if r.conn is conn)
                    reply = self._read_reply(r)
                    replies[r.rank] = reply
                    del pending[r.rank]
                    if reply.kind != "ok" and grace_until is None:
                        grace_until = time.monotonic() + self.grace
        except BaseException:  # Ctrl-C, SIGTERM: the ranks are mid-task, the group is lost
            self._teardown()
            raise
        failed = [rep for rep in replies.values() if rep.kind != "ok"]
        if not failed and not pending:
            return [replies[r.rank].value for r in ranks]
        where = f"task {name} at t={len(ranks)}"
        # every rank stopped at the same point, none inside a collective: the process group
        # is consistent, so the pool is kept (a failure inside one would leave it broken)
        if failed and not pending and len({rep.seq for rep in replies.values()}) == 1 \
                and all(rep.kind != "crash" and not rep.value["inside"] for rep in failed):
            raise self._agreed_error(failed)
        try:
            if failed:
                crashes = [rep for rep in failed if rep.kind == "crash"]
                if crashes:
                    raise self._crash_error(min(crashes, key=lambda rep: rep.rank), where, ranks)
                raise self._raised_error(failed, where, ranks)
            raise self._task_timeout(list(pending.values()), ranks, where, deadline)
        finally:
            self._teardown()

    def _read_reply(self, r: _Rank) -> _Reply:
        try:
            kind, _task, seq, value = recv(r.conn)
        except (EOFError, OSError):
            return self._crash_reply(r)
        return _Reply(kind, r.rank, seq, value)

    def _crash_reply(self, r: _Rank) -> _Reply:
        r.proc.join(timeout=2.0)
        if r.proc.exitcode is None:  # pipe closed, process alive: treat it as dead
            r.proc.kill()
            r.proc.join()
        code = r.proc.exitcode
        return _Reply("crash", r.rank, -1, code)

    # -- reports

    def _crumbs(self, ranks: Sequence[_Rank], skip: int | None = None) -> str:
        assert self._board is not None
        return "\n".join(f"  rank {r.rank} (pid {r.proc.pid}): {self._board.read(r.rank)}"
                         for r in ranks if r.rank != skip)

    def _crash_error(self, reply: _Reply, where: str, ranks: Sequence[_Rank]) -> RankCrash:
        assert self._board is not None
        r = next(r for r in self._ranks if r.rank == reply.rank)
        if reply.value == MAIN_REIMPORTED:
            return UnguardedMain(
                f"rank {r.rank} (pid {r.proc.pid}) exited during {where}: it re-imported your "
                f"script ({_main_path()}) to start, as multiprocessing does in every process "
                "it starts, and the script started the harness's rank processes again at "
                "import time. Put the code that runs checks under `if __name__ == "
                "\"__main__\":` (the Python docs: multiprocessing, \"Safe importing of main "
                "module\")", rank=r.rank, exit_code=MAIN_REIMPORTED, pids=self.pids,
                breadcrumb=str(self._board.read(r.rank)))
        launcher_end = None if self._forkserver is None else child_end(self._forkserver)
        if launcher_end is not None:
            return self._launcher_error(r, launcher_end, where, ranks)
        code = reply.value
        sig = signal.Signals(-code).name if code < 0 else None
        how = f"killed by {sig}" if sig else f"exited with code {code}"
        text = (f"rank {r.rank} crashed during {where}: {how} (pid {r.proc.pid})\n"
                f"rank {r.rank} breadcrumb: {self._board.read(r.rank)}\n"
                f"other ranks:\n{self._crumbs(ranks, skip=r.rank)}\n"
                f"rank {r.rank} log tail:\n{_tail(r.log)}")
        return RankCrash(text, rank=r.rank, signal_name=sig, exit_code=code, pids=self.pids,
                         breadcrumb=str(self._board.read(r.rank)))

    def _launcher_error(self, r: _Rank, end: str, where: str, ranks: Sequence[_Rank]
                        ) -> LauncherCrash:
        """The forkserver, the ranks' parent, ended: the rank whose pipe closed first left
        because its parent went away (its log says so), not on its own."""
        assert self._board is not None and self._forkserver is not None
        how = end if end != "gone" else ("gone (how it ended cannot be read: not this "
                                         "process's child)")
        text = (f"the forkserver process (pid {self._forkserver}), which starts the rank "
                f"processes, died during {where}: {how}; rank {r.rank} (pid {r.proc.pid}) exited "
                f"because its parent went away (its own exit status is unknown: multiprocessing "
                f"reports 255 for every rank whose forkserver is gone); no rank crashed on its "
                f"own, and the pool starts afresh on its next task\n"
                f"rank {r.rank} breadcrumb: {self._board.read(r.rank)}\n"
                f"other ranks:\n{self._crumbs(ranks, skip=r.rank)}\n"
                f"rank {r.rank} log tail:\n{_tail(r.log)}")
        return LauncherCrash(text, launcher="forkserver", launcher_pid=self._forkserver,
                             launcher_end=end, rank=r.rank, pids=self.pids,
                             breadcrumb=str(self._board.read(r.rank)))

    def _raised_error(self, failed: list[_Reply], where: str, ranks: Sequence[_Rank]) -> RankFailure:
        # The root cause: an error raised outside a collective before one raised inside one
        # (a peer's "connection closed"), a rank's own error before a PeerAborted, low rank first.
        root = min(failed, key=lambda rep: (rep.value["inside"], rep.value["consequence"], rep.rank))
        p = root.value
        text = (f"rank {root.rank} raised {p['type']} during {where}: {p['message']}\n"
                f"rank {root.rank} breadcrumb: {p['crumb']}\n"
                f"other ranks:\n{self._crumbs(ranks, skip=root.rank)}\n"
                f"rank {root.rank} traceback:\n{p['traceback']}")
        error = RankFailure(text, rank=root.rank, remote_traceback=p["traceback"],
                            raised_at=p["raised_at"], pids=self.pids, breadcrumb=p["crumb"])
        error.__cause__ = _unpickle_exception(p)
        return error

    def _agreed_error(self, failed: list[_Reply]) -> BaseException:
        root = min(failed, key=lambda rep: (rep.value["consequence"], rep.rank))
        p = root.value
        original = _unpickle_exception(p)
        note = (f"raised on rank {root.rank} ({p['crumb']}); every rank stopped at the same "
                f"point, so the rank pool is kept. rank {root.rank} traceback:\n{p['traceback']}")
        if original is None:
            return RankFailure(f"rank {root.rank} raised {p['type']}: {p['message']}\n{note}",
                               rank=root.rank, remote_traceback=p["traceback"])
        original.add_note(note)
        return original

    def _task_timeout(self, pending: list[_Rank], ranks: list[_Rank], where: str,
                      deadline: float) -> RankTimeout:
        assert self._board is not None
        crumbs = {r.rank: self._board.read(r.rank) for r in pending}
        # what each rank is doing, from the kernel: a stopped rank cannot answer SIGUSR1
        states = {r.rank: process_state(r.proc.pid) for r in pending}
        halted = {rank: s for rank, s in states.items() if s in _NOT_RUNNING}
        stacks = self._dump_stacks([r for r in pending if r.rank not in halted])
        for rank, state in halted.items():
            stacks[rank] = (f"(no stack: the rank did not answer the stack request, process "
                            f"state {state}: {_NOT_RUNNING[state]})")
        silent = tuple(r for r in sorted(stacks) if r not in halted and stacks[r] == _NO_STACK)
        lines = [f"{where} did not finish within the watchdog deadline of {deadline:g} s "
                 f"(process-group timeout {self.pg_timeout:g} s)"]
        if halted or silent:
            stuck = tuple(sorted(halted)) or silent
            lines.append("not running, so it did not answer the stack request:" if halted else
                         "did not answer the stack request (stuck where faulthandler cannot "
                         "run):")
            lines += [f"  rank {r} (pid {self._ranks[r].proc.pid}): process state "
                      f"{states[r] or 'gone'}"
                      + (f" ({_NOT_RUNNING[states[r]]})" if r in halted else "")
                      + f"; last breadcrumb: {crumbs[r]}" for r in stuck]
        else:
            behind = min(c.progress for c in crumbs.values())
            stuck = tuple(r.rank for r in pending if crumbs[r.rank].progress == behind)
            if len(stuck) == len(pending):
                lines.append("no rank is behind the others; every unfinished rank waits at:")
            else:
                lines.append("stuck (behind the others):")
            lines += [f"  rank {r} (pid {self._ranks[r].proc.pid}): {crumbs[r]}" for r in stuck]
        waiting = [r for r in pending if r.rank not in stuck]
        if waiting:
            lines.append("waiting for them:")
            lines += [f"  rank {r.rank} (pid {r.proc.pid}): {crumbs[r.rank]}" for r in waiting]
        finished = [r.rank for r in ranks if r.rank not in crumbs]
        if finished:
            lines.append(f"finished: ranks {finished}")
        lines += [f"stacks of rank {r} (faulthandler):\n{stacks[r]}" for r in sorted(stacks)]
        kwargs = dict(rank=stuck[0], stuck=stuck, stacks=stacks, pids=self.pids,
                      breadcrumb=str(crumbs[stuck[0]]))
        if halted:
            return RankStopped("\n".join(lines), states=halted, **kwargs)
        return RankTimeout("\n".join(lines), **kwargs)

    def _start_timeout(self, arrived: set[int], ready: set[int], elapsed: float,
                       someone_arrived: bool) -> RankTimeout:
        assert self._board is not None
        missing = tuple(r.rank for r in self._ranks if r.rank not in arrived)
        stuck = missing or tuple(r.rank for r in self._ranks if r.rank not in ready)
        stacks = self._dump_stacks([r for r in self._ranks if r.rank not in ready])
        if missing and someone_arrived:
            head = (f"rendezvous: rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} never arrived, {self.rendezvous_deadline:g} s "
                    f"after the first rank did ({elapsed:.1f} s after start)")
        elif missing:
            head = f"rank pool start-up: no rank arrived at rendezvous within {elapsed:.1f} s"
        else:
            head = (f"rendezvous: every rank arrived but ranks {list(stuck)} did not finish "
                    f"joining the process group within {elapsed:.1f} s")
        text = (f"{head}\nbreadcrumbs:\n{self._crumbs(self._ranks)}\n"
                + "\n".join(f"stacks of rank {r} (faulthandler):\n{stacks[r]}" for r in sorted(stacks)))
        return RankTimeout(text, rank=stuck[0], stuck=stuck, stacks=stacks, pids=self.pids)

    def _dump_stacks(self, ranks: Sequence[_Rank], settle: float = 1.5) -> dict[int, str]:
        """Every live rank's Python stacks, written by its faulthandler on SIGUSR1."""
        live = [r for r in ranks if r.proc.exitcode is None]
        for r in live:
            os.kill(r.proc.pid, signal.SIGUSR1)
        sizes: dict[int, int] = {}
        give_up = time.monotonic() + settle
        while time.monotonic() < give_up:
            time.sleep(0.05)
            now = {r.rank: r.stacks.stat().st_size if r.stacks.exists() else 0 for r in live}
            if now == sizes and all(now.values()):
                break
            sizes = now
        return {r.rank: (r.stacks.read_text(errors="replace") if r.stacks.exists() else "")
                or _NO_STACK for r in live}


_NO_STACK = "(no stack written)"
# /proc states of a rank that cannot run its SIGUSR1 handler, and what each means
_NOT_RUNNING = {"T": "stopped: SIGSTOP, SIGTSTP or a debugger", "t": "stopped by a tracer",
                "D": "in uninterruptible sleep in the kernel"}


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back (and delivered at the end) while a rank is spawned: an
    interrupt inside ``Process.start`` would leave a rank the forkserver forked but the pool
    never registered (so never killed), reading half its start-up data from a dead parent."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# The forkserver listens on an AF_UNIX socket that ``forkserver.ensure_running`` binds at
# ``connection.arbitrary_address("AF_UNIX")``: ``<util.get_temp_dir()>/listener-XXXXXXXX``,
# where ``get_temp_dir()`` is ``tempfile.mkdtemp(prefix="pymp-")`` under TMPDIR (CPython
# Lib/multiprocessing/{forkserver,connection,util}.py). ``sockaddr_un.sun_path`` holds 108
# bytes on Linux and 104 on macOS, its NUL included, so a TMPDIR longer than about 70 bytes
# makes the bind fail ("OSError: AF_UNIX path too long") before any rank starts.
SUN_PATH_MAX = 104 - 1  # the smaller of the two, less the NUL
_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")  # what multiprocessing appends
SHORT_TEMP_BASES = ("/tmp", "/var/tmp", "/dev/shm")


def socket_tempdir(base: str | None = None) -> str | None:
    """Where multiprocessing's temporary files (the forkserver's listener socket) must go:
    None where ``base`` (default ``tempfile.gettempdir()``, i.e. TMPDIR) is short enough for
    the socket path, else the first of ``SHORT_TEMP_BASES`` that is short enough and a
    writable directory. Raises ``WsbError`` naming TMPDIR and its length where none is."""
    base = base if base is not None else tempfile.gettempdir()
    if len(os.fsencode(base)) + _SOCKET_SUFFIX <= SUN_PATH_MAX:
        return None
    for short in SHORT_TEMP_BASES:
        if (len(short) + _SOCKET_SUFFIX <= SUN_PATH_MAX and os.path.isdir(short)
                and os.access(short, os.W_OK | os.X_OK)):
            return short
    raise WsbError(f"TMPDIR={base!r} is {len(os.fsencode(base))} bytes: the rank pool's "
                   f"forkserver socket under it would exceed the {SUN_PATH_MAX}-byte AF_UNIX "
                   f"path limit, and none of {', '.join(SHORT_TEMP_BASES)} is a writable "
                   "directory to use instead; set TMPDIR to a shorter directory")


def _start_forkserver() -> None:
    """Start multiprocessing's forkserver (if it is not running) with SIGINT ignored: it
    inherits that through exec, so a Ctrl-C in the terminal, which reaches the whole process
    group, interrupts the parent (which tears the ranks down) and never the forkserver in the
    middle of importing torch (a traceback of its own, and a broken pool).

    Under a TMPDIR too long for its socket path (``socket_tempdir``), multiprocessing's
    temporary directory (``pymp-*``, private, 0700, removed by multiprocessing at exit) is
    made under a short system one instead, by pointing ``tempfile.tempdir`` there for the
    duration of the start only. The pool's own files (``wsb-ranks-*``) stay under TMPDIR."""
    from multiprocessing import forkserver

    short = socket_tempdir()
    saved = tempfile.tempdir
    if short is not None:
        tempfile.tempdir = short
    try:
        if threading.current_thread() is not threading.main_thread():
            forkserver.ensure_running()
            return
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)
    except OSError as exc:
        if "AF_UNIX path too long" not in str(exc):
            raise
        raise WsbError(f"the rank pool's forkserver socket path is too long ({exc}): "
                       "multiprocessing's temporary directory was made under a long TMPDIR "
                       "before the pool started; set TMPDIR to a shorter directory") from exc
    finally:
        tempfile.tempdir = saved


def _check_deadline(deadline: float, pg_timeout: float) -> None:
    if not deadline > 0 or deadline * 2 > pg_timeout:
        raise ValueError(f"watchdog deadline={deadline!r} must be positive and at most half of "
                         f"the process-group timeout pg_timeout={pg_timeout!r}, so that the "
                         "watchdog, not gloo, sees a stuck rank")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"  (no log: {exc})"
    return "\n".join("  " + line for line in text.splitlines()[-lines:]) or "  (empty)"


def _unpickle_exception(payload: Mapping[str, Any]) -> BaseException | None:
    try:
        exc = pickle.loads(payload["pickled"]) if payload["pickled"] else None
    except Exception:  # noqa: BLE001 - a class the parent cannot import: text only
        return None
    return exc if isinstance(exc, BaseException) else None


_shared: RankPool | None = None
_shared_lock = threading.Lock()
_shared_deadline: float | None = None  # None: RankPool's default
# A torchrun job's ranks (``torchrun.TorchrunRanks``) standing in for the shared pool: every
# caller of ``shared_pool`` then runs its tasks on the job (``stand_in``).
_stand_in: Any = None


def stand_in(ranks: Any) -> None:
    """Make ``ranks`` (``TorchrunRanks``; None: undo) what ``shared_pool`` returns, whatever
    size is asked: a task of a degree above the job's world is refused by its ``run``."""
    global _stand_in
    _stand_in = ranks


def shared_pool(size: int, *, deadline: float | None = None) -> RankPool:
    """A process-wide pool of at least ``size`` ranks, started on first use and killed at
    interpreter exit, for callers (tests, the CLI, a fuzz loop) that run many checks without
    threading a pool through. Asking for more ranks than it has replaces it.

    ``deadline`` (``wsb --deadline``) sets the watchdog deadline of this pool and of every
    shared pool after it; a deadline above half the process-group timeout replaces the pool
    with one whose timeout is twice the deadline."""
    global _shared, _shared_deadline
    if _stand_in is not None:
        return _stand_in  # type: ignore[no-any-return]
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
                or not 0 < deadline < float("inf"):
            raise ValueError(f"shared_pool: deadline must be a finite number of seconds > 0, "
                             f"got deadline={deadline!r}")
        _shared_deadline = float(deadline)
    check_ranks(size)  # before the pool there is replaced
    with _shared_lock:
        wanted = _shared_deadline
        if _shared is not None and wanted is not None and _shared.deadline != wanted:
            if wanted * 2 <= _shared.pg_timeout:
                _shared.deadline = wanted
            else:
                _shared.close()
                _shared = None
        if _shared is None or _shared.size < size:
            if _shared is not None:
                _shared.close()
            timing = {} if wanted is None else {"deadline": wanted,
                                                "pg_timeout": max(300.0, 2 * wanted)}
            _shared = RankPool(size, **timing)
        return _shared


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (``R`` running, ``S`` sleeping, ``D`` in
    uninterruptible wait, ``T`` stopped, ``Z`` a zombie...), or None once it is gone: what a
    rank is doing, read from /proc rather than inferred from its breadcrumbs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def parent_pid(pid: int) -> int | None:
    """A process's parent pid, read from /proc (None where it is gone, or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def child_end(pid: int) -> str | None:
    """How a child process of this one ended, read without reaping it (``waitid`` with
    ``WNOWAIT``, so multiprocessing still reaps its forkserver itself): ``"killed by
    SIGKILL"``, ``"exited with code 1"``; None while it runs. For a process that is not this
    one's child: ``"gone"`` once it is gone or a zombie, else None."""
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None if is_alive(pid) else "gone"
    if ended is None:
        return None
    if ended.si_code == os.CLD_EXITED:
        return f"exited with code {ended.si_status}"
    try:
        return f"killed by {signal.Signals(ended.si_status).name}"
    except ValueError:
        return f"killed by signal {ended.si_status}"


def is_alive(pid: int) -> bool:
    """Running or stopped: not gone, and not a zombie waiting for its reaper."""
    return process_state(pid) not in (None, "Z")

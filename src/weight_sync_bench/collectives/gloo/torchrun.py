"""The rank side under ``torchrun``: this process as one rank of a job, running the tasks the
rank pool runs, driven by rank 0.

    torchrun --standalone --nproc-per-node 4 -m weight_sync_bench check --launcher torchrun ...

``TorchrunRanks()`` reads the job from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``: ``torchrun_env``), joins its process group by
``env://`` rendezvous, and makes the prefix subgroups of sizes 1..world-1 the pool makes
(``rank._join``), so a task of degree t runs on ranks 0..t-1 with ``ctx.group`` that prefix,
exactly as on the pool. Rank 0 plays the pool's parent as well as its own rank:
``ranks.run(task, degree, kwargs=..., rank_kwargs=...)`` has ``RankPool.run``'s signature
and results; the other ranks sit in ``ranks.serve()`` until rank 0 ``close``s. Installed as
the process's shared pool (``pool.stand_in``), it carries every gloo check of the harness,
unchanged: the phase 1b check, a user's splitter or resharder, training over gloo.

Control messages (the task, its arguments, each rank's own arguments, the replies) travel on
a gloo group of their own, so the task groups may be NCCL's; the control group waits as long
as rank 0 needs between tasks (a day), the task groups time out at the deadline.

What bounds a fault, and what torchrun's own agent adds (see the README's "Under torchrun"):

- a rank that raises: its typed error and traceback reach rank 0 with every rank's breadcrumb
  (``RankFailure``; an error every rank agreed on, outside a collective, is re-raised as is
  and the job goes on, as on the pool);
- a rank that hangs (alive, stuck): its peers wait in the collective until the task groups'
  timeout (the deadline) and report; each rank's faulthandler dumps its own stacks on its
  stderr once a task has run for the deadline (``faulthandler.dump_traceback_later``); then
  rank 0 waits at most the deadline again in ``monitored_barrier`` (gloo's: it names the
  ranks that did not arrive) and raises ``RankTimeout`` naming the stuck rank, within about
  twice the deadline. Rank 0 then exits non-zero and the agent tears the job down. A stuck
  rank 0 is named by the others, which wait for it twice the deadline after their own part;
- a rank that dies: torchrun's agent sees the exit within its ``--monitor-interval``,
  terminates every other worker and fails the job naming the dead rank's global rank, local
  rank and exit code or signal (``ChildFailedError``); rank 0 may not get to report;
- torchrun's agent killed (SIGKILL: it cannot pass it on): it starts its workers in sessions
  of their own, so they outlive it; each rank watches its parent and, within half a second
  of the agent going, says so on its stderr (``rank 1: its parent, torchrun's agent (pid N),
  is gone; exiting 70``) and exits, even from inside a collective (``rank.exit_when_orphaned``,
  what a pool rank does when its forkserver goes);
- not given: ``RankStopped`` (a SIGSTOPped rank reads as hung: no /proc of a remote host),
  and stacks on demand from rank 0 (there is no SIGUSR1 across hosts; each rank's own timer
  dumps them instead).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync_bench.collectives.gloo.breadcrumbs import Tracer
from weight_sync_bench.collectives.gloo.rank import (
    RankContext,
    error_payload,
    exit_if_orphaned,
    exit_when_orphaned,
)
from weight_sync_bench.errors import (
    MismatchedOptions,
    RankFailure,
    RankTimeout,
    UnsupportedLauncher,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from weight_sync_bench.collectives.gloo.breadcrumbs import Fault

# The process-group backends a torchrun job's ranks run on (where a check's forward runs
# under the rank pool or in process: check.forwards.BACKENDS)
TORCHRUN_BACKENDS = ("gloo", "nccl")
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
CONTROL_TIMEOUT = timedelta(days=1)  # rank 0 between tasks: a reference forward, user code


def torchrun_env(command: str = "check") -> tuple[int, int, int]:
    """``(rank, world, local rank)`` from torchrun's environment, or ``UnsupportedLauncher``
    naming what is missing."""
    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise UnsupportedLauncher(
            f"--launcher torchrun: {', '.join(missing)} not set: this process was not started "
            f"by torchrun (run torchrun --standalone --nproc-per-node N -m weight_sync_bench "
            f"{command} --launcher torchrun ...), or use --launcher pool")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def device_for(backend: str, local_rank: int) -> str:
    """The device a backend's tensors live on; ``UnsupportedLauncher`` where it cannot run."""
    if backend == "gloo":
        return "cpu"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise UnsupportedLauncher(
                f"--backend nccl needs CUDA, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
                "use --backend gloo")
        return f"cuda:{local_rank}"
    raise UnsupportedLauncher(f"unknown backend {backend!r}; known: "
                              f"{', '.join(TORCHRUN_BACKENDS)}")


class TorchrunRanks:
    """This process's place in a torchrun job (module docstring): ``rank``, ``size`` (the
    world), ``device``, ``groups[t]`` (ranks 0..t-1), ``control`` (gloo), ``tracer``.

    ``backend="nccl"`` (CUDA only) makes the job's groups ``cpu:gloo,cuda:nccl``: CUDA tensors
    over NCCL, CPU tensors over gloo. ``deadline`` is the task groups' timeout and the
    watchdog's bound. ``command`` names the subcommand in the error outside torchrun.
    ``options`` (option -> value as text, e.g. ``{"--seed": "0"}``) are what this rank was
    started with: the ranks compare them as they join, and every rank raises
    ``MismatchedOptions`` naming each option that differs and every rank's value
    (``agree``), before any task runs.
    """

    def __init__(self, backend: str = "gloo", *, deadline: float = 300.0,
                 command: str = "check", options: Mapping[str, str] | None = None) -> None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
                or not 0 < deadline < float("inf"):
            raise ValueError(f"TorchrunRanks: deadline must be a finite number of seconds > 0, "
                             f"got deadline={deadline!r}")
        device_for(backend, 0)  # what this machine cannot run is refused first, naming why
        self.rank, self.size, self.local_rank = torchrun_env(command)
        _watch_the_agent(self.rank)
        self.backend, self.deadline = backend, float(deadline)
        self.device = device_for(backend, self.local_rank)
        if self.device != "cpu":
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=self.deadline)
        self.tracer = Tracer(self.rank)
        self.tracer.mark("rendezvous")
        with _terminable():  # the agent's SIGTERM ends a rank waiting here for a dead peer
            dist.init_process_group("gloo" if backend == "gloo" else "cpu:gloo,cuda:nccl",
                                    init_method="env://", rank=self.rank, world_size=self.size,
                                    timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        if options is not None:
            try:
                self.agree(options)
            except MismatchedOptions:
                self._destroy()
                raise
        self.groups: dict[int, Any] = {self.size: dist.group.WORLD}
        for degree in range(1, self.size):  # collective over the world: every rank, in order
            self.groups[degree] = dist.new_group(list(range(degree)), timeout=timeout)
        self.tracer.mark("idle", task=0)
        self.starts = 1
        self._task = 0
        self._open = True
        self._consistent = True  # False once a task failed inside a collective

    def agree(self, options: Mapping[str, str]) -> None:
        """Every rank's ``options`` gathered on every rank (a collective of the whole job);
        ``MismatchedOptions`` on every rank alike where any option differs, naming it and
        each rank's value. A few dozen short strings: the values themselves travel, not a
        digest, so that the error can say what differs."""
        mine = {str(k): str(v) for k, v in options.items()}
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, mine, group=self.control)
        names = list(dict.fromkeys(k for given in gathered for k in given))  # rank 0's order
        absent = "(not an option of this rank's command)"
        differ = {name: tuple(given.get(name, absent) for given in gathered) for name in names
                  if len({given.get(name, absent) for given in gathered}) > 1}
        if not differ:
            return
        lines = [f"  {name}: " + ", ".join(f"{value} on rank {r}" for r, value in
                                          enumerate(values)) for name, values in differ.items()]
        raise MismatchedOptions(
            f"the {self.size} ranks of this torchrun job were started with different options "
            f"(this is rank {self.rank}; every rank compared what every rank parsed, before "
            f"any work):\n" + "\n".join(lines) + "\nevery rank of a job must run the same "
            "command: torchrun gives each the same command line, so a launch script that "
            "changes one rank's options, or a stale one on one host, is the cause",
            differ=differ)

    # -- the pool's surface (what ``shared_pool``'s callers use)

    @property
    def running(self) -> bool:
        return self._open

    def arm(self, fault: Fault) -> None:  # pragma: no cover - the pool's test hook
        raise UnsupportedLauncher("faults are armed on the rank pool; under torchrun pass "
                                  "fault= to run")

    def run(self, task: Callable[..., Any], degree: int, *,
            kwargs: Mapping[str, Any] | None = None,
            rank_kwargs: Sequence[Mapping[str, Any]] | None = None,
            deadline: float | None = None, fault: Fault | None = None) -> list[Any]:
        """``task(ctx, **kwargs, **rank_kwargs[rank])`` on ranks ``0..degree-1`` of the job,
        from rank 0; their results in rank order (``RankPool.run``)."""
        if self.rank != 0:
            raise UnsupportedLauncher(f"TorchrunRanks.run: rank {self.rank} serves; rank 0 "
                                      "runs the tasks")
        if not self._open:
            raise UnsupportedLauncher("TorchrunRanks.run: the job's ranks were closed")
        if not isinstance(degree, int) or not 1 <= degree <= self.size:
            raise UnsupportedLauncher(
                f"a task of degree {degree} needs {degree} ranks; torchrun started {self.size} "
                f"(torchrun --nproc-per-node {degree} ...)")
        if rank_kwargs is not None and len(rank_kwargs) != degree:
            raise ValueError(f"TorchrunRanks.run: rank_kwargs has {len(rank_kwargs)} entries "
                             f"for degree={degree}")
        self._task += 1
        deadline = self.deadline if deadline is None else deadline
        header = ("task", self._task, task, degree, dict(kwargs or {}), fault, deadline,
                  rank_kwargs is not None)
        dist.broadcast_object_list([header], src=0, group=self.control)
        if rank_kwargs is not None:
            for r in range(1, degree):
                dist.send_object_list([dict(rank_kwargs[r])], dst=r, group=self.control)
        reply = self._execute(header, dict(rank_kwargs[0]) if rank_kwargs else {})
        replies = self._gather(reply, deadline, getattr(task, "__name__", repr(task)), degree)
        return [value for _kind, _seq, _crumb, value in replies[:degree]]

    def serve(self) -> None:
        """Ranks other than 0: run rank 0's tasks until it closes the job."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            header = box[0]
            if header[0] == "close":
                self._destroy()
                return
            _, _task, _fn, degree, _kw, _fault, deadline, personal = header
            mine: dict[str, Any] = {}
            if personal and self.rank < degree:
                got: list[Any] = [None]
                dist.recv_object_list(got, src=0, group=self.control)
                mine = got[0]
            self._gather(self._execute(header, mine), deadline, "", degree)

    def close(self) -> None:
        """Rank 0: tell every rank to leave (when the job is still consistent), then leave the
        process group. Idempotent."""
        if not self._open:
            return
        if self.rank == 0 and self._consistent:
            dist.broadcast_object_list([("close",)], src=0, group=self.control)
        self._destroy()

    def leave(self) -> None:
        """Leave the process group without a word to the others: for code every rank runs
        alike (``sync.torchrun``), where no rank serves."""
        self._destroy()

    def __enter__(self) -> TorchrunRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the rank side of one task

    def _execute(self, header: tuple[Any, ...], mine: Mapping[str, Any]
                 ) -> tuple[str, int, str, Any]:
        _, task_id, task, degree, kwargs, fault, deadline, _ = header
        if self.rank >= degree:
            return ("idle", 0, str(self.tracer.crumb), None)
        ctx = RankContext(self.rank, degree, self.groups[degree], self.tracer)
        self.tracer.begin_task(task_id, fault)
        faulthandler.dump_traceback_later(deadline, exit=False, file=sys.stderr)
        try:
            reply = ("ok", self.tracer.crumb.seq, str(self.tracer.crumb),
                     task(ctx, **kwargs, **mine))
        except Exception as exc:  # noqa: BLE001 - every failure goes to rank 0
            reply = ("error", self.tracer.crumb.seq, str(self.tracer.crumb),
                     error_payload(exc, self.tracer))
        finally:
            faulthandler.cancel_dump_traceback_later()
        self.tracer.mark("idle", task=task_id)
        return reply

    def _gather(self, reply: tuple[str, int, str, Any], deadline: float, name: str,
                degree: int) -> list[tuple[str, int, str, Any]]:
        """Every rank's reply on rank 0, after a ``monitored_barrier`` that names the ranks
        that did not arrive within ``deadline``; raises what the replies report."""
        where = f"task {name} at t={degree} (torchrun, {self.size} ranks)"
        # rank 0 waits the deadline for the others from the end of its own part; the others
        # wait for rank 0 twice that (it may still be at work when they are done; a task
        # that outlives the deadline twice over is a stuck rank 0)
        wait = deadline if self.rank == 0 else 2 * deadline
        try:
            dist.monitored_barrier(group=self.control, timeout=timedelta(seconds=wait),
                                   wait_all_ranks=True)
        except RuntimeError as exc:
            exit_if_orphaned()  # a peer that left because the agent went: say that instead
            self._consistent = False
            if self.rank != 0:
                raise RankTimeout(f"rank {self.rank}: rank 0 did not finish {where} within "
                                  f"{wait:g} s of this rank's part ending, or left: {exc}",
                                  rank=0, stuck=(0,), breadcrumb=reply[2]) from None
            raise self._timeout(str(exc), reply, where, deadline) from None
        gathered: list[Any] = [None] * self.size if self.rank == 0 else []
        dist.gather_object(reply, gathered if self.rank == 0 else None, dst=0,
                           group=self.control)
        if self.rank != 0:
            return []
        failed = [(r, rep) for r, rep in enumerate(gathered) if rep[0] == "error"]
        if failed:
            seqs = {rep[1] for rep in gathered[:degree]}
            if len(seqs) == 1 and not any(rep[3]["inside"] for _, rep in failed):
                raise self._agreed(failed)  # the groups are consistent: the job goes on
            self._consistent = False
            raise self._raised(failed, gathered, where)
        return gathered

    def _timeout(self, message: str, reply: tuple[str, int, str, Any], where: str,
                 deadline: float) -> RankTimeout:
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
        stuck = tuple(int(r) for r in found.group(1).split(",")) if found else ()
        own = (f"rank 0 raised {reply[3]['type']}: {reply[3]['message']}" if reply[0] == "error"
               else "rank 0 finished its part")
        if not stuck:  # not a timeout: a peer's connection closed (it died or left)
            return RankTimeout(f"{where} did not finish: a rank left the job (its connection "
                               f"closed: {message.strip()}); torchrun's agent names the rank "
                               f"that exited\nrank 0 breadcrumb: {reply[2]}; {own}",
                               breadcrumb=reply[2])
        text = (f"{where} did not finish: rank{'s' if len(stuck) > 1 else ''} "
                f"{', '.join(map(str, stuck))} did not report within the deadline of "
                f"{deadline:g} s after rank 0's part ended (gloo's monitored_barrier: "
                f"{message.strip()})\n"
                f"rank 0 breadcrumb: {reply[2]}; {own}\n"
                f"each stuck rank's faulthandler dumped its stacks on its own stderr after "
                f"{deadline:g} s of the task")
        return RankTimeout(text, rank=stuck[0], stuck=stuck, breadcrumb=reply[2])

    def _raised(self, failed: list[tuple[int, Any]], gathered: list[Any], where: str
                ) -> RankFailure:
        # the root cause first: an error outside a collective, a rank's own error before a
        # PeerAborted, low rank first (``RankPool._raised_error``'s rule)
        rank, root = min(failed, key=lambda f: (f[1][3]["inside"], f[1][3]["consequence"],
                                                f[0]))
        p = root[3]
        others = "\n".join(f"  rank {r}: {rep[2]}" for r, rep in enumerate(gathered) if r != rank)
        error = RankFailure(f"rank {rank} raised {p['type']} during {where}: {p['message']}\n"
                            f"rank {rank} breadcrumb: {p['crumb']}\nother ranks:\n{others}\n"
                            f"rank {rank} traceback:\n{p['traceback']}", rank=rank,
                            remote_traceback=p["traceback"], raised_at=p["raised_at"],
                            breadcrumb=p["crumb"])
        return error

    def _agreed(self, failed: list[tuple[int, Any]]) -> BaseException:
        import pickle

        rank, root = min(failed, key=lambda f: (f[1][3]["consequence"], f[0]))
        p = root[3]
        try:
            original = pickle.loads(p["pickled"]) if p["pickled"] else None
        except Exception:  # noqa: BLE001 - a class rank 0 cannot import: text only
            original = None
        note = (f"raised on rank {rank} ({p['crumb']}); every rank stopped at the same point, "
                f"so the job goes on. rank {rank} traceback:\n{p['traceback']}")
        if not isinstance(original, BaseException):
            return RankFailure(f"rank {rank} raised {p['type']}: {p['message']}\n{note}",
                               rank=rank, remote_traceback=p["traceback"])
        original.add_note(note)
        return original

    def _destroy(self) -> None:
        # a job whose agent is gone ends here, saying so, not with the error that only
        # followed from it (a peer that noticed first closed its connection)
        exit_if_orphaned()
        self._open = False
        if dist.is_initialized():
            dist.destroy_process_group()


_watching: list[int] = []  # the rank this process watches its agent as, once per process


def _watch_the_agent(rank: int) -> None:
    """This rank exits (70, saying why on its stderr) once its parent, torchrun's agent, is
    gone: an agent killed by SIGKILL leaves its workers running in sessions of their own, and
    a rank stuck in a collective, or waiting for one that is, would never end. Not in a
    process that watches already (a pool rank; a second job in one process)."""
    if not _watching:
        _watching.append(rank)
        exit_when_orphaned(f"rank {rank}", "torchrun's agent")


@contextmanager
def _terminable() -> Iterator[None]:
    """SIGTERM's default action (the process ends) while this rank waits in rendezvous.

    A peer that fails before it joins (a bad option on its command line) leaves this rank
    blocked inside ``init_process_group``, in C++, where the CLI's SIGTERM handler (which
    raises in Python, between bytecodes) never runs: torchrun's agent would wait its 30 s
    before a SIGKILL. Nothing is set up yet that a handler would need to clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

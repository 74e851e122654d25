"""Run by tests/collectives/test_pool_faults.py in a process of its own (the forkserver it
kills is process-wide: killing the test process's own would take every other pool's ranks
with it): a pool of 2 ranks runs a task that waits, while one process dies by SIGKILL, and
what ``run`` raised is printed.

    python tests/collectives/launcher_faults.py forkserver|rank [orphan]

``forkserver``: the forkserver that forked the ranks is killed; ``rank``: rank 1 kills
itself, the forkserver lives. Prints ``RAISED <type> rank=<rank> launcher=<pid or None>
forkserver=<pid>``, then the message, then ``AGAIN <ranks>`` once the pool ran a task again.
``orphan``: then, the pool's ranks started again and idle, ``ORPHANS <pool directory> <rank
pids> <forkserver pid>`` is printed and this process, their owner, dies by SIGKILL (no
finalizer runs): its forkserver and ranks are left to exit on their own.
"""

from __future__ import annotations

import multiprocessing.forkserver as fs
import os
import signal
import sys
import threading
import time

from weight_sync_bench.collectives.gloo.pool import RankPool


def parent_of(ctx) -> int:
    """The rank's parent: the forkserver that forked it."""
    return os.getppid()


def wait_or_die(ctx, *, dies: int | None) -> int:
    if ctx.rank == dies:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # longer than the test's hang detector: only the fault ends it
    return ctx.rank


def main(victim: str, orphan: bool = False) -> int:
    with RankPool(2, deadline=120.0, pg_timeout=240.0) as pool:
        forkserver = pool.run(parent_of, 2)[0]
        dies = 1 if victim == "rank" else None
        if victim == "forkserver":  # while the task runs (or, on a slow machine, just before)
            threading.Timer(0.5, os.kill, (forkserver, signal.SIGKILL)).start()
        try:
            pool.run(wait_or_die, 2, kwargs={"dies": dies})
        except Exception as exc:  # noqa: BLE001 - what the pool raised is the test's subject
            print(f"RAISED {type(exc).__name__} rank={exc.rank} "
                  f"launcher={getattr(exc, 'launcher_pid', None)} forkserver={forkserver}")
            print(exc, flush=True)
        print(f"AGAIN {pool.run(rank_of, 2)}", flush=True)
        if orphan:
            print("ORPHANS", pool.directory, *pool.pids, fs._forkserver._forkserver_pid,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return 0


def rank_of(ctx) -> int:
    return ctx.rank


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], orphan=sys.argv[2:] == ["orphan"]))

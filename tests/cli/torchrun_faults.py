"""Run by ``torchrun`` in tests/cli/test_torchrun_check.py: one phase 1b check on the job's
ranks with a fault injected into one rank (``Fault``, the pool's test hook), and what rank 0
raised printed as one line, ``RAISED <type> stuck=<ranks> rank=<rank>``.

    torchrun --standalone --nproc-per-node 2 tests/cli/torchrun_faults.py ACTION RANK DEADLINE

ACTION ``orphan``: rank 0 prints ``READY <every rank's pid>`` once the job runs tasks, then
runs a check whose rank RANK stalls, for the test to SIGKILL torchrun's agent meanwhile.
"""

from __future__ import annotations

import os
import sys
import time

from weight_sync_bench.check.forwards import run_phase1b
from weight_sync_bench.collectives.gloo.breadcrumbs import Fault
from weight_sync_bench.collectives.gloo.torchrun import TorchrunRanks
from weight_sync_bench.model.config import TOY


def echo_task(ctx, *, common: str, value: str) -> tuple[int, int, str, str]:
    """What a rank was given: its rank, the task's degree, the common and its own argument."""
    return ctx.rank, ctx.degree, common, value


def pid_task(ctx) -> int:
    return os.getpid()


def main(action: str, rank: int, deadline: float) -> int:
    ranks = TorchrunRanks(deadline=deadline)
    if ranks.rank != 0:
        ranks.serve()
        return 0
    started = time.monotonic()
    if action == "orphan":
        print(f"READY {ranks.run(pid_task, ranks.size)}", flush=True)
        action = "stall"
    try:
        run_phase1b(TOY, ranks.size, param_seed=0, token_seed=0, pool=ranks,
                    fault=Fault(action, rank, "forward", 1) if action != "none" else None)
    except Exception as exc:  # noqa: BLE001 - what rank 0 raised is the test's subject
        print(f"RAISED {type(exc).__name__} stuck={getattr(exc, 'stuck', None)} "
              f"rank={getattr(exc, 'rank', None)} after={time.monotonic() - started:.1f}",
              flush=True)
        print(exc, file=sys.stderr, flush=True)
        return 3
    finally:
        if action != "none":
            ranks.close()
    if action == "none":  # each rank its own arguments; a task below the world's size
        with ranks:
            for degree in range(1, ranks.size + 1):
                echoed = ranks.run(echo_task, degree, kwargs={"common": "c"},
                                   rank_kwargs=[{"value": f"v{r}"} for r in range(degree)])
                print(f"ECHO {echoed}", flush=True)
    print(f"PASSED after={time.monotonic() - started:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))

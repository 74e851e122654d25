"""The watchdog reads a rank's process state instead of inferring it from breadcrumbs; the
``arm`` test hook; an interrupt while the parent waits tears the ranks down.

A rank stopped inside a collective has the same breadcrumb as its waiting peers ("inside
collective #n, waiting for peers"): only /proc says which one cannot answer. Likewise a
rank whose parent, the forkserver, was killed reads as "exit code 255" to multiprocessing:
only the forkserver's own end says that no rank crashed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.collectives.test_gloo_pool import assert_orphans_exit
from weight_sync_bench.check.forwards import run_phase1b
from weight_sync_bench.collectives.gloo.breadcrumbs import Fault
from weight_sync_bench.collectives.gloo.pool import RankPool, is_alive, shared_pool
from weight_sync_bench.errors import RankCrash, RankStopped, RankTimeout
from weight_sync_bench.model.config import TOY

TINY = TOY.replace(name="tiny", vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, ffn=48)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, deadline=20.0, pg_timeout=60.0) as p:
        yield p


def _healthy_again(pool, old):
    assert old and not any(is_alive(pid) for pid in old)
    result = run_phase1b(TINY, 2, param_seed=1, token_seed=2, pool=pool, reference=True)
    assert set(pool.pids).isdisjoint(old) and result.logits.isfinite().all()


def test_a_rank_stopped_inside_a_collective_is_named_stopped_from_its_process_state(pool):
    pool.start()
    old = pool.pids
    start = time.monotonic()
    with pytest.raises(RankStopped) as caught:
        run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool, deadline=1.0,
                    fault=Fault("stop", rank=1, phase="forward", index=3))
    elapsed = time.monotonic() - start
    error = caught.value
    assert (error.rank, error.stuck, error.states) == (1, (1,), {1: "T"})
    message = str(error)
    assert "no rank is behind the others" not in message  # the wrong inference of old
    assert (f"not running, so it did not answer the stack request:\n  rank 1 (pid {old[1]}): "
            "process state T (stopped: SIGSTOP, SIGTSTP or a debugger); last breadcrumb: "
            "forward: inside collective #") in message
    # the waiting peer's breadcrumb says the very same thing: breadcrumbs could not tell them apart
    assert error.breadcrumb.startswith("forward: inside collective #")
    assert f"waiting for them:\n  rank 0 (pid {old[0]}): {error.breadcrumb}" in message
    assert "in all_reduce" in error.stacks[0] and "did not answer" in error.stacks[1]
    # the deadline, and the stacks of the live rank only (~1.5 s when idle): a hang detector
    assert elapsed < 1.0 + 20.0
    _healthy_again(pool, old)


# The long run: by default the twin is test_gloo_pool.py's
# test_rank_stalled_before_a_collective_is_named_with_its_breadcrumb_and_stacks (a stalled,
# running rank: a RankTimeout, not RankStopped, its breadcrumb named), the same fault.
@pytest.mark.slow
def test_a_rank_stalled_but_running_is_still_judged_by_its_breadcrumb(pool):
    """The twin: a running rank answers the stack request, so it is no RankStopped."""
    pool.start()
    old = pool.pids
    with pytest.raises(RankTimeout) as caught:
        run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool, deadline=1.0,
                    fault=Fault("stall", rank=1, phase="forward", index=3))
    assert type(caught.value) is RankTimeout and caught.value.stuck == (1,)
    assert "stuck (behind the others)" in str(caught.value)
    _healthy_again(pool, old)


def test_an_armed_fault_fires_on_the_next_task_only(pool):
    pool.start()
    pool.arm(Fault("kill", rank=0, phase="forward", index=1))
    with pytest.raises(RankCrash) as caught:
        run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool)
    assert caught.value.signal_name == "SIGKILL" and caught.value.breadcrumb
    result = run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool, reference=True)
    assert result.logits.isfinite().all()


def test_an_interrupt_while_the_parent_waits_kills_the_ranks(pool):
    """Ctrl-C (here SIGALRM raising KeyboardInterrupt, deterministically) lands in the
    watchdog's wait: the ranks are mid-task, so they are torn down, not left running."""
    pool.start()
    old = pool.pids

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool,
                        fault=Fault("stall", rank=1, phase="forward", index=1))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not pool.running
    _healthy_again(pool, old)


def test_the_shared_pools_deadline_is_settable_and_validated():
    pool = shared_pool(4)
    try:
        assert shared_pool(4, deadline=7.5) is pool and pool.deadline == 7.5  # no restart
        assert shared_pool(4) is pool and pool.deadline == 7.5  # it holds for later callers
        with pytest.raises(ValueError, match="deadline must be a finite number"):
            shared_pool(4, deadline=float("nan"))
        with pytest.raises(ValueError, match="deadline must be a finite number"):
            shared_pool(4, deadline=0)
    finally:
        shared_pool(4, deadline=60.0)  # the default, for the tests after this one


LAUNCHER_FAULTS = Path(__file__).with_name("launcher_faults.py")


def _launcher_fault(victim: str, *then: str, returncode: int = 0) -> str:
    """``launcher_faults.py`` in a process of its own (its forkserver is its own to kill);
    the timeout only detects a hang: the ranks' task waits 600 s unless the fault ends it."""
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(LAUNCHER_FAULTS), victim, *then],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == returncode, done.stdout + done.stderr
    return done.stdout


def test_a_killed_forkserver_is_named_not_blamed_on_rank_0_as_exit_code_255():
    """SIGKILL of the forkserver, the process that starts the ranks: every rank exits because
    its parent went away, and multiprocessing reports each as exit code 255. The report names
    the forkserver, its pid and its signal, and says why rank 0 left (from its own log).

    The same process then dies by SIGKILL itself, its pool's new ranks idle (``orphan``):
    the default run's case of test_gloo_pool.py's
    test_ranks_of_a_parent_killed_without_cleanup_exit_on_their_own, in this process start
    rather than one of its own (checked at the end)."""
    out = _launcher_fault("forkserver", "orphan", returncode=-signal.SIGKILL)
    found = re.search(r"RAISED LauncherCrash rank=0 launcher=(\d+) forkserver=(\d+)", out)
    assert found and found.group(1) == found.group(2), out
    pid = found.group(1)
    assert (f"the forkserver process (pid {pid}), which starts the rank processes, died during "
            "task wait_or_die at t=2: killed by SIGKILL; rank 0 (pid ") in out
    assert "exited because its parent went away" in out and "no rank crashed on its own" in out
    assert f"rank 0 log tail:\n  rank 0: its parent, the forkserver (pid {pid}), is gone; " \
        "exiting 70" in out
    assert "crashed" not in out.split("no rank crashed")[0]  # not "rank 0 crashed ... 255"
    assert "AGAIN [0, 1]" in out  # a new forkserver, new ranks: the pool runs again
    # SIGKILL of the pool's owner leaves no finalizer to run: the forkserver sees its owner
    # gone and exits, and each rank, finding itself orphaned, exits on its own (within a
    # second when idle; the wait below is a hang detector, 30x that)
    (orphans,) = [line.split()[1:] for line in out.splitlines() if line.startswith("ORPHANS ")]
    assert_orphans_exit(*orphans)


# 4 s, a process of its own: the long run. By default the twin is test_gloo_pool.py's
# test_rank_killed_by_a_signal_is_reported_as_a_crash_with_the_signal_name: a rank killed by
# SIGKILL while the forkserver lives, blamed as a RankCrash of that rank, no launcher named.
@pytest.mark.slow
def test_a_rank_that_kills_itself_is_still_blamed_as_that_rank():
    """The twin: the forkserver lives, rank 1 dies by SIGKILL on its own: a RankCrash of
    rank 1, named by its signal, and no launcher named."""
    out = _launcher_fault("rank")
    assert re.search(r"RAISED RankCrash rank=1 launcher=None forkserver=\d+", out), out
    assert re.search(r"rank 1 crashed during task wait_or_die at t=2: killed by SIGKILL "
                     r"\(pid \d+\)", out), out
    assert "forkserver process" not in out and "AGAIN [0, 1]" in out

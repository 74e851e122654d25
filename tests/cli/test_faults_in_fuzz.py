"""A rank fault during ``wsb fuzz`` / ``wsb mutants`` over gloo is a harness fault, not a
counterexample: not shrunk, not a property failure, nothing in the corpus; it is reported
typed (rank, signal or stop, breadcrumb), the pool restarts, the run goes on and ends with
its summary and exit 3.

The fault is armed on the shared rank pool the run's forward uses (``RankPool.arm``): the
first task of the run carries it. The fuzz shrinks toward t=1, so the first example runs on
rank 0 alone, which is the rank the fault hits.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.breadth import breadth
from weight_sync_bench.cli import main
from weight_sync_bench.collectives.gloo.breadcrumbs import Fault
from weight_sync_bench.collectives.gloo.pool import shared_pool


@pytest.fixture
def pool(tmp_path, monkeypatch):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path / "corpus"))
    p = shared_pool(4)
    p.start()
    yield p
    shared_pool(4, deadline=60.0)  # --deadline below set the shared pool's; put it back


def _run(argv, capsys):
    start = time.monotonic()
    code = main(argv)
    return code, capsys.readouterr(), time.monotonic() - start


# wsb fuzz by default, wsb mutants in the long run: both run through cli.fuzz's one
# _run_fuzz and _finish over fuzz.runner, which turns the rank fault into a harness fault
@pytest.mark.parametrize("command", breadth(["fuzz", "mutants"], keep={"fuzz"}))
def test_a_killed_rank_is_a_harness_fault_and_the_run_goes_on(pool, tmp_path, capsys, command):
    starts = pool.starts
    pool.arm(Fault("kill", rank=0, phase="forward", index=3))
    code, out, elapsed = _run([command, "--phase", "1b", "--examples", "3", "--seed", "1",
                               "--mutation", "o_proj_reversed"], capsys)
    assert code == 3, out.out + out.err
    assert ("HARNESS FAULT (not a counterexample: not shrunk, not written to the corpus; the "
            "rank pool restarts on its next task): RankCrash during ") in out.out
    assert "rank 0 killed by SIGKILL; breadcrumb: forward: after collective #" in out.out
    assert "0 failures, 1 harness faults" in out.out  # the summary, not a lost report
    assert "Traceback" not in out.err and "FlakyFailure" not in out.out + out.err
    assert pool.starts == starts + 1  # restarted once, and the run went on over it
    assert "corpus:" in out.out and not (tmp_path / "corpus").exists()
    assert elapsed < 30


def test_a_stopped_rank_is_named_stopped_within_the_deadline(pool, tmp_path, capsys):
    pool.arm(Fault("stop", rank=0, phase="forward", index=3))
    code, out, elapsed = _run(["fuzz", "--phase", "1b", "--examples", "2", "--seed", "1",
                               "--mutation", "o_proj_reversed", "--deadline", "1", "--json"],
                              capsys)
    assert code == 3
    records = [json.loads(line) for line in out.out.splitlines()]
    (fault,) = [r for r in records if r["kind"] == "harness_fault"]
    assert (fault["type"], fault["rank"], fault["how"]) == ("RankStopped", 0,
                                                           "stopped (process state T)")
    assert fault["breadcrumb"].startswith("forward: inside collective #")
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["exit_code"] == 3
    assert summary["harness_faults"] == 1 and summary["failures"] == 0
    assert summary["examples"] >= 2 and summary["new_entries"] == []  # it went on: the budget ran
    assert not (tmp_path / "corpus").exists()
    assert elapsed < 1 + 20


def test_without_a_fault_the_same_run_passes(pool, capsys):
    """The twin: the exit 3 above is the fault's, not the run's."""
    code, out, _ = _run(["fuzz", "--phase", "1b", "--examples", "2", "--seed", "1",
                         "--mutation", "o_proj_reversed"], capsys)
    assert code == 0 and "0 failures, 0 harness faults" in out.out

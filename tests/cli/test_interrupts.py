"""Ctrl-C during check, fuzz or mutants prints the partial summary and exits 130 with no
traceback; SIGTERM exits 143 the same way; either way the ranks end and the pool's
temporary directories (``wsb-ranks-*``, multiprocessing's ``pymp-*``) are removed.

In process, Ctrl-C is a ``KeyboardInterrupt`` raised at a known point (by the user's
resharder, or by a SIGALRM handler). Out of process, a real signal reaches a real ``wsb``
with a private TMPDIR: SIGINT to the whole process group, as a terminal sends it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.breadth import breadth
from weight_sync_bench.cli import main


def test_ctrl_c_during_check_prints_what_ran_and_exits_130(tmp_path, monkeypatch, capsys):
    (tmp_path / "flaky_user.py").write_text(textwrap.dedent("""
        from weight_sync_bench import TOY, layout_for, reshard
        calls = []

        def second_call_interrupted(shards, dst):
            calls.append(dst)
            if len(calls) == 2:
                raise KeyboardInterrupt  # Ctrl-C, while the user's code runs
            return reshard(shards, layout_for(TOY), dst)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["check", "--config", "toy", "--resharder", "flaky_user:second_call_interrupted"])
    out, err = capsys.readouterr()
    assert code == 130
    assert out.count("PASS") == 1  # the one check that ran, in the table
    assert ("interrupted after 1 of 4 checks: 1 passed, 0 failed; not run: toy 1 -> 2, "
            "toy 2 -> 1, toy 2 -> 2") in out
    assert "Traceback" not in err


def _interrupt_after(seconds):
    """SIGINT to this process after ``seconds``, through the handler ``wsb`` installs."""
    def handler(signum, frame):
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return previous


# fuzz by default, mutants in the long run: both close through cli.fuzz's one interrupted
# summary; by default mutants' Ctrl-C path (a table of what ran, exit 130) is
# test_a_ctrl_c_while_the_progress_line_is_drawn_still_prints_what_ran's
@pytest.mark.parametrize(("argv", "header"), breadth([
    (["fuzz", "--minutes", "5", "--chunk", "2"], "property"),
    (["mutants", "--examples", "100000", "--chunk", "2"], "mutation"),
], keep={"fuzz"}, name=lambda case: case[0][0]))
def test_ctrl_c_during_fuzz_or_mutants_prints_the_partial_summary(argv, header, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    # SIGINT 0.3 s after the first progress line, not after a time from the start: on a
    # loaded machine the start-up alone (imports, the floor's notes) can take longer, and a
    # Ctrl-C before any property ran has nothing to summarise
    from weight_sync_bench.cli import fuzz as cli_fuzz

    armed, previous = [], signal.getsignal(signal.SIGALRM)
    real = cli_fuzz.pending_interrupt

    def first_progress_arms():
        if not armed:
            armed.append(_interrupt_after(0.3))
        return real()

    monkeypatch.setattr(cli_fuzz, "pending_interrupt", first_progress_arms)
    try:
        start = time.monotonic()
        code = main([*argv, "--seed", "3"])
        elapsed = time.monotonic() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    # interrupted, not run to its budget (5 minutes, or 100,000 examples): ~1-2 s when idle;
    # 60 s is thirty times that and a fifth of the budget
    assert armed and code == 130 and elapsed < 60, err
    assert out.splitlines()[0].split()[0] == header  # the closing table, of what ran
    assert f"corpus: {tmp_path} (0 new entries)" in out
    assert "interrupted (KeyboardInterrupt): a partial run, not the whole budget" in out
    assert "interrupted: the summary above covers the" in out
    assert "Traceback" not in err


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (our private TMPDIR)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(pid))
    return found


@pytest.mark.parametrize(("signum", "group", "code"), [
    # Ctrl-C in a terminal: every process of the group (6 s; the long run: by default the
    # same ranks end on SIGTERM, and SIGINT's path is test_ctrl_c_during_check_prints_what_ran_and_exits_130)
    pytest.param(signal.SIGINT, True, 130, id="SIGINT-to-group", marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, False, 143, id="SIGTERM"),  # a job runner stopping wsb
])
def test_a_signal_during_a_gloo_check_ends_the_ranks_and_leaves_no_temporary_files(
        tmp_path, signum, group, code):
    # short: multiprocessing's forkserver socket lives under it (AF_UNIX paths are <= 107 bytes)
    private = Path(tempfile.mkdtemp(prefix="wsb-sig-", dir="/tmp"))
    stdout, stderr = tmp_path / "out", tmp_path / "err"
    env = {**os.environ, "TMPDIR": str(private), "OMP_NUM_THREADS": "1"}
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "weight_sync_bench", "check", "--backend",
                                 "gloo", "--config", "all"], env=env, stdout=out, stderr=err,
                                start_new_session=True)
    try:
        give_up = time.monotonic() + 60
        while not list(private.glob("wsb-ranks-*/rank*.log")):  # a rank process is running
            assert proc.poll() is None and time.monotonic() < give_up, stderr.read_text()
            time.sleep(0.05)
        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        sent = time.monotonic()
        assert proc.wait(timeout=30) == code
        assert time.monotonic() - sent < 10
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        leftover = list(private.iterdir())
        shutil.rmtree(private, ignore_errors=True)
    assert "interrupted after" in stdout.read_text()
    assert "Traceback" not in stderr.read_text(), stderr.read_text()
    assert leftover == []  # no wsb-ranks-*, no pymp-*
    give_up = time.monotonic() + 10  # the forkserver leaves once its owner has gone
    while _processes_with(str(private)) and time.monotonic() < give_up:
        time.sleep(0.1)
    left = _processes_with(str(private))
    assert left == [], [(pid, Path(f"/proc/{pid}/stat").read_text()[:80],
                         Path(f"/proc/{pid}/cmdline").read_bytes()[:120]) for pid in left]


def test_a_ctrl_c_while_the_progress_line_is_drawn_still_prints_what_ran(tmp_path, monkeypatch,
                                                                         capsys):
    """The interrupt lands in ``wsb fuzz``'s own loop, not in the run: it is thrown into the
    run, which reports what ran (the table), exit 130. Its twin: the line drawn without one
    lets the run go to its budget."""
    from weight_sync_bench.cli.output import ProgressLine

    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    real, shown = ProgressLine.show, []

    def interrupted(self, text):
        shown.append(text)
        if len(shown) == 2:
            raise KeyboardInterrupt
        return real(self, text)

    monkeypatch.setattr(ProgressLine, "show", interrupted)
    argv = ["mutants", "--examples", "2", "--chunk", "1", "--seed", "3", "--mutation",
            "contiguous_qkv", "--mutation", "kv_swapped"]
    assert main(argv) == 130
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[0] == "mutation" and "interrupted" in out
    shown.clear()
    monkeypatch.setattr(ProgressLine, "show", lambda self, text: shown.append(text))
    assert main(argv) == 0 and len(shown) > 2  # the twin

"""The CLI's exit paths (issue 30, the mutation pass over ``cli/main.py``'s ``exit_code``,
``run``, ``cmd_check``, ``program`` and ``main``, and ``cli/output.py``): how each command's
outcome becomes an exit code, a message on stderr and the ``--json`` records, and what
``wsb check`` prints and returns for each mix of passing, failing, skipped and interrupted
checks.

An exit code taken from the wrong check, a tally that miscounts, an error that prints no
record, or a progress line that swallows the last state would each make CI read a run wrongly.
Here the checks are stood in (``_plan`` hands back prepared verdicts), so each test decides
exactly what ran and checks every line and record."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from weight_sync_bench.check.checker import format_verdicts
from weight_sync_bench.check.verdict import Verdict
from weight_sync_bench.cli import output as O
from weight_sync_bench.cli.records import verdict_record
from weight_sync_bench.errors import (
    ArtifactProtected,
    InvalidShards,
    MissingArtifacts,
    PeerAborted,
    RankFailure,
    ToleranceMismatch,
    UserCodeError,
    WsbError,
)
from weight_sync_bench.model.footprint import GIB, Limits

M = importlib.import_module("weight_sync_bench.cli.main")  # the package exports main()

PASS = Verdict(config="toy", src=2, dst=1, max_abs_error=0.0, threshold=1e-3,
               first_mismatch=None)
FAIL = Verdict(config="toy", src=1, dst=2, max_abs_error=0.5, threshold=1e-3,
               first_mismatch="layers.0.qkv.weight")


# ---- the exit-code contract -----------------------------------------------------------------

def test_each_exception_maps_to_its_exit_code():
    assert M.exit_code(KeyboardInterrupt()) == 130
    assert M.exit_code(O.Terminated("SIGTERM")) == 143
    assert M.exit_code(UserCodeError("x", role="converter", function="m:f")) == 4
    assert M.exit_code(InvalidShards("x")) == 4
    assert M.exit_code(RankFailure("x")) == 3
    assert M.exit_code(PeerAborted("x")) == 3
    assert M.exit_code(MissingArtifacts("x")) == 3
    assert M.exit_code(ToleranceMismatch("x")) == 2
    assert M.exit_code(WsbError("x")) == 2
    assert M.exit_code(ValueError("x")) == 3
    assert (O.EXIT_OK, O.EXIT_FAILED, O.EXIT_USAGE, O.EXIT_HARNESS, O.EXIT_USER_CODE) == (
        0, 1, 2, 3, 4)
    assert (O.EXIT_INTERRUPTED, O.EXIT_TERMINATED, O.EXIT_BROKEN_PIPE) == (130, 143, 141)
    assert O.interrupt_code(KeyboardInterrupt()) == 130
    assert O.interrupt_code(O.Terminated()) == 143


def namespace(**kw):
    return argparse.Namespace(**{"json": False, "quiet": False, "command": "check", **kw})


def raising(exc):
    def func(args):
        raise exc
    return func


def test_run_returns_what_the_command_returns_and_says_nothing(capsys):
    assert M.run(lambda args: 1, namespace(), "wsb check") == 1
    assert M.run(lambda args: 0, namespace(), "wsb check") == 0
    assert capsys.readouterr() == ("", "")


def test_run_turns_a_typed_error_into_one_line_and_its_code(capsys):
    error = ToleranceMismatch("no floor covers it")
    error.add_note("measure it with: wsb floor geometry")
    error.add_note("or narrow the domain")
    assert M.run(raising(error), namespace(), "wsb check") == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("wsb check: no floor covers it\nmeasure it with: wsb floor geometry\n"
                   "or narrow the domain\n")
    assert M.run(raising(UserCodeError("your f broke", role="resharder", function="m:f")),
                 namespace(), "wsb (rank 1 of 2) check") == 4
    assert capsys.readouterr().err == "wsb (rank 1 of 2) check: your f broke\n"


def test_run_prints_a_harness_bugs_traceback(capsys):
    import traceback

    bug = ZeroDivisionError("oops")
    assert M.run(raising(bug), namespace(), "wsb check") == 3
    err = capsys.readouterr().err
    assert err == ("wsb check: internal error, a bug of the harness (exit 3):\n"
                   + "".join(traceback.format_exception(bug)).rstrip() + "\n")
    assert err.endswith("ZeroDivisionError: oops\n")


@pytest.mark.parametrize("exc, code, said", [
    (KeyboardInterrupt(), 130, "interrupted (SIGINT)"),
    (O.Terminated("SIGTERM"), 143, "interrupted (SIGTERM)")])
def test_run_says_how_it_was_interrupted(capsys, exc, code, said):
    assert M.run(raising(exc), namespace(), "wsb fuzz") == code
    assert capsys.readouterr().err == f"wsb fuzz: {said}\n"


def test_under_json_an_error_is_a_record_too(capsys):
    assert M.run(raising(WsbError("bad input")), namespace(json=True, command="fuzz"),
                 "wsb fuzz") == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"kind": "error", "command": "fuzz", "exit_code": 2,
                               "type": "WsbError", "message": "bad input"}
    assert err == "wsb fuzz: bad input\n"
    M.run(raising(KeyboardInterrupt()), namespace(json=True), "wsb check")
    assert json.loads(capsys.readouterr().out)["exit_code"] == 130


class Stdout:
    """A stdout whose file descriptor is 42, and that keeps what is written."""

    def __init__(self):
        self.written = []

    def fileno(self):
        return 42

    def write(self, text):
        self.written.append(text)

    def flush(self):
        pass


def test_a_reader_that_leaves_ends_the_run_quietly(monkeypatch, capsys):
    moved = []
    stdout = Stdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(os, "open", lambda path, flags: moved.append((path, flags)) or 99)
    monkeypatch.setattr(os, "dup2", lambda a, b: moved.append((a, b)))
    assert M.run(raising(BrokenPipeError()), namespace(json=True), "wsb check") == 141
    assert moved == [(os.devnull, os.O_WRONLY), (99, 42)]
    assert stdout.written == [] and capsys.readouterr().err == ""


def test_a_command_runs_under_its_own_deadline_and_signal_handlers(monkeypatch):
    from weight_sync_bench.check import user_code

    seen = []

    def func(args):
        seen.append((user_code._DEADLINE[0], signal.getsignal(signal.SIGTERM)))
        return 0

    user_code.set_deadline(30.0)
    before = signal.getsignal(signal.SIGTERM)
    try:
        M.run(func, namespace(), "wsb check")
        assert user_code._DEADLINE[0] == 30.0  # put back after the command
    finally:
        user_code.set_deadline(None)
    [(during, handler)] = seen
    assert during is None and handler is not before and callable(handler)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_program_names_its_rank_under_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert M.program() == "wsb"
    monkeypatch.setenv("RANK", "1")
    assert M.program() == "wsb"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert M.program() == "wsb (rank 1 of 4)"
    monkeypatch.setenv("RANK", "")
    assert M.program() == "wsb"


def test_main_runs_the_command_under_its_name_and_strict_env_only_while_it_runs(monkeypatch):
    seen = []

    def fake_run(func, args, prog):
        seen.append((func, args.command, prog, os.environ.get("WSB_STRICT_ENV")))
        return 7

    monkeypatch.setattr(M, "run", fake_run)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WSB_STRICT_ENV", raising=False)
    assert M.main(["layout", "--config", "toy"]) == 7
    assert seen[-1] == (M.cmd_layout, "layout", "wsb layout", None)
    assert M.main(["check", "--strict-env"]) == 7
    assert seen[-1][1:] == ("check", "wsb check", "1")
    assert seen[-1][0] is M._parser("wsb").parse_args(["check"]).func
    assert "WSB_STRICT_ENV" not in os.environ
    monkeypatch.setenv("WSB_STRICT_ENV", "0")
    M.main(["check", "--strict-env"])
    assert seen[-1][3] == "1" and os.environ["WSB_STRICT_ENV"] == "0"
    M.main(["check"])
    assert seen[-1][3] == "0"
    import torch
    torch.set_num_threads(2)
    M.main(["check"])
    assert torch.get_num_threads() == 1


def test_main_puts_strict_env_back_when_the_command_raises(monkeypatch):
    def boom(func, args, prog):
        raise RuntimeError("escaped")

    monkeypatch.setattr(M, "run", boom)
    monkeypatch.setenv("WSB_STRICT_ENV", "prior")
    with pytest.raises(RuntimeError):
        M.main(["check", "--strict-env"])
    assert os.environ["WSB_STRICT_ENV"] == "prior"


# ---- wsb check ------------------------------------------------------------------------------

class Jobs:
    """``_plan`` stood in: the jobs as (label, verdict or exception) and the skipped notes."""

    def __init__(self, monkeypatch, rows, skipped=()):
        self.ran, self.progress = [], []

        def job(label, what):
            def run(progress):
                self.ran.append(label)
                self.progress.append(progress)
                if isinstance(what, BaseException):
                    raise what
                if callable(what):
                    return what()
                return what
            return run

        self.jobs = [(label, job(label, what)) for label, what in rows]

        def plan(args, line):
            assert isinstance(line, O.ProgressLine)  # planning shows its progress
            return self.jobs, list(skipped)

        monkeypatch.setattr(M, "_plan", plan)


def check(*argv):
    return M.main(["check", *argv])


def test_check_exits_1_when_a_later_check_fails_and_names_it(monkeypatch, capsys):
    jobs = Jobs(monkeypatch, [("toy 1 -> 2", PASS), ("toy 2 -> 1", PASS), ("toy 1 -> 4", FAIL)])
    assert check() == 1
    out = capsys.readouterr().out
    assert jobs.ran == ["toy 1 -> 2", "toy 2 -> 1", "toy 1 -> 4"]
    assert out == "\n".join([format_verdicts([PASS, PASS, FAIL]), M.FORWARD_LEGEND, "",
                             str(FAIL), "", "2 passed, 1 failed", ""])


def test_check_exits_0_when_every_check_passes(monkeypatch, capsys):
    Jobs(monkeypatch, [("a", PASS), ("b", PASS)], skipped=["toy_kv4: t=8 not supported"])
    assert check() == 0
    out = capsys.readouterr().out
    assert out == "\n".join([format_verdicts([PASS, PASS]), M.FORWARD_LEGEND,
                             "toy_kv4: t=8 not supported", "", "2 passed, 0 failed", ""])


def test_quiet_check_prints_the_failures_and_the_tally_only(monkeypatch, capsys):
    Jobs(monkeypatch, [("a", FAIL), ("b", PASS)], skipped=["skipped one"])
    assert check("-q") == 1
    assert capsys.readouterr().out == "\n".join(
        ["skipped one", "", str(FAIL), "", "1 passed, 1 failed", ""])


def test_check_json_is_a_record_per_check_then_the_summary(monkeypatch, capsys):
    Jobs(monkeypatch, [("a", PASS), ("b", FAIL)], skipped=["s"])
    assert check("--json") == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records == [
        json.loads(json.dumps(O._plain({"kind": "check", **verdict_record(PASS)}))),
        json.loads(json.dumps(O._plain({"kind": "check", **verdict_record(FAIL)}))),
        {"kind": "summary", "command": "check", "exit_code": 1, "checks": 2, "ran": 2,
         "passed": 1, "failed": 1, "interrupted": False, "skipped": ["s"]}]


def test_check_with_nothing_to_run_is_refused_naming_why(monkeypatch, capsys):
    Jobs(monkeypatch, [], skipped=["toy: t=3 not supported", "toy_kv4: t=3 not supported"])
    assert check() == 2
    assert capsys.readouterr().err == (
        "wsb check: no config supports the requested degrees:\n"
        "  toy: t=3 not supported\n  toy_kv4: t=3 not supported\n")


@pytest.mark.parametrize("exc, code, said", [
    (KeyboardInterrupt(), 130, "SIGINT"), (O.Terminated("SIGTERM"), 143, "SIGTERM")])
def test_an_interrupted_check_reports_what_ran_and_what_did_not(monkeypatch, capsys, exc, code,
                                                               said):
    jobs = Jobs(monkeypatch, [("a", PASS), ("b", FAIL), ("c", exc), ("d", PASS)])
    assert check() == code
    out = capsys.readouterr().out
    assert jobs.ran == ["a", "b", "c"]
    assert out == "\n".join([format_verdicts([PASS, FAIL]), M.FORWARD_LEGEND, "", str(FAIL), "",
                             "interrupted after 2 of 4 checks: 1 passed, 1 failed; not run: "
                             "c, d", ""])
    Jobs(monkeypatch, [("a", PASS), ("b", FAIL), ("c", exc)])
    assert check("--json") == code
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary == {"kind": "summary", "command": "check", "exit_code": code, "checks": 3,
                       "ran": 2, "passed": 1, "failed": 1, "interrupted": True, "skipped": []}


def test_an_interrupt_whose_raise_was_swallowed_still_stops_the_check(monkeypatch, capsys):
    pending = []
    monkeypatch.setattr(M, "pending_interrupt", lambda: pending[0] if pending else None)

    def second():
        pending.append(KeyboardInterrupt())
        return PASS

    jobs = Jobs(monkeypatch, [("a", PASS), ("b", second), ("c", PASS)])
    assert check() == 130
    assert jobs.ran == ["a", "b"]
    assert "interrupted after 2 of 3 checks: 2 passed, 0 failed; not run: c" in \
        capsys.readouterr().out


def test_an_interrupt_before_any_check_prints_no_table(monkeypatch, capsys):
    Jobs(monkeypatch, [("a", KeyboardInterrupt())])
    assert check() == 130
    assert capsys.readouterr().out == (
        "\ninterrupted after 0 of 1 checks: 0 passed, 0 failed; not run: a\n")


def test_check_refuses_meaningless_option_mixes_before_planning(monkeypatch, capsys):
    monkeypatch.setattr(M, "_plan", lambda args, line: pytest.fail("planned"))
    assert check("--splitter", "m:f", "--src", "2") == 2
    assert capsys.readouterr().err == (
        "wsb check: --src has no meaning with --splitter (a split starts from the full model); "
        "give --dst\n")
    assert check("--converter", "m:f", "--from", "megatron:2", "--to", "vllm:1", "--stream",
                 "layer", "--backend", "gloo") == 2
    assert capsys.readouterr().err == (
        "wsb check: --stream layer streams a conversion in this process only (phase 1a): a "
        "streamed --converter check over --backend gloo is not built; drop one of them\n")


def test_check_applies_its_deadline_and_notes_an_automatic_stream(monkeypatch, capsys):
    applied = []
    monkeypatch.setattr(M, "apply_deadline", lambda d, gloo: applied.append((d, gloo)))

    def plan(args, line):
        args.auto_stream = "streamed per layer: the model does not fit"
        return [("a", lambda progress: PASS)], []

    monkeypatch.setattr(M, "_plan", plan)
    assert check("--deadline", "5") == 0
    assert applied == [(5.0, False)]
    assert capsys.readouterr().out.startswith(
        "note: streamed per layer: the model does not fit\n")
    check("--backend", "gloo")
    assert applied[-1] == (None, True)


def test_a_streamed_checks_stages_are_shown_on_a_terminal_only(monkeypatch):
    handed = []

    def job(progress):
        handed.append(progress)
        if progress is not None:
            progress("stage 1/3")
        return PASS

    monkeypatch.setattr(M, "_plan", lambda args, line: ([("a", job)], []))
    shown = []
    monkeypatch.setattr(O.ProgressLine, "show", lambda self, text: shown.append(text))
    check("--stream", "layer")
    assert handed == [None]  # not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    check()
    assert handed[-1] is None  # not streamed
    check("--stream", "layer")
    assert callable(handed[-1])
    assert shown[-2:] == ["check 1/1: a (inprocess)", "check 1/1: a (inprocess): stage 1/3"]


def test_the_progress_line_names_each_check(monkeypatch, capsys):
    Jobs(monkeypatch, [("toy 1 -> 2", PASS), ("toy 2 -> 1", PASS)])
    shown = []
    real = O.ProgressLine.show
    monkeypatch.setattr(O.ProgressLine, "show", lambda self, text: shown.append(text)
                        or real(self, text))
    check("--backend", "inprocess")
    assert shown == ["check 1/2: toy 1 -> 2 (inprocess)", "check 2/2: toy 2 -> 1 (inprocess)"]


# ---- output ---------------------------------------------------------------------------------

def test_output_reads_its_mode_from_the_arguments(capsys):
    out = O.Output(argparse.Namespace())
    assert (out.json, out.quiet, out.command) == (False, False, "wsb")
    assert O.Output(argparse.Namespace(command=None)).command == "wsb"
    out = O.Output(argparse.Namespace(json=True, quiet=True, command="fuzz"))
    assert (out.json, out.quiet, out.command) == (True, True, "fuzz")
    assert out.progress().enabled is False and O.Output(namespace()).progress().enabled


def test_text_prints_unless_json_and_records_print_only_under_json(capsys):
    text = O.Output(namespace())
    text.text("hello")
    text.text()
    text.note("judged by the committed floor")
    text.record("note", text="x")
    assert capsys.readouterr().out == "hello\n\nnote: judged by the committed floor\n"
    js = O.Output(namespace(json=True, command="check"))
    js.text("hidden")
    js.note("n")
    js.record("note", text=math.inf)
    js.summary(0, checks=1, ran=1, passed=1, failed=0, interrupted=False, skipped=[])
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines[:2]] == [{"kind": "note", "text": "n"},
                                                        {"kind": "note", "text": "inf"}]
    assert json.loads(lines[2])["kind"] == "summary" and json.loads(lines[2])["exit_code"] == 0


def test_a_record_must_carry_exactly_its_kinds_keys(capsys):
    for out in (O.Output(namespace()), O.Output(namespace(json=True))):
        with pytest.raises(AssertionError) as exc:
            out.record("note", text="x", extra=1)
        assert exc.value.args == (("note", ["extra"]),)  # names the keys that differ
        with pytest.raises(AssertionError):
            out.record("note")
        with pytest.raises(AssertionError):
            out.summary(0, checks=1)  # a check summary's other keys missing


def test_json_has_no_nan_or_inf_and_paths_are_text():
    assert O._plain(math.nan) == "nan" and O._plain(-math.inf) == "-inf"
    assert O._plain({"a": [1.5, math.inf, (Path("/x"), None)], "b": {"c": math.nan}}) == {
        "a": [1.5, "inf", ["/x", None]], "b": {"c": "nan"}}
    assert O._plain(3) == 3 and O._plain("s") == "s" and O._plain(True) is True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_progress_line_into_a_log_shows_the_first_then_one_a_period_then_the_last(capsys):
    clock = Clock()
    clock.now = 100.0
    line = O.ProgressLine(period=10.0, clock=clock)
    assert not line.live and O.ProgressLine().period == O.LOG_PERIOD == 10.0
    line.show("one")
    clock.now = 105.0
    line.show("two")
    line.show("three")
    clock.now = 110.0
    line.show("four")
    clock.now = 112.0
    line.show("five")
    assert capsys.readouterr().err == "one\nfour\n"  # five waits for the period, or close
    line.close()
    line.close()
    assert capsys.readouterr().err == "five\n"
    quiet = O.ProgressLine(enabled=False, clock=clock)
    quiet.show("x")
    quiet.close()
    assert capsys.readouterr().err == ""


def test_a_progress_line_on_a_terminal_is_rewritten_in_place(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    clock = Clock()
    line = O.ProgressLine(clock=clock)
    assert line.live and line.period == O.LIVE_PERIOD == 0.1
    line.show("longer text")
    clock.now = 1.0
    line.show("short")
    line.close()
    assert capsys.readouterr().err == "\rlonger text\rshort      \n"
    line.close()  # nothing shown since: no second newline
    assert capsys.readouterr().err == ""
    clock.now = 2.0
    line.show("again")  # a line closed starts afresh
    assert capsys.readouterr().err == "\ragain"
    O.ProgressLine(clock=clock).close()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-3, "0s"), (59.4, "59s"), (59.6, "1m00s"), (61, "1m01s"), (600, "10m00s"),
    (3599, "59m59s"), (3600, "1h00m"), (3661, "1h01m"), (36000 + 59 * 60, "10h59m")])
def test_durations(seconds, text):
    assert O.duration(seconds) == text


def test_a_ticker_shows_what_it_is_at_with_elapsed_time_and_eta(capsys):
    clock = Clock()
    clock.now = 100.0
    ticker = O.Ticker(O.ProgressLine(period=0.0, clock=clock), "measuring ", clock=clock)
    ticker(0, 4, "toy seed 0")
    clock.now = 130.0
    ticker(1, 4, "toy seed 1")
    ticker(2, 4, "toy seed 2")
    O.Ticker(O.ProgressLine(period=0.0, clock=clock), clock=clock)(2, 2, "done")
    assert capsys.readouterr().err.splitlines() == [
        "measuring toy seed 0: 0/4, 0s elapsed, ETA ?",
        "measuring toy seed 1: 1/4, 30s elapsed, ETA 1m30s",
        "measuring toy seed 2: 2/4, 30s elapsed, ETA 30s",
        "done: 2/2, 0s elapsed, ETA 0s"]


# ---- argument types and limits --------------------------------------------------------------

def refusal(parse, text):
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse(text)
    return str(exc.value)


def test_the_argument_types_refuse_by_name():
    assert O.count("3") == 3 and O.count("1") == 1
    assert refusal(O.count, "0") == "must be > 0, got 0"
    assert refusal(O.count, "x") == "expected an int, got 'x'"
    assert O.rank("0") == 0
    assert refusal(O.rank, "-1") == "a rank is >= 0, got -1"
    assert refusal(O.rank, "1.5") == "expected an int, got '1.5'"
    assert O.positive("0.5") == 0.5
    for bad in ("0", "-1", "nan", "inf"):
        assert refusal(O.positive, bad) == f"must be > 0 and finite, got {bad}"
    assert refusal(O.positive, "x") == "expected a number, got 'x'"
    assert O.seed("0") == 0 and O.seed(str(2**63 - 1)) == 2**63 - 1
    for bad in ("-1", str(2**63), "x"):
        assert refusal(O.seed, bad) == f"must be an int in 0..2^63-1, got {bad}"


def test_the_limits_are_the_options():
    assert O.limits_of(argparse.Namespace(max_gib=None, max_gflop=2.0)) == Limits(
        max_flops=2e9)
    assert O.limits_of(argparse.Namespace(max_gib=1.5, max_gflop=3.0)) == Limits(
        max_bytes=int(1.5 * GIB), max_flops=3e9)


def test_a_deadline_bounds_the_users_function_and_on_gloo_the_pool(monkeypatch):
    from weight_sync_bench.check import user_code
    from weight_sync_bench.collectives.gloo import pool

    set_, pools = [], []
    monkeypatch.setattr(user_code, "set_deadline", set_.append)
    monkeypatch.setattr(pool, "shared_pool", lambda n, *, deadline: pools.append((n, deadline)))
    O.apply_deadline(None, True)
    assert set_ == [] and pools == []
    O.apply_deadline(5.0, False)
    assert set_ == [5.0] and pools == []
    O.apply_deadline(7.0, True)
    assert set_ == [5.0, 7.0] and pools == [(4, 7.0)]


# ---- signals ---------------------------------------------------------------------------------

def test_sigterm_inside_raises_terminated_and_is_remembered(monkeypatch):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert O.pending_interrupt() is None
    with pytest.raises(O.Terminated):
        with O.signals_raise():
            assert O.pending_interrupt() is None
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode
                for _ in range(1000):
                    pass
            finally:
                pending = O.pending_interrupt()
    assert isinstance(pending, O.Terminated)
    assert O.pending_interrupt() is None  # forgotten once the run is over
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    with pytest.raises(KeyboardInterrupt) as info:
        with O.signals_raise():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
    assert not isinstance(info.value, O.Terminated)


def test_signals_outside_the_main_thread_are_left_alone():
    seen = []

    def body():
        with O.signals_raise():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before]


# ---- measuring commands never silently replace a committed artifact ------------------------

def test_a_committed_artifact_is_replaced_only_when_asked(tmp_path):
    target = tmp_path / "phase1a.json"
    with pytest.raises(ArtifactProtected) as exc:
        O.guard_target(target, named=False, write=False, command="wsb floor phase")
    assert str(exc.value) == (f"wsb floor phase: would replace the committed {target}: pass "
                              "--write to replace it, or --out PATH to write the measurement "
                              "elsewhere")
    assert O.guard_target(target, named=False, write=True, command="c") is None
    target.write_text('{"cells": 3}')
    assert O.guard_target(target, named=True, write=False, command="c") == {"cells": 3}
    target.write_text("[1]")
    assert O.guard_target(target, named=True, write=False, command="c") is None
    target.write_text("{broken")
    assert O.guard_target(target, named=True, write=False, command="c") is None
    target.unlink()
    target.mkdir()
    assert O.guard_target(target, named=True, write=False, command="c") is None


def test_a_smaller_measurement_replaces_a_larger_one_only_with_force(tmp_path):
    target = tmp_path / "random_floor_1a.json"
    with pytest.raises(ArtifactProtected) as exc:
        O.refuse_smaller(target, old=1000, new=999, what="samples", force=False)
    assert str(exc.value) == (f"{target} holds 1000 samples; this measurement would have 999: "
                              "pass --force to replace a larger measurement with a smaller one "
                              "(or --out PATH)")
    O.refuse_smaller(target, old=1000, new=999, what="samples", force=True)
    O.refuse_smaller(target, old=1000, new=1000, what="samples", force=False)


def test_the_side_by_side_table_aligns_three_columns():
    assert O.side_by_side([("worst", "1e-06", "2e-06"), ("samples", "1000", "12")],
                          "committed", "new") == (
        "         committed  new\n"
        "worst    1e-06      2e-06\n"
        "samples  1000       12")


# ---- what the first pass left ---------------------------------------------------------------

def test_a_converter_check_is_refused_only_when_streamed_over_gloo(monkeypatch):
    jobs = Jobs(monkeypatch, [("a", PASS)])
    for argv in (["--backend", "gloo"], ["--stream", "layer"], []):
        assert check("--converter", "m:f", "--from", "megatron:2", "--to", "vllm:1",
                     *argv) == 0, argv
    assert check("--stream", "layer", "--backend", "gloo") == 0  # not a conversion
    assert check("--src", "2", "--dst", "1") == 0  # a reshard has a source
    assert check("--splitter", "m:f", "--dst", "2") == 0
    assert jobs.ran == ["a"] * 6


@pytest.fixture
def printed(monkeypatch):
    """Every print of the CLI's two printing modules, with its keywords."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        print(*args, **kwargs)

    monkeypatch.setattr(M, "print", spy, raising=False)
    monkeypatch.setattr(O, "print", spy, raising=False)
    return calls


def test_every_line_is_flushed_as_it_is_printed(printed, monkeypatch, capsys):
    """A reader of a pipe (CI, ``| tee``) sees each line, record and error when it happens."""
    Jobs(monkeypatch, [("a", PASS)])
    check()
    check("--json")
    M.run(raising(WsbError("bad")), namespace(), "wsb check")
    line = O.ProgressLine(period=0.0)
    line.show("progress")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    live = O.ProgressLine(period=0.0)
    live.show("on a terminal")
    assert len(printed) > 5 and all(kw.get("flush") is True for _, kw in printed)


def test_usage_errors_name_the_program(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        M.main(["check", "--seed", "x"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("usage: wsb check ")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        M.main(["check", "--seed", "x"])
    assert capsys.readouterr().err.startswith("usage: wsb (rank 1 of 2) check ")


def test_strict_env_is_put_back_even_if_the_command_cleared_it(monkeypatch):
    def clears(func, args, prog):
        os.environ.pop("WSB_STRICT_ENV")
        return 0

    monkeypatch.setattr(M, "run", clears)
    monkeypatch.delenv("WSB_STRICT_ENV", raising=False)
    assert M.main(["check", "--strict-env"]) == 0
    assert "WSB_STRICT_ENV" not in os.environ


def test_the_shared_options_read_as_documented():
    """``-q``, ``--json``, ``--strict-env``, ``--max-gib``, ``--max-gflop`` and ``--deadline``:
    their flags, types, defaults and help, as every subcommand shows them."""
    parser = argparse.ArgumentParser()
    O.add_output_options(parser)
    O.add_limit_options(parser)
    O.add_deadline_option(parser)
    got = {a.dest: (a.option_strings, a.type, a.default, a.metavar, a.help)
           for a in parser._actions if a.dest != "help"}
    from weight_sync_bench.model.footprint import DEFAULT_MAX_FLOPS
    gflop = DEFAULT_MAX_FLOPS / 1e9
    assert got == {
        "quiet": (["-q", "--quiet"], None, False, None,
                  "no progress line; print failures and the closing line only"),
        "json": (["--json"], None, False, None,
                 "one JSON object per line on stdout, one per check, then a summary (see the "
                 "README's 'Exit codes and machine-readable output')"),
        "strict_env": (["--strict-env"], None, False, None,
                       "refuse a floor measured under another torch, numpy, Python, machine "
                       "class or CPU kernel set than this one (exit 2), rather than note it "
                       "(the same as WSB_STRICT_ENV=1)"),
        "max_gib": (["--max-gib"], O.positive, None, "G",
                    "refuse a check whose estimated memory exceeds G GiB (default this "
                    "machine's memory, /proc/meminfo MemTotal)"),
        "max_gflop": (["--max-gflop"], O.positive, gflop, "F",
                      f"refuse a check whose estimated work exceeds F GFLOP (default "
                      f"{gflop:g})"),
        "deadline": (["--deadline"], O.positive, None, "SECONDS",
                     "the most one call of your function (--converter, --resharder, "
                     "--splitter) may take, in process (default: unbounded; exit 4 with its "
                     "stack when over), and with gloo the rank pool's watchdog deadline for "
                     "one task (default 60; a rank that has not finished by then is named)")}
    named = argparse.ArgumentParser()
    O.add_limit_options(named, max_gib=2.5, max_gflop=10.0, what="a sync")
    helps = {a.dest: (a.default, a.help) for a in named._actions if a.dest != "help"}
    assert helps == {
        "max_gib": (2.5, "refuse a sync whose estimated memory exceeds G GiB (default 2.5)"),
        "max_gflop": (10.0, "refuse a sync whose estimated work exceeds F GFLOP (default 10)")}
    quiet_only = argparse.ArgumentParser()
    O.add_output_options(quiet_only, json_records=False)
    assert [a.dest for a in quiet_only._actions] == ["help", "quiet"]

"""``wsb fuzz``, ``wsb mutants`` and ``wsb replay``: how a run's report becomes the closing
text, the ``--json`` records, the campaign summary and the exit code (issue 30, the mutation
pass over ``cli/fuzz.py``'s ``_finish``, ``_tally_record``, ``_fault_record``,
``_write_summary``, ``cmd_fuzz``, ``cmd_mutants``, ``cmd_replay``, ``_range`` and
``_domain_field``).

The fuzz runner, the summary writer, the corpus scan and the replay are stood in, so each
test decides exactly what the run found (failures, harness faults, an interrupt, nothing at
all; entries broken, faulted or unreadable) and checks every line, record and code: a code
taken from the wrong outcome, or a failure beside a fault read as a fault, would tell CI a
campaign passed. The real runs are ``test_fuzz.py``'s, ``test_replay.py``'s and
``test_faults_in_fuzz.py``'s."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import weight_sync_bench.fuzz.replay as replay_module
import weight_sync_bench.fuzz.summary as summary_module
from weight_sync_bench.cli import fuzz as F
from weight_sync_bench.cli.output import Terminated
from weight_sync_bench.cli.records import KEYS
from weight_sync_bench.errors import MissingArtifacts, RankCrash, RankFailure, WsbError
from weight_sync_bench.fuzz import corpus, runner
from weight_sync_bench.fuzz.runner import FuzzReport, HarnessFault, Tally


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="wsb")
    F.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


class Failure(AssertionError):
    """A counterexample as ``_finish`` sees it: its text and its record."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} fails on toy 2->1")
        self.name = name


def fault(label: str = "invariant", rank: int = 1) -> HarnessFault:
    return HarnessFault(label, None, RankCrash("rank 1 died\nits traceback", rank=rank,
                                               signal_name="SIGKILL", breadcrumb="step 3"))


def tally(prop: str = "invariant", mutation: str | None = None, **kw) -> Tally:
    return Tally(prop, mutation, **kw)


def fuzz_report(*, tallies=(), failures=(), faults=(), interrupted=None, **kw) -> FuzzReport:
    return FuzzReport(list(tallies), 1.5, "wsb-test", 42, list(failures), list(faults),
                      interrupted=interrupted, **kw)


@pytest.fixture
def finish(monkeypatch):
    """``_finish`` with the table and the counterexample record stood in."""
    monkeypatch.setattr(runner, "format_report",
                        lambda report, matrix: (f"TABLE matrix={matrix} "
                                                f"tallies={len(report.tallies)}"))
    monkeypatch.setattr(F, "counterexample_record", lambda f: {
        **dict.fromkeys(("property", "case", "conventions", "src", "dst", "mutation",
                         "named_mutation", "deviation", "threshold", "ratio", "first_mismatch",
                         "diagnosis", "error")), "message": str(f)})

    def run(report, *, json_out=False, command="fuzz", **kw):
        out = F.Output(argparse.Namespace(json=json_out, quiet=False, command=command))
        return F._finish(report, out, **kw)
    return run


# ---- the exit code of a finished run ---------------------------------------------------------

def test_a_clean_run_exits_0_and_says_what_it_ran(finish, capsys):
    report = fuzz_report(tallies=[tally(examples=5)])
    assert finish(report, failed=False, matrix=False, extra=["campaign summary: s.json"]) == 0
    assert capsys.readouterr().out == "TABLE matrix=False tallies=1\ncampaign summary: s.json\n"


def test_a_failure_beside_a_fault_exits_1_and_prints_both(finish, capsys):
    report = fuzz_report(tallies=[tally(examples=5)], failures=[Failure("invariant")],
                         faults=[fault()])
    assert finish(report, failed=True, matrix=False) == 1
    out = capsys.readouterr().out
    assert out == ("TABLE matrix=False tallies=1\n\nFAIL invariant fails on toy 2->1\n"
                   "\nHARNESS FAULT (not a counterexample: not shrunk, not written to the "
                   f"corpus; the rank pool restarts on its next task): {fault()}\n")


def test_a_fault_alone_exits_3(finish, capsys):
    assert finish(fuzz_report(tallies=[tally(examples=5)], faults=[fault()]), failed=False,
                  matrix=True) == 3
    assert capsys.readouterr().out.startswith("TABLE matrix=True tallies=1\n\nHARNESS FAULT")


def test_a_run_that_tried_nothing_exits_2_and_says_so(finish, capsys):
    assert finish(fuzz_report(tallies=[tally(examples=0)]), failed=False, matrix=False) == 2
    assert capsys.readouterr().out.endswith(
        "\n\ntried no example: nothing was checked (the budget ran out before the first "
        "example, or the profile generates none and no corpus entry applies)\n")


@pytest.mark.parametrize(("signal", "code"), [(KeyboardInterrupt(), 130),
                                              (Terminated(), 143)])
def test_an_interrupt_decides_the_code_over_failures_and_faults(finish, capsys, signal, code):
    report = fuzz_report(tallies=[tally(examples=3)], failures=[Failure("invariant")],
                         faults=[fault()], interrupted=signal)
    assert finish(report, failed=True, matrix=False) == code
    assert capsys.readouterr().out.endswith(
        "\n\ninterrupted: the summary above covers the 3 examples that ran\n")


def test_an_interrupt_before_any_example_is_not_a_usage_error(finish, capsys):
    assert finish(fuzz_report(interrupted=KeyboardInterrupt()), failed=False,
                  matrix=False) == 130
    assert "tried no example" not in capsys.readouterr().out


# ---- the records ---------------------------------------------------------------------------------

def test_json_records_tallies_then_counterexamples_then_faults_then_the_summary(finish, capsys,
                                                                               tmp_path):
    entry = tmp_path / "e.json"
    t1 = tally("invariant", examples=4, identity=1, failures=1, max_ratio=2.5,
               min_ratio=0.5, min_at="toy 2->1", new_entries=[entry], faults=[fault()])
    t2 = tally("kill", "kv_swapped", examples=3, identity=3, killed=0)
    report = fuzz_report(tallies=[t1, t2], failures=[Failure("invariant")], faults=[fault()],
                         stopped="3 harness faults", corpus=tmp_path)
    assert finish(report, json_out=True, failed=True, matrix=True,
                  summary=tmp_path / "s.json") == 1
    out = records(capsys.readouterr().out)
    assert [r["kind"] for r in out] == ["mutant", "mutant", "counterexample", "harness_fault",
                                        "summary"]
    assert out[0] == {"kind": "mutant", "property": "invariant", "mutation": None,
                      "examples": 4, "identity": 1, "failures": 1, "killed": 0,
                      "min_ratio": 0.5, "max_ratio": 2.5, "min_at": "toy 2->1",
                      "new_entries": [str(entry)], "faults": 1}
    # every example an identity one: no smallest ratio to report
    assert out[1]["min_ratio"] is None and out[1]["min_at"] is None
    assert out[1]["mutation"] == "kv_swapped" and out[1]["faults"] == 0
    assert out[2]["message"] == "invariant fails on toy 2->1"
    assert out[3] == {"kind": "harness_fault", "property": "invariant", "entry": None,
                      "type": "RankCrash", "rank": 1, "how": "killed by SIGKILL",
                      "breadcrumb": "step 3", "case": None, "message": "rank 1 died"}
    assert out[4] == {"kind": "summary", "command": "fuzz", "exit_code": 1, "examples": 7,
                      "failures": 1, "harness_faults": 1, "elapsed": 1.5,
                      "profile": "wsb-test", "master_seed": 42, "corpus": str(tmp_path),
                      "new_entries": [str(entry)], "stopped": "3 harness faults",
                      "summary_file": str(tmp_path / "s.json"), "found": None}


def test_a_property_tally_is_a_property_record_and_no_summary_file_is_null(finish, capsys):
    assert finish(fuzz_report(tallies=[tally(examples=2, min_ratio=0.25)]), json_out=True,
                  failed=False, matrix=False) == 0
    out = records(capsys.readouterr().out)
    assert [r["kind"] for r in out] == ["property", "summary"]
    assert out[0]["min_ratio"] == 0.25 and out[1]["summary_file"] is None


def test_a_fault_records_its_case_and_an_empty_message():
    f = HarnessFault("kill[x]", "toy 1->2", RankFailure("", rank=None))
    assert F._fault_record(f) == {"property": "kill[x]", "entry": None, "type": "RankFailure",
                                  "rank": None, "how": "raised", "breadcrumb": None,
                                  "case": "toy 1->2", "message": ""}


# ---- the campaign summary -------------------------------------------------------------------

@pytest.fixture
def summary(monkeypatch):
    seen = {}

    def build(report, *, phase, command, budget):
        seen["build"] = (report, phase, command, budget)
        return {"built": True}
    monkeypatch.setattr(summary_module, "build_summary", build)
    return seen


def test_the_summary_is_built_from_the_run_and_written_where_asked(summary, monkeypatch):
    monkeypatch.setattr(summary_module, "write_summary",
                        lambda s, path: Path("/tmp/x/s.json") if s == {"built": True} else None)
    args = argparse.Namespace(phase="1b", summary=None)
    assert F._write_summary("R", args, "mutants", {"examples": 3}) == (
        Path("/tmp/x/s.json"), "campaign summary: /tmp/x/s.json")
    assert summary["build"] == ("R", "1b", "mutants", {"examples": 3})


def test_nowhere_to_write_the_summary_is_a_line_not_a_failure(summary, monkeypatch):
    def missing(s, path):
        raise MissingArtifacts("no checkout and no WSB_FUZZ_DIR")
    monkeypatch.setattr(summary_module, "write_summary", missing)
    args = argparse.Namespace(phase="1a", summary=None)
    assert F._write_summary("R", args, "fuzz", {}) == (
        None, ("campaign summary not written: no checkout and no WSB_FUZZ_DIR (or pass "
               "--summary PATH)"))

    def unwritable(s, path):
        raise PermissionError(13, "Permission denied", "/ro/summaries")
    monkeypatch.setattr(summary_module, "write_summary", unwritable)
    assert F._write_summary("R", args, "fuzz", {}) == (
        None, ("campaign summary not written: /ro/summaries: Permission denied (or pass "
               "--summary PATH)"))

    def bare(s, path):
        raise OSError("disk gone")
    monkeypatch.setattr(summary_module, "write_summary", bare)
    assert F._write_summary("R", args, "fuzz", {}) == (
        None, ("campaign summary not written: its directory: disk gone (or pass --summary "
               "PATH)"))


def test_a_summary_path_given_that_cannot_be_written_is_an_error(summary, monkeypatch):
    def unwritable(s, path):
        assert path == Path("/ro/s.json")
        raise PermissionError(13, "Permission denied", "/ro/s.json")
    monkeypatch.setattr(summary_module, "write_summary", unwritable)
    args = argparse.Namespace(phase="1a", summary=Path("/ro/s.json"))
    with pytest.raises(WsbError) as e:
        F._write_summary("R", args, "fuzz", {})
    assert str(e.value) == ("--summary /ro/s.json: cannot write the campaign summary "
                            "(Permission denied)")

    def bare(s, path):
        raise OSError("disk gone")
    monkeypatch.setattr(summary_module, "write_summary", bare)
    with pytest.raises(WsbError, match=r"summary \(disk gone\)$"):
        F._write_summary("R", args, "fuzz", {})


# ---- wsb fuzz and wsb mutants ------------------------------------------------------------------

@pytest.fixture
def campaign(monkeypatch, finish):
    """``_run_fuzz`` and the summary stood in: ``seen`` records what each was asked."""
    seen = {"report": fuzz_report(tallies=[tally(examples=4)])}

    def run_fuzz(args, out, **kwargs):
        assert args.command in ("fuzz", "mutants") and isinstance(out, F.Output)
        seen["run"] = kwargs
        return seen["report"]

    def write(report, args, command, budget):
        assert report is seen["report"] and args.command == command
        seen["summary"] = (command, budget)
        return Path("s.json"), "campaign summary: s.json"
    monkeypatch.setattr(F, "_run_fuzz", run_fuzz)
    monkeypatch.setattr(F, "_write_summary", write)
    return seen


def fuzz(*argv: str) -> int:
    args = parse(*argv)
    return args.func(args)


def test_fuzz_runs_the_invariant_on_its_budget(campaign, capsys):
    assert fuzz("fuzz") == 0
    assert campaign["run"] == {"mutations": None, "invariant": True, "chunk": 25, "work": None,
                               "minutes": 1.0}
    assert campaign["summary"] == ("fuzz", {"minutes": 1.0})
    assert capsys.readouterr().out == "TABLE matrix=False tallies=1\ncampaign summary: s.json\n"
    assert fuzz("fuzz", "--examples", "7", "--chunk", "3") == 0
    assert campaign["run"] == {"mutations": None, "invariant": True, "chunk": 3, "work": None,
                               "examples": 7}
    assert campaign["summary"] == ("fuzz", {"examples": 7})
    assert fuzz("fuzz", "--minutes", "0.5", "--mutation", "kv_swapped") == 0
    assert campaign["run"] == {"mutations": ["kv_swapped"], "invariant": False, "chunk": 25,
                               "work": None, "minutes": 0.5}


def test_fuzz_exits_1_on_a_failure_and_json_names_the_summary(campaign, capsys):
    campaign["report"] = fuzz_report(tallies=[tally(examples=4)], failures=[Failure("inv")])
    assert fuzz("fuzz", "--json") == 1
    out = records(capsys.readouterr().out)
    assert out[-1]["exit_code"] == 1 and out[-1]["summary_file"] == "s.json"


def test_fuzz_moe_runs_the_moe_targets_in_process_only(campaign, monkeypatch):
    monkeypatch.setattr(runner, "moe_targets", lambda: [("moe_convert", None)])
    assert fuzz("fuzz", "--moe", "--examples", "2") == 0
    assert campaign["run"]["work"] == [("moe_convert", None)]
    for argv in (("--mutation", "kv_swapped"), ("--phase", "1b")):
        with pytest.raises(WsbError) as e:
            fuzz("fuzz", "--moe", *argv)
        assert str(e.value) == ("--moe runs every MoE property in process: drop --mutation (or "
                                "name MoE mutations with --mutation alone) and --phase")


@pytest.mark.parametrize(("argv", "flag"), [
    (("--from", "megatron"), "--from"), (("--to", "vllm"), "--to"), (("--src", "2"), "--src"),
    (("--dst", "2"), "--dst")])
def test_a_users_option_without_a_users_function_is_refused(campaign, argv, flag):
    with pytest.raises(WsbError) as e:
        fuzz("fuzz", *argv)
    assert str(e.value) == (f"{flag} is for fuzzing your own function: give --splitter, "
                            "--resharder or --converter")
    assert "run" not in campaign


def test_a_users_function_goes_to_its_own_path(campaign, monkeypatch):
    def user(args, out):
        assert isinstance(out, F.Output) and (args.resharder, args.src) == ("m:f", 2)
        return 5
    monkeypatch.setattr(F, "_cmd_fuzz_user", user)
    assert fuzz("fuzz", "--resharder", "m:f", "--src", "2") == 5
    monkeypatch.setattr(F, "_cmd_fuzz_user", lambda args, out: 6)
    assert fuzz("fuzz", "--splitter", "m:f") == 6 and fuzz("fuzz", "--converter", "m:f") == 6
    assert "run" not in campaign


def test_find_smallest_writes_each_mutations_smallest_case(campaign, monkeypatch, capsys):
    asked = []

    def smallest(name, *, profile, phase, forward):
        asked.append((name, profile, phase, forward))
        return _Smallest(name)
    monkeypatch.setattr(runner, "find_smallest", smallest)
    monkeypatch.setattr(F, "phase_forward", lambda phase: f"forward {phase}")
    monkeypatch.setattr(F, "apply_deadline", lambda d, g: asked.append(("deadline", d, g)))
    assert fuzz("fuzz", "--find-smallest", "kv_swapped", "--find-smallest", "norm_rotated",
                "--profile", "wsb-test", "--phase", "1b", "--deadline", "9", "--json") == 0
    assert asked == [("deadline", 9.0, True), ("kv_swapped", "wsb-test", "1b", "forward 1b"),
                     ("norm_rotated", "wsb-test", "1b", "forward 1b")]
    out = records(capsys.readouterr().out)
    assert out[:2] == [{"kind": "smallest", "mutation": n, "case": f"case of {n}",
                        "message": f"smallest {n}"} for n in ("kv_swapped", "norm_rotated")]
    assert out[2] == {"kind": "summary", "command": "fuzz", "exit_code": 0,
                      **dict.fromkeys(F.FUZZ_SUMMARY), "found": 2}
    assert "run" not in campaign
    assert fuzz("fuzz", "--find-smallest", "kv_swapped") == 0
    assert capsys.readouterr().out == "kv_swapped: smallest kv_swapped\n"
    assert asked[-1] == ("kv_swapped", None, "1a", "forward 1a")


class _Smallest:
    def __init__(self, name):
        self.outcome = SimpleNamespace(case=f"case of {name}")
        self.name = name

    def __str__(self):
        return f"smallest {self.name}"


def test_mutants_exit_1_naming_each_mutation_not_killed_everywhere(campaign, capsys):
    campaign["report"] = fuzz_report(tallies=[
        tally("kill", "a", examples=5, identity=1, killed=4),
        tally("kill", "b", examples=5, identity=1, killed=3),
        tally("kill", "c", examples=5, identity=5, killed=0),
        tally("kill", "d", examples=4, identity=0, killed=3)])
    assert fuzz("mutants", "--examples", "5", "--mutation", "kv_swapped", "--chunk", "2") == 1
    assert campaign["run"] == {"examples": 5, "invariant": False, "chunk": 2,
                               "mutations": ["kv_swapped"]}
    assert campaign["summary"] == ("mutants", {"examples": 5})
    out = capsys.readouterr().out
    assert out == ("TABLE matrix=True tallies=4\n\nnot killed everywhere by 10x: b, d\n"
                   "campaign summary: s.json\n")


def test_mutants_every_one_killed_exit_0_and_a_failure_still_exits_1(campaign, capsys):
    campaign["report"] = fuzz_report(tallies=[tally("kill", "a", examples=40, killed=40)])
    assert fuzz("mutants") == 0
    assert campaign["run"]["examples"] == 40
    assert "not killed" not in capsys.readouterr().out
    campaign["report"] = fuzz_report(tallies=[tally("kill", "a", examples=4, killed=4)],
                                     failures=[Failure("kill")])
    assert fuzz("mutants", "--json") == 1
    out = records(capsys.readouterr().out)
    assert [r["kind"] for r in out] == ["mutant", "counterexample", "summary"]
    assert out[-1]["command"] == "mutants" and out[-1]["summary_file"] == "s.json"


# ---- wsb replay ----------------------------------------------------------------------------------

def entry(name: str, phase: str = "1a", origin: str = "discovered"):
    return SimpleNamespace(path=Path("corpus") / name, case=SimpleNamespace(phase=phase),
                           origin=origin)


class Bad(Exception):
    def __init__(self, path, field):
        super().__init__(f"{path} is not JSON")
        self.path, self.field = path, field


@pytest.fixture
def corpus_of(monkeypatch):
    """The scan, the replay and its table stood in; ``seen`` records each replay's forward
    and the deadline."""
    seen = {"replayed": [], "deadline": None, "scan": None}

    def use(entries, bad=(), *, status="reproduces", holds=True, faults=()):
        def scan(paths, limits):
            seen["scan"] = (paths, limits.max_bytes, limits.max_flops)
            return SimpleNamespace(entries=list(entries), bad=list(bad))

        def replay(es, *, forward, load):
            assert load is F.load_function  # a user's entry re-runs the user's function
            (e,) = es
            seen["replayed"].append((e.path.name, forward))
            if e.path.name in faults:
                raise RankCrash(f"rank 0 of {e.path.name} died\nmore", rank=0,
                                signal_name="SIGKILL", breadcrumb="load")
            ok = holds if not callable(holds) else holds(e)
            yield SimpleNamespace(entry=e, status=status if not callable(status) else status(e),
                                  claim_holds=ok)
        monkeypatch.setattr(corpus, "scan_corpus", scan)
        monkeypatch.setattr(replay_module, "replay", replay)
    monkeypatch.setattr(corpus, "format_replay", lambda results: f"REPLAY {len(results)}")
    monkeypatch.setattr(F, "replay_record", lambda r: {
        **dict.fromkeys(KEYS["replay"]),
        "entry": str(r.entry.path), "status": r.status})
    monkeypatch.setattr(F, "phase_forward", lambda phase: f"forward {phase}")
    monkeypatch.setattr(F, "apply_deadline", lambda d, g: seen.update(deadline=(d, g)))
    seen["use"] = use
    return seen


def test_replay_of_entries_whose_claim_holds_exits_0(corpus_of, capsys):
    corpus_of["use"]([entry("a.json"), entry("b.json", origin="seeded")])
    assert fuzz("replay") == 0
    assert corpus_of["scan"] == (None, 2 * 2 ** 30, 50e9)
    assert corpus_of["deadline"] == (None, False)
    assert corpus_of["replayed"] == [("a.json", "forward 1a"), ("b.json", "forward 1a")]
    assert capsys.readouterr().out == (
        "REPLAY 2\n\n2 reproduces; the project's claim holds on 2/2\n"
        "discovered: 1 (claim holds on 1); seeded: 1 (claim holds on 1)\n")


def test_replay_limits_and_paths_are_the_options(corpus_of):
    corpus_of["use"]([entry("a.json")])
    fuzz("replay", "x.json", "d", "--max-gib", "0.5", "--max-gflop", "3", "--deadline", "4")
    assert corpus_of["scan"] == ([Path("x.json"), Path("d")], 2 ** 29, 3e9)
    assert corpus_of["deadline"] == (4.0, False)


def test_replay_runs_each_phase_through_its_forward_in_order(corpus_of, capsys):
    corpus_of["use"]([entry("b.json", "1b"), entry("a.json", "1a"), entry("c.json", "1b")],
                     status=lambda e: "reproduces" if e.case.phase == "1a" else "fixed")
    assert fuzz("replay", "--json") == 0
    assert corpus_of["deadline"] == (None, True)
    assert corpus_of["replayed"] == [("a.json", "forward 1a"), ("b.json", "forward 1b"),
                                     ("c.json", "forward 1b")]
    out = records(capsys.readouterr().out)
    assert [r["entry"] for r in out[:-1]] == ["corpus/a.json", "corpus/b.json", "corpus/c.json"]
    assert out[-1] == {"kind": "summary", "command": "replay", "exit_code": 0, "replayed": 3,
                       "broken": 0, "bad": 0, "harness_faults": 0, "phases": ["1a", "1b"],
                       "statuses": {"reproduces": 1, "fixed": 2},
                       "origins": {"discovered": 3, "seeded": 0}}
    fuzz("replay")
    assert ("\n1 reproduces, 2 fixed; the project's claim holds on 3/3; phases 1a, 1b\n"
            in capsys.readouterr().out)


def test_replay_progress_names_each_entry_and_its_phase(corpus_of, capsys):
    corpus_of["use"]([entry("a.json"), entry("b.json", "1b")])
    fuzz("replay")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "replay 1/2: a.json (phase 1a)" and err[-1] == "replay 2/2: b.json (phase 1b)"


def test_a_broken_claim_exits_1_beside_faults_and_bad_entries(corpus_of, capsys):
    bad = Bad("corpus/x.json", "case")
    corpus_of["use"]([entry("a.json"), entry("b.json"), entry("c.json")], [bad],
                     holds=lambda e: e.path.name != "c.json", faults=("b.json",))
    assert fuzz("replay") == 1
    out = capsys.readouterr().out
    assert out == (
        "REPLAY 2\n"
        "\nHARNESS FAULT replaying corpus/b.json: RankCrash: rank 0 of b.json died\n"
        "\nBAD ENTRY corpus/x.json (field case): corpus/x.json is not JSON\n"
        "\n2 reproduces; the project's claim holds on 1/2; 1 bad entry; 1 harness faults\n"
        "discovered: 2 (claim holds on 1); seeded: 0 (claim holds on 0)\n")


def test_a_fault_without_a_broken_claim_exits_3_and_is_recorded(corpus_of, capsys):
    corpus_of["use"]([entry("a.json"), entry("b.json")], faults=("a.json",))
    assert fuzz("replay", "--json") == 3
    out = records(capsys.readouterr().out)
    assert out[0] == {"kind": "harness_fault", "property": None, "entry": "corpus/a.json",
                      "type": "RankCrash", "rank": 0, "how": None, "breadcrumb": "load",
                      "case": None, "message": "rank 0 of a.json died"}
    assert out[1]["kind"] == "replay" and out[1]["entry"] == "corpus/b.json"
    assert out[-1]["exit_code"] == 3 and out[-1]["harness_faults"] == 1
    assert out[-1]["replayed"] == 1


def test_bad_entries_alone_exit_2_and_are_recorded(corpus_of, capsys):
    corpus_of["use"]([entry("a.json")], [Bad("corpus/x.json", None), Bad("corpus/y.json", "m")])
    assert fuzz("replay", "--json") == 2
    out = records(capsys.readouterr().out)
    assert out[:2] == [{"kind": "bad_entry", "entry": "corpus/x.json", "field": None,
                        "type": "Bad", "message": "corpus/x.json is not JSON"},
                       {"kind": "bad_entry", "entry": "corpus/y.json", "field": "m",
                        "type": "Bad", "message": "corpus/y.json is not JSON"}]
    assert out[-1]["bad"] == 2 and out[-1]["broken"] == 0
    fuzz("replay")
    text = capsys.readouterr().out
    assert "(field -)" in text and "; 2 bad entries\n" in text


def test_nothing_to_replay_exits_2_and_says_so(corpus_of, capsys):
    corpus_of["use"]([])
    assert fuzz("replay") == 2
    assert corpus_of["deadline"] == (None, True)  # no entry: the pool may be asked for
    assert capsys.readouterr().out == (
        "\nnothing replayed; the project's claim holds on 0/0\n"
        "no corpus entries to replay: nothing was checked\n")
    corpus_of["use"]([], [Bad("corpus/x.json", None)])
    assert fuzz("replay") == 2
    assert "no corpus entries to replay" not in capsys.readouterr().out


# ---- the domain options -------------------------------------------------------------------------

def test_ranges_and_domain_fields_parse_or_name_what_is_wrong():
    assert F._range("4") == 4 and F._range("1-8") == (1, 8)
    assert F._domain_field("d_model=8-32") == ("d_model", (8, 32))
    assert F._domain_field("seed=3") == ("seed", 3)
    with pytest.raises(argparse.ArgumentTypeError) as e:
        F._range("a-b")
    assert str(e.value) == "expected N or LO-HI, got 'a-b'"
    with pytest.raises(argparse.ArgumentTypeError) as e:  # the field is before the first =
        F._domain_field("d_model=8=9")
    assert str(e.value) == "expected N or LO-HI, got '8=9'"
    for text in ("d_model", "=4"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            F._domain_field(text)
        assert str(e.value) == f"expected FIELD=N or FIELD=LO-HI, got {text!r}"
    args = parse("fuzz", "--resharder", "m:f", "--kv-heads", "1-2", "--domain", "d_model=8",
                 "--domain", "n_layers=1-2")
    assert args.kv_heads == (1, 2) and args.domain == [("d_model", 8), ("n_layers", (1, 2))]

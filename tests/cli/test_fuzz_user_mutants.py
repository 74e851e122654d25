"""``wsb fuzz --splitter | --resharder | --converter MODULE:FUNCTION`` (issue 30, the
mutation pass over ``cli/fuzz.py``'s ``_cmd_fuzz_user``): what the command refuses, and
what it hands the domain, the user's function, the runner, the summary and ``_finish``.

The contract (``cli/fuzz.py``, ``docs/guide/your-function.md``): a converter needs ``--from``
and ``--to`` (its degrees are its conventions', never ``--src``/``--dst``) and runs in
process (``--phase 1a``); a splitter or resharder speaks the harness's names (no
``--from``/``--to``), and a splitter has no ``--src``; ``--find-smallest`` and
``--mutation`` are the harness's own mutations, refused beside a user's function. The
budget is ``--examples`` if given, else ``--minutes``, else one minute; the run's exit code
is ``_finish``'s, failed exactly when a counterexample was found.

Everything after the argument handling is stood in (``narrow``, ``UserFunction``,
``UserStats``, ``fuzz_run``, ``user_report``, ``_run_fuzz``, ``_write_summary``,
``_finish``): each records what it was handed, so each test pins every argument of one
invocation in milliseconds. The real runs are ``tests/cli/test_user_fuzz.py``'s.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from weight_sync_bench.cli import fuzz as F
from weight_sync_bench.errors import WsbError
from weight_sync_bench.fuzz.runner import FuzzReport, Tally

STRATEGIES = importlib.import_module("weight_sync_bench.fuzz.strategies.user")
USER = importlib.import_module("weight_sync_bench.fuzz.user")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="wsb")
    F.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["fuzz", *argv])


class Function:
    """``UserFunction`` as the command uses it: what it was built with, its domain rule."""

    def __init__(self, fn, role, *, src, dst, name):
        self.built = (fn, role, src, dst, name)
        self.prop, self.label = f"prop of {role}", f"label of {name}"

    def domain(self, domain):
        return f"{domain} as {self.built[1]} needs"


class Stats:
    def __init__(self):
        self.checked, self.declined, self.first_failure_at = 11, 3, 7
        self.smallest_declined = SimpleNamespace(case="tiny case")

    def lines(self):
        return ["stats line 1", "stats line 2"]


@pytest.fixture
def world(monkeypatch):
    """Every collaborator stood in; ``world.log`` holds (name, what it was handed)."""
    log = []
    state = SimpleNamespace(log=log, failures=[], code=5, handed=[])
    report = FuzzReport([Tally("p", None, examples=4)], 1.0, "wsb-test", 9, state.failures)
    state.report = report

    def narrow(**kw):
        log.append(("narrow", kw))
        return "DOMAIN"

    def fuzz_run(function, **kw):
        log.append(("fuzz_run", function.built, kw))
        return "RUN"

    def user_report(got, stats):
        log.append(("user_report", got is report, type(stats).__name__))
        return report

    def run_fuzz(args, out, **kw):
        log.append(("_run_fuzz", kw))
        state.handed.append(("_run_fuzz", args, out))
        return report

    def write_summary(got, args, command, budget):
        log.append(("_write_summary", got is report, command, budget))
        state.handed.append(("_write_summary", args, None))
        return Path("s.json"), "campaign summary: s.json"

    def finish(got, out, **kw):
        log.append(("_finish", got is report, kw))
        state.handed.append(("_finish", None, out))
        return state.code

    monkeypatch.setattr(STRATEGIES, "narrow", narrow)
    monkeypatch.setattr(USER, "UserFunction", Function)
    monkeypatch.setattr(USER, "UserStats", Stats)
    monkeypatch.setattr(USER, "fuzz_run", fuzz_run)
    monkeypatch.setattr(USER, "user_report", user_report)
    monkeypatch.setattr(F, "_run_fuzz", run_fuzz)
    monkeypatch.setattr(F, "_write_summary", write_summary)
    monkeypatch.setattr(F, "_finish", finish)
    monkeypatch.setattr(F, "load_function", lambda spec, role: f"loaded {spec} as {role}")
    monkeypatch.setattr(F, "user_corpus_dir", lambda: Path("user-corpus"))
    return state


def logged(world, name):
    (entry,) = [e[1:] for e in world.log if e[0] == name]
    return entry


def test_a_resharder_run_hands_every_collaborator_what_it_names(world, capsys):
    args = parse("--resharder", "m:f", "--src", "2", "--dst", "4", "--examples", "30",
                 "--chunk", "6", "--phase", "1b", "--json")
    code = F.cmd_fuzz(args)
    assert code == 5  # _finish's
    (run, a, out), (write, b, _), (finish, _, out2) = world.handed
    assert (run, write, finish) == ("_run_fuzz", "_write_summary", "_finish")
    assert a is args and b is args  # the run and the summary read the command's own options
    assert isinstance(out, F.Output) and out2 is out and out.json  # one Output, --json's
    assert logged(world, "narrow") == ({"max_d_model": None, "kv_heads": None, "gqa": None,
                                        "vocab_multiple": None},)
    built, kw = logged(world, "fuzz_run")
    assert built == ("loaded m:f as resharder", "resharder", None, None, "m:f")
    assert kw == {"domain": "DOMAIN as resharder needs", "src": 2, "dst": 4,
                  "stats": kw["stats"], "real": True, "phase": "1b"}
    assert type(kw["stats"]) is Stats
    assert logged(world, "_run_fuzz") == ({"work": [("prop of resharder", "label of m:f")],
                                           "run": "RUN", "chunk": 6,
                                           "corpus_path": Path("user-corpus"),
                                           "examples": 30},)
    assert logged(world, "user_report") == (True, "Stats")
    assert logged(world, "_write_summary") == (True, "fuzz", {"examples": 30})
    assert logged(world, "_finish") == (True, {
        "failed": False, "matrix": False,
        "extra": ["", "domain: DOMAIN as resharder needs", "stats line 1", "stats line 2",
                  "campaign summary: s.json"],
        "summary": Path("s.json")})
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record == {"kind": "user_function", "role": "resharder", "function": "m:f",
                      "domain": "DOMAIN as resharder needs", "checked": 11, "declined": 3,
                      "smallest_declined": "tiny case", "first_failure_at": 7}


def test_a_counterexample_is_a_failed_run(world):
    world.failures.append(AssertionError("found"))
    F.cmd_fuzz(parse("--splitter", "m:s"))
    assert logged(world, "_finish")[1]["failed"] is True


def test_nothing_declined_records_no_smallest(world, capsys, monkeypatch):
    class Quiet(Stats):
        def __init__(self):
            super().__init__()
            self.smallest_declined = None
    monkeypatch.setattr(USER, "UserStats", Quiet)
    F.cmd_fuzz(parse("--splitter", "m:s", "--json"))
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["smallest_declined"] is None


@pytest.mark.parametrize(("argv", "budget"), [
    ([], {"minutes": 1.0}), (["--minutes", "2.5"], {"minutes": 2.5}),
    (["--examples", "3"], {"examples": 3})])
def test_the_budget(world, argv, budget):
    F.cmd_fuzz(parse("--splitter", "m:s", *argv))
    assert logged(world, "_run_fuzz")[0] == {
        "work": [("prop of splitter", "label of m:s")], "run": "RUN", "chunk": 25,
        "corpus_path": Path("user-corpus"), **budget}
    assert logged(world, "_write_summary")[2] == budget


def test_the_domain_narrowed_by_every_option(world):
    F.cmd_fuzz(parse("--splitter", "m:s", "--dst", "2", "--max-d-model", "64", "--kv-heads",
                     "1-2", "--gqa-only", "--vocab-multiple", "8", "--domain", "n_layers=1-2",
                     "--domain", "seq_len=4", "--no-real-geometries"))
    assert logged(world, "narrow") == ({"max_d_model": 64, "kv_heads": (1, 2), "gqa": True,
                                        "vocab_multiple": 8, "n_layers": (1, 2),
                                        "seq_len": 4},)
    built, kw = logged(world, "fuzz_run")
    assert built == ("loaded m:s as splitter", "splitter", None, None, "m:s")
    assert (kw["src"], kw["dst"], kw["real"], kw["phase"]) == (None, 2, False, "1a")


def test_no_gqa_narrows_to_mha(world):
    F.cmd_fuzz(parse("--splitter", "m:s", "--no-gqa"))
    assert logged(world, "narrow")[0]["gqa"] is False


def test_a_converter_takes_its_conventions_and_degrees_from_its_ends(world):
    F.cmd_fuzz(parse("--converter", "m:c", "--from", "megatron:4", "--to", "vllm"))
    built, kw = logged(world, "fuzz_run")
    assert built == ("loaded m:c as converter", "converter", "megatron", "vllm", "m:c")
    assert (kw["src"], kw["dst"], kw["domain"]) == (4, None, "DOMAIN as converter needs")
    F.cmd_fuzz(parse("--converter", "m:c", "--from", "megatron:tp=2,pp=2", "--to",
                     "hf:1"))
    built, kw = [e[1:] for e in world.log if e[0] == "fuzz_run"][1]
    assert built[2:4] == ("megatron:tp=2,pp=2", "hf") and (kw["src"], kw["dst"]) == (4, 1)


@pytest.mark.parametrize(("argv", "message"), [
    (["--resharder", "m:f", "--mutation", "kv_swapped"],
     ("--resharder fuzzes your function; --find-smallest and --mutation are the harness's own "
      "mutations")),
    (["--splitter", "m:f", "--find-smallest", "kv_swapped"],
     ("--splitter fuzzes your function; --find-smallest and --mutation are the harness's own "
      "mutations")),
    (["--converter", "m:f", "--to", "hf"],
     "--converter needs --from CONVENTION[:T] and --to CONVENTION[:T]"),
    (["--converter", "m:f", "--from", "hf"],
     "--converter needs --from CONVENTION[:T] and --to CONVENTION[:T]"),
    (["--converter", "m:f", "--from", "hf", "--to", "vllm", "--src", "2"],
     "a converter's degrees are its conventions': --from megatron:4, not --src"),
    (["--converter", "m:f", "--from", "hf", "--to", "vllm", "--dst", "2"],
     "a converter's degrees are its conventions': --from megatron:4, not --src"),
    (["--converter", "m:f", "--from", "hf", "--to", "vllm", "--phase", "1b"],
     "conversions are fuzzed in process: --phase 1a"),
    (["--resharder", "m:f", "--from", "hf"],
     ("--from / --to name a converter's conventions; a resharder speaks the harness's own "
      "names (--src / --dst fix its degrees)")),
    (["--splitter", "m:f", "--to", "hf"],
     ("--from / --to name a converter's conventions; a splitter speaks the harness's own "
      "names (--src / --dst fix its degrees)")),
    (["--splitter", "m:f", "--src", "2"],
     ("--src has no meaning with --splitter (a split starts from the full model); give "
      "--dst")),
])
def test_each_refusal_before_anything_runs(world, argv, message):
    with pytest.raises(WsbError) as info:
        F.cmd_fuzz(parse(*argv))
    assert str(info.value) == message
    assert world.log == []


def test_a_resharder_may_fix_its_source_degree(world):
    F.cmd_fuzz(parse("--resharder", "m:f", "--src", "3"))
    assert logged(world, "fuzz_run")[1]["src"] == 3

"""``wsb sync`` (issue 30, the mutation pass over ``cli/sync.py``): what the command hands
the sync and what it prints, records and returns.

The contract (``cli/sync.py``'s docstring, ``docs/reference/exit-codes.md``): exit 0 when
the first run's element check and forward pass, 1 when either fails (a ``--naive`` run
after it is printed and recorded, never judged); 2 for what cannot run here (a pool-only
option under torchrun, ``--weights`` under torchrun, ``--resharder`` with ``--mutation`` or
``--naive``, a backend other than gloo on the rank pool, a forward no phase 1b floor
covers); under torchrun a rank other than 0 prints nothing and exits 0. The plan is printed
first (every transfer with ``--transfers``), then each run's report; ``--json`` gives one
``sync`` record per run (``records.KEYS["sync"]``) and a summary.

The rank side is stood in (``SyncSession``, ``run_torchrun``): the session records what it
was opened with and what each run was handed (the function, the plan, the bucket, the
calibration, the forward, the storage) and returns prepared results, so each test checks
every argument, line, record and code of one outcome in milliseconds. The real session is
run by ``tests/sync/test_cli.py``.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from weight_sync_bench.cli.launch import job_options
from weight_sync_bench.cli.main import build_parser, main
from weight_sync_bench.errors import FloorNotMeasured
from weight_sync_bench.model.config import TOY_KV4, ModelConfig
from weight_sync_bench.sync.execute import DEFAULT_BUCKET, execute_plan, gather_scatter
from weight_sync_bench.sync.layouts import sync_layout
from weight_sync_bench.sync.planner import plan_for

S = importlib.import_module("weight_sync_bench.cli.sync")

ROUTE = ["--from", "megatron:2", "--to", "vllm:1"]


class Plan:
    label = "megatron:2 -> vllm:1"
    build_seconds = 0.125

    def __init__(self):
        self.limits = []

    def __str__(self):
        return "the plan"

    def describe(self, *, limit):
        self.limits.append(limit)
        return "every transfer"


class Result:
    """What ``SyncSession.run`` returns, each figure distinct."""

    def __init__(self, name, passed, plan, *, verdict=None):
        self.name, self.passed, self.plan, self.verdict = name, passed, plan, verdict
        self.fn, self.bytes_moved, self.b_min, self.ratio, self.naive = name, 12, 8, 1.5, 24
        self.seconds, self.t_min, self.bandwidth, self.sent_balance = 0.5, 0.25, 2e9, 1.25
        self.ranks = (SimpleNamespace(rank=0, sent=12), SimpleNamespace(rank=1, sent=0))
        self.elements_passed, self.coverage, self.into = passed, 0.75, "existing"

    def __str__(self):
        return f"report of {self.name}"


def record_of(result):
    v = result.verdict
    return {"kind": "sync", "plan": result.plan.label, "fn": result.name, "bytes_moved": 12,
            "b_min": 8, "ratio": 1.5, "naive_bytes": 24, "seconds": 0.5, "t_min": 0.25,
            "bandwidth": 2e9, "sent_max_over_mean": 1.25, "plan_seconds": 0.125,
            "ranks": [{"rank": 0, "sent": 12}, {"rank": 1, "sent": 0}],
            "elements_passed": result.passed, "coverage": 0.75, "into": "existing",
            "max_abs_error": v.max_abs_error if v else None,
            "threshold": v.threshold if v else None, "passed": result.passed}


class Session:
    """``SyncSession``'s stand-in: ``outcomes`` are (name, passed) per run, in order."""

    opened: ClassVar[list] = []

    def __init__(self, config, src, dst, **kw):
        self.config, self.src, self.dst, self.kw = config, src, dst, kw
        self.plan, self.forward, self.runs, self.closed = Plan(), kw["forward"], [], False
        Session.opened.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True

    def run(self, fn, **kw):
        self.runs.append((fn, kw))
        name, passed = self.outcomes[len(self.runs) - 1]
        verdict = SimpleNamespace(max_abs_error=1e-6, threshold=1e-3) if kw.get(
            "forward", True) and self.forward else None
        return Result(name, passed, self.plan, verdict=verdict)


class Ticks:
    """``Ticker``'s stand-in that records each step, then shows it as the real one does."""

    def __init__(self, seen, ticker):
        self.seen, self.ticker = seen, ticker

    def __call__(self, line, prefix):
        real = self.ticker(line, prefix)
        self.seen.append(("prefix", prefix))

        def tick(done, total, what):
            self.seen.append((done, total, what))
            real(done, total, what)
        return tick


@pytest.fixture
def sync(monkeypatch):
    """Stands in the session with runs that pass, and records ticks, floors, ranks checked,
    deadlines and torchrun jobs; ``sync.outcomes`` sets what the runs return."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    rec = SimpleNamespace(ticks=[], floors=[], ranks=[], deadlines=[], jobs=[], devices=[],
                          torchrun_result=None)
    Session.opened = []
    monkeypatch.setattr(Session, "outcomes", [("first", True), ("naive", True)], raising=False)
    monkeypatch.setattr(S, "SyncSession", Session)
    monkeypatch.setattr(S, "Ticker", Ticks(rec.ticks, S.Ticker))
    real_floor, real_ranks = S.floor_for, S.check_ranks

    def floor_for(config, phase):
        rec.floors.append((config, phase))
        return real_floor(config, phase)

    def check_ranks(world):
        rec.ranks.append(world)
        return real_ranks(world)

    def run_torchrun(*args, **kw):
        rec.jobs.append((args, kw))
        return rec.torchrun_result

    monkeypatch.setattr(S, "floor_for", floor_for)
    monkeypatch.setattr(S, "check_ranks", check_ranks)
    monkeypatch.setattr(S, "apply_deadline", lambda d, gloo: rec.deadlines.append((d, gloo)))
    monkeypatch.setattr(S, "run_torchrun", run_torchrun)
    monkeypatch.setattr(S, "device_for", lambda *a: rec.devices.append(a))
    return rec


# ---- the pool ---------------------------------------------------------------------------

def test_the_pool_run_opens_the_session_as_asked_and_prints_the_plan_then_the_report(
        sync, capsys):
    assert main(["sync", "--config", "toy_kv4", *ROUTE, "--seed", "3", "--dp", "2",
                 "--bucket", "4096", "--into", "existing", "--deadline", "7"]) == 0
    (s,) = Session.opened
    assert (s.config, s.src, s.dst, s.kw) == (
        TOY_KV4, "megatron:2", "vllm:1", {"seed": 3, "dp": 2, "forward": True, "weights": None})
    assert s.closed
    assert s.runs == [(execute_plan, {"plan": None, "bucket_bytes": 4096, "calibrate": True,
                                      "into": "existing"})]
    assert sync.floors == [(TOY_KV4, "1b")]
    assert sync.ranks == [plan_for(sync_layout(TOY_KV4, "megatron:2", dp=2),
                                   sync_layout(TOY_KV4, "vllm:1")).world] == [4]
    assert sync.deadlines == [(7.0, True)]
    assert sync.ticks == [
        ("prefix", "wsb sync "),
        (0, 2, "megatron:2 -> vllm:1: starting the rank processes, loading the source shards"),
        (1, 2, ("megatron:2 -> vllm:1: resharding, checking every element, the destination "
                "forward")),
        (2, 2, "megatron:2 -> vllm:1: done")]
    out, err = capsys.readouterr()
    assert out == "the plan\n\nreport of first\n"
    lines = err.splitlines()  # not a terminal: the first step, then the last at close
    assert lines[0].startswith("wsb sync megatron:2 -> vllm:1: starting the rank processes, "
                               "loading the source shards: 0/2, ") and lines[0].endswith("ETA ?")
    assert lines[-1].startswith("wsb sync megatron:2 -> vllm:1: done: 2/2, ")
    assert s.plan.limits == []


def test_naive_runs_second_without_a_forward_and_only_the_first_run_is_judged(sync, capsys,
                                                                             tiny):
    model = ["--hf-config", str(tiny), "--layers", "1", *ROUTE, "--no-forward"]
    Session.outcomes = [("first", True), ("naive", False)]
    assert main(["sync", *model, "--naive", "--bucket", "512", "--transfers"]) == 0
    (s,) = Session.opened
    assert s.kw == {"seed": 0, "dp": 1, "forward": False, "weights": None}
    assert s.config == ModelConfig.from_hf_config(tiny, n_layers=1)
    assert s.runs == [
        (execute_plan, {"plan": None, "bucket_bytes": 512, "calibrate": True, "into": "fresh"}),
        (gather_scatter, {"bucket_bytes": 512, "calibrate": True, "forward": False,
                          "into": "fresh"})]
    assert sync.floors == []  # --no-forward: no floor needed
    assert sync.deadlines == [(None, True)]
    assert [t for t in sync.ticks if t[0] != "prefix"] == [
        (0, 3, "megatron:2 -> vllm:1: starting the rank processes, loading the source shards"),
        (1, 3, "megatron:2 -> vllm:1: resharding, checking every element"),
        (2, 3, "megatron:2 -> vllm:1: the naive gather-then-scatter"),
        (3, 3, "megatron:2 -> vllm:1: done")]
    out = capsys.readouterr().out
    assert out == "the plan\nevery transfer\n\nreport of first\n\nreport of naive\n"
    assert s.plan.limits == [None]  # every transfer, not the first few
    Session.outcomes = [("first", False), ("naive", True)]
    assert main(["sync", *model, "--naive", "-q"]) == 1
    assert capsys.readouterr() == ("the plan\n\nreport of first\n\nreport of naive\n", "")


def test_under_json_each_run_is_a_sync_record_and_the_summary_is_the_first_runs(sync, capsys,
                                                                               tiny):
    Session.outcomes = [("first", False), ("naive", True)]
    assert main(["sync", "--config", "toy_kv4", *ROUTE, "--naive", "--json"]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    first, naive = (Result("first", False, Plan(), verdict=SimpleNamespace(
        max_abs_error=1e-6, threshold=1e-3)), Result("naive", True, Plan()))
    assert records == [record_of(first), record_of(naive),
                       {"kind": "summary", "command": "sync", "exit_code": 1, "passed": False}]
    assert records[0]["max_abs_error"] == 1e-6 and records[1]["threshold"] is None
    Session.outcomes = [("first", True)]
    assert main(["sync", "--config", "toy_kv4", *ROUTE, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
        "kind": "summary", "command": "sync", "exit_code": 0, "passed": True}


def test_a_planner_mutation_runs_in_place_of_the_plan(sync, monkeypatch, tiny):
    mutated = []
    monkeypatch.setitem(S.PLAN_MUTATIONS, "dropped_transfer",
                        lambda plan: mutated.append(plan) or "the mutated plan")
    Session.outcomes = [("first", False)]
    assert main(["sync", "--hf-config", str(tiny), "--layers", "1", *ROUTE, "--no-forward",
                 "--mutation", "dropped_transfer", "-q"]) == 1
    (s,) = Session.opened
    assert mutated == [s.plan]
    assert s.runs[0][1]["plan"] == "the mutated plan" and s.runs[0][0] is execute_plan


def test_a_users_resharder_runs_in_place_of_the_executor_and_is_refused_with_what_changes_it(
        sync, capsys, tiny, tmp_path, monkeypatch):
    from tests.sync import resharders

    model = ["--hf-config", str(tiny), "--layers", "1", *ROUTE, "--no-forward", "-q"]
    assert main(["sync", *model, "--resharder", "tests.sync.resharders:flip_one_bit"]) == 0
    assert Session.opened[0].runs[0][0] is resharders.flip_one_bit
    refusal = ("wsb sync: --resharder runs on the rank pool (--launcher pool), without "
               "--mutation or --naive (they change the harness's own executor)\n")
    for extra in (["--naive"], ["--mutation", "box_overlap"], ["--launcher", "torchrun"]):
        capsys.readouterr()
        assert main(["sync", *model, "--resharder", "tests.sync.resharders:flip_one_bit",
                     *extra]) == 2
        assert capsys.readouterr().err == refusal
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["sync", *model, "--resharder", "broken_at_import:fn"]) == 4
    assert capsys.readouterr().err.startswith(
        "wsb sync: your resharder `broken_at_import:fn` raised RuntimeError at import: no")
    sys.modules.pop("broken_at_import", None)
    assert len(Session.opened) == 1  # nothing refused started a session


def test_the_pool_refuses_another_backend_naming_the_launcher(sync, capsys):
    assert main(["sync", "--config", "toy_kv4", *ROUTE, "--backend", "nccl"]) == 2
    assert sync.devices == [("nccl", 0)]  # asked first: without CUDA it says why
    assert capsys.readouterr().err == ("wsb sync: --backend nccl needs --launcher torchrun "
                                       "(the rank pool runs gloo on CPU)\n")
    assert not Session.opened and not sync.ranks


def test_more_ranks_than_the_pool_starts_are_refused_before_any_session(sync, capsys,
                                                                        monkeypatch):
    monkeypatch.setenv("WSB_MAX_RANKS", "3")
    assert main(["sync", "--config", "toy_kv4", *ROUTE, "--dp", "2", "--no-forward"]) == 2
    assert sync.ranks == [4] and not Session.opened
    assert capsys.readouterr().err.startswith("wsb sync: 4 rank processes asked for ")


# ---- the floor, the geometry and the weights --------------------------------------------

def test_a_forward_no_floor_covers_is_refused_naming_the_command(sync, capsys, tiny,
                                                                 monkeypatch):
    model = ["--hf-config", str(tiny), "--layers", "1", "--vocab", "256", *ROUTE]
    assert main(["sync", *model]) == 2
    err = capsys.readouterr().err
    config = ModelConfig.from_hf_config(tiny, n_layers=1, vocab=256)
    assert sync.floors == [(config, "1b")]
    command = f"wsb floor geometry --hf-config {tiny} --layers 1 --vocab 256 --phase 1b"
    assert err.startswith("wsb sync: the destination forward of tiny_llama needs a phase 1b "
                          "floor (tiny_llama: no measured floor covers this check (phase 1b")
    assert err.endswith(f"). Measure it with `{command}`; --no-forward checks every "
                        "destination element bit for bit, the bytes, the time and each "
                        "rank's memory without one\n")
    assert not Session.opened

    def no_floor(config, phase):
        raise FloorNotMeasured("long message", command="measure it so", why="no toy_kv4 floor")
    monkeypatch.setattr(S, "floor_for", no_floor)  # a committed geometry: its own command
    with pytest.raises(FloorNotMeasured) as e:
        S.cmd_sync(build_parser().parse_args(["sync", "--config", "toy_kv4", *ROUTE]))
    assert str(e.value) == (
        "the destination forward of toy_kv4 needs a phase 1b floor (no toy_kv4 floor). "
        "Measure it with `measure it so`; --no-forward checks every destination element bit "
        "for bit, the bytes, the time and each rank's memory without one")
    assert e.value.command == "measure it so" and e.value.__cause__ is None
    assert e.value.__suppress_context__


def test_a_geometry_over_the_budget_is_refused_before_the_floor(sync, capsys):
    assert main(["sync", "--config", "toy_kv4", *ROUTE, "--max-gib", "0.001"]) == 2
    assert capsys.readouterr().err.startswith("wsb sync: toy_kv4: ")
    assert not sync.floors and not Session.opened


def test_weights_move_in_the_geometry_their_directory_states(sync, capsys, tiny, tmp_path):
    hf = tmp_path / "hf"
    assert main(["emit", "--convention", "hf", "--hf-config", str(tiny), "--layers", "1",
                 "-q", str(hf)]) == 0
    assert main(["sync", "--weights", str(hf), *ROUTE, "-q"]) == 0
    (s,) = Session.opened
    assert s.config == ModelConfig.from_hf_config(tiny, n_layers=1)
    assert s.kw == {"seed": 0, "dp": 1, "forward": True, "weights": hf}
    assert sync.floors == []  # measured on the weights
    assert main(["sync", "--weights", str(hf), "--config", "toy_kv4", *ROUTE, "-q"]) == 0
    assert Session.opened[-1].config is TOY_KV4  # given: checked against the directory later
    assert main(["sync", "--weights", str(hf), "--hf-config", str(tiny), "--layers", "1",
                 "--vocab", "256", *ROUTE, "-q"]) == 0
    assert Session.opened[-1].config == ModelConfig.from_hf_config(tiny, n_layers=1, vocab=256)
    capsys.readouterr()
    (tmp_path / "mg" / "mp_rank_00").mkdir(parents=True)
    assert main(["sync", "--weights", str(tmp_path / "mg"), *ROUTE]) == 2
    assert capsys.readouterr().err == (
        f"wsb sync: {tmp_path / 'mg'}: a Megatron checkpoint's args state sizes, not the "
        "whole model (vocabulary, norms, rope): give --config NAME or --hf-config PATH (as "
        "Megatron-Bridge's export takes its Hugging Face config); the args are checked "
        "against it\n")
    assert main(["sync", "--weights", str(hf), *ROUTE, "--launcher", "torchrun"]) == 2
    assert capsys.readouterr().err == ("wsb sync: --weights runs on the rank pool (--launcher "
                                       "pool); under torchrun the values are the seed's\n")
    assert len(Session.opened) == 3 and not sync.jobs


# ---- torchrun ---------------------------------------------------------------------------

def test_under_torchrun_the_job_gets_every_option_and_rank_0_alone_prints(sync, capsys):
    argv = ["sync", "--launcher", "torchrun", "--config", "toy_kv4", *ROUTE, "--dp", "2",
            "--seed", "5", "--bucket", "1024", "--into", "existing"]
    assert main(argv) == 0  # a rank other than 0: run_torchrun returns None
    assert capsys.readouterr() == ("", "")
    (args, kw), = sync.jobs
    assert args == (TOY_KV4, "megatron:2", "vllm:1")
    expected = job_options(build_parser().parse_args(argv))
    assert kw == {"dp": 2, "seed": 5, "bucket_bytes": 1024, "forward_check": True,
                  "backend": "gloo", "deadline": 300.0, "into": "existing",
                  "options": expected}
    assert expected["--from"] == "megatron:2" and expected["--seed"] == "5"
    assert sync.floors == [(TOY_KV4, "1b")] and not sync.ranks and not sync.deadlines
    plan = Plan()
    sync.torchrun_result = Result("rank 0", False, plan)
    assert main([*argv, "--no-forward", "--deadline", "9", "--transfers"]) == 1
    assert sync.jobs[-1][1]["forward_check"] is False and sync.jobs[-1][1]["deadline"] == 9.0
    assert capsys.readouterr().out == "the plan\nevery transfer\n\nreport of rank 0\n"
    assert plan.limits == [None] and not Session.opened
    for extra in (["--naive"], ["--mutation", "box_overlap"]):
        assert main([*argv, *extra]) == 2
        assert capsys.readouterr().err == ("wsb sync: --mutation and --naive run on the rank "
                                           "pool only (--launcher pool)\n")
    assert len(sync.jobs) == 2


# ---- the parser -------------------------------------------------------------------------

def test_sync_parses_to_its_command_with_its_defaults():
    a = build_parser().parse_args(["sync"])
    assert (a.func, a.config_default, a.src, a.dst, a.dp, a.seed, a.weights, a.bucket,
            a.no_forward, a.naive, a.transfers, a.resharder, a.mutation, a.into, a.launcher,
            a.backend, a.deadline) == (
        S.cmd_sync, "toy_kv4", "megatron:4", "vllm:2", 1, 0, None, DEFAULT_BUCKET, False,
        False, False, None, None, "fresh", "pool", "gloo", None)
    assert a.option_names["src"] == "--from" and a.option_names["dst"] == "--to"
    assert a.option_names["no_forward"] == "--no-forward"
    a = build_parser().parse_args(["sync", "--weights", "w", "--dp", "3", "--bucket", "64",
                                   "--no-forward", "--naive", "--transfers", "--into",
                                   "existing", "--launcher", "torchrun", "--mutation",
                                   "dropped_transfer", "--resharder", "m:f"])
    assert (a.weights, a.dp, a.bucket, a.no_forward, a.naive, a.transfers, a.into,
            a.launcher, a.mutation, a.resharder) == (
        Path("w"), 3, 64, True, True, True, "existing", "torchrun", "dropped_transfer", "m:f")
    for bad in (["--dp", "0"], ["--bucket", "0"], ["--seed", "-1"], ["--into", "stale"],
                ["--mutation", "nope"], ["--launcher", "mpi"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["sync", *bad])
    assert isinstance(build_parser().parse_args(["sync", "--weights", "w"]).weights, Path)

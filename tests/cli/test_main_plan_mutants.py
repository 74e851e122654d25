"""How ``wsb check`` plans its checks, how ``wsb layout`` prints, and how a check's memory
budget is sized (issue 30, the mutation pass over ``cli/main.py``'s ``build_parser``,
``_plan``, ``_convert_plan``, ``_weights_plan``, ``_weights_job``, ``_weights_config``,
``ensure_floor``, ``_models``, ``_within_budget``, ``memory_budget``, ``_options``,
``_pairs`` and ``cmd_layout``).

The plan is what a CI run of ``wsb check`` is: a check left out, a pair taken from the
wrong degrees, a function called with another check's keywords, a floor read for the wrong
phase or dtype, a geometry skipped where it should have been refused (or the reverse) would
each make a run pass without checking what it says it checked. Here every expensive step is
stood in by a recording fake (the checks, the checker and its sweep, the floor look-up and
measurement, the weights' loading, the user's function), so each test pins the labels, the
order, every argument of every call and each refusal's text and type; the checks themselves
are ``test_main.py``'s, ``test_convert_cli.py``'s and ``test_real_width_cli.py``'s.

The rules pinned are the module's own documented ones: ``check.checker.degree_pairs`` (every
ordered pair of supported degrees, src == dst included) is what a sweep without --src/--dst
checks; ``cli.launch.launched`` sets the pool's backend (``inprocess``) before a command
runs, so ``parse`` below does too; ``phase_of`` (1b over gloo, else 1a) names the floor."""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from weight_sync_bench.cli.output import ProgressLine, Ticker
from weight_sync_bench.conventions import convention_by_name, endpoint, render
from weight_sync_bench.conventions.table import render_ranks
from weight_sync_bench.errors import (
    FloorNotMeasured,
    GeometryTooLarge,
    UnsupportedLayout,
    WsbError,
)
from weight_sync_bench.model.config import CONFIGS, TOY, TOY_KV4, TOY_MOE, ModelConfig
from weight_sync_bench.model.footprint import GIB, Limits
from weight_sync_bench.model.plan import layout_for

M = importlib.import_module("weight_sync_bench.cli.main")  # the package exports main()

P = object()  # a progress callback handed to a job: passed through, never called here
WEIGHTS = Path("/nonexistent/weights")  # never read: held_weights is stood in


def parse(*argv: str) -> argparse.Namespace:
    """``wsb check ARGV``'s namespace, its backend set as ``launched`` sets it (the parser
    built once, as ``main`` builds it: 30 ms a build)."""
    args = M._parser("wsb").parse_args(["check", *argv])
    args.backend = args.backend or "inprocess"
    return args


def unsupported(config: ModelConfig, degree: int) -> str:
    """The declared layout's own refusal of ``degree`` (``LayoutTable.validate``)."""
    with pytest.raises(UnsupportedLayout) as info:
        layout_for(config).validate(degree)
    return str(info.value)


class Stand:
    """The recording stand-ins: ``calls`` in order as (name, positional, keywords); a check
    returns ``("verdict", name, n)`` (n: its place in ``calls``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.floors: list[tuple] = []  # ensure_floor's (args, config, line, first)
        self.refuse: dict[str, Exception] = {}  # require_stored raises for these configs

    def fake(self, name: str, result=None):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if result is not None:
                return result(*args, **kwargs)
            return ("verdict", name, len(self.calls) - 1)
        return call

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]


def fn(*args, **kwargs):  # the user's function load_function hands back
    raise AssertionError("the checks are stood in: the function is never called")


@pytest.fixture
def stand(monkeypatch):
    s = Stand()
    for name in ("check_split", "check_reshard", "check_convert", "stream_check"):
        monkeypatch.setattr(M, name, s.fake(name))
    monkeypatch.setattr(M, "checker_for", s.fake(
        "checker_for", lambda config, **k: ("checker", config.name, len(s.calls))))
    monkeypatch.setattr(M, "sweep", s.fake(
        "sweep", lambda config, *, pairs, seed, checker: (("swept", config.name, pairs[0]),)))
    monkeypatch.setattr(M, "load_function", s.fake("load_function", lambda spec, role: fn))
    monkeypatch.setattr(M, "held_weights", s.fake("held_weights", lambda w, c: {"held": c.name}))

    def require_stored(config, where):
        s.calls.append(("require_stored", (config, where), {}))
        if config.name in s.refuse:
            raise s.refuse[config.name]
    monkeypatch.setattr(M, "require_stored", require_stored)

    def ensure_floor(args, config, line, first=None):
        s.floors.append((args, config, line, first))
    monkeypatch.setattr(M, "ensure_floor", ensure_floor)
    return s


# ---- _pairs, _options, memory_budget -------------------------------------------------------

def test_pairs_are_every_src_by_every_dst_unless_one_is_given():
    def pairs(src, dst):
        return M._pairs(argparse.Namespace(src=src, dst=dst), [1, 2, 4])

    assert pairs(None, None) == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1),
                                 (4, 2), (4, 4)]
    assert pairs(2, None) == [(2, 1), (2, 2), (2, 4)]
    assert pairs(None, 4) == [(1, 4), (2, 4), (4, 4)]
    assert pairs(8, 1) == [(8, 1)]  # taken as given: the layout validates them


def test_options_are_the_five_keywords_a_users_check_takes_from_the_command_line():
    args = parse("--seed", "7", "--backend", "gloo", "--dtype", "bf16", "--measure-floor",
                 "--stream", "layer")
    assert M._options(args) == {"seed": 7, "backend": "gloo", "dtype": "bf16",
                                "measure_floor": True, "stream": "layer"}


def test_the_memory_budget_is_the_flag_in_gib_else_half_this_machines_memory():
    assert M.memory_budget(parse("--memory-budget", "1.5")) == int(1.5 * GIB)
    assert M.memory_budget(parse("--memory-budget", "4")) == 4 * GIB
    half = int(Limits().max_bytes * 0.5)
    assert M.MEMORY_SHARE == 0.5
    assert M.memory_budget(parse()) == half
    assert M.memory_budget(argparse.Namespace()) == half  # a command without the flag


# ---- _within_budget -------------------------------------------------------------------------

@pytest.fixture
def sized(monkeypatch):
    """``footprint`` stood in: TOY held whole needs 3.5 GiB, a layer of it 0.125 GiB."""
    asked = []

    def footprint(config, unit="model"):  # the real default
        asked.append((config.name, unit))
        return SimpleNamespace(bytes={"model": int(3.5 * GIB), "layer": GIB // 8}[unit])
    monkeypatch.setattr(M, "footprint", footprint)
    return asked


WHY = ("toy held whole would need about 3.5 GiB, over the memory budget of 2 GiB "
       "(--memory-budget; default half of this machine's memory)")


def test_past_the_budget_the_harness_own_check_streams_per_layer_saying_why(sized):
    args = parse("--memory-budget", "2")
    M._within_budget(args, TOY)
    assert args.stream == "layer"
    assert args.auto_stream == f"streamed per layer: {WHY}; per layer about 0.125 GiB"
    assert sized == [("toy", "model"), ("toy", "layer")]


def test_at_the_budget_nothing_changes_and_a_given_stream_is_not_estimated(sized):
    args = parse("--memory-budget", "3.5")  # exactly the estimate: within
    M._within_budget(args, TOY)
    assert args.stream is None and not hasattr(args, "auto_stream")
    assert sized == [("toy", "model")]
    args = parse("--memory-budget", "2", "--stream", "parameter")
    M._within_budget(args, TOY)
    assert args.stream == "parameter" and not hasattr(args, "auto_stream")
    assert sized == [("toy", "model")]  # not even estimated


@pytest.mark.parametrize("role", ["--resharder", "--splitter", "--converter"])
def test_past_the_budget_a_users_function_is_refused_naming_stream(sized, role):
    args = parse("--memory-budget", "2", role, "m:f")
    with pytest.raises(GeometryTooLarge) as info:
        M._within_budget(args, TOY)
    assert str(info.value) == (
        f"{WHY}: pass --stream layer (your function is then called once per layer, with a "
        "dict of that layer's tensors) or --stream parameter, or raise --memory-budget")
    assert info.value.estimate == int(3.5 * GIB)
    assert args.stream is None and sized == [("toy", "model")]


# ---- _models --------------------------------------------------------------------------------

@pytest.fixture
def guarded(monkeypatch):
    seen = []
    monkeypatch.setattr(M, "_within_budget", lambda args, config: seen.append(
        ("budget", args, config.name)))
    monkeypatch.setattr(M, "guard", lambda args, config, **k: seen.append(
        ("guard", args, config.name, k)))
    return seen


HINT = "; --stream parameter holds one parameter at a time"


def test_models_are_every_dense_config_by_default_each_budgeted_then_guarded(guarded):
    args = parse()
    assert M._models(args) == list(CONFIGS.values()) == [TOY, TOY_KV4]
    assert guarded == [("budget", args, "toy"), ("guard", args, "toy", {"unit": "model",
                                                                        "hint": HINT}),
                       ("budget", args, "toy_kv4"), ("guard", args, "toy_kv4",
                                                     {"unit": "model", "hint": HINT})]


def test_models_are_the_named_config_and_a_streamed_check_is_guarded_per_unit(guarded):
    args = parse("--config", "toy", "--stream", "parameter")
    assert M._models(args) == [TOY]
    assert guarded == [("budget", args, "toy"),
                       ("guard", args, "toy", {"unit": "parameter", "hint": ""})]
    assert M._models(parse("--config", "toy_kv4")) == [TOY_KV4]
    assert M._models(parse("--config", "toy_moe")) == [TOY_MOE]


def test_models_are_the_hf_config_alone(guarded, tiny):
    args = parse("--hf-config", str(tiny), "--layers", "1", "--stream", "layer")
    (config,) = M._models(args)
    assert config == ModelConfig.from_hf_config(tiny, n_layers=1)
    assert guarded == [("budget", args, "tiny_llama"),
                       ("guard", args, "tiny_llama", {"unit": "layer", "hint": ""})]


# ---- ensure_floor ---------------------------------------------------------------------------

class Line:
    """A progress line that keeps what it was shown."""

    def __init__(self, live: bool = False) -> None:
        self.live, self.shown = live, []

    def show(self, text: str) -> None:
        self.shown.append(text)


@pytest.fixture
def floors(monkeypatch):
    """``floor_for`` (raising ``missing`` when set), ``measure_geometry`` and
    ``floor_command`` stood in, their calls in one list."""
    s = SimpleNamespace(calls=[], missing=None, command="CMD")

    def floor_for(config, phase="1a", dtype="fp32"):  # its defaults
        s.calls.append(("floor_for", config.name, phase, dtype))
        if s.missing is not None:
            raise s.missing
    monkeypatch.setattr(M, "floor_for", floor_for)
    def measure_geometry(config, *, phase="1a", dtype="fp32", progress=None):  # its defaults
        s.calls.append(("measure", config.name, {"phase": phase, "dtype": dtype,
                                                 "progress": progress}))
    monkeypatch.setattr(M, "measure_geometry", measure_geometry)

    def floor_command(args, config):
        s.calls.append(("floor_command", args, config.name))
        return s.command
    monkeypatch.setattr(M, "floor_command", floor_command)
    return s


def floor_args(**kw):
    return argparse.Namespace(**{"backend": "inprocess", "dtype": "bf16", "measure_floor": False,
                                 "hf_config": None, **kw})


def first_job(calls):
    def job(progress, **over):
        calls.append(("first", progress, over))
    return ("toy 1 -> 2", job)


def test_a_measured_floor_is_read_for_the_phase_and_dtype_and_nothing_else_runs(floors):
    line = Line()
    M.ensure_floor(floor_args(), TOY, line, first=first_job(floors.calls))
    M.ensure_floor(floor_args(backend="gloo", dtype="fp16", measure_floor=True), TOY_KV4, line)
    assert floors.calls == [("floor_for", "toy", "1a", "bf16"),
                            ("floor_for", "toy_kv4", "1b", "fp16")]
    assert line.shown == []


def test_a_committed_geometry_without_its_floor_is_refused_as_floor_for_refused_it(floors):
    floors.missing = FloorNotMeasured("no floor covers toy", command="wsb floor ...")
    with pytest.raises(FloorNotMeasured) as info:
        M.ensure_floor(floor_args(), TOY, Line())
    assert info.value is floors.missing
    assert floors.calls == [("floor_for", "toy", "1a", "bf16")]


@pytest.mark.parametrize("same", [True, False])
def test_an_hf_geometry_without_its_floor_is_refused_naming_the_command(floors, same):
    floors.missing = FloorNotMeasured("no floor covers tiny", command="CMD" if same else "other")
    args = floor_args(hf_config="tiny/config.json")
    with pytest.raises(FloorNotMeasured) as info:
        M.ensure_floor(args, TOY, Line(), first=first_job(floors.calls))
    how = ("rerun this check with --measure-floor (it measures the floor once and caches it)"
           if same else "`CMD` (once; the checks then read the cached floor), or rerun this "
           "check with --measure-floor")
    assert type(info.value) is FloorNotMeasured
    assert str(info.value) == f"no floor covers tiny.\nFrom the command line: {how}"
    assert info.value.command == "CMD"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert floors.calls == [("floor_for", "toy", "1a", "bf16"), ("floor_command", args, "toy")]


@pytest.mark.parametrize("live", [False, True])
def test_measure_floor_calls_the_function_once_then_measures_phase_1a(floors, live):
    floors.missing = FloorNotMeasured("no floor covers toy")
    line = Line(live)
    M.ensure_floor(floor_args(measure_floor=True), TOY, line, first=first_job(floors.calls))
    [floor, first, (measure, name, keywords)] = floors.calls
    assert floor == ("floor_for", "toy", "1a", "bf16")
    assert first == ("first", None, {"threshold": math.inf, "backend": "inprocess",
                                     "measure_floor": False})
    assert (measure, name) == ("measure", "toy")
    progress = keywords.pop("progress")
    assert keywords == {"phase": "1a", "dtype": "bf16"}
    if live:
        assert isinstance(progress, Ticker) and progress.line is line
    else:
        assert progress is None
    assert line.shown == [
        "calling your function once (toy 1 -> 2) before measuring the floor of toy ...",
        "measuring the floor of toy (once; cached) ..."]


def test_measure_floor_over_gloo_leaves_the_measuring_to_the_checker(floors):
    floors.missing = FloorNotMeasured("no floor covers toy_kv4")
    line = Line()
    M.ensure_floor(floor_args(measure_floor=True, backend="gloo"), TOY_KV4, line,
                   first=first_job(floors.calls))
    assert [c[0] for c in floors.calls] == ["floor_for", "first"]
    assert line.shown == [("calling your function once (toy 1 -> 2) before measuring the floor "
                          "of toy_kv4 ...")]
    floors.calls.clear()
    M.ensure_floor(floor_args(measure_floor=True), TOY, line)  # no function: measured alone
    assert floors.calls == [("floor_for", "toy", "1a", "bf16"),
                            ("measure", "toy", {"phase": "1a", "dtype": "bf16",
                                                "progress": None})]


# ---- _plan: the harness's own checks --------------------------------------------------------

def pairs_of(config: ModelConfig) -> list[tuple[int, int]]:
    degrees = layout_for(config).supported_degrees()
    return [(s, d) for s in degrees for d in degrees]  # check.checker.degree_pairs' rule


def test_the_default_plan_sweeps_every_pair_of_every_config_with_one_checker_each(stand):
    args = parse("--seed", "7", "--dtype", "bf16", "--measure-floor")
    line = ProgressLine(enabled=False)
    jobs, skipped = M._plan(args, line)
    assert skipped == []
    assert pairs_of(TOY) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [label for label, _ in jobs] == (
        [f"toy {s} -> {d}" for s, d in pairs_of(TOY)]
        + [f"toy_kv4 {s} -> {d}" for s, d in pairs_of(TOY_KV4)])
    assert [(a, c, ln, first) for a, c, ln, first in stand.floors] == [
        (args, TOY, line, None), (args, TOY_KV4, line, None)]
    assert stand.calls == []  # nothing is built before a job runs
    verdicts = [job(P) for _, job in jobs]
    assert verdicts == ([("swept", "toy", p) for p in pairs_of(TOY)]
                        + [("swept", "toy_kv4", p) for p in pairs_of(TOY_KV4)])
    checkers = stand.named("checker_for")
    assert checkers == [((TOY,), {"seed": 7, "backend": "inprocess", "dtype": "bf16",
                                  "measure_floor": True}),
                        ((TOY_KV4,), {"seed": 7, "backend": "inprocess", "dtype": "bf16",
                                      "measure_floor": True})]
    toy_checker, kv4_checker = ("checker", "toy", 1), ("checker", "toy_kv4", 6)
    assert stand.named("sweep") == (
        [((TOY,), {"pairs": [p], "seed": 7, "checker": toy_checker}) for p in pairs_of(TOY)]
        + [((TOY_KV4,), {"pairs": [p], "seed": 7, "checker": kv4_checker})
           for p in pairs_of(TOY_KV4)])


def test_a_given_src_or_dst_narrows_the_sweep_to_its_pairs(stand):
    jobs, _ = M._plan(parse("--config", "toy_kv4", "--src", "2"), ProgressLine(enabled=False))
    assert [label for label, _ in jobs] == ["toy_kv4 2 -> 1", "toy_kv4 2 -> 2", "toy_kv4 2 -> 4"]
    jobs, _ = M._plan(parse("--config", "toy_kv4", "--dst", "4"), ProgressLine(enabled=False))
    assert [label for label, _ in jobs] == ["toy_kv4 1 -> 4", "toy_kv4 2 -> 4", "toy_kv4 4 -> 4"]
    assert [job(P) for _, job in jobs] == [("swept", "toy_kv4", (s, 4)) for s in (1, 2, 4)]
    jobs, _ = M._plan(parse("--config", "toy", "--src", "2", "--dst", "1"),
                      ProgressLine(enabled=False))
    assert [label for label, _ in jobs] == ["toy 2 -> 1"]


def test_a_streamed_plan_checks_each_pair_streamed(stand):
    args = parse("--config", "toy", "--stream", "parameter", "--seed", "3", "--dtype", "fp16",
                 "--measure-floor")
    line = ProgressLine(enabled=False)
    jobs, skipped = M._plan(args, line)
    assert skipped == [] and [label for label, _ in jobs] == [
        f"toy {s} -> {d}" for s, d in pairs_of(TOY)]
    assert [(a, c, first) for a, c, _, first in stand.floors] == [(args, TOY, None)]
    assert [job(P) for _, job in jobs] == [("verdict", "stream_check", n) for n in range(4)]
    assert stand.named("stream_check") == [
        ((TOY, d), {"src": s, "per": "parameter", "seed": 3, "dtype": "fp16",
                    "measure_floor": True, "progress": P, "backend": "inprocess"})
        for s, d in pairs_of(TOY)]
    jobs, _ = M._plan(parse("--stream", "layer", "--src", "1"), line)
    assert [label for label, _ in jobs] == ["toy 1 -> 1", "toy 1 -> 2", "toy_kv4 1 -> 1",
                                            "toy_kv4 1 -> 2", "toy_kv4 1 -> 4"]
    stand.calls.clear()
    jobs[-1][1](None)
    assert stand.named("stream_check") == [
        ((TOY_KV4, 4), {"src": 1, "per": "layer", "seed": 0, "dtype": "fp32",
                        "measure_floor": False, "progress": None, "backend": "inprocess"})]


@pytest.mark.parametrize("flag", ["--src", "--dst"])
def test_over_every_config_an_unsupported_degree_skips_the_config_naming_the_rule(stand, flag):
    rule = unsupported(TOY, 4)
    assert rule == ("layers.0.qkv.weight: HeadPartitioned needs n_kv_heads % t == 0 "
                    "(n_kv_heads=2, t=4)")
    jobs, skipped = M._plan(parse(flag, "4"), ProgressLine(enabled=False))
    assert skipped == [f"skipped toy: {rule}"]
    pairs = [(4, d) for d in (1, 2, 4)] if flag == "--src" else [(s, 4) for s in (1, 2, 4)]
    assert [label for label, _ in jobs] == [f"toy_kv4 {s} -> {d}" for s, d in pairs]
    assert [c.name for _, c, _, _ in stand.floors] == ["toy_kv4"]


@pytest.mark.parametrize("flag", ["--src", "--dst"])
def test_for_one_config_an_unsupported_degree_is_refused_naming_it(stand, flag):
    with pytest.raises(WsbError) as info:
        M._plan(parse("--config", "toy", flag, "4"), ProgressLine(enabled=False))
    assert type(info.value) is WsbError
    assert str(info.value) == f"toy: {unsupported(TOY, 4)}"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert stand.floors == []


def test_a_plan_without_a_line_shows_nothing(stand, capsys, monkeypatch):
    monkeypatch.setattr(M, "ensure_floor", lambda args, config, line, first=None: line.show(
        f"measuring the floor of {config.name}"))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a log: every line shown
    M._plan(parse("--config", "toy"))
    assert capsys.readouterr().err == ""
    M._plan(parse("--config", "toy"), ProgressLine())  # the twin: a line that shows
    assert capsys.readouterr().err == "measuring the floor of toy\n"


# ---- _plan: a user's splitter or resharder ------------------------------------------------

def test_a_resharder_is_checked_at_every_pair_its_first_check_called_before_the_floor(stand):
    args = parse("--resharder", "mine:reshard", "--seed", "5", "--dtype", "bf16",
                 "--stream", "layer")
    line = ProgressLine(enabled=False)
    jobs, skipped = M._plan(args, line)
    assert stand.calls[:1] == [("load_function", ("mine:reshard", "resharder"), {})]
    assert skipped == [] and [label for label, _ in jobs] == (
        [f"toy {s} -> {d}" for s, d in pairs_of(TOY)]
        + [f"toy_kv4 {s} -> {d}" for s, d in pairs_of(TOY_KV4)])
    # every config's floor, each with its own first check (the same job the plan runs)
    assert [(a, c, ln) for a, c, ln, _ in stand.floors] == [(args, TOY, line),
                                                            (args, TOY_KV4, line)]
    assert stand.floors[0][3] is jobs[0] and stand.floors[1][3] is jobs[4]
    stand.calls.clear()
    assert jobs[5][1](P) == ("verdict", "check_reshard", 0)
    assert jobs[1][1](None, threshold=math.inf, backend="inprocess") == (
        "verdict", "check_reshard", 1)
    common = {"seed": 5, "backend": "inprocess", "dtype": "bf16", "measure_floor": False,
              "stream": "layer"}
    assert stand.calls == [
        ("check_reshard", (fn, TOY_KV4, 1, 2), {"progress": P, **common}),
        ("check_reshard", (fn, TOY, 1, 2), {"progress": None, **common,
                                            "threshold": math.inf})]


def test_a_splitter_is_checked_at_every_dst_or_the_one_given(stand):
    args = parse("--splitter", "mine:split", "--config", "toy_kv4", "--measure-floor")
    jobs, _ = M._plan(args, ProgressLine(enabled=False))
    assert stand.calls == [("load_function", ("mine:split", "splitter"), {})]
    assert [label for label, _ in jobs] == ["toy_kv4 split -> 1", "toy_kv4 split -> 2",
                                            "toy_kv4 split -> 4"]
    assert stand.floors[0][3] is jobs[0]
    stand.calls.clear()
    jobs[2][1](P, measure_floor=False)
    assert stand.calls == [("check_split", (fn, TOY_KV4, 4), {
        "progress": P, "seed": 0, "backend": "inprocess", "dtype": "fp32",
        "measure_floor": False, "stream": None})]
    jobs, _ = M._plan(parse("--splitter", "m:f", "--dst", "2"), ProgressLine(enabled=False))
    assert [label for label, _ in jobs] == ["toy split -> 2", "toy_kv4 split -> 2"]
    assert stand.floors[-1][3] is jobs[1]


def test_with_weights_a_splitter_or_resharder_goes_to_the_weights_plan(stand, monkeypatch):
    planned = []
    monkeypatch.setattr(M, "_weights_plan", lambda args, f, role: planned.append(
        (args, f, role)) or ["weights jobs"])
    for role in ("splitter", "resharder"):
        args = parse(f"--{role}", "m:f", "--weights", str(WEIGHTS))
        assert M._plan(args, ProgressLine(enabled=False)) == (["weights jobs"], [])
        assert planned[-1] == (args, fn, role)
    assert stand.floors == []


def test_weights_without_a_function_are_refused(stand):
    with pytest.raises(WsbError) as info:
        M._plan(parse("--weights", str(WEIGHTS)), ProgressLine(enabled=False))
    assert str(info.value) == ("--weights is your function's input: give --converter, "
                               "--splitter or --resharder")
    assert stand.calls == []


@pytest.mark.parametrize("given", [["--from", "megatron:2"], ["--to", "vllm:2"],
                                   ["--from", "megatron:2", "--to", "vllm:2"]])
def test_from_or_to_without_a_converter_is_refused(stand, given):
    with pytest.raises(WsbError) as info:
        M._plan(parse(*given), ProgressLine(enabled=False))
    assert str(info.value) == ("--from and --to are a converter's conventions: give --converter "
                               "MODULE:FUNCTION (--src and --dst are the degrees of the "
                               "harness's own)")


@pytest.mark.parametrize("argv, every", [([], True), (["--config", "all"], True),
                                         (["--config", "toy"], False),
                                         (["--weights", str(WEIGHTS)], True)])
def test_a_converter_goes_to_the_conversion_plan_knowing_whether_it_covers_every_config(
        stand, monkeypatch, argv, every):
    planned = []
    monkeypatch.setattr(M, "_convert_plan", lambda args, f, e, line: planned.append(
        (args, f, e, line)) or (["conversions"], ["skips"]))
    args = parse("--converter", "m:convert", *argv)
    line = ProgressLine(enabled=False)
    assert M._plan(args, line) == (["conversions"], ["skips"])
    assert planned == [(args, fn, every, line)]
    assert stand.calls == [("load_function", ("m:convert", "converter"), {})]


def test_a_converter_over_an_hf_geometry_is_not_every_config(stand, monkeypatch, tiny):
    planned = []
    monkeypatch.setattr(M, "_convert_plan", lambda args, f, e, line: planned.append(e) or ([], []))
    M._plan(parse("--converter", "m:f", "--hf-config", str(tiny), "--layers", "1"),
            ProgressLine(enabled=False))
    assert planned == [False]


# ---- _convert_plan --------------------------------------------------------------------------

def convert_plan(stand, *argv, every=None):
    args = parse("--converter", "m:f", *argv)
    if every is None:
        every = args.config in (None, "all")
    line = ProgressLine(enabled=False)
    return args, line, M._convert_plan(args, fn, every, line)


@pytest.mark.parametrize("given", [["--src", "2"], ["--dst", "2"], ["--src", "1", "--dst", "2"]])
def test_a_converter_with_src_or_dst_is_refused(stand, given):
    with pytest.raises(WsbError) as info:
        convert_plan(stand, "--from", "megatron:2", "--to", "vllm:2", *given)
    assert str(info.value) == ("--src and --dst are degrees of the harness's own convention; a "
                               "converter's are in --from NAME:T and --to NAME:T")


@pytest.mark.parametrize("given", [[], ["--from", "megatron:2"], ["--to", "vllm:2"]])
def test_a_converter_needs_both_from_and_to(stand, given):
    with pytest.raises(WsbError) as info:
        convert_plan(stand, *given)
    assert str(info.value) == ("--converter needs --from NAME:T and --to NAME:T (e.g. --from "
                               "megatron:4 --to vllm:2; a bare hf means degree 1)")


def test_a_conversion_is_checked_per_config_its_first_check_called_before_the_floor(stand):
    args, line, (jobs, skipped) = convert_plan(
        stand, "--from", "megatron:2", "--to", "vllm:4", "--seed", "9", "--dtype", "bf16",
        "--stream", "layer", "--measure-floor")
    assert skipped == []
    assert [label for label, _ in jobs] == ["toy megatron:2 -> vllm:4",
                                            "toy_kv4 megatron:2 -> vllm:4"]
    assert stand.named("require_stored") == [((TOY, endpoint("vllm:4")), {}),
                                             ((TOY_KV4, endpoint("vllm:4")), {})]
    assert [(a, c, ln) for a, c, ln, _ in stand.floors] == [(args, TOY, line),
                                                            (args, TOY_KV4, line)]
    assert stand.floors[0][3] is jobs[0] and stand.floors[1][3] is jobs[1]
    stand.calls.clear()
    assert jobs[1][1](P) == ("verdict", "check_convert", 0)
    jobs[0][1](None, threshold=math.inf, backend="inprocess", measure_floor=False)
    common = {"seed": 9, "backend": "inprocess", "dtype": "bf16", "measure_floor": True,
              "stream": "layer"}
    assert stand.calls == [
        ("check_convert", (fn, TOY_KV4, "megatron:2", "vllm:4"), {"progress": P, **common}),
        ("check_convert", (fn, TOY, "megatron:2", "vllm:4"), {
            "progress": None, **common, "threshold": math.inf, "measure_floor": False})]


def test_over_every_config_a_convention_that_cannot_store_one_skips_it_naming_the_rule(stand):
    with pytest.raises(UnsupportedLayout) as info:
        endpoint("meta:4").pieces(TOY)
    rule = str(info.value)
    assert rule.startswith("meta: layers.0.attention.wk.weight needs n_kv_heads % t == 0")
    _, _, (jobs, skipped) = convert_plan(stand, "--from", "meta:4", "--to", "vllm:2")
    assert skipped == [f"skipped toy: {rule}"]
    assert [label for label, _ in jobs] == ["toy_kv4 meta:4 -> vllm:2"]
    assert [c.name for _, c, _, _ in stand.floors] == ["toy_kv4"]
    # the destination's refusal (require_stored: an FP8 one's block rules too) alike
    stand.refuse["toy_kv4"] = UnsupportedLayout("vllm: toy_kv4 refused")
    stand.floors.clear()
    _, _, (jobs, skipped) = convert_plan(stand, "--from", "megatron:2", "--to", "vllm:2")
    assert skipped == ["skipped toy_kv4: vllm: toy_kv4 refused"]
    assert [label for label, _ in jobs] == ["toy megatron:2 -> vllm:2"]


def test_for_one_config_a_convention_that_cannot_store_it_is_refused_as_it_says(stand):
    refused = UnsupportedLayout("vllm: toy refused")
    stand.refuse["toy"] = refused
    with pytest.raises(UnsupportedLayout) as info:
        convert_plan(stand, "--config", "toy", "--from", "megatron:2", "--to", "vllm:2")
    assert info.value is refused and stand.floors == []
    with pytest.raises(UnsupportedLayout, match="^meta: layers.0.attention.wk.weight needs"):
        convert_plan(stand, "--config", "toy", "--from", "meta:4", "--to", "vllm:2")


FP8 = "vllm:tp=2,fp8=block128"


def test_an_fp8_destination_is_checked_whole_in_process_measuring_no_floor(stand):
    _, _, (jobs, skipped) = convert_plan(stand, "--from", "megatron:2", "--to", FP8, "--seed",
                                         "4", "--dtype", "bf16")
    assert skipped == [] and [label for label, _ in jobs] == [
        f"toy megatron:2 -> {FP8}", f"toy_kv4 megatron:2 -> {FP8}"]
    assert stand.named("require_stored") == [((TOY, endpoint(FP8)), {}),
                                             ((TOY_KV4, endpoint(FP8)), {})]
    assert stand.floors == []  # its threshold is measured on its dequantized weights
    stand.calls.clear()
    assert jobs[1][1](P, threshold=1.0) == ("verdict", "check_convert", 0)
    jobs[0][1](None)
    assert stand.calls == [("check_convert", (fn, TOY_KV4, "megatron:2", FP8),
                            {"seed": 4, "dtype": "bf16", "threshold": 1.0}),
                           ("check_convert", (fn, TOY, "megatron:2", FP8),
                            {"seed": 4, "dtype": "bf16"})]


@pytest.mark.parametrize("given", [["--stream", "layer"], ["--backend", "gloo"],
                                   ["--measure-floor"]])
def test_an_fp8_destination_refuses_stream_a_rank_pool_and_measure_floor(stand, given):
    with pytest.raises(WsbError) as info:
        convert_plan(stand, "--config", "toy_kv4", "--from", "megatron:2", "--to", FP8, *given)
    assert str(info.value) == (f"{FP8}: an FP8 destination is checked whole, in process, with a "
                               "threshold measured on its dequantized weights: drop --stream, "
                               "--backend and --measure-floor")


def test_a_converter_on_weights_is_one_job_on_them(stand, monkeypatch):
    made = []
    monkeypatch.setattr(M, "_weights_job", lambda args, f, src, dst: made.append(
        (args, f, src, dst)) or "the weights' job")
    args, _, planned = convert_plan(stand, "--from", "megatron:2", "--to", "vllm:2",
                                    "--weights", str(WEIGHTS))
    assert planned == (["the weights' job"], [])
    assert made == [(args, fn, endpoint("megatron:2"), endpoint("vllm:2"))]
    assert stand.calls == [] and stand.floors == []


# ---- --weights: _weights_config, _weights_job, _weights_plan ------------------------------

@pytest.mark.parametrize("given", [["--dtype", "bf16"], ["--stream", "layer"],
                                   ["--measure-floor"]])
def test_weights_are_checked_whole_in_their_own_dtype(given):
    with pytest.raises(WsbError) as info:
        M._weights_config(parse("--weights", str(WEIGHTS), *given))
    assert str(info.value) == ("--weights checks your weights whole, in their own dtype, with a "
                               "threshold measured on them: drop --dtype, --stream and "
                               "--measure-floor")


def test_the_weights_geometry_is_the_model_options_else_what_the_directory_states(
        monkeypatch, tiny):
    seen = []
    monkeypatch.setattr(M, "model_of", lambda args: seen.append(("model_of", args)) or TOY_KV4)
    monkeypatch.setattr(M, "weights_geometry", lambda d, given, options: seen.append(
        ("weights_geometry", d, given, options)) or TOY)
    options = "--hf-config PATH or --config NAME"
    assert M._weights_config(parse("--weights", str(WEIGHTS))) == TOY
    assert seen == [("weights_geometry", WEIGHTS, None, options)]
    for model in (["--config", "toy_kv4"], ["--hf-config", str(tiny), "--layers", "1"]):
        seen.clear()
        args = parse("--weights", str(WEIGHTS), *model)
        M._weights_config(args)
        assert seen == [("model_of", args), ("weights_geometry", WEIGHTS, TOY_KV4, options)]


def test_a_converter_on_weights_reads_the_directorys_geometry(stand, monkeypatch):
    configs = []
    monkeypatch.setattr(M, "_weights_config", lambda args: configs.append(args) or TOY_KV4)
    args = parse("--converter", "m:f", "--weights", str(WEIGHTS), "--seed", "6",
                 "--backend", "gloo")
    label, job = M._weights_job(args, fn, endpoint("megatron:2"), endpoint(FP8))
    assert configs == [args]
    assert label == f"toy_kv4 megatron:2 -> {FP8} on {WEIGHTS}"
    assert job(P, threshold=2.0) == ("verdict", "check_convert", 0)
    assert stand.calls == [("check_convert", (fn, TOY_KV4, "megatron:2", FP8), {
        "seed": 6, "backend": "gloo", "weights": WEIGHTS, "threshold": 2.0})]


@pytest.mark.parametrize("src, dst", [("meta:4", "vllm:2"), ("megatron:2", "meta:tp=4")])
def test_a_converter_on_weights_is_refused_where_a_convention_cannot_store_them(
        stand, monkeypatch, src, dst):
    monkeypatch.setattr(M, "_weights_config", lambda args: TOY)
    with pytest.raises(UnsupportedLayout, match="^meta: layers.0.attention.wk.weight needs"):
        M._weights_job(parse("--converter", "m:f"), fn, endpoint(src), endpoint(dst))


@pytest.fixture
def weights_of_toy(monkeypatch):
    configs = []
    monkeypatch.setattr(M, "_weights_config", lambda args: configs.append(args) or TOY)
    return configs


def test_a_splitter_on_weights_is_checked_at_every_dst_reading_them_once(stand,
                                                                         weights_of_toy):
    args = parse("--splitter", "m:f", "--weights", str(WEIGHTS), "--backend", "gloo")
    jobs = M._weights_plan(args, fn, "splitter")
    assert weights_of_toy == [args]
    assert [label for label, _ in jobs] == [f"toy split -> 1 on {WEIGHTS}",
                                            f"toy split -> 2 on {WEIGHTS}"]
    assert stand.calls == []  # read when the first check runs
    assert jobs[1][1](P) == ("verdict", "check_split", 1)
    jobs[0][1](None, threshold=3.0)
    held = {"held": "toy"}
    assert stand.calls == [
        ("held_weights", (WEIGHTS, TOY), {}),
        ("check_split", (fn, TOY, 2), {"backend": "gloo", "weights": held}),
        ("check_split", (fn, TOY, 1), {"backend": "gloo", "weights": held, "threshold": 3.0})]
    jobs = M._weights_plan(parse("--splitter", "m:f", "--dst", "2"), fn, "splitter")
    assert [label for label, _ in jobs] == ["toy split -> 2 on None"]


def test_a_resharder_on_weights_is_checked_at_every_pair_or_the_one_given(stand,
                                                                         weights_of_toy):
    args = parse("--resharder", "m:f", "--weights", str(WEIGHTS))
    jobs = M._weights_plan(args, fn, "resharder")
    assert [label for label, _ in jobs] == [f"toy {s} -> {d} on {WEIGHTS}"
                                            for s, d in pairs_of(TOY)]
    assert jobs[2][1](P, threshold=1.0) == ("verdict", "check_reshard", 1)
    jobs[3][1](P)
    held = {"held": "toy"}
    assert stand.calls == [
        ("held_weights", (WEIGHTS, TOY), {}),
        ("check_reshard", (fn, TOY, 2, 1), {"backend": "inprocess", "weights": held,
                                            "threshold": 1.0}),
        ("check_reshard", (fn, TOY, 2, 2), {"backend": "inprocess", "weights": held})]
    jobs = M._weights_plan(parse("--resharder", "m:f", "--weights", str(WEIGHTS), "--src", "2"),
                           fn, "resharder")
    assert [label for label, _ in jobs] == [f"toy 2 -> {d} on {WEIGHTS}" for d in (1, 2)]


@pytest.mark.parametrize("flag", ["--src", "--dst"])
def test_weights_at_an_unsupported_degree_are_refused_naming_the_rule(stand, weights_of_toy,
                                                                     flag):
    with pytest.raises(UnsupportedLayout) as info:
        M._weights_plan(parse("--resharder", "m:f", flag, "4"), fn, "resharder")
    assert str(info.value) == unsupported(TOY, 4)
    assert stand.calls == []


# ---- wsb layout -----------------------------------------------------------------------------

def layout(capsys, *argv: str) -> str:
    args = M._parser("wsb").parse_args(["layout", *argv])
    assert M.cmd_layout(args) == 0
    return capsys.readouterr().out


def test_layout_prints_the_declared_table_at_1_2_4_8_and_every_supported_degree(capsys):
    out = layout(capsys)  # --config toy, its default
    assert out == (layout_for(TOY).render([1, 2, 4, 8]) + "\n\nsupported degrees: 1, 2\n"
                   + M.LAYOUT_LEGEND + "\n")
    assert out.splitlines()[0].split()[-4:] == ["t=1", "t=2", "t=4", "t=8"]
    assert "layers.0.qkv.weight        [384, 256]    HP(8,2,32)   [384, 256]    [192, 256]    -" \
        in out
    out = layout(capsys, "--config", "toy_kv4", "--degree", "2")
    assert out == (layout_for(TOY_KV4).render([2]) + "\n\nsupported degrees: 1, 2, 4\n"
                   + M.LAYOUT_LEGEND + "\n")


def test_layout_of_a_degree_outside_1_2_4_8_adds_its_column(capsys, write_config):
    path = write_config("nine", hidden_size=72, intermediate_size=144, num_attention_heads=9,
                        num_key_value_heads=3, head_dim=8, vocab_size=576, num_hidden_layers=1)
    out = layout(capsys, "--hf-config", str(path))  # no --layers: nothing is built
    config = ModelConfig.from_hf_config(path)
    assert layout_for(config).supported_degrees() == [1, 3]
    assert out == (layout_for(config).render([1, 2, 3, 4, 8]) + "\n\nsupported degrees: 1, 3\n"
                   + M.LAYOUT_LEGEND + "\n")
    out = layout(capsys, "--hf-config", str(path), "--convention", "vllm")
    assert out.endswith("\nsupported degrees (1..8): 1, 3\n" + M.CONVENTION_LEGEND + "\n")
    assert convention_by_name("vllm").supported_degrees(config, 9) == [1, 3, 9]  # not 1..9


def test_layout_of_a_convention_prints_its_table_at_its_supported_degrees(capsys):
    vllm = convention_by_name("vllm")
    out = layout(capsys, "--convention", "vllm")
    assert out == (render(TOY, vllm, None) + "\n\nsupported degrees (1..8): 1, 2, 4, 8\n"
                   + M.CONVENTION_LEGEND + "\n")
    assert render(TOY, vllm, None) == render(TOY, vllm, [1, 2, 4, 8])


@pytest.mark.parametrize("argv, degree", [(["--convention", "vllm:2"], 2),
                                          (["--convention", "vllm", "--degree", "4"], 4),
                                          (["--convention", "vllm:2", "--degree", "8"], 8)])
def test_layout_of_a_convention_at_one_degree_its_own_or_the_flags(capsys, argv, degree):
    out = layout(capsys, "--config", "toy_kv4", *argv)
    assert out == (render(TOY_KV4, convention_by_name("vllm"), [degree])
                   + "\n\nsupported degrees (1..8): 1, 2, 4, 8\n" + M.CONVENTION_LEGEND + "\n")


def test_layout_of_a_degree_the_convention_cannot_store_is_refused_naming_the_rule(capsys):
    for argv in (["--convention", "meta:4"], ["--convention", "meta", "--degree", "4"]):
        with pytest.raises(UnsupportedLayout, match="^meta: layers.0.attention.wk.weight needs "
                                                    "n_kv_heads % t == 0"):
            layout(capsys, *argv)
        assert capsys.readouterr().out == ""


def test_layout_says_none_where_a_convention_stores_no_degree_up_to_8(capsys, monkeypatch):
    """The fallback: ``--degree`` past 8 where the convention stores none of 1..8 (stood in:
    no committed convention does that)."""
    real = convention_by_name("vllm")

    class Stored:
        def __getattr__(self, name):
            return getattr(real, name)

        def supported_degrees(self, config, max_degree):
            return []
    monkeypatch.setattr(M, "convention_by_name", lambda name: Stored())
    out = layout(capsys, "--convention", "vllm", "--degree", "2")
    assert "\nsupported degrees (1..8): none\n" in out


def test_layout_of_an_endpoint_prints_its_ranks_too(capsys):
    where = endpoint("megatron:tp=2")
    out = layout(capsys, "--convention", "megatron:tp=2")
    assert out == (render(TOY, convention_by_name("megatron"), [where]) + "\n\n"
                   + render_ranks(TOY, where) + "\n" + M.CONVENTION_LEGEND + "\n"
                   + M.RANKS_LEGEND + "\n")
    wider = layout(capsys, "--convention", "megatron:tp=2", "--degree", "4")
    where = endpoint("megatron:tp=4")
    assert wider == (render(TOY, convention_by_name("megatron"), [where]) + "\n\n"
                     + render_ranks(TOY, where) + "\n" + M.CONVENTION_LEGEND + "\n"
                     + M.RANKS_LEGEND + "\n")


@pytest.mark.parametrize("argv, text", [([], "megatron"), (["--degree", "2"], "megatron:2"),
                                        (["--degree", "2"], "megatron:tp=2,ep=2")])
def test_layout_of_an_moe_config_prints_the_ranks_of_its_endpoint(capsys, argv, text):
    convention = text.split(":")[0] if "=" not in text else text
    out = layout(capsys, "--config", "toy_moe", "--convention", convention, *argv)
    where = endpoint(text)
    assert out == (render(TOY_MOE, convention_by_name("megatron"), [where]) + "\n\n"
                   + render_ranks(TOY_MOE, where) + "\n" + M.CONVENTION_LEGEND + "\n"
                   + M.RANKS_LEGEND + "\n")
    assert "experts" in out.split("\n\n")[-1].splitlines()[0]


# ---- build_parser: what the help texts do not show ----------------------------------------
# (tests/cli/test_help.py pins every parser's help word for word: the options, their
# metavars, choices and help; here the defaults, types, destinations and handlers)

def test_check_parses_to_its_defaults_and_runs_cmd_check_on_the_pool(monkeypatch):
    ran = []
    monkeypatch.setattr(M, "cmd_check", lambda args: ran.append(args.backend) or 5)
    args = M.build_parser().parse_args(["check"])
    fields = vars(args).copy()
    func, names = fields.pop("func"), fields.pop("option_names")
    assert fields == {
        "command": "check", "config": None, "hf_config": None, "layers": None, "vocab": None,
        "src": None, "dst": None, "seed": 0, "backend": None, "launcher": "pool",
        "resharder": None, "splitter": None, "converter": None, "convert_from": None,
        "convert_to": None, "weights": None, "dtype": "fp32", "stream": None,
        "measure_floor": False, "max_gib": None, "max_gflop": 10000.0, "memory_budget": None,
        "quiet": False, "json": False, "strict_env": False, "deadline": None,
        "config_default": "all"}
    assert func(args) == 5 and ran == ["inprocess"]  # launched: the pool's backend
    assert names == {
        "help": "--help", "config": "--config", "hf_config": "--hf-config", "layers": "--layers",
        "vocab": "--vocab", "src": "--src", "dst": "--dst", "seed": "--seed",
        "backend": "--backend", "launcher": "--launcher", "resharder": "--resharder",
        "splitter": "--splitter", "converter": "--converter", "convert_from": "--from",
        "convert_to": "--to", "weights": "--weights", "dtype": "--dtype", "stream": "--stream",
        "measure_floor": "--measure-floor", "max_gib": "--max-gib", "max_gflop": "--max-gflop",
        "memory_budget": "--memory-budget", "quiet": "--quiet", "json": "--json",
        "strict_env": "--strict-env", "deadline": "--deadline"}


def test_check_options_parse_to_their_types(capsys):
    args = M.build_parser().parse_args([
        "check", "--src", "2", "--dst", "4", "--seed", "9223372036854775807", "--backend",
        "gloo", "--from", "megatron:2", "--to", "vllm:4", "--converter", "m:f", "--weights",
        "some/dir", "--dtype", "bf16", "--stream", "parameter", "--measure-floor",
        "--memory-budget", "1.5"])
    assert (args.src, args.dst, args.seed, args.backend) == (2, 4, 2**63 - 1, "gloo")
    assert (args.convert_from, args.convert_to, args.converter) == ("megatron:2", "vllm:4", "m:f")
    assert args.weights == Path("some/dir") and isinstance(args.weights, Path)
    assert (args.dtype, args.stream, args.measure_floor, args.memory_budget) == (
        "bf16", "parameter", True, 1.5)
    for bad in (["--seed", "-1"], ["--memory-budget", "0"], ["--src", "two"],
                ["--resharder", "m:f", "--splitter", "m:g"]):
        with pytest.raises(SystemExit) as info:
            M.build_parser().parse_args(["check", *bad])
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seed: must be an int in 0..2^63-1, got -1" in err
    assert "argument --memory-budget: must be > 0 and finite, got 0" in err
    assert "argument --splitter: not allowed with argument --resharder" in err


def test_layout_parses_to_its_defaults_and_runs_cmd_layout(capsys):
    args = M.build_parser().parse_args(["layout"])
    assert vars(args) == {"command": "layout", "config": None, "hf_config": None,
                          "layers": None, "vocab": None, "convention": None, "degree": None,
                          "quiet": False, "config_default": "toy", "func": M.cmd_layout}
    assert M.build_parser().parse_args(["layout", "--degree", "3"]).degree == 3
    with pytest.raises(SystemExit):
        M.build_parser().parse_args(["layout", "--degree", "0"])
    assert "argument --degree: must be > 0, got 0" in capsys.readouterr().err


def test_a_subcommand_is_required_and_version_answers_alone(capsys):
    from weight_sync_bench.version import version

    parser = M.build_parser("wsb (rank 1 of 2)")
    assert parser.prog == "wsb (rank 1 of 2)"
    with pytest.raises(SystemExit) as info:
        parser.parse_args([])
    assert info.value.code == 2
    assert "the following arguments are required: command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        M.build_parser().parse_args(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == version() + "\n"
    assert M.build_parser().prog == "wsb"

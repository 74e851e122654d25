"""``wsb train-check``'s planning, printing and exit paths (issue 30, the mutation pass over
``cli/train.py``): which cases a command line trains, which thresholds each is judged by and
when they are read, what the tables, the progress line and the ``--json`` records say, and
which exit code the command returns for each mix of passing, failing, missed and identity
cells.

A case left out of the plan, a threshold read for the wrong mesh, a tally that miscounts or an
exit code taken from the wrong list would each make a training-equivalence run in CI read
wrongly. Here the training is stood in (``FakeCase`` hands back prepared reports; the floors,
the matrix and the gloo pool are recorded stand-ins), so each test decides exactly what ran
and checks every line, record and call. The real runs are ``test_train.py``'s and
``test_train_sequence.py``'s."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from weight_sync_bench.cli import train as T
from weight_sync_bench.errors import InvalidConfig, InvalidMesh, WsbError
from weight_sync_bench.model.config import CONFIGS
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.compare import Comparison, TrainingReport
from weight_sync_bench.training.floor import SMALL_VARIANTS, TOY_VARIANTS, meshes
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import (
    ALL_TRAINING_MUTATIONS,
    TRAINING_MUTATIONS,
    MatrixRow,
)
from weight_sync_bench.training.sequence_floor import sequence_meshes

SMALL = "small_tied_bias"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="wsb")
    T.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train-check", *argv])


def report(config: str, mesh: Mesh, packed: bool, *, passed: bool = True, steps: int = 2
           ) -> TrainingReport:
    """Two quantities: a toleranced one (deviation 2e-3 over 1e-3 when failing) and an exact
    one that always holds."""
    return TrainingReport(config, mesh, steps, packed, (
        Comparison("loss", 5e-4 if passed else 2e-3, 1e-3, "" if passed else "step 2"),
        Comparison("replicas", 0.0, 0.0)))


class Stand:
    """The recorded stand-ins: ``fail`` names the labels whose check fails."""

    def __init__(self) -> None:
        self.fail: set[str] = set()
        self.cases: list[FakeCase] = []
        self.checked: list[tuple[str, object, object]] = []  # (label, thresholds, trained)
        self.calls: list[tuple] = []


class FakeCase:
    """``TrainingCase``'s fields, and a ``check`` that returns a prepared report."""

    stand: Stand

    def __init__(self, config, mesh, seed, steps, spec, params):
        self.config, self.mesh, self.seed, self.steps = config, mesh, seed, steps
        self.spec, self.params = spec, params
        self.stand.cases.append(self)

    @property
    def label(self) -> str:
        return f"{self.config.name} {self.mesh}{' packed' if self.spec.packed else ''}"

    def check(self, thresholds, *, trained=None):
        self.stand.checked.append((self.label, thresholds, trained))
        return report(self.config.name, self.mesh, self.spec.packed,
                      passed=self.label not in self.stand.fail, steps=self.steps)


@pytest.fixture
def stand(monkeypatch):
    s = Stand()
    FakeCase.stand = s
    monkeypatch.setattr(T, "TrainingCase", FakeCase)
    monkeypatch.setattr(T, "load", lambda phase: {"training floor": phase})
    monkeypatch.setattr(T, "load_sequence", lambda phase: {"sequence floor": phase})
    monkeypatch.setattr(T, "check_environment", lambda read, what, remedy: ())

    def thresholds_for(config, *, artifact, mesh):
        s.calls.append(("plain", config.name, str(mesh), artifact))
        return {"plain": str(mesh)}

    def sequence_thresholds(config, mesh, *, artifact):
        s.calls.append(("sequence", config.name, str(mesh), artifact))
        return {"sequence": str(mesh)}
    monkeypatch.setattr(T, "thresholds_for", thresholds_for)
    monkeypatch.setattr(T, "sequence_thresholds", sequence_thresholds)
    monkeypatch.setattr(T, "apply_deadline", lambda deadline, gloo: s.calls.append(
        ("deadline", deadline, gloo)))
    return s


def run(*argv: str) -> int:
    args = parse(*argv)
    return args.func(args)


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def plan(config: str, packings=(False, True)) -> list[str]:
    """Every (config, mesh, batch) label a plain run trains, in order."""
    cfg = T.TRAIN_CONFIGS[config]
    out = []
    for packed in packings:
        spec = default_spec(cfg, packed=packed)
        out += [f"{config} {m}{' packed' if packed else ''}" for m in meshes(cfg, spec.rows)]
    return out


# ---- the command line ---------------------------------------------------------------------

def test_the_defaults_and_the_options_values():
    args = parse()
    assert (args.config, args.weights, args.dp, args.tp, args.steps, args.seed, args.batch,
            args.gloo, args.sp, args.cp, args.mutations) == (
        None, None, None, None, 2, 0, "both", False, False, None, False)
    assert (args.quiet, args.json, args.strict_env, args.deadline) == (False, False, False, None)
    assert args.func is T.cmd_train_check
    args = parse("--config", "toy", "--weights", "w", "--dp", "2", "--tp", "4", "--steps", "3",
                 "--seed", "7", "--batch", "packed", "--gloo", "--sp", "--cp", "2",
                 "--mutations", "-q", "--json", "--deadline", "5")
    assert (args.config, args.weights, args.dp, args.tp, args.steps, args.seed, args.batch,
            args.gloo, args.sp, args.cp, args.mutations, args.quiet, args.json,
            args.deadline) == ("toy", Path("w"), 2, 4, 3, 7, "packed", True, True, 2, True,
                               True, True, 5.0)


@pytest.mark.parametrize("argv", [("--dp", "0"), ("--tp", "0"), ("--steps", "0"),
                                  ("--cp", "0"), ("--seed", "-1"), ("--batch", "neither"),
                                  ("--dp", "x")])
def test_every_count_degree_and_seed_is_validated(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_configs_names_one_every_or_refuses():
    assert T._configs("all") == list(T.TRAIN_CONFIGS.values())
    assert list(T.TRAIN_CONFIGS) == [*CONFIGS, TOY_VARIANTS.name,
                                     *(c.name for c in SMALL_VARIANTS)]
    assert T._configs(SMALL) == [T.TRAIN_CONFIGS[SMALL]]
    with pytest.raises(InvalidConfig) as e:
        T._configs("nope")
    assert str(e.value) == f"unknown config 'nope'; known: {', '.join(T.TRAIN_CONFIGS)}, all"


def test_ranks_sequence_and_the_rank_pools_meshes():
    assert T._ranks(Mesh(2, 3, False, 5)) == 30
    assert T.GLOO_RANKS == 4
    ns = argparse.Namespace
    assert not T._sequence(ns(sp=False, cp=None))
    assert T._sequence(ns(sp=True, cp=None)) and T._sequence(ns(sp=False, cp=1))
    # default: dp = 1 and at most GLOO_RANKS ranks
    plain = ns(dp=None, cp=None)
    assert T._over_gloo(plain, Mesh(1, 4))
    assert not T._over_gloo(plain, Mesh(1, 8)) and not T._over_gloo(plain, Mesh(2, 1))
    assert not T._over_gloo(plain, Mesh(1, 2, True, 4))
    # --dp or --cp asks for more
    assert T._over_gloo(ns(dp=2, cp=None), Mesh(2, 4))
    assert T._over_gloo(ns(dp=None, cp=4), Mesh(1, 2, True, 4))
    assert not T._over_gloo(ns(dp=None, cp=4), Mesh(2, 1, False, 4))


# ---- the plan ------------------------------------------------------------------------------

def test_a_plain_run_trains_every_mesh_of_both_batches_in_order(stand, capsys):
    assert run("--config", SMALL) == 0
    assert [c.label for c in stand.cases] == plan(SMALL)
    assert len(stand.cases) > 4
    cfg = T.TRAIN_CONFIGS[SMALL]
    for case in stand.cases:
        assert (case.config, case.seed, case.steps, case.params) == (cfg, 0, 2, None)
        assert case.spec == default_spec(cfg, packed=case.spec.packed)
    assert [c[:3] for c in stand.calls if c[0] == "plain"] == [
        ("plain", SMALL, str(c.mesh)) for c in stand.cases]
    assert all(c[3] == {"training floor": "1a"} for c in stand.calls if c[0] == "plain")
    # each case judged by its own mesh's thresholds, trained in process
    assert [(label, t, trained) for label, t, trained in stand.checked] == [
        (c.label, {"plain": str(c.mesh)}, None) for c in stand.cases]
    assert stand.calls[0] == ("deadline", None, False)
    capsys.readouterr()


def test_the_default_config_is_toy_and_each_batch_option_is_its_packing(stand):
    assert run("--batch", "unpacked", "--tp", "2", "--dp", "1", "--seed", "5", "--steps",
               "3") == 0
    assert [c.label for c in stand.cases] == ["toy dp=1 tp=2"]
    assert (stand.cases[0].seed, stand.cases[0].steps) == (5, 3)
    stand.cases.clear()
    assert run("--config", SMALL, "--batch", "packed") == 0
    assert [c.label for c in stand.cases] == plan(SMALL, (True,))


def test_dp_and_tp_pick_their_meshes(stand):
    run("--config", SMALL, "--batch", "unpacked", "--dp", "2")
    assert {c.mesh.dp for c in stand.cases} == {2}
    assert len({c.mesh.tp for c in stand.cases}) > 1
    stand.cases.clear()
    run("--config", SMALL, "--batch", "unpacked", "--tp", "2")
    assert {c.mesh.tp for c in stand.cases} == {2}
    assert len({c.mesh.dp for c in stand.cases}) > 1


@pytest.mark.parametrize(("argv", "mesh"), [
    (("--dp", "3"), Mesh(3, 1)), (("--tp", "3"), Mesh(1, 3)), (("--dp", "3", "--tp", "2"),
                                                                Mesh(3, 2)),
    (("--sp", "--tp", "3"), Mesh(1, 3, True, 1)), (("--cp", "3"), Mesh(1, 1, False, 3)),
    (("--sp", "--dp", "3", "--tp", "2", "--cp", "3"), Mesh(3, 2, True, 3))])
def test_a_mesh_no_plan_holds_is_built_as_asked_so_that_it_is_refused_by_name(
        stand, argv, mesh):
    """Never silently nothing, never a run at another size: the mesh asked for, whose
    ``TrainingCase`` then names what is wrong with it (``test_train.py``)."""
    run("--config", SMALL, "--batch", "unpacked", *argv)
    assert [c.mesh for c in stand.cases] == [mesh]


def test_sequence_options_pick_the_sequence_meshes(stand):
    cfg = T.TRAIN_CONFIGS["toy_kv4"]
    rows, seq_len = default_spec(cfg, packed=False).rows, cfg.seq_len
    run("--config", "toy_kv4", "--batch", "unpacked", "--sp")
    want = [m for m in sequence_meshes(cfg, rows, seq_len) if m.sp]
    assert [c.mesh for c in stand.cases] == want and want
    stand.cases.clear()
    run("--config", "toy_kv4", "--batch", "unpacked", "--cp", "2")
    want = [m for m in sequence_meshes(cfg, rows, seq_len) if not m.sp and m.cp == 2]
    assert [c.mesh for c in stand.cases] == want and want
    # every sequence mesh is judged by the sequence floor, read once for the run
    assert {c[0] for c in stand.calls if c[0] != "deadline"} == {"sequence"}
    assert all(c[3] == {"sequence floor": "1a"} for c in stand.calls if c[0] == "sequence")


def test_a_rank_pool_trains_dp1_meshes_of_at_most_four_ranks_unless_dp_is_given(stand, monkeypatch):
    trained = []
    monkeypatch.setattr(T, "_gloo_trainer", lambda cases: (
        trained.append([c.label for c in cases]) or (lambda case: f"trace of {case.label}")))
    cfg = T.TRAIN_CONFIGS["toy_kv4"]
    rows = default_spec(cfg, packed=True).rows
    assert run("--config", "toy_kv4", "--batch", "packed", "--gloo") == 0
    want = [m for m in meshes(cfg, rows) if m.dp == 1 and m.tp <= 4]
    assert [c.mesh for c in stand.cases] == want and len(want) < len(meshes(cfg, rows))
    assert trained == [[c.label for c in stand.cases]]  # one pool for the run
    assert [trace for _, _, trace in stand.checked] == [f"trace of {c.label}"
                                                         for c in stand.cases]
    assert ("deadline", None, True) in stand.calls
    assert {c[3]["training floor"] for c in stand.calls if c[0] == "plain"} == {"1b"}
    stand.cases.clear()
    run("--config", "toy_kv4", "--batch", "packed", "--gloo", "--dp", "2")
    assert [c.mesh for c in stand.cases] == [m for m in meshes(cfg, rows) if m.dp == 2]
    assert max(T._ranks(c.mesh) for c in stand.cases) > 4


def test_no_case_is_refused_naming_the_config(stand, monkeypatch):
    monkeypatch.setattr(T, "meshes", lambda config, rows: [])
    with pytest.raises(InvalidMesh) as e:
        run()
    assert str(e.value) == "no training case matches --config toy with these options"
    with pytest.raises(InvalidMesh, match=f"--config {SMALL} with"):
        run("--config", SMALL)
    assert not stand.checked


def test_every_threshold_is_read_before_anything_trains(stand, monkeypatch):
    def refuse_the_last(config, *, artifact, mesh):
        if str(mesh) == str(stand.cases[-1].mesh):
            raise WsbError(f"no floor for {mesh}")
        return {}
    monkeypatch.setattr(T, "thresholds_for", refuse_the_last)
    with pytest.raises(WsbError, match="no floor for"):
        run("--config", SMALL, "--batch", "unpacked")
    assert not stand.checked


def test_deadline_is_applied_before_the_floors_are_read(stand, monkeypatch):
    order = []
    monkeypatch.setattr(T, "apply_deadline", lambda d, g: order.append(("deadline", d, g)))
    monkeypatch.setattr(T, "load", lambda phase: order.append(("load", phase)) or {})
    run("--config", SMALL, "--batch", "unpacked", "--deadline", "7", "--tp", "1", "--dp", "1")
    assert order == [("deadline", 7.0, False), ("load", "1a")]


# ---- floors measured elsewhere -----------------------------------------------------------------

def test_each_floor_read_is_checked_for_its_environment_and_noted(stand, monkeypatch, capsys):
    seen = []

    def notes(read, what, remedy):
        seen.append((read, what, remedy))
        return (f"{what} measured elsewhere: torch 9",)
    monkeypatch.setattr(T, "check_environment", notes)
    run("--config", "toy_kv4", "--batch", "unpacked", "--sp", "--tp", "2", "--dp", "1")
    assert seen == [
        ({"training floor": "1a"}, "the phase 1a training floor",
         "python -m weight_sync_bench.tolerance training --phase 1a --write"),
        ({"sequence floor": "1a"}, "the phase 1a sequence floor",
         "python -m weight_sync_bench.tolerance sequence --phase 1a --write")]
    out = capsys.readouterr().out
    assert out.startswith("note: the phase 1a training floor measured elsewhere: torch 9\n"
                          "note: the phase 1a sequence floor measured elsewhere: torch 9\n")
    seen.clear()
    run("--config", SMALL, "--batch", "unpacked", "--tp", "1", "--dp", "1", "--json")
    assert [w for _, w, _ in seen] == ["the phase 1a training floor"]  # no sequence floor
    assert records(capsys.readouterr().out)[0] == {
        "kind": "note", "text": "the phase 1a training floor measured elsewhere: torch 9"}


# ---- what a plain run prints and returns ---------------------------------------------------------

def test_a_failure_after_passing_cases_exits_1_and_is_counted(stand, capsys):
    labels = plan(SMALL, (False,))
    stand.fail = {labels[-1]}
    assert run("--config", SMALL, "--batch", "unpacked", "--seed", "3") == 1
    out = capsys.readouterr().out
    assert out.endswith(f"\n\n{len(labels) - 1} passed, 1 failed (steps=2, seed=3, phase 1a)\n")
    assert out.count("FAIL") == 1 and out.count("PASS") == 2 * len(labels) - 1


def test_every_case_passing_exits_0(stand, capsys):
    labels = plan(SMALL)
    assert run("--config", SMALL) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"\n\n{len(labels)} passed, 0 failed (steps=2, seed=0, phase 1a)\n")
    assert out.count("PASS") == 2 * len(labels) and "FAIL" not in out


def test_quiet_prints_the_failed_cases_rows_and_the_closing_line_only(stand, capsys):
    labels = plan(SMALL, (True,))
    stand.fail = {labels[1]}
    assert run("--config", SMALL, "--batch", "packed", "-q") == 1
    out, err = capsys.readouterr()
    failed = stand.cases[1]
    assert out == T.format_reports([report(SMALL, failed.mesh, True, passed=False)]) + (
        f"\n\n{len(labels) - 1} passed, 1 failed (steps=2, seed=0, phase 1a)\n")
    assert err == ""  # no progress line
    stand.fail = set()
    assert run("--config", SMALL, "--batch", "packed", "-q") == 0
    assert capsys.readouterr().out == (
        f"\n{len(labels)} passed, 0 failed (steps=2, seed=0, phase 1a)\n")


def test_the_progress_line_names_each_case_and_its_phase(stand, capsys):
    labels = plan(SMALL, (True,))
    run("--config", SMALL, "--batch", "packed")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"train-check 1/{len(labels)}: {labels[0]} (phase 1a)"
    assert err[-1] == f"train-check {len(labels)}/{len(labels)}: {labels[-1]} (phase 1a)"


def test_json_records_every_case_then_the_summary(stand, capsys):
    labels = plan(SMALL, (False,))
    stand.fail = {labels[-1]}
    assert run("--config", SMALL, "--batch", "unpacked", "--json", "--steps", "4",
               "--seed", "9") == 1
    out = records(capsys.readouterr().out)
    assert [r["kind"] for r in out] == ["train"] * len(labels) + ["summary"]
    last = stand.cases[-1]
    assert out[-2] == {"kind": "train", "config": SMALL, "mesh": str(last.mesh),
                       "packed": False, "phase": "1a", "passed": False, "comparisons": [
                           {"quantity": "loss", "deviation": 2e-3, "threshold": 1e-3,
                            "ratio": pytest.approx(2.0), "where": "step 2", "passed": False},
                           {"quantity": "replicas", "deviation": 0.0, "threshold": 0.0,
                            "ratio": 0.0, "where": None, "passed": True}]}
    assert [r["passed"] for r in out[:-1]] == [True] * (len(labels) - 1) + [False]
    assert [r["mesh"] for r in out[:-1]] == [str(c.mesh) for c in stand.cases]
    assert out[-1] == {"kind": "summary", "command": "train-check", "exit_code": 1,
                       "checks": len(labels), "passed": len(labels) - 1, "failed": 1,
                       "phase": "1a", "steps": 4, "seed": 9, "cells": None, "ran": None,
                       "missed": None}


def test_format_reports_is_one_aligned_row_per_quantity():
    rows = T.format_reports([report(SMALL, Mesh(2, 1), False, passed=False),
                             report("toy", Mesh(1, 2, True, 2), True)])
    assert rows == (
        "config           mesh               batch     quantity  deviation  threshold  ratio  "
        "worst at  result\n"
        "small_tied_bias  dp=2 tp=1          unpacked  loss      0.002      0.001      2x     "
        "step 2    FAIL\n"
        "small_tied_bias  dp=2 tp=1          unpacked  replicas  0          exact      0x     "
        "-         PASS\n"
        "toy              dp=1 tp=2 sp cp=2  packed    loss      0.0005     0.001      0.5x   "
        "-         PASS\n"
        "toy              dp=1 tp=2 sp cp=2  packed    replicas  0          exact      0x     "
        "-         PASS")


def test_table_pads_every_column_but_the_last_to_its_widest():
    assert T._table([["a", "bbb", "c"], ["dd", "e", "f  "]]) == "a   bbb  c\ndd  e    f"


# ---- the mutation matrix -----------------------------------------------------------------------

def row(mutation: str, case: FakeCase, outcome: str) -> MatrixRow:
    """``identity`` (skipped), ``detected`` or ``missed``."""
    if outcome == "identity":
        return MatrixRow(mutation, case.label, "no TP", None)
    return MatrixRow(mutation, case.label, None, report(
        case.config.name, case.mesh, case.spec.packed, passed=outcome == "missed"))


@pytest.fixture
def matrix(stand, monkeypatch):
    """``mutation_matrix`` stood in: per case, the outcomes ``stand.outcomes`` lists (by
    default one identity cell and one detected)."""
    stand.outcomes = {}

    def fake(cases, thresholds, mutations):
        [case] = cases
        stand.calls.append(("matrix", case.label, thresholds, mutations))
        return [row(f"m{i}", case, o) for i, o in enumerate(
            stand.outcomes.get(case.label, ("identity", "detected")))]
    monkeypatch.setattr(T, "mutation_matrix", fake)
    return stand


def test_mutations_all_detected_exit_0_with_the_tally(matrix, capsys):
    labels = plan(SMALL, (False,))
    assert run("--config", SMALL, "--batch", "unpacked", "--mutations") == 0
    out = capsys.readouterr().out
    assert out.endswith(f"\n\n{len(labels)} of {len(labels)} detected, {len(labels)} identity "
                        "cells skipped\n")
    calls = [c for c in matrix.calls if c[0] == "matrix"]
    assert calls == [("matrix", c.label, {"plain": str(c.mesh)}, TRAINING_MUTATIONS)
                     for c in matrix.cases]
    assert not matrix.checked  # the correct check is not run


def test_a_missed_mutation_after_detected_ones_exits_1(matrix, capsys):
    labels = plan(SMALL, (False,))
    matrix.outcomes = {labels[-1]: ("detected", "missed")}
    assert run("--config", SMALL, "--batch", "unpacked", "--mutations") == 1
    out = capsys.readouterr().out
    ran = len(labels) + 1
    assert out.endswith(f"\n\n{ran - 1} of {ran} detected, {len(labels) - 1} identity cells "
                        "skipped\n")
    assert out.count(" NO ") == 1


def test_quiet_mutations_print_the_missed_cells_only(matrix, capsys):
    labels = plan(SMALL, (False,))
    matrix.outcomes = {labels[0]: ("missed", "detected")}
    assert run("--config", SMALL, "--batch", "unpacked", "--mutations", "-q") == 1
    out, err = capsys.readouterr()
    missed = row("m0", matrix.cases[0], "missed")
    ran = len(labels) + 1
    assert out == T.format_matrix([missed]) + (
        f"\n\n{ran - 1} of {ran} detected, {len(labels) - 1} identity cells skipped\n")
    assert err == ""
    matrix.outcomes = {}
    assert run("--config", SMALL, "--batch", "unpacked", "--mutations", "-q") == 0
    assert capsys.readouterr().out == (
        f"\n{len(labels)} of {len(labels)} detected, {len(labels)} identity cells skipped\n")


def test_a_matrix_of_identity_cells_only_is_a_usage_error(matrix, capsys):
    labels = plan(SMALL, (False,))
    matrix.outcomes = {label: ("identity",) for label in labels}
    assert run("--config", SMALL, "--batch", "unpacked", "--mutations", "--json") == 2
    out = records(capsys.readouterr().out)
    assert out[-1] == {"kind": "summary", "command": "train-check", "exit_code": 2,
                       "cells": len(labels), "ran": 0, "missed": 0, "checks": None,
                       "passed": None, "failed": None, "phase": "1a", "steps": 2, "seed": 0}


def test_mutation_json_records_each_cell(matrix, capsys):
    labels = plan(SMALL, (True,))
    matrix.outcomes = {labels[0]: ("identity", "missed", "detected")}
    assert run("--config", SMALL, "--batch", "packed", "--mutations", "--json", "--steps",
               "3", "--seed", "4") == 1
    out = records(capsys.readouterr().out)
    cells = len(labels) * 2 + 1
    assert [r["kind"] for r in out] == ["train_mutation"] * cells + ["summary"]
    assert out[:3] == [
        {"kind": "train_mutation", "mutation": "m0", "case": labels[0], "identity": "no TP",
         "detected": None, "ratio": None, "quantity": None},
        {"kind": "train_mutation", "mutation": "m1", "case": labels[0], "identity": None,
         "detected": False, "ratio": 0.5, "quantity": "loss"},
        {"kind": "train_mutation", "mutation": "m2", "case": labels[0], "identity": None,
         "detected": True, "ratio": pytest.approx(2.0), "quantity": "loss"}]
    assert out[-1] == {"kind": "summary", "command": "train-check", "exit_code": 1,
                       "cells": cells, "ran": len(labels) + 1, "missed": 1, "checks": None,
                       "passed": None, "failed": None, "phase": "1a", "steps": 3, "seed": 4}


def test_sequence_mutations_run_the_sequence_ones_too(matrix, capsys):
    run("--config", "toy_kv4", "--batch", "unpacked", "--sp", "--tp", "2", "--dp", "1",
        "--mutations")
    calls = [c for c in matrix.calls if c[0] == "matrix"]
    assert calls and all(c[3] == ALL_TRAINING_MUTATIONS for c in calls)
    assert all(c[2] == {"sequence": c[1].split(" ", 1)[1]} for c in calls)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"train-check --mutations 1/{len(calls)}: {calls[0][1]} "
                      f"({len(ALL_TRAINING_MUTATIONS)} mutations, phase 1a)")
    assert err[-1].startswith(f"train-check --mutations {len(calls)}/{len(calls)}: ")


def test_mutations_over_the_rank_pool_read_phase_1b(matrix, monkeypatch, capsys):
    made = []

    def gloo_matrix(cases):
        made.append([c.label for c in cases])

        def run_on_pool(cs, thresholds, mutations):
            matrix.calls.append(("pool matrix", cs[0].label, mutations))
            return [row("m", cs[0], "detected")]
        return run_on_pool
    monkeypatch.setattr(T, "_gloo_matrix", gloo_matrix)
    assert run("--config", SMALL, "--batch", "unpacked", "--mutations", "--gloo") == 0
    assert made == [[c.label for c in matrix.cases]]
    assert [c[1] for c in matrix.calls if c[0] == "pool matrix"] == [
        c.label for c in matrix.cases]
    assert not [c for c in matrix.calls if c[0] == "matrix"]
    assert "phase 1b" in capsys.readouterr().err


def test_format_matrix_rows():
    case = argparse.Namespace(label="toy dp=1 tp=2", config=CONFIGS["toy"], mesh=Mesh(1, 2),
                              spec=argparse.Namespace(packed=False))
    exact = MatrixRow("pad", "toy dp=1 tp=2", None, TrainingReport(
        "toy", Mesh(1, 2), 2, False, (Comparison("loss", 1e-4, 1e-3),
                                      Comparison("vocab", 3.0, 0.0),
                                      Comparison("replicas", 0.25, 0.0))))
    assert T.format_matrix([row("a", case, "identity"), row("b", case, "missed"),
                            row("c", case, "detected"), exact]) == (
        "mutation  case           detected  ratio  by quantity  exact                   "
        "identity\n"
        "a         toy dp=1 tp=2  -         -      -            -                       "
        "no TP\n"
        "b         toy dp=1 tp=2  NO        0.5x   loss         -\n"
        "c         toy dp=1 tp=2  yes       2x     loss         -\n"
        "pad       toy dp=1 tp=2  yes       0.1x   loss         vocab=3, replicas=0.25")


# ---- --weights --------------------------------------------------------------------------------

@pytest.fixture
def weights(stand, monkeypatch):
    """The checkpoint reading stood in: the geometry is what was given (else toy), the
    parameters a marker; ``thresholds_on`` recorded."""
    import weight_sync_bench.check.weights as W
    import weight_sync_bench.cli.checkpoint as C
    import weight_sync_bench.model.stepwise as S

    def geometry(directory, given, options):
        stand.calls.append(("geometry", directory, given and given.name, options))
        return given or CONFIGS["toy"]
    monkeypatch.setattr(C, "weights_geometry", geometry)
    monkeypatch.setattr(W, "held_weights", lambda d, config: ("held", str(d), config.name))
    monkeypatch.setattr(S, "computing", lambda params: ("fp32", params))

    def thresholds_on(config, params, shapes, spec, steps, seeds, phase, *, train):
        stand.calls.append(("on", config.name, params, [str(m) for m in shapes], spec.packed,
                            steps, seeds, phase, train))
        return {"on": [str(m) for m in shapes]}
    monkeypatch.setattr(T, "thresholds_on", thresholds_on)
    return stand


def test_weights_are_trained_with_thresholds_measured_on_them(weights, capsys):
    assert run("--weights", "ck", "--config", SMALL, "--batch", "unpacked", "--seed", "6",
               "--steps", "3") == 0
    cfg = T.TRAIN_CONFIGS[SMALL]
    params = ("fp32", ("held", "ck", SMALL))
    assert weights.calls[1] == ("geometry", Path("ck"), SMALL, "--config NAME")
    assert [c.params for c in weights.cases] == [params] * len(weights.cases)
    widest = meshes(cfg, default_spec(cfg, packed=False).rows)[-1]
    on = [c for c in weights.calls if c[0] == "on"]
    # one measurement per (batch, mesh): on the checked mesh and the config's widest
    assert on == [("on", SMALL, params, list(dict.fromkeys([str(c.mesh), str(widest)])), False,
                   3, (7, 8), "1a", None) for c in weights.cases]
    assert not [c for c in weights.calls if c[0] == "plain"]
    out = capsys.readouterr().out
    assert out.startswith(f"note: your weights (ck, {SMALL}): each mesh's thresholds measured "
                          "on them (the correct sharded training on that mesh and the widest, "
                          "at batch seeds 7 and 8, 100x the worst of each quantity)\n")


def test_weights_measure_each_batch_and_mesh_once(weights, monkeypatch):
    monkeypatch.setattr(T, "_cases", lambda args, w: [
        FakeCase(w[0], m, 0, 2, default_spec(w[0], packed=p), w[1])
        for p, m in ((False, Mesh(1, 2)), (False, Mesh(1, 2)), (True, Mesh(1, 2)))])
    run("--weights", "ck")
    on = [c for c in weights.calls if c[0] == "on"]
    assert [(c[4], c[3][0]) for c in on] == [(False, "dp=1 tp=2"), (True, "dp=1 tp=2")]
    assert weights.calls[1][2] is None  # no --config: the directory states the geometry
    assert [t for _, t, _ in weights.checked] == [{"on": on[0][3]}] * 2 + [{"on": on[1][3]}]


def test_weights_over_the_rank_pool_measure_on_its_meshes(weights, monkeypatch):
    pools = []

    def trainer(case):
        return "trace"
    monkeypatch.setattr(T, "_gloo_trainer", lambda cases: pools.append(
        [c.label for c in cases]) or trainer)
    run("--weights", "ck", "--config", "toy_kv4", "--batch", "packed", "--gloo", "--tp", "2")
    cfg = T.TRAIN_CONFIGS["toy_kv4"]
    widest = [m for m in meshes(cfg, default_spec(cfg, packed=True).rows) if m.dp == 1
              and m.tp <= 4][-1]
    on = [c for c in weights.calls if c[0] == "on"]
    assert on and all(c[3] == ["dp=1 tp=2", str(widest)] and c[7] == "1b" and c[8] is trainer
                      for c in on)
    assert [t for _, _, t in weights.checked] == ["trace"] * len(weights.cases)
    # a pool sized for each measured case, then one for the run
    assert pools == [*([c.label] for c in weights.cases), [c.label for c in weights.cases]]


@pytest.mark.parametrize(("argv", "message"), [
    (("--sp",), ("--weights trains DP x TP meshes; --sp / --cp on your weights is not built "
                 "(their floor domain is measured on its own)")),
    (("--cp", "2"), "--weights trains DP x TP meshes"),
    (("--config", "all"), "--weights holds one model: give its --config NAME, not all")])
def test_weights_refuse_what_they_cannot_train(weights, argv, message):
    with pytest.raises(WsbError) as e:
        run("--weights", "ck", *argv)
    assert str(e.value).startswith(message)
    assert not weights.cases


# ---- the gloo launchers -----------------------------------------------------------------------

def test_the_launchers_size_one_rank_pool_for_the_largest_mesh(monkeypatch):
    import weight_sync_bench.collectives.gloo.pool as P
    import weight_sync_bench.training.gloo as G
    sizes, calls = [], []
    monkeypatch.setattr(P, "shared_pool", lambda n: sizes.append(n) or f"pool{n}")
    monkeypatch.setattr(G, "train_gloo", lambda case, pool: calls.append((case, pool)) or "tr")
    monkeypatch.setattr(G, "gloo_mutation_matrix", lambda cs, t, pool, muts: calls.append(
        (cs, t, pool, muts)) or ["rows"])
    small = [argparse.Namespace(mesh=Mesh(1, 2)), argparse.Namespace(mesh=Mesh(1, 1))]
    wide = [*small, argparse.Namespace(mesh=Mesh(2, 3, False, 1))]
    assert T._gloo_trainer(small)(small[0]) == "tr"
    assert T._gloo_trainer(wide)(wide[2]) == "tr"
    assert sizes == [4, 6] and calls == [(small[0], "pool4"), (wide[2], "pool6")]
    calls.clear()
    assert T._gloo_matrix(wide)(wide[:1], {"t": 1}, ("m",)) == ["rows"]
    assert T._gloo_matrix(small)(small, {}, ()) == ["rows"]
    assert sizes[2:] == [6, 4]
    assert calls == [(wide[:1], {"t": 1}, "pool6", ("m",)), (small, {}, "pool4", ())]

"""The training floors under sequence and context parallelism (issue 30, the mutation pass
over ``training/sequence_floor.py``): the meshes that shard the sequence, the cases of the
SP / CP domain (configs, specs, seeds, meshes, labels, the cancelling regime), the cells
phase 1b's domain keeps of them, what ``load_sequence`` reads and refuses, and which floor
``thresholds_for`` judges a mesh by: ``sequence[_1b].json`` where the mesh shards the
sequence (sp, or cp > 1), ``training[_1b].json`` otherwise, with the phase 1b cell check
(``floor.require_mesh``) either way.

No case trains here: ``init_params`` (TOY's 19M parameters per spec and seed), the
adversary and the batches are stood in where the domain's cases are drawn; the committed
artifacts' cells are the check that the domain is the one measured.
"""

from __future__ import annotations

import json

import pytest

from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.training import load, thresholds_within
from weight_sync_bench.training import floor, sequence_floor
from weight_sync_bench.training import step as floor_step
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.floor import (
    PACKED_WITH_EMPTY_ROW,
    REPETITIONS,
    SMALL,
    SMALL_VARIANTS,
    STEPS,
    TOY_VARIANTS,
)
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.sequence_floor import (
    load_sequence,
    sequence_meshes,
    thresholds_for,
)

CONFIGS = (TOY, TOY_KV4, TOY_VARIANTS, *SMALL_VARIANTS)
SEQUENCE_COMMAND = "python -m weight_sync_bench.tolerance sequence --phase 1b --write"


# -- the meshes that shard the sequence


def test_every_tp_degree_with_sp_or_cp_where_the_sequence_splits_evenly():
    """SMALL (TP 1, 2, 4; 8 tokens): CP 1, 2, 4 over tp, SP on from t = 2, in the order
    tp, cp, sp off then on, dp 1 then 2; never the plain DP x TP shape (cp 1, sp off); SP
    over cp 4 at t = 4 would give each rank half a token (8 / 4 / 4) and is left out."""
    assert layout_for(SMALL).supported_degrees() == [1, 2, 4]
    on = [(1, 2, False), (1, 4, False),
          (2, 1, True), (2, 2, False), (2, 2, True), (2, 4, False), (2, 4, True),
          (4, 1, True), (4, 2, False), (4, 2, True), (4, 4, False)]
    assert sequence_meshes(SMALL, 4, 8) == [Mesh(dp, tp, sp, cp) for tp, cp, sp in on
                                            for dp in (1, 2)]


def test_a_sequence_that_does_not_split_leaves_its_cp_and_sp_meshes_out():
    """6 tokens: cp 4 does not divide them; under SP a cp chunk must split over t too (6 / 2
    = 3 tokens at t = 2 does not; 6 at t = 4 does not)."""
    assert sequence_meshes(SMALL, 1, 6) == [
        Mesh(1, 1, cp=2), Mesh(1, 2, sp=True), Mesh(1, 2, cp=2), Mesh(1, 4, cp=2)]


def test_dp_goes_up_to_the_rows_and_the_given_degrees():
    assert sequence_meshes(TOY, 2, 16) == [
        Mesh(dp, tp, sp, cp) for tp, cp, sp in
        [(1, 2, False), (1, 4, False), (2, 1, True), (2, 2, False), (2, 2, True),
         (2, 4, False), (2, 4, True)] for dp in (1, 2)]
    assert [m.dp for m in sequence_meshes(SMALL, 1, 8)] == [1] * 11  # dp <= rows
    assert {m.dp for m in sequence_meshes(SMALL, 4, 8, dps=(2, 4))} == {2, 4}
    assert sequence_meshes(SMALL, 2, 8, dps=(2,)) == [
        m for m in sequence_meshes(SMALL, 2, 8) if m.dp == 2]


# -- the committed domain's cases


@pytest.fixture
def light_params(monkeypatch):
    """``init_params`` stood in (TOY's 19M parameters per spec and seed would take seconds):
    each case's parameters name their config and seed, the adversary its config and t; a
    case handed no parameters (it would draw its own) says so."""
    monkeypatch.setattr(sequence_floor, "init_params",
                        lambda config, seed: {"drawn": (config.name, seed)})
    monkeypatch.setattr(floor_step, "init_params",
                        lambda config, seed: {"drawn by the case": (config.name, seed)})
    monkeypatch.setattr(sequence_floor.adversarial, "cancelling",
                        lambda config, p, t: {**p, "cancelling": (config.name, t)})
    monkeypatch.setattr(floor_step, "batches_for", lambda *a: ["batches"])


def specs_of(config):
    """Unpacked, packed, and the packed batch with a row of padding alone where it fits (4
    rows of 8 tokens: the SMALL configs)."""
    specs = [default_spec(config, packed=False), default_spec(config, packed=True)]
    fits = (config.batch, config.seq_len) == (PACKED_WITH_EMPTY_ROW.rows, 8)
    return specs + [PACKED_WITH_EMPTY_ROW] * fits


def test_every_config_spec_and_seed_trains_on_every_sequence_mesh(light_params):
    groups = [g for g in sequence_floor._groups(2, 3) if g[0] == "plain"]
    want = [(config, spec, seed) for config in CONFIGS for spec in specs_of(config)
            for seed in (0, 1)]
    assert len(groups) == len(want) == (2 + 2 + 2 + 3 * 3) * 2
    for (regime, label, cases), (config, spec, seed) in zip(groups, want, strict=True):
        assert label == f"{config.name} {'packed' if spec.packed else 'unpacked'} seed={seed}"
        assert [c.mesh for c in cases] == sequence_meshes(config, spec.rows, spec.seq_len)
        assert cases and all((c.config, c.seed, c.steps, c.spec) == (config, seed, 3, spec)
                             for c in cases)
        assert all(c.params == {"drawn": (config.name, seed)} for c in cases)
    assert [g[1] for g in groups[:4]] == ["toy unpacked seed=0", "toy unpacked seed=1",
                                          "toy packed seed=0", "toy packed seed=1"]
    assert sum(1 for g in groups if g[2][0].spec is PACKED_WITH_EMPTY_ROW) == 3 * 2


def test_the_cancelling_regime_of_the_small_configs_at_each_even_degree(light_params):
    groups = [g for g in sequence_floor._groups(2, 1) if g[0] == "cancelling"]
    want = [(config, seed, t) for config in SMALL_VARIANTS for seed in (0, 1)
            for t in layout_for(config).supported_degrees() if t % 2 == 0]
    assert [(c.name, s, t) for c, s, t in want] == [
        (name, s, t) for name, ts in (("small", (2, 4)), ("small_tied_bias", (2, 4)),
                                      ("small_gqa_bias", (2,))) for s in (0, 1) for t in ts]
    assert len(groups) == len(want)
    for (regime, label, cases), (config, seed, t) in zip(groups, want, strict=True):
        spec = default_spec(config, packed=True)
        assert label == f"{config.name} cancelling t={t} seed={seed}"
        assert [c.mesh for c in cases] == [
            m for m in sequence_meshes(config, spec.rows, spec.seq_len) if m.tp == t]
        assert cases and all((c.config, c.seed, c.steps, c.spec) == (config, seed, 1, spec)
                             for c in cases)
        assert all(c.params == {"drawn": (config.name, seed), "cancelling": (config.name, t)}
                   for c in cases)


@pytest.mark.parametrize("phase", ["1a", "1b"])
def test_the_committed_artifacts_cells_are_the_domains_cases_its_phase_keeps(
        light_params, committed, phase):
    """``measure`` keeps the cases of its phase's domain (``floor.in_domain``): every one in
    process; over gloo up to 8 ranks and cp 2, meshes with dp or cp > 1 on the first seed.
    The committed artifact measured exactly these cells (under each kernel set)."""
    artifact = committed[phase]
    groups = sequence_floor._groups(artifact["repetitions"], artifact["steps"])
    want = [(regime, f"{label} {c.mesh}") for regime, label, cases in groups for c in cases
            if floor.in_domain(phase, c.mesh, c.seed)]
    kernel_set = artifact["cells"][0]["kernel_set"]
    assert [(c["regime"], c["case"]) for c in artifact["cells"]
            if c["kernel_set"] == kernel_set] == want
    if phase == "1b":
        assert "small packed seed=1 dp=1 tp=2 sp" in {case for _, case in want}
        assert "small packed seed=1 dp=2 tp=2 sp" not in {case for _, case in want}
        assert "small packed seed=0 dp=2 tp=2 sp cp=2" in {case for _, case in want}
        assert not any(case.endswith("cp=4") for _, case in want)


def test_measure_sequence_measures_the_sequence_domain_into_the_sequence_artifact(
        monkeypatch):
    seen = []
    monkeypatch.setattr(sequence_floor, "_groups", lambda r, s: ("groups", r, s))
    monkeypatch.setattr(sequence_floor, "measure", lambda *a, **k: seen.append((a, k)) or 7)
    progress = object()
    assert sequence_floor.measure_sequence(5, 4, "1b", progress=progress) == 7
    assert sequence_floor.measure_sequence() == 7
    assert seen == [
        ((5, 4, "1b"), {"groups": ("groups", 5, 4), "kind": "sequence", "progress": progress}),
        ((REPETITIONS, STEPS, "1a"), {"groups": ("groups", REPETITIONS, STEPS),
                                      "kind": "sequence", "progress": None})]


# -- the artifact read back


@pytest.fixture(scope="module")
def committed():
    """The committed sequence floors of each phase, as their files hold them."""
    return {phase: json.loads(artifact_path(phase, kind="sequence").read_text())
            for phase in ("1a", "1b")}


def test_load_sequence_reads_the_phases_committed_sequence_floor(committed):
    assert artifact_path("1a", kind="sequence").name == "sequence.json"
    assert artifact_path("1b", kind="sequence").name == "sequence_1b.json"
    assert load_sequence() == committed["1a"]
    assert load_sequence(phase="1b") == committed["1b"]
    assert [(committed[p]["kind"], committed[p]["phase"]) for p in ("1a", "1b")] == [
        ("sequence", "1a"), ("sequence", "1b")]


def test_load_sequence_reads_the_path_it_is_given(committed, tmp_path):
    for phase in ("1a", "1b"):
        mine = {**committed[phase], "steps": 99, "cells": []}
        path = tmp_path / f"mine_{phase}.json"
        path.write_text(json.dumps(mine))
        assert load_sequence(path, phase=phase) == mine


def test_load_sequence_refuses_another_kind_another_phase_and_a_missing_file(
        committed, tmp_path):
    def written(name, **fields):
        path = tmp_path / name
        path.write_text(json.dumps({**committed["1a"], "cells": [], **fields}))
        return path
    with pytest.raises(ToleranceMismatch, match=r"training.json: not a schema-1 sequence "
                       r"artifact$"):
        load_sequence(written("training.json", kind="training"))
    with pytest.raises(ToleranceMismatch, match=r"s_1b.json: records phase '1b', "
                       r"asked for '1a': a floor is not reused across phases$"):
        load_sequence(written("s_1b.json", phase="1b"))
    with pytest.raises(ToleranceMismatch, match="records phase '1a', asked for '1b'"):
        load_sequence(written("s.json"), phase="1b")
    with pytest.raises(ToleranceMismatch, match=r"gone.json: no sequence tolerance; measure "
                       rf"it with `{SEQUENCE_COMMAND}`$"):
        load_sequence(tmp_path / "gone.json", phase="1b")


# -- which floor judges a mesh


@pytest.fixture
def asked(monkeypatch):
    """``floor.thresholds_for`` and ``load_sequence`` stood in: what each was asked."""
    calls = []

    def training(config, regime="plain", artifact=None, phase="1a", mesh=None):
        calls.append(("floor", config.name, regime, artifact, phase, mesh))
        return {"floor": len(calls)}

    def load_seq(path=None, phase="1a"):
        calls.append(("load_sequence", path, phase))
        return f"sequence {phase}"
    monkeypatch.setattr(sequence_floor, "_thresholds_for", training)
    monkeypatch.setattr(sequence_floor, "load_sequence", load_seq)
    return calls


@pytest.mark.parametrize("mesh", [Mesh(1, 1), Mesh(2, 2), Mesh(4, 1)])
def test_a_mesh_that_does_not_shard_the_sequence_is_judged_by_the_training_floor(
        asked, mesh):
    assert thresholds_for(SMALL, mesh) == {"floor": 1}
    assert thresholds_for(SMALL, mesh, "cancelling", {"a": 1}, "1b") == {"floor": 2}
    assert asked == [("floor", "small", "plain", None, "1a", mesh),
                     ("floor", "small", "cancelling", {"a": 1}, "1b", mesh)]


@pytest.mark.parametrize("mesh", [Mesh(1, 2, sp=True), Mesh(1, 1, cp=2), Mesh(2, 4, True, 4),
                                  Mesh(2, 2, cp=2)])
def test_a_mesh_with_sp_or_cp_is_judged_by_the_sequence_floor_of_its_phase(asked, mesh):
    assert thresholds_for(SMALL, mesh) == {"floor": 2}
    assert thresholds_for(SMALL, mesh, "cancelling", phase="1b") == {"floor": 4}
    given = {"phase": "1b", "kind": "sequence"}
    assert thresholds_for(SMALL, mesh, "cancelling", given, "1a") == {"floor": 5}
    # the artifact decides the phase of the cell check (``floor.thresholds_for``)
    assert [c[:4] + c[5:] for c in asked] == [
        ("load_sequence", None, "1a"), ("floor", "small", "plain", "sequence 1a", mesh),
        ("load_sequence", None, "1b"), ("floor", "small", "cancelling", "sequence 1b", mesh),
        ("floor", "small", "cancelling", given, mesh)]


def test_the_committed_floors_judge_each_mesh_and_1b_checks_the_cell(committed):
    config = SMALL_VARIANTS[1]
    assert thresholds_for(config, Mesh(1, 2, sp=True)) == thresholds_within(
        config, committed["1a"], "plain")
    assert thresholds_for(config, Mesh(2, 2, cp=2), "cancelling", phase="1b") == (
        thresholds_within(config, committed["1b"], "cancelling"))
    assert thresholds_for(config, Mesh(2, 2), phase="1b") == thresholds_within(
        config, load(phase="1b"), "plain")
    stale = committed["1b"]
    stale = {**stale, "cells": [c for c in stale["cells"] if "sp" not in c["case"].split()]}
    with pytest.raises(FloorNotMeasured, match=r"small_tied_bias: no measured sequence floor "
                       r"covers mesh dp=1 tp=2 sp \(2 ranks, phase 1b, plain regime\)"
                       ) as refused:
        thresholds_for(config, Mesh(1, 2, sp=True), artifact=stale)
    assert refused.value.command == SEQUENCE_COMMAND
    thresholds_for(config, Mesh(1, 2, cp=2), artifact=stale)  # the twin: measured

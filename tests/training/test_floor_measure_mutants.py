"""The training floors' measuring loop and its domain (issue 30, the mutation pass over
``training/floor.py``): which cases the committed floor trains, which meshes phase 1b's
domain admits, what a measurement records of each cell and of each quantity's worst, what
it refuses, and the thresholds read back from it.

A measurement here trains ``SMALL`` (d_model 32) cases for one step: milliseconds each.
What the committed floors hold is ``tests/tolerance/test_training_floor_mutants.py``'s;
the refusals of an unmeasured gloo mesh are ``test_gloo_floor_cells.py``'s.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.model.config import TOY, TOY_KV4, init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.training import QUANTITIES, REGIMES, domain_of, load
from weight_sync_bench.training import floor
from weight_sync_bench.training import step as floor_step
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.floor import (
    GLOO_ADDED_SEEDS,
    GLOO_MAX_CP,
    GLOO_WORLD,
    PACKED_WITH_EMPTY_ROW,
    SMALL,
    SMALL_VARIANTS,
    TOY_VARIANTS,
)
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.optimizer import AdamW
from weight_sync_bench.training.step import TrainingCase

SPEC = default_spec(SMALL, packed=True)


def case(mesh: Mesh, seed: int = 0, config=SMALL, spec=SPEC) -> TrainingCase:
    return TrainingCase(config, mesh, seed, 1, spec, init_params(config, seed))


# -- phase 1b's domain


@pytest.mark.parametrize(("mesh", "seed", "inside"), [
    (Mesh(1, 8), 5, True), (Mesh(2, 4), 0, True), (Mesh(8, 1), GLOO_ADDED_SEEDS - 1, True),
    (Mesh(2, 4), GLOO_ADDED_SEEDS, False),  # dp > 1: the first seeds only
    (Mesh(1, 2, cp=2), GLOO_ADDED_SEEDS, False), (Mesh(1, 2, cp=2), 0, True),
    (Mesh(1, 2, sp=True), 7, True),  # sp alone is not an added mesh
    (Mesh(3, 3), 0, False),  # 9 ranks
    (Mesh(1, 1, cp=4), 0, False), (Mesh(2, 2, cp=2), 0, True),  # cp 4 > GLOO_MAX_CP
    (Mesh(1, 2, cp=4), 0, False),
    (Mesh(4, 2, cp=2), 0, False)])  # 16 ranks: dp * cp * tp, not dp / cp * tp
def test_phase_1b_trains_meshes_up_to_its_world_and_cp_and_added_meshes_on_the_first_seeds(
        mesh, seed, inside):
    assert (GLOO_WORLD, GLOO_MAX_CP) == (8, 2)
    assert floor.over_gloo(mesh, seed) is inside
    assert floor.in_domain("1b", mesh, seed) is inside
    assert floor.in_domain("1a", mesh, seed) is True
    size_ok = mesh.dp * mesh.cp * mesh.tp <= GLOO_WORLD and mesh.cp <= GLOO_MAX_CP
    assert floor.over_gloo(mesh) is size_ok  # at any seed


def test_the_domain_the_1b_artifact_records():
    assert floor.gloo_domain() == {
        "max_ranks": 8, "max_cp": 2,
        "seeds": f"every seed at dp = cp = 1; the first {GLOO_ADDED_SEEDS} with dp or cp > 1"}


def test_meshes_are_every_tp_degree_with_dp_1_2_4_up_to_the_rows():
    degrees = layout_for(SMALL).supported_degrees()
    assert floor.meshes(SMALL, 4) == [Mesh(dp, t) for t in degrees for dp in (1, 2, 4)]
    assert floor.meshes(SMALL, 2) == [Mesh(dp, t) for t in degrees for dp in (1, 2)]
    assert floor.meshes(SMALL, 1) == [Mesh(1, t) for t in degrees]


# -- the committed domain's cases


@pytest.fixture
def light_params(monkeypatch):
    """``init_params`` stood in (TOY's 19M parameters, drawn per spec and seed, would take
    seconds): each case's parameters name their config and seed."""
    monkeypatch.setattr(floor, "init_params",
                        lambda config, seed: {"drawn": (config.name, seed)})
    monkeypatch.setattr(floor.adversarial, "loud_biases",
                        lambda config, p: {**p, "loud": config.name})
    monkeypatch.setattr(floor.adversarial, "cancelling",
                        lambda config, p, t: {**p, "cancelling": (config.name, t)})

    def max_elsewhere(base, t):
        far = TrainingCase(base.config, base.mesh, base.seed, base.steps, base.spec,
                           {**base.params, "far": t})
        return far
    monkeypatch.setattr(floor.adversarial, "max_elsewhere", max_elsewhere)
    monkeypatch.setattr(floor_step, "batches_for", lambda *a: ["batches"])


def test_the_committed_domain_trains_every_config_spec_and_seed_on_every_mesh(light_params):
    groups = floor._cases(2, 3)
    plain = [g for g in groups if " seed=" in g[1] and "cancelling" not in g[1]
             and "max_elsewhere" not in g[1]]
    want = []
    for config in (TOY, TOY_KV4, TOY_VARIANTS, *SMALL_VARIANTS):
        specs = [default_spec(config, packed=False), default_spec(config, packed=True)]
        if config.batch == 4 and config.seq_len == 8:
            specs.append(PACKED_WITH_EMPTY_ROW)
        for spec in specs:
            for seed in (0, 1):
                want.append((config.name, spec, seed))
    assert [(g[2][0].config.name, g[2][0].spec, g[2][0].seed) for g in plain] == want
    for regime, label, cases in plain:
        config, spec, seed = cases[0].config, cases[0].spec, cases[0].seed
        assert regime == "plain"
        assert label == f"{config.name} {'packed' if spec.packed else 'unpacked'} seed={seed}"
        assert [c.mesh for c in cases] == floor.meshes(config, spec.rows)
        assert all((c.config, c.seed, c.steps, c.spec) == (config, seed, 3, spec)
                   for c in cases)
        assert all(c.params == {"drawn": (config.name, seed)} for c in cases)
    assert sum(1 for g in plain if g[2][0].spec is PACKED_WITH_EMPTY_ROW) == 2 * 3  # SMALLs


def test_the_adversarial_cases_of_the_small_configs(light_params):
    groups = floor._cases(1, 2)
    adversarial = [g for g in groups if "cancelling" in g[1] or "max_elsewhere" in g[1]]
    want = []
    for config in SMALL_VARIANTS:
        for t in (d for d in layout_for(config).supported_degrees() if d >= 2):
            if t % 2 == 0:
                want.append(("cancelling", f"{config.name} cancelling t={t} seed=0"))
            want.append(("plain", f"{config.name} max_elsewhere t={t} seed=0"))
    assert [(g[0], g[1]) for g in adversarial] == want
    for regime, label, cases in adversarial:
        t = int(label.split("t=")[1].split()[0])
        config = cases[0].config
        assert [c.mesh for c in cases] == [Mesh(1, t), Mesh(2, t)]
        assert all((c.seed, c.steps, c.spec) == (0, 2, default_spec(config, packed=True))
                   for c in cases)
        loud = {"loud": config.name} if config.bias else {}
        extra = {"cancelling": (config.name, t)} if regime == "cancelling" else {"far": t}
        assert all(c.params == {"drawn": (config.name, 0), **loud, **extra} for c in cases)


def test_a_case_moved_to_another_mesh_keeps_everything_else_and_its_batches():
    base = case(Mesh(1, 2))
    base.adamw = AdamW(lr=0.25, betas=(0.5, 0.75))
    base.batches = ["the adversary's batches"]
    moved = floor._with_mesh(base, Mesh(2, 2))
    assert moved.mesh == Mesh(2, 2) and moved.batches is base.batches
    assert (moved.config, moved.seed, moved.steps, moved.spec, moved.params, moved.adamw) == (
        base.config, base.seed, base.steps, base.spec, base.params, base.adamw)


# -- a measurement


def test_a_measurement_records_every_cell_and_each_quantitys_worst_with_its_case():
    groups = [("plain", "small a", [case(Mesh(1, 2)), case(Mesh(2, 2))]),
              ("plain", "small b", [case(Mesh(1, 4), seed=1)]),
              ("cancelling", "small c", [case(Mesh(1, 2))])]
    seen = []
    art = floor.measure(3, 1, groups=groups, progress=lambda *a: seen.append(a))
    assert seen == [(1, 3, "small a"), (2, 3, "small b"), (3, 3, "small c")]
    assert (art["kind"], art["phase"], art["repetitions"], art["steps"]) == (
        "training", "1a", 3, 1)
    assert "meshes" not in art
    cells = art["cells"]
    assert [(c["regime"], c["case"]) for c in cells] == [
        ("plain", "small a dp=1 tp=2"), ("plain", "small a dp=2 tp=2"),
        ("plain", "small b dp=1 tp=4"), ("cancelling", "small c dp=1 tp=2")]
    assert all(set(c) == {"regime", "case", *QUANTITIES} for c in cells)
    for regime in REGIMES:
        mine = [c for c in cells if c["regime"] == regime]
        for q in QUANTITIES:
            worst = art["regimes"][regime][q]
            top = max(mine, key=lambda c, q=q: c[q])
            assert worst["worst"] == top[q] > 0
            assert worst["case"] == top["case"] and isinstance(worst["where"], str)
    assert art["domain"] == domain_of(SMALL)


def test_a_quantity_never_above_zero_keeps_an_empty_worst():
    """Two equal copies: the first cell to exceed 0 names the worst, a later equal one does
    not replace it."""
    groups = [("plain", "small a", [case(Mesh(1, 1)), case(Mesh(1, 1))])]
    art = floor.measure(1, 1, groups=groups, regimes=("plain",))
    assert list(art["regimes"]) == ["plain"]
    for q in QUANTITIES:
        worst = art["regimes"]["plain"][q]
        if worst["worst"] == 0.0:
            assert (worst["case"], worst["where"]) == ("", "")
        else:
            assert worst["case"] == "small a dp=1 tp=1"


def test_a_correct_run_with_an_inexact_exact_quantity_is_refused():
    bad = case(Mesh(2, 2))

    def train(c):
        trace = c.sharded()
        return dataclasses.replace(trace, replica_spread=0.25)
    with pytest.raises(ToleranceMismatch) as caught:
        floor.measure(1, 1, groups=[("plain", "small x", [bad])], train=train)
    assert str(caught.value) == ("small x dp=2 tp=2: replicas is 0.25 in a correct run, "
                                 "not 0")


def test_phase_1b_skips_the_cases_outside_its_domain_and_records_it(monkeypatch):
    trained = []
    monkeypatch.setattr(floor, "_trainer", lambda phase: (
        trained.append(phase) or (lambda c: trained.append(c.mesh) or c.sharded())))
    groups = [("plain", "small out", [case(Mesh(2, 2), seed=GLOO_ADDED_SEEDS)]),
              ("plain", "small in", [case(Mesh(2, 2), seed=GLOO_ADDED_SEEDS),
                                     case(Mesh(1, 2), seed=GLOO_ADDED_SEEDS)])]
    seen = []
    art = floor.measure(1, 1, "1b", groups=groups, progress=lambda *a: seen.append(a),
                        regimes=("plain",))
    assert trained == ["1b", Mesh(1, 2)]
    assert [c["case"] for c in art["cells"]] == ["small in dp=1 tp=2"]
    assert seen == [(2, 2, "small in")]  # an empty group is skipped, progress too
    assert art["meshes"] == floor.gloo_domain() and art["phase"] == "1b"


def test_the_trainer_of_each_phase():
    assert floor._trainer("1a")(case(Mesh(1, 1))) is None
    with pytest.raises(ToleranceMismatch) as caught:
        floor._trainer("2")
    assert str(caught.value) == "unknown phase '2'; known: 1a, 1b"


def test_the_kind_names_the_artifact():
    art = floor.measure(1, 1, groups=[("plain", "s", [case(Mesh(1, 2))])], kind="sequence",
                        regimes=("plain",))
    assert art["kind"] == "sequence"


# -- thresholds read back


def test_thresholds_on_a_users_weights_train_them_at_each_seed_on_each_mesh(monkeypatch):
    got = {}

    def measure(*, groups, phase, train, regimes):
        got.update(groups=groups, phase=phase, train=train, regimes=regimes)
        return "ARTIFACT"
    monkeypatch.setattr(floor, "measure", measure)
    monkeypatch.setattr(floor, "thresholds_within",
                        lambda config, artifact, regime: {"from": (config, artifact, regime)})
    params = init_params(SMALL, 5)
    train = object()
    out = floor.thresholds_on(SMALL, params, [Mesh(1, 2), Mesh(2, 2)], SPEC, 4, (7, 8),
                              phase="1b", train=train)
    assert out == {"from": (SMALL, "ARTIFACT", "plain")}
    assert (got["phase"], got["train"], got["regimes"]) == ("1b", train, ("plain",))
    assert [(r, label) for r, label, _ in got["groups"]] == [
        ("plain", "small your-weights seed=7"), ("plain", "small your-weights seed=8")]
    for (_, _, cases), seed in zip(got["groups"], (7, 8)):
        assert [c.mesh for c in cases] == [Mesh(1, 2), Mesh(2, 2)]
        assert all((c.seed, c.steps, c.spec, c.params) == (seed, 4, SPEC, params)
                   for c in cases)


def test_thresholds_for_reads_the_phases_floor_and_asks_1b_for_the_mesh(monkeypatch):
    asked = []
    monkeypatch.setattr(floor, "require_mesh", lambda *a: asked.append(a))
    training_1a, training_1b = load(phase="1a"), load(phase="1b")
    got = floor.thresholds_for(SMALL, mesh=Mesh(2, 2))
    assert got == floor.thresholds_within(SMALL, training_1a, "plain") and not asked
    got = floor.thresholds_for(SMALL, "cancelling", phase="1b", mesh=Mesh(2, 2))
    assert got == floor.thresholds_within(SMALL, training_1b, "cancelling")
    assert asked == [(training_1b, SMALL, Mesh(2, 2), "cancelling")]
    floor.thresholds_for(SMALL, phase="1b")  # no mesh: nothing to ask
    assert len(asked) == 1
    given = {**training_1b, "phase": "1a"}  # an artifact handed in: its own phase decides
    floor.thresholds_for(SMALL, artifact=given, phase="1b", mesh=Mesh(2, 2))
    assert len(asked) == 1
    assert all(math.isfinite(v) for v in got.values())


def test_without_groups_the_committed_domain_is_measured(monkeypatch):
    asked = []
    monkeypatch.setattr(floor, "_cases", lambda repetitions, steps: (
        asked.append((repetitions, steps)) or [("plain", "small d", [case(Mesh(1, 2))])]))
    art = floor.measure(4, 1, regimes=("plain",))
    assert asked == [(4, 1)] and [c["case"] for c in art["cells"]] == ["small d dp=1 tp=2"]


def test_in_process_every_case_is_measured_whatever_gloo_admits():
    outside = [case(Mesh(2, 2), seed=GLOO_ADDED_SEEDS), case(Mesh(1, 2), seed=GLOO_ADDED_SEEDS)]
    assert not floor.over_gloo(outside[0].mesh, outside[0].seed)
    art = floor.measure(1, 1, groups=[("plain", "small o", outside)], regimes=("plain",))
    assert [c["case"] for c in art["cells"]] == ["small o dp=2 tp=2", "small o dp=1 tp=2"]


def test_a_groups_cases_share_one_reference(monkeypatch):
    calls = []
    original = TrainingCase.reference
    monkeypatch.setattr(TrainingCase, "reference",
                        lambda self: calls.append(self.mesh) or original(self))
    floor.measure(1, 1, groups=[("plain", "small r", [case(Mesh(1, 2)), case(Mesh(2, 2))])],
                  regimes=("plain",))
    assert calls == [Mesh(1, 2)]


def test_phase_1b_trains_over_the_shared_rank_pool(monkeypatch):
    from weight_sync_bench.collectives.gloo import pool as gloo_pool
    from weight_sync_bench.training import gloo as training_gloo
    pools = []
    monkeypatch.setattr(gloo_pool, "shared_pool", lambda n: pools.append(n) or f"pool of {n}")
    monkeypatch.setattr(training_gloo, "train_gloo", lambda c, pool: ("trained", c, pool))
    train = floor._trainer("1b")
    one = case(Mesh(1, 2))
    assert pools == [GLOO_WORLD] and train(one) == ("trained", one, f"pool of {GLOO_WORLD}")


def test_thresholds_on_measure_in_process_by_default(monkeypatch):
    phases = []
    monkeypatch.setattr(floor, "measure", lambda **k: phases.append(k["phase"]) or "A")
    monkeypatch.setattr(floor, "thresholds_within", lambda config, artifact, regime: {})
    floor.thresholds_on(SMALL, init_params(SMALL, 0), [Mesh(1, 2)], SPEC, 1, (0,))
    assert phases == ["1a"]


def test_an_unmeasured_mesh_is_refused_by_the_artifacts_kind_phase_and_regime():
    from weight_sync_bench.errors import FloorNotMeasured
    bare = {"cells": []}  # no kind, no phase: a training floor of phase 1a
    with pytest.raises(FloorNotMeasured) as caught:
        floor.require_mesh(bare, SMALL, Mesh(2, 2))
    assert str(caught.value) == (
        "small: no measured training floor covers mesh dp=2 tp=2 (4 ranks, phase 1a, plain "
        "regime): training.json measured small at no mesh; a threshold measured on another "
        "mesh (another order of the sums) does not judge it. Measure it with "
        "`python -m weight_sync_bench.tolerance training --write`")
    plain = {"cells": [{"regime": "plain", "case": "small packed seed=0 dp=2 tp=2"}]}
    floor.require_mesh(plain, SMALL, Mesh(2, 2))  # the twin: measured
    with pytest.raises(FloorNotMeasured, match="cancelling regime"):  # but not cancelling
        floor.require_mesh(plain, SMALL, Mesh(2, 2), "cancelling")
    cancelling = {"cells": [{"regime": "cancelling",
                             "case": "small cancelling t=2 seed=0 dp=2 tp=2"}]}
    floor.require_mesh(cancelling, SMALL, Mesh(2, 2), "cancelling")

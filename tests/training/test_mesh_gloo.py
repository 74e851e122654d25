"""The DP x TP training mesh and context parallelism over gloo: one process per rank of the
mesh on the phase 1b rank pool, the same ``TrainStep`` as in process, compared with the
dense reference; the mutations the in-process mesh detects on these meshes are detected
here too, each beside its clean twin (the same case trained correctly passes). Each case is
judged by the phase 1b cells of its own mesh (``training.floor.require_mesh``).

Smallest geometry, one step (4 ranks on 2 cores); the longer runs are ``wsb train-check
--gloo`` and ``-m slow``."""

import re

import pytest

from weight_sync_bench.collectives.gloo.pool import RankPool, shared_pool
from weight_sync_bench.errors import InvalidMesh
from weight_sync_bench.training.floor import PACKED_WITH_EMPTY_ROW, SMALL_VARIANTS
from weight_sync_bench.training.gloo import (
    all_groups,
    coordinates,
    gloo_mutation_matrix,
    mesh_ranks,
    train_gloo,
)
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import training_mutation
from weight_sync_bench.training.sequence_floor import thresholds_for
from weight_sync_bench.training.step import TrainingCase

CONFIG = SMALL_VARIANTS[1]  # padded vocab, tied embeddings, biases


def _case(mesh: Mesh, steps: int = 1) -> tuple[TrainingCase, dict[str, float]]:
    case = TrainingCase(CONFIG, mesh, seed=5, steps=steps, spec=PACKED_WITH_EMPTY_ROW)
    return case, thresholds_for(CONFIG, mesh, phase="1b")


def test_global_ranks_are_the_in_process_mesh_s_flat_positions_replica_by_replica():
    mesh = Mesh(2, 2, cp=2)
    assert [coordinates(g, mesh) for g in (0, 1, 2, 5, 7)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert mesh_ranks(5, mesh) == ([4, 5], [5, 7], [1, 5])  # TP, CP, DP groups of rank 5
    assert mesh.tp_groups() == [[0, 1], [2, 3]] and mesh.cp_groups() == [[0, 2], [1, 3]]
    assert all_groups(Mesh(2, 2)) == [(0, 1), (0, 2), (1, 3), (2, 3)]


@pytest.fixture(scope="module")
def dp_tp():
    case, thresholds = _case(Mesh(2, 2))
    return case, thresholds, case.reference()


def test_a_dp2_x_tp2_mesh_over_gloo_trains_like_the_reference(dp_tp):
    case, thresholds, reference = dp_tp
    report = case.check(thresholds, reference=reference, trained=train_gloo(case, shared_pool(4)))
    assert report.passed, [(c.quantity, c.deviation, c.threshold) for c in report.comparisons]
    assert report["replicas"].deviation == 0.0  # the DP replicas byte-identical after the step


@pytest.mark.parametrize("name", ["equal_average_local_means", "doc_mask_offset"])
def test_dp_mutations_over_gloo_are_detected(dp_tp, name):
    case, thresholds, reference = dp_tp
    mutation = training_mutation(name)
    assert mutation.identity_reason(case) is None
    report = case.check(thresholds, reference=reference, mutation=name,
                        trained=train_gloo(case, shared_pool(4), mutation.recipe))
    assert not report.passed and report.worst.ratio > 10


@pytest.fixture(scope="module")
def cp():
    case, thresholds = _case(Mesh(1, 1, cp=2))
    return case, thresholds, case.reference()


def test_a_context_parallel_mesh_over_gloo_trains_like_the_reference(cp):
    case, thresholds, reference = cp
    report = case.check(thresholds, reference=reference, trained=train_gloo(case, shared_pool(4)))
    assert report.passed, [(c.quantity, c.deviation, c.threshold) for c in report.comparisons]


@pytest.mark.parametrize("name", ["cp_grad_unreduced", "cp_key_offset"])
def test_cp_mutations_over_gloo_are_detected(cp, name):
    case, thresholds, reference = cp
    mutation = training_mutation(name)
    assert mutation.identity_reason(case) is None
    report = case.check(thresholds, reference=reference, mutation=name,
                        trained=train_gloo(case, shared_pool(4), mutation.recipe))
    assert not report.passed and report.worst.ratio > 10


def test_a_mesh_larger_than_the_pool_is_refused_naming_both_sizes():
    case, _ = _case(Mesh(2, 4))
    pool = RankPool(4)  # its own: the shared pool may have grown past 4 in this process
    with pytest.raises(InvalidMesh, match=r"mesh dp=2 tp=4 needs 8 ranks over gloo, the rank "
                                          r"pool has 4"):
        train_gloo(case, pool)
    assert pool.pids == ()  # refused before a rank started


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [Mesh(2, 2), Mesh(1, 2, cp=2), Mesh(1, 2, sp=True, cp=2),
                                  Mesh(4, 1), Mesh(2, 1, cp=2)])
def test_every_mesh_of_four_ranks_detects_every_training_mutation_over_gloo(mesh):
    from weight_sync_bench.training.mutations import ALL_TRAINING_MUTATIONS

    case, thresholds = _case(mesh, steps=2)
    rows = gloo_mutation_matrix([case], thresholds, shared_pool(4), ALL_TRAINING_MUTATIONS)
    ran = [r for r in rows if r.report is not None]
    assert ran and all(r.detected for r in ran), [(r.mutation, r.report.worst) for r in ran
                                                  if not r.detected]
    clean = case.check(thresholds, trained=train_gloo(case, shared_pool(4)))
    assert clean.passed, clean.worst


def _train_check(argv):
    import argparse

    from weight_sync_bench.cli.train import register

    parser = argparse.ArgumentParser(prog="wsb")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_wsb_train_check_gloo_runs_dp_x_tp_and_cp_meshes_against_the_1b_floors(capsys):
    common = ["train-check", "--gloo", "--config", "small_tied_bias", "--steps", "1",
              "--batch", "packed"]
    assert _train_check([*common, "--dp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp=2 tp=2" in out and "1 passed, 0 failed (steps=1, seed=0, phase 1b)" in out
    assert _train_check([*common, "--cp", "2", "--tp", "1"]) == 0  # the matrix's clean twin
    out = capsys.readouterr().out
    assert "dp=1 tp=1 cp=2" in out and "1 passed, 0 failed (steps=1, seed=0, phase 1b)" in out
    assert _train_check([*common, "--cp", "2", "--tp", "1", "--mutations"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"(\d+) of (\d+) detected", out)
    assert found and found.group(1) == found.group(2) != "0", out

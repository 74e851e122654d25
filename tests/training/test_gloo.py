"""Training over gloo: one process per TP rank on the phase 1b rank pool, compared with the
dense reference against the phase 1b training floor (tolerance/training_1b.json)."""

import pytest

from tests.breadth import breadth
from weight_sync_bench.collectives.gloo.pool import shared_pool
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.training import load
from weight_sync_bench.training.floor import (
    PACKED_WITH_EMPTY_ROW,
    SMALL_VARIANTS,
    thresholds_for,
)
from weight_sync_bench.training.gloo import train_gloo
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import training_mutation
from weight_sync_bench.training.step import TrainingCase

CONFIG = SMALL_VARIANTS[1]  # padded vocab, tied embeddings, biases
GLOO = thresholds_for(CONFIG, phase="1b", mesh=Mesh(1, 4))  # a cell of this very mesh


@pytest.fixture(scope="module")
def case_and_reference():
    case = TrainingCase(CONFIG, Mesh(1, 4), seed=5, steps=2, spec=PACKED_WITH_EMPTY_ROW)
    return case, case.reference()


def test_a_tp_group_over_gloo_trains_like_the_reference(case_and_reference):
    case, reference = case_and_reference
    report = case.check(GLOO, reference=reference, trained=train_gloo(case, shared_pool(4)))
    assert report.passed, [(c.quantity, c.deviation, c.threshold) for c in report.comparisons]


# The TP backward over gloo (tp_ranks_as_examples: each rank's own loss output) and the
# row-parallel forward's all-reduce (row_bias_every_rank) by default; extra_tp_averaging
# (0.7 s), a TP gradient scaled as tp_ranks_as_examples' is, in the long run (detected in
# process by default: tests/training/test_mutations.py)
@pytest.mark.parametrize("name", breadth(["tp_ranks_as_examples", "row_bias_every_rank",
                                          "extra_tp_averaging"],
                                         keep={"tp_ranks_as_examples", "row_bias_every_rank"}))
def test_tp_mutations_over_gloo_are_detected(case_and_reference, name):
    case, reference = case_and_reference
    mutation = training_mutation(name)
    trained = train_gloo(case, shared_pool(4), mutation.recipe)
    report = case.check(GLOO, reference=reference, trained=trained, mutation=name)
    assert not report.passed and report.worst.ratio > 10


def test_gloo_has_its_own_floor():
    with pytest.raises(ToleranceMismatch, match="records phase '1a', asked for '1b'"):
        load(artifact_path("1a", kind="training"), phase="1b")  # the in-process floor is not reused

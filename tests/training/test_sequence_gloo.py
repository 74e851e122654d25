"""Sequence parallelism over gloo: the same forward (``reduce_scatter`` and ``all_gather``
along the sequence, one process per TP rank) trained against the dense reference.

The thresholds are SP-over-gloo's own (tolerance/sequence_1b.json): a floor is reused neither
across phases nor across meshes; the twin below shows the check is not vacuous."""

import pytest

from weight_sync_bench.collectives.gloo.pool import shared_pool
from weight_sync_bench.training.floor import PACKED_WITH_EMPTY_ROW, SMALL_VARIANTS
from weight_sync_bench.training.gloo import train_gloo
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import training_mutation
from weight_sync_bench.training.sequence_floor import thresholds_for
from weight_sync_bench.training.step import TrainingCase

CONFIG = SMALL_VARIANTS[1]  # padded vocab, tied embeddings, biases
GLOO = thresholds_for(CONFIG, Mesh(1, 2, sp=True), phase="1b")


@pytest.fixture(scope="module")
def sp_case():
    case = TrainingCase(CONFIG, Mesh(1, 2, sp=True), seed=5, steps=2, spec=PACKED_WITH_EMPTY_ROW)
    return case, case.reference()


def test_a_sequence_parallel_tp_group_over_gloo_trains_like_the_reference(sp_case):
    case, reference = sp_case
    report = case.check(GLOO, reference=reference, trained=train_gloo(case, shared_pool(4)))
    assert report.passed, [(c.quantity, c.deviation, c.threshold) for c in report.comparisons]


def test_the_split_backward_of_the_sp_gather_is_detected_over_gloo(sp_case):
    case, reference = sp_case
    mutation = training_mutation("sp_gather_backward_split")
    trained = train_gloo(case, shared_pool(4), mutation.recipe)
    report = case.check(GLOO, reference=reference, trained=trained, mutation=mutation.name)
    assert not report.passed and report.worst.ratio > 10

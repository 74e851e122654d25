"""Every training mutation is detected where it is not the identity, with its ratio; the
unmutated twin of each case passes; and where a mutation declares itself the identity,
running it really changes nothing."""

import pytest

from weight_sync_bench.model.config import TOY, init_params
from weight_sync_bench.training import adversarial
from weight_sync_bench.training.batches import BatchSpec, default_spec
from weight_sync_bench.training.floor import (
    PACKED_WITH_EMPTY_ROW,
    SMALL,
    SMALL_VARIANTS,
    thresholds_for,
)
from weight_sync_bench.training.loss import valid_count
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import (
    TRAINING_MUTATIONS,
    mutation_matrix,
    training_mutation,
)
from weight_sync_bench.training.step import TrainingCase

PLAIN = thresholds_for(TOY)
NAMES = [m.name for m in TRAINING_MUTATIONS]
TIED_BIASED = SMALL_VARIANTS[1]  # padded vocab 50 -> 52, tied embeddings, biases


@pytest.fixture(scope="module")
def exposing_case():
    """A case where no mutation is the identity: uneven valid counts over dp=2, ignored
    labels, padded vocab, tied embeddings, loud row-parallel biases, tp=2, and packed rows
    whose last DP rank has document boundaries (and a row of padding alone)."""
    params = adversarial.loud_biases(TIED_BIASED, init_params(TIED_BIASED, 3))
    case = TrainingCase(TIED_BIASED, Mesh(2, 2), seed=3, spec=PACKED_WITH_EMPTY_ROW,
                        params=params)
    # every step has the same layout, so the same uneven counts on the two DP ranks
    for batch in case.batches:
        assert [valid_count(batch.targets[rows]) for rows in case.mesh.row_blocks(4)] == [8, 4]
    return case, case.reference()


def test_the_unmutated_twin_of_the_exposing_case_passes(exposing_case):
    case, reference = exposing_case
    report = case.check(PLAIN, reference=reference)
    assert report.passed, [(c.quantity, c.deviation) for c in report.comparisons]


@pytest.mark.parametrize("name", NAMES)
def test_each_training_mutation_is_detected_where_it_is_not_the_identity(name, exposing_case):
    case, reference = exposing_case
    mutation = training_mutation(name)
    assert mutation.identity_reason(case) is None
    report = mutation.check(case, PLAIN, reference=reference)
    assert not report.passed
    worst = report.worst
    assert worst.ratio > 10, f"{name}: only {worst.ratio:.3g}x on {worst.quantity}"


def test_tp_ranks_as_examples_prints_the_right_loss_but_wrong_gradients(exposing_case):
    case, reference = exposing_case
    report = training_mutation("tp_ranks_as_examples").check(case, PLAIN, reference=reference)
    assert report["loss"].passed and not report["param_grad"].passed


IDENTITY_CASES = {
    "equal_average_local_means": dict(mesh=Mesh(1, 2)),
    "extra_tp_averaging": dict(mesh=Mesh(2, 1)),
    "tp_ranks_as_examples": dict(mesh=Mesh(2, 1)),
    "row_bias_every_rank": dict(config=SMALL, mesh=Mesh(2, 2)),  # no biases
    "padded_vocab_unmasked": dict(config=SMALL.replace(vocab=52), mesh=Mesh(2, 2)),
    "ignored_labels_counted": dict(spec=BatchSpec(((8,), (8,), (8,), (8,)), 8), mesh=Mesh(2, 2)),
    "doc_mask_offset": dict(spec=default_spec(SMALL, packed=False), mesh=Mesh(2, 2)),
}


@pytest.mark.parametrize("name", sorted(IDENTITY_CASES))  # the optimizer ones never are
def test_where_a_mutation_declares_itself_the_identity_it_changes_nothing(name):
    fields = {"config": TIED_BIASED, "spec": PACKED_WITH_EMPTY_ROW, **IDENTITY_CASES[name]}
    case = TrainingCase(fields["config"], fields["mesh"], seed=2, spec=fields["spec"])
    mutation = training_mutation(name)
    assert mutation.identity_reason(case) is not None
    assert mutation.check(case, PLAIN).passed


def test_a_late_boundary_that_only_moves_padding_is_declared_the_identity():
    # row 1 ends in padding: shifting its end one late changes a padding row of the mask,
    # which no valid label can see
    spec = BatchSpec(((8,), (5,)), 8, packed=True)
    case = TrainingCase(SMALL.replace(batch=2), Mesh(2, 1), spec=spec)
    mutation = training_mutation("doc_mask_offset")
    assert "no valid label depends" in mutation.identity_reason(case)
    assert mutation.check(case, PLAIN).passed
    moved = TrainingCase(SMALL.replace(batch=2), Mesh(2, 1), spec=BatchSpec(((8,), (3, 5)), 8,
                                                                            packed=True))
    assert mutation.identity_reason(moved) is None
    assert not mutation.check(moved, PLAIN).passed


def _toy_matrix_case():
    return TrainingCase(TOY, Mesh(2, 2), seed=3, steps=1, spec=default_spec(TOY, packed=True))


def test_on_toy_exactly_the_bias_and_padding_mutations_are_the_identity():
    # the cheap half of the matrix test below (no training): which cells it skips on TOY
    case = _toy_matrix_case()
    identity = {m.name for m in TRAINING_MUTATIONS if m.identity_reason(case) is not None}
    assert identity == {"row_bias_every_rank", "padded_vocab_unmasked"}  # no bias, no padding


# About 10 s (TOY's 19M parameters trained once per mutation). In the default run each
# mutation's detection at dp=2 x tp=2 is test_each_training_mutation_is_detected_where_it_is_
# not_the_identity (above, on the exposing case), mutation_matrix itself is run (9 of 9
# detected) by tests/cli/test_train.py::test_train_check_mutations_reports_each_ratio, and
# TOY's identity cells are the test above.
@pytest.mark.slow
def test_matrix_on_toy_detects_every_mutation_that_is_not_the_identity():
    case = _toy_matrix_case()
    rows = mutation_matrix([case], PLAIN)
    skipped = {r.mutation: r.identity for r in rows if r.report is None}
    assert set(skipped) == {"row_bias_every_rank", "padded_vocab_unmasked"}  # no bias, no padding
    assert all(r.detected for r in rows if r.report is not None)

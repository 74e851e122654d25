"""The comparison's exact checks fire, and the optimizer is compared directly: the padded-vocab
gradient check sees a gradient on a padded row, AdamW's moments catch a wrong beta2 at step 1,
and the hyperparameters each side stepped with catch a learning rate 0.5% high, which the
parameters alone cannot (see ``training.compare.EXACT``)."""

import math

import pytest
import torch

from weight_sync_bench.model.config import TOY
from weight_sync_bench.tolerance.training import QUANTITIES
from weight_sync_bench.training.compare import EXACT, Shards, Trace, deviations
from weight_sync_bench.training.floor import SMALL_VARIANTS
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import training_mutation
from weight_sync_bench.training.step import TrainingCase

NEVER = dict.fromkeys(QUANTITIES, math.inf)  # every toleranced quantity passes: exact ones decide
PADDED = next(c for c in SMALL_VARIANTS if c.padded_vocab > c.vocab)


@pytest.fixture(scope="module")
def padded_case():
    case = TrainingCase(PADDED, Mesh(1, 2), steps=1)
    return case, case.reference(), case.sharded()


def _with_padding_gradient(trace: Trace, value: float) -> Trace:
    """The sharded run's trace with one element of the last padded row set to ``value``:
    in the last TP rank's shard, which holds that row (compared where it lies, not
    gathered)."""
    grads = dict(trace.grads)
    table = grads["tok_embeddings.weight"]
    assert isinstance(table, Shards)
    last = table.tensors[-1].clone()
    last[-1, 0] = value
    grads["tok_embeddings.weight"] = Shards(table.tensors[:-1] + (last,), table.spec)
    assert grads["tok_embeddings.weight"].gather()[PADDED.padded_vocab - 1, 0] == value
    return Trace(trace.losses, trace.input_grad, grads, trace.params, trace.replica_spread,
                 trace.exp_avg, trace.exp_avg_sq, trace.hyperparameters)


def test_a_gradient_on_one_padded_vocab_row_fails_the_exact_padding_check(padded_case):
    case, ref, got = padded_case
    assert PADDED.padded_vocab > PADDED.vocab
    found = deviations(PADDED, case.params, ref, _with_padding_gradient(got, 2.0 ** -40))
    assert found["padding_grad"] == (2.0 ** -40, "tok_embeddings.weight")
    report = case.check(NEVER, reference=ref, trained=_with_padding_gradient(got, 2.0 ** -40))
    assert not report.passed and report.exact_failures[0].quantity == "padding_grad"


def test_the_twin_a_correct_run_has_exactly_zero_gradient_on_the_padded_rows(padded_case):
    case, ref, got = padded_case
    assert deviations(PADDED, case.params, ref, got)["padding_grad"][0] == 0.0
    assert case.check(NEVER, reference=ref, trained=got).passed


# The optimizer's claims on SMALL at dp 2 x tp 2: the moments' global positions, beta2's 98%
# and the learning rate's 0.5% are the same figures at any width (measured: 0.98 and 0.005 on
# every SMALL variant as on TOY), and TOY's 19M parameters made these three tests 7 s, this
# under 1. A named config at TOY's width trains like the reference in
# tests/training/test_step.py (toy_kv4-dp1-tp4-packed).
DP_TP = SMALL_VARIANTS[0]


@pytest.fixture(scope="module")
def dp_tp_case():
    case = TrainingCase(DP_TP, Mesh(2, 2), steps=1)
    return case, case.reference()


def test_the_moments_are_compared_in_global_position_and_match(dp_tp_case):
    case, ref = dp_tp_case
    got = case.sharded()
    assert len(got.exp_avg) == len(got.exp_avg_sq) == case.steps
    assert got.exp_avg[0].keys() == ref.exp_avg[0].keys() == case.params.keys()
    for name, want in ref.exp_avg_sq[0].items():
        assert got.exp_avg_sq[0][name].shape == want.shape
    found = deviations(DP_TP, case.params, ref, got)
    assert found["exp_avg"][0] < 1e-4 and found["exp_avg_sq"][0] < 1e-4
    assert found["hyperparameters"][0] == 0.0 and len(got.hyperparameters) == 4  # dp 2 x tp 2


def test_beta2_of_0999_on_the_sharded_side_is_caught_by_the_second_moment_at_step_1(dp_tp_case):
    case, ref = dp_tp_case
    mutation = training_mutation("adamw_beta2_0999")
    found = deviations(DP_TP, case.params, ref, case.sharded(mutation.recipe))
    # (1 - 0.999) g^2 against (1 - 0.95) g^2: 98% of the second moment
    assert found["exp_avg_sq"][0] == pytest.approx(0.98, rel=1e-3)
    assert found["exp_avg"][0] < 1e-4  # beta1 untouched: the first moment still matches
    assert found["hyperparameters"][0] == pytest.approx((0.999 - 0.95) / 0.95)


def test_a_learning_rate_half_a_percent_high_is_caught_by_the_hyperparameters(dp_tp_case):
    case, ref = dp_tp_case
    mutation = training_mutation("adamw_lr_half_percent_high")
    report = mutation.check(case, NEVER, reference=ref)
    assert report["hyperparameters"].deviation == pytest.approx(0.005)
    assert not report.passed and "hyperparameters" in EXACT


def test_the_token_seed_changes_the_tokens_and_a_check_uses_its_own():
    from weight_sync_bench import Checker
    from weight_sync_bench.model.config import make_tokens

    assert not torch.equal(make_tokens(TOY, 1000), make_tokens(TOY, 1001))
    assert torch.equal(make_tokens(TOY, 1000), make_tokens(TOY, 1000))
    assert not torch.equal(Checker(TOY, seed=0).tokens, Checker(TOY, seed=1).tokens)

"""Properties over fuzzed training cases (strategies.training): the correct distributed step
matches the dense one on every geometry, batch layout and DP x TP shape drawn, and every
training mutation is detected wherever it does not declare itself the identity.

The example budget follows the loaded profile (``wsb-test`` by default, ``wsb-nightly`` for
the long run); the mutation properties take a tenth of it each, being seven."""

import pytest
from hypothesis import event, given, settings
from weight_sync_bench.fuzz.strategies.training import training_cases

from weight_sync_bench.model.config import TOY
from weight_sync_bench.training import adversarial
from weight_sync_bench.training.floor import thresholds_for
from weight_sync_bench.training.mutations import TRAINING_MUTATIONS

PLAIN = thresholds_for(TOY)
PER_MUTATION = max(10, settings.default.max_examples // 10)


@settings(max_examples=max(20, settings.default.max_examples // 4))
@given(case=training_cases())
def test_correct_training_matches_the_reference_on_fuzzed_cases(case):
    event(f"dp={case.mesh.dp} tp={case.mesh.tp} packed={case.spec.packed}")
    report = case.check(PLAIN)
    failing = [(c.quantity, c.deviation, c.threshold, c.where) for c in report.comparisons
               if not c.passed]
    assert not failing


@pytest.mark.parametrize("mutation", TRAINING_MUTATIONS, ids=lambda m: m.name)
def test_training_mutations_are_detected_on_fuzzed_cases(mutation):
    @settings(max_examples=PER_MUTATION)
    @given(case=training_cases())
    def prop(case):
        if case.config.bias:  # biases of weight size hide under the residual of a tiny model
            case.params = adversarial.loud_biases(case.config, case.params)
        event("identity" if mutation.identity_reason(case) else "not identity")
        broken = mutation.broken_claim(case, PLAIN)
        assert broken is None, broken

    prop()

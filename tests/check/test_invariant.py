"""The invariant: ReferenceModel(full, x) == ShardedModel(reshard(split(full, src), dst), x)
within the measured phase-1a threshold, for every ordered pair of supported degrees."""

import pytest

from weight_sync_bench import TOY, TOY_KV4, Checker, layout_for, sweep
from weight_sync_bench.check.checker import degree_pairs
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.tolerance.rules import threshold_for

PAIRS = [(TOY, s, d) for s in (1, 2) for d in (1, 2)] + [
    (TOY_KV4, s, d) for s in (1, 2, 4) for d in (1, 2, 4)]  # 4 + 9 ordered pairs


class CountingForward:
    def __init__(self):
        self.calls = 0

    def __call__(self, config, shards, tokens):
        self.calls += 1
        return inprocess_forward(config, shards, tokens)


@pytest.fixture(scope="module")
def checkers():
    return {c.name: Checker(c, forward=CountingForward()) for c in (TOY, TOY_KV4)}


def test_the_pairs_are_every_ordered_pair_of_supported_degrees():
    assert [(c, s, d) for c in (TOY, TOY_KV4) for s, d in degree_pairs(layout_for(c))] == PAIRS


@pytest.mark.parametrize("config, src, dst", PAIRS, ids=[f"{c.name}-{s}to{d}" for c, s, d in PAIRS])
def test_resharded_logits_match_the_reference_within_the_threshold(checkers, config, src, dst):
    (verdict,) = sweep(config, pairs=[(src, dst)], checker=checkers[config.name])
    assert verdict.passed, str(verdict)
    assert verdict.threshold == threshold_for(config)
    if dst == 1:
        assert verdict.max_abs_error == 0.0  # a 1-way split reorders no sum


def test_a_sweep_runs_one_forward_per_destination_not_per_pair():
    forward = CountingForward()
    checker = Checker(TOY_KV4, forward=forward)
    verdicts = sweep(TOY_KV4, checker=checker)
    assert len(verdicts) == 9 and all(v.passed for v in verdicts)
    assert forward.calls == 3  # destinations 1, 2, 4
    assert not any(v.own_forward for v in verdicts)

"""Break tests: each seed injection is detected at every degree >= 2 of both configs.

Break tests alone are not enough. Each asserts two things: the injected bug deviates far
beyond the floor, and its clean twin passes. With a broken ShardedModel (o_proj's output
zeroed) the first assertion still holds for every injection, the second fails for every one:
it is only the clean twins, i.e. the invariant, that catch a broken forward. The last test
shows exactly that split.
"""

import pytest
import torch

from weight_sync_bench import TOY, TOY_KV4, Checker, sweep
from weight_sync_bench.check.checker import degree_pairs
from weight_sync_bench.check.mutations import SEED_MUTATIONS
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.model.sharded import ShardedModel

BREAKS = [(c, m, t) for c in (TOY, TOY_KV4) for m in SEED_MUTATIONS
          for t in (2,) + ((4,) if c is TOY_KV4 else ())]


@pytest.fixture(scope="module")
def checkers():
    return {c.name: Checker(c) for c in (TOY, TOY_KV4)}


@pytest.fixture(scope="module")
def clean_routes(checkers):
    """``clean_routes(config, degree)``: the verdict of the route 1 -> degree without an
    injection, computed once per module (every injection at that route shares it as its
    twin: the same checker, the same route, the same verdict)."""
    verdicts = {}

    def clean(config, degree):
        if (config.name, degree) not in verdicts:
            (verdicts[config.name, degree],) = sweep(config, pairs=[(1, degree)],
                                                     checker=checkers[config.name])
        return verdicts[config.name, degree]
    return clean


@pytest.mark.parametrize("config, mutation, degree", BREAKS,
                         ids=[f"{c.name}-{m.name}-t{t}" for c, m, t in BREAKS])
def test_seed_injection_is_detected_at_every_degree_of_two_or_more(checkers, clean_routes,
                                                                  config, mutation, degree):
    checker = checkers[config.name]
    assert mutation.identity_reason(config, degree) is None
    (verdict,) = sweep(config, pairs=[(1, degree)], mutation=mutation, checker=checker)
    assert not verdict.passed
    assert verdict.ratio > 100, str(verdict)  # far beyond the floor, not a borderline catch
    assert verdict.first_mismatch is not None and verdict.own_forward
    # the twin: the same route without the injection passes
    clean = clean_routes(config, degree)
    assert clean.passed, str(clean)


@pytest.mark.parametrize("mutation", SEED_MUTATIONS, ids=lambda m: m.name)
def test_every_seed_injection_is_the_identity_at_t1(checkers, mutation):
    assert mutation.identity_reason(TOY, 1) is not None
    checker = checkers["toy"]
    shards = mutation.apply(checker.declared(1), checker.layout, TOY)
    assert checker.verdict(shards, dst=1).passed


class ZeroedOProj(InProcessCollective):
    """A deliberately broken sharded model: attention's output never reaches the residual."""

    def all_reduce(self, xs, *, tag):
        out = super().all_reduce(xs, tag=tag)
        return [torch.zeros_like(o) for o in out] if tag.endswith("o_proj.weight") else out


def broken_forward(config, shards, tokens):
    return ShardedModel(config, shards, ZeroedOProj(len(shards)))(tokens)[0]


def test_a_broken_forward_passes_the_mutation_half_of_every_break_test_and_fails_the_rest():
    broken = {c.name: Checker(c, forward=broken_forward) for c in (TOY, TOY_KV4)}
    routes = {(c.name, *pair): v for c in (TOY, TOY_KV4)
              for pair, v in zip(degree_pairs(broken[c.name].layout),
                                 sweep(c, pairs=degree_pairs(broken[c.name].layout),
                                       checker=broken[c.name]))}
    invariant = list(routes.values())
    assert len(invariant) == 13 and not any(v.passed for v in invariant)
    # The mutation half of every break test still passes under the broken forward ...
    breaks = [v for c, m, t in BREAKS
              for v in sweep(c, pairs=[(1, t)], mutation=m, checker=broken[c.name])]
    assert all(not v.passed and v.ratio > 100 for v in breaks)
    # ... and its clean twin fails: only the unmutated route sees the broken forward (the
    # twin of each is the invariant's route 1 -> t, swept above by the same checker)
    twins = [routes[c.name, 1, t] for c, _, t in BREAKS]
    assert len(twins) == len(BREAKS) and not any(v.passed for v in twins)

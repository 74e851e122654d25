"""Fixtures of the checks' own tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def guarded_layers(monkeypatch):
    """The MoE layers at which a routing guard's ``choice`` is asked, in order: a forward
    given the reference's routing guard (``model.sharded.RoutingGuard``) asks it at every
    MoE layer it computes; one given none never does."""
    from weight_sync_bench.model.sharded import RoutingGuard
    asked: list[int] = []
    choice = RoutingGuard.choice

    def counted(self, layer, own, tokens=None):
        asked.append(layer)
        return choice(self, layer, own, tokens)
    monkeypatch.setattr(RoutingGuard, "choice", counted)
    return asked


@pytest.fixture
def sharded_guards(monkeypatch):
    """The routing guard each stepwise sharded forward (``model.stepwise.ShardedSteps``, the
    streamed checks') is built with, in order; None for a dense model's."""
    from weight_sync_bench.model.stepwise import ShardedSteps
    made = []
    over = ShardedSteps.over

    def spy(*a, **k):
        made.append(k.get("guard"))
        return over(*a, **k)
    monkeypatch.setattr(ShardedSteps, "over", staticmethod(spy))
    return made

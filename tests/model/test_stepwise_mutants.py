"""The forwards taken a stage at a time (issue 30, the mutation pass over ``model/stepwise.py``
and ``model/plan.py``): the stages a streamed check and a floor measurement report and hold,
the upcast each step computes with, and what ``ShardedSteps.over`` hands the sharded model.

The streamed checks themselves (the same verdict as the whole-model check, bit for bit) are
``tests/check/test_stream.py``'s and ``test_streaming_mutants.py``'s.
"""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.model.config import TOY, TOY_MOE
from weight_sync_bench.model.plan import experts_placement
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.model.stepwise import ShardedSteps, computing, stages
from weight_sync_bench.training.floor import SMALL_VARIANTS

TIED = SMALL_VARIANTS[1]


@pytest.mark.parametrize("config", [TOY, TIED, TOY_MOE], ids=lambda c: c.name)
def test_the_stages_are_the_embedding_each_layer_and_the_head_in_draw_order(config):
    names = list(config.param_shapes())
    got = stages(config)
    assert [label for label, _ in got] == (
        ["embedding"] + [f"layers.{i}" for i in range(config.n_layers)] + ["head"])
    assert got[0][1] == ["tok_embeddings.weight"]
    assert got[-1][1] == (["norm.weight"] if config.tie_embeddings
                          else ["norm.weight", "lm_head.weight"])
    for i in range(config.n_layers):
        assert got[1 + i][1] == [n for n in names if n.startswith(f"layers.{i}.")]
    assert [n for _, group in got for n in group] == names


def test_computing_upcasts_exactly_and_keeps_fp32_tensors_as_they_are():
    x = torch.randn(4, 3)
    b = torch.randn(5).to(torch.bfloat16)
    h = torch.randn(2).to(torch.float16)
    out = computing({"x": x, "b": b, "h": h})
    assert out["x"] is x
    assert out["b"].dtype == out["h"].dtype == torch.float32
    assert torch.equal(out["b"].to(torch.bfloat16), b) and torch.equal(out["h"].half(), h)
    assert list(out) == ["x", "b", "h"]


def test_over_hands_the_placements_and_the_routing_guard_to_the_sharded_model():
    collective = InProcessCollective(2)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    guard = RoutingGuard({}, 0.5)
    experts = experts_placement(TOY_MOE, ep=2)
    steps = ShardedSteps.over(TOY_MOE, collective, tokens, embedding=Replicate(),
                              experts=experts, guard=guard)
    model = steps.model
    assert (model.config, model.collective, model.embedding, model.experts, model.guard) == (
        TOY_MOE, collective, Replicate(), experts, guard)
    assert model.shards == [{}, {}] and steps.tokens is tokens and steps.local == 2
    assert ShardedSteps.over(TOY_MOE, collective, tokens).model.guard is None


@pytest.mark.parametrize("order", ["contiguous", "linear", "round_robin"])
def test_experts_placement_keeps_the_order_an_engine_places_experts_in(order):
    up = experts_placement(TOY_MOE, ep=2, etp=1, order=order)
    down = experts_placement(TOY_MOE, down=True, ep=4, order=order)
    assert (up.order, up.ep, up.etp, up.dim, up.blocks) == (
        order, 2, 1, 0, (TOY_MOE.expert_ffn, TOY_MOE.expert_ffn))
    assert (down.order, down.ep, down.etp, down.dim, down.blocks) == (
        order, 4, 0, 1, (TOY_MOE.expert_ffn,))
    assert up.n_experts == down.n_experts == TOY_MOE.n_experts

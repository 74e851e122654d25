"""``check.routing``: where the check's tokens hide a mutation from the forward. A change to
experts no token is routed to is hidden; a change to a routed expert at any layer, or to a
tensor that holds no expert, is not, whatever else the mutation touches."""

from __future__ import annotations

import pytest

from weight_sync_bench.check import routing
from weight_sync_bench.check.convert import conversion_checker
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.mutations import MUTATIONS, Conversion
from weight_sync_bench.model.config import ModelConfig

# 2 tokens, top-1 of 8 experts, 2 MoE layers: each layer routes to at most 2 experts
FEW = ModelConfig(name="few", vocab=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=4, ffn=16, n_experts=8, top_k=1, expert_ffn=8, batch=1, seq_len=2)
HF = endpoint("hf")


@pytest.fixture(scope="module")
def checker():
    return conversion_checker(FEW, threshold=1.0)


def _routed(checker, layer):
    return set(checker.checker.guard.routings[layer].experts.flatten().tolist())


def _changed(checker, *where):
    """The declared HF shards with ``(layer, expert)``'s gate_proj (or a named tensor) moved."""
    shards = [{n: t.clone() for n, t in rank.items()} for rank in checker.declared(HF)]
    for item in where:
        name = (item if isinstance(item, str)
                else f"model.layers.{item[0]}.mlp.experts.{item[1]}.gate_proj.weight")
        shards[0][name] += 1.0
    return shards


def test_a_change_to_unrouted_experts_alone_is_hidden_and_named(checker):
    idle = [min(set(range(FEW.n_experts)) - _routed(checker, layer)) for layer in (0, 1)]
    shards = _changed(checker, (0, idle[0]), (1, idle[1]))
    why = routing.unrouted_only(checker, Conversion(FEW, HF, HF), shards)
    assert why == ("it changes only experts no token is routed to on these tokens "
                   f"(layer 0: {idle[0]}; layer 1: {idle[1]})")
    bucket = MUTATIONS["expert_bucket_not_sent"]  # an expert-weight mutation: the same rule
    assert routing.forward_unchanged(checker, Conversion(FEW, HF, HF), bucket, shards) == why


def test_a_routed_expert_changed_at_one_layer_is_seen_though_another_layer_s_is_idle(checker):
    idle0 = min(set(range(FEW.n_experts)) - _routed(checker, 0))
    busy1 = min(_routed(checker, 1))
    shards = _changed(checker, (0, idle0), (1, busy1))
    assert routing.unrouted_only(checker, Conversion(FEW, HF, HF), shards) is None


def test_a_change_outside_the_experts_is_seen(checker):
    idle0 = min(set(range(FEW.n_experts)) - _routed(checker, 0))
    shards = _changed(checker, (0, idle0), "model.layers.0.mlp.gate.weight")
    assert routing.unrouted_only(checker, Conversion(FEW, HF, HF), shards) is None
    assert routing.unrouted_only(checker, Conversion(FEW, HF, HF),
                                 [dict(r) for r in checker.declared(HF)]) is None  # no change

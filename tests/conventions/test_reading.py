"""The forward reads a convention's local tensors as its framework does: a per-rank
permutation computed from the declared maps (never the data), KV heads per HeadReplicated,
and a hidden-split embedding looked up locally then all-gathered."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench import (
    TOY,
    TOY_KV4,
    InProcessCollective,
    ModelConfig,
    ReferenceModel,
    ShardedModel,
    init_params,
    layout_for,
    split,
)
from weight_sync_bench.conventions import (
    CONVENTIONS,
    forward_inputs,
    reading_plan,
    shards_for,
)
from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.layout.placements import (
    HeadReplicated,
    Replicate,
    Shard,
    local_kv_heads,
)
from weight_sync_bench.model.config import make_tokens
from weight_sync_bench.tolerance.rules import threshold_for

SMALL = ModelConfig(name="small", vocab=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2,
                    head_dim=8, ffn=48, seq_len=8)


@pytest.mark.parametrize("convention, degree, identity", [
    ("plain", 2, True), ("vllm", 2, True), ("vllm", 8, True),  # stored = what the forward reads
    ("megatron", 2, True),  # one KV group per rank: grouped order is [Q_r | K_r | V_r]
    ("megatron", 1, False),  # two groups on one rank: de-interleaved on the rank
    ("hf", 1, False), ("meta", 2, False),  # q/k/v concatenated; Meta's q/k rows re-paired
])
def test_the_reading_plan_is_the_identity_exactly_where_the_framework_stores_the_forward_layout(
        convention, degree, identity):
    assert reading_plan(CONVENTIONS[convention], TOY, degree).identity is identity


def test_vllm_past_n_kv_ranks_reads_its_qkv_as_head_replicated():
    forward = CONVENTIONS["vllm"].forward_layout(TOY, 8).layout
    assert forward["layers.0.qkv.weight"].placement == HeadReplicated(8, 2, 32)
    assert str(forward["layers.0.qkv.weight"].placement) == "HR(8,2,32)"
    assert CONVENTIONS["vllm"].forward_layout(TOY, 2).layout["layers.0.qkv.weight"].placement \
        != HeadReplicated(8, 2, 32)


def test_local_kv_heads_is_one_replicated_head_past_n_kv_ranks():
    assert [local_kv_heads(2, t) for t in (1, 2, 4, 8)] == [2, 1, 1, 1]
    assert local_kv_heads(8, 2) == 4


def test_a_wrong_shard_computes_wrong_logits_rather_than_failing_in_the_harness():
    # Meta rank 1's wk rows in HF order: shape-valid, so the forward runs and is wrong
    conv = CONVENTIONS["meta"]
    shards = shards_for(SMALL, "meta", 2)
    name = "layers.0.attention.wk.weight"
    shards[1][name] = shards[1][name].flip(0)
    plan = reading_plan(conv, SMALL, 2)
    logits = ShardedModel(SMALL, forward_inputs(shards, conv, SMALL, 2), InProcessCollective(2),
                          embedding=plan.forward.embedding)(make_tokens(SMALL, 0))[0]
    reference = ReferenceModel(SMALL, init_params(SMALL, 0))(make_tokens(SMALL, 0))
    assert torch.isfinite(logits).all() and (logits - reference).abs().max() > 1e-3


def _embedding_forward(config, degree, embedding, **kwargs):
    params, tokens = init_params(config, 0), make_tokens(config, 1000)
    shards = split(params, layout_for(config), degree)
    if embedding == Shard(1):
        for rank, table in enumerate(params["tok_embeddings.weight"].chunk(degree, dim=1)):
            shards[rank]["tok_embeddings.weight"] = table.clone()
    collective = InProcessCollective(degree)
    logits = ShardedModel(config, shards, collective, embedding=embedding, **kwargs)(tokens)[0]
    return logits, ReferenceModel(config, params)(tokens), collective.calls


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_hidden_split_embedding_is_a_local_lookup_then_an_all_gather(sequence_parallel):
    logits, reference, calls = _embedding_forward(TOY, 2, Shard(1),
                                                  sequence_parallel=sequence_parallel)
    assert calls[0] == ("all_gather", "tok_embeddings.weight")
    assert (logits - reference).abs().max() <= threshold_for(TOY)
    _, _, vocab_calls = _embedding_forward(TOY, 2, Shard(0), sequence_parallel=sequence_parallel)
    assert vocab_calls[0][0] == ("reduce_scatter" if sequence_parallel else "all_reduce")


def test_an_embedding_placement_the_forward_cannot_read_is_a_typed_error():
    with pytest.raises(UnsupportedLayout, match=r"tok_embeddings.weight: the forward reads an "
                       r"embedding split on the vocabulary \(S\(0\)\) or the hidden dimension "
                       r"\(S\(1\)\), not R"):
        _embedding_forward(TOY_KV4, 1, Replicate())

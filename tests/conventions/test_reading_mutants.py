"""``conventions.reading`` (issue 30, the mutation pass over ``conventions/reading.py``): how a
framework's forward reads its own local tensors.

A convention's forward layout says which canonical rows each rank's forward consumes; the
reading plan turns the tensors a rank stores into those inputs by a permutation computed from
the index maps alone. If the permutation is wrong, every verdict on that convention is wrong.
The tests check it three ways. First, against the forward layout applied to the canonical
parameters: every endpoint's inputs, bit for bit, padded rows as zeros. Second, against the
frameworks' own reading rules, written out here: Megatron-Core's de-interleave of
``linear_qkv``, HF's ``permute`` of Meta's wq and wk, and vLLM's KV head per rank past
``n_kv_heads`` ranks. Third, against a user's own bytes: stored padding is read as stored,
and padding the convention does not store is read as zeros. They also pin where the
in-process forward puts the dense ranks, the experts and the embedding, and that an identity
plan reads the stored tensors without copying them."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import (
    endpoint,
    forward_inputs,
    forward_model,
    materialize,
    reading_plan,
    shards_for,
)
from weight_sync_bench.conventions import reading as R
from weight_sync_bench.conventions.convention import Convention, ForwardLayout
from weight_sync_bench.conventions.maps import Piece, placed, rows
from weight_sync_bench.errors import UnsupportedConvention
from weight_sync_bench.model.config import TOY, ModelConfig, init_params, make_tokens
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard

# vocab 60: Megatron pads it to 128 t, vLLM to 64; 8 Q heads over 2 KV groups
C = ModelConfig(name="c", vocab=60, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2,
                head_dim=8, ffn=48, seq_len=8)
Q3 = TOY.replace(name="q3", vocab=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 ffn=96, n_layers=2, qk_norm=True, n_experts=8, top_k=2, expert_ffn=32,
                 norm_topk=True)


def declared_reads(config, where, params):
    """Each rank's forward inputs as the forward layout declares them: the canonical rows of
    every parameter at its placement over the world, the forward's padded rows zeros."""
    forward = reading_plan(where.convention, config, where).forward
    world = len(reading_plan(where.convention, config, where).ranks)
    out = []
    for rank in range(world):
        mine = {}
        for spec in forward.layout:
            full = torch.zeros(spec.shape)
            real = params[spec.name]
            full[tuple(slice(0, n) for n in real.shape)] = real
            dim, ranges = spec.ranges(world, rank)
            idx = torch.cat([rows(a, b) for a, b in ranges]) if ranges else rows(0, 0)
            mine[spec.name] = full.index_select(dim, idx)
        out.append(mine)
    return out


DENSE = ["plain:2", "megatron:1", "megatron:2", "megatron:4", "megatron:8", "vllm:2", "vllm:4",
         "hf", "meta:2", "megatron:tp=2,pp=2"]
MOE = ["megatron:tp=2,ep=4", "megatron:tp=4,ep=8,etp=1", "vllm:2", "vllm:tp=2,ep=2", "hf",
       "hf:experts=fused", "plain:tp=2,ep=2"]


@pytest.mark.parametrize("config, where", [(C, w) for w in DENSE] + [(Q3, w) for w in MOE],
                         ids=lambda x: getattr(x, "name", x))
def test_every_endpoints_forward_reads_exactly_the_rows_its_forward_layout_declares(config,
                                                                                    where):
    at = endpoint(where)
    params = init_params(config, 3)
    got = forward_inputs(materialize(at.pieces(config), params), at.convention, config, at)
    expected = declared_reads(config, at, params)
    assert len(got) == len(expected)
    for rank, (g, e) in enumerate(zip(got, expected)):
        assert list(g) == list(e), (where, rank)
        for name in e:
            assert torch.equal(g[name], e[name]), (where, rank, name)


def megatron_query_key_value(mixed, ng, np_, hn):
    """Megatron-Core's ``SelfAttention.get_query_key_value_tensors``
    (megatron/core/transformer/attention.py, core_r0.x), on the weight's rows: the local
    ``linear_qkv`` output viewed ``[ng, (np / ng + 2) * hn]`` and split into
    ``[np / ng * hn, hn, hn]`` per group, queries then keys then values."""
    d = mixed.shape[-1]
    q, k, v = mixed.view(ng, (np_ // ng + 2) * hn, d).split([np_ // ng * hn, hn, hn], dim=1)
    return torch.cat([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])


@pytest.mark.parametrize("t", [1, 2])
def test_megatrons_qkv_is_read_as_megatron_core_splits_its_groups(t):
    at = endpoint(f"megatron:{t}")
    shards = shards_for(C, at)
    inputs = forward_inputs(shards, at.convention, C, at)
    ng, np_ = C.n_kv_heads // t, C.n_heads // t
    for rank in range(t):
        for i in range(C.n_layers):
            mixed = shards[rank][f"decoder.layers.{i}.self_attention.linear_qkv.weight"]
            assert torch.equal(inputs[rank][f"layers.{i}.qkv.weight"],
                               megatron_query_key_value(mixed, ng, np_, C.head_dim))


def hf_permute(w, n_heads, dim1, dim2):
    """transformers' convert_llama_weights_to_hf.py::permute, as written there."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def test_metas_wq_and_wk_are_read_in_hfs_rotate_half_order_and_wv_as_stored():
    shards = shards_for(C, "meta:2")
    at = endpoint("meta:2")
    inputs = forward_inputs(shards, at.convention, C, at)
    hd, d = C.head_dim, C.d_model
    for rank in range(2):
        a = "layers.0.attention."
        wq, wk, wv = (shards[rank][a + w + ".weight"] for w in ("wq", "wk", "wv"))
        expected = torch.cat([hf_permute(wq, C.n_heads // 2, C.n_heads // 2 * hd, d),
                              hf_permute(wk, C.n_kv_heads // 2, C.n_kv_heads // 2 * hd, d), wv])
        assert torch.equal(inputs[rank]["layers.0.qkv.weight"], expected)
        ff = "layers.0.feed_forward."
        assert torch.equal(inputs[rank]["layers.0.gate_up.weight"],
                           torch.cat([shards[rank][ff + "w1.weight"],
                                      shards[rank][ff + "w3.weight"]]))
        # the hidden-split embedding read as stored
        assert torch.equal(inputs[rank]["tok_embeddings.weight"],
                           shards[rank]["tok_embeddings.weight"])


def test_vllm_past_n_kv_ranks_reads_kv_head_rank_over_its_replicas():
    # vllm/model_executor/layers/linear.py, QKVParallelLinear: num_kv_head_replicas =
    # tp / n_kv_heads, and rank r loads KV head r // num_kv_head_replicas
    t, params = 8, init_params(C, 0)
    at = endpoint(f"vllm:{t}")
    inputs = forward_inputs(shards_for(C, at), at.convention, C, at)
    q, hd, qkv = C.q_rows, C.head_dim, params["layers.1.qkv.weight"]
    for rank in range(t):
        head = rank // (t // C.n_kv_heads)
        got = inputs[rank]["layers.1.qkv.weight"]
        assert torch.equal(got[:hd], qkv[rank * hd:(rank + 1) * hd])
        assert torch.equal(got[hd:2 * hd], qkv[q + head * hd:q + (head + 1) * hd])
        assert torch.equal(got[2 * hd:], qkv[q + C.kv_rows + head * hd:
                                             q + C.kv_rows + (head + 1) * hd])


def test_stored_vocabulary_padding_is_read_as_stored_not_as_zeros():
    # a user's shard with something in Megatron's padding rows: the forward reads those rows
    # (a wrong shard computes what the framework would), at the padded rows' own places
    at = endpoint("megatron:2")
    shards = shards_for(C, at)
    name = "embedding.word_embeddings.weight"
    rows_per_rank = shards[1][name].shape[0]  # 128: 256 padded rows over 2
    shards[1][name][rows_per_rank - 1] = 7.0  # global row 255, padding
    inputs = forward_inputs(shards, at.convention, C, at)
    got = inputs[1]["tok_embeddings.weight"]
    assert got.shape == (rows_per_rank, C.d_model)
    assert torch.equal(got, shards[1][name])
    assert (got[rows_per_rank - 1] == 7.0).all()


def test_a_gathered_qkv_is_gathered_over_the_ranks_own_tp_group_only():
    # Megatron at t > n_kv_heads all-gathers mixed_qkv over the TP group: where the world
    # holds two data-parallel replicas of TP 4, a wrong copy on replica 1 is what replica 1's
    # forward reads, and replica 0's is untouched
    at = endpoint("megatron:tp=4,ep=8,etp=1")
    plan = reading_plan(at.convention, Q3, at)
    assert plan.forward.tp == 4 and len(plan.ranks) == 8 and plan.forward.gathered
    clean = shards_for(Q3, at)
    wrong = shards_for(Q3, at)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    wrong[4][name] = wrong[4][name] + 1.0
    a = forward_inputs(clean, at.convention, Q3, at)
    b = forward_inputs(wrong, at.convention, Q3, at)
    qkv = "layers.0.qkv.weight"
    assert all(torch.equal(a[r][qkv], b[r][qkv]) for r in range(4))
    assert not torch.equal(a[4][qkv], b[4][qkv])


def _partly_padded_build(config, at):
    """Stores the vocabulary padded to a multiple of 2 (one padding row at vocab 61)."""
    layout = layout_for(config.replace(vocab_multiple=2))
    shapes = config.param_shapes()
    return [{s.name: placed(s, at.degree, r, real=shapes[s.name][s.ranges(at.degree, r)[0]])
             for s in layout} for r in range(at.degree)]


def _padded_reads(config, at):
    """Reads it padded to a multiple of 4: three padding rows, one of them stored."""
    forward = config.replace(vocab_multiple=4)
    return ForwardLayout(forward, layout_for(forward))


PARTLY = Convention("partly", "pads less than its forward reads", _partly_padded_build,
                    _padded_reads)


def test_padding_the_convention_does_not_store_is_read_as_zeros_after_the_stored_padding():
    c61 = C.replace(name="c61", vocab=61)
    shards = materialize(PARTLY.pieces(c61, 1), init_params(c61, 0))
    for name in ("tok_embeddings.weight", "lm_head.weight"):
        assert shards[0][name].shape[0] == 62
        shards[0][name][61] = 5.0  # the one stored padding row, as a user's shard has it
    plan = reading_plan(PARTLY, c61, 1)
    selection = plan.ranks[0]["tok_embeddings.weight"]
    assert selection.zero.tolist() == [62, 63]
    got = forward_inputs(shards, PARTLY, c61, 1)[0]
    for name in ("tok_embeddings.weight", "lm_head.weight"):
        assert got[name].shape == (64, C.d_model)
        assert torch.equal(got[name][:62], shards[0][name])
        assert (got[name][61] == 5.0).all()
        assert not got[name][62:].any()


def test_a_selection_without_pieces_concatenates_the_named_tensors_as_they_are():
    stored = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.arange(6.0, 10.0).reshape(2, 2)}
    whole = R.Selection(("a", "b"), 0, None, None).apply(stored)
    assert torch.equal(whole, torch.arange(10.0).reshape(5, 2))
    picked = R.Selection(("a", "b"), 0, torch.tensor([4, 0, 1]), torch.tensor([2])).apply(stored)
    assert torch.equal(picked, torch.tensor([[8.0, 9.0], [0.0, 1.0], [0.0, 0.0]]))
    cols = R.Selection(("a", "b"), 1, torch.tensor([1]), None).apply(
        {"a": torch.zeros(2, 1), "b": torch.ones(2, 1)})
    assert torch.equal(cols, torch.ones(2, 1))


@pytest.mark.parametrize("where", ["vllm:2", "plain:2", "megatron:2"])
def test_an_identity_plan_hands_the_forward_the_stored_tensors_themselves(where):
    # no copy: a forward over the stored tensors, not twice the memory
    at = endpoint(where)
    shards = shards_for(C, at)
    assert reading_plan(at.convention, C, at).identity
    for mine, inputs in zip(shards, forward_inputs(shards, at.convention, C, at)):
        assert all(any(x is s for s in mine.values()) for x in inputs.values())


def test_a_one_row_tensor_read_with_a_padded_row_reads_its_row_then_a_zero():
    pieces = [("w", Piece("x", 0, rows(0, 1)))]
    selection = R._select(pieces, torch.tensor([0, -1]), 0, "here")
    assert selection.zero.tolist() == [1]
    assert torch.equal(selection.apply({"w": torch.full((1, 2), 3.0)}),
                       torch.tensor([[3.0, 3.0], [0.0, 0.0]]))


def test_a_rank_missing_rows_its_forward_reads_is_named_with_the_first_eight():
    pieces = [("w", Piece("x", 0, rows(0, 4)))]
    with pytest.raises(AssertionError, match=r"^here: rank stores no copy of canonical indices "
                       r"\[4, 5, 6, 7, 8, 9, 10, 11\] its forward reads$"):
        R._select(pieces, rows(0, 20), 0, "here")
    with pytest.raises(AssertionError, match=r"indices \[30\] its"):  # past every stored one
        R._select(pieces, torch.tensor([0, 30]), 0, "here")


def test_a_staged_endpoints_plan_is_its_unstaged_ones_after_the_stage_rules():
    at = endpoint("megatron:tp=2,pp=2")
    assert reading_plan(at.convention, C, at) is reading_plan(at.convention, C, at.unstaged())
    with pytest.raises(UnsupportedConvention, match="pp=3"):  # 2 layers over 3 stages
        reading_plan(at.convention, C, endpoint("megatron:tp=2,pp=3"))


def _model(config, where, guard=None):
    at = endpoint(where)
    plan = reading_plan(at.convention, config, at)
    inputs = forward_inputs(materialize(at.pieces(config), init_params(config, 0)),
                            at.convention, config, at)
    return forward_model(plan.forward, inputs, guard=guard), plan


@pytest.mark.parametrize("config, where", [(C, "meta:2"), (C, "megatron:4"), (Q3, "vllm:2"),
                                           (Q3, "vllm:tp=2,ep=2"), (Q3, "megatron:tp=2,ep=4")],
                         ids=lambda x: getattr(x, "name", x))
def test_the_in_process_forward_of_every_layout_computes_the_reference(config, where):
    model, plan = _model(config, where)
    tokens = make_tokens(config, 7)
    reference = ReferenceModel(config, init_params(config, 0))(tokens)
    logits = model(tokens)
    assert len(logits) == endpoint(where).world
    for rank_logits in logits:
        real = rank_logits[..., :config.vocab]  # the padded vocabulary's rows dropped
        assert real.shape == reference.shape, where
        assert (real - reference).abs().max() <= 5e-6, where
    assert model.embedding == plan.forward.embedding and model.experts == plan.forward.experts


def test_a_world_wider_than_tp_runs_tp_groups_side_by_side_and_experts_over_the_world():
    guard = RoutingGuard({}, 0.0)
    model, plan = _model(Q3, "megatron:tp=2,ep=4", guard=guard)
    assert plan.forward.tp == 2 and len(plan.ranks) == 8
    assert model.collective.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert model.experts_group.degree == 8
    assert model.guard is guard
    dense, _ = _model(Q3, "vllm:2")
    assert dense.collective.degree == 2 and dense.experts_group is None and dense.guard is None

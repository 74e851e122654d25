"""``model.sharded`` (issue 30, the mutation pass over ``model/sharded.py``): the tensor-,
sequence-, context- and expert-parallel forward, written once over the collectives' protocol.

The layout is Megatron-Core's (``ColumnParallelLinear`` / ``RowParallelLinear``, the row-
parallel bias added once after the reduce; ``VocabParallelEmbedding``'s masked lookup; with
``sequence_parallel`` the column-parallel inputs all-gathered and the row-parallel outputs
reduce-scattered along the sequence). A forward is judged by its logits against the unsharded
``ReferenceModel`` on the same parameters, per local rank, at 2e-6 (a correct one differs by
summation order only, ~1e-7). Pinned here: every dense variant the layout table declares
(biases, tied and padded vocabularies, q/k norms) at TP 2 and 4 with and without SP; packed
documents under CP and SP; each rank's unreduced vocab slice; the global positions each
rank's residual stream holds; the collectives a forward asks for, named by the parameter or
layer they serve (the breadcrumbs a gloo failure reports); the refusals' text; the routing
guard's bound. ``test_moe.py`` has the MoE forwards under every expert placement."""

from __future__ import annotations

import re

import pytest
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective, InProcessGroups
from weight_sync_bench.errors import UnevenSequence, UnsupportedLayout
from weight_sync_bench.layout.placements import Experts, Shard
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import TOY, ModelConfig, init_params, make_tokens
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.routing import Routing
from weight_sync_bench.model.sharded import (
    RoutingGuard,
    ShardedModel,
    check_sequence_split,
)

D = ModelConfig(name="d", vocab=60, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                head_dim=8, ffn=48, batch=2, seq_len=8)
# two packed rows: documents of 3 and 4 tokens then one padding position; three documents
SEGMENTS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 1, 1, 1, 2, 2, 2]])
ATOL = 2e-6


def sharded(c: ModelConfig, t: int, **kwargs) -> tuple[ShardedModel, torch.Tensor, torch.Tensor]:
    """A TP-``t`` forward of ``c`` on seed 0's parameters, its tokens and the reference's
    logits (packed as ``segments`` when given)."""
    segments = kwargs.pop("segments", None)
    p, tokens = init_params(c, 0), make_tokens(c, 1)
    expected = ReferenceModel(c, p)(tokens, segments)
    return ShardedModel(c, split(p, layout_for(c), t), InProcessCollective(t), **kwargs), \
        tokens, expected


@pytest.mark.parametrize("variant", [
    {}, {"bias": True}, {"qkv_bias": True}, {"o_bias": True, "qk_norm": True},
    {"tie_embeddings": True, "vocab_multiple": 16}, {"vocab_multiple": 16},
], ids=lambda v: "-".join(v) or "plain")
@pytest.mark.parametrize("t, sp", [(2, False), (2, True), (4, True)])
def test_every_dense_variant_is_the_reference_on_every_rank(variant, t, sp):
    model, tokens, expected = sharded(D.replace(**variant), t, sequence_parallel=sp)
    logits = model(tokens)
    assert len(logits) == t
    for rank in logits:
        torch.testing.assert_close(rank, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("sp", [False, True])
def test_packed_documents_are_the_reference_under_tensor_and_sequence_parallelism(sp):
    model, tokens, expected = sharded(D.replace(bias=True), 2, sequence_parallel=sp,
                                      segments=SEGMENTS)
    for rank in model(tokens, SEGMENTS):
        torch.testing.assert_close(rank, expected, rtol=0, atol=ATOL)


def cp2_tp2(c: ModelConfig, sp: bool):
    """CP 2 x TP 2 over four flat positions (j, r) -> 2 j + r, as ``test_moe`` lays it out;
    the model, its two groups, the tokens and the reference's packed logits."""
    p, tokens = init_params(c, 0), make_tokens(c, 1)
    expected = ReferenceModel(c, p)(tokens, SEGMENTS)
    shards = split(p, layout_for(c), 2)
    tp, cp = InProcessGroups([[0, 1], [2, 3]]), InProcessGroups([[0, 2], [1, 3]])
    model = ShardedModel(c, shards + shards, tp, context=cp, sequence_parallel=sp)
    return model, tp, cp, tokens, expected


@pytest.mark.parametrize("sp", [False, True])
def test_packed_documents_under_context_parallelism_are_the_reference_chunk_by_chunk(sp):
    model, _, _, tokens, expected = cp2_tp2(D.replace(bias=True), sp)
    logits = model(tokens, SEGMENTS)
    assert [tuple(x.shape) for x in logits] == [(2, 4, 60)] * 4  # (B, T / cp, vocab)
    for position, rank in enumerate(logits):
        j = position // 2  # CP rank: positions [4 j, 4 j + 4)
        torch.testing.assert_close(rank, expected[:, 4 * j:4 * j + 4], rtol=0, atol=ATOL)
    # and unpacked: plain causal attention over the global positions
    plain = ReferenceModel(model.config, init_params(model.config, 0))(tokens)
    torch.testing.assert_close(model(tokens)[3], plain[:, 4:], rtol=0, atol=ATOL)


def test_each_ranks_residual_stream_holds_its_chunks_global_positions():
    model, _, _, tokens, _ = cp2_tp2(D, sp=True)
    assert model.chunks(8) == [(0, 4), (0, 4), (4, 8), (4, 8)]
    # nothing before a forward has run (a dense model routes nothing in it either)
    assert model.embedding_output is None and model.embedding_positions is None
    model(tokens)
    assert model.routings == {}
    # SP shards each chunk over the TP ranks: TP rank r of CP rank j holds [4 j + 2 r, + 2)
    assert model.embedding_positions == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # ints: the training check slices the reference's embedding gradient with them
    assert {type(x) for pair in model.embedding_positions for x in pair} == {int}
    assert [tuple(h.shape) for h in model.embedding_output] == [(2, 2, 32)] * 4
    no_sp, _, _, _, _ = cp2_tp2(D, sp=False)
    no_sp(tokens)
    assert no_sp.embedding_positions == [(0, 4), (0, 4), (4, 8), (4, 8)]
    tp_only, _, _ = sharded(D, 4, sequence_parallel=True)
    assert tp_only.chunks(8) == [(0, 8)] * 4
    tp_only(tokens)
    assert tp_only.embedding_positions == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_unreduced_logits_are_each_ranks_slice_of_the_padded_vocabulary():
    c = D.replace(tie_embeddings=True, vocab_multiple=16)  # 60 -> 64 rows, 32 a rank
    model, tokens, expected = sharded(c, 2, sequence_parallel=True)
    local = model(tokens, gather_logits=False)
    assert [tuple(x.shape) for x in local] == [(2, 8, 32)] * 2  # (B, T, padded_vocab / t)
    whole = torch.cat(local, dim=-1)
    torch.testing.assert_close(whole[..., :60], expected, rtol=0, atol=ATOL)
    gathered = model(tokens)
    assert [tuple(x.shape) for x in gathered] == [(2, 8, 60)] * 2  # padding columns cut
    unpadded, tokens, expected = sharded(D, 2)
    assert [tuple(x.shape) for x in unpadded(tokens)] == [(2, 8, 60)] * 2


@pytest.mark.parametrize("t", [2, 4])
def test_a_vocab_parallel_lookup_of_every_token_id_is_the_tables_row(t):
    # Megatron-Core VocabParallelEmbedding: ids outside [vocab_start, vocab_end) masked to 0,
    # the lookup's rows zeroed there, the partial embeddings all-reduced
    c = D.replace(vocab_multiple=16)  # 64 rows: 32 or 16 a rank, the last 4 padding
    model, _, _ = sharded(c, t)
    table = init_params(c, 0)["tok_embeddings.weight"]
    ids = torch.arange(60).view(2, 30)  # (B, T): every id, each rank's first and last
    for h in model.embed([ids] * t):
        assert torch.equal(h, torch.nn.functional.embedding(ids, table))


@pytest.mark.parametrize("t, sp", [(1, True), (2, True), (2, False)])
def test_an_embedding_split_on_the_hidden_dimension_is_the_reference(t, sp):
    # fairscale's ParallelEmbedding (Llama 2, the Meta convention): each rank looks every
    # token up in its d / t columns, the columns are all-gathered; with SP each rank then keeps
    # its own sequence shard
    p, tokens = init_params(D, 0), make_tokens(D, 1)
    shards = split(p, layout_for(D), t)
    for r, rank in enumerate(shards):
        rank["tok_embeddings.weight"] = p["tok_embeddings.weight"].chunk(t, dim=1)[r]
    model = ShardedModel(D, shards, InProcessCollective(t), sequence_parallel=sp,
                         embedding=Shard(1))
    expected = ReferenceModel(D, p)(tokens)
    for rank in model(tokens):
        torch.testing.assert_close(rank, expected, rtol=0, atol=ATOL)
    assert model.collective.calls[0] == ("all_gather", "tok_embeddings.weight")
    width = 8 // t if sp else 8
    assert [tuple(h.shape) for h in model.embedding_output] == [(2, width, 32)] * t


def test_finishing_before_the_heads_step_is_an_internal_error_saying_so():
    model, tokens, _ = sharded(D, 2)
    with pytest.raises(AssertionError, match="^finish: the head's step has not run$"):
        model.finish(model.begin(tokens))


def _dense_calls(c: ModelConfig, reduce: str, gather: bool) -> list[tuple[str, str]]:
    """The collectives of one TP forward of a dense ``c``: the embedding's and each row-
    parallel layer's ``reduce``, each column-parallel region entered by an all-gather along
    the sequence (with SP), the logits all-gathered over the vocabulary."""
    enter = (lambda name: [("all_gather", name)]) if gather else (lambda name: [])
    calls = [(reduce, "tok_embeddings.weight")]
    for i in range(c.n_layers):
        calls += [*enter(f"layers.{i}.qkv.weight"), (reduce, f"layers.{i}.o_proj.weight"),
                  *enter(f"layers.{i}.gate_up.weight"), (reduce, f"layers.{i}.down.weight")]
    return calls + [*enter(c.head_name), ("all_gather", c.head_name)]


@pytest.mark.parametrize("variant", [{}, {"bias": True, "tie_embeddings": True}],
                         ids=["plain", "bias-tied"])
@pytest.mark.parametrize("sp", [False, True])
def test_the_collectives_a_forward_asks_for_name_what_they_serve(variant, sp):
    c = D.replace(**variant)
    model, tokens, _ = sharded(c, 2, sequence_parallel=sp)
    model(tokens)
    reduce = "reduce_scatter" if sp else "all_reduce"
    assert model.collective.calls == _dense_calls(c, reduce, gather=sp)


def test_context_parallelism_gathers_each_layers_keys_and_values_over_the_cp_group():
    model, tp, cp, tokens, _ = cp2_tp2(D, sp=True)
    model(tokens, SEGMENTS)
    assert cp.calls == [("all_gather", f"layers.{i}.attention", group)
                        for i in range(2) for group in ((0, 2), (1, 3))]
    assert [(op, tag) for op, tag, group in tp.calls if group == (0, 1)] == _dense_calls(
        D, "reduce_scatter", gather=True)


def test_shard_dicts_and_groups_that_do_not_pair_are_refused_naming_the_ranks():
    p = split(init_params(D, 0), layout_for(D), 2)
    with pytest.raises(ValueError, match=re.escape(
            "ShardedModel: 1 shard dicts for local ranks [0, 1]")):
        ShardedModel(D, p[:1], InProcessCollective(2))
    with pytest.raises(ValueError, match=re.escape(
            "ShardedModel: CP ranks [0, 1, 2] do not pair with TP ranks [0, 1]")):
        ShardedModel(D, p, InProcessCollective(2), context=InProcessCollective(3))
    with pytest.raises(ValueError, match=re.escape(
            "ShardedModel: expert-group ranks [0, 1, 2, 3] do not pair with TP ranks [0, 1]")):
        ShardedModel(D, p, InProcessCollective(2), experts_group=InProcessCollective(4))
    with pytest.raises(UnsupportedLayout, match="^" + re.escape(
            "d: an expert group wider than the TP group runs without sequence parallelism") + "$"):
        ShardedModel(D, p, InProcessCollective(2), experts_group=InProcessCollective(2),
                     sequence_parallel=True)


@pytest.mark.parametrize("seq_len, cp, t, sp, message", [
    (8, 3, 1, False, "d: context parallelism needs seq_len % cp == 0 (seq_len=8, cp=3)"),
    (8, 2, 3, True, ("d: sequence parallelism needs (seq_len / cp) % t == 0 "
                     "(seq_len=8, cp=2, t=3)")),
])
def test_an_uneven_sequence_split_is_refused_naming_the_numbers(seq_len, cp, t, sp, message):
    with pytest.raises(UnevenSequence, match="^" + re.escape(message) + "$"):
        check_sequence_split("d", seq_len, cp, t, sp)
    check_sequence_split("d", 12, 3, 2, True)  # 12 / 3 = 4 positions a chunk, 2 a TP rank
    check_sequence_split("d", 8, 2, 3, False)  # without SP a chunk is not split over TP


def test_an_odd_sequence_splits_only_where_a_layout_cuts_it():
    odd = D.replace(seq_len=7)
    model, tokens, expected = sharded(odd, 2)  # TP alone never cuts the sequence
    assert model.chunks(7) == [(0, 7), (0, 7)]
    torch.testing.assert_close(model(tokens)[1], expected, rtol=0, atol=ATOL)
    sp, _, _ = sharded(odd, 2, sequence_parallel=True)
    with pytest.raises(UnevenSequence, match="^" + re.escape(
            "d: sequence parallelism needs (seq_len / cp) % t == 0 (seq_len=7, cp=1, t=2)")):
        sp(tokens)


def test_forward_and_call_gather_the_logits_unless_told_not_to():
    c = D.replace(vocab_multiple=16)  # 64 padded rows, 32 a rank
    model, tokens, expected = sharded(c, 2)
    assert [tuple(x.shape) for x in model.forward(tokens)] == [(2, 8, 60)] * 2
    assert [tuple(x.shape) for x in model.forward(tokens, gather_logits=False)] == [
        (2, 8, 32)] * 2
    torch.testing.assert_close(model.forward(tokens)[0], expected, rtol=0, atol=ATOL)


def test_the_forward_as_steps_ends_in_gathered_logits_by_default():
    # what a streamed check runs: begin, one block per layer, end (``model.stepwise``)
    c = D.replace(vocab_multiple=16)
    model, tokens, expected = sharded(c, 2, sequence_parallel=True)
    state = model.begin(tokens)
    for i in range(c.n_layers):
        model.block(state, i)
    logits = model.end(state)
    assert [tuple(x.shape) for x in logits] == [(2, 8, 60)] * 2
    torch.testing.assert_close(logits[1], expected, rtol=0, atol=ATOL)
    state = model.begin(tokens)
    for i in range(c.n_layers):
        model.block(state, i)
    for name in c.head_params:
        model.step(state, name)
    assert [tuple(x.shape) for x in model.finish(state)] == [(2, 8, 60)] * 2


def test_the_guard_takes_the_references_choice_at_its_bound_exactly():
    ref = Routing(torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.zeros(3, 8),
                  torch.tensor([0.25, 0.125, 0.5]))
    guard = RoutingGuard({0: ref}, 0.25)  # token 0's margin is the bound: near-tied
    assert guard.near(0).tolist() == [True, True, False]
    own = torch.tensor([[7, 1], [2, 6], [4, 7]])
    assert guard.choice(0, own).tolist() == [[0, 1], [2, 3], [4, 7]]
    assert guard.near_ties() == (2, 3)


# ---------------------------------------------------------------- experts wider than TP

MOE = {"vocab": 64, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "ffn": 48,
       "n_layers": 2, "batch": 2, "seq_len": 8, "n_experts": 8, "top_k": 2, "expert_ffn": 16}
QWEN2 = TOY.replace(name="q2", **MOE, shared_ffn=32, shared_gate=True)  # gated shared expert
DEEPSEEK = TOY.replace(name="ds", **MOE, router="sigmoid", router_bias=True, norm_topk=True,
                       n_groups=4, topk_groups=2, shared_ffn=32, dense_layers=1)
QWEN3 = TOY.replace(name="q3", **MOE, norm_topk=True, qk_norm=True)  # no shared expert


def expert_world(c: ModelConfig, ep: int, order: str = "contiguous", **kwargs):
    """Megatron-Core's experts over a world of 4 (EP ``ep``, expert-TP 1, ``4 / ep`` expert
    replicas) beside two TP-2 replicas of the dense layers: the model, its TP groups, the
    expert group, the tokens and the reference (whose routings the guard may hold)."""
    p, tokens = init_params(c, 0), make_tokens(c, 1)
    ref = ReferenceModel(c, p)
    expected = ref(tokens)
    placement = Experts(c.n_experts, (c.expert_ffn, c.expert_ffn), 0, ep, 1, order)
    base, f = split(p, layout_for(c), 2), c.expert_ffn
    shards = []
    for w in range(4):  # rank w: TP rank w % 2; EP rank (w // etp) % ep, every chunk of it
        mine, rank = placement.experts_of(placement.coordinates(4, w)[1]), dict(base[w % 2])
        for i in range(c.dense_layers, c.n_layers):
            gu = p[f"layers.{i}.experts.gate_up.weight"]
            down = p[f"layers.{i}.experts.down.weight"]
            rank[f"layers.{i}.experts.gate_up.weight"] = torch.cat(
                [gu[e * 2 * f:(e + 1) * 2 * f] for e in mine])
            rank[f"layers.{i}.experts.down.weight"] = torch.cat(
                [down[:, e * f:(e + 1) * f] for e in mine], dim=1)
        shards.append(rank)
    tp, group = InProcessGroups([[0, 1], [2, 3]]), InProcessCollective(4)
    model = ShardedModel(c, shards, tp, experts=placement, experts_group=group, **kwargs)
    return model, tp, group, tokens, expected, ref


@pytest.mark.parametrize("config", [QWEN2, DEEPSEEK, QWEN3], ids=lambda c: c.name)
@pytest.mark.parametrize("ep, order", [(4, "contiguous"), (2, "contiguous"), (2, "round_robin"),
                                       (1, "contiguous")])  # edp 1, 2, 2, 4 replicas
def test_experts_over_a_wider_group_than_tp_are_the_reference(config, ep, order):
    model, tp, group, tokens, expected, ref = expert_world(config, ep, order)
    logits = model(tokens)
    for rank in logits:
        torch.testing.assert_close(rank, expected, rtol=0, atol=ATOL)
    moe = range(config.dense_layers, config.n_layers)
    # the routed partials summed over the expert group, the shared ones over the TP group
    assert group.calls == [("all_reduce", f"layers.{i}.experts") for i in moe]
    shared = [(op, tag) for op, tag, g in tp.calls if g == (0, 1) and ".experts" in tag]
    assert shared == ([("all_reduce", f"layers.{i}.experts") for i in moe]
                      if config.shared_ffn else [])
    # every rank routes every token itself, with its own router: the reference's choice
    assert sorted(model.routings) == list(moe)
    for i in moe:
        assert len(model.routings[i]) == 4
        for own in model.routings[i]:
            assert torch.equal(own.experts, ref.routings[i].experts)
            torch.testing.assert_close(own.scores, ref.routings[i].scores, rtol=0, atol=ATOL)


@pytest.mark.parametrize("sp", [False, True])
def test_an_moe_layer_within_the_tp_group_leaves_its_region_once_named_for_its_experts(sp):
    model, tokens, expected = sharded(QWEN2, 2, sequence_parallel=sp)
    torch.testing.assert_close(model(tokens)[0], expected, rtol=0, atol=ATOL)
    reduce = "reduce_scatter" if sp else "all_reduce"
    assert [call for call in model.collective.calls if ".experts" in call[1]] == [
        (reduce, "layers.0.experts"), (reduce, "layers.1.experts")]  # routed + shared, summed


def test_each_rank_computes_only_its_experts_and_its_replicas_share_of_the_tokens():
    model, _, _, tokens, _, _ = expert_world(QWEN3, 2)
    assert model._held_experts() == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    state = model.begin(tokens)
    for suffix in QWEN3.suffixes_of(0):
        model.step(state, f"layers.0.{suffix}")
        if suffix.startswith("router"):
            break
    chosen = model.routings[0][0].experts  # (16, 2): every rank chose the same
    for w, routed in enumerate(state.routed):
        served = [n for n in range(16) if n % 2 == w // 2]  # edp rank w // 2: tokens n % 2
        for e, (tok, weights) in enumerate(routed):
            want = [n for n in served if e in chosen[n].tolist()]
            assert tok.tolist() == want, (w, e)
            assert bool((weights > 0).all())


def test_a_guarded_rank_takes_the_references_near_tied_choice_in_an_expert_world():
    ref_model, _, _, tokens, _, ref = expert_world(QWEN3, 2)
    ref_model(tokens)  # the reference's routings, read when each layer routes
    flipped = {i: Routing(r.experts.flip(-1), r.scores, torch.full_like(r.margin, 0.5))
               for i, r in ref.routings.items()}  # every token near-tied, its order reversed
    guard = RoutingGuard(flipped, 1.0)
    model, _, _, _, expected, _ = expert_world(QWEN3, 2, guard=guard)
    for rank in model(tokens):  # the same experts in the other order: the same logits
        torch.testing.assert_close(rank, expected, rtol=0, atol=ATOL)
    other = {i: Routing((r.experts + 1) % 8, r.scores, r.margin) for i, r in flipped.items()}
    wrong, _, _, _, _, _ = expert_world(QWEN3, 2, guard=RoutingGuard(other, 1.0))
    assert not torch.allclose(wrong(tokens)[0], expected, rtol=0, atol=1e-3)

"""``conventions.meta`` and ``conventions.plain`` (issue 30, the mutation pass over
``conventions/meta.py`` and ``plain.py``): the original Llama 2 checkpoints' storage and the
harness's own.

A convention that gets one rule wrong makes every verdict on it wrong. For Meta, that means
the interleaved-pair RoPE order of wq and wk (HF's ``permute``), the hidden-dimension
embedding, the names, the refusals, and each rank's chunk. These tests check them against
HF's own ``permute``, written out here as ``convert_llama_weights_to_hf.py`` (transformers
4.x) has it, and against each rank's bytes."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions import meta as Meta
from weight_sync_bench.errors import UnsupportedConvention, UnsupportedLayout
from weight_sync_bench.layout.placements import Shard
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for

C = ModelConfig(name="m", vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                head_dim=8, ffn=48, batch=1, seq_len=4)


def hf_permute(w, n_heads, dim1, dim2):
    """transformers' convert_llama_weights_to_hf.py::permute, as written there."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def test_permute_is_hfs_and_its_index_says_where_each_row_comes_from():
    w = torch.arange(32 * 3, dtype=torch.float32).reshape(32, 3)
    assert torch.equal(Meta.permute(w, 4), hf_permute(w, 4, 32, 3))
    assert torch.equal(Meta.permute(w, 2), hf_permute(w, 2, 32, 3))
    one_d = torch.arange(16.0)
    assert torch.equal(Meta.permute(one_d, 2), hf_permute(one_d[:, None], 2, 16, 1)[:, 0])
    p = Meta.permute_index(32, 4)
    assert p.dtype == torch.int64 and torch.equal(Meta.permute(w, 4), w[p])
    # per head of 8 rows: HF row j is Meta row 2j, HF row 4 + j is Meta row 2j + 1
    assert p[:8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_wq_and_wk_hold_the_canonical_rows_in_metas_interleaved_order():
    hd = C.head_dim
    q = Meta.meta_q_rows(C)
    assert q.tolist()[:hd] == [0, 4, 1, 5, 2, 6, 3, 7]  # Meta row 2j = HF j, 2j+1 = HF 4+j
    assert q.tolist()[hd:2 * hd] == [8 + r for r in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert sorted(q.tolist()) == list(range(C.q_rows))
    k = Meta.meta_k_rows(C)
    assert k.tolist()[:hd] == [C.q_rows + r for r in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert sorted(k.tolist()) == list(range(C.q_rows, C.q_rows + C.kv_rows))
    # the inverse of HF's permute: permuting Meta's wq gives the canonical rows back
    params = init_params(C, 0)
    qkv = params["layers.0.qkv.weight"]
    assert torch.equal(Meta.permute(qkv[q], C.n_heads), qkv[:C.q_rows])
    assert torch.equal(Meta.permute(qkv[k], C.n_kv_heads), qkv[C.q_rows:C.q_rows + C.kv_rows])


@pytest.mark.parametrize("t", [1, 2])
def test_each_rank_stores_its_chunk_under_metas_names(t):
    params = init_params(C, 1)
    at = endpoint(f"meta:{t}")
    shards = materialize(at.pieces(C), params)
    plain = split(params, layout_for(C), t)
    q, k = Meta.meta_q_rows(C), Meta.meta_k_rows(C)
    v = torch.arange(C.q_rows + C.kv_rows, C.q_rows + 2 * C.kv_rows)
    for r, shard in enumerate(shards):
        assert sorted(shard) == sorted(
            [Meta.NAMES[n] for n in Meta.NAMES if "{i}" not in n]
            + [Meta.NAMES[n].format(i=i) for n in Meta.NAMES if "{i}" in n for i in range(2)]
            + [f"layers.{i}.attention.{w}.weight" for i in range(2) for w in ("wq", "wk", "wv")]
            + [f"layers.{i}.feed_forward.{w}.weight" for i in range(2) for w in ("w1", "w3")])
        for i in range(2):
            qkv, gu = params[f"layers.{i}.qkv.weight"], params[f"layers.{i}.gate_up.weight"]
            a = f"layers.{i}.attention."
            assert torch.equal(shard[a + "wq.weight"], qkv[q.chunk(t)[r]])
            assert torch.equal(shard[a + "wk.weight"], qkv[k.chunk(t)[r]])
            assert torch.equal(shard[a + "wv.weight"], qkv[v.chunk(t)[r]])
            f = f"layers.{i}.feed_forward."
            assert torch.equal(shard[f + "w1.weight"], gu[:C.ffn].chunk(t)[r])
            assert torch.equal(shard[f + "w3.weight"], gu[C.ffn:].chunk(t)[r])
            assert torch.equal(shard[f + "w2.weight"], plain[r][f"layers.{i}.down.weight"])
            assert torch.equal(shard[a + "wo.weight"], plain[r][f"layers.{i}.o_proj.weight"])
            assert torch.equal(shard[f"layers.{i}.attention_norm.weight"],
                               params[f"layers.{i}.attn_norm.weight"])
        # ParallelEmbedding: the hidden dimension's chunk; the output: vocabulary rows
        assert torch.equal(shard["tok_embeddings.weight"],
                           params["tok_embeddings.weight"].chunk(t, dim=1)[r])
        assert torch.equal(shard["output.weight"], params["lm_head.weight"].chunk(t)[r])
        assert torch.equal(shard["norm.weight"], params["norm.weight"])


def test_the_forward_reads_the_embedding_on_the_hidden_dimension_only():
    forward = Meta.META.forward_layout(C, endpoint("meta:2"))
    placements = {s.name: s.placement for s in forward.layout}
    assert placements["tok_embeddings.weight"] == Shard(1)
    assert forward.embedding == Shard(1) and forward.config is C
    plain = {s.name: s.placement for s in layout_for(C)}
    assert {n: p for n, p in placements.items() if n != "tok_embeddings.weight"} == {
        n: p for n, p in plain.items() if n != "tok_embeddings.weight"}
    assert Meta.NAME == "meta" and Meta.META.name == "meta"


def refusal(config, t=2):
    with pytest.raises(UnsupportedConvention) as exc:
        endpoint(f"meta:{t}").pieces(config)
    return str(exc.value)


@pytest.mark.parametrize("change, message", [
    ({"n_experts": 4, "top_k": 2, "expert_ffn": 8},
     "meta: layers.0.attention.wq.weight needs a dense Llama 2 block (Meta's Llama 2 "
     "checkpoints have no experts and no q/k norms) (n_experts=4, qk_norm=False, t=2)"),
    ({"qk_norm": True},
     "meta: layers.0.attention.wq.weight needs a dense Llama 2 block (Meta's Llama 2 "
     "checkpoints have no experts and no q/k norms) (n_experts=0, qk_norm=True, t=2)"),
    ({"vocab_multiple": 16},
     "meta: tok_embeddings.weight needs an unpadded canonical vocabulary (vocab_multiple == 1: "
     "the convention pads by its own rule) (vocab_multiple=16, t=2)"),
    ({"tie_embeddings": True},
     "meta: output.weight needs tie_embeddings == False (Meta Llama checkpoints store output "
     "separately) (tie_embeddings=True, t=2)"),
    ({"qkv_bias": True},
     "meta: layers.0.attention.wq.weight needs no biases (Meta Llama linears are bias-free) "
     "(bias=False, qkv_bias=True, o_bias=False, t=2)"),
    ({"o_bias": True},
     "meta: layers.0.attention.wq.weight needs no biases (Meta Llama linears are bias-free) "
     "(bias=False, qkv_bias=False, o_bias=True, t=2)"),
    ({"bias": True},
     "meta: layers.0.attention.wq.weight needs no biases (Meta Llama linears are bias-free) "
     "(bias=True, qkv_bias=False, o_bias=False, t=2)"),
    ({"n_heads": 3, "n_kv_heads": 1},
     "meta: layers.0.attention.wq.weight needs n_heads % t == 0 (n_heads=3, t=2)"),
    ({"n_kv_heads": 1},
     "meta: layers.0.attention.wk.weight needs n_kv_heads % t == 0 (n_local_kv_heads = "
     "n_kv_heads // t: no KV replication) (n_kv_heads=1, t=2)"),
    ({"ffn": 47}, "meta: layers.0.feed_forward.w1.weight needs ffn % t == 0 (ffn=47, t=2)"),
    ({"d_model": 33},
     "meta: tok_embeddings.weight needs d_model % t == 0 (ParallelEmbedding splits the hidden "
     "dimension) (d_model=33, t=2)"),
    ({"vocab": 63},
     "meta: output.weight needs vocab % t == 0 (ColumnParallelLinear over the unpadded "
     "vocabulary) (vocab=63, t=2)")])
def test_a_geometry_meta_cannot_store_is_refused_naming_the_rule(change, message):
    assert refusal(C.replace(**change)) == message


def test_twin_the_same_geometries_at_one_rank_are_stored_where_only_divisibility_failed():
    for change in ({"n_heads": 3, "n_kv_heads": 1}, {"n_kv_heads": 1}, {"ffn": 47},
                   {"d_model": 33}, {"vocab": 63}):
        assert endpoint("meta:1").pieces(C.replace(**change))
    assert endpoint("meta:2").pieces(C)  # and the geometry itself at two
    assert "needs no biases" in refusal(C.replace(bias=True), 1)  # a rule that is not
    assert "down" not in refusal(C.replace(bias=True), 1)         # divisibility holds at 1


# ---- plain ----------------------------------------------------------------------------------

MOE = C.replace(name="moe", n_experts=4, top_k=2, expert_ffn=8)


@pytest.mark.parametrize("at", ["plain:1", "plain:2", "plain:tp=2,ep=2", "plain:tp=2,etp=1"])
def test_plain_is_the_declared_split_bit_for_bit(at):
    where = endpoint(at)
    params = init_params(MOE, 2)
    shards = materialize(where.pieces(MOE), params)
    layout = where.convention.forward_layout(MOE, where).layout
    expected = split(params, layout, where.world)
    assert len(shards) == where.world
    assert all(sorted(s) == sorted(e) and all(torch.equal(s[n], e[n]) for n in e)
               for s, e in zip(shards, expected))


def test_plains_experts_go_over_expert_parallel_ranks_only_when_asked():
    unrelaid = {s.name: s.placement for s in layout_for(MOE)}
    two = endpoint("plain:2")
    assert two.convention.forward_layout(MOE, two).config is MOE
    tp = {s.name: s.placement for s in two.convention.forward_layout(MOE, two).layout}
    assert tp == unrelaid
    for at in ("plain:tp=2,ep=2", "plain:tp=2,etp=1"):
        where = endpoint(at)
        got = {s.name: s.placement for s in where.convention.forward_layout(MOE, where).layout}
        assert got != unrelaid, at
        assert {n: p for n, p in got.items() if "experts" not in n} == {
            n: p for n, p in unrelaid.items() if "experts" not in n}
    ep = endpoint("plain:tp=2,ep=2")
    experts = [s for s in ep.convention.forward_layout(MOE, ep).layout if "experts" in s.name]
    assert experts and all(s.placement.ep == 2 for s in experts)


def test_plain_refuses_a_degree_its_layout_cannot_hold_naming_the_parameter():
    with pytest.raises(UnsupportedLayout, match="qkv.weight"):
        endpoint("plain:4").pieces(C)  # 2 KV heads over 4 ranks

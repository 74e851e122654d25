"""``conventions.megatron`` (issue 30, the mutation pass over ``conventions/megatron.py``):
Megatron-Core's GPT model with the Transformer Engine spec, dense and MoE, and its refusals.

Megatron is where most RL syncs start. Its ``linear_qkv`` interleaves Q, K and V per KV
group, its vocabulary is padded to a multiple of ``128 t``, its experts sit under LOCAL
indices on ranks laid out "tp-cp-ep-dp-pp": one index, name or rank off sends a wrong byte
through every converter checked against it. These tests check each rank's stored bytes
against Megatron-Core's own rules (NVIDIA/Megatron-LM @ d98e8a64, core 0.20.0), written out
here: ``attention.py::SelfAttention.get_query_key_value_tensors`` (the view ``(sq, b, ng,
(np/ng + 2) * hn)``: per group its Q heads, then K_g, then V_g), ``ColumnParallelLinear``'s
row chunk r and ``RowParallelLinear``'s column chunk r, ``mlp.py::MLP`` (``glu``: fc1
``[gate_r | up_r]``), ``vocab_utils.py::calculate_padded_vocab_size``,
``moe_layer.py::BaseMoELayer`` (``local_expert_indices``: ``ep_rank * E/ep + j``) and
``parallel_state.initialize_model_parallel``'s rank order. They pin each refusal's text, the
number of ranks and the layout the forward reads."""

from __future__ import annotations

import math

import pytest
import torch

from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions import megatron as M
from weight_sync_bench.errors import UnsupportedConvention
from weight_sync_bench.layout.placements import DataParallel, Experts, HeadReplicated
from weight_sync_bench.model.config import ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for

# 100 tokens pad to 128 t; 2 KV groups of 2 Q heads each; t = 4 cuts inside a group
DENSE = ModelConfig(name="d", vocab=100, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=4, ffn=24, batch=1, seq_len=4)
MOE = {"n_layers": 1, "ffn": 8, "n_experts": 4, "top_k": 2, "expert_ffn": 8}
QWEN2 = DENSE.replace(name="q2", **MOE, shared_ffn=8, shared_gate=True)
DEEPSEEK = DENSE.replace(name="ds", **MOE, router="sigmoid", router_bias=True, shared_ffn=8)
L = "decoder.layers."


def stored(config, at, seed=0):
    params = init_params(config, seed)
    return params, materialize(endpoint(at).pieces(config), params)


def rows(a, b):
    return torch.arange(a, b)


def megatron_qkv_order(c):
    """``get_query_key_value_tensors``' view ``(ng, (np/ng + 2) * hn)`` of ``linear_qkv``:
    for each group g its np/ng Q heads, then K_g, then V_g (canonical ``[Q | K | V]`` rows)."""
    hd, per = c.head_dim, c.n_heads // c.n_kv_heads
    out = []
    for g in range(c.n_kv_heads):
        out += [rows(g * per * hd, (g + 1) * per * hd), rows(c.q_rows + g * hd,
                c.q_rows + (g + 1) * hd), rows(c.q_rows + c.kv_rows + g * hd,
                                               c.q_rows + c.kv_rows + (g + 1) * hd)]
    return torch.cat(out)


def test_the_qkv_is_interleaved_per_group_and_each_rank_keeps_a_contiguous_chunk_of_it():
    order = megatron_qkv_order(DENSE)
    # q0 q1 k0 v0 | q2 q3 k1 v1, four rows each
    assert order[::4].tolist() == [0, 4, 16, 24, 8, 12, 20, 28]
    assert torch.equal(M.grouped_qkv_order(4, 2, 4), order)
    assert torch.equal(M.grouped_qkv_order(4, 1, 2), megatron_qkv_order(
        DENSE.replace(n_kv_heads=1, head_dim=2, d_model=8)))
    assert M.grouped_qkv_order(4, 2, 4).dtype == torch.int64
    for t in (1, 2, 4):
        for r in range(t):
            got = M.qkv_stored_rows(DENSE, t, r)
            want = sorted(order.chunk(t)[r].tolist())
            runs = [x for a, b in got for x in range(a, b)]
            assert runs == want and all(b > a for a, b in got), (t, r)
    assert M.qkv_stored_rows(DENSE, 2, 1) == [(8, 16), (20, 24), (28, 32)]


def test_the_vocabulary_pads_to_a_multiple_of_128_t_as_calculate_padded_vocab_size_does():
    assert [M.padded_vocab(v, t) for v, t in ((1, 1), (128, 1), (129, 1), (100, 2), (256, 2),
                                              (257, 2), (100, 3))] == [
        128, 128, 256, 256, 256, 512, 384]
    assert M.MAKE_VOCAB_SIZE_DIVISIBLE_BY == 128 and M.NAME == "megatron"
    assert M.MEGATRON.name == "megatron" and M.MEGATRON.stages
    assert M.OPTIONS == {"experts": ("grouped", "sequential"), "vocab": ("padded", "unpadded"),
                         "pp_account": ("none", "embedding", "loss", "both")}
    assert M.vocab_multiple(endpoint("megatron:2")) == 256
    assert M.vocab_multiple(endpoint("megatron:tp=2,vocab=unpadded")) == 1


@pytest.mark.parametrize("t, vocab", [(1, "padded"), (2, "padded"), (4, "padded"),
                                      (2, "unpadded"), (4, "unpadded")])
def test_each_rank_holds_what_megatron_cores_layers_hold(t, vocab):
    config = DENSE.replace(qkv_bias=True, qk_norm=True)
    params, shards = stored(config, f"megatron:tp={t},vocab={vocab}")
    assert len(shards) == t
    f = config.ffn // t
    vp = (128 * t if vocab == "padded" else 100) // t  # each rank's vocabulary rows
    order = megatron_qkv_order(config)
    for r, got in enumerate(shards):
        layer = [f"{L}{i}.{n}" for i in range(2) for n in (
            "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
            "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight")]
        assert sorted(got) == sorted(["embedding.word_embeddings.weight",
                                      "decoder.final_layernorm.weight", "output_layer.weight",
                                      *layer])
        mine = order.chunk(t)[r]  # ColumnParallelLinear: contiguous row chunk r
        for i in range(2):
            m, p = f"{L}{i}.", f"layers.{i}."
            a = m + "self_attention."
            assert torch.equal(got[a + "linear_qkv.weight"], params[p + "qkv.weight"][mine])
            assert torch.equal(got[a + "linear_qkv.bias"], params[p + "qkv.bias"][mine])
            assert torch.equal(got[a + "linear_proj.weight"],
                               params[p + "o_proj.weight"][:, r * 16 // t:(r + 1) * 16 // t])
            gu = params[p + "gate_up.weight"]
            assert torch.equal(got[m + "mlp.linear_fc1.weight"],
                               torch.cat([gu[r * f:(r + 1) * f], gu[24 + r * f:24 + (r + 1) * f]]))
            assert torch.equal(got[m + "mlp.linear_fc2.weight"],
                               params[p + "down.weight"][:, r * f:(r + 1) * f])
            for ours, theirs in (("attn_norm", "self_attention.linear_qkv.layer_norm_weight"),
                                 ("ffn_norm", "mlp.linear_fc1.layer_norm_weight"),
                                 ("q_norm", "self_attention.q_layernorm.weight"),
                                 ("k_norm", "self_attention.k_layernorm.weight")):
                assert torch.equal(got[m + theirs], params[p + ours + ".weight"])
        assert torch.equal(got["decoder.final_layernorm.weight"], params["norm.weight"])
        for ours, theirs in (("tok_embeddings", "embedding.word_embeddings"),
                             ("lm_head", "output_layer")):
            table = got[theirs + ".weight"]  # VocabParallelEmbedding: rows [r Vp/t, (r+1) Vp/t)
            assert table.shape == (vp, 16)
            real = params[ours + ".weight"][r * vp:(r + 1) * vp]
            assert torch.equal(table[:len(real)], real)
            assert not table[len(real):].any()


def test_a_tied_model_stores_no_output_layer():
    _, shards = stored(DENSE.replace(tie_embeddings=True), "megatron:2")
    assert all("output_layer.weight" not in s and "embedding.word_embeddings.weight" in s
               for s in shards)


@pytest.mark.parametrize("t, vocab", [(1, "padded"), (2, "padded"), (4, "padded"),
                                      (4, "unpadded")])
def test_the_forward_reads_the_padded_model_and_gathers_the_qkv_past_n_kv(t, vocab):
    config = DENSE.replace(qkv_bias=True)
    at = endpoint(f"megatron:tp={t},vocab={vocab}")
    forward = M.MEGATRON.forward_layout(config, at)
    multiple = 128 * t if vocab == "padded" else 1
    assert forward.config == config.replace(vocab_multiple=multiple)
    assert forward.tp == t
    qkv = {f"layers.{i}.qkv.{k}" for i in range(2) for k in ("weight", "bias")}
    assert forward.gathered == (qkv if t > 2 else frozenset())
    declared = layout_for(config.replace(vocab_multiple=multiple))
    for spec in forward.layout:
        if spec.name in qkv and t > 2:
            assert spec.placement == HeadReplicated(4, 2, 4), spec.name
        else:
            assert spec.placement == declared[spec.name].placement, spec.name


def test_only_the_qkv_tensors_the_model_has_are_gathered():
    forward = M.MEGATRON.forward_layout(DENSE, endpoint("megatron:4"))  # no qkv bias
    assert forward.gathered == {"layers.0.qkv.weight", "layers.1.qkv.weight"}


def megatron_coordinates(g, tp, ep, etp):
    """``initialize_model_parallel``'s order "tp-cp-ep-dp-pp", TP fastest: attention TP rank
    ``g % tp``; expert-TP rank ``g % etp``, EP rank ``(g // etp) % ep``."""
    return g % tp, g % etp, (g // etp) % ep


def expert(params, e, f):
    gu, down = params["layers.0.experts.gate_up.weight"], params["layers.0.experts.down.weight"]
    start = 2 * f * e
    return gu[start:start + f], gu[start + f:start + 2 * f], down[:, f * e:f * (e + 1)]


@pytest.mark.parametrize("at, tp, ep, etp", [
    ("megatron:1", 1, 1, 1),
    ("megatron:2", 2, 1, 2),  # etp defaults to tp: every expert, half its intermediate
    ("megatron:tp=2,ep=2", 2, 2, 2),  # lcm(2, 4) = 4 ranks
    ("megatron:tp=2,ep=4", 2, 4, 2),  # 8 ranks: 2k, 2k+1 hold EP rank k
    ("megatron:tp=2,ep=4,etp=1", 2, 4, 1),  # 4 ranks: EP rank g % 4
    ("megatron:tp=4,ep=2,etp=1", 4, 2, 1),  # 4 ranks, each expert on 2 (expert-DP 2)
    ("megatron:tp=1,etp=1", 1, 1, 1),
    ("megatron:tp=1,etp=2", 1, 1, 2),  # expert-TP wider than TP: 2 ranks, one attention copy each
    ("megatron:tp=1,ep=2,etp=2", 1, 2, 2),
    ("megatron:tp=2,ep=2,experts=sequential", 2, 2, 2),
])
def test_each_rank_holds_its_local_experts_as_te_grouped_mlp_names_them(at, tp, ep, etp):
    params, shards = stored(QWEN2, at)
    world = math.lcm(tp, ep * etp)
    assert len(shards) == world == endpoint(at).world
    f, local = 8 // etp, 4 // ep
    sequential = "sequential" in at
    sgu, sdown = params["layers.0.shared.gate_up.weight"], params["layers.0.shared.down.weight"]
    s = 8 // tp  # the shared expert over the attention TP group
    for g, got in enumerate(shards):
        tp_rank, etp_rank, ep_rank = megatron_coordinates(g, tp, ep, etp)
        names = []
        for j in range(local):
            e = ep_rank * local + j  # local_expert_indices
            if sequential:
                fc1 = f"{L}0.mlp.experts.local_experts.{j}.linear_fc1.weight"
                fc2 = f"{L}0.mlp.experts.local_experts.{j}.linear_fc2.weight"
            else:
                fc1, fc2 = f"{L}0.mlp.experts.linear_fc1.weight{j}", \
                    f"{L}0.mlp.experts.linear_fc2.weight{j}"
            names += [fc1, fc2]
            gate, up, down = expert(params, e, 8)
            k = slice(etp_rank * f, (etp_rank + 1) * f)
            assert torch.equal(got[fc1], torch.cat([gate[k], up[k]])), (at, g, j)
            assert torch.equal(got[fc2], down[:, k]), (at, g, j)
        m = f"{L}0.mlp."
        assert sorted(got) == sorted([
            "embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
            "output_layer.weight", f"{L}0.self_attention.linear_qkv.layer_norm_weight",
            f"{L}0.self_attention.linear_qkv.weight", f"{L}0.self_attention.linear_proj.weight",
            f"{L}0.pre_mlp_layernorm.weight", m + "router.weight",
            m + "shared_experts.linear_fc1.weight", m + "shared_experts.linear_fc2.weight",
            m + "shared_experts.gate_weight", *names])
        qkv = params["layers.0.qkv.weight"][megatron_qkv_order(QWEN2).chunk(tp)[tp_rank]]
        assert torch.equal(got[f"{L}0.self_attention.linear_qkv.weight"], qkv)
        assert torch.equal(got[f"{L}0.pre_mlp_layernorm.weight"],
                           params["layers.0.ffn_norm.weight"])
        assert torch.equal(got[m + "router.weight"], params["layers.0.router.weight"])
        assert torch.equal(got[m + "shared_experts.gate_weight"],
                           params["layers.0.shared_gate.weight"])
        r = tp_rank
        assert torch.equal(got[m + "shared_experts.linear_fc1.weight"],
                           torch.cat([sgu[r * s:(r + 1) * s], sgu[8 + r * s:8 + (r + 1) * s]]))
        assert torch.equal(got[m + "shared_experts.linear_fc2.weight"],
                           sdown[:, r * s:(r + 1) * s])


def test_deepseeks_selection_bias_is_the_routers_expert_bias_buffer():
    params, (got,) = stored(DEEPSEEK, "megatron:1")
    assert torch.equal(got[f"{L}0.mlp.router.expert_bias"], params["layers.0.router.bias"])
    assert not any("gate_weight" in n for n in got)


@pytest.mark.parametrize("at, tp, ep, etp", [
    ("megatron:2", 2, 1, 2), ("megatron:tp=2,ep=4", 2, 4, 2),
    ("megatron:tp=4,ep=2,etp=1", 4, 2, 1), ("megatron:tp=2,ep=4,etp=1", 2, 4, 1)])
def test_the_forward_reads_the_experts_where_they_are_and_the_dense_layers_per_replica(
        at, tp, ep, etp):
    forward = M.MEGATRON.forward_layout(QWEN2, endpoint(at))
    assert forward.tp == tp and M.expert_tp(endpoint(at)) == etp
    assert forward.experts == Experts(4, (8, 8), dim=0, ep=ep, etp=etp)
    assert forward.layout["layers.0.experts.down.weight"].placement == Experts(
        4, (8,), dim=1, ep=ep, etp=etp)
    world = math.lcm(tp, ep * etp)
    declared = layout_for(QWEN2.replace(vocab_multiple=128 * tp))
    inner = HeadReplicated(4, 2, 4) if tp > 2 else declared["layers.0.qkv.weight"].placement
    qkv = forward.layout["layers.0.qkv.weight"].placement
    # each data-parallel replica of the TP group reads the dense layers
    assert qkv == (DataParallel(inner, tp) if world > tp else inner)
    assert forward.layout["layers.0.router.weight"].placement == (DataParallel(
        declared["layers.0.router.weight"].placement, tp) if world > tp else
        declared["layers.0.router.weight"].placement)


def test_pipeline_stages_store_each_stages_layers_under_local_indices():
    params, shards = stored(DENSE, "megatron:tp=2,pp=2")
    assert len(shards) == 4 == endpoint("megatron:tp=2,pp=2").world
    assert "embedding.word_embeddings.weight" in shards[0]
    assert "output_layer.weight" in shards[2] and "output_layer.weight" not in shards[0]
    # rank 2 (stage 1, TP rank 0) stores layer 1 as decoder.layers.0
    assert torch.equal(shards[2][f"{L}0.mlp.linear_fc2.weight"],
                       params["layers.1.down.weight"][:, :12])
    assert not any(n.startswith(f"{L}1.") for s in shards for n in s)
    assert endpoint("megatron:tp=2,ep=2,pp=2").world == 8 and endpoint("megatron:2").world == 2


FC1 = f"{L}0.mlp.experts.linear_fc1.weight0"
QKV = f"{L}0.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("config, at, message", [
    # the canonical model has no padding of its own: Megatron pads by its own rule
    (DENSE.replace(vocab_multiple=8), "megatron:1", ("embedding.word_embeddings.weight needs "
     "an unpadded canonical vocabulary (vocab_multiple == 1: the convention pads by its own "
     "rule) (vocab_multiple=8, t=1)")),
    # verl / mbridge's unpadded table: VocabParallelEmbedding's divide
    (DENSE, "megatron:tp=3,vocab=unpadded", ("embedding.word_embeddings.weight needs vocab % "
     "t == 0 with vocab=unpadded (VocabParallelEmbedding divides the vocabulary evenly over "
     "TP) (vocab=100, t=3)")),
    (DENSE.replace(n_heads=6, d_model=24), "megatron:4", (f"{QKV} needs n_heads % t == 0 "
     "(n_heads=6, t=4)")),
    # 3 KV groups over 2 ranks: neither divides the other
    (DENSE.replace(n_heads=6, n_kv_heads=3, d_model=24), "megatron:2", (f"{QKV} needs "
     "n_kv_heads % t == 0, or t % n_kv_heads == 0 (TP > num_query_groups: Megatron-Core since "
     "f7dfb99795) (n_kv_heads=3, t=2)")),
    # one KV group over 8 ranks: (8 + 2) * 2 = 20 rows, which ColumnParallelLinear's divide
    # refuses though both head rules hold
    (DENSE.replace(n_heads=8, n_kv_heads=1, head_dim=2), "megatron:8", (f"{QKV} needs the qkv "
     "rows divisible by t (ColumnParallelLinear) (rows=20, t=8)")),
    (DENSE.replace(ffn=6), "megatron:4", (f"{L}0.mlp.linear_fc1.weight needs ffn % t == 0 "
     "(ffn=6, t=4)")),
    (DENSE.replace(o_bias=True), "megatron:1", (f"{L}0.self_attention.linear_proj.bias needs "
     "no o_proj bias (a linear_proj bias comes only with add_bias_linear, which also biases "
     "linear_fc1, absent from the harness block) (o_bias=True, bias=False, t=1)")),
    (DENSE.replace(bias=True), "megatron:1", (f"{L}0.self_attention.linear_proj.bias needs no "
     "o_proj bias (a linear_proj bias comes only with add_bias_linear, which also biases "
     "linear_fc1, absent from the harness block) (o_bias=False, bias=True, t=1)")),
    (QWEN2.replace(n_experts=6, top_k=2), "megatron:tp=2,ep=4", (f"{FC1} needs n_experts % ep "
     "== 0 (BaseMoELayer: num_moe_experts % ep_size) (n_experts=6, ep=4, t=2)")),
    (QWEN2.replace(expert_ffn=6), "megatron:4", (f"{FC1} needs expert_ffn % etp == 0 "
     "(moe_ffn_hidden_size over the expert-TP group) (expert_ffn=6, etp=4, t=4)")),
    (QWEN2.replace(expert_ffn=6), "megatron:tp=1,etp=4", (f"{FC1} needs expert_ffn % etp == 0 "
     "(moe_ffn_hidden_size over the expert-TP group) (expert_ffn=6, etp=4, t=1)")),
    (QWEN2.replace(shared_ffn=6), "megatron:4", (f"{L}0.mlp.shared_experts.linear_fc1.weight "
     "needs shared_ffn % t == 0 (shared experts split over the attention TP group) "
     "(shared_ffn=6, t=4)")),
])
def test_each_refusal_names_the_tensor_the_rule_and_the_numbers(config, at, message):
    with pytest.raises(UnsupportedConvention) as e:
        endpoint(at).pieces(config)
    assert str(e.value) == "megatron: " + message


@pytest.mark.parametrize("config, at", [
    (DENSE.replace(n_heads=8, d_model=32), "megatron:8"),  # t % n_kv == 0 past the groups
    (DENSE.replace(n_heads=8, n_kv_heads=1), "megatron:8"),  # (8 + 2) * 4 = 40 rows over 8
    (DENSE.replace(n_heads=6, n_kv_heads=6, d_model=24), "megatron:3"),  # padded: 384 / 3
    (DENSE.replace(vocab=102, n_heads=6, n_kv_heads=6, d_model=24), ("megatron:tp=3,"
     "vocab=unpadded")),
    (DENSE.replace(ffn=6, n_heads=2, head_dim=8), "megatron:2"),
    (QWEN2.replace(expert_ffn=6), "megatron:tp=4,etp=2"),  # expert_ffn over etp, not t
    (QWEN2.replace(expert_ffn=6), "megatron:tp=4,ep=4,etp=1"),
    (QWEN2.replace(n_experts=6, top_k=2), "megatron:tp=2,ep=2"),
    (QWEN2.replace(shared_ffn=4), "megatron:4"),
])
def test_the_twins_at_the_edge_of_each_rule_are_stored(config, at):
    assert len(endpoint(at).pieces(config)) == endpoint(at).world

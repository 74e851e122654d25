"""``conventions.vllm`` (issue 30, the mutation pass over ``conventions/vllm.py``): vLLM's
parameters after weight loading, dense and MoE, and its refusals.

vLLM is where most syncs end. A KV head replicated to the wrong rank, gate and up swapped in
``gate_up_proj``, a vocabulary padded to the wrong multiple, an expert on the wrong EP rank or
a refusal that lets through a degree vLLM rejects would each put a wrong byte in the engine.
These tests check each rank's stored bytes against vLLM's own loaders, written out here as
vLLM 0.33.0 has them: ``QKVParallelLinear.weight_loader`` (KV shard ``tp_rank //
num_kv_head_replicas``), ``MergedColumnParallelLinear.weight_loader`` (``[gate_r | up_r]``),
``pad_vocab_size`` (a multiple of 64), ``FusedMoE._load_w13`` / ``_load_w2`` and
``expert_map_manager.py::determine_expert_map`` (linear, remainder to the first ranks; round
robin), FlashInfer CUTLASS's ``swap_w13_to_w31``. They pin each refusal's text and the layout
the forward reads."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions import vllm as V
from weight_sync_bench.errors import UnsupportedConvention
from weight_sync_bench.layout.placements import Experts, HeadReplicated
from weight_sync_bench.model.config import ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for

# 100 tokens pad to 128; 2 KV heads, so t = 4 replicates each twice
DENSE = ModelConfig(name="d", vocab=100, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=4, ffn=24, batch=1, seq_len=4)
MOE = {"n_layers": 1, "ffn": 8, "n_experts": 5, "top_k": 2, "expert_ffn": 8}
QWEN2 = DENSE.replace(name="q2", **MOE, shared_ffn=8, shared_gate=True)
DEEPSEEK = DENSE.replace(name="ds", **{**MOE, "n_experts": 6}, router="sigmoid",
                         router_bias=True, n_groups=2, shared_ffn=8)
MIXTRAL = DENSE.replace(name="mx", **MOE, moe_style="mixtral")


def stored(config, at, seed=0):
    params = init_params(config, seed)
    return params, materialize(endpoint(at).pieces(config), params)


def rows(a, b):
    return torch.arange(a, b)


def vllm_qkv_rows(c, t, r):
    """``QKVParallelLinear``'s rank r: ``num_heads = n_heads / t``, ``num_kv_heads =
    max(1, n_kv / t)``, ``num_kv_head_replicas = max(1, t / n_kv)``; ``weight_loader`` loads
    q shard ``tp_rank`` and k, v shard ``tp_rank // num_kv_head_replicas``."""
    hd, nq = c.head_dim, c.n_heads // t
    nkv, replicas = max(1, c.n_kv_heads // t), max(1, t // c.n_kv_heads)
    kv = r // replicas
    q0, v0 = c.q_rows, c.q_rows + c.kv_rows
    return torch.cat([rows(r * nq * hd, (r + 1) * nq * hd),
                      rows(q0 + kv * nkv * hd, q0 + (kv + 1) * nkv * hd),
                      rows(v0 + kv * nkv * hd, v0 + (kv + 1) * nkv * hd)])


def test_the_vocabulary_pads_to_a_multiple_of_64_as_pad_vocab_size_does():
    assert [V.padded_vocab(v) for v in (1, 63, 64, 65, 100, 128, 129)] == [
        64, 64, 64, 128, 128, 128, 192]
    assert V.DEFAULT_VOCAB_PADDING_SIZE == 64 and V.NAME == "vllm" and V.VLLM.name == "vllm"
    assert V.OPTIONS == {"placement": ("linear", "round_robin"),
                         "kernel": ("none", "flashinfer_cutlass"),
                         "fp8": ("none", "block128", "tensor")}


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama_biases", "qwen3_qkv_bias"])
def test_each_rank_holds_what_vllms_loaders_put_there(t, qk_norm):
    # Llama's attention_bias biases qkv_proj and o_proj; Qwen3's qkv_proj only
    config = DENSE.replace(qkv_bias=True, o_bias=not qk_norm, qk_norm=qk_norm)
    params, shards = stored(config, f"vllm:{t}")
    assert len(shards) == t
    f, vp = config.ffn // t, 128 // t
    for r, got in enumerate(shards):
        layer = [f"model.layers.{i}.{n}" for i in range(2) for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
            *(("self_attn.q_norm.weight", "self_attn.k_norm.weight") if qk_norm else
              ("self_attn.o_proj.bias",)),
            "mlp.gate_up_proj.weight", "mlp.down_proj.weight")]
        assert sorted(got) == sorted(["model.embed_tokens.weight", "model.norm.weight",
                                      "lm_head.weight", *layer])
        for i in range(2):
            m, p = f"model.layers.{i}.", f"layers.{i}."
            qkv = vllm_qkv_rows(config, t, r)
            assert torch.equal(got[m + "self_attn.qkv_proj.weight"], params[p + "qkv.weight"][qkv])
            assert torch.equal(got[m + "self_attn.qkv_proj.bias"], params[p + "qkv.bias"][qkv])
            cols = slice(r * 16 // t, (r + 1) * 16 // t)
            assert torch.equal(got[m + "self_attn.o_proj.weight"],
                               params[p + "o_proj.weight"][:, cols])
            # RowParallelLinear's bias is the whole bias (added by rank 0 only)
            if not qk_norm:
                assert torch.equal(got[m + "self_attn.o_proj.bias"], params[p + "o_proj.bias"])
            gu = params[p + "gate_up.weight"]
            assert torch.equal(got[m + "mlp.gate_up_proj.weight"],
                               torch.cat([gu[r * f:(r + 1) * f], gu[24 + r * f:24 + (r + 1) * f]]))
            assert torch.equal(got[m + "mlp.down_proj.weight"],
                               params[p + "down.weight"][:, r * f:(r + 1) * f])
            norms = [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]
            if qk_norm:
                norms += [("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")]
            for ours, theirs in norms:
                assert torch.equal(got[m + theirs + ".weight"], params[p + ours + ".weight"])
        assert torch.equal(got["model.norm.weight"], params["norm.weight"])
        for ours, theirs in (("tok_embeddings", "model.embed_tokens"), ("lm_head", "lm_head")):
            table = got[theirs + ".weight"]  # rows [r Vp/t, (r+1) Vp/t) of the padded table
            assert table.shape == (vp, 16)
            real = params[ours + ".weight"][r * vp:(r + 1) * vp]
            assert torch.equal(table[:len(real)], real)
            assert not table[len(real):].any()


def test_kv_head_r_times_n_kv_over_t_is_replicated_past_n_kv_ranks():
    config = DENSE.replace(qkv_bias=True)
    params, shards = stored(config, "vllm:4")
    qkv = params["layers.0.qkv.weight"]
    for r, got in enumerate(shards):
        g = r * 2 // 4  # ranks 0, 1 hold KV head 0; ranks 2, 3 KV head 1
        assert torch.equal(got["model.layers.0.self_attn.qkv_proj.weight"], torch.cat(
            [qkv[r * 4:(r + 1) * 4], qkv[16 + g * 4:16 + (g + 1) * 4],
             qkv[24 + g * 4:24 + (g + 1) * 4]]))


def test_a_tied_model_stores_the_embedding_only():
    _, shards = stored(DENSE.replace(tie_embeddings=True), "vllm:2")
    assert all("lm_head.weight" not in s and "model.embed_tokens.weight" in s for s in shards)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_the_forward_reads_the_64_padded_model_with_kv_heads_replicated_past_n_kv(t):
    config = DENSE.replace(qkv_bias=True)
    forward = V.VLLM.forward_layout(config, t)
    assert forward.config == config.replace(vocab_multiple=64)
    declared = layout_for(config.replace(vocab_multiple=64))
    for spec in forward.layout:
        if ".qkv." in spec.name and t > 2:
            assert spec.placement == HeadReplicated(4, 2, 4), spec.name
        else:
            assert spec.placement == declared[spec.name].placement, spec.name
    assert forward.tp == 0 and forward.gathered == frozenset()


def determine_expert_map(e, ep, ep_rank, placement):
    """vLLM's ``determine_expert_map``: ``linear`` gives the first ``e % ep`` ranks one
    expert more; ``round_robin`` ``arange(ep_rank, e, ep)``."""
    if placement == "round_robin":
        return list(range(ep_rank, e, ep))
    base, rem = divmod(e, ep)
    start = ep_rank * base + min(ep_rank, rem)
    return list(range(start, start + base + (ep_rank < rem)))


def expert(params, e, f):
    gu, down = params["layers.0.experts.gate_up.weight"], params["layers.0.experts.down.weight"]
    start = 2 * f * e
    return gu[start:start + f], gu[start + f:start + 2 * f], down[:, f * e:f * (e + 1)]


@pytest.mark.parametrize("at, ep, placement, kernel", [
    ("vllm:1", 1, "linear", "none"),
    ("vllm:2", 1, "linear", "none"),  # no EP: every expert, half its intermediate on each rank
    ("vllm:4", 1, "linear", "none"),
    ("vllm:tp=2,kernel=flashinfer_cutlass", 1, "linear", "flashinfer_cutlass"),
    ("vllm:tp=2,ep=2", 2, "linear", "none"),  # 5 experts: 3 on rank 0, 2 on rank 1
    ("vllm:tp=4,ep=4", 4, "linear", "none"),  # 2, 1, 1, 1
    ("vllm:tp=4,ep=4,kernel=flashinfer_cutlass", 4, "linear", "flashinfer_cutlass"),
])
def test_w13_and_w2_hold_each_ranks_experts_as_fused_moe_loads_them(at, ep, placement, kernel):
    params, shards = stored(QWEN2, at)
    t = len(shards)
    tp = t // ep  # the experts' TP: t without EP, 1 with it
    f = 8 // tp
    pre = "model.layers.0.mlp.experts.routed_experts."
    for r, got in enumerate(shards):
        mine = determine_expert_map(5, ep, r if ep > 1 else 0, placement)
        k = r % tp
        w13, w2 = got[pre + "w13_weight"], got[pre + "w2_weight"]
        assert w13.shape == (len(mine), 2 * f, 16) and w2.shape == (len(mine), 16, f)
        for j, e in enumerate(mine):
            gate, up, down = expert(params, e, 8)
            w1, w3 = gate[k * f:(k + 1) * f], up[k * f:(k + 1) * f]  # _load_w13: narrowed
            want = [w3, w1] if kernel == "flashinfer_cutlass" else [w1, w3]
            assert torch.equal(w13[j], torch.cat(want)), (at, r, e)
            assert torch.equal(w2[j], down[:, k * f:(k + 1) * f]), (at, r, e)


def test_round_robin_puts_expert_ep_rank_plus_k_ep_on_each_rank():
    params, shards = stored(DEEPSEEK, "vllm:tp=4,ep=4,placement=round_robin")
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    for r, got in enumerate(shards):
        mine = determine_expert_map(6, 4, r, "round_robin")  # 0 4 | 1 5 | 2 | 3
        assert got[w13].shape[0] == len(mine)
        for j, e in enumerate(mine):
            gate, up, _ = expert(params, e, 8)
            assert torch.equal(got[w13][j], torch.cat([gate, up]))
    forward = V.VLLM.forward_layout(DEEPSEEK, endpoint("vllm:tp=4,ep=4,placement=round_robin"))
    assert forward.experts == Experts(6, (8, 8), dim=0, ep=4, etp=1, order="round_robin")
    down = forward.layout["layers.0.experts.down.weight"].placement
    assert down == Experts(6, (8,), dim=1, ep=4, etp=1, order="round_robin")


@pytest.mark.parametrize("at, ep", [("vllm:2", 1), ("vllm:tp=2,ep=2", 2)])
def test_the_forward_reads_the_experts_where_they_are_stored(at, ep):
    forward = V.VLLM.forward_layout(QWEN2, endpoint(at))
    etp = 1 if ep > 1 else 0
    assert forward.experts == Experts(5, (8, 8), dim=0, ep=ep, etp=etp,
                                      order="linear" if ep > 1 else "contiguous")
    assert forward.layout["layers.0.experts.down.weight"].placement == Experts(
        5, (8,), dim=1, ep=ep, etp=etp, order="linear" if ep > 1 else "contiguous")


def test_qwen2_moe_stores_the_router_its_shared_expert_and_its_gate():
    params, shards = stored(QWEN2, "vllm:2")
    m = "model.layers.0.mlp."
    assert sorted(shards[0]) == sorted([
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        m + "gate.weight", m + "experts.routed_experts.w13_weight",
        m + "experts.routed_experts.w2_weight", m + "shared_expert.gate_up_proj.weight",
        m + "shared_expert.down_proj.weight", m + "shared_expert_gate.weight"])
    sgu, sdown = params["layers.0.shared.gate_up.weight"], params["layers.0.shared.down.weight"]
    for r, got in enumerate(shards):  # split like the dense MLP: [gate_r | up_r], columns r
        assert torch.equal(got[m + "shared_expert.gate_up_proj.weight"],
                           torch.cat([sgu[4 * r:4 * r + 4], sgu[8 + 4 * r:12 + 4 * r]]))
        assert torch.equal(got[m + "shared_expert.down_proj.weight"], sdown[:, 4 * r:4 * r + 4])
        assert torch.equal(got[m + "gate.weight"], params["layers.0.router.weight"])
        assert torch.equal(got[m + "shared_expert_gate.weight"],
                           params["layers.0.shared_gate.weight"])


def test_deepseek_stores_its_selection_bias_and_shared_experts_without_a_gate():
    params, (got,) = stored(DEEPSEEK, "vllm:1")
    m = "model.layers.0.mlp."
    assert torch.equal(got[m + "gate.e_score_correction_bias"], params["layers.0.router.bias"])
    assert torch.equal(got[m + "shared_experts.gate_up_proj.weight"],
                       params["layers.0.shared.gate_up.weight"])
    assert torch.equal(got[m + "shared_experts.down_proj.weight"],
                       params["layers.0.shared.down.weight"])
    assert not any("shared_expert." in n or "shared_expert_gate" in n for n in got)


def test_mixtral_keeps_block_sparse_moe_for_the_router_and_experts():
    params, (got,) = stored(MIXTRAL, "vllm:1")
    b = "model.layers.0.block_sparse_moe."
    assert {b + "gate.weight", b + "experts.routed_experts.w13_weight",
            b + "experts.routed_experts.w2_weight"} <= set(got)
    assert torch.equal(got[b + "gate.weight"], params["layers.0.router.weight"])
    assert not any(".mlp." in n for n in got)
    assert V.moe_names(MIXTRAL) == {
        "layers.{i}.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
        "layers.{i}.router.bias": "model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias",
        "layers.{i}.shared.gate_up.weight":
            "model.layers.{i}.mlp.shared_experts.gate_up_proj.weight",
        "layers.{i}.shared.down.weight": "model.layers.{i}.mlp.shared_experts.down_proj.weight",
        "layers.{i}.shared_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
        "experts": "model.layers.{i}.block_sparse_moe.experts.routed_experts"}


def test_a_moe_model_with_dense_layers_stores_their_dense_mlp():
    config = DEEPSEEK.replace(n_layers=2, dense_layers=1)
    params, shards = stored(config, "vllm:2")
    gu = params["layers.0.gate_up.weight"]  # ffn 8: rank 1 [gate 4-7 | up 4-7]
    assert torch.equal(shards[1]["model.layers.0.mlp.gate_up_proj.weight"],
                       torch.cat([gu[4:8], gu[12:16]]))
    assert "model.layers.1.mlp.experts.routed_experts.w13_weight" in shards[1]
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" not in shards[1]


W13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"
O_BIAS = "model.layers.0.self_attn.o_proj.bias"


@pytest.mark.parametrize("config, at, message", [
    # the canonical model has no padding of its own: vLLM pads by pad_vocab_size
    (DENSE.replace(vocab_multiple=8), "vllm:1", ("model.embed_tokens.weight needs an unpadded "
     "canonical vocabulary (vocab_multiple == 1: the convention pads by its own rule) "
     "(vocab_multiple=8, t=1)")),
    (DENSE.replace(n_heads=6, d_model=24), "vllm:4", (f"{QKV} needs n_heads % t == 0 "
     "(n_heads=6, t=4)")),
    # t > n_kv: each KV head on t / n_kv ranks, so t must be a multiple of n_kv
    (DENSE.replace(n_heads=6, n_kv_heads=2, d_model=24, ffn=6), "vllm:3", (f"{QKV} needs "
     "t % n_kv_heads == 0 when t > n_kv_heads (n_kv_heads=2, t=3)")),
    # t <= n_kv: whole KV heads per rank
    (DENSE.replace(n_heads=6, n_kv_heads=3, d_model=24), "vllm:2", (f"{QKV} needs "
     "n_kv_heads % t == 0 when t <= n_kv_heads (n_kv_heads=3, t=2)")),
    (DENSE.replace(ffn=6), "vllm:4", ("model.layers.0.mlp.gate_up_proj.weight needs "
     "ffn % t == 0 (ffn=6, t=4)")),
    # 128 padded rows do not split over 3 ranks (vocab_parallel_embedding's divide)
    (DENSE.replace(n_heads=6, n_kv_heads=6, d_model=24), "vllm:3", ("model.embed_tokens.weight "
     "needs padded vocab % t == 0 (the vocabulary padded to a multiple of 64) (vocab=100, "
     "padded vocab=128, t=3)")),
    (DENSE.replace(bias=True), "vllm:1", ("model.layers.0.mlp.down_proj.bias needs no down "
     "bias without a gate_up bias (LlamaMLP's mlp_bias biases gate_up_proj and down_proj "
     "together) (bias=True, t=1)")),
    (QWEN2.replace(n_experts=3), "vllm:4", (f"{W13} needs t <= n_experts "
     "(Qwen3MoeSparseMoeBlock refuses tp_size > num_experts) (n_experts=3, t=4)")),
    (QWEN2, "vllm:tp=4,ep=2", (f"{W13} needs ep == 1 or ep == t (FusedMoEParallelConfig: "
     "expert parallelism spans the whole TP x DP group) (ep=2, t=4)")),
    (QWEN2, "vllm:tp=2,etp=1", (f"{W13} needs no expert-TP degree of its own (the experts' TP "
     "is t without EP, 1 with it) (etp=1, ep=1, t=2)")),
    (QWEN2, "vllm:tp=2,ep=2,etp=2", (f"{W13} needs no expert-TP degree of its own (the "
     "experts' TP is t without EP, 1 with it) (etp=2, ep=2, t=2)")),
    (QWEN2.replace(expert_ffn=6), "vllm:4", (f"{W13} needs expert_ffn % t == 0 "
     "(intermediate_size_per_partition) (expert_ffn=6, t=4)")),
    (QWEN2.replace(shared_ffn=6), "vllm:4", ("model.layers.0.mlp.shared_expert.gate_up_proj."
     "weight needs shared_ffn % t == 0 (shared_ffn=6, t=4)")),
    # round_robin without grouped top-k: determine_expert_placement_strategy falls back
    (QWEN2, "vllm:tp=2,ep=2,placement=round_robin", (f"{W13} needs placement=round_robin only "
     "with expert parallelism and grouped top-k (n_groups > 1): "
     "determine_expert_placement_strategy falls back to linear otherwise (ep=2, n_groups=1, "
     "t=2)")),
    (DEEPSEEK, "vllm:tp=2,placement=round_robin", (f"{W13} needs placement=round_robin only "
     "with expert parallelism and grouped top-k (n_groups > 1): "
     "determine_expert_placement_strategy falls back to linear otherwise (ep=1, n_groups=2, "
     "t=2)")),
    # Qwen3's o_proj has bias=False in vLLM, where HF's is biased by attention_bias
    (DENSE.replace(qk_norm=True, qkv_bias=True, o_bias=True), "vllm:2", (O_BIAS + " needs no "
     "o_proj bias beside q/k norms (Qwen3Attention's o_proj has bias=False) (o_bias=True, "
     "bias=False, t=2)")),
    (QWEN2.replace(shared_ffn=0, shared_gate=False, qk_norm=True, o_bias=True), "vllm:1", (
     O_BIAS + " needs no o_proj bias beside q/k norms (Qwen3Attention's o_proj has bias=False) "
     "(o_bias=True, bias=False, t=1)")),
    (MIXTRAL.replace(qkv_bias=True), "vllm:1", ("model.layers.0.self_attn.qkv_proj.bias needs "
     "no attention biases in a Mixtral (MixtralAttention's have bias=False) (qkv_bias=True, "
     "o_bias=False, bias=False, t=1)")),
    (MIXTRAL.replace(o_bias=True), "vllm:2", ("model.layers.0.self_attn.qkv_proj.bias needs "
     "no attention biases in a Mixtral (MixtralAttention's have bias=False) (qkv_bias=False, "
     "o_bias=True, bias=False, t=2)")),
])
def test_each_refusal_names_the_tensor_the_rule_and_the_numbers(config, at, message):
    with pytest.raises(UnsupportedConvention) as e:
        endpoint(at).pieces(config)
    assert str(e.value) == "vllm: " + message


@pytest.mark.parametrize("config, at", [
    (DENSE.replace(n_heads=8, n_kv_heads=2, d_model=32), "vllm:8"),  # t > n_kv, 8 % 2 == 0
    (DENSE.replace(n_heads=2, n_kv_heads=2, head_dim=8), "vllm:2"),  # t == n_kv: no replicas
    (DENSE.replace(n_heads=6, n_kv_heads=6, d_model=24, vocab=129), "vllm:3"),  # 192 / 3
    (DENSE.replace(ffn=6, n_heads=2, head_dim=8), "vllm:2"),
    (QWEN2.replace(n_experts=4), "vllm:4"),  # t == n_experts
    (QWEN2.replace(expert_ffn=6), "vllm:tp=4,ep=4"),  # EP: the experts whole, any expert_ffn
    (QWEN2.replace(expert_ffn=5), "vllm:tp=2,ep=2"),  # at the smallest EP too
    (QWEN2, "vllm:tp=2,ep=2,etp=1"),  # the experts' TP given as it is: 1 with EP
    (QWEN2, "vllm:tp=2,etp=2"),  # t without EP
    (DEEPSEEK, "vllm:tp=2,ep=2,placement=round_robin"),
    # q/k norms with q/k/v biases alone: vLLM's Qwen3 reads attention_bias for qkv_proj
    (DENSE.replace(qk_norm=True, qkv_bias=True), "vllm:2"),
    (DENSE.replace(qkv_bias=True, o_bias=True), "vllm:2"),  # Llama's: both biased
    (QWEN2.replace(qkv_bias=True, o_bias=True), "vllm:2"),  # no q/k norms
    (MIXTRAL, "vllm:2"),
    (DEEPSEEK.replace(qkv_bias=True, o_bias=True), "vllm:2"),  # not a Mixtral
])
def test_the_twins_at_the_edge_of_each_rule_are_stored(config, at):
    assert len(endpoint(at).pieces(config)) == endpoint(at).degree

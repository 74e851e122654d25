"""The Mixture-of-Experts model: its geometry's rules, the routing math against transformers'
own algorithms written out here, the reference forward against a per-token oracle, and the
sharded forward equal to the reference under every expert placement."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.layout.placements import Experts
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.layout.table import LayoutTable, ShardSpec
from weight_sync_bench.model.config import (
    MOE_HF_CONFIGS,
    TOY,
    TOY_MOE,
    TOY_MOE_DS,
    ModelConfig,
    hf_config_path,
    init_params,
    make_tokens,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel, rms_norm
from weight_sync_bench.model.routing import by_expert, choose, gate_weights, route
from weight_sync_bench.model.sharded import RoutingGuard, ShardedModel

SMALL = dict(vocab=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, n_layers=2)
QWEN3 = TOY.replace(name="q3", **SMALL, qk_norm=True, n_experts=8, top_k=2, expert_ffn=32,
                    norm_topk=True)
DEEPSEEK = TOY.replace(name="ds", **SMALL, n_experts=12, top_k=3, expert_ffn=32,
                       router="sigmoid", router_bias=True, norm_topk=True, n_groups=4,
                       topk_groups=2, shared_ffn=64, dense_layers=1)
QWEN2 = TOY.replace(name="q2", **SMALL, qkv_bias=True, n_experts=6, top_k=4, expert_ffn=32,
                    shared_ffn=64, shared_gate=True)
MOE = [QWEN3, DEEPSEEK, QWEN2]


@pytest.mark.parametrize("changes, rule", [
    ({"top_k": 9}, "1 <= top_k <= n_experts (top_k=9, n_experts=8)"),
    ({"top_k": 0}, "1 <= top_k <= n_experts (top_k=0, n_experts=8)"),
    ({"expert_ffn": 0}, "expert_ffn >= 1 (expert_ffn=0)"),
    ({"router": "relu"}, "router in ('softmax', 'sigmoid') (router='relu')"),
    # the selection bias is DeepSeek-V3's, on sigmoid scores
    ({"router_bias": True}, "router_bias only with router='sigmoid'"),
    ({"n_groups": 3}, "n_experts % n_groups == 0 (n_experts=8, n_groups=3)"),
    ({"n_groups": 2, "topk_groups": 3}, "topk_groups <= n_groups (topk_groups=3, n_groups=2)"),
    # a group scores by the sum of its top two
    ({"n_groups": 8}, "at least 2 experts per group (a group scores by its top 2: n_experts=8"),
    ({"n_groups": 4, "topk_groups": 1, "top_k": 3},
     "top_k <= topk_groups * n_experts / n_groups (top_k=3, topk_groups=1"),
    ({"shared_gate": True}, "shared_gate needs a shared expert (shared_ffn >= 1)"),
    ({"dense_layers": 3}, "dense_layers <= n_layers (dense_layers=3, n_layers=2)"),
    ({"moe_style": "gpt"}, "moe_style in ('qwen', 'mixtral') (moe_style='gpt')"),
])
def test_an_inconsistent_moe_geometry_is_refused_naming_the_rule(changes, rule):
    with pytest.raises(InvalidConfig, match="^" + re.escape(f"q3: MoE needs {rule}")):
        QWEN3.replace(**changes)


def test_moe_fields_without_experts_are_refused():
    with pytest.raises(InvalidConfig, match=re.escape(
            "toy: top_k=2, expert_ffn=8 without experts (n_experts=0)")):
        TOY.replace(top_k=2, expert_ffn=8)


def test_a_dense_geometry_records_what_it_always_did_and_an_moe_one_reads_back():
    assert TOY.geometry() == {"vocab": 32000, "d_model": 256, "n_layers": 4, "n_heads": 8,
                              "n_kv_heads": 2, "head_dim": 32, "ffn": 704, "batch": 2,
                              "seq_len": 16}
    for c in (*MOE, TOY_MOE, TOY_MOE_DS):
        assert ModelConfig.from_geometry(c.geometry(), c.name) == c
        assert c.geometry()["n_experts"] == c.n_experts


def test_an_moe_layers_parameters_in_forward_order():
    assert DEEPSEEK.suffixes_of(0)[-2:] == ("gate_up.weight", "down.weight")  # first_k_dense
    assert DEEPSEEK.suffixes_of(1)[-6:] == (
        "router.weight", "router.bias", "experts.gate_up.weight", "experts.down.weight",
        "shared.gate_up.weight", "shared.down.weight")
    assert QWEN2.suffixes_of(0)[-1] == "shared_gate.weight"
    assert QWEN3.suffixes_of(0)[2:4] == ("q_norm.weight", "k_norm.weight")
    shapes = QWEN3.param_shapes()
    assert shapes["layers.0.experts.gate_up.weight"] == (8 * 2 * 32, 64)  # experts side by side
    assert shapes["layers.0.experts.down.weight"] == (64, 8 * 32)
    assert shapes["layers.0.router.weight"] == (8, 64)
    assert shapes["layers.0.q_norm.weight"] == (16,)


# ---------------------------------------------------------------- the shipped configs

@pytest.mark.parametrize("name, fields", [
    ("qwen3_30b_a3b", dict(d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                           vocab=151936, n_experts=128, top_k=8, expert_ffn=768, norm_topk=True,
                           qk_norm=True, qkv_bias=False, shared_ffn=0, moe_style="qwen")),
    ("mixtral_8x7b", dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                          vocab=32000, n_experts=8, top_k=2, expert_ffn=14336, norm_topk=True,
                          qk_norm=False, moe_style="mixtral")),
    ("qwen1_5_moe_a2_7b", dict(d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16,
                               head_dim=128, vocab=151936, n_experts=60, top_k=4,
                               expert_ffn=1408, norm_topk=False, shared_ffn=5632,
                               shared_gate=True, qkv_bias=True, qk_norm=False)),
])
def test_a_shipped_moe_config_reads_as_the_models_geometry(name, fields):
    c = ModelConfig.from_hf_config(hf_config_path(name))
    assert {k: getattr(c, k) for k in fields} == fields
    assert c.notes == ()  # no sliding window in use in any of them
    assert ModelConfig.from_hf_config(c.to_hf_config(), name=c.name) == c


def test_every_shipped_moe_config_is_listed():
    assert sorted(MOE_HF_CONFIGS) == ["mixtral_8x7b", "qwen1_5_moe_a2_7b", "qwen3_30b_a3b"]


QWEN3_MOE_JSON = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
                  "num_hidden_layers": 2, "vocab_size": 256, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}


@pytest.mark.parametrize("changes, message", [
    # an architecture the block does not implement is never read as a dense Llama
    ({"model_type": "deepseek_v3"}, "HF config field 'model_type' is 'deepseek_v3': the "
                                    "harness models llama, mistral"),
    ({"model_type": "gpt_oss"}, "HF config field 'model_type' is 'gpt_oss'"),
    ({"kv_lora_rank": 512}, "HF config field 'kv_lora_rank' is 512: DeepSeek's multi-head "
                            "latent attention (MLA) is not modelled"),
    ({"sinks": True}, "HF config field 'sinks' is True: attention sinks is not modelled"),
    ({"decoder_sparse_step": 2}, "HF config fields 'decoder_sparse_step' 2 and "
                                 "'mlp_only_layers' []"),
    ({"mlp_only_layers": [1]}, "HF config fields 'decoder_sparse_step' 1 and 'mlp_only_layers' "
                               "[1]"),
    ({"rope_scaling": {"type": "yarn"}}, "HF config field 'rope_scaling'"),
])
def test_what_the_moe_block_cannot_model_is_refused_naming_the_field(changes, message):
    with pytest.raises(InvalidConfig, match="^tiny: " + re.escape(message)):
        ModelConfig.from_hf_config({**QWEN3_MOE_JSON, **changes}, name="tiny")


def test_a_qwen_moe_config_reads_its_dense_prefix_and_a_sliding_window_is_a_note():
    c = ModelConfig.from_hf_config({**QWEN3_MOE_JSON, "mlp_only_layers": [0],
                                    "sliding_window": 4096}, name="tiny")
    assert (c.dense_layers, c.n_experts, c.qk_norm) == (1, 8, True)
    assert c.notes == ("tiny: sliding_window 4096 is not modelled; a check's tokens lie within "
                       "it, so attention is unchanged",)
    unused = ModelConfig.from_hf_config({**QWEN3_MOE_JSON, "sliding_window": 4096,
                                         "use_sliding_window": False}, name="tiny")
    assert unused.notes == ()  # Qwen's configs name a window they do not use


def test_qwen3_dense_reads_its_qk_norms():
    c = ModelConfig.from_hf_config({**QWEN3_MOE_JSON, "model_type": "qwen3"}, name="tiny")
    assert (c.qk_norm, c.n_experts) == (True, 0)
    assert ModelConfig.from_hf_config(c.to_hf_config(), name="tiny") == c


# ---------------------------------------------------------------- routing

def test_top_k_and_its_margin():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.45], [3.0, 2.0, 1.0, 2.0]])
    experts, margin = choose(scores, QWEN3.replace(n_experts=4, top_k=2))
    assert experts.tolist() == [[1, 2], [0, 1]] or experts.tolist() == [[1, 2], [0, 3]]
    # half the gap between the 2nd and 3rd scores: a change of that much in one score flips it
    assert torch.allclose(margin, torch.tensor([0.025, 0.0]))


def _deepseek_topk(scores: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """transformers 5.24.0 DeepseekV3TopkRouter's selection, written out (the oracle)."""
    n = scores.shape[0]
    group_scores = scores.view(n, c.n_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=c.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, c.n_groups, c.n_experts // c.n_groups
                                                 ).reshape(n, -1)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=c.top_k, dim=-1, sorted=False)[1]


def test_group_limited_choice_is_deepseek_v3s_and_its_margin_bounds_every_flip():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(500, 12, generator=gen)
    experts, margin = choose(scores, DEEPSEEK)
    assert torch.equal(experts.sort(dim=-1).values,
                       _deepseek_topk(scores, DEEPSEEK).sort(dim=-1).values)
    # any change of every score by less than the margin keeps every token's choice
    for _ in range(20):
        noise = (torch.rand(scores.shape, generator=gen) * 2 - 1) * margin[:, None] * 0.999
        moved, _ = choose(scores + noise, DEEPSEEK)
        assert torch.equal(moved.sort(dim=-1).values, experts.sort(dim=-1).values)
    # and the margin is tight: moving the k-th and (k+1)-th expert score of the closest
    # token 1.01 margins toward each other flips it (where its group margin is not smaller)
    hit = 0
    for i in range(len(scores)):
        allowed = scores[i].clone()
        groups = scores[i].view(DEEPSEEK.n_groups, -1).topk(2, -1).values.sum(-1)
        kept = groups.topk(DEEPSEEK.topk_groups).indices
        mask = torch.ones(DEEPSEEK.n_groups, dtype=torch.bool)
        mask[kept] = False
        allowed.view(DEEPSEEK.n_groups, -1)[mask] = float("-inf")
        order = allowed.argsort(descending=True)
        kth, nxt = int(order[DEEPSEEK.top_k - 1]), int(order[DEEPSEEK.top_k])
        gap = float(allowed[kth] - allowed[nxt]) / 2
        if abs(gap - float(margin[i])) < 1e-7:
            moved = scores[i:i + 1].clone()
            moved[0, kth] -= gap * 1.01
            moved[0, nxt] += gap * 1.01
            hit += choose(moved, DEEPSEEK)[0].sort(-1).values.tolist() != experts[i:i + 1].sort(
                -1).values.tolist()
    assert hit > 100


def test_softmax_weights_are_qwens_and_sigmoid_weights_ignore_the_bias():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 8, generator=gen)
    r = route(logits, QWEN3)
    probs = F.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, 2, dim=-1)  # transformers' Qwen3MoeTopKRouter
    assert torch.equal(r.experts.sort(-1).values, idx.sort(-1).values)
    assert torch.allclose(gate_weights(logits, idx, QWEN3), top / top.sum(-1, keepdim=True))
    bias = torch.randn(12, generator=gen)
    ds_logits = torch.randn(7, 12, generator=gen)
    chosen = route(ds_logits, DEEPSEEK, bias).experts
    assert torch.equal(chosen.sort(-1).values,
                       _deepseek_topk(ds_logits.sigmoid() + bias, DEEPSEEK).sort(-1).values)
    w = gate_weights(ds_logits, chosen, DEEPSEEK)
    s = ds_logits.sigmoid().gather(1, chosen)
    assert torch.allclose(w, s / (s.sum(-1, keepdim=True) + 1e-20))


def test_tokens_by_expert_skip_tokens_served_elsewhere():
    experts = torch.tensor([[0, 2], [2, 1], [-1, -1]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.0, 0.0]])
    out = by_expert(experts, weights, 3)
    assert [t.tolist() for t, _ in out] == [[0], [1], [0, 1]]
    assert [w.tolist() for _, w in out] == [[0.5], [0.75], [0.5, 0.25]]


# ---------------------------------------------------------------- forwards

def _oracle_logits(c: ModelConfig, p: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The reference's MoE block replaced by a per-token loop over transformers' semantics
    (Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock / DeepseekV3MoE): each token's top-k
    experts, SwiGLU each, weighted, summed; the shared expert added (gated by a sigmoid)."""
    ref = ReferenceModel(c, p)
    original = ref.step

    def step(state, name):
        if ".router.weight" not in name:
            return original(state, name)
        i = int(name.split(".")[1])
        x = state.x.flatten(0, 1)
        logits = x @ p[f"layers.{i}.router.weight"].T
        bias = p.get(f"layers.{i}.router.bias")
        chosen = route(logits, c, bias).experts
        w = gate_weights(logits, chosen, c)
        f = c.expert_ffn
        y = torch.zeros_like(x)
        gu, down = p[f"layers.{i}.experts.gate_up.weight"], p[f"layers.{i}.experts.down.weight"]
        for n in range(x.shape[0]):
            for j in range(c.top_k):
                e = int(chosen[n, j])
                h = gu[e * 2 * f:(e + 1) * 2 * f] @ x[n]
                y[n] += w[n, j] * (down[:, e * f:(e + 1) * f] @ (F.silu(h[:f]) * h[f:]))
        if c.shared_ffn:
            g = p[f"layers.{i}.shared.gate_up.weight"] @ x.T
            s = (p[f"layers.{i}.shared.down.weight"] @ (F.silu(g[:c.shared_ffn]) * g[c.shared_ffn:])).T
            if c.shared_gate:
                s = torch.sigmoid(x @ p[f"layers.{i}.shared_gate.weight"].T) * s
            y = y + s
        state.h, state.x = state.h + y.view_as(state.h), None
        state.skip = True

    def skipping(state, name):
        if getattr(state, "skip", False) and (".experts." in name or ".shared" in name
                                              or ".router.bias" in name):
            return None
        if ".attn_norm" in name:
            state.skip = False
        return step(state, name)
    ref.step = skipping
    return ref(tokens)


@pytest.mark.parametrize("config", MOE, ids=lambda c: c.name)
def test_the_reference_moe_block_is_the_per_token_oracle(config):
    p = init_params(config, 0)
    tokens = make_tokens(config, 1000)
    torch.testing.assert_close(ReferenceModel(config, p)(tokens), _oracle_logits(config, p, tokens),
                               rtol=0, atol=2e-6)


def test_q_and_k_norms_apply_per_head_before_rope():
    c, p = QWEN3, init_params(QWEN3, 0)
    tokens = make_tokens(c, 1000)
    flat = dict(p)
    for i in range(c.n_layers):  # unit norms: the same as no norm only where RMS is 1
        flat[f"layers.{i}.q_norm.weight"] = torch.full((c.head_dim,), 2.0)
    assert not torch.allclose(ReferenceModel(c, p)(tokens), ReferenceModel(c, flat)(tokens))
    q = torch.randn(2, 3, 4, 16)
    assert torch.allclose(rms_norm(q, torch.ones(16), 1e-6).pow(2).mean(-1), torch.ones(2, 3, 4),
                          atol=1e-4)


def _relaid(config: ModelConfig, ep: int, etp: int, order: str) -> LayoutTable:
    return LayoutTable(tuple(
        ShardSpec(s.name, s.shape, Experts(s.placement.n_experts, s.placement.blocks,
                                           s.placement.dim, ep, etp, order)
                  if isinstance(s.placement, Experts) else s.placement)
        for s in layout_for(config)))


@pytest.mark.parametrize("config", MOE, ids=lambda c: c.name)
@pytest.mark.parametrize("t, ep, etp, order", [
    (1, 1, 0, "contiguous"), (2, 1, 0, "contiguous"), (2, 2, 1, "contiguous"),
    (2, 2, 1, "round_robin"), (2, 1, 1, "contiguous"),  # etp 1 at t=2: experts on 2 replicas
])
def test_the_sharded_moe_forward_is_the_reference_under_every_expert_placement(config, t, ep, etp,
                                                                              order):
    if config.n_experts % ep and order == "contiguous":
        pytest.skip("contiguous experts need n_experts % ep == 0")
    p, tokens = init_params(config, 0), make_tokens(config, 1000)
    ref = ReferenceModel(config, p)
    expected = ref(tokens)
    layout = _relaid(config, ep, etp, order)
    placement = next(s.placement for s in layout if isinstance(s.placement, Experts))
    model = ShardedModel(config, split(p, layout, t), InProcessCollective(t), experts=placement,
                         guard=RoutingGuard(ref.routings, 1e-5))
    (logits, *_) = model(tokens)
    torch.testing.assert_close(logits, expected, rtol=0, atol=5e-6)
    for i, own in model.routings.items():  # each rank chose what the reference chose
        for r in own:
            assert torch.equal(r.experts, ref.routings[i].experts)


def test_uneven_experts_linear_and_an_empty_rank_still_give_the_reference():
    c = QWEN2  # 6 experts over ep 4 linear: 2, 2, 1, 1; over ep 8: two ranks hold none
    p, tokens = init_params(c, 0), make_tokens(c, 1000)
    ref = ReferenceModel(c, p)
    expected = ref(tokens)
    for t in (4, 8):
        layout = _relaid(c.replace(n_heads=8, head_dim=8, n_kv_heads=8), t, 1, "linear")
        cfg = c.replace(n_heads=8, head_dim=8, n_kv_heads=8)
        p2 = init_params(cfg, 0)
        ref2 = ReferenceModel(cfg, p2)
        want = ref2(tokens)
        placement = next(s.placement for s in layout if isinstance(s.placement, Experts))
        shards = split(p2, layout, t)
        assert [s["layers.0.experts.down.weight"].shape[1] for s in shards] == (
            [64, 64, 32, 32] if t == 4 else [32] * 6 + [0, 0])
        (logits, *_) = ShardedModel(cfg, shards, InProcessCollective(t), experts=placement)(tokens)
        torch.testing.assert_close(logits, want, rtol=0, atol=5e-6)
    assert expected.shape == want.shape


def test_sequence_parallel_moe_is_the_reference():
    c = QWEN3
    p, tokens = init_params(c, 0), make_tokens(c, 1000)
    expected = ReferenceModel(c, p)(tokens)
    (logits, *_) = ShardedModel(c, split(p, layout_for(c), 2), InProcessCollective(2),
                                sequence_parallel=True)(tokens)
    torch.testing.assert_close(logits, expected, rtol=0, atol=5e-6)


def test_the_guard_keeps_the_references_choice_on_near_ties_only():
    from weight_sync_bench.model.routing import Routing

    ref = Routing(torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.zeros(3, 8),
                  torch.tensor([0.5, 1e-6, 0.2]))
    guard = RoutingGuard({0: ref}, 1e-5)
    own = torch.tensor([[0, 1], [2, 7], [6, 5]])
    assert guard.choice(0, own).tolist() == [[0, 1], [2, 3], [6, 5]]
    assert guard.choice(0, own[1:], torch.tensor([1, 2])).tolist() == [[2, 3], [6, 5]]
    assert guard.near_ties() == (1, 3)


def test_context_parallel_moe_routes_each_chunk_with_the_references_near_ties():
    from weight_sync_bench.collectives.inprocess import InProcessGroups

    c = QWEN3
    p, tokens = init_params(c, 0), make_tokens(c, 1000)
    ref = ReferenceModel(c, p)
    expected = ref(tokens)
    guard = RoutingGuard(ref.routings, float("inf"))  # every token takes the reference's
    shards = split(p, layout_for(c), 2)
    tp = InProcessGroups([[0, 1], [2, 3]])  # CP 2 x TP 2: positions (j, r) -> 2 j + r
    cp = InProcessGroups([[0, 2], [1, 3]])
    model = ShardedModel(c, shards + shards, tp, context=cp, guard=guard)
    logits = model(tokens)
    torch.testing.assert_close(torch.cat([logits[0], logits[2]], dim=1), expected, rtol=0,
                               atol=5e-6)

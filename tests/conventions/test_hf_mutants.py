"""``conventions.hf`` (issue 30, the mutation pass over ``conventions/hf.py``): a Hugging Face
checkpoint's names and tensors, dense and MoE, per expert (v4) and fused (v5), and its
refusals.

HF is where most syncs start and end. A name one character off, experts cut in the wrong
order, a fused tensor of the wrong shape or a bias stored where transformers keeps none would
each send a wrong byte through every converter checked against it. These tests check each
stored tensor's bytes against the canonical parameters, using the maps' row selections
(``conventions.maps``, tested on their own), and pin each refusal's text."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions import hf as H
from weight_sync_bench.conventions.maps import (
    expert_cols,
    expert_rows,
)
from weight_sync_bench.errors import UnsupportedConvention
from weight_sync_bench.model.config import ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for

DENSE = ModelConfig(name="d", vocab=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=4, ffn=24, batch=1, seq_len=4)
QWEN = DENSE.replace(name="q", n_layers=1, n_experts=3, top_k=2, expert_ffn=8, shared_ffn=8,
                     shared_gate=True)
DEEPSEEK = QWEN.replace(name="ds", router="sigmoid", router_bias=True, shared_gate=False)
MIXTRAL = QWEN.replace(name="mx", moe_style="mixtral", shared_ffn=0, shared_gate=False)


def stored(config, at="hf:1", seed=0):
    params = init_params(config, seed)
    return params, materialize(endpoint(at).pieces(config), params)[0]


def test_a_dense_checkpoint_is_every_tensor_under_transformers_names():
    params, got = stored(DENSE.replace(qkv_bias=True, o_bias=True, qk_norm=True))
    q, kv = DENSE.q_rows, DENSE.kv_rows
    for i in range(2):
        m = f"model.layers.{i}."
        qkv, b = params[f"layers.{i}.qkv.weight"], params[f"layers.{i}.qkv.bias"]
        assert torch.equal(got[m + "self_attn.q_proj.weight"], qkv[:q])
        assert torch.equal(got[m + "self_attn.k_proj.weight"], qkv[q:q + kv])
        assert torch.equal(got[m + "self_attn.v_proj.weight"], qkv[q + kv:])
        assert torch.equal(got[m + "self_attn.q_proj.bias"], b[:q])
        assert torch.equal(got[m + "self_attn.k_proj.bias"], b[q:q + kv])
        assert torch.equal(got[m + "self_attn.v_proj.bias"], b[q + kv:])
        assert torch.equal(got[m + "self_attn.o_proj.bias"], params[f"layers.{i}.o_proj.bias"])
        gu = params[f"layers.{i}.gate_up.weight"]
        assert torch.equal(got[m + "mlp.gate_proj.weight"], gu[:DENSE.ffn])
        assert torch.equal(got[m + "mlp.up_proj.weight"], gu[DENSE.ffn:])
        for canonical, name in H.NAMES.items():
            if "{i}" in canonical and canonical.format(i=i) in params:
                assert torch.equal(got[name.format(i=i)], params[canonical.format(i=i)]), name
    assert torch.equal(got["model.embed_tokens.weight"], params["tok_embeddings.weight"])
    assert torch.equal(got["lm_head.weight"], params["lm_head.weight"])
    assert torch.equal(got["model.norm.weight"], params["norm.weight"])
    assert got["model.layers.1.self_attn.q_norm.weight"].shape == (DENSE.head_dim,)
    # per layer: 2 norms, q/k/v weight and bias, o_proj weight and bias, 3 mlp, q/k norms
    assert len(got) == 3 + 2 * 15


def test_every_stored_name_is_transformers_own():
    """The names as transformers' Llama / Qwen2 / Qwen3 modules save them, written out."""
    _, got = stored(DENSE.replace(n_layers=1, qkv_bias=True, o_bias=True, qk_norm=True))
    layer = [f"model.layers.0.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
        "self_attn.o_proj.weight", "self_attn.o_proj.bias",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    assert sorted(got) == sorted(["model.embed_tokens.weight", "model.norm.weight",
                                  "lm_head.weight", *layer])
    assert H.OPTIONS == {"experts": ("per_expert", "fused"),
                         "fp8": ("none", "block128", "tensor")}
    assert H.NAME == "hf" and H.HF.name == "hf"


def test_a_tied_checkpoint_drops_the_tied_copy():
    _, got = stored(DENSE.replace(tie_embeddings=True))
    assert "lm_head.weight" not in got and "model.embed_tokens.weight" in got


def per_expert(config, params, got, block, w):
    gu = params["layers.0.experts.gate_up.weight"]
    down = params["layers.0.experts.down.weight"]
    for e in range(config.n_experts):
        p = f"model.layers.0.{block}.experts.{e}."
        assert torch.equal(got[p + f"{w['gate']}.weight"],
                           gu[expert_rows(config, [e], halves=("gate",))])
        assert torch.equal(got[p + f"{w['up']}.weight"],
                           gu[expert_rows(config, [e], halves=("up",))])
        assert torch.equal(got[p + f"{w['down']}.weight"], down[:, expert_cols(config, [e])])


def test_qwen_moe_stores_one_module_per_expert_and_its_shared_expert():
    params, got = stored(QWEN)
    per_expert(QWEN, params, got, "mlp", {"gate": "gate_proj", "up": "up_proj",
                                          "down": "down_proj"})
    m = "model.layers.0.mlp."
    assert torch.equal(got[m + "gate.weight"], params["layers.0.router.weight"])
    sgu = params["layers.0.shared.gate_up.weight"]
    assert torch.equal(got[m + "shared_expert.gate_proj.weight"], sgu[:8])
    assert torch.equal(got[m + "shared_expert.up_proj.weight"], sgu[8:])
    assert torch.equal(got[m + "shared_expert.down_proj.weight"],
                       params["layers.0.shared.down.weight"])
    assert torch.equal(got[m + "shared_expert_gate.weight"],
                       params["layers.0.shared_gate.weight"])
    assert not any("gate_up_proj" in n or "block_sparse_moe" in n for n in got)


def test_deepseek_stores_the_selection_bias_and_shared_experts_without_a_gate():
    params, got = stored(DEEPSEEK)
    m = "model.layers.0.mlp."
    assert torch.equal(got[m + "gate.e_score_correction_bias"], params["layers.0.router.bias"])
    assert torch.equal(got[m + "shared_experts.gate_proj.weight"],
                       params["layers.0.shared.gate_up.weight"][:8])
    assert torch.equal(got[m + "shared_experts.down_proj.weight"],
                       params["layers.0.shared.down.weight"])
    assert not any("shared_expert_gate" in n or "shared_expert." in n for n in got)


def test_mixtral_keeps_its_block_name_and_w1_w3_w2_per_expert():
    params, got = stored(MIXTRAL)
    per_expert(MIXTRAL, params, got, "block_sparse_moe",
               {"gate": "w1", "up": "w3", "down": "w2"})
    assert torch.equal(got["model.layers.0.block_sparse_moe.gate.weight"],
                       params["layers.0.router.weight"])
    assert not any(".mlp." in n for n in got)


@pytest.mark.parametrize("config", [QWEN, MIXTRAL], ids=["qwen", "mixtral"])
def test_fused_experts_are_one_tensor_each_gate_first_under_mlp(config):
    params, got = stored(config, "hf:experts=fused")
    e = config.n_experts
    gu = params["layers.0.experts.gate_up.weight"]
    down = params["layers.0.experts.down.weight"]
    fused = got["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.shape == (e, 2 * config.expert_ffn, config.d_model)
    for x in range(e):
        assert torch.equal(fused[x], torch.cat([gu[expert_rows(config, [x], halves=("gate",))],
                                                gu[expert_rows(config, [x], halves=("up",))]]))
    fused_down = got["model.layers.0.mlp.experts.down_proj"]
    assert fused_down.shape == (e, config.d_model, config.expert_ffn)
    for x in range(e):
        assert torch.equal(fused_down[x], down[:, expert_cols(config, [x])])
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], params["layers.0.router.weight"])
    assert not any(".experts.0." in n or "block_sparse_moe" in n for n in got)


def test_the_forward_reads_the_plain_layout():
    for config in (DENSE, QWEN):
        forward = H.HF.forward_layout(config, endpoint("hf:1"))
        assert forward.config is config
        assert [(s.name, s.placement) for s in forward.layout] == [
            (s.name, s.placement) for s in layout_for(config)]


def refusal(config, at):
    with pytest.raises(UnsupportedConvention) as exc:
        endpoint(at).pieces(config)
    return str(exc.value)


def test_what_hf_cannot_store_is_refused_naming_the_rule():
    assert refusal(DENSE, "hf:2") == (
        "hf: model.embed_tokens.weight needs t == 1 (a Hugging Face checkpoint is unsharded) "
        "(t=2)")
    assert refusal(DENSE.replace(vocab_multiple=16), "hf:1") == (
        "hf: model.embed_tokens.weight needs an unpadded canonical vocabulary (vocab_multiple "
        "== 1: the convention pads by its own rule) (vocab_multiple=16, t=1)")
    assert refusal(DENSE.replace(bias=True), "hf:1") == (
        "hf: model.layers.0.mlp.down_proj.bias needs no down bias without gate/up biases "
        "(LlamaMLP's mlp_bias biases all three) (bias=True, t=1)")
    assert refusal(QWEN, "hf:ep=2") == (
        "hf: model.layers.0.mlp.experts needs ep == 1 (a Hugging Face checkpoint holds every "
        "expert) (ep=2, etp=0, t=1)")
    assert refusal(QWEN, "hf:etp=1") == (
        "hf: model.layers.0.mlp.experts needs ep == 1 (a Hugging Face checkpoint holds every "
        "expert) (ep=1, etp=1, t=1)")
    assert stored(QWEN, "hf:1")[1]  # the twin: the same geometry, one rank, every expert


@pytest.mark.parametrize("biases", [dict(qkv_bias=True), dict(o_bias=True), dict(bias=False,
                                    qkv_bias=True, o_bias=True)])
def test_a_mixtral_with_attention_biases_is_refused_and_a_qwen_moe_stores_them(biases):
    # MixtralAttention's q/k/v/o_proj have bias=False (transformers 4.57.6)
    config = MIXTRAL.replace(**biases)
    assert refusal(config, "hf:1") == (
        "hf: model.layers.0.self_attn.q_proj.bias needs no attention biases in a Mixtral "
        "(MixtralAttention's have bias=False) (qkv_bias="
        f"{config.qkv_bias}, o_bias={config.o_bias}, bias=False, t=1)")
    assert stored(MIXTRAL, "hf:1")[1]  # twins: no biases, or another block
    assert stored(QWEN.replace(**biases), "hf:1")[1]


def test_fused_experts_of_a_one_expert_model_keep_their_expert_axis():
    """transformers v5's ``gate_up_proj`` is ``[E, 2F, d]`` whatever E, one expert included."""
    one = QWEN.replace(name="one", n_experts=1, top_k=1)
    params, got = stored(one, "hf:experts=fused")
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape == (1, 16, 16)
    assert got["model.layers.0.mlp.experts.down_proj"].shape == (1, 16, 8)
    assert torch.equal(got["model.layers.0.mlp.experts.down_proj"][0],
                       params["layers.0.experts.down.weight"])

"""``ModelConfig.to_hf_config`` (and its ``_moe_hf_config``), pinned exactly: the whole
config.json dict of each family it writes (Llama, Llama with attention_bias, Qwen2, Qwen3,
Mixtral, Qwen2-MoE, Qwen3-MoE), key order included, each refusal's whole message beside a
twin that is accepted, and ``from_hf_config(to_hf_config(c)) == c`` for every accepted one."""

from __future__ import annotations

import json
import re

import pytest

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import (
    SHIPPED_HF_CONFIGS,
    TOY_MOE,
    TOY_MOE_DS,
    ModelConfig,
    hf_config_path,
)
from weight_sync_bench.model.hf_file import read_hf_config

# head_dim 24 is not hidden_size / heads (16): it must be written, not implied.
TINY = ModelConfig(name="tiny", vocab=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                   head_dim=24, ffn=96, rope_theta=500000.0, norm_eps=1e-6)

DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
         "intermediate_size": 96, "num_hidden_layers": 3, "vocab_size": 256,
         "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "attention_bias": False, "hidden_act": "silu"}

MIXTRAL = TINY.replace(n_experts=4, top_k=2, expert_ffn=96, norm_topk=True, moe_style="mixtral")
QWEN2_MOE = TINY.replace(qkv_bias=True, n_experts=8, top_k=4, expert_ffn=32, shared_ffn=48,
                         shared_gate=True, dense_layers=1)
QWEN2_MOE_UNSHARED = TINY.replace(qkv_bias=True, n_experts=8, top_k=2, expert_ffn=32,
                                  norm_topk=True)
QWEN3_MOE = TINY.replace(qk_norm=True, n_experts=8, top_k=2, expert_ffn=32, norm_topk=True,
                         dense_layers=2)

MOE_REFUSED = " has no HF config field of Mixtral, Qwen2-MoE or Qwen3-MoE"
MIXTRAL_REFUSED = ("tiny: a Mixtral with q/k norms, biases, unnormalised top-k, a shared expert, "
                   "dense layers or an expert width other than intermediate_size" + MOE_REFUSED)
SHARED_BESIDE_NORMS = ("tiny: a shared expert beside q/k norms (a Qwen3-MoE has no shared "
                       "expert)" + MOE_REFUSED)
O_BIAS_WITHOUT_NORMS = ("tiny: an o_proj bias without q/k norms (a Qwen2-MoE has none)"
                        + MOE_REFUSED)
NORMS_AND_QKV_BIAS = ("tiny: qk_norm with q/k/v biases and no o_proj bias has no HF config "
                      "(Qwen3's attention_bias biases q, k, v and o_proj)")


def expected(**changes: object) -> list[tuple[str, object]]:
    """DENSE with ``changes`` (existing keys keep their place, new ones go last), as items."""
    return list({**DENSE, **changes}.items())


def refused(config: ModelConfig, message: str) -> None:
    with pytest.raises(InvalidConfig, match="^" + re.escape(message) + "$"):
        config.to_hf_config()


def round_trips(config: ModelConfig) -> None:
    back = ModelConfig.from_hf_config(config.to_hf_config(), name=config.name)
    assert back == config


# ---------------------------------------------------------------- dense: the exact dicts

@pytest.mark.parametrize("config, items", [
    (TINY, expected()),
    (TINY.replace(tie_embeddings=True), expected(tie_word_embeddings=True)),
    # q/k/v and o_proj biases: Llama's attention_bias
    (TINY.replace(qkv_bias=True, o_bias=True), expected(attention_bias=True)),
    # q/k/v biases alone: Qwen2, attention_bias false
    (TINY.replace(qkv_bias=True), expected(architectures=["Qwen2ForCausalLM"],
                                           model_type="qwen2")),
    # q/k norms: Qwen3
    (TINY.replace(qk_norm=True), expected(architectures=["Qwen3ForCausalLM"],
                                          model_type="qwen3")),
    # q/k norms, q/k/v and o_proj biases: Qwen3's attention_bias (Qwen3Attention, 4.57.6)
    (TINY.replace(qk_norm=True, qkv_bias=True, o_bias=True),
     expected(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=True)),
], ids=["llama", "llama_tied", "llama_attention_bias", "qwen2", "qwen3", "qwen3_attention_bias"])
def test_a_dense_geometry_is_written_as_its_familys_exact_config(config, items):
    out = config.to_hf_config()
    assert list(out.items()) == items
    round_trips(config)


def test_the_token_shape_and_the_name_are_not_written():
    out = TINY.replace(batch=5, seq_len=7, name="other").to_hf_config()
    assert out == TINY.to_hf_config()
    assert ModelConfig.from_hf_config(out, name="tiny") == TINY


def test_what_is_written_is_json_and_reads_back_from_a_file(tmp_path):
    for config in (TINY, TINY.replace(qkv_bias=True), TINY.replace(qk_norm=True), MIXTRAL,
                   QWEN2_MOE, QWEN3_MOE):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config.to_hf_config()))
        assert json.loads(path.read_text()) == config.to_hf_config()
        assert ModelConfig.from_hf_config(path, name="tiny") == config


# ---------------------------------------------------------------- dense: the refusals

@pytest.mark.parametrize("changes, message", [
    (dict(bias=True), "tiny: bias=True (a down bias) has no HF config field: HF's mlp_bias "
                      "biases gate and up too"),
    # the bias refusal comes first, whatever else is wrong
    (dict(bias=True, o_bias=True, vocab_multiple=64),
     "tiny: bias=True (a down bias) has no HF config field: HF's mlp_bias biases gate and up "
     "too"),
    (dict(o_bias=True), "tiny: o_bias without qkv_bias has no HF config field (attention_bias "
                        "biases q, k, v and o_proj)"),
    (dict(o_bias=True, vocab_multiple=64),
     "tiny: o_bias without qkv_bias has no HF config field (attention_bias biases q, k, v and "
     "o_proj)"),
    (dict(vocab_multiple=64), "tiny: vocab_multiple=64 has no HF config field (vocab_size is the "
                              "unpadded vocabulary)"),
    (dict(vocab_multiple=2, qkv_bias=True, o_bias=True),
     "tiny: vocab_multiple=2 has no HF config field (vocab_size is the unpadded vocabulary)"),
    (dict(qk_norm=True, qkv_bias=True), NORMS_AND_QKV_BIAS),
    (dict(qk_norm=True, qkv_bias=True, vocab_multiple=1), NORMS_AND_QKV_BIAS),
])
def test_what_hf_cannot_say_of_a_dense_geometry_is_refused_naming_it(changes, message):
    refused(TINY.replace(**changes), message)


@pytest.mark.parametrize("changes", [
    dict(bias=False), dict(o_bias=True, qkv_bias=True), dict(vocab_multiple=1),
    dict(qk_norm=True, qkv_bias=False), dict(qkv_bias=True, o_bias=False),
    dict(qk_norm=True, qkv_bias=True, o_bias=True),
])
def test_each_refusals_twin_is_written_and_reads_back(changes):
    round_trips(TINY.replace(**changes))


# ---------------------------------------------------------------- MoE: the exact dicts

def test_a_mixtral_is_written_as_mixtrals_exact_config():
    assert list(MIXTRAL.to_hf_config().items()) == expected(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_experts_per_tok=2,
        num_local_experts=4)
    round_trips(MIXTRAL)
    tied = MIXTRAL.replace(tie_embeddings=True, rope_theta=1e6)
    assert tied.to_hf_config() == {**MIXTRAL.to_hf_config(), "tie_word_embeddings": True,
                                   "rope_theta": 1e6}
    round_trips(tied)


def test_a_qwen2_moe_is_written_with_its_gated_shared_expert_and_qkv_biases():
    assert list(QWEN2_MOE.to_hf_config().items()) == expected(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts_per_tok=4,
        num_experts=8, moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[0], shared_expert_intermediate_size=48, qkv_bias=True)
    round_trips(QWEN2_MOE)


def test_a_qwen2_moe_without_a_shared_expert_is_still_qwen2_moe_by_its_biases():
    assert list(QWEN2_MOE_UNSHARED.to_hf_config().items()) == expected(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts_per_tok=2,
        num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], shared_expert_intermediate_size=0, qkv_bias=True)
    round_trips(QWEN2_MOE_UNSHARED)


def test_a_qwen2_moe_without_qkv_biases_says_so_in_qkv_bias():
    # Qwen2MoeAttention biases q, k and v by config.qkv_bias (transformers 4.57.6), o_proj never
    for config, shared in ((QWEN2_MOE.replace(qkv_bias=False), 48),
                           (QWEN3_MOE.replace(qk_norm=False), 0)):
        out = config.to_hf_config()
        assert (out["model_type"], out["qkv_bias"], out["attention_bias"]) == (
            "qwen2_moe", False, False)
        assert out["shared_expert_intermediate_size"] == shared
        round_trips(config)


def test_a_qwen3_moe_with_attention_biases_says_so_in_attention_bias():
    # Qwen3MoeAttention biases q, k, v and o_proj by config.attention_bias (4.57.6)
    config = QWEN3_MOE.replace(qkv_bias=True, o_bias=True)
    assert config.to_hf_config() == {**QWEN3_MOE.to_hf_config(), "attention_bias": True}
    round_trips(config)


def test_a_qwen3_moe_is_written_with_its_dense_prefix_and_no_qwen2_fields():
    assert list(QWEN3_MOE.to_hf_config().items()) == expected(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts_per_tok=2,
        num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[0, 1])
    round_trips(QWEN3_MOE)
    assert list(TOY_MOE.to_hf_config().items()) == [
        ("architectures", ["Qwen3MoeForCausalLM"]), ("model_type", "qwen3_moe"),
        ("hidden_size", 256), ("num_attention_heads", 8), ("num_key_value_heads", 4),
        ("head_dim", 32), ("intermediate_size", 704), ("num_hidden_layers", 4),
        ("vocab_size", 32000), ("rope_theta", 10000.0), ("rms_norm_eps", 1e-5),
        ("tie_word_embeddings", False), ("attention_bias", False), ("hidden_act", "silu"),
        ("num_experts_per_tok", 2), ("num_experts", 8), ("moe_intermediate_size", 128),
        ("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", [])]
    round_trips(TOY_MOE)


# ---------------------------------------------------------------- MoE: the refusals

@pytest.mark.parametrize("config, message", [
    (TOY_MOE_DS, "toy_moe_ds: a sigmoid router with selection bias True and 4 groups "
                 "(DeepSeek-V3's routing)" + MOE_REFUSED),
    # each of the three alone
    (QWEN3_MOE.replace(router="sigmoid"),
     "tiny: a sigmoid router with selection bias False and 1 groups (DeepSeek-V3's routing)"
     + MOE_REFUSED),
    (QWEN3_MOE.replace(router="sigmoid", router_bias=True),
     "tiny: a sigmoid router with selection bias True and 1 groups (DeepSeek-V3's routing)"
     + MOE_REFUSED),
    (QWEN3_MOE.replace(n_groups=2),
     "tiny: a softmax router with selection bias False and 2 groups (DeepSeek-V3's routing)"
     + MOE_REFUSED),
    (QWEN3_MOE.replace(n_groups=4, topk_groups=2),
     "tiny: a softmax router with selection bias False and 4 groups (DeepSeek-V3's routing)"
     + MOE_REFUSED),
    (QWEN2_MOE.replace(shared_gate=False), "tiny: an ungated shared expert (DeepSeek's)"
                                           + MOE_REFUSED),
    (QWEN3_MOE.replace(shared_ffn=16), "tiny: an ungated shared expert (DeepSeek's)"
                                       + MOE_REFUSED),
    # a Mixtral: each thing it cannot say alone
    (MIXTRAL.replace(qk_norm=True), MIXTRAL_REFUSED),
    (MIXTRAL.replace(qkv_bias=True), MIXTRAL_REFUSED),
    (MIXTRAL.replace(qkv_bias=True, o_bias=True), MIXTRAL_REFUSED),
    (MIXTRAL.replace(norm_topk=False), MIXTRAL_REFUSED),
    (MIXTRAL.replace(shared_ffn=16, shared_gate=True), MIXTRAL_REFUSED),
    (MIXTRAL.replace(dense_layers=1), MIXTRAL_REFUSED),
    (MIXTRAL.replace(expert_ffn=48), MIXTRAL_REFUSED),
    # q/k norms (Qwen3-MoE) with a shared expert (Qwen2-MoE's), biased or not
    (QWEN2_MOE.replace(qk_norm=True, qkv_bias=False), SHARED_BESIDE_NORMS),
    (QWEN2_MOE.replace(qk_norm=True, o_bias=True), SHARED_BESIDE_NORMS),
    (QWEN3_MOE.replace(shared_ffn=1, shared_gate=True), SHARED_BESIDE_NORMS),
    # q/k norms with q/k/v biases and no o_proj bias: the dense refusal, before the MoE ones
    (QWEN2_MOE.replace(qk_norm=True), NORMS_AND_QKV_BIAS),
    (QWEN2_MOE_UNSHARED.replace(qk_norm=True), NORMS_AND_QKV_BIAS),
    (QWEN3_MOE.replace(qkv_bias=True), NORMS_AND_QKV_BIAS),
    # an o_proj bias without q/k norms (Qwen2-MoE has none), with a shared expert or not
    (QWEN2_MOE.replace(o_bias=True), O_BIAS_WITHOUT_NORMS),
    (QWEN2_MOE_UNSHARED.replace(o_bias=True), O_BIAS_WITHOUT_NORMS),
])
def test_what_no_hf_moe_config_can_say_is_refused_naming_it(config, message):
    refused(config, message)


@pytest.mark.parametrize("config", [
    MIXTRAL, MIXTRAL.replace(dense_layers=0, expert_ffn=96, norm_topk=True),
    QWEN2_MOE, QWEN2_MOE_UNSHARED, QWEN3_MOE,
    QWEN3_MOE.replace(n_groups=1, router="softmax"),
    QWEN2_MOE.replace(shared_ffn=1), QWEN2_MOE.replace(norm_topk=True, dense_layers=3),
    QWEN3_MOE.replace(norm_topk=False, dense_layers=0, tie_embeddings=True),
    QWEN3_MOE.replace(top_k=8, n_kv_heads=4),
    QWEN2_MOE.replace(qkv_bias=False), QWEN3_MOE.replace(qk_norm=False),
    QWEN3_MOE.replace(qkv_bias=True, o_bias=True),
])
def test_each_moe_refusals_twin_is_written_and_reads_back(config):
    round_trips(config)


def test_a_dense_refusal_comes_before_a_moe_one():
    refused(TOY_MOE_DS.replace(bias=True), "toy_moe_ds: bias=True (a down bias) has no HF "
                                           "config field: HF's mlp_bias biases gate and up too")
    refused(QWEN2_MOE.replace(vocab_multiple=8), "tiny: vocab_multiple=8 has no HF config field "
                                                 "(vocab_size is the unpadded vocabulary)")


# ---------------------------------------------------------------- the shipped configs

@pytest.mark.parametrize("name", sorted(SHIPPED_HF_CONFIGS))
def test_a_shipped_config_is_written_back_with_the_files_own_values(name):
    """Every field written that the Hub's file has holds the file's value (Mistral's
    architecture and model type aside: it is written as the Llama it is)."""
    raw = read_hf_config(hf_config_path(name))
    config = ModelConfig.from_hf_config(hf_config_path(name))
    out = config.to_hf_config()
    differ = {k for k in out if k in raw and out[k] != raw[k]}
    assert differ == ({"architectures", "model_type"} if name.startswith("mistral") else set())
    assert ModelConfig.from_hf_config(out, name=config.name) == config

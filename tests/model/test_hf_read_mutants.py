"""Reading a Hugging Face ``config.json`` into a geometry (the mutation pass over
``ModelConfig.from_hf_config``, ``_moe_fields`` and the shipped-config lookup): each field's
default where the file leaves it out, each refusal's whole message, the Qwen2 and
Qwen2-MoE bias rules, the MoE layer pattern, and the shipped configs by name and shrunk.
"""

from __future__ import annotations

import json

import pytest

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import (
    MAX_HF_SIZE,
    SHIPPED_HF_CONFIGS,
    ModelConfig,
    hf_config_file,
    hf_config_path,
    shipped_hf_config,
)

LLAMA = {"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 24, "num_hidden_layers": 2, "vocab_size": 40}
QWEN3_MOE = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8}
QWEN2_MOE = {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 0}


def read(data, **kwargs):
    return ModelConfig.from_hf_config(data, **kwargs)


def refusal(data, **kwargs):
    with pytest.raises(InvalidConfig) as e:
        read(data, **kwargs)
    return str(e.value)


def test_what_a_file_leaves_out_takes_the_llama_defaults():
    c = read(LLAMA)
    assert c.name == "hf" and c.head_dim == 8 and c.rope_theta == 10000.0
    assert c.norm_eps == 1e-6 and c.tie_embeddings is False
    assert (c.qkv_bias, c.o_bias, c.qk_norm, c.n_experts) == (False, False, False, 0)
    assert read({**LLAMA, "tie_word_embeddings": True}).tie_embeddings is True


def test_a_size_may_be_the_largest_int_and_no_larger():
    assert read({**LLAMA, "num_hidden_layers": MAX_HF_SIZE}, n_layers=2).n_layers == 2
    assert refusal({**LLAMA, "num_hidden_layers": MAX_HF_SIZE + 1}, n_layers=2) == (
        f"hf: HF config field 'num_hidden_layers' is {MAX_HF_SIZE + 1}, expected an int in "
        f"1..{MAX_HF_SIZE} (2^31-1)")


@pytest.mark.parametrize("changes, message", [
    ({"rope_theta": 0}, "hf: HF config field 'rope_theta' is 0, expected a finite number > 0"),
    ({"rope_theta": "1e4"}, "hf: HF config field 'rope_theta' is '1e4', expected "
                            "(<class 'int'>, <class 'float'>)"),
    ({"mlp_bias": True}, "hf: HF config field 'mlp_bias' is true: the harness block has no "
                         "gate_up bias, so gate/up/down biases are not modelled"),
    ({"hidden_act": "gelu"}, "hf: HF config field 'hidden_act' is 'gelu': the harness block "
                             "is SwiGLU (silu)"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4},
     "hf: HF config fields 'num_attention_heads' and 'num_key_value_heads': GQA needs "
     "num_attention_heads % num_key_value_heads == 0 (num_attention_heads=4, "
     "num_key_value_heads=3)"),
    ({"head_dim": 7}, "hf: HF config field 'head_dim' is 7: RoPE rotates pairs, so it must "
                      "be even"),
    ({"hidden_size": 14}, "hf: HF config field 'head_dim' is 7 (hidden_size / "
                          "num_attention_heads): RoPE rotates pairs, so it must be even"),
])
def test_each_refusal_names_the_field_and_why(changes, message):
    assert refusal({**LLAMA, **changes}) == message


def test_a_qwen2_is_known_by_its_architecture_or_its_model_type_and_has_qkv_biases():
    for qwen2 in ({**LLAMA, "architectures": ["Qwen2ForCausalLM"]},
                  {**LLAMA, "model_type": "qwen2"}):
        c = read(qwen2)
        assert (c.qkv_bias, c.o_bias) == (True, False)
    plain = read({**LLAMA, "architectures": ["LlamaForCausalLM"]})
    assert (plain.qkv_bias, plain.o_bias) == (False, False)  # twin
    both = read({**LLAMA, "attention_bias": True})
    assert (both.qkv_bias, both.o_bias) == (True, True)


def test_a_qwen2_moe_has_qkv_biases_unless_its_file_says_not_and_never_an_o_bias():
    c = read({**QWEN2_MOE, "attention_bias": True})
    assert (c.qkv_bias, c.o_bias) == (True, False)
    assert read({**QWEN2_MOE, "qkv_bias": False}).qkv_bias is False
    assert read(QWEN2_MOE).qkv_bias is True
    # Qwen2MoeAttention reads qkv_bias, never attention_bias (transformers 4.57.6)
    c = read({**QWEN2_MOE, "qkv_bias": False, "attention_bias": True})
    assert (c.qkv_bias, c.o_bias) == (False, False)


ATTENTION_BIAS_NOTE = "hf: attention_bias true is not read: HF's {} attention does not read it"


@pytest.mark.parametrize("model_type, biases", [
    ("llama", (True, True)), ("qwen3", (True, True)), ("qwen3_moe", (True, True)),
    ("mistral", (False, False)), ("mixtral", (False, False)), ("qwen2", (True, False)),
    ("qwen2_moe", (True, False)),
])
def test_attention_bias_is_read_only_where_hfs_attention_reads_it(model_type, biases):
    # transformers 4.57.6: LlamaAttention, Qwen3Attention and Qwen3MoeAttention bias q, k,
    # v and o_proj by attention_bias; MistralAttention and MixtralAttention have no biases;
    # Qwen2Attention always biases q, k and v, Qwen2MoeAttention by qkv_bias
    data = {**QWEN2_MOE, "num_local_experts": 4, "model_type": model_type}
    c = read({**data, "attention_bias": True})
    assert (c.qkv_bias, c.o_bias) == biases
    reads = model_type in ("llama", "qwen3", "qwen3_moe")
    assert c.notes == (() if reads else (ATTENTION_BIAS_NOTE.format(model_type),))
    twin = read({**data, "attention_bias": False})
    assert twin.notes == () and twin.o_bias is False
    assert twin.qkv_bias is (model_type in ("qwen2", "qwen2_moe"))


def test_a_sliding_window_is_noted_unless_the_file_turns_it_off():
    assert read({**LLAMA, "sliding_window": 4096}).notes == (
        "hf: sliding_window 4096 is not modelled; a check's tokens lie within it, so "
        "attention is unchanged",)
    assert read({**LLAMA, "sliding_window": 4096, "use_sliding_window": False}).notes == ()


def test_an_moe_reads_its_experts_and_defaults():
    c = read(QWEN3_MOE)
    assert (c.n_experts, c.top_k, c.expert_ffn, c.norm_topk) == (4, 2, 8, False)
    assert (c.shared_ffn, c.shared_gate, c.dense_layers, c.qk_norm) == (0, False, 0, True)
    assert read({**QWEN3_MOE, "num_experts_per_tok": 4}).top_k == 4  # every expert
    assert read({**QWEN3_MOE, "norm_topk_prob": True}).norm_topk is True
    # only Qwen2-MoE has a shared expert: Qwen3-MoE's field is not read
    assert read({**QWEN3_MOE, "shared_expert_intermediate_size": 8}).shared_ffn == 0


@pytest.mark.parametrize("size, gated", [(0, False), (1, True), (8, True)])
def test_a_qwen2_moe_shared_expert_is_gated_whenever_it_has_a_width(size, gated):
    c = read({**QWEN2_MOE, "shared_expert_intermediate_size": size})
    assert (c.shared_ffn, c.shared_gate) == (size, gated)


def test_a_qwen2_moe_must_give_its_shared_experts_width():
    # Qwen2MoeConfig's default is 5632 (transformers 4.57.6), not no shared expert
    data = {k: v for k, v in QWEN2_MOE.items() if k != "shared_expert_intermediate_size"}
    assert refusal(data) == "hf: HF config has no 'shared_expert_intermediate_size'"


@pytest.mark.parametrize("changes, message", [
    ({"num_experts_per_tok": 5}, "hf: HF config field 'num_experts_per_tok' is 5: a token "
                                 "chooses at most every expert (num_experts=4)"),
    ({"mlp_only_layers": [0, -1]}, "hf: HF config field 'mlp_only_layers' is [0, -1], "
                                   "expected a list of layer indices (ints >= 0)"),
    ({"mlp_only_layers": [1]}, "hf: HF config fields 'decoder_sparse_step' 1 and "
                               "'mlp_only_layers' [1]: the harness models every layer sparse "
                               "but a first few (decoder_sparse_step 1, mlp_only_layers 0..k-1)"),
])
def test_each_moe_refusal_names_the_field_and_why(changes, message):
    assert refusal({**QWEN3_MOE, **changes}) == message


def test_a_first_few_dense_layers_are_read():
    assert read({**QWEN3_MOE, "mlp_only_layers": [0]}).dense_layers == 1


def test_a_shipped_config_is_found_by_name_and_an_unknown_one_is_named():
    assert hf_config_path("llama3_8b").name == "llama3_8b.json"
    assert hf_config_file("llama3_8b") == hf_config_path("llama3_8b")
    with pytest.raises(InvalidConfig) as e:
        hf_config_path("nope")
    assert str(e.value) == ("unknown shipped HF config 'nope'; known: "
                            + ", ".join(SHIPPED_HF_CONFIGS))


def test_a_shipped_moe_config_shrinks_its_expert_and_shared_widths_and_keeps_its_name():
    name = next(n for n in SHIPPED_HF_CONFIGS
                if "shared_expert_intermediate_size"
                in json.loads(hf_config_path(n).read_text()))
    data = json.loads(hf_config_path(name).read_text())
    c = shipped_hf_config(name, shrink=8, n_layers=1)
    assert c.name == name
    assert c.expert_ffn == data["moe_intermediate_size"] // 8
    assert c.shared_ffn == data["shared_expert_intermediate_size"] // 8


def test_a_shipped_config_is_read_at_its_full_width_unless_shrunk():
    data = json.loads(hf_config_path("llama3_8b").read_text())
    c = shipped_hf_config("llama3_8b", n_layers=1, vocab=64)
    assert (c.d_model, c.ffn, c.n_layers, c.vocab) == (data["hidden_size"],
                                                       data["intermediate_size"], 1, 64)

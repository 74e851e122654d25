import re

import pytest
import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import (
    HF_CONFIGS,
    TOY,
    TOY_KV4,
    ModelConfig,
    hf_config_path,
    init_params,
    make_tokens,
    shipped_hf_config,
)


def test_toy_has_the_specified_parameter_count():
    assert TOY.n_params == 19_204_352
    assert sum(t.numel() for t in init_params(TOY, 0).values()) == 19_204_352


def test_toy_kv4_differs_from_toy_only_in_kv_heads():
    assert TOY_KV4.replace(name="toy", n_kv_heads=2) == TOY
    assert TOY_KV4.qkv_rows == (8 + 2 * 4) * 32  # 512


def test_fused_row_counts_follow_the_seed_diagram():
    assert (TOY.q_rows, TOY.kv_rows, TOY.qkv_rows) == (256, 64, 384)
    assert TOY.param_shapes()["layers.0.gate_up.weight"] == (1408, 256)


def test_params_are_a_deterministic_function_of_the_seed():
    a, b, c = init_params(TOY_KV4, 3), init_params(TOY_KV4, 3), init_params(TOY_KV4, 4)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.qkv.weight"], c["layers.0.qkv.weight"])
    assert torch.equal(make_tokens(TOY, 7), make_tokens(TOY, 7))


def test_init_looks_like_a_trained_checkpoint():
    params = init_params(TOY, 0)
    # small-std weights: the layers' contribution to the logits is not drowned by the embedding
    assert 0.015 < params["layers.0.qkv.weight"].std() < 0.025
    assert 0.015 < params["tok_embeddings.weight"].std() < 0.025
    # norms near one but not all equal, so a permuted norm weight changes the output
    norm = params["layers.0.attn_norm.weight"]
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.05


@pytest.mark.parametrize("changes, message", [
    ({"n_heads": 6, "n_kv_heads": 4}, "GQA needs n_heads % n_kv_heads == 0 (n_heads=6, n_kv_heads=4)"),
    ({"head_dim": 7}, "RoPE needs an even head_dim (head_dim=7)"),
    ({"vocab": 0}, "vocab must be a positive int, got 0"),
])
def test_invalid_geometry_is_rejected_with_the_rule(changes, message):
    with pytest.raises(InvalidConfig, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{**TOY.__dict__, **changes})


# The shipped config.json values (research notes conventions.md section 3.1).
SHIPPED = {
    # name: (d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn, vocab, rope_theta, eps)
    "llama3_8b": (4096, 32, 32, 8, 128, 14336, 128256, 500000.0, 1e-5),
    "qwen2_5_7b": (3584, 28, 28, 4, 128, 18944, 152064, 1000000.0, 1e-6),
    "mistral_7b": (4096, 32, 32, 8, 128, 14336, 32000, 10000.0, 1e-5),
    "mistral_nemo": (5120, 40, 32, 8, 128, 14336, 131072, 1000000.0, 1e-5),  # hd != 5120/32
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_a_shipped_hf_config_reads_as_the_models_geometry(name):
    c = ModelConfig.from_hf_config(hf_config_path(name))
    assert c.name == name
    assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab,
            c.rope_theta, c.norm_eps) == SHIPPED[name]
    assert not c.tie_embeddings and not c.bias and not c.o_bias
    assert c.qkv_bias == (name == "qwen2_5_7b")  # Qwen2Attention: q, k, v biases, no o_proj


def test_a_reduced_copy_keeps_head_counts_and_the_head_dim_ratio():
    nemo = shipped_hf_config("mistral_nemo", shrink=16, n_layers=1, vocab=512)
    assert (nemo.d_model, nemo.head_dim, nemo.n_heads, nemo.n_kv_heads, nemo.ffn) == (
        320, 8, 32, 8, 896)
    assert (nemo.n_layers, nemo.vocab) == (1, 512)
    with pytest.raises(InvalidConfig, match="hidden_size=3584 is not divisible by shrink=5"):
        shipped_hf_config("qwen2_5_7b", shrink=5)


LLAMA = {"hidden_size": 64, "num_attention_heads": 8, "intermediate_size": 96,
         "num_hidden_layers": 2, "vocab_size": 100}


def test_from_hf_config_defaults_kv_heads_head_dim_and_reads_attention_bias():
    c = ModelConfig.from_hf_config(LLAMA, name="tiny")
    assert (c.n_kv_heads, c.head_dim, c.rope_theta, c.norm_eps) == (8, 8, 10000.0, 1e-6)
    # HF Llama's attention_bias biases q, k, v and o_proj
    biased = ModelConfig.from_hf_config({**LLAMA, "attention_bias": True, "head_dim": 16,
                                         "num_key_value_heads": 2}, n_layers=1, vocab=50)
    assert (biased.qkv_bias, biased.o_bias, biased.bias) == (True, True, False)
    assert (biased.head_dim, biased.n_kv_heads, biased.n_layers, biased.vocab) == (16, 2, 1, 50)
    shapes = biased.param_shapes()
    assert "layers.0.qkv.bias" in shapes and "layers.0.o_proj.bias" in shapes
    assert "layers.0.down.bias" not in shapes


@pytest.mark.parametrize("changes, message", [
    # the harness block has no gate_up bias: mlp_bias is not modelled
    ({"mlp_bias": True}, "tiny: HF config field 'mlp_bias' is true"),
    ({"hidden_act": "gelu"}, "tiny: HF config field 'hidden_act' is 'gelu'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "tiny: HF config field 'rope_scaling'"),
    ({"hidden_size": None}, "tiny: HF config has no 'hidden_size'"),
    ({"num_attention_heads": "8"}, "tiny: HF config field 'num_attention_heads' is '8', expected int"),
    # 60 / 8 is not a head_dim, and none is given
    ({"hidden_size": 60}, ("tiny: HF config has no 'head_dim' and hidden_size % "
                          "num_attention_heads != 0 (hidden_size=60, num_attention_heads=8)")),
])
def test_what_the_block_cannot_model_is_rejected_naming_the_field(changes, message):
    with pytest.raises(InvalidConfig, match="^" + re.escape(message)):
        ModelConfig.from_hf_config({**LLAMA, **changes}, name="tiny")


def test_a_missing_or_malformed_file_is_named(tmp_path):
    with pytest.raises(InvalidConfig, match="no such HF config.json"):
        ModelConfig.from_hf_config(tmp_path / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{")
    with pytest.raises(InvalidConfig, match="config.json: not valid JSON"):
        ModelConfig.from_hf_config(bad)


def test_split_biases_appear_in_the_geometry_only_when_set():
    assert "qkv_bias" not in TOY.geometry() and "o_bias" not in TOY.geometry()
    assert TOY.replace(qkv_bias=True).geometry()["qkv_bias"] == 1
    both = TOY.replace(bias=True)  # bias=True still means all three
    assert (both.has_qkv_bias, both.has_o_bias, both.has_down_bias) == (True, True, True)
    assert both.geometry() == {**TOY.geometry(), "bias": 1}


def test_init_params_hands_out_a_copy_of_the_draw_it_keeps():
    """``init_params`` keeps a draw of TOY's width: what a caller gets is its own (writing
    into it changes no later call), and equal bit for bit to a fresh draw (``iter_params``)."""
    from weight_sync_bench.model.config import clear_kept_params, iter_params

    clear_kept_params()
    first = init_params(TOY, 5)
    fresh = dict(iter_params(TOY, 5))
    for x in first.values():
        x.fill_(float("nan"))  # the caller's to write
    again = init_params(TOY, 5)
    assert again.keys() == fresh.keys()
    assert all(torch.equal(again[n], fresh[n]) for n in fresh)
    assert all(again[n].data_ptr() != first[n].data_ptr() for n in fresh)
    # the twin: another seed is another draw (the key is not the config alone)
    assert not torch.equal(init_params(TOY, 6)["tok_embeddings.weight"],
                           fresh["tok_embeddings.weight"])


def test_init_params_keeps_at_most_its_budget_oldest_out_first(monkeypatch):
    """The kept draws never exceed ``_KEPT_BYTES``: the least recently asked goes first, and
    what is dropped is drawn again, the same bits."""
    from weight_sync_bench.model import config as model_config

    # TOY at a vocabulary of 512 and one layer (1/20 of its bytes): the budget scaled to it
    small = TOY.replace(vocab=512, n_layers=1)
    one = small.n_params * 4
    monkeypatch.setattr(model_config, "_KEPT_BYTES", 3 * one)  # a draw of a third: kept
    model_config.clear_kept_params()
    first = init_params(small, 1)
    for seed in (2, 3, 4):  # the fourth is over the budget: seed 1, the oldest, is dropped
        init_params(small, seed)
    key = (small, 0, model_config.DEFAULT_INIT, torch.float32)
    assert list(model_config._kept) == [key[:1] + (s,) + key[2:] for s in (2, 3, 4)]
    assert sum(model_config._kept_bytes.values()) == 3 * one
    init_params(small, 2)  # asked again: now the most recent, seed 3 goes next
    init_params(small, 1)
    assert [k[1] for k in model_config._kept] == [4, 2, 1]
    again = init_params(small, 1)
    assert all(torch.equal(again[n], first[n]) for n in first)
    model_config.clear_kept_params()

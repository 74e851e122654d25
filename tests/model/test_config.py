import pytest
import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import (
    TOY,
    TOY_KV4,
    ModelConfig,
    init_params,
    make_tokens,
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

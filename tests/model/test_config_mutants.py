"""The geometry's own rules and the draws every check starts from (the mutation pass over
``model/config.py``, outside its Hugging Face reading and writing): a config's refusals by
message and at their boundaries, the synced dtypes by name, the built-ins by name, each
kind of parameter's draw from the seed, the tokens, and the geometry a floor records.
"""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import (
    CONFIGS,
    MOE_CONFIGS,
    TOY_MOE,
    Init,
    config_by_name,
    draw_param,
    dtype_name,
    init_params,
    iter_params,
    make_tokens,
    parse_dtype,
)
from weight_sync_bench.training.floor import SMALL  # 2 layers, d_model 32

MOE = SMALL.replace(name="moe", n_experts=4, top_k=2, expert_ffn=8)
KNOWN = "known: fp32, bf16, fp16"


@pytest.mark.parametrize("text, dtype", [
    ("bf16", torch.bfloat16), ("BF16", torch.bfloat16), ("bfloat16", torch.bfloat16),
    ("torch.bfloat16", torch.bfloat16), ("fp32", torch.float32), ("float32", torch.float32),
    ("half", torch.float16), ("Float16", torch.float16), (torch.float16, torch.float16)])
def test_a_synced_dtype_is_read_by_any_of_its_names(text, dtype):
    assert parse_dtype(text) is dtype


@pytest.mark.parametrize("value", ["int8", "torch.float8_e4m3fn", "float64", torch.float64,
                                   torch.int8, 3])
def test_another_dtype_is_refused_naming_the_known_ones(value):
    with pytest.raises(InvalidConfig) as e:
        parse_dtype(value)
    assert str(e.value) == f"dtype {value!r} is not a synced weight dtype; {KNOWN}"


def test_a_dtype_is_named_by_its_short_name_and_another_is_refused():
    assert [dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [
        "fp32", "bf16", "fp16"]
    with pytest.raises(InvalidConfig) as e:
        dtype_name(torch.int8)
    assert str(e.value) == f"dtype torch.int8 is not a synced weight dtype; {KNOWN}"


def test_a_built_in_is_found_by_name_dense_or_moe_and_an_unknown_one_is_named():
    assert config_by_name("toy") is CONFIGS["toy"]
    assert config_by_name("toy_moe") is MOE_CONFIGS["toy_moe"]
    with pytest.raises(InvalidConfig) as e:
        config_by_name("nope")
    assert str(e.value) == "unknown config 'nope'; known: toy, toy_kv4, toy_moe, toy_moe_ds"


def _gen(seed=7):
    return torch.Generator().manual_seed(seed)


def test_each_kind_of_parameter_is_its_own_scaled_draw_from_the_generator():
    init = Init(std=0.03, norm_spread=0.2, gate_scale=2.0, selection_bias=0.3)
    shape = (3, 5)  # not square: the gates scale by the input width, shape[-1]
    plain = torch.randn(shape, generator=_gen())
    cases = {"layers.0.attn_norm.weight": 1.0 + 0.2 * plain,
             "layers.0.router.weight": plain * (2.0 / 5 ** 0.5),
             "layers.0.shared_gate.weight": plain * (2.0 / 5 ** 0.5),
             "layers.0.router.bias": plain * 0.3,
             "layers.0.qkv.weight": plain * 0.03}
    for name, want in cases.items():
        got = draw_param(name, shape, _gen(), init)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_narrow_dtype_is_the_fp32_draw_rounded(dtype):
    fp32 = draw_param("layers.0.qkv.weight", (4, 6), _gen())
    got = draw_param("layers.0.qkv.weight", (4, 6), _gen(), dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, fp32.to(dtype))


def test_iter_params_and_init_params_draw_in_the_dtype_asked_for():
    fp32 = dict(iter_params(SMALL, 3))
    for drawn in (dict(iter_params(SMALL, 3, dtype=torch.bfloat16)),
                  init_params(SMALL, 3, dtype=torch.bfloat16)):
        assert list(drawn) == list(SMALL.param_shapes())
        assert all(x.dtype == torch.bfloat16 and torch.equal(x, fp32[n].to(torch.bfloat16))
                   for n, x in drawn.items())


def test_the_tokens_are_uniform_ids_from_zero_drawn_from_the_seed():
    config = SMALL.replace(vocab=3, batch=4, seq_len=50)
    tokens = make_tokens(config, 5)
    assert tokens.shape == (4, 50) and tokens.dtype == torch.int64
    assert torch.equal(tokens, torch.randint(0, 3, (4, 50), generator=_gen(5)))
    assert set(tokens.unique().tolist()) == {0, 1, 2}  # id 0 is drawn too


@pytest.mark.parametrize("field", ["vocab", "d_model", "n_layers", "head_dim", "ffn"])
@pytest.mark.parametrize("value", [0, 16.0, True])
def test_a_size_must_be_a_positive_int(field, value):
    with pytest.raises(InvalidConfig) as e:
        SMALL.replace(**{field: value})
    assert str(e.value) == f"small: {field} must be a positive int, got {value!r}"


@pytest.mark.parametrize("field", ["n_experts", "top_k", "expert_ffn", "shared_ffn",
                                   "dense_layers"])
@pytest.mark.parametrize("value", [-1, 2.0, True])
def test_an_moe_count_must_be_a_non_negative_int(field, value):
    with pytest.raises(InvalidConfig) as e:
        MOE.replace(**{field: value})
    assert str(e.value) == f"moe: {field} must be a non-negative int, got {value!r}"


@pytest.mark.parametrize("field", ["tie_embeddings", "qkv_bias", "norm_topk", "shared_gate"])
def test_a_switch_must_be_a_bool(field):
    with pytest.raises(InvalidConfig) as e:
        SMALL.replace(**{field: 1})
    assert str(e.value) == f"small: {field} must be a bool, got 1"


def test_a_dense_config_with_an_moe_field_is_refused_by_name():
    with pytest.raises(InvalidConfig) as e:
        SMALL.replace(top_k=2, expert_ffn=8)
    assert str(e.value) == ("small: top_k=2, expert_ffn=8 without experts (n_experts=0): MoE "
                            "fields need n_experts >= 1")


@pytest.mark.parametrize("changes, rule", [
    ({"top_k": 0}, "1 <= top_k <= n_experts (top_k=0, n_experts=4)"),
    ({"top_k": 5}, "1 <= top_k <= n_experts (top_k=5, n_experts=4)"),
    ({"expert_ffn": 0}, "expert_ffn >= 1 (expert_ffn=0)"),
    ({"router_bias": True},
     "router_bias only with router='sigmoid' (DeepSeek-V3's e_score_correction_bias)"),
    ({"n_groups": 4, "top_k": 1},
     "at least 2 experts per group (a group scores by its top 2: n_experts=4, n_groups=4)"),
    ({"n_groups": 2, "top_k": 3},
     "top_k <= topk_groups * n_experts / n_groups (top_k=3, topk_groups=1, n_experts=4, "
     "n_groups=2)"),
    ({"shared_gate": True}, "shared_gate needs a shared expert (shared_ffn >= 1)"),
    ({"dense_layers": 3}, "dense_layers <= n_layers (dense_layers=3, n_layers=2)"),
])
def test_each_moe_rule_is_refused_by_name(changes, rule):
    with pytest.raises(InvalidConfig) as e:
        MOE.replace(**changes)
    assert str(e.value) == f"moe: MoE needs {rule}"


@pytest.mark.parametrize("changes", [
    {"top_k": 1}, {"top_k": 4}, {"expert_ffn": 1}, {"n_experts": 1, "top_k": 1},
    {"n_groups": 2, "top_k": 2}, {"shared_ffn": 1, "shared_gate": True},
    {"dense_layers": 2}, {"router": "sigmoid", "router_bias": True}])
def test_the_twins_each_rule_at_its_boundary_is_accepted(changes):
    config = MOE.replace(**changes)
    assert all(getattr(config, k) == v for k, v in changes.items())


def test_a_single_expert_is_an_moe_layer_and_dense_layers_come_first():
    one = MOE.replace(n_experts=1, top_k=1, dense_layers=1)
    assert [one.is_moe_layer(i) for i in range(2)] == [False, True]
    assert not SMALL.is_moe_layer(1)


def test_a_down_bias_is_a_parameter_of_every_layer():
    biased = SMALL.replace(bias=True)
    shapes = biased.param_shapes()
    assert [n for n in shapes if n.endswith("down.bias")] == ["layers.0.down.bias",
                                                              "layers.1.down.bias"]
    assert shapes["layers.1.down.bias"] == (32,)
    assert biased.suffixes_of(0)[-1] == "down.bias"
    assert "down.bias" not in SMALL.suffixes_of(0)  # twin: none without it


def test_an_moe_geometry_records_every_moe_field_bools_as_ints():
    g = TOY_MOE.replace(norm_topk=True).geometry()
    assert g["norm_topk"] == 1 and type(g["norm_topk"]) is int
    assert g["router_bias"] == 0 and type(g["router_bias"]) is int
    assert g["router"] == "softmax" and g["n_experts"] == 8
    assert "name" not in g

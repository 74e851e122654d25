"""``model.footprint`` pinned to its documented closed form, term by term: the parameters,
activations, flops, tensors and bytes of dense and MoE geometries (dense prefix, shared
expert, one expert chosen of several), whole and streamed per layer or parameter; the
refusal's text for each limit and unit; the field named. ``test_footprint.py`` holds the
claims (an upper estimate, a streamed check holds less); this file holds the arithmetic."""

from __future__ import annotations

import math

import pytest

from weight_sync_bench.errors import GeometryTooLarge
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.footprint import (
    COPIES,
    GIB,
    Footprint,
    Limits,
    driving_field,
    footprint,
    require_fits,
)

# every size distinct, so that a size read for another shows: q_rows 12 (3 heads x 4),
# qkv_rows 20 (one KV head), padded vocab 40 (37 to a multiple of 8)
DENSE = ModelConfig(name="dense", vocab=37, vocab_multiple=8, d_model=10, n_layers=3,
                    n_heads=3, n_kv_heads=1, head_dim=4, ffn=14, batch=2, seq_len=5)
# two dense layers of five, six experts of width 6 (top 2), a shared expert of 7
MOE = DENSE.replace(name="moe", n_layers=5, n_experts=6, top_k=2, expert_ffn=6, shared_ffn=7,
                    shared_gate=True, dense_layers=2)
ALL_MOE = MOE.replace(name="all_moe", dense_layers=0)
# experts declared, every layer dense: no MoE term anywhere
MOE_ALL_DENSE = MOE.replace(name="moe_all_dense", dense_layers=5)
# every layer MoE, a dense width larger than the experts': no dense term anywhere
WIDE_FFN_MOE = ALL_MOE.replace(name="wide_ffn_moe", ffn=100)
# the largest parameter the fused qkv (96 x 10), or the shared expert's gate_up (100 x 10)
WIDE_QKV = DENSE.replace(name="wide_qkv", vocab=8, vocab_multiple=1, n_heads=8, n_kv_heads=8)
WIDE_SHARED = MOE.replace(name="wide_shared", shared_ffn=50)
CONFIGS = [DENSE, MOE, ALL_MOE, MOE_ALL_DENSE, WIDE_FFN_MOE, WIDE_QKV, WIDE_SHARED]


def closed_form(c: ModelConfig, unit: str = "model") -> Footprint:
    """``footprint``'s docstring, written out again."""
    V, d, L, B, T, H = c.padded_vocab, c.d_model, c.n_layers, c.batch, c.seq_len, c.n_heads
    qkv, q, E, k, fe, fs = c.qkv_rows, c.q_rows, c.n_experts, c.top_k, c.expert_ffn, c.shared_ffn
    L_m = L - c.dense_layers if E else 0
    L_d = L - L_m
    dense_layer = qkv * d + d * q + 3 * c.ffn * d + qkv + 4 * d
    moe_layer = qkv * d + d * q + qkv + 3 * d + E * (d + 1) + 3 * E * fe * d + 3 * fs * d + d
    P = 2 * V * d + d + L_d * dense_layer + L_m * moe_layer
    m = max(3 * c.ffn if L_d else 0, 3 * (k * fe + fs) + E if L_m else 0)
    A = B * T * (3 * d + 2 * qkv + m + 5 * V) + 2 * B * H * T * T
    P_a = P - L_m * 3 * (E - k) * fe * d
    kernels = 30 * L + 6 * E * L_m
    flops = 3 * (2 * P_a * B * T + 4 * L * B * H * T * T * c.head_dim + 20_000 * kernels)
    per_layer = 9 + 5 + 3 * E if L_m else 9
    if unit == "model":
        held, tensors = P, 3 + 9 * L_d + (9 + 5 + 3 * E) * L_m
    elif unit == "layer":
        held = max(V * d, dense_layer if L_d else 0, moe_layer if L_m else 0)
        tensors = per_layer
    else:
        held = max(c.padded_vocab * d, qkv * d, d * q, *((2 * c.ffn * d,) if L_d else ()),
                   *((E * 2 * fe * d, E * d, 2 * fs * d) if L_m else ()))
        tensors = per_layer
    C = {"model": 4, "layer": 3, "parameter": 3}[unit]
    return Footprint(P, A, 4 * (C * held + A) + C * 1024 * tensors, flops, tensors, unit, held,
                     C)


@pytest.mark.parametrize("unit", ["model", "layer", "parameter"])
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_the_estimate_is_its_closed_form_term_by_term(config, unit):
    assert footprint(config, unit) == closed_form(config, unit)


@pytest.mark.parametrize("config, largest", [
    (DENSE, "tok_embeddings.weight"), (WIDE_QKV, "layers.0.qkv.weight"),
    (MOE, "layers.2.experts.gate_up.weight"), (WIDE_SHARED, "layers.2.shared.gate_up.weight")])
def test_streamed_per_parameter_the_largest_is_the_largest_of_param_shapes(config, largest):
    shapes = config.param_shapes()
    numel = {n: math.prod(s) for n, s in shapes.items()}
    assert max(numel, key=lambda n: numel[n]) == largest  # each a different parameter
    assert footprint(config, "parameter").held == numel[largest]


def test_streamed_per_layer_only_the_kinds_of_layer_the_geometry_has_count():
    # no MoE layer: the dense one (800), not an MoE one of these experts (1736)
    assert footprint(MOE_ALL_DENSE, "layer").held == 800
    # no dense layer: the MoE one (1736), not a dense one of width 100 (3000 + 400)
    assert footprint(WIDE_FFN_MOE, "layer").held == 1736
    assert footprint(WIDE_FFN_MOE).activations == 10 * (30 + 40 + 63 + 200) + 300
    assert footprint(MOE_ALL_DENSE).activations == 10 * (30 + 40 + 42 + 200) + 300


def test_the_small_dense_geometry_by_hand():
    # P = 2 x 40 x 10 + 10 + 3 x (200 + 120 + 420 + 20 + 40); A = 10 x (30 + 40 + 42 + 200)
    # + 2 x 2 x 3 x 25; flops = 3 x (2 P 10 + 4 x 3 x 2 x 3 x 25 x 4 + 20000 x 90)
    cost = footprint(DENSE)
    assert (cost.params, cost.activations, cost.flops) == (3210, 3420, 5_614_200)
    assert (cost.tensors, cost.held, cost.copies, cost.unit) == (30, 3210, 4, "model")
    assert cost.bytes == 4 * (4 * 3210 + 3420) + 4 * 1024 * 30


def test_the_moe_geometry_by_hand():
    # a dense layer 800, an MoE layer 200 + 120 + 20 + 30 + 6 x 11 + 3 x 6 x 6 x 10 + 210 + 10
    cost = footprint(MOE)
    assert cost.params == 800 + 10 + 2 * 800 + 3 * 1736
    # m = max(42, 3 x (12 + 7) + 6 = 63); the four experts not chosen do no work
    assert cost.activations == 10 * (30 + 40 + 63 + 200) + 300
    assert cost.flops == 3 * (2 * (cost.params - 3 * 3 * 4 * 6 * 10) * 10 + 4 * 5 * 2 * 3 * 25 * 4
                              + 20_000 * (150 + 3 * 36))
    assert cost.tensors == 3 + 2 * 9 + 3 * 32
    layer = footprint(MOE, "layer")
    assert (layer.held, layer.tensors, layer.copies) == (1736, 32, 3)
    assert footprint(MOE, "parameter").held == 720  # the stacked experts' gate_up, 6 x 12 x 10


def test_an_unknown_unit_is_refused_naming_the_units():
    with pytest.raises(ValueError) as err:
        footprint(DENSE, "rank")
    assert str(err.value) == ("footprint: unit must be one of ('model', 'layer', 'parameter'), "
                              "got 'rank'")
    assert tuple(COPIES) == ("model", "layer", "parameter")


def test_the_formula_names_the_figures_whole_and_streamed():
    assert footprint(DENSE).formula() == (
        "4 B x (4 x 3.21e+03 parameters + 3.42e+03 activations) + 4 x 30 tensors x 1024 B, "
        "5.61e+06 flops; see model.footprint")
    assert footprint(MOE, "layer").formula() == (
        "4 B x (3 x 1.74e+03 parameters of its largest layer + 3.63e+03 activations) + 3 x 32 "
        "tensors x 1024 B, 1.58e+07 flops; see model.footprint")


def test_the_gflop_figures_divide_by_10_to_the_9():
    # 1.235e9 and 1.225e9 sit on a rounding edge of three digits: a divisor one larger moves
    cost = footprint(DENSE)
    cost = Footprint(cost.params, cost.activations, 0, 1_235_000_000, cost.tensors)
    assert Limits(max_flops=1_225_000_000).over(cost) == [
        "about 1.24 GFLOP (limit 1.23 GFLOP; raise it with --max-gflop)"]


def test_each_limit_is_over_only_past_it_and_says_its_flag():
    cost = footprint(DENSE)
    assert Limits(max_bytes=cost.bytes, max_flops=cost.flops).over(cost) == []
    assert Limits(max_bytes=cost.bytes - 1, max_flops=cost.flops).over(cost) == [
        f"about {cost.bytes / GIB:.3g} GiB (limit {(cost.bytes - 1) / GIB:.3g} GiB; raise it "
        "with --max-gib)"]
    assert Limits(max_bytes=cost.bytes, max_flops=cost.flops - 1).over(cost) == [
        "about 0.00561 GFLOP (limit 0.00561 GFLOP; raise it with --max-gflop)"]
    both = Limits(max_bytes=1, max_flops=1).over(cost)
    assert [s.split(" (")[0] for s in both] == [f"about {cost.bytes / GIB:.3g} GiB",
                                                 "about 0.00561 GFLOP"]
    with pytest.raises(ValueError, match="^max_flops must be a finite number > 0, got 0$"):
        Limits(max_flops=0)


def test_a_refusal_says_the_unit_the_field_as_written_and_the_hint():
    wide = DENSE.replace(name="wide", d_model=10**5)
    cost = footprint(wide, "layer")
    with pytest.raises(GeometryTooLarge) as err:
        require_fits(wide, Limits(max_bytes=cost.bytes - 1, max_flops=1e30), unit="layer",
                     names={"d_model": "hidden_size"}, hint="; try --stream")
    assert str(err.value) == (
        "wide: field 'hidden_size' (d_model) is 100000: checking this geometry streamed per "
        f"layer would need about {cost.bytes / GIB:.3g} GiB (limit {(cost.bytes - 1) / GIB:.3g} "
        "GiB; raise it with --max-gib); try --stream, refused before allocating anything "
        f"(estimate: {cost.formula()})")
    assert (err.value.field, err.value.estimate, err.value.flops) == ("hidden_size", cost.bytes,
                                                                       cost.flops)
    # a name the user wrote as the harness does: not repeated in parentheses
    with pytest.raises(GeometryTooLarge) as err:
        require_fits(wide, Limits(max_bytes=1, max_flops=1e30))
    assert str(err.value).startswith("wide: field 'd_model' is 100000: checking this geometry "
                                     "would need about ")
    assert err.value.field == "d_model"


def test_a_refusal_of_a_geometry_no_larger_than_the_shipped_ones_names_no_field():
    with pytest.raises(GeometryTooLarge) as err:
        require_fits(DENSE, Limits(max_bytes=1, max_flops=1e30))
    assert str(err.value).startswith("dense: checking this geometry would need about ")
    assert err.value.field is None


def test_the_driving_field_is_the_largest_ratio_and_only_above_one():
    reference = {k: 10 for k in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                 "head_dim", "ffn", "batch", "seq_len", "n_experts",
                                 "expert_ffn", "shared_ffn")}
    at = DENSE.replace(vocab=10, d_model=10, n_layers=10, n_heads=10, n_kv_heads=10,
                       head_dim=10, ffn=10, batch=10, seq_len=10)
    assert driving_field(at, reference) is None  # every ratio 1: none above
    assert driving_field(at.replace(ffn=11), reference) == "ffn"
    assert driving_field(at.replace(ffn=30, seq_len=20), reference) == "ffn"
    assert driving_field(at.replace(batch=11), {**reference, "n_experts": 0}) == "batch"

"""``model.footprint``: the one estimate of what checking a geometry costs, MoE experts
counted, whole or streamed, and the guard that refuses a geometry over the limits naming
the field that drives the estimate. Each claim has its twin: an estimate that left the
experts out would be caught, a geometry within the limits is not refused."""

from __future__ import annotations

import math

import pytest

from weight_sync_bench import memory
from weight_sync_bench.errors import (
    CorpusEntryTooLarge,
    CorruptCorpusEntry,
    GeometryTooLarge,
    InvalidNumber,
)
from weight_sync_bench.model.config import (
    HF_NAMES,
    SHIPPED_HF_CONFIGS,
    TOY,
    TOY_MOE,
    TOY_MOE_DS,
    shipped_hf_config,
)
from weight_sync_bench.model.footprint import (
    FALLBACK_MAX_BYTES,
    GIB,
    Limits,
    driving_field,
    footprint,
    require_fits,
    shipped_reference,
    sizes,
)

CONFIGS = [TOY, TOY_MOE, TOY_MOE_DS,
           *(shipped_hf_config(n, shrink=16, n_layers=2, vocab=512) for n in SHIPPED_HF_CONFIGS)]
IDS = [c.name for c in CONFIGS]


def numel(shape):
    return math.prod(shape)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_estimate_counts_every_parameter_experts_included(config):
    """An upper estimate: at least the real parameter count (biases and norms it may not
    have are counted), for dense and MoE geometries alike."""
    assert footprint(config).params >= config.n_params


@pytest.mark.parametrize("config", [TOY_MOE, TOY_MOE_DS], ids=["toy_moe", "toy_moe_ds"])
def test_a_dense_only_estimate_of_an_moe_geometry_would_be_caught(config):
    """The twin: counting an MoE layer as a dense MLP of width ``ffn`` (the estimate before
    experts were counted) falls below the real count, so the test above is not vacuous."""
    d, qkv = config.d_model, config.qkv_rows
    dense_only = (2 * config.padded_vocab * d + d + config.n_layers
                  * (qkv * d + d * config.q_rows + 3 * config.ffn * d + qkv + 4 * d))
    assert dense_only < config.n_params <= footprint(config).params


def test_more_experts_cost_what_their_weights_and_kernels_cost():
    more = TOY_MOE.replace(n_experts=16)
    moe_layers = TOY_MOE.n_layers - TOY_MOE.dense_layers
    grown = footprint(more).params - footprint(TOY_MOE).params
    d, f = TOY_MOE.d_model, TOY_MOE.expert_ffn
    assert grown == moe_layers * 8 * (3 * f * d + d + 1)  # 8 more experts and router rows
    assert footprint(more).flops > footprint(TOY_MOE).flops


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_a_streamed_check_holds_its_largest_unit(config):
    """Per parameter: the largest of ``param_shapes``, exactly; per layer: at least the
    largest layer's parameters (and the embedding); either way less than the whole."""
    shapes = config.param_shapes()
    assert footprint(config, "parameter").held == max(numel(s) for s in shapes.values())
    layers = [sum(numel(s) for n, s in shapes.items() if n.startswith(f"layers.{i}."))
              for i in range(config.n_layers)]
    assert footprint(config, "layer").held >= max(layers)
    whole = footprint(config)
    assert footprint(config, "parameter").bytes <= footprint(config, "layer").bytes < whole.bytes
    assert footprint(config, "layer").flops == whole.flops  # streaming saves memory, not work


def test_the_default_limits_are_this_machines_memory_and_ten_thousand_gflop(monkeypatch):
    assert Limits().max_bytes == (memory.total() or FALLBACK_MAX_BYTES)
    assert Limits().max_flops == 1e13
    monkeypatch.setattr(memory, "total", lambda: None)  # no /proc/meminfo: 16 GiB
    assert Limits().max_bytes == 16 * GIB
    with pytest.raises(InvalidNumber, match=r"^max_bytes must be a finite number > 0, got 0$"):
        Limits(max_bytes=0)


def test_a_huge_hidden_size_is_refused_naming_the_field_and_the_estimate():
    config = shipped_hf_config("llama3_8b", n_layers=1).replace(name="big", d_model=10**9)
    with pytest.raises(GeometryTooLarge) as err:
        require_fits(config, Limits(max_bytes=64 * GIB), names=HF_NAMES)
    cost = footprint(config)
    assert str(err.value).startswith(
        f"big: field 'hidden_size' (d_model) is 1000000000: checking this geometry would need "
        f"about {cost.bytes / GIB:.3g} GiB (limit 64 GiB; raise it with --max-gib) and about "
        f"{cost.flops / 1e9:.3g} GFLOP (limit 1e+04 GFLOP; raise it with --max-gflop), "
        "refused before allocating anything (estimate: 4 B x (4 x ")
    assert str(err.value).endswith("flops; see model.footprint)")
    assert (err.value.field, err.value.estimate, err.value.flops) == (
        "hidden_size", cost.bytes, cost.flops)


def test_a_geometry_within_the_limits_is_not_refused():
    """The twin: the same geometry at its real width fits limits of its own estimate."""
    config = shipped_hf_config("llama3_8b", n_layers=1)
    cost = footprint(config)
    assert require_fits(config, Limits(max_bytes=cost.bytes, max_flops=cost.flops)) == cost
    with pytest.raises(GeometryTooLarge):
        require_fits(config, Limits(max_bytes=cost.bytes - 1, max_flops=cost.flops))


def test_the_field_named_is_the_one_furthest_above_the_shipped_configs():
    top = shipped_reference()
    assert top["d_model"] == 5120 and top["n_experts"] == 128 and top["n_layers"] == 48
    llama = shipped_hf_config("llama3_8b")
    assert driving_field(llama, top) is None  # a shipped geometry: nothing is outside
    assert driving_field(llama.replace(n_layers=4800), top) == "n_layers"
    # 10x the depth outweighs 2x the width: the ratio decides, not the number
    assert driving_field(llama.replace(n_layers=480, d_model=10240), top) == "n_layers"
    # a field the reference has at zero is outside wherever it is set
    assert driving_field(TOY_MOE, sizes(TOY)) == "n_experts"


def test_a_corpus_entry_too_large_is_a_geometry_too_large_and_a_corrupt_entry():
    err = CorpusEntryTooLarge("x", path="e.json", field="case.geometry.d_model", estimate=1,
                              flops=2)
    assert isinstance(err, GeometryTooLarge) and isinstance(err, CorruptCorpusEntry)
    assert (err.path, err.field, err.estimate, err.flops) == ("e.json",
                                                              "case.geometry.d_model", 1, 2)

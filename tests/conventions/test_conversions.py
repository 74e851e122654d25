"""The harness's own converter passes ``check_convert``'s verdict for every ordered pair of
(convention, degree) of TOY, TOY_KV4 and a reduced geometry of each shipped HF config: the
twin of every detection in test_mutations (the same checks pass when nothing is wrong).
TOY_KV4 and the reduced mistral_7b run in the long run only (``WSB_PROFILE=wsb-nightly``,
``make nightly``), as their detections in test_mutations do (``NIGHTLY_GEOMETRIES``): the
default run keeps each detection's twin."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench import TOY, TOY_KV4
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.conventions import (
    CONVENTIONS,
    convert,
    endpoint,
    gather_canonical,
    materialize,
    shards_for,
)
from weight_sync_bench.fuzz.profiles import profile_name
from weight_sync_bench.model.config import HF_CONFIGS, shipped_hf_config

MAX_DEGREE = 16  # reaches vLLM's KV replication for the 8-KV-head geometries
GEOMETRIES = [TOY, TOY_KV4, *(shipped_hf_config(n, shrink=16, n_layers=1, vocab=512)
                              for n in HF_CONFIGS)]
# the long run's, as in test_mutations (whose detections on them run there too)
NIGHTLY_GEOMETRIES = ("toy_kv4", "mistral_7b")
NIGHTLY = pytest.mark.skipif(profile_name() != "wsb-nightly",
                             reason="the long run: WSB_PROFILE=wsb-nightly (make nightly)")
MATRIX = [pytest.param(c, id=c.name, marks=NIGHTLY if c.name in NIGHTLY_GEOMETRIES else ())
          for c in GEOMETRIES]


def endpoints(config):
    return [endpoint(f"{n}:{t}") for n, c in CONVENTIONS.items()
            for t in c.supported_degrees(config, MAX_DEGREE)]


def test_the_geometries_cover_replication_tied_free_biases_and_a_head_dim_off_d_over_h():
    names = {c.name: c for c in GEOMETRIES}
    assert names["mistral_nemo"].head_dim * names["mistral_nemo"].n_heads != names["mistral_nemo"].d_model
    assert names["qwen2_5_7b"].has_qkv_bias and not names["qwen2_5_7b"].has_o_bias
    # vLLM at t > n_kv_heads is in every matrix (TOY: 2 KV heads at t=4, 8)
    for config in GEOMETRIES:
        vllm = CONVENTIONS["vllm"].supported_degrees(config, MAX_DEGREE)
        assert any(t > config.n_kv_heads for t in vllm) or config.name == "qwen2_5_7b", config.name


@pytest.mark.parametrize("config", MATRIX)
def test_the_harness_converter_passes_every_pair_of_conventions_and_degrees(
        config, checker_for_config):
    """Every ordered pair, by composition: ``convert(src -> dst)`` is ``materialize(dst,
    gather(src))``; gathering every source gives the canonical parameters byte for byte, so
    every pair's output is ``materialize(dst, canonical)``, one byte string per destination,
    whose verdict is checked (a verdict is a function of those bytes)."""
    checker = checker_for_config(config)
    eps, shapes = endpoints(config), config.param_shapes()
    for src in eps:
        gathered = gather_canonical(checker.source(src), src.pieces(config), shapes)
        assert all(bit_equal(gathered[n], x) for n, x in checker.checker.full.items()), str(src)
    for dst in eps:
        verdict = checker.verdict(materialize(dst.pieces(config), checker.checker.full),
                                  src=eps[0], dst=dst)
        assert verdict.passed, str(verdict)
        assert verdict.first_mismatch is None and 0 <= verdict.ratio < 1


def test_the_harness_converter_passes_every_pair_literally_on_a_reduced_llama3(
        checker_for_config):
    config = GEOMETRIES[2]  # llama3_8b at 1/16 width: 18 endpoints, 324 ordered pairs
    checker = checker_for_config(config)
    for src in endpoints(config):
        source = checker.source(src)
        for dst in endpoints(config):
            verdict = checker.verdict(convert(source, src, dst, config), src=src, dst=dst)
            assert verdict.passed, str(verdict)


def test_convert_is_gather_through_the_source_then_materialize_through_the_destination():
    source = shards_for(TOY_KV4, "megatron", 4)
    via = materialize(endpoint("vllm:8").pieces(TOY_KV4),
                      gather_canonical(source, endpoint("megatron:4").pieces(TOY_KV4),
                                       TOY_KV4.param_shapes()))
    out = convert(source, "megatron:4", "vllm:8", TOY_KV4)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(out, via) for n in a)


def test_shards_for_is_a_pure_function_of_config_convention_degree_and_seed():
    a, b = shards_for(TOY, "megatron", 2, seed=3), shards_for(TOY, "megatron", 2, seed=3)
    c = shards_for(TOY, "megatron", 2, seed=4)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(a, b) for n in x)
    assert not torch.equal(a[0]["output_layer.weight"], c[0]["output_layer.weight"])
    # fresh tensors: no rank aliases another, or the canonical parameters
    a[0]["decoder.final_layernorm.weight"].zero_()
    assert a[1]["decoder.final_layernorm.weight"].abs().min() > 0

"""The harness's own converter passes ``check_convert``'s verdict for every ordered pair of
(convention, degree) of TOY, TOY_KV4 and a reduced geometry of each shipped HF config: the
twin of every detection in test_mutations (the same checks pass when nothing is wrong).
TOY_KV4 and the reduced mistral_7b run in the long run only (``WSB_PROFILE=wsb-nightly``,
``make nightly``), as their detections in test_mutations do (``NIGHTLY_GEOMETRIES``): the
default run keeps each detection's twin."""

from __future__ import annotations

import pytest
import torch

from tests.breadth import breadth
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


def covering_pairs(eps):
    """Every ordered pair of conventions once, the degrees at each end rotating so that every
    endpoint is a source and a destination: for source convention i and destination
    convention j, the source takes its degree j + 5k (mod its count), the destination its
    degree i + 5k, over as many rounds k as the most degrees of one convention need."""
    by = {}
    for e in eps:
        by.setdefault(str(e).split(":")[0], []).append(e)
    names = list(by)
    rounds = -(-max(len(v) for v in by.values()) // len(names))
    return [(by[a][(j + k * len(names)) % len(by[a])], by[b][(i + k * len(names)) % len(by[b])])
            for k in range(rounds) for i, a in enumerate(names) for j, b in enumerate(names)]


# By default the covering pairs (each convention to each, every endpoint a source and a
# destination: 25 of the 361); every ordered pair in the long run (1.9 s). Every pair's
# verdict runs by default by composition in
# test_the_harness_converter_passes_every_pair_of_conventions_and_degrees.
@pytest.mark.parametrize("pairs", breadth(["covering", "every"], keep={"covering"}))
def test_the_harness_converter_passes_every_pair_literally_on_a_reduced_llama3(
        checker_for_config, pairs):
    config = GEOMETRIES[2]  # llama3_8b at 1/16 width: 19 endpoints, 361 ordered pairs
    checker = checker_for_config(config)
    eps = endpoints(config)
    chosen = [(a, b) for a in eps for b in eps] if pairs == "every" else covering_pairs(eps)
    assert {str(a) for a, _ in chosen} == {str(b) for _, b in chosen} == {str(e) for e in eps}
    assert len({(str(a).split(":")[0], str(b).split(":")[0]) for a, b in chosen}) == \
        len(CONVENTIONS) ** 2
    for src in eps:
        mine = [dst for a, dst in chosen if a is src]
        if not mine:
            continue
        source = checker.source(src)
        for dst in mine:
            verdict = checker.verdict(convert(source, src, dst, config), src=src, dst=dst)
            assert verdict.passed, str(verdict)


# TOY's and TOY_KV4's heads and layers with a vocabulary of 1000 (padded by Megatron and vLLM
# at every degree): these two are index maps and seeds, the same at any vocabulary; the
# 32000-row embedding and head made them 0.7 s.
TOY_V1000 = TOY.replace(name="toy_v1000", vocab=1000)
TOY_KV4_V1000 = TOY_KV4.replace(name="toy_kv4_v1000", vocab=1000)


def test_convert_is_gather_through_the_source_then_materialize_through_the_destination():
    config = TOY_KV4_V1000
    source = shards_for(config, "megatron", 4)
    via = materialize(endpoint("vllm:8").pieces(config),
                      gather_canonical(source, endpoint("megatron:4").pieces(config),
                                       config.param_shapes()))
    out = convert(source, "megatron:4", "vllm:8", config)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(out, via) for n in a)


def test_shards_for_is_a_pure_function_of_config_convention_degree_and_seed():
    config = TOY_V1000
    a, b = shards_for(config, "megatron", 2, seed=3), shards_for(config, "megatron", 2, seed=3)
    c = shards_for(config, "megatron", 2, seed=4)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(a, b) for n in x)
    assert not torch.equal(a[0]["output_layer.weight"], c[0]["output_layer.weight"])
    # fresh tensors: no rank aliases another, or the canonical parameters
    a[0]["decoder.final_layernorm.weight"].zero_()
    assert a[1]["decoder.final_layernorm.weight"].abs().min() > 0

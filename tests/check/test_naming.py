"""Name the bug (``check.naming``): wherever a catalogued mutation is not the identity, the
shards it makes are named as itself (or as every mutation that makes the same bytes there),
the declared shards never are, and a bug outside the catalogue is not named either.

The matrices: the layout catalogue (``check.mutations``: ``MUTATIONS`` and the dtype round
trips) over the degrees and dtypes of two small geometries, as ``test_mutations`` enumerates
them; the conversion catalogue (``conventions.mutations``) over every pair of conventions
and degrees of a small geometry, as the conversion kill matrix does (one verdict per
distinct mutated shard set). What is expected comes from an oracle that shares no code with
``check.naming``: every mutation the check tries, applied whole and compared byte for byte.
"""

from __future__ import annotations

import pytest

from tests.breadth import breadth
from weight_sync_bench.errors import UnsupportedLayout
import torch

from weight_sync_bench import TOY, ModelConfig, layout_for, reshard, split
from weight_sync_bench.check.checker import Checker, check_reshard, check_split
from weight_sync_bench.check.convert import check_convert, conversion_checker
from weight_sync_bench.check.mutations import DTYPE_MUTATIONS, MUTATIONS
from weight_sync_bench.check.stream import stage_split
from weight_sync_bench.conventions import CONVENTIONS, convert, endpoint
from weight_sync_bench.conventions.mutations import (
    CONVERSION_MUTATIONS,
    PIPELINE_MUTATIONS,
    Conversion,
)
from weight_sync_bench.fuzz.domain import DOMAIN, fuzz_params
from weight_sync_bench.layout.table import LayoutTable

# test_mutations' geometries: n_kv_heads 2 (degrees 1, 2) and 4 (degrees 1, 2, 4)
KV2 = DOMAIN.config(n_kv_heads=2, group=2, head_dim=2, d_model=8, ffn_per_kv_head=2,
                    vocab_per_kv_head=8, n_layers=1, batch=1, seq_len=2)
KV4 = KV2.replace(n_kv_heads=4, n_heads=8, ffn=8, vocab=32)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUT_CATALOGUE = (*MUTATIONS.values(), *DTYPE_MUTATIONS)
# Every conversion mutation can occur and change bytes in one of these: 8 heads over 2 KV
# heads (vLLM replicates them past t=2), head_dim 8 (two RoPE pairs), untied embeddings; Meta
# stores no bias, the second has a qkv bias (qkv_bias_not_split).
SMALL = ModelConfig(name="small", vocab=64, d_model=32, n_layers=1, n_heads=8, n_kv_heads=2,
                    head_dim=8, ffn=48)
SMALL_BIAS = SMALL.replace(name="small_bias", qkv_bias=True)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _equal(a, b) -> bool:
    """The oracle's comparison: every stored tensor of every rank, as raw integers."""
    return all(list(x) == list(y) and all(x[n].dtype == y[n].dtype and x[n].shape == y[n].shape
                                           and torch.equal(_bits(x[n]), _bits(y[n])) for n in x)
               for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def checkers():
    return {(c.n_kv_heads, d): Checker(c, threshold=1.0, dtype=d, params={
        n: x.to(d) for n, x in fuzz_params(c, 0).items()}) for c in (KV2, KV4) for d in DTYPES}


LAYOUT_CELLS = [(m, c, t, d) for m in LAYOUT_CATALOGUE for c in (KV2, KV4) for t in (1, 2, 4)
                for d in DTYPES if t <= c.n_kv_heads and m.identity_reason(c, t, d) is None]
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _layout_oracle(checker: Checker, degree: int, shards) -> set[str]:
    """Every layout mutation and round trip not the identity here whose whole output is
    ``shards``."""
    declared, config = checker.declared(degree), checker.config
    return {m.name for m in LAYOUT_CATALOGUE
            if m.identity_reason(config, degree, checker.dtype) is None
            and _equal(m.apply(declared, checker.layout, config), shards)}


@pytest.mark.parametrize("mutation, config, degree, dtype", LAYOUT_CELLS,
                         ids=[f"{m.name}-kv{c.n_kv_heads}-t{t}-{NAMES[d]}"
                              for m, c, t, d in LAYOUT_CELLS])
def test_every_layout_mutation_is_named_as_itself_or_as_those_it_coincides_with(
        checkers, mutation, config, degree, dtype):
    checker = checkers[config.n_kv_heads, dtype]
    shards = mutation.apply(checker.declared(degree), checker.layout, config)
    verdict = checker.verdict(shards, dst=degree, mutation=mutation.name)
    expected = _layout_oracle(checker, degree, shards)
    assert mutation.name in expected and verdict.named_mutation is not None, str(verdict)
    assert set(verdict.named_mutation.split(", ")) == expected, str(verdict)
    line = f"  this is exactly `{mutation.name}`: {mutation.description}"
    assert (line in str(verdict).splitlines()) == (expected == {mutation.name}), str(verdict)


@pytest.mark.parametrize("config", [KV2, KV4], ids=lambda c: f"kv{c.n_kv_heads}")
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_the_declared_shards_are_never_named(checkers, config, dtype):
    checker = checkers[config.n_kv_heads, dtype]
    for degree in layout_for(config).supported_degrees():
        verdict = checker.verdict([dict(p) for p in checker.declared(degree)], dst=degree)
        assert verdict.passed and verdict.named_mutation is None and verdict.named_meaning is None
        assert "this is exactly" not in str(verdict)


def _swap_two_q_heads_on_rank_0(shards, config):
    """Outside the catalogue: rank 0's first two Q heads of layer 0 exchanged, nothing else."""
    out = [dict(p) for p in shards]
    hd, name = config.head_dim, "layers.0.qkv.weight"
    w = out[0][name].clone()
    w[:hd], w[hd:2 * hd] = out[0][name][hd:2 * hd], out[0][name][:hd]
    out[0][name] = w
    return out


def test_a_bug_outside_the_catalogue_is_diagnosed_but_not_named(checkers):
    checker = checkers[4, torch.float32]
    shards = _swap_two_q_heads_on_rank_0(checker.declared(2), KV4)
    verdict = checker.verdict(shards, dst=2)
    assert not verdict.passed and verdict.diagnosis == (
        "rank 0 layers.0.qkv.weight holds Q head 1, Q head 0, Q heads 2-3, K heads 0-1, "
        "V heads 0-1; declared Q heads 0-3, K heads 0-1, V heads 0-1",)
    assert _layout_oracle(checker, 2, shards) == set() and verdict.named_mutation is None
    assert "this is exactly" not in str(verdict)


def test_two_catalogued_bugs_at_once_are_neither(checkers):
    checker = checkers[4, torch.float32]
    both = MUTATIONS["kv_swapped"].apply(checker.declared(2), checker.layout, KV4)
    both = MUTATIONS["lm_head_reversed"].apply(both, checker.layout, KV4)
    verdict = checker.verdict(both, dst=2)
    assert verdict.mismatches == ("layers.0.qkv.weight", "lm_head.weight")
    assert verdict.named_mutation is None  # kv_swapped's own parameter alone is not enough


# ---- streamed: the same names, the parameters before the first difference drawn again

VARIANT = TOY.replace(name="variant", vocab=500, d_model=64, n_layers=2, ffn=96, head_dim=8,
                      qkv_bias=True)


def _per_stage(mutation, config):
    """A streamed splitter that is ``mutation``: the declared split of the stage, mutated."""
    split_stage, layout = stage_split(layout_for(config)), layout_for(config)

    def fn(full, degree):
        sub = LayoutTable(tuple(layout[n] for n in full))
        return mutation.apply(split_stage(full, degree), sub, config)
    return fn


STREAMED = [m for m in LAYOUT_CATALOGUE if m.identity_reason(VARIANT, 2) is None]


@pytest.mark.parametrize("mutation", STREAMED, ids=lambda m: m.name)
def test_a_streamed_check_names_what_the_whole_check_names(mutation):
    fn = _per_stage(mutation, VARIANT)
    whole = check_split(fn, VARIANT, 2, threshold=1.0)
    streamed = check_split(fn, VARIANT, 2, threshold=1.0, stream="parameter")
    assert mutation.name in whole.named_mutation.split(", ")
    assert streamed.named_mutation == whole.named_mutation
    assert streamed.named_meaning == whole.named_meaning


def test_a_round_trip_of_all_but_the_first_parameter_is_not_named_whole_or_streamed():
    """The twin that needs the parameters before the first difference: bf16 round trip
    everywhere but the embedding (drawn first, compared equal, dropped) is not
    ``bf16_round_trip``, which would change the embedding too."""
    trip = next(m for m in DTYPE_MUTATIONS if m.name == "bf16_round_trip")
    layout, split_stage = layout_for(VARIANT), stage_split(layout_for(VARIANT))

    def all_but_embedding(full, degree):
        out = split_stage(full, degree)
        names = [n for n in full if n != "tok_embeddings.weight"]
        return trip.apply(out, LayoutTable(tuple(layout[n] for n in names)), VARIANT)

    everywhere = _per_stage(trip, VARIANT)
    for per in (None, "layer", "parameter"):
        assert check_split(everywhere, VARIANT, 2, threshold=1.0,
                           stream=per).named_mutation == "bf16_round_trip"
        wrong = check_split(all_but_embedding, VARIANT, 2, threshold=1.0, stream=per)
        assert not wrong.passed and wrong.named_mutation is None, per


def test_a_reshard_is_named_as_a_split_is_whole_and_streamed():
    m, layout = MUTATIONS["gate_up_swapped"], layout_for(VARIANT)

    def fn(shards, dst):  # a stage's (or the whole model's) source shards
        sub = LayoutTable(tuple(layout[n] for n in shards[0]))
        return m.apply(reshard(shards, sub, dst), sub, VARIANT)

    for per in (None, "parameter"):
        assert check_reshard(fn, VARIANT, 1, 2, threshold=1.0,
                             stream=per).named_mutation == "gate_up_swapped"


def test_the_verdict_says_what_the_named_mutation_means():
    def swapped(full, degree):
        return MUTATIONS["gate_up_swapped"].apply(split(full, layout_for(TOY), degree),
                                                  layout_for(TOY), TOY)

    verdict = check_split(swapped, TOY, 2, threshold=1.0)
    assert verdict.named_mutation == "gate_up_swapped"
    assert verdict.named_meaning == "gate and up halves exchanged inside every rank's gate_up shard"
    assert str(verdict).splitlines()[-1] == (
        "  this is exactly `gate_up_swapped`: gate and up halves exchanged inside every rank's "
        "gate_up shard")


# ---- conversions

def _endpoints(config, max_degree=8):
    if config is STAGED:  # pipeline stages: even, interleaved, an uneven last stage
        return [endpoint(e) for e in STAGED_ENDPOINTS]
    if config.n_experts:  # the MoE endpoints: expert parallelism, its options
        return [endpoint(e) for e in MOE_ENDPOINTS if _stores(config, e)]
    return [endpoint(f"{n}:{t}") for n, c in CONVENTIONS.items()
            for t in c.supported_degrees(config, max_degree)]


def _stores(config, where):
    try:
        endpoint(where).pieces(config)
    except UnsupportedLayout:
        return False
    return True


MOE_ENDPOINTS = ("hf", "hf:experts=fused", "plain:2", "vllm:2", "vllm:tp=2,ep=2",
                 "vllm:tp=4,ep=4", "vllm:tp=2,kernel=flashinfer_cutlass", "megatron:2",
                 "megatron:tp=2,ep=2", "megatron:tp=2,ep=2,etp=1")
# Qwen3-MoE's block with square experts (expert_ffn == d_model: a transposed expert keeps its
# shape) and DeepSeek's with a selection bias, a gated shared expert and 6 experts (vLLM's
# linear expert map over 4 EP ranks has a remainder)
MOE_SQUARE = ModelConfig(name="moe_square", vocab=64, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=4, head_dim=8, ffn=48, qk_norm=True, n_experts=4, top_k=2,
                         expert_ffn=32, norm_topk=True)
MOE_BIAS = ModelConfig(name="moe_bias", vocab=64, d_model=32, n_layers=2, n_heads=4,
                       n_kv_heads=4, head_dim=8, ffn=48, n_experts=6, top_k=2, expert_ffn=16,
                       router="sigmoid", router_bias=True, norm_topk=True, shared_ffn=16,
                       shared_gate=True)


STAGED = SMALL.replace(name="small_staged", n_layers=4, vocab=100)
STAGED_ENDPOINTS = ("hf", "vllm:2", "megatron:2", "megatron:tp=2,pp=2",
                    "megatron:tp=1,pp=2,vpp=2", "megatron:tp=2,pp=2,pp_last=3")


def _round_trip(shards, via):
    return [{n: x.to(via).to(x.dtype) for n, x in r.items()} for r in shards]


def _conversion_oracle(checker, conversion, shards) -> set[str]:
    """Every mutation a conversion check tries, applied whole, whose output is ``shards``:
    the conversion mutations that apply and change bytes, the layout ones where the
    destination is plain, the two round trips (fp32 weights)."""
    config, dst = conversion.config, conversion.dst
    declared = checker.declared(dst)
    made = {m.name: m.apply(declared, conversion) for m in CONVERSION_MUTATIONS
            if m.not_applicable(conversion) is None and m.identity_reason(conversion) is None}
    if dst.name == "plain":
        made |= {m.name: m.apply(declared, layout_for(config), config) for m in MUTATIONS.values()
                 if m.identity_reason(config, dst.degree) is None}
    made |= {"bf16_round_trip": _round_trip(declared, torch.bfloat16),
             "fp16_round_trip": _round_trip(declared, torch.float16)}
    return {name: out for name, out in made.items() if _equal(out, shards)}.keys()


@pytest.fixture(scope="module")
def checkers_by_name():
    return {c.name: conversion_checker(c, threshold=1.0)
            for c in (SMALL, SMALL_BIAS, MOE_SQUARE, MOE_BIAS, STAGED)}


@pytest.fixture(scope="module")
def small(checkers_by_name):
    return checkers_by_name["small"]


def _live(config, mutations=CONVERSION_MUTATIONS):
    """One conversion per distinct mutated shard set where the mutation changes bytes."""
    cells = {}
    for m in mutations:
        for src in _endpoints(config):
            for dst in _endpoints(config):
                conversion = Conversion(config, src, dst)
                if m.not_applicable(conversion) is None and m.identity_reason(conversion) is None:
                    cells.setdefault(m.key(conversion), (m, conversion))
    return list(cells.values())


CONVERSION_CELLS = (_live(SMALL) + _live(SMALL_BIAS) + _live(MOE_SQUARE) + _live(MOE_BIAS)
                    + _live(STAGED, PIPELINE_MUTATIONS))


# The default run names 18 of the 28 conversion mutations, one or more of each kind of bug,
# between them every geometry with every source and destination convention it has cells for
# and both kinds of key (test_the_default_run_names_in_every_geometry_and_convention_...):
# the two that coincide with layout mutations on a plain destination (tp_rank_defaults_to_0
# with qkv_rank0_duplicated, megatron_qkv_read_as_plain with qkv_interleaved_read_as_plain),
# the replicated KV heads (kv_replica_modulo), a RoPE permute (rope_permute_missing), the qkv
# bias (qkv_bias_not_split), the Meta embedding cut each way (embedding_split_on_vocab;
# embedding_joined_on_vocab, keyed by its source degree), the vocabulary padding (every
# geometry), of the MoE ones those the kill matrix keeps by default but for the expert-TP
# gathers (an expert's layout: expert_transposed_twice, cheaper than fc1_etp_rank_concat and
# fc2_split_on_wrong_dim), and every pipeline one. The long run names the rest: the same
# kinds over more rows (fc1/fc2_etp, megatron_fc1_rank_concat, output_stale_copy,
# w13_halves_swapped, expert_bucket_not_sent, plain_qkv_read_as_megatron,
# router_bias_not_synced, rope_permute_twice, rope_k_permuted_with_n_heads).
NAMED_BY_DEFAULT = {
    "tp_rank_defaults_to_0", "megatron_qkv_read_as_plain", "kv_replica_modulo",
    "rope_permute_missing", "qkv_bias_not_split", "embedding_split_on_vocab",
    "embedding_joined_on_vocab", "vocab_padding_per_rank", "local_expert_id_as_global",
    "ep_remainder_to_last", "router_bias_negated", "expert_transposed_twice",
    "shared_gate_dropped", "qk_norm_from_next_layer", *(m.name for m in PIPELINE_MUTATIONS)}


def test_the_default_run_names_in_every_geometry_and_convention_the_whole_matrix_does():
    """The default run's share of the conversion matrix (``NAMED_BY_DEFAULT``) has cells in
    every geometry from every source and into every destination convention the whole
    matrix has, keyed by the destination and by the source degree."""
    kept = [(m, c) for m, c in CONVERSION_CELLS if m.name in NAMED_BY_DEFAULT]
    for where in (lambda c: (c.config.name, c.src.name), lambda c: (c.config.name, c.dst.name)):
        assert {where(c) for _, c in kept} == {where(c) for _, c in CONVERSION_CELLS}
    assert {m.depends_on for m, _ in kept} == {m.depends_on for m, _ in CONVERSION_CELLS}


@pytest.mark.parametrize("mutation", breadth(
    [pytest.param(m, id=m.name) for m in CONVERSION_MUTATIONS], keep=NAMED_BY_DEFAULT,
    name=lambda p: p.id))
def test_every_conversion_mutation_is_named_as_itself_or_as_those_it_coincides_with(
        checkers_by_name, mutation):
    cells = [c for m, c in CONVERSION_CELLS if m is mutation]
    assert cells, "not live anywhere in the matrix: the test would be vacuous"
    for conversion in cells:
        checker, src, dst = checkers_by_name[conversion.config.name], conversion.src, conversion.dst
        shards = mutation.apply(checker.declared(dst), conversion)
        verdict = checker.verdict(shards, src=src, dst=dst, mutation=mutation.name)
        expected = set(_conversion_oracle(checker, conversion, shards))
        assert mutation.name in expected, (str(conversion), expected)
        assert verdict.named_mutation is not None, str(verdict)
        assert set(verdict.named_mutation.split(", ")) == expected, (str(conversion),
                                                                      str(verdict))


def test_correct_conversions_are_never_named(small):
    for src in _endpoints(SMALL):
        for dst in _endpoints(SMALL):
            if src.name == dst.name == "plain" or src.degree == 1:  # one source per destination
                out = convert(small.source(src), src, dst, SMALL)
                verdict = small.verdict(out, src=src, dst=dst)
                assert verdict.passed and verdict.named_mutation is None, (str(src), str(dst))


def test_a_conversion_bug_outside_the_catalogue_is_not_named(small):
    """The twin: vLLM's first two Q heads on rank 0 exchanged is diagnosed, and no catalogued
    mutation makes those bytes."""
    src, dst = endpoint("hf"), endpoint("vllm:2")
    qkv = "model.layers.0.self_attn.qkv_proj.weight"

    def wrong(shards, degree):
        out = convert(shards, src, dst, SMALL)
        w, hd = out[0][qkv].clone(), SMALL.head_dim
        w[:hd], w[hd:2 * hd] = out[0][qkv][hd:2 * hd], out[0][qkv][:hd]
        out[0][qkv] = w
        return out

    verdict = check_convert(wrong, SMALL, "hf", "vllm:2", threshold=1.0)
    assert verdict.first_mismatch == qkv and verdict.diagnosis[0].startswith(
        f"rank 0 {qkv} holds Q head 1, Q head 0, Q heads 2-3")
    shards = wrong(small.source(src), 2)
    assert set(_conversion_oracle(small, Conversion(SMALL, src, dst), shards)) == set()
    assert verdict.named_mutation is None


def test_a_conversion_says_which_public_bug_it_is():
    def rank0(shards, degree):
        out = convert(shards, "megatron:2", "vllm:2", SMALL)
        return next(m for m in CONVERSION_MUTATIONS if m.name == "tp_rank_defaults_to_0").apply(
            out, Conversion(SMALL, endpoint("megatron:2"), endpoint("vllm:2")))

    verdict = check_convert(rank0, SMALL, "megatron:2", "vllm:2", threshold=1.0)
    assert verdict.named_mutation == "tp_rank_defaults_to_0"
    assert verdict.named_meaning == (
        "every rank loads rank 0's shard of the fused qkv and gate_up; modelled on "
        "vllm-gguf-plugin #103 (fix #106): kwargs.get('tp_rank', 0) in load_qkv_weight and "
        "load_merged_column_weight")

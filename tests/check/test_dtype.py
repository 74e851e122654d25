"""bf16 and fp16 weights: shards compared bit for bit in the synced dtype, both forwards in
fp32 from those values, judged by the dtype's own measured floor (``phase1a_bf16.json``,
``phase1a_fp16.json``); a shard of the wrong dtype is the user's typed error, and a silent
round trip through another dtype is caught by the byte check even where the logits pass."""

import dataclasses

import pytest
import torch

from weight_sync_bench import (
    TOY,
    TOY_KV4,
    Checker,
    check_reshard,
    check_split,
    layout_for,
    split,
)
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.check.mutations import DTYPE_MUTATIONS, mutation_by_name
from weight_sync_bench.errors import InvalidConfig, WrongUserShard
from weight_sync_bench.fuzz.domain import DOMAIN
from weight_sync_bench.layout.reshard import reshard
from weight_sync_bench.model.config import init_params, parse_dtype
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.rules import load_artifact, threshold_from

LAYOUT = layout_for(TOY)


def declared_split(full, degree):
    return split(full, LAYOUT, degree)


def declared_reshard(shards, dst):
    return reshard(shards, layout_for(TOY_KV4), dst)


def naive_split(full, degree):
    """Every fused qkv cut contiguously: the classic layout bug, in any dtype."""
    shards = declared_split(full, degree)
    for rank, chunk in enumerate(full["layers.0.qkv.weight"].chunk(degree, dim=0)):
        shards[rank]["layers.0.qkv.weight"] = chunk.clone()
    return shards


@pytest.fixture(scope="module")
def bf16():
    return Checker(TOY, dtype="bf16")


@pytest.fixture(scope="module")
def fp32():
    return Checker(TOY)


def test_bf16_and_fp16_weights_are_the_fp32_draws_rounded_and_fp32_is_unchanged():
    small = TOY.replace(vocab=64, n_layers=1)
    fp32 = init_params(small, 3)
    for name in ("bf16", "fp16"):
        low = init_params(small, 3, dtype=parse_dtype(name))
        assert all(low[n].dtype == parse_dtype(name) for n in low)
        assert all(torch.equal(low[n], fp32[n].to(parse_dtype(name))) for n in fp32)
    assert all(x.dtype == torch.float32 for x in fp32.values())
    with pytest.raises(InvalidConfig, match="dtype 'int8' is not a synced weight dtype; "
                                            "known: fp32, bf16, fp16"):
        parse_dtype("int8")


def test_a_correct_bf16_split_passes_under_the_bf16_floor(bf16):
    verdict = check_split(declared_split, TOY, 2, dtype="bf16")
    assert verdict.passed and verdict.dtype == "bf16" and verdict.first_mismatch is None
    assert verdict.threshold == threshold_from(load_artifact("1a",
                                                             artifact_path(dtype="bf16")))
    assert str(verdict).startswith("PASS toy split -> 2 (phase 1a, bf16 weights)")
    assert verdict.max_abs_error == bf16.declared_error(2)
    assert bf16.floor.path == artifact_path(dtype="bf16") and bf16.floor.source == "committed"


def test_a_correct_fp16_reshard_passes_under_the_fp16_floor():
    verdict = check_reshard(declared_reshard, TOY_KV4, 4, 2, dtype=torch.float16)
    assert verdict.passed and verdict.dtype == "fp16"
    assert verdict.threshold == threshold_from(load_artifact("1a",
                                                             artifact_path(dtype="fp16")))


def test_the_forward_computes_in_fp32_from_the_bf16_values(bf16):
    # the reference of the bf16 check is the fp32 reference of the rounded weights, exactly
    from weight_sync_bench.model.reference import ReferenceModel
    upcast = {n: x.float() for n, x in bf16.full.items()}
    assert torch.equal(bf16.reference, ReferenceModel(TOY, upcast)(bf16.tokens))
    assert all(x.dtype == torch.bfloat16 for x in bf16.declared(2)[0].values())


def test_a_split_returning_fp32_shards_for_bf16_weights_names_rank_name_and_dtypes():
    def upcasts_one(full, degree):
        shards = declared_split(full, degree)
        shards[1]["layers.2.gate_up.weight"] = shards[1]["layers.2.gate_up.weight"].float()
        return shards

    with pytest.raises(WrongUserShard) as caught:
        check_split(upcasts_one, TOY, 2, dtype="bf16")
    err = caught.value
    assert (err.rank, err.name) == (1, "layers.2.gate_up.weight")
    assert (err.expected_dtype, err.actual_dtype) == (torch.bfloat16, torch.float32)
    assert ("returned shards that do not fit the layout: rank 1 layers.2.gate_up.weight: "
            "dtype torch.float32, expected torch.bfloat16") in str(err)


def test_one_bf16_ulp_in_one_shard_fails_the_byte_check_and_the_untouched_shards_pass(bf16):
    clean = bf16.verdict(bf16.declared(2), dst=2)
    assert clean.passed  # the twin: the declared bf16 shards, byte for byte
    shards = [dict(p) for p in bf16.declared(2)]
    bits = shards[1]["norm.weight"].clone().view(torch.int16)
    bits[5] ^= 1  # the last mantissa bit of one element
    shards[1]["norm.weight"] = bits.view(torch.bfloat16)
    verdict = bf16.verdict(shards, dst=2)
    assert not verdict.passed and verdict.first_mismatch == "norm.weight"
    assert verdict.mismatches == ("norm.weight",)


def test_a_naive_bf16_split_is_diagnosed_as_the_fp32_one_is(bf16, fp32):
    full = {n: x.clone() for n, x in bf16.full.items()}
    low = bf16.verdict(naive_split(full, 2), dst=2)
    high = fp32.verdict(naive_split({n: x.clone() for n, x in fp32.full.items()}, 2), dst=2)
    assert not low.passed and low.ratio > 100
    assert low.diagnosis == high.diagnosis == (
        "rank 0 layers.0.qkv.weight holds Q heads 0-5; declared Q heads 0-3, K head 0, V head 0",
        "rank 1 layers.0.qkv.weight holds Q heads 6-7, K heads 0-1, V heads 0-1; declared "
        "Q heads 4-7, K head 1, V head 1")


@pytest.mark.parametrize("name", ["bf16_round_trip", "fp16_round_trip"])
def test_a_round_trip_through_a_narrower_dtype_is_caught_by_the_byte_check(fp32, name):
    mutated = mutation_by_name(name).apply(fp32.declared(2), fp32.layout, TOY)
    assert all(mutated[r][n].dtype == torch.float32 for r in range(2) for n in mutated[r])
    verdict = fp32.verdict(mutated, dst=2, mutation=name)
    assert not verdict.passed and verdict.first_mismatch == "tok_embeddings.weight"
    assert len(verdict.mismatches) == len(LAYOUT)  # every parameter was rounded
    assert fp32.verdict(fp32.declared(2), dst=2).passed  # the twin


def test_a_bf16_round_trip_of_one_weight_stays_inside_the_logits_tolerance_so_only_bytes_catch_it(
        fp32):
    # one row-parallel weight rounded through bf16 moves the logits by less than the
    # threshold (0.44x here): the tolerance alone would pass it, the byte check does not
    one = dataclasses.replace(mutation_by_name("bf16_round_trip"), target=r"layers\.3\.down\.weight")
    verdict = fp32.verdict(one.apply(fp32.declared(2), fp32.layout, TOY), dst=2)
    assert verdict.finite and fp32.declared_error(2) < verdict.max_abs_error <= verdict.threshold
    assert verdict.first_mismatch == "layers.3.down.weight" and not verdict.passed
    # the whole model rounded moves them past it (7.9x): both checks fail it
    every = fp32.verdict(mutation_by_name("bf16_round_trip").apply(
        fp32.declared(2), fp32.layout, TOY), dst=2)
    assert every.ratio > 1 and every.first_mismatch is not None


# A geometry small enough to run at every synced dtype; kv 2 so t=2 has two ranks
SMALL = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                      vocab_per_kv_head=16, n_layers=1, batch=1, seq_len=4)
CELLS = [(m, d) for m in DTYPE_MUTATIONS for d in ("fp32", "bf16", "fp16")]


@pytest.mark.parametrize("mutation, dtype", CELLS, ids=[f"{m.name}-{d}" for m, d in CELLS])
def test_a_dtype_mutation_is_the_identity_exactly_where_it_says(mutation, dtype):
    weights = parse_dtype(dtype)
    checker = Checker(SMALL, threshold=1.0, dtype=weights)
    declared = checker.declared(2)
    mutated = mutation.apply(declared, checker.layout, SMALL)
    changed = any(not bit_equal(m[n], d[n]) for m, d in zip(mutated, declared) for n in d)
    reason = mutation.identity_reason(SMALL, 2, weights)
    if weights == torch.bfloat16 and mutation.name == "fp16_round_trip":
        assert reason is not None and "not declared" in reason  # lossy only at the extremes
        return
    assert changed == (reason is None), f"{mutation.name} on {dtype}: declared {reason!r}"
    verdict = checker.verdict(mutated, dst=2)
    assert (verdict.first_mismatch is None) == (reason is not None)

"""The public API users validate their own split and reshard functions with."""

import pytest
import torch

from tests.breadth import breadth
from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import (
    TOY,
    TOY_KV4,
    Checker,
    InvalidShards,
    check_reshard,
    check_split,
    gather,
    layout_for,
    reshard,
    split,
)
from weight_sync_bench.check.diagnosis import format_indices
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.errors import ModifiedInput

LAYOUT = layout_for(TOY)


def declared_split(full, degree):
    return split(full, LAYOUT, degree)


def naive_split(full, degree):
    """The classic bug: every sharded tensor cut contiguously along its sharded dim."""
    shards = declared_split(full, degree)
    for name in full:
        if name.endswith(("qkv.weight", "gate_up.weight")):
            for rank, chunk in enumerate(full[name].chunk(degree, dim=0)):
                shards[rank][name] = chunk.clone()
    return shards


def test_a_correct_split_function_passes_with_the_numbers_reported():
    verdict = check_split(declared_split, TOY, 2)
    assert verdict.passed and verdict.first_mismatch is None
    assert (verdict.src, verdict.dst) == (None, 2)
    assert 0 < verdict.max_abs_error <= verdict.threshold
    assert str(verdict).startswith("PASS toy split -> 2 (phase 1a)")


def test_a_naive_split_fails_and_the_report_names_the_heads_each_rank_holds():
    verdict = check_split(naive_split, TOY, 2)
    assert not verdict.passed and verdict.ratio > 100
    assert verdict.first_mismatch == "layers.0.qkv.weight"
    assert verdict.mismatches[:2] == ("layers.0.qkv.weight", "layers.0.gate_up.weight")
    assert verdict.diagnosis[:2] == (  # rows 0-191; declared 0-127, 256-287, 320-351
        "rank 0 layers.0.qkv.weight holds Q heads 0-5; declared Q heads 0-3, K head 0, V head 0",
        "rank 1 layers.0.qkv.weight holds Q heads 6-7, K heads 0-1, V heads 0-1; declared "
        "Q heads 4-7, K head 1, V head 1")
    text = str(verdict)
    assert "FAIL toy split -> 2" in text and "max |logit error|" in text and "threshold" in text


# Three pairs by default (each degree once a source and once a destination, the resharder
# called through check_reshard each time), the other six in the long run: the harness's
# reshard passes every pair by default in tests/check/test_invariant.py.
@pytest.mark.parametrize("src, dst", breadth(
    [(src, dst) for src in (1, 2, 4) for dst in (1, 2, 4)],
    keep={"1to4", "4to2", "2to1"}, name=lambda pair: f"{pair[0]}to{pair[1]}"))
def test_a_correct_reshard_function_passes_for_every_pair(src, dst):
    verdict = check_reshard(lambda shards, d: reshard(shards, layout_for(TOY_KV4), d),
                            TOY_KV4, src, dst)
    assert verdict.passed, str(verdict)


def test_a_reshard_that_reverses_rank_order_is_diagnosed():
    def reversed_o_proj(shards, dst):
        out = reshard(shards, layout_for(TOY_KV4), dst)
        return MUTATIONS["o_proj_reversed"].apply(out, layout_for(TOY_KV4), TOY_KV4)

    verdict = check_reshard(reversed_o_proj, TOY_KV4, 2, 4)
    assert not verdict.passed and verdict.first_mismatch == "layers.0.o_proj.weight"
    assert verdict.diagnosis[0] == (
        "rank 0 layers.0.o_proj.weight holds columns 192-255; declared columns 0-63")


def test_bytes_that_differ_fail_even_when_the_logits_stay_within_tolerance():
    """Data movement has no tolerance: one flipped low mantissa bit is a failed sync."""
    def flip_one_bit(full, degree):
        shards = declared_split(full, degree)
        w = shards[1]["layers.3.down.weight"]
        w.view(torch.int32)[0, 0] ^= 1
        return shards

    verdict = check_split(flip_one_bit, TOY, 2)
    assert verdict.max_abs_error <= verdict.threshold  # the forward cannot see it
    assert not verdict.passed and verdict.first_mismatch == "layers.3.down.weight"
    assert verdict.diagnosis == (
        "rank 1 layers.3.down.weight holds columns ?, 353-703; declared columns 352-703",)


def test_non_finite_logits_never_pass_even_with_declared_bytes():
    def nan_forward(config, shards, tokens):
        logits = inprocess_forward(config, shards, tokens)
        return logits.index_fill(-1, torch.tensor([5]), float("nan"))

    checker = Checker(TOY_KV4, forward=nan_forward)
    verdict = checker.verdict(checker.declared(2), dst=2)
    assert verdict.first_mismatch is None and not verdict.finite and not verdict.passed
    assert "logits are not finite" in str(verdict)


# The two tests below run on TOY over a 512-word vocabulary (a fifth of its weights:
# what they check does not depend on the vocabulary, every shape a message names is TOY's),
# judged by an explicit threshold, 100x what its declared shards deviate by (1e-6).
NARROW = narrowed(TOY)
NARROW_LAYOUT = layout_for(NARROW)


@pytest.mark.parametrize("corrupt, message", [
    (lambda s: s.pop(), r"expected 2 rank dicts at t=2, got 1"),
    (lambda s: s[1].pop("norm.weight"), r"rank 1: missing norm\.weight"),
    (lambda s: s[0].update({"bias": torch.zeros(1)}), r"rank 0: unexpected bias"),
    (lambda s: s[1].update({"layers.1.qkv.weight": torch.zeros(384, 256)}),
     r"rank 1 layers\.1\.qkv\.weight: shape \[384, 256\], declared \[192, 256\] \(HP\(8,2,32\) at t=2\)"),
    (lambda s: s[0].update({"norm.weight": s[0]["norm.weight"].double()}),
     r"rank 0 norm\.weight: dtype torch\.float64, expected torch\.float32"),
    (lambda s: s[0].update({"norm.weight": [1.0] * 256}), r"rank 0 norm\.weight: expected a Tensor, got list"),
])
def test_malformed_shards_raise_a_typed_error_naming_rank_and_parameter(corrupt, message):
    def bad_split(full, degree):
        shards = split(full, NARROW_LAYOUT, degree)
        corrupt(shards)
        return shards

    with pytest.raises(InvalidShards, match=message):
        check_split(bad_split, NARROW, 2, threshold=THRESHOLD)


def test_the_user_function_cannot_corrupt_the_harness_copy_of_the_weights():
    """It gets copies (the reference is never touched), and writing into them is named:
    in a weight sync the input is the trainer's weights (``user_code.call``)."""
    checker = Checker(NARROW, threshold=THRESHOLD)
    before = {n: t.clone() for n, t in checker.full.items()}

    def destructive(full, degree):
        shards = split(full, NARROW_LAYOUT, degree)
        for t in full.values():
            t.zero_()
        return shards

    with pytest.raises(ModifiedInput, match="modified in place `tok_embeddings.weight`"):
        check_split(destructive, NARROW, 2, threshold=THRESHOLD)
    fresh = Checker(NARROW, threshold=THRESHOLD).full
    assert all(torch.equal(before[n], t) for n, t in fresh.items())
    assert check_split(lambda full, degree: split(full, NARROW_LAYOUT, degree), NARROW, 2,
                       threshold=THRESHOLD).passed  # the twin


def test_diagnosis_round_trips_through_gather():
    """A diagnosis describes shards relative to the full tensor, so gathering the declared
    shards reproduces it: the comparison is against the layout, not a round trip."""
    checker = Checker(TOY_KV4)
    assert all(torch.equal(a, checker.full[n]) for n, a in gather(checker.declared(4), checker.layout).items())


def test_format_indices_compresses_runs_and_marks_unknown_slices():
    assert format_indices([0, 1, 2, 7, None, None, 9]) == "0-2, 7, ? x2, 9"
    assert format_indices([5, 4]) == "5, 4"


def test_byte_comparison_is_bitwise_not_numeric():
    from weight_sync_bench.check.diagnosis import bit_equal

    zero, neg_zero, nan = torch.tensor([0.0]), torch.tensor([-0.0]), torch.tensor([float("nan")])
    assert not bit_equal(zero, neg_zero)  # numerically equal, different bytes
    assert bit_equal(nan, nan.clone())  # numerically unequal, same bytes
    x = torch.randn(4, 3, dtype=torch.bfloat16)
    assert bit_equal(x.t(), x.t().contiguous()) and not bit_equal(x, x.to(torch.float16))
    y = x.clone()
    y.view(torch.int16)[2, 1] ^= 1
    assert not bit_equal(x, y)

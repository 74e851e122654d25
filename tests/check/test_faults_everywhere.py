"""Reusable checks that a verdict is computed from everything that was checked, not from a
part of it (issue "The checker's own checks"): a one-bit fault placed on the first and on
the last rank, in every way a check can run (whole, streamed per layer, streamed per
parameter; split and reshard); every bit-exact comparison fed a difference that keeps the
value equal (``-0.0`` for ``+0.0``, another NaN payload) as well as one that changes it, on
both of its paths (one slab, and the chunked path past ``_CHUNK``) and in its last chunk;
every deviation fed NaN and Inf. Each fault has its twin: the same run without it passes."""

from __future__ import annotations

import math

import pytest
import torch

from tests.breadth import breadth
from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import TOY, TOY_KV4, check_reshard, check_split, layout_for
from weight_sync_bench.check import diagnosis
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.check.stream import stage_reshard, stage_split
from weight_sync_bench.training.compare import deviation, max_abs_difference

STREAMS = [None, "layer", "parameter"]
NAME = "layers.1.down.weight"  # a row-parallel weight every rank holds a piece of
# TOY and TOY_KV4 over a 512-word vocabulary (a fifth of the cost: their 32000-word embedding
# and head are most of their weights), judged by an explicit threshold: no floor is committed
# for them, and the fault is in the bytes, which no threshold excuses.
NARROW, NARROW_KV4 = narrowed(TOY), narrowed(TOY_KV4)


def flip_low_bit(shards, rank, name):
    """The lowest mantissa bit of the last element of ``rank``'s ``name``: no forward sees
    it, the bytes do."""
    if name in shards[rank]:
        x = shards[rank][name].clone()
        x.view(-1).view(torch.int32)[-1] ^= 1
        shards[rank][name] = x
    return shards


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("where", breadth(["first", "last"], keep={"last"}))  # first: most tests
def test_a_split_with_one_wrong_bit_on_any_rank_fails_however_it_is_checked(stream, where):
    split = stage_split(layout_for(NARROW))
    degree = 2
    rank = 0 if where == "first" else degree - 1

    def wrong(full, d):
        return flip_low_bit(split(full, d), rank, NAME)

    verdict = check_split(wrong, NARROW, degree, stream=stream, threshold=THRESHOLD)
    assert not verdict.passed and verdict.first_mismatch == NAME, verdict
    assert verdict.max_abs_error <= verdict.threshold  # the bytes, not the forward, fail it
    assert check_split(split, NARROW, degree, stream=stream, threshold=THRESHOLD).passed  # twin


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("where", breadth(["first", "last"], keep={"last"}))  # first: most tests
def test_a_reshard_with_one_wrong_bit_on_any_rank_fails_however_it_is_checked(stream, where):
    reshard = stage_reshard(layout_for(NARROW_KV4))
    src, dst = 2, 4
    rank = 0 if where == "first" else dst - 1

    def wrong(shards, d):
        return flip_low_bit(reshard(shards, d), rank, NAME)

    verdict = check_reshard(wrong, NARROW_KV4, src, dst, stream=stream, threshold=THRESHOLD)
    assert not verdict.passed and verdict.first_mismatch == NAME, verdict
    assert check_reshard(reshard, NARROW_KV4, src, dst, stream=stream,
                         threshold=THRESHOLD).passed  # the twin


def value_equal_variants(x: torch.Tensor, at: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(what, a, b)``: pairs that differ only at flat index ``at``, by a value-equal change
    (the sign of a zero, a NaN's payload) or a value change (one low bit)."""
    out = []
    a, b = x.clone(), x.clone()
    a.view(-1)[at], b.view(-1)[at] = 0.0, -0.0
    out.append(("+0.0 / -0.0", a, b))
    a, b = x.clone(), x.clone()
    a.view(-1).view(torch.int32)[at] = 0x7FC00000  # the canonical quiet NaN
    b.view(-1).view(torch.int32)[at] = 0x7FC00001  # another payload
    out.append(("NaN payloads", a, b))
    a, b = x.clone(), x.clone()
    b.view(-1).view(torch.int32)[at] ^= 1
    out.append(("one low bit", a, b))
    return out


@pytest.mark.parametrize("size", ["one slab", "chunked"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_bit_equal_sees_value_equal_differences_on_both_paths(monkeypatch, size, where):
    if size == "chunked":  # the chunked path, without allocating 16 MiB slabs
        monkeypatch.setattr(diagnosis, "_CHUNK", 64)
    x = torch.randn(40, 16)  # 640 elements: ten 64-element slabs when chunked
    at = 0 if where == "first" else x.numel() - 1
    for what, a, b in value_equal_variants(x, at):
        assert not bit_equal(a, b), what
        assert bit_equal(a, a.clone()), what  # the twin: the same bytes (NaN included)


@pytest.mark.parametrize("where", ["first", "last"])
def test_bit_equal_sees_value_equal_differences_in_a_strided_view(where):
    """A column slice is compared through its integer view in place (no contiguous copy):
    a -0.0, another NaN payload or a low bit in it is a difference; the same bytes in
    another strided slice are not (the twin)."""
    x = torch.randn(40, 17)  # a column slice of it: 40 rows of 16, stride 17
    at = 0 if where == "first" else 40 * 16 - 1
    for what, a, b in value_equal_variants(x[:, 1:].contiguous(), at):
        wide_a, wide_b = torch.randn(40, 17), torch.randn(40, 17)
        wide_a[:, 1:], wide_b[:, 1:] = a, b
        assert not wide_a[:, 1:].is_contiguous()
        assert not bit_equal(wide_a[:, 1:], wide_b[:, 1:]), what
        assert bit_equal(wide_a[:, 1:], wide_a.clone()[:, 1:]), what  # the twin


def test_a_deviation_is_never_zero_for_a_nan_or_inf_difference():
    want = torch.randn(300)
    for poison in (float("nan"), float("inf"), float("-inf")):
        got = want.clone()
        got[-1] = poison
        assert deviation(got, want, 1.0) == math.inf, poison
        assert deviation(got, want, 0.0) == math.inf, poison
        assert not max_abs_difference(got, want) <= 0.0, poison
    assert deviation(want.clone(), want, 1.0) == 0.0  # the twin
    both = want.clone()
    both[-1] = float("nan")  # NaN on both sides is still not a deviation of zero
    assert deviation(both, both.clone(), 1.0) == math.inf

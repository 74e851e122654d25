"""The comparison's blockwise kernels return, bit for bit, what the plain whole-tensor
expressions they replace return (``training.compare``): the fp64 ``max |got - want|``
through an fp32 pass that recomputes in fp64 only the blocks reaching the largest fp32
value, ``max |x|`` from ``aminmax``, a same-dtype ``max |x - y|``, and the L2 norm of a
difference in a reused fp64 scratch. Each case is built so that a shortcut that is not exact
would show: fp32 ties whose fp64 values differ, NaN, overflow, signed zeros, subnormals,
fp64 inputs (which must not be modified), broadcasting and non-contiguous views."""

import math

import pytest
import torch

from weight_sync_bench.training.compare import (
    BLOCK,
    _absmax,
    max_abs_difference,
    max_abs_difference_in_dtype,
    update_deviation,
)

ULP1 = 2.0 ** -23  # fp32 spacing just above 1.0


def plain(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max())


def same(x: float, y: float) -> bool:
    """Equal to the bit, NaN equal to NaN."""
    return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))


def noisy_pair(blocks: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    want = torch.randn(blocks * BLOCK, generator=g)
    return want + 1e-3 * torch.randn(blocks * BLOCK, generator=g), want


def tied_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Block 0 and block 2 both reach the largest fp32 difference, 1 + 2^-23; block 2's exact
    (and fp64) difference is 2^-25 larger, which fp32 rounds away."""
    got, want = noisy_pair()
    got[5], want[5] = 1.0 + ULP1, 0.0  # exactly 1 + 2^-23
    got[2 * BLOCK + 7], want[2 * BLOCK + 7] = 1.0 + ULP1, -(2.0 ** -25)  # 1 + 2^-23 + 2^-25
    return got, want


def test_the_tie_is_real_fp32_sees_two_equal_maxima_fp64_the_later_one_larger():
    got, want = tied_pair()
    d32 = (got - want).abs()
    assert d32[5] == d32[2 * BLOCK + 7] == d32.max()  # a first-block-only recompute would stop
    assert plain(got, want) == 1.0 + ULP1 + 2.0 ** -25 != float(d32.max())


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    out = [("noise", *noisy_pair()), ("tie across blocks", *tied_pair())]
    got, want = noisy_pair(seed=1)
    out.append(("equal", want.clone(), want))
    zeros = torch.zeros(2 * BLOCK)
    out.append(("signed zeros", -zeros, zeros))
    got, want = noisy_pair(seed=2)
    got[BLOCK + 3] = float("nan")
    out.append(("NaN in block 1", got, want))
    got, want = noisy_pair(seed=3)
    got[3], want[3] = float("inf"), float("inf")
    out.append(("inf - inf", got, want))
    got, want = noisy_pair(seed=4)
    got[9], want[9] = 3e38, -3e38  # overflows in fp32, finite in fp64
    got[2 * BLOCK], want[2 * BLOCK] = 3.4e38, -1e38  # overflows too, smaller in fp64
    out.append(("fp32 overflow ties", got, want))
    tiny = torch.zeros(2 * BLOCK)
    tiny[BLOCK + 1] = 2.0 ** -149  # the smallest subnormal: the only difference
    out.append(("a lone subnormal", tiny, torch.zeros(2 * BLOCK)))
    got, want = noisy_pair(seed=5)
    out.append(("fp64 inputs", got.double(), want.double()))
    out.append(("fp64 against fp32", got.double(), want))
    out.append(("bf16 inputs", got.bfloat16(), want.bfloat16()))
    table = torch.randn(3 * BLOCK // 64, 64, generator=torch.Generator().manual_seed(6))
    out.append(("transposed views", table.t(), (table + 1e-3).t()))
    out.append(("one block", got[:100], want[:100]))
    out.append(("empty rows", got[:0], want[:0]))
    out.append(("broadcast", got[:BLOCK].view(8, -1), want[:BLOCK // 8]))
    return out


@pytest.mark.parametrize("name, got, want", _cases(), ids=[c[0] for c in _cases()])
def test_max_abs_difference_is_the_plain_fp64_expression_to_the_bit(name, got, want):
    before = got.clone(), want.clone()
    expected = plain(got, want) if got.numel() else 0.0
    assert same(max_abs_difference(got, want) if got.numel() else 0.0, expected), name
    assert unchanged(got, before[0]) and unchanged(want, before[1])


def unchanged(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))


def test_fp64_inputs_are_not_modified_in_place():
    got, want = noisy_pair(seed=7)
    got, want = got.double(), want.double()
    kept = got.clone()
    max_abs_difference(got, want)
    max_abs_difference(got[:10], want[:10])
    assert torch.equal(got, kept)


@pytest.mark.parametrize("name, got, want", _cases()[:-2], ids=[c[0] for c in _cases()[:-2]])
def test_absmax_and_the_same_dtype_difference_are_the_plain_expressions(name, got, want):
    if got.dtype != want.dtype:
        want = want.to(got.dtype)
    assert same(_absmax(got), float(got.double().abs().max()) if got.numel() else 0.0), name
    if got.numel():
        assert same(max_abs_difference_in_dtype(got, want), float((got - want).abs().max())), name


@pytest.mark.parametrize("poison", [None, float("inf"), float("-inf"), float("nan")])
def test_a_copy_compared_with_itself_reads_zero_unless_it_is_not_finite(poison):
    x, _ = noisy_pair(seed=8)
    if poison is not None:
        x[2 * BLOCK + 11] = poison
    assert same(max_abs_difference_in_dtype(x, x), float((x - x).abs().max()))


def test_the_norm_in_a_reused_scratch_is_the_fresh_tensor_norm_to_the_bit():
    got, want = noisy_pair(blocks=5, seed=9)
    start = want - 1e-3
    scratch = torch.empty(5 * BLOCK, dtype=torch.float64)
    table = got.view(-1, 64)
    for args in ((got, want, start), (table, want.view(-1, 64), start.view(-1, 64)),
                 (table.t(), want.view(-1, 64).t(), start.view(-1, 64).t()),  # falls back
                 (got[:77], want[:77], start[:77])):
        assert same(update_deviation(*args, scratch), update_deviation(*args))
    nan = got.clone()
    nan[3 * BLOCK] = float("nan")
    assert update_deviation(nan, want, start, scratch) == float("inf")

"""The comparison's blockwise kernels return, bit for bit, what the plain whole-tensor
expressions they replace return (``training.compare``): the fp64 ``max |got - want|``
through an fp32 pass that recomputes in fp64 only the blocks reaching the largest fp32
value, ``max |x|`` from ``aminmax`` and a same-dtype ``max |x - y|``; and the L2 norm of a
difference, summed a block at a time in a reused fp64 scratch, within a few fp64 ulps of
the whole-tensor one (a reordered sum, not bit for bit). Each case is built so that a shortcut that is not exact
would show: fp32 ties whose fp64 values differ, NaN, overflow, signed zeros, subnormals,
fp64 inputs (which must not be modified), broadcasting and non-contiguous views."""

import math

import pytest
import torch

from weight_sync_bench.training.compare import (
    BLOCK,
    _absmax,
    difference_and_magnitude,
    max_abs_difference,
    max_abs_difference_in_dtype,
    update_deviation,
)

pytestmark = pytest.mark.usefixtures("comparison_path")
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
    wide = torch.randn(3 * BLOCK // 64, 97, generator=torch.Generator().manual_seed(13))
    out.append(("column slices", wide[:, 5:88], (wide + 1e-3)[:, 2:85]))
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


def _magnitude_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """_cases plus references whose largest magnitude lies in the last, partial block, as
    a negative value, or is NaN or infinite past the first block."""
    out = _cases()
    for where, value in (("largest in the last partial block", 50.0),
                         ("largest negative, last block", -50.0),
                         ("NaN in the reference, block 2", float("nan")),
                         ("-inf in the reference, block 1", float("-inf"))):
        got, want = noisy_pair(seed=11)
        got, want = torch.cat([got, got[:5]]), torch.cat([want, want[:5]])
        at = {50.0: -1, -50.0: -2}.get(value, 2 * BLOCK + 1 if value != value else BLOCK + 2)
        want[at] = value
        out.append((where, got, want))
    return out


@pytest.mark.parametrize("name, got, want", _magnitude_cases(),
                         ids=[c[0] for c in _magnitude_cases()])
def test_the_difference_and_the_references_magnitude_in_one_pass_are_each_to_the_bit(
        name, got, want):
    """``difference_and_magnitude``: ``max_abs_difference`` and ``_absmax`` of the
    reference, each to the bit, wherever the largest of either lies (the magnitude only
    where the difference is not NaN: then the deviation is infinite whatever the scale)."""
    if not got.numel():
        return
    difference, magnitude = difference_and_magnitude(got, want)
    assert same(difference, plain(got, want)), name
    if not math.isnan(difference):
        assert same(magnitude, float(want.double().abs().max())), name


def test_the_one_pass_pair_broadcasts_past_one_block_as_the_plain_expressions_do():
    g = torch.Generator().manual_seed(12)
    got, row = torch.randn(8, BLOCK // 4, generator=g), torch.randn(BLOCK // 4, generator=g)
    assert got.numel() > BLOCK  # past the one-block shortcut
    assert difference_and_magnitude(got, row) == (plain(got, row),
                                                  float(row.double().abs().max()))


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


def test_the_blockwise_norm_is_the_fresh_tensor_norm_within_fp64_rounding(comparison_path):
    """Summed a block at a time in the scratch, or whole without one (non-contiguous views,
    short tensors, no scratch): both within 1e-12 of ``torch.norm`` of the fresh fp64
    difference, its reordered sum; NaN anywhere is infinite, exactly 0 stays 0."""
    got, want = noisy_pair(blocks=5, seed=9)
    start = want - 1e-3
    scratch = torch.full((2 * BLOCK,), 7.0, dtype=torch.float64)
    table = got.view(-1, 64)
    for a, b, c in ((got, want, start), (table, want.view(-1, 64), start.view(-1, 64)),
                    (table.t(), want.view(-1, 64).t(), start.view(-1, 64).t()),  # falls back
                    (got[:77], want[:77], start[:77])):
        fresh = (float((a.double() - b.double()).norm())
                 / float((b.double() - c.double()).norm()))
        for s in (scratch, None):
            assert update_deviation(a, b, c, s) == pytest.approx(fresh, rel=1e-12, abs=0)
    if comparison_path == "torch":  # the kernels need no scratch
        assert not torch.all(scratch == 7.0)  # the blocks ran in it
    assert update_deviation(want.clone(), want, start, scratch) == 0.0  # the twin
    nan = got.clone()
    nan[3 * BLOCK] = float("nan")
    assert update_deviation(nan, want, start, scratch) == float("inf")
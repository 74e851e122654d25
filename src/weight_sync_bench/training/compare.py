"""What a training run exposes, and how the sharded one is compared with the reference.

Deviations are relative to the reference's own scale, per parameter, so one threshold
serves parameters whose gradients differ by orders of magnitude: ``max |got - want| /
max |want|`` for the loss, the gradients and AdamW's two moments after every step (so a
wrong beta shows at step 1), and for the parameters after AdamW steps the L2 error relative
to the reference's own update (``update_deviation`` says why not a max). The hyperparameters
each optimizer stepped with are compared exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.model.config import ModelConfig

if TYPE_CHECKING:
    from collections.abc import Iterator

    from weight_sync_bench.training.mesh import Mesh


Params = dict[str, torch.Tensor]
# compared exactly, no threshold: copies that must be byte-identical, the gradient of the
# padded vocab rows, which are no part of the logical model and must be exactly zero, and
# the optimizer hyperparameters each side stepped with. Those catch a wrong lr at step 1:
# the parameters cannot (0.5% of an update of 1e-3 is below the float32 resolution of a
# norm weight near 1, 6e-8 / 1e-3 = 6e-5 of the update, times the 100x safety factor).
EXACT = ("replicas", "padding_grad", "hyperparameters")


@dataclass
class Trace:
    """What a training run exposes for comparison (gradients and inputs of step 1)."""

    losses: list[float]
    input_grad: torch.Tensor  # (B, T, d)
    grads: Params  # global positions
    params: list[Params]  # after each step
    replica_spread: float = 0.0  # max |difference| between copies that must be identical
    # AdamW's moments after each step, in global positions
    exp_avg: list[Params] = field(default_factory=list)
    exp_avg_sq: list[Params] = field(default_factory=list)
    # the hyperparameters of every optimizer the run stepped with (one per local rank)
    hyperparameters: list[dict[str, float]] = field(default_factory=list)


def deviation(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """``max |got - want| / scale``; NaN anywhere reads as infinite; scale 0 demands equality."""
    diff = max_abs_difference(got, want) if got.numel() else 0.0
    if diff != diff:
        return float("inf")
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


# Elements per block of a streamed comparison: a block's scratch (256 KiB in fp32, 512 KiB
# in fp64) stays in L2 cache, where the whole-tensor fp64 copies of a 32000 x 256 table
# (65 MB each, fresh pages every time) cost 10-20x more than the arithmetic.
BLOCK = 1 << 16


def max_abs_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``float((got.double() - want.double()).abs().max())`` to the bit (NaN if a difference
    is NaN), without the two whole-tensor fp64 copies.

    fp32 inputs go block by block: first ``max |got - want|`` in fp32 per block, then the
    fp64 difference of only the blocks that reach the largest fp32 value. That is exact:
    the fp32 and the fp64 difference are both the exact difference correctly rounded, a
    non-decreasing function of it, odd in it; so the element whose exact |difference| is
    largest has the largest fp32 value too, and lies in a block that is recomputed. A zero
    fp32 maximum means every difference is exactly zero (two fp32 values that differ differ
    by at least 2^-149, which rounds to no less)."""
    if got.shape != want.shape or got.numel() <= BLOCK:  # broadcast, or one block: plainly
        return float((got.double() - want.double()).abs().max())
    a, b = got.detach().reshape(-1), want.detach().reshape(-1)
    n = a.numel()
    if not a.dtype == b.dtype == torch.float32:
        worst = 0.0
        for i in range(0, n, BLOCK):
            m = _largest_magnitude(_fp64_difference(a[i:i + BLOCK], b[i:i + BLOCK]))
            if math.isnan(m):
                return m
            worst = max(worst, m)
        return worst
    worst, at = 0.0, []
    for i, m in _blockwise(a, b):
        if math.isnan(m):
            return m
        if m > worst:
            worst, at = m, [i]
        elif m == worst:
            at.append(i)
    if worst == 0.0:
        return 0.0
    return max(_largest_magnitude(_fp64_difference(a[i:i + BLOCK], b[i:i + BLOCK]))
               for i in at)


def _fp64_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.double() - b.double()``: a fresh fp64 copy of ``a`` (never ``a`` itself, even in
    fp64), less ``b`` converted exactly as the subtraction reads it."""
    return a.to(torch.float64, copy=True).sub_(b)


def max_abs_difference_in_dtype(x: torch.Tensor, y: torch.Tensor) -> float:
    """``float((x - y).abs().max())`` to the bit, in the tensors' own dtype, block by block
    (no whole-tensor difference); NaN if a difference is NaN."""
    if x.numel() <= BLOCK or x.shape != y.shape or x.dtype != y.dtype:  # plainly
        return float((x - y).detach().abs().max())
    if x is y:  # a copy shared, not copied: x - x is 0, or NaN where x is not finite
        lo, hi = (float(v) for v in torch.aminmax(x.detach()))
        return 0.0 if math.isfinite(lo) and math.isfinite(hi) else float("nan")
    worst = 0.0
    for _, m in _blockwise(x.detach().reshape(-1), y.detach().reshape(-1)):
        if math.isnan(m):
            return m
        worst = max(worst, m)
    return worst


def _blockwise(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[int, float]]:
    """``(offset, max |a - b|)`` of each ``BLOCK`` of two flat tensors of one dtype, the
    difference computed in that dtype into one reused block of scratch."""
    n = a.numel()
    scratch = torch.empty(min(BLOCK, n), dtype=a.dtype)
    for i in range(0, n, BLOCK):
        size = min(BLOCK, n - i)
        yield i, _largest_magnitude(torch.sub(a[i:i + size], b[i:i + size], out=scratch[:size]))


def _absmax(x: torch.Tensor) -> float:
    """``float(x.double().abs().max())`` (NaN if any is NaN, 0 if empty), without a copy:
    the largest |x| is the larger of |min| and |max|, and fp64 holds every fp32 exactly."""
    if x.numel() <= BLOCK:  # one block: plainly (0 if empty)
        return float(x.double().abs().max()) if x.numel() else 0.0
    return _largest_magnitude(x)


def _largest_magnitude(x: torch.Tensor) -> float:
    """``max |x|`` of a non-empty tensor as the larger of |min| and |max| (NaN if any is)."""
    lo, hi = (float(v) for v in torch.aminmax(x.detach()))
    if math.isnan(lo) or math.isnan(hi):
        return float("nan")
    return max(abs(lo), abs(hi))


def _worst(items: dict[str, float]) -> tuple[float, str]:
    name = max(items, key=lambda n: items[n])
    return items[name], name


def deviations(config: ModelConfig, start: Params, ref: Trace, got: Trace
               ) -> dict[str, tuple[float, str]]:
    """Each quantity's deviation and where it is worst (a parameter name, or "")."""
    grads = gradient_deviations(config, ref, got)
    out = {q: grads[q] for q in ("loss", "input_grad", "param_grad", "kv_grad")}
    out["replicas"] = (got.replica_spread, "")
    out["padding_grad"] = grads["padding_grad"]
    out.update(moment_deviations(ref, got))
    out["hyperparameters"] = (max((relative_difference(h, ref.hyperparameters[0])
                                   for h in got.hyperparameters), default=float("inf")), "")
    out.update(parameter_deviations(start, ref, got))
    return out


def gradient_deviations(config: ModelConfig, ref: Trace, got: Trace
                        ) -> dict[str, tuple[float, str]]:
    """The first step's loss, input gradient, parameter gradients, their K and V rows, and
    the padded vocab rows' gradient (which must be exactly zero)."""
    out: dict[str, tuple[float, str]] = {
        "loss": (deviation(torch.tensor(got.losses[0]), torch.tensor(ref.losses[0]),
                           abs(ref.losses[0])), ""),
        "input_grad": (deviation(got.input_grad, ref.input_grad, _absmax(ref.input_grad)), ""),
        "param_grad": _worst({n: deviation(got.grads[n], g, _absmax(g))
                              for n, g in ref.grads.items()}),
    }
    kv = {}
    for name, g in ref.grads.items():
        if ".qkv." in name:
            want, have = g[config.q_rows:], got.grads[name][config.q_rows:]  # [K | V] rows
            kv[name] = deviation(have, want, _absmax(want))
    out["kv_grad"] = _worst(kv)
    padding = {n: _absmax(g[config.vocab:]) for n, g in got.grads.items()  # rows >= vocab
               if n in ("tok_embeddings.weight", "lm_head.weight")}
    out["padding_grad"] = _worst({n: v if v == v else float("inf") for n, v in padding.items()})
    return out


def moment_deviations(ref: Trace, got: Trace) -> dict[str, tuple[float, str]]:
    """AdamW's first and second moments after every step, worst over parameters and steps."""
    return {quantity: _worst({f"{n} step {k + 1}": deviation(g[n], want, _absmax(want))
                              for k, (w, g) in enumerate(zip(getattr(ref, quantity),
                                                             getattr(got, quantity)))
                              for n, want in w.items()})
            for quantity in ("exp_avg", "exp_avg_sq")}


def parameter_deviations(start: Params, ref: Trace, got: Trace) -> dict[str, tuple[float, str]]:
    """The parameters after the first and after the last step, against the reference's
    update from ``start`` (one step: the same comparison, made once)."""
    sizes = [p.numel() for p in ref.params[0].values()]
    scratch = torch.empty(max(sizes, default=0), dtype=torch.float64)  # reused by every norm
    out: dict[str, tuple[float, str]] = {}
    done: dict[int, tuple[float, str]] = {}
    for quantity, k in (("params_step1", 0), ("params_final", len(ref.params) - 1)):
        if k not in done:
            done[k] = _worst({n: update_deviation(got.params[k][n], p, start[n], scratch)
                              for n, p in ref.params[k].items()})
        out[quantity] = done[k]
    return out


def update_deviation(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor,
                     scratch: torch.Tensor | None = None) -> float:
    """``||got - want|| / ||want - start||`` (L2): the parameter error relative to the
    reference's own update. Not a max, because AdamW's first step is close to
    ``lr * sign(g)``: an element whose gradient sits at the floor (|g| near the rounding
    error of a reordered sum) may flip its whole step, and over millions of elements some
    do, so an elementwise maximum measures that tail rather than the update. ``scratch``
    (fp64, at least ``got.numel()`` elements) holds each difference instead of a fresh
    tensor."""
    diff = _norm_of_difference(got, want, scratch)
    if diff != diff:
        return float("inf")
    scale = _norm_of_difference(want, start, scratch)
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def _norm_of_difference(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None
                        ) -> float:
    """``float((a.double() - b.double()).norm())`` to the bit. In ``scratch`` when both are
    contiguous and of one shape: the same fp64 values, laid out as the fresh difference
    would be, reduced by the same kernel (a norm is not blockwise-exact: the whole tensor
    is reduced at once)."""
    if (scratch is None or a.numel() <= BLOCK or a.shape != b.shape
            or scratch.numel() < a.numel() or not (a.is_contiguous() and b.is_contiguous())):
        return float((a.double() - b.double()).norm())
    d = scratch[:a.numel()]
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    for i in range(0, x.numel(), BLOCK):  # each block subtracted while still in cache
        d[i:i + BLOCK].copy_(x[i:i + BLOCK]).sub_(y[i:i + BLOCK])
    return float(d.view(a.shape).norm())


def relative_difference(got: dict[str, float], want: dict[str, float]) -> float:
    """The largest ``|got - want| / |want|`` over the hyperparameters (inf if one is missing)."""
    worst = 0.0
    for name, value in want.items():
        if name not in got:
            return float("inf")
        worst = max(worst, abs(got[name] - value) / abs(value) if value else
                    (0.0 if got[name] == value else float("inf")))
    return worst


@dataclass(frozen=True)
class Comparison:
    """One compared quantity: its deviation against its threshold (0 for exact ones)."""

    quantity: str
    deviation: float
    threshold: float
    where: str = ""

    @property
    def passed(self) -> bool:
        return self.deviation <= self.threshold

    @property
    def ratio(self) -> float:
        if self.threshold == 0.0:
            return 0.0 if self.deviation == 0.0 else float("inf")
        return self.deviation / self.threshold


@dataclass(frozen=True)
class TrainingReport:
    """Every compared quantity of one training check (config, mesh, batch, recipe)."""

    config: str
    mesh: Mesh
    steps: int
    packed: bool
    comparisons: tuple[Comparison, ...]
    mutation: str | None = None
    losses: tuple[float, float] = (0.0, 0.0)  # (sharded, reference) printed loss of step 1

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    @property
    def worst(self) -> Comparison:
        """The comparison furthest over (or nearest to) its threshold."""
        return max(self.comparisons, key=lambda c: c.ratio)

    @property
    def worst_toleranced(self) -> Comparison:
        """The worst of the quantities with a measured threshold (a finite ratio to report,
        where an exact quantity's violation reads as infinitely many thresholds)."""
        return max((c for c in self.comparisons if c.threshold > 0), key=lambda c: c.ratio)

    @property
    def exact_failures(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if c.threshold == 0 and not c.passed)

    def __getitem__(self, quantity: str) -> Comparison:
        for c in self.comparisons:
            if c.quantity == quantity:
                return c
        raise KeyError(quantity)

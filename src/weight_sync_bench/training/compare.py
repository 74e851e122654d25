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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Union

import torch

from weight_sync_bench.layout.reshard import declared_pieces, gather_tensor
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.training import kernels

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from weight_sync_bench.layout.table import LayoutTable, ShardSpec
    from weight_sync_bench.training.mesh import Mesh


Params = dict[str, torch.Tensor]
# compared exactly, no threshold: copies that must be byte-identical, the gradient of the
# padded vocab rows, which are no part of the logical model and must be exactly zero, and
# the optimizer hyperparameters each side stepped with. Those catch a wrong lr at step 1:
# the parameters cannot (0.5% of an update of 1e-3 is below the float32 resolution of a
# norm weight near 1, 6e-8 / 1e-3 = 6e-5 of the update, times the 100x safety factor).
EXACT = ("replicas", "padding_grad", "hyperparameters")


@dataclass(frozen=True, eq=False)
class Shards:
    """One parameter's tensor as the TP ranks hold it (``tensors[r]``: rank r's shard) with
    its declared spec: compared with the reference's global tensor slice by slice
    (``declared_pieces``: the global rows and columns each shard holds), never gathered
    into a global copy first. Gathering every shard of every step and moment cost the
    training check as much as the reference step itself (``bench/bench_training.py``)."""

    tensors: tuple[torch.Tensor, ...]
    spec: ShardSpec

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.spec.shape)

    def pieces(self, rows: tuple[int, int] | None = None
               ) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
        """``(view of a shard, index of the global tensor it holds)`` per declared piece;
        with ``rows = (lo, hi)``, only what lies in global rows ``[lo, hi)`` of dim 0."""
        out = []
        for piece, index in declared_pieces(self.tensors, self.spec):
            if rows is None:
                out.append((piece, index))
                continue
            lo, hi = rows
            if len(index) == 1:  # cut along dim 0: the rows it holds, [start, stop)
                start, stop = index[0].start, index[0].stop
                a, b = max(lo, start), min(hi, stop)
                if a < b:
                    out.append((piece.narrow(0, a - start, b - a), (slice(a, b),)))
            else:  # replicated, or cut along another dim: every row of dim 0
                out.append((piece.narrow(0, lo, hi - lo), (slice(lo, hi),) + index[1:]))
        return out

    def once(self) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
        """``pieces()`` with each global slice once: where ranks hold copies of one slice
        (replicated KV heads), the last rank's, as ``gather_tensor`` keeps it. For a sum
        over the tensor (a norm), which copies would count twice; a maximum reads them all.
        Refused (``ValueError``) unless the pieces then cover the tensor's elements once."""
        last = {tuple((s.start, s.stop) for s in index): (piece, index)
                for piece, index in self.pieces()}
        if sum(piece.numel() for piece, _ in last.values()) != math.prod(self.spec.shape):
            raise ValueError(f"{self.spec.name}: the declared pieces of {self.spec.placement} "
                             "do not cover the tensor once")
        return list(last.values())

    def pairs(self, full: torch.Tensor, rows: tuple[int, int] | None = None
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(piece of a shard, the slice of ``full`` it declares)``, each pair one shape."""
        return [(piece, full[index]) for piece, index in self.pieces(rows)]

    def gather(self) -> torch.Tensor:
        """The global tensor (``gather_tensor``): for a reader, never for a comparison."""
        return gather_tensor(list(self.tensors), self.spec)


Held = dict[str, Union[torch.Tensor, Shards]]  # global tensors, or the TP ranks' shards


def held(ranks: list[Params], layout: LayoutTable) -> dict[str, Shards]:
    """What the TP ranks ``ranks[r]`` hold of each parameter of ``layout``, as ``Shards``."""
    return {spec.name: Shards(tuple(local[spec.name] for local in ranks), spec)
            for spec in layout}


def gathered(trace: Trace) -> Trace:
    """``trace`` with every ``Shards`` it holds gathered to its global tensor."""
    def whole(tensors: Held) -> Held:
        return {n: x.gather() if isinstance(x, Shards) else x for n, x in tensors.items()}
    return replace(trace, grads=whole(trace.grads), params=[whole(p) for p in trace.params],
                   exp_avg=[whole(m) for m in trace.exp_avg],
                   exp_avg_sq=[whole(m) for m in trace.exp_avg_sq])


def _pairs(got: torch.Tensor | Shards, want: torch.Tensor,
           rows: tuple[int, int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(got, Shards):
        return got.pairs(want, rows)
    return [(got, want)] if rows is None else [(got[rows[0]:rows[1]], want[rows[0]:rows[1]])]


def _largest(values: Iterable[float]) -> float:
    """The largest of ``values`` (0 if none), NaN if any is: Python's ``max`` skips a NaN
    depending on where it stands."""
    worst = 0.0
    for v in values:
        if v != v:
            return v
        worst = max(worst, v)
    return worst


@dataclass
class Trace:
    """What a training run exposes for comparison (gradients and inputs of step 1)."""

    losses: list[float]
    input_grad: torch.Tensor  # (B, T, d)
    grads: Held  # global tensors (the reference), or the TP ranks' shards (a sharded run)
    params: list[Held]  # after each step
    replica_spread: float = 0.0  # max |difference| between copies that must be identical
    # AdamW's moments after each step
    exp_avg: list[Held] = field(default_factory=list)
    exp_avg_sq: list[Held] = field(default_factory=list)
    # the hyperparameters of every optimizer the run stepped with (one per local rank)
    hyperparameters: list[dict[str, float]] = field(default_factory=list)


def deviation(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """``max |got - want| / scale``; NaN anywhere reads as infinite; scale 0 demands equality."""
    return _relative(max_abs_difference(got, want) if got.numel() else 0.0, scale)


def relative_deviation(got: torch.Tensor | Shards, want: torch.Tensor,
                       rows: tuple[int, int] | None = None) -> float:
    """``deviation(got, want, max |want|)`` (``max |want|`` over ``rows`` with them), to the
    bit, each block of ``want`` read once for both (``difference_and_magnitude``); as
    shards, the pieces cover ``want`` (or its rows), so its largest magnitude is theirs, and
    every copy a rank holds is compared."""
    diff, scale = 0.0, 0.0
    for g, w in _pairs(got, want, rows):
        d, m = difference_and_magnitude(g, w) if g.numel() else (0.0, 0.0)
        if d != d:
            return float("inf")
        diff, scale = max(diff, d), _largest((scale, m))
    return _relative(diff, scale)


def _relative(diff: float, scale: float) -> float:
    """``diff / scale``: NaN reads as infinite; scale 0 demands equality."""
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

    A pair the compiled kernels take (``training.kernels``: one fp32 shape, rows
    contiguous) is read once there; the rest is ``_torch_max_abs_difference``.
    the fp32 and the fp64 difference are both the exact difference correctly rounded, a
    non-decreasing function of it, odd in it; so the element whose exact |difference| is
    largest has the largest fp32 value too, and lies in a block that is recomputed. A zero
    fp32 maximum means every difference is exactly zero (two fp32 values that differ differ
    by at least 2^-149, which rounds to no less)."""
    fused = kernels.difference_and_magnitude(got, want)
    return _torch_max_abs_difference(got, want) if fused is None else fused[0]


def _torch_max_abs_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max_abs_difference`` in torch. fp32 inputs go block by block: first ``max |got -
    want|`` in fp32 per block, then the fp64 difference of only the blocks that reach the
    largest fp32 value. That is exact: the fp32 and the fp64 difference are both the exact
    difference correctly rounded, a non-decreasing function of it, odd in it; so the
    element whose exact |difference| is largest has the largest fp32 value too, and lies in
    a block that is recomputed. A zero fp32 maximum means every difference is exactly zero
    (two fp32 values that differ differ by at least 2^-149, which rounds to no less)."""
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
    return _fp32_difference(a, b, magnitude=False)[0]


def difference_and_magnitude(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max_abs_difference(got, want), _absmax(want))``, each to the bit (where the
    difference is NaN, the magnitude of the blocks read until then), reading ``want``
    once: in the compiled kernels where they take the pair, else fp32 blocks take ``max
    |want|`` while the block is in cache. A comparison reads from memory tensors too large
    for any cache, and a second pass over the reference for its scale cost a quarter of the
    comparisons."""
    fused = kernels.difference_and_magnitude(got, want)
    if fused is not None:
        return fused
    if got.shape != want.shape or got.numel() <= BLOCK or not (
            got.dtype == want.dtype == torch.float32):
        return _torch_max_abs_difference(got, want), _absmax(want)
    return _fp32_difference(got.detach().reshape(-1), want.detach().reshape(-1),
                            magnitude=True)


def _fp32_difference(a: torch.Tensor, b: torch.Tensor, *, magnitude: bool
                     ) -> tuple[float, float]:
    """``max_abs_difference``'s fp32 path over two flat fp32 tensors (``max |a - b|`` per
    block, then the fp64 difference of the blocks reaching the largest), and ``max |b|``
    (NaN if any is) with ``magnitude``, else 0. A NaN difference returns at once: its
    deviation is infinite, whatever the scale."""
    worst, at, largest = 0.0, [], 0.0
    for i, m, size in _blockwise(a, b):
        if magnitude:  # a NaN in b is a NaN difference in its block, returned below
            largest = max(largest, _largest_magnitude(b[i:i + size]))
        if math.isnan(m):
            return m, largest
        if m > worst:
            worst, at = m, [i]
        elif m == worst:
            at.append(i)
    if worst == 0.0:
        return 0.0, largest
    return max(_largest_magnitude(_fp64_difference(a[i:i + BLOCK], b[i:i + BLOCK]))
               for i in at), largest


def _fp64_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.double() - b.double()``: a fresh fp64 copy of ``a`` (never ``a`` itself, even in
    fp64), less ``b`` converted exactly as the subtraction reads it."""
    return a.to(torch.float64, copy=True).sub_(b)


def max_abs_difference_in_dtype(x: torch.Tensor, y: torch.Tensor) -> float:
    """``float((x - y).abs().max())`` to the bit, in the tensors' own dtype, block by block
    (no whole-tensor difference); NaN if a difference is NaN."""
    if x.numel() <= BLOCK or x.shape != y.shape or x.dtype != y.dtype:  # plainly
        return float((x - y).detach().abs().max())
    worst = 0.0
    for _, m, _ in _blockwise(x.detach().reshape(-1), y.detach().reshape(-1)):
        if math.isnan(m):
            return m
        worst = max(worst, m)
    return worst


def _blockwise(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[int, float, int]]:
    """``(offset, max |a - b|, size)`` of each ``BLOCK`` of two flat tensors of one dtype,
    the difference computed in that dtype into one reused block of scratch."""
    n = a.numel()
    scratch = torch.empty(min(BLOCK, n), dtype=a.dtype)
    for i in range(0, n, BLOCK):
        size = min(BLOCK, n - i)
        yield i, _largest_magnitude(torch.sub(a[i:i + size], b[i:i + size],
                                              out=scratch[:size])), size


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
    """Each quantity's deviation and where it is worst (a parameter name, or ""). The
    reference's tensors are global; a sharded run's trace taken as the reference (two
    sharded runs compared) is gathered first."""
    ref = gathered(ref)
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
        "input_grad": (relative_deviation(got.input_grad, ref.input_grad), ""),
        "param_grad": _worst({n: relative_deviation(got.grads[n], g)
                              for n, g in ref.grads.items()}),
    }
    kv = {}
    for name, g in ref.grads.items():
        if ".qkv." in name:
            kv_rows = (config.q_rows, g.shape[0])  # the [K | V] rows
            kv[name] = relative_deviation(got.grads[name], g, kv_rows)
    out["kv_grad"] = _worst(kv)
    padding = {n: _padding_absmax(g, config.vocab) for n, g in got.grads.items()
               if n in ("tok_embeddings.weight", "lm_head.weight")}
    out["padding_grad"] = _worst({n: v if v == v else float("inf") for n, v in padding.items()})
    return out


def _padding_absmax(g: torch.Tensor | Shards, vocab: int) -> float:
    """``max |g|`` over the padded vocab rows (rows ``>= vocab``), NaN if any is NaN."""
    if not isinstance(g, Shards):
        return _absmax(g[vocab:])
    return _largest(_absmax(piece) for piece, _ in g.pieces((vocab, g.shape[0])))


def moment_deviations(ref: Trace, got: Trace) -> dict[str, tuple[float, str]]:
    """AdamW's first and second moments after every step, worst over parameters and steps."""
    return {quantity: _worst({f"{n} step {k + 1}": relative_deviation(g[n], want)
                              for k, (w, g) in enumerate(zip(getattr(ref, quantity),
                                                             getattr(got, quantity)))
                              for n, want in w.items()})
            for quantity in ("exp_avg", "exp_avg_sq")}


def parameter_deviations(start: Params, ref: Trace, got: Trace) -> dict[str, tuple[float, str]]:
    """The parameters after the first and after the last step, against the reference's
    update from ``start`` (one step: the same comparison, made once)."""
    scratch = torch.empty(2 * BLOCK, dtype=torch.float64)  # reused by every norm
    out: dict[str, tuple[float, str]] = {}
    done: dict[int, tuple[float, str]] = {}
    for quantity, k in (("params_step1", 0), ("params_final", len(ref.params) - 1)):
        if k not in done:
            done[k] = _worst({n: update_deviation(got.params[k][n], p, start[n], scratch)
                              for n, p in ref.params[k].items()})
        out[quantity] = done[k]
    return out


def update_deviation(got: torch.Tensor | Shards, want: torch.Tensor, start: torch.Tensor,
                     scratch: torch.Tensor | None = None) -> float:
    """``||got - want|| / ||want - start||`` (L2): the parameter error relative to the
    reference's own update. Not a max, because AdamW's first step is close to
    ``lr * sign(g)``: an element whose gradient sits at the floor (|g| near the rounding
    error of a reordered sum) may flip its whole step, and over millions of elements some
    do, so an elementwise maximum measures that tail rather than the update. ``got`` as
    shards: each slice once (``Shards.once``) against its slices of ``want`` and ``start``.
    ``scratch`` (fp64, ``2 * BLOCK`` elements or more) holds each block's differences
    instead of fresh tensors."""
    if isinstance(got, Shards):
        triples = [(piece, want[index], start[index]) for piece, index in got.once()]
    else:
        triples = [(got, want, start)]
    diff, scale = _norms_of_differences(triples, scratch)
    if diff != diff:
        return float("inf")
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def _norms_of_differences(triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                          scratch: torch.Tensor | None) -> tuple[float, float]:
    """``(||a - b||, ||b - c||)`` over every ``(a, b, c)``: the L2 norms of the fp64
    differences (NaN if one is NaN, inf if one is infinite, 0 only if every one is 0), their
    squares summed in fp64 in the compiled kernels where they take the triple, else a
    block at a time while the block is in cache, each of ``a``, ``b`` and ``c`` read from
    memory once. Not ``torch.norm``'s whole-tensor reduction to the bit: a reordered sum
    differs from it by under 1e-12 of the norm, against thresholds of 1e-2 of it; the
    whole-tensor fp64 differences it needed cost more than the AdamW step they check."""
    diff = scale = 0.0
    for a, b, c in triples:
        fused = kernels.squared_differences(a, b, c)
        if fused is not None:
            diff, scale = diff + fused[0], scale + fused[1]
            continue
        x, y, z = a.detach(), b.detach(), c.detach()
        if (scratch is None or scratch.numel() < 2 * BLOCK or x.numel() <= BLOCK
                or not x.shape == y.shape == z.shape
                or not (x.is_contiguous() and y.is_contiguous() and z.is_contiguous())):
            d, e = (x.double() - y.double()).reshape(-1), (y.double() - z.double()).reshape(-1)
            diff, scale = diff + float(torch.dot(d, d)), scale + float(torch.dot(e, e))
            continue
        x, y, z = x.reshape(-1), y.reshape(-1), z.reshape(-1)
        for i in range(0, x.numel(), BLOCK):
            size = min(BLOCK, x.numel() - i)
            # each block converted to fp64 once, then subtracted in fp64: a subtraction of
            # mixed dtypes costs 2.5x one of fp64
            d, e = scratch[:size], scratch[BLOCK:BLOCK + size]
            e.copy_(y[i:i + size])
            d.copy_(x[i:i + size]).sub_(e)
            diff += float(torch.dot(d, d))
            d.copy_(z[i:i + size])
            e.sub_(d)
            scale += float(torch.dot(e, e))
    return math.sqrt(diff), math.sqrt(scale)


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

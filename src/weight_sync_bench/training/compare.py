"""What a training run exposes, and how the sharded one is compared with the reference.

Deviations are relative to the reference's own scale, per parameter, so one threshold
serves parameters whose gradients differ by orders of magnitude: ``max |got - want| /
max |want|`` for the loss, the gradients and AdamW's two moments after every step (so a
wrong beta shows at step 1), and for the parameters after AdamW steps the L2 error relative
to the reference's own update (``update_deviation`` says why not a max). The hyperparameters
each optimizer stepped with are compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.model.config import ModelConfig

if TYPE_CHECKING:
    from weight_sync_bench.training.mesh import Mesh


Params = dict[str, torch.Tensor]
QUANTITIES = ("loss", "input_grad", "param_grad", "kv_grad", "exp_avg", "exp_avg_sq",
              "params_step1", "params_final")
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
    diff = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    if diff != diff:
        return float("inf")
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def _absmax(x: torch.Tensor) -> float:
    return float(x.double().abs().max()) if x.numel() else 0.0


def _worst(items: dict[str, float]) -> tuple[float, str]:
    name = max(items, key=lambda n: items[n])
    return items[name], name


def deviations(config: ModelConfig, start: Params, ref: Trace, got: Trace
               ) -> dict[str, tuple[float, str]]:
    """Each quantity's deviation and where it is worst (a parameter name, or "")."""
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
    out["replicas"] = (got.replica_spread, "")
    padding = {n: _absmax(g[config.vocab:]) for n, g in got.grads.items()  # rows >= vocab
               if n in ("tok_embeddings.weight", "lm_head.weight")}
    out["padding_grad"] = _worst({n: v if v == v else float("inf") for n, v in padding.items()})
    for quantity in ("exp_avg", "exp_avg_sq"):
        out[quantity] = _worst({f"{n} step {k + 1}": deviation(g[n], want, _absmax(want))
                                for k, (w, g) in enumerate(zip(getattr(ref, quantity),
                                                               getattr(got, quantity)))
                                for n, want in w.items()})
    out["hyperparameters"] = (max((relative_difference(h, ref.hyperparameters[0])
                                   for h in got.hyperparameters), default=float("inf")), "")
    for quantity, k in (("params_step1", 0), ("params_final", len(ref.params) - 1)):
        out[quantity] = _worst({n: update_deviation(got.params[k][n], p, start[n])
                                for n, p in ref.params[k].items()})
    return out


def update_deviation(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """``||got - want|| / ||want - start||`` (L2): the parameter error relative to the
    reference's own update. Not a max, because AdamW's first step is close to
    ``lr * sign(g)``: an element whose gradient sits at the floor (|g| near the rounding
    error of a reordered sum) may flip its whole step, and over millions of elements some
    do, so an elementwise maximum measures that tail rather than the update."""
    diff = float((got.double() - want.double()).norm())
    if diff != diff:
        return float("inf")
    scale = float((want.double() - start.double()).norm())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


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

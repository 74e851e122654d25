"""The optimizer both sides of a training check step with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamW:
    """The optimizer both sides step with: elementwise, so equal gradients give equal steps.

    ``eps`` is 1e-6, not torch's 1e-8: Adam's first step is about ``lr * g / (|g| + eps)``,
    so a gradient that is mathematically zero (a K bias under softmax's shift invariance,
    say) and only rounding noise on either side becomes a full +-lr step of random sign.
    With 1e-8 that noise alone made the parameters after one step differ by 2.2e-3 of the
    update (threshold 1: an error as large as the whole update would pass); with 1e-6 it is
    below 1e-4 (threshold 1e-2), while real gradients (>= 1e-5 here) still step at ~lr.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-6
    weight_decay: float = 0.1

    def make(self, params: Sequence[torch.Tensor]) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay, foreach=False)


Params = dict[str, torch.Tensor]
HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")


def same_optimizer(adamw: AdamW) -> AdamW:
    """The sharded side steps with the case's optimizer (``Recipe.optimizer``)."""
    return adamw


def moments(optim: torch.optim.Optimizer, params: Params, *, copy: bool = True
            ) -> tuple[Params, Params]:
    """Copies of AdamW's first and second moments (``exp_avg``, ``exp_avg_sq``) of each named
    parameter, as the optimizer holds them; zeros for a parameter it has not stepped.
    ``copy=False``: the optimizer's own tensors, for a caller whose optimizer steps no more
    (the last step's moments)."""
    first, second = {}, {}
    for name, p in params.items():
        state = optim.state.get(p, {})
        for out, key in ((first, "exp_avg"), (second, "exp_avg_sq")):
            if key not in state:
                out[name] = torch.zeros_like(p)
            else:
                out[name] = state[key].detach().clone() if copy else state[key].detach()
    return first, second


def hyperparameters(optim: torch.optim.Optimizer) -> dict[str, float]:
    """What the optimizer actually steps with: lr, betas, eps and weight decay of each of its
    parameter groups (one here), compared exactly between the two sides."""
    (group,) = optim.param_groups
    beta1, beta2 = group["betas"]
    return {"lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
            "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}

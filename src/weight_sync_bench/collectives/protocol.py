"""The ``Collective`` protocol: what the sharded forward needs from a process group.

Activations are ``list[Tensor]`` indexed by local rank: an in-process collective holds every
rank of the group (lists of length t), a process-group collective one (lists of length 1).
The forward never asks which it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:

    pass


Tensors = list[torch.Tensor]


@runtime_checkable
class Collective(Protocol):
    """What the sharded forward needs from a process group.

    ``ranks`` are the group ranks whose activations this object holds, in list order.
    ``tag`` names the parameter or layer a collective serves, for breadcrumbs and reports.
    Every operation is differentiable in the autograd sense, its backward the forward's
    adjoint (all-reduce: all-reduce; all-gather: reduce-scatter; reduce-scatter:
    all-gather): the in-process one is, being plain tensor arithmetic.
    """

    @property
    def degree(self) -> int: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        """Sum over the group; every rank gets the sum."""
        ...

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        """Concatenate along ``dim`` in rank order; every rank gets the result."""
        ...

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        """Sum over the group, then rank r keeps chunk r of the sum along ``dim`` (follows
        ``torch.chunk(degree, dim)``; ``dim`` must divide evenly)."""
        ...

"""Collectives with every rank in this process: ``InProcessCollective`` (one group) and
``InProcessGroups`` (several groups side by side over one mesh's flat positions).

Reduce by sum in rank order, gather by concatenation. Being plain tensor arithmetic, their
autograd backward is the adjoint; hooks record the backward calls a test counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weight_sync_bench.collectives.protocol import Tensors

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class InProcessCollective:
    """Every rank of a degree-t group in this process: reduce by sum, gather by cat.

    Sums in rank order. Each rank's all-reduce output is the same tensor object, so autograd
    sends the sum of every rank's gradient back to each input: all-reduce's own backward.
    ``calls`` records what the forward asked for; ``backward_calls`` the adjoint collective
    each one's backward amounts to (recorded by an autograd hook when its gradient arrives,
    as a process-group implementation would run it): the counts a test asserts.
    """

    def __init__(self, degree: int) -> None:
        if degree < 1:
            raise ValueError(f"InProcessCollective needs degree >= 1, got {degree}")
        self._degree = degree
        self.calls: list[tuple[str, str]] = []  # (op, tag), in order: what the forward asked for
        self.backward_calls: list[tuple[str, str]] = []  # (adjoint op, tag), in backward order

    @property
    def degree(self) -> int:
        return self._degree

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self._degree))

    def _check(self, xs: Tensors, op: str, tag: str) -> None:
        if len(xs) != self._degree:
            raise ValueError(f"{op} {tag}: got {len(xs)} tensors for {self._degree} ranks")
        shapes = {tuple(x.shape) for x in xs}
        if op in ("all_reduce", "reduce_scatter") and len(shapes) > 1:
            raise ValueError(f"{op} {tag}: ranks disagree on shape: "
                             + ", ".join(f"rank {r} {list(x.shape)}" for r, x in enumerate(xs)))
        self.calls.append((op, tag))

    def _on_backward(self, x: torch.Tensor, adjoint: str, tag: str) -> None:
        if x.requires_grad:
            x.register_hook(lambda grad: self.backward_calls.append((adjoint, tag)))

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        self._check(xs, "all_reduce", tag)
        total = _sum_in_rank_order(xs)
        self._on_backward(total, "all_reduce", tag)
        return [total] * self._degree

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        self._check(xs, "all_gather", tag)
        out = torch.cat(xs, dim=dim) if self._degree > 1 else xs[0]
        self._on_backward(out, "reduce_scatter", tag)
        return [out] * self._degree

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        """The sum, chunked: rank r's output is a view of chunk r, so its gradient lands in
        that chunk of the sum's gradient and flows to every input (all-gather's backward)."""
        self._check(xs, "reduce_scatter", tag)
        if xs[0].shape[dim] % self._degree:
            raise ValueError(f"reduce_scatter {tag}: dim {dim} of size {xs[0].shape[dim]} does "
                             f"not split evenly over degree {self._degree}")
        total = _sum_in_rank_order(xs)
        self._on_backward(total, "all_gather", tag)
        return list(total.chunk(self._degree, dim=dim))


def _sum_in_rank_order(xs: Tensors) -> torch.Tensor:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


class InProcessGroups:
    """Several same-sized groups of one mesh axis side by side over one flat list of ranks.

    ``groups[g]`` lists the flat list positions of group g's ranks, in group-rank order;
    every position lies in exactly one group. ``ranks[i]`` is position i's rank within its
    group, so the forward reads each activation's group rank as it does for one group. Each
    collective runs group by group (one ``InProcessCollective`` per group), and ``calls``
    records it once per group with the positions it spans: (op, tag, span).
    """

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        self.groups = tuple(tuple(g) for g in groups)
        sizes = {len(g) for g in self.groups}
        flat = sorted(i for g in self.groups for i in g)
        if len(sizes) != 1 or flat != list(range(len(flat))):
            raise ValueError(f"InProcessGroups: groups {self.groups} must be same-sized and "
                             "cover positions 0..n-1 once each")
        self._degree = sizes.pop()
        self._members = [InProcessCollective(self._degree) for _ in self.groups]
        rank_of = dict(pair for g in self.groups for pair in zip(g, range(len(g))))
        self._ranks = tuple(rank_of[i] for i in range(len(flat)))
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []

    @property
    def degree(self) -> int:
        return self._degree

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def backward_calls(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(op, tag, g) for g, m in zip(self.groups, self._members)
                for op, tag in m.backward_calls]

    def _each(self, xs: Tensors, op: str, tag: str, run: Callable[[InProcessCollective, Tensors],
                                                                  Tensors]) -> Tensors:
        if len(xs) != len(self._ranks):
            raise ValueError(f"{op} {tag}: got {len(xs)} tensors for {len(self._ranks)} "
                             "positions")
        out: list[torch.Tensor | None] = [None] * len(xs)
        for group, member in zip(self.groups, self._members):
            self.calls.append((op, tag, group))
            for i, y in zip(group, run(member, [xs[i] for i in group])):
                out[i] = y
        return out  # type: ignore[return-value]

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        return self._each(xs, "all_reduce", tag, lambda m, ys: m.all_reduce(ys, tag=tag))

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        return self._each(xs, "all_gather", tag, lambda m, ys: m.all_gather(ys, dim, tag=tag))

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        return self._each(xs, "reduce_scatter", tag,
                          lambda m, ys: m.reduce_scatter(ys, dim, tag=tag))

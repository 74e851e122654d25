"""``GlooCollective``: one rank of a gloo process group behind the ``Collective`` protocol.

Each operation is a ``torch.autograd.Function`` whose backward is its forward's adjoint
(all-reduce: all-reduce; all-gather: reduce-scatter; reduce-scatter: all-gather), so the
same forward and training step run here as in process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weight_sync_bench.collectives.gloo.rank import RankContext
from weight_sync_bench.collectives.protocol import Tensors


class GlooCollective:
    """One rank of a gloo group: the ``Collective`` of phase 1b. Lists have length 1."""

    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx

    @property
    def degree(self) -> int:
        return self._ctx.degree

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self._ctx.rank,)

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        (x,) = self._one(xs, "all_reduce", tag)
        return [_AllReduce.apply(x, self._ctx, tag)]

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        (x,) = self._one(xs, "all_gather", tag)
        return [_AllGather.apply(x, self._ctx, dim, tag)]

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        (x,) = self._one(xs, "reduce_scatter", tag)
        if x.shape[dim] % self._ctx.degree:
            raise ValueError(f"reduce_scatter {tag}: dim {dim} of size {x.shape[dim]} does not "
                             f"split evenly over degree {self._ctx.degree}")
        return [_ReduceScatter.apply(x, self._ctx, dim, tag)]

    def _one(self, xs: Tensors, op: str, tag: str) -> Tensors:
        if len(xs) != 1:
            raise ValueError(f"{op} {tag}: GlooCollective holds rank {self._ctx.rank} only, "
                             f"got {len(xs)} tensors")
        return xs


def all_reduce_sum(x: torch.Tensor, ctx: RankContext, tag: str) -> torch.Tensor:
    """A new tensor: ``x`` summed over the group, traced as ``all_reduce(tag)``."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    with ctx.tracer.collective("all_reduce", tag):
        dist.all_reduce(out, group=ctx.group)
    return out


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: RankContext, tag: str) -> torch.Tensor:  # type: ignore[override]
        fctx.rank_ctx, fctx.tag = ctx, tag
        return all_reduce_sum(x, ctx, tag)

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return all_reduce_sum(grad, fctx.rank_ctx, fctx.tag), None, None


def all_gather_cat(x: torch.Tensor, ctx: RankContext, dim: int, tag: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, traced as ``all_gather``."""
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.degree)]
    with ctx.tracer.collective("all_gather", tag):
        dist.all_gather(parts, x, group=ctx.group)
    return torch.cat(parts, dim=dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: RankContext, dim: int, tag: str) -> torch.Tensor:  # type: ignore[override]
        fctx.rank_ctx, fctx.dim, fctx.tag, fctx.width = ctx, dim, tag, x.shape[dim]
        return all_gather_cat(x, ctx, dim, tag)

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        # Reduce-scatter: every rank's loss saw every slice; this rank's input owns one.
        total = all_reduce_sum(grad, fctx.rank_ctx, fctx.tag)
        return total.narrow(fctx.dim, fctx.rank_ctx.rank * fctx.width, fctx.width), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Sum over the group, keep this rank's chunk along ``dim`` (an all-reduce and a slice
    on the wire: gloo has no reduce-scatter); backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: RankContext, dim: int, tag: str) -> torch.Tensor:  # type: ignore[override]
        fctx.rank_ctx, fctx.dim, fctx.tag = ctx, dim, tag
        out = x.detach().clone(memory_format=torch.contiguous_format)
        with ctx.tracer.collective("reduce_scatter", tag):
            dist.all_reduce(out, group=ctx.group)
        width = x.shape[dim] // ctx.degree
        return out.narrow(dim, ctx.rank * width, width).contiguous()

    @staticmethod
    def backward(fctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return all_gather_cat(grad, fctx.rank_ctx, fctx.dim, fctx.tag), None, None, None

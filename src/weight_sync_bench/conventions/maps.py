"""The one primitive every storage convention is written in: an index map.

Every tensor a convention stores, full or rank-local, is a selection of one canonical
parameter along one dim: ``canonical[piece.source].index_select(piece.dim, piece.idx)``,
where ``idx`` is an int64 vector and ``-1`` stands for a zero slice (vocabulary padding).
A convention at degree t is then a list over ranks of ``{stored name: Piece}``, and the
operations on it are data movement, exact to the bit:

- ``materialize(pieces, canonical)``: the stored tensors (what ``shards_for`` returns);
- ``gather_canonical(shards, pieces, ...)``: its inverse, the canonical parameters back
  from stored tensors (the harness's own converter is gather, then materialize).

The canonical model is the harness's own parameters (``init_params``): fused qkv stored as
``[Q | K | V]`` with rows head-major, fused gate_up as ``[gate | up]``, RoPE rotate-half
(Hugging Face) order. The row helpers below name its rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from weight_sync_bench.layout.table import ShardSpec
    from weight_sync_bench.model.config import ModelConfig


Params = dict[str, torch.Tensor]
Shape = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Piece:
    """One stored tensor: ``canonical[source].index_select(dim, idx)``, ``idx == -1`` a zero
    slice. ``idx`` is a 1-D int64 tensor; its order is the stored order."""

    source: str
    dim: int
    idx: torch.Tensor
    # Derived once: where idx is -1, and the contiguous span idx covers (if it is one).
    padding: torch.Tensor | None = field(init=False, repr=False)
    span: tuple[int, int] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        idx = self.idx
        assert idx.dim() == 1 and idx.dtype == torch.int64, (self.source, idx.shape, idx.dtype)
        pad = (idx < 0).nonzero().flatten()
        object.__setattr__(self, "padding", pad if pad.numel() else None)
        span = None
        if pad.numel() == 0 and idx.numel() and bool(
                torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + idx.numel()))):
            span = (int(idx[0]), int(idx[0]) + idx.numel())
        object.__setattr__(self, "span", span)

    def local_shape(self, full: Shape) -> Shape:
        """The stored tensor's shape, given its source's full shape."""
        out = list(full)
        out[self.dim] = self.idx.numel()
        return tuple(out)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The stored tensor, cut from the full canonical tensor (a fresh contiguous copy)."""
        if self.span is not None:
            a, b = self.span
            return full.narrow(self.dim, a, b - a).clone(memory_format=torch.contiguous_format)
        out = full.index_select(self.dim, self.idx.clamp(min=0))
        if self.padding is not None:
            out.index_fill_(self.dim, self.padding, 0.0)
        return out

    def equals(self, other: Piece) -> bool:
        return (self.source == other.source and self.dim == other.dim
                and torch.equal(self.idx, other.idx))


RankPieces = dict[str, Piece]
Pieces = list[RankPieces]


def rows(start: int, stop: int) -> torch.Tensor:
    """``arange(start, stop)`` as int64 indices."""
    return torch.arange(start, stop, dtype=torch.int64)


def chunk(idx: torch.Tensor, degree: int, rank: int) -> torch.Tensor:
    """The rank-th of ``degree`` equal contiguous chunks of an index vector (a rule has
    checked that it divides evenly)."""
    width = idx.numel() // degree
    return idx[rank * width:(rank + 1) * width]


def padded(real: int, total: int) -> torch.Tensor:
    """``0 .. real-1`` then ``total - real`` padding (-1) entries: a padded vocabulary."""
    return torch.cat([rows(0, real), torch.full((total - real,), -1, dtype=torch.int64)])


def placed(spec: ShardSpec, degree: int, rank: int, *, real: int | None = None) -> Piece:
    """What ``rank`` holds of ``spec.name`` under its placement, as a piece; indices at or
    past ``real`` along the placement's dim are padding (-1): a table the convention pads
    beyond the canonical rows."""
    dim, ranges = spec.ranges(degree, rank)
    idx = torch.cat([rows(a, b) for a, b in ranges])
    if real is not None:
        idx[idx >= real] = -1
    return Piece(spec.name, dim, idx)


# The canonical fused tensors' rows, by head and by half.

def q_heads(config: ModelConfig, heads: Iterable[int]) -> torch.Tensor:
    """Rows of the given Q heads in the canonical qkv, head-major."""
    hd = config.head_dim
    return torch.cat([rows(h * hd, (h + 1) * hd) for h in heads])


def k_heads(config: ModelConfig, heads: Iterable[int]) -> torch.Tensor:
    hd, q = config.head_dim, config.q_rows
    return torch.cat([rows(q + g * hd, q + (g + 1) * hd) for g in heads])


def v_heads(config: ModelConfig, heads: Iterable[int]) -> torch.Tensor:
    hd, q, kv = config.head_dim, config.q_rows, config.kv_rows
    return torch.cat([rows(q + kv + g * hd, q + kv + (g + 1) * hd) for g in heads])


def gate_rows(config: ModelConfig) -> torch.Tensor:
    return rows(0, config.ffn)


def up_rows(config: ModelConfig) -> torch.Tensor:
    return rows(config.ffn, 2 * config.ffn)


def materialize(pieces: Pieces, canonical: Mapping[str, torch.Tensor],
                names: Iterable[str] | None = None) -> list[Params]:
    """Every rank's stored tensors (or only ``names``), cut from the canonical parameters:
    fresh tensors, no aliasing between ranks or with ``canonical``."""
    wanted = None if names is None else set(names)
    return [{name: piece.take(canonical[piece.source]) for name, piece in rank.items()
             if wanted is None or name in wanted} for rank in pieces]


def gather_canonical(shards: Sequence[Mapping[str, torch.Tensor]], pieces: Pieces,
                     shapes: Mapping[str, Shape], sources: Iterable[str] | None = None
                     ) -> Params:
    """The canonical parameters (or only ``sources``) written back from stored tensors: the
    inverse of ``materialize``. Padding slices are dropped; a canonical index stored on
    several ranks (a replica) is taken from the lowest rank, as ``gather`` takes rank 0's
    copy of a replicated parameter. Assumes the shards fit the pieces' shapes."""
    wanted = set(shapes) if sources is None else set(sources)
    dtype = next(iter(shards[0].values())).dtype if shards and shards[0] else torch.float32
    full = {name: torch.zeros(shapes[name], dtype=dtype) for name in wanted}
    for rank in reversed(range(len(pieces))):  # rank 0 writes last: its copy wins
        for name, piece in pieces[rank].items():
            if piece.source not in full:
                continue
            x, target = shards[rank][name], full[piece.source]
            if piece.span is not None:
                a, b = piece.span
                target.narrow(piece.dim, a, b - a).copy_(x)
            elif piece.padding is None:
                target.index_copy_(piece.dim, piece.idx, x)
            else:
                keep = (piece.idx >= 0).nonzero().flatten()
                target.index_copy_(piece.dim, piece.idx[keep], x.index_select(piece.dim, keep))
    return full

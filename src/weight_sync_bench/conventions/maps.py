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
(Hugging Face) order, an MoE layer's experts side by side (``experts.gate_up.weight``: expert
x's ``[gate | up]`` rows at ``[2Fx, 2F(x+1))``; ``experts.down.weight``: its columns at
``[Fx, F(x+1))``). The row helpers below name its rows.

A piece may *stack* its selection (``stack`` members): the selected dim is cut into
``stack`` equal runs, stacked along a new leading dim. vLLM's ``w13_weight`` ``[E_local,
2F/t, d]`` is the rows of a rank's experts, stacked per expert; its ``w2_weight`` ``[E_local,
d, F/t]`` their down columns, stacked per expert. ``Piece.flat`` is the inverse view, which
every operation below works on, so a stacked tensor is data movement like any other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
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
    stack: int = 1  # members stacked along a new dim 0 (1: the selection as it is)
    # a stacked tensor even of one member ([1, ...]: vLLM's w13_weight on a rank holding one
    # expert is [E_local, 2F, d] whatever E_local); ``is_stacked`` is what every reader asks
    keep: bool = False
    # Derived once: where idx is -1, and the contiguous span idx covers (if it is one).
    padding: torch.Tensor | None = field(init=False, repr=False)
    span: tuple[int, int] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        idx = self.idx
        assert idx.dim() == 1 and idx.dtype == torch.int64, (self.source, idx.shape, idx.dtype)
        assert self.stack >= 1 and idx.numel() % self.stack == 0, (self.source, self.stack)
        # read through numpy (the same memory): a piece is built for every tensor of every
        # rank of every endpoint, and torch's per-operation overhead dominated its cost
        values = idx.numpy()
        below = values < 0
        pad = torch.from_numpy(below.nonzero()[0]) if below.any() else None
        object.__setattr__(self, "padding", pad)
        span = None
        n = values.size
        if pad is None and n and int(values[-1]) - int(values[0]) == n - 1 and (
                n == 1 or bool((values[1:] - values[:-1] == 1).all())):
            span = (int(values[0]), int(values[0]) + n)
        object.__setattr__(self, "span", span)

    @property
    def is_stacked(self) -> bool:
        """Whether the stored tensor has a leading member axis (``stored[i]`` is member i)."""
        return self.stack > 1 or self.keep

    def same_cut(self, other: Piece) -> bool:
        """Whether ``other`` cuts the same stored tensor from the same canonical one (a
        data-parallel replica's piece): ``take`` gives both the same bytes."""
        return (self.source, self.dim, self.stack, self.keep, self.span) == (
            other.source, other.dim, other.stack, other.keep, other.span) and (
            self.span is not None or torch.equal(self.idx, other.idx))

    def flat_shape(self, full: Shape) -> Shape:
        """The selection's shape before stacking, given its source's full shape."""
        out = list(full)
        out[self.dim] = self.idx.numel()
        return tuple(out)

    def local_shape(self, full: Shape) -> Shape:
        """The stored tensor's shape, given its source's full shape."""
        out = list(self.flat_shape(full))
        if not self.is_stacked:
            return tuple(out)
        out[self.dim] //= self.stack
        return (self.stack, *out)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The stored tensor, cut from the full canonical tensor (a fresh contiguous copy)."""
        if self.span is not None:
            a, b = self.span
            out = full.narrow(self.dim, a, b - a)
            if not self.is_stacked:
                return out.clone(memory_format=torch.contiguous_format)
        else:
            out = full.index_select(self.dim, self.idx.clamp(min=0))
            if self.padding is not None:
                out.index_fill_(self.dim, self.padding, 0.0)
        return self.stacked(out)

    def stacked(self, flat: torch.Tensor) -> torch.Tensor:
        """The stored form of a selection (``flat_shape``): itself, or its ``stack`` runs
        along ``dim`` stacked along a new dim 0 (a contiguous copy)."""
        if not self.is_stacked:
            return flat
        return flat.unflatten(self.dim, (self.stack, -1)).movedim(self.dim, 0).contiguous()

    def flat(self, stored: torch.Tensor) -> torch.Tensor:
        """The selection a stored tensor holds (``flat_shape``): the inverse of ``stacked``, a
        view where the stacked dim is 0 (``[S, n, d] -> [S n, d]``), else a copy."""
        if not self.is_stacked:
            return stored
        return stored.movedim(0, self.dim).flatten(self.dim, self.dim + 1)

    def members(self) -> list[Piece]:
        """The plain selections a stacked piece stacks, in order (member i is ``stored[i]``,
        the flat selection's i-th run along ``dim``); a piece that stacks nothing is its
        own one member."""
        if not self.is_stacked:
            return [self]
        m = self.idx.numel() // self.stack
        return [Piece(self.source, self.dim, self.idx[i * m:(i + 1) * m].clone())
                for i in range(self.stack)]

    def equals(self, other: Piece) -> bool:
        return (self.source == other.source and self.dim == other.dim
                and self.stack == other.stack and self.keep == other.keep
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
    idx = rows(*ranges[0]) if len(ranges) == 1 else torch.cat([rows(a, b) for a, b in ranges])
    if real is not None and any(b > real for _, b in ranges):
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


# An MoE layer's experts, side by side in the canonical experts.gate_up / experts.down.

def expert_rows(config: ModelConfig, experts: Iterable[int], *, etp: int = 1, etp_rank: int = 0,
                halves: tuple[str, ...] = ("gate", "up")) -> torch.Tensor:
    """Canonical ``experts.gate_up`` rows: for each expert in order, chunk ``etp_rank`` of
    ``etp`` of each of its ``halves`` in the order given (``("gate", "up")``: ``[gate_r |
    up_r]``, Megatron's fc1 and vLLM's w13; ``("up", "gate")``: FlashInfer's ``[w3; w1]``)."""
    f = config.expert_ffn
    at = {"gate": 0, "up": f}
    return _runs([e * 2 * f + at[h] for e in experts for h in halves], f, etp, etp_rank)


def expert_cols(config: ModelConfig, experts: Iterable[int], *, etp: int = 1,
                etp_rank: int = 0) -> torch.Tensor:
    """Canonical ``experts.down`` columns: for each expert in order, chunk ``etp_rank`` of
    ``etp`` of its down columns."""
    f = config.expert_ffn
    return _runs([e * f for e in experts], f, etp, etp_rank)


def _runs(starts: list[int], length: int, etp: int, etp_rank: int) -> torch.Tensor:
    """``cat([chunk(rows(s, s + length), etp, etp_rank) for s in starts])``, built at once
    (a model of 128 experts asks for thousands of these per endpoint)."""
    width = length // etp
    if not starts or not width:
        return rows(0, 0)
    first = np.asarray(starts, dtype=np.int64)[:, None] + etp_rank * width
    return torch.from_numpy((first + np.arange(width, dtype=np.int64)).reshape(-1))


def materialize(pieces: Pieces, canonical: Mapping[str, torch.Tensor],
                names: Iterable[str] | None = None) -> list[Params]:
    """Every rank's stored tensors (or only ``names``), cut from the canonical parameters:
    fresh tensors, no aliasing between ranks or with ``canonical``."""
    wanted = None if names is None else set(names)
    return [{name: piece.take(canonical[piece.source]) for name, piece in rank.items()
             if wanted is None or name in wanted} for rank in pieces]


def stored_dtypes(shards: Sequence[Mapping[str, torch.Tensor]], pieces: Pieces
                  ) -> dict[str, torch.dtype]:
    """Each canonical parameter's dtype, the one its stored tensors hold (a checkpoint may
    keep fp32 norms beside bf16 matrices); a parameter none of ``shards`` holds is absent
    (``gather_canonical`` and ``translate`` make it fp32)."""
    return {piece.source: shards[rank][name].dtype for rank in range(len(pieces))
            for name, piece in pieces[rank].items() if name in shards[rank]}


def gather_canonical(shards: Sequence[Mapping[str, torch.Tensor]], pieces: Pieces,
                     shapes: Mapping[str, Shape], sources: Iterable[str] | None = None
                     ) -> Params:
    """The canonical parameters (or only ``sources``) written back from stored tensors: the
    inverse of ``materialize``. Padding slices are dropped; a canonical index stored on
    several ranks (a replica) is taken from the lowest rank, as ``gather`` takes rank 0's
    copy of a replicated parameter. Assumes the shards fit the pieces' shapes."""
    wanted = set(shapes) if sources is None else set(sources)
    dtypes = stored_dtypes(shards, pieces)
    full = {name: torch.zeros(shapes[name], dtype=dtypes.get(name, torch.float32))
            for name in wanted}
    for rank in reversed(range(len(pieces))):  # rank 0 writes last: its copy wins
        for name, piece in pieces[rank].items():
            if piece.source not in full:
                continue
            x, target = piece.flat(shards[rank][name]), full[piece.source]
            if piece.span is not None:
                a, b = piece.span
                target.narrow(piece.dim, a, b - a).copy_(x)
            elif piece.padding is None:
                target.index_copy_(piece.dim, piece.idx, x)
            else:
                keep = (piece.idx >= 0).nonzero().flatten()
                target.index_copy_(piece.dim, piece.idx[keep], x.index_select(piece.dim, keep))
    return full


# Between two conventions without the canonical tensor: what a streamed check holds.

@dataclass(frozen=True)
class Run:
    """``length`` consecutive indices along a stored tensor's dim, from ``at``, that are
    ``length`` consecutive indices of one source stored tensor (``rank``'s ``name``, from
    ``start``), or zeros (``rank`` None: vocabulary padding, or canonical indices no source
    holds, which ``gather_canonical`` leaves zero)."""

    at: int
    length: int
    rank: int | None = None
    name: str | None = None
    start: int = 0


def runs(src: Pieces, piece: Piece, size: int,
         owners: dict[tuple[str, int], Owners | None] | None = None) -> list[Run] | None:
    """Where each index of the stored tensor ``piece`` lives among the source convention's
    stored tensors ``src``, as maximal runs (a few per head: a head's rows are contiguous in
    every convention), so a copy or a comparison reads views and never the canonical tensor.
    ``size``: the canonical parameter's length along ``piece.dim``. An index stored on several
    source ranks is read from the lowest, as ``gather_canonical`` takes it; ``None`` where a
    source piece of the same parameter cuts another dim (Meta's hidden-split embedding from
    a vocab-split one): no run of one dim describes it. ``owners`` caches each parameter's
    ``Owners`` (per dim) across calls on the same ``src``."""
    if owners is None:
        owners = {}
    key = (piece.source, piece.dim)
    if key not in owners:
        owners[key] = Owners.of(src, piece.source, piece.dim, size)
    found = owners[key]
    return None if found is None else found.runs(piece)


@dataclass(frozen=True)
class Owners:
    """For each canonical index of one parameter along one dim: which source stored tensor
    holds it (``who``, an index into ``tensors``, -1 none) and where (``pos``)."""

    who: torch.Tensor
    pos: torch.Tensor
    tensors: tuple[tuple[int, str], ...]  # (rank, stored name)

    @classmethod
    def of(cls, src: Pieces, source: str, dim: int, size: int) -> Owners | None:
        who = torch.full((size,), -1, dtype=torch.int64)
        pos = torch.zeros(size, dtype=torch.int64)
        tensors: list[tuple[int, str]] = []
        for rank in reversed(range(len(src))):  # rank 0 writes last: its copy wins
            for name, p in src[rank].items():
                if p.source != source:
                    continue
                if p.dim != dim:
                    return None
                keep = (p.idx >= 0).nonzero().flatten()
                who[p.idx[keep]] = len(tensors)
                pos[p.idx[keep]] = keep
                tensors.append((rank, name))
        return cls(who, pos, tuple(tensors))

    def runs(self, piece: Piece) -> list[Run]:
        idx = piece.idx
        n = idx.numel()
        if n == 0:
            return []
        o = torch.where(idx >= 0, self.who[idx.clamp(min=0)], -1)
        q = torch.where(o >= 0, self.pos[idx.clamp(min=0)], 0)
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = (o[1:] != o[:-1]) | ((o[1:] >= 0) & (q[1:] != q[:-1] + 1))
        at_t = starts.nonzero().flatten()
        at, owner, first = at_t.tolist(), o[at_t].tolist(), q[at_t].tolist()
        out = []
        for a, b, k, start in zip(at, [*at[1:], n], owner, first):
            if k < 0:
                out.append(Run(a, b - a))
            else:
                rank, name = self.tensors[k]
                out.append(Run(a, b - a, rank, name, start))
        return out


def translate(shards: Sequence[Mapping[str, torch.Tensor]], src: Pieces, dst: Pieces,
              shapes: Mapping[str, Shape], names: Iterable[str] | None = None
              ) -> list[Params]:
    """The destination convention's stored tensors (or only ``names``) straight from the
    source's: ``materialize(dst, gather_canonical(shards, src, shapes))`` bit for bit, each
    destination tensor written run by run from views of the source tensors, so no canonical
    tensor is made (the extra memory is the output; a parameter ``runs`` cannot describe, cut
    along another dim, goes through its canonical tensor)."""
    wanted = None if names is None else set(names)
    dtypes = stored_dtypes(shards, src)  # as gather_canonical keeps them
    out: list[Params] = [{} for _ in dst]
    fallback: dict[str, torch.Tensor] = {}
    owners: dict[tuple[str, int], Owners | None] = {}
    for rank, pieces in enumerate(dst):
        for name, piece in pieces.items():
            if wanted is not None and name not in wanted:
                continue
            found = runs(src, piece, shapes[piece.source][piece.dim], owners)
            if found is None:
                if piece.source not in fallback:
                    fallback.update(gather_canonical(shards, src, shapes, [piece.source]))
                out[rank][name] = piece.take(fallback[piece.source])
                continue
            x = torch.empty(piece.flat_shape(shapes[piece.source]),
                            dtype=dtypes.get(piece.source, torch.float32))
            for run in found:
                part = x.narrow(piece.dim, run.at, run.length)
                if run.rank is None:
                    part.zero_()
                else:
                    assert run.name is not None
                    source = src[run.rank][run.name].flat(shards[run.rank][run.name])
                    part.copy_(source.narrow(piece.dim, run.start, run.length))
            out[rank][name] = piece.stacked(x)
    return out

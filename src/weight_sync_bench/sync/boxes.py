"""Layouts as index boxes: every rank-local tensor as a concatenation of boxes of the
canonical full tensor, and the validation of a whole cover before anything moves.

A stored tensor is ``canonical[source].index_select(dim, idx)`` (``conventions.Piece``). A
*box* is a maximal run of its positions along ``dim`` whose canonical indices are
consecutive: positions ``[offset, offset + length)`` of the stored tensor hold canonical
indices ``[start, start + length)`` (every other dim whole). A run of ``-1`` (vocabulary
padding) is a padding box: zeros, no source. Megatron's grouped qkv is a few boxes per
rank, Meta's pair-ordered q rows one box per row.

``validate_cover`` checks a layout as DCP's ``_validate_global_plan`` checks a checkpoint
plan, by a sweep over sorted intervals, not by comparing every pair of boxes:

- bounds: every box inside the canonical shape;
- no overlap within a rank: no canonical index stored twice on one rank;
- replication exactly as stated: each canonical index is held by as many ranks as the
  layout's ``statement`` (its placements) says, e.g. once under ``Shard``, t times for a
  ``Replicate`` norm, ``t / n_kv_heads`` times for a ``HeadReplicated`` KV head, dp times
  more over data-parallel replicas;
- total volume: the boxes' elements add up to the stated total.

Each failure is an ``InvalidCover`` naming the layout, parameter, rank and box.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from weight_sync_bench.errors import InvalidCover

if TYPE_CHECKING:
    from weight_sync_bench.conventions.maps import Piece
    from weight_sync_bench.sync.layouts import SyncLayout

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """Positions ``[offset, offset + length)`` along ``dim`` of ``rank``'s stored tensor
    ``name`` hold canonical ``source`` indices ``[start, start + length)`` along ``dim``,
    every other dim whole. ``source`` None: a padding box (zeros, nothing to fetch)."""

    rank: int
    name: str
    source: str | None
    dim: int
    start: int
    length: int
    offset: int

    @property
    def stop(self) -> int:
        return self.start + self.length

    def __str__(self) -> str:
        where = f"rank {self.rank} {self.name}[{self.offset}:{self.offset + self.length}]"
        if self.source is None:
            return f"{where} padding x{self.length}"
        return (f"{where} = {self.source} {_axis(self.dim)} {self.start}-{self.stop - 1}")


@dataclass(frozen=True)
class Stored:
    """One stored tensor of one rank: its canonical source, dim, local shape and boxes in
    position order (their lengths add up to ``shape[dim]``)."""

    rank: int
    name: str
    source: str
    dim: int
    shape: Shape
    boxes: tuple[Box, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True, eq=False)
class Cover:
    """A layout as boxes: ``ranks[rank][part]`` is a ``Stored``, one per ``layout.parts``
    (a stored tensor, or one member of a stacked one, ``w13_weight[i]``)."""

    layout: SyncLayout
    ranks: tuple[dict[str, Stored], ...]

    def boxes(self, source: str) -> list[Box]:
        """Every non-padding box of canonical ``source``, over all ranks."""
        return self._by_source().get(source, [])

    def unit(self, source: str, dim: int) -> int:
        """Elements per index along ``dim`` of canonical ``source`` (the product of the others)."""
        shape = self.layout.config.param_shapes()[source]
        return int(np.prod(shape)) // shape[dim]

    @functools.cache  # noqa: B019 - one Cover per layout, cached by cover_of
    def _by_source(self) -> dict[str, list[Box]]:
        out: dict[str, list[Box]] = defaultdict(list)
        for rank in self.ranks:
            for stored in rank.values():
                out[stored.source] += [b for b in stored.boxes if b.source is not None]
        return dict(out)


def runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """``(offset, start, length)`` of each maximal run of ``idx``: consecutive canonical
    indices, or consecutive padding (start -1)."""
    n = len(idx)
    if n == 0:
        return []
    pad = idx < 0
    same = np.where(pad[1:] & pad[:-1], True, (idx[1:] == idx[:-1] + 1) & ~pad[1:] & ~pad[:-1])
    cuts = np.concatenate([[0], np.flatnonzero(~same) + 1, [n]])
    return [(int(a), -1 if pad[a] else int(idx[a]), int(b - a)) for a, b in itertools.pairwise(cuts)]


def stored_boxes(rank: int, name: str, piece: Piece, full: Shape) -> Stored:
    boxes = tuple(Box(rank, name, None if start < 0 else piece.source, piece.dim,
                      max(start, 0), length, offset)
                  for offset, start, length in runs(piece.idx.numpy()))
    return Stored(rank, name, piece.source, piece.dim, piece.local_shape(full), boxes)


@functools.lru_cache(maxsize=256)
def _cover(layout: SyncLayout) -> Cover:
    shapes = layout.config.param_shapes()
    return Cover(layout, tuple(
        {name: stored_boxes(rank, name, piece, shapes[piece.source])
         for name, piece in pieces.items()} for rank, pieces in enumerate(layout.parts)))


def cover_of(layout: SyncLayout, *, validate: bool = True) -> Cover:
    """The layout's boxes (cached per layout), validated unless ``validate=False`` (a
    deliberately broken layout, for the planner's mutations)."""
    cover = _cover(layout)
    if validate:
        validate_cover(cover)
    return cover


def validate_cover(cover: Cover) -> None:
    """Bounds, no overlap within a rank, replication as stated, total volume; raises the
    first ``InvalidCover``. A sweep over each parameter's sorted interval endpoints."""
    layout = cover.layout
    shapes = layout.config.param_shapes()
    seen: set[str] = set()
    for rank in cover.ranks:
        for stored in rank.values():
            if stored.source not in shapes:
                raise InvalidCover(f"{layout}: rank {stored.rank} {stored.name} reads canonical "
                                   f"{stored.source!r}, which {layout.config.name} does not have",
                                   param=stored.source, rank=stored.rank)
            seen.add(stored.source)
    stated = set(layout.statement.names)
    for source in sorted(seen - stated):
        raise InvalidCover(f"{layout}: stores canonical {source}, which its statement "
                           f"(placements) does not lay out", param=source)
    for source, shape in shapes.items():
        boxes = cover.boxes(source)
        dims = {b.dim for b in boxes}
        stated_dim, _ = layout.stated_ranges(source, 0)
        if dims - {stated_dim}:
            bad = next(b for b in boxes if b.dim != stated_dim)
            raise InvalidCover(f"{layout}: {bad} is split along dim {bad.dim}; the layout "
                               f"states {layout.statement[source].placement} along dim "
                               f"{stated_dim}", param=source, rank=bad.rank, box=bad)
        size = shape[stated_dim]
        for b in boxes:
            if b.start < 0 or b.stop > size:
                raise InvalidCover(f"{layout}: {b} is out of bounds: {source} has {size} "
                                   f"{_axis(stated_dim)} (0-{size - 1})",
                                   param=source, rank=b.rank, box=b)
        _no_overlap_within_ranks(layout, source, boxes)
        _replication_as_stated(layout, cover, source, boxes, stated_dim)


def _no_overlap_within_ranks(layout: SyncLayout, source: str, boxes: list[Box]) -> None:
    by_rank: dict[int, list[Box]] = defaultdict(list)
    for b in boxes:
        by_rank[b.rank].append(b)
    for rank, mine in by_rank.items():
        mine.sort(key=lambda b: b.start)
        for a, b in itertools.pairwise(mine):
            if b.start < a.stop:
                raise InvalidCover(
                    f"{layout}: rank {rank} holds {source} {_axis(a.dim)} "
                    f"{b.start}-{min(a.stop, b.stop) - 1} twice: {a} and {b} overlap "
                    "(one rank stores each canonical index at most once)",
                    param=source, rank=rank, box=b)


def _replication_as_stated(layout: SyncLayout, cover: Cover, source: str, boxes: list[Box],
                           dim: int) -> None:
    """Sweep the held and the stated intervals together; every elementary segment must be
    held by exactly as many ranks as stated."""
    events: list[tuple[int, int, int]] = []  # (position, +1/-1, 0 held / 1 stated)
    for b in boxes:
        events += [(b.start, 1, 0), (b.stop, -1, 0)]
    for rank in range(layout.world):
        stated_dim, ranges = layout.stated_ranges(source, rank)
        assert stated_dim == dim
        for a, z in ranges:
            events += [(a, 1, 1), (z, -1, 1)]
    events.sort()
    count = [0, 0]
    held_volume = stated_volume = 0
    pos = 0
    i = 0
    while i < len(events):
        nxt = events[i][0]
        if nxt > pos and count[0] != count[1]:
            holders = sorted({b.rank for b in boxes if b.start <= pos < b.stop})
            box = next((b for b in boxes if b.start <= pos < b.stop), None)
            raise InvalidCover(
                f"{layout}: {source} {_axis(dim)} {pos}-{nxt - 1} is held {count[0]} "
                f"time{'s' if count[0] != 1 else ''} (ranks {holders}), the layout states "
                f"{count[1]} ({layout.statement[source].placement} at t={layout.degree}"
                + (f", dp={layout.dp}" if layout.dp > 1 else "") + ")",
                param=source, rank=holders[0] if holders else None, box=box)
        held_volume += count[0] * (nxt - pos)
        stated_volume += count[1] * (nxt - pos)
        pos = nxt
        while i < len(events) and events[i][0] == nxt:
            count[events[i][2]] += events[i][1]
            i += 1
    unit = cover.unit(source, dim)
    if held_volume != stated_volume:  # the sweep above makes this unreachable; kept as DCP does
        raise InvalidCover(f"{layout}: {source} boxes hold {held_volume * unit} elements, the "
                           f"layout states {stated_volume * unit}", param=source)


def _axis(dim: int) -> str:
    return {0: "rows", 1: "columns"}.get(dim, f"indices of dim {dim}")

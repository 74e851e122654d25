"""The figures a sync is judged against, computed without the planner.

- ``minimum_bytes``: ``B_min = element size x sum over destination ranks of |needed minus
  already held|``, from the layouts' index maps with boolean masks over each canonical
  parameter (not boxes, not intervals: an oracle that shares no code with the planner);
- ``naive_bytes``: what gather-then-scatter moves (every source rank but rank 0 sends its
  whole local state to rank 0, which sends every other destination rank its whole local
  state), the figure production weight syncs that gather full tensors pay;
- ``time_bound``: ``T_min = max over ranks of max(bytes sent, bytes received) / bandwidth``.

These are parent-side figures of a test or a report; a mask is a full parameter's worth of
booleans, which only the harness's own process allocates.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.sync.planner import ELEMENT_SIZE

if TYPE_CHECKING:
    from collections.abc import Sequence

    from weight_sync_bench.sync.layouts import SyncLayout


def _mask(layout: SyncLayout, rank: int, source: str, shape: tuple[int, ...]) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    if rank >= layout.world:
        return mask
    for piece in layout.pieces[rank].values():
        if piece.source == source:
            real = piece.idx[piece.idx >= 0]
            mask.index_fill_(piece.dim, real, True)
    return mask


def needed_elements(src: SyncLayout, dst: SyncLayout) -> list[int]:
    """Per destination rank: canonical elements it stores that its own source tensors lack."""
    shapes = src.config.param_shapes()
    out = []
    for rank in range(dst.world):
        missing = 0
        for source, shape in shapes.items():
            need = _mask(dst, rank, source, shape)
            if need.any():
                missing += int((need & ~_mask(src, rank, source, shape)).sum())
        out.append(missing)
    return out


@functools.lru_cache(maxsize=64)
def minimum_bytes(src: SyncLayout, dst: SyncLayout) -> int:
    """``B_min``: bytes that must cross between ranks, whoever plans them (cached per pair
    of layout objects)."""
    return ELEMENT_SIZE * sum(needed_elements(src, dst))


def _stored_elements(layout: SyncLayout, rank: int) -> int:
    shapes = layout.config.param_shapes()
    total = 0
    for piece in layout.pieces[rank].values():
        n = 1
        for size in piece.local_shape(shapes[piece.source]):
            n *= size
        total += n
    return total


def naive_bytes(src: SyncLayout, dst: SyncLayout) -> int:
    """Gather-then-scatter through rank 0: every source rank but 0 sends all it stores, rank
    0 sends every other destination rank all it must store (padding included: whole
    tensors)."""
    gathered = sum(_stored_elements(src, r) for r in range(1, src.world))
    scattered = sum(_stored_elements(dst, r) for r in range(1, dst.world))
    return ELEMENT_SIZE * (gathered + scattered)


def time_bound(sent: Sequence[int], received: Sequence[int], bandwidth: float) -> float:
    """``T_min`` in seconds: the busiest rank's larger direction over the pair bandwidth
    (bytes per second, each direction at once)."""
    return max(max(s, r) for s, r in zip(sent, received)) / bandwidth

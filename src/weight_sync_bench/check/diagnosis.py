"""What a shard that differs from the declared layout really holds.

Shards are compared with the declared split bit for bit (``mismatching``); for the first
parameter that differs, each rank's slices are matched to the full tensor's so the report
says which rows the rank holds against the declared ones (``diagnose``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from weight_sync_bench.layout.placements import format_ranges

if TYPE_CHECKING:
    from collections.abc import Iterable

    from weight_sync_bench.layout.table import ShardSpec


Params = dict[str, torch.Tensor]

def mismatching(shards: list[Params], declared: list[Params], names: Iterable[str]) -> list[str]:
    """Those of ``names`` (in their order: a layout's, or a convention's stored names) whose
    bytes differ from the declared shards on any rank."""
    return [name for name in names
            if any(not _bit_equal(s[name], d[name]) for s, d in zip(shards, declared))]


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (so NaN == NaN and -0.0 != 0.0, unlike ``torch.equal`` on floats).

    Compared ``_CHUNK`` elements at a time along dim 0, so the temporaries (the comparison's
    boolean array, the contiguous copy of a strided view such as a column slice) stay a few
    MiB at any width instead of a fraction of the largest parameter."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dim() == 0 or a.numel() <= _CHUNK:
        return _equal_bytes(a, b)
    step = max(1, _CHUNK // (a.numel() // a.shape[0]))  # rows per comparison
    return all(_equal_bytes(a.narrow(0, i, min(step, a.shape[0] - i)),
                            b.narrow(0, i, min(step, a.shape[0] - i)))
               for i in range(0, a.shape[0], step))


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = _SAME_WIDTH_INT[a.element_size()]  # any dtype, bf16 too, seen as raw integers
    x, y = (t.detach().contiguous().view(as_int).numpy() for t in (a, b))
    return bool(np.array_equal(x, y))  # a third faster than torch.equal here


_CHUNK = 1 << 22  # elements per comparison: a 4 Mi-element (16 MiB fp32) slab


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_AXIS = {0: "rows", 1: "columns"}


def diagnose(full: torch.Tensor, spec: ShardSpec, shards: list[torch.Tensor]) -> list[str]:
    """For each rank whose shard is not the declared one: which source indices it holds,
    found by matching its slices along the placement's dim to the full tensor, against the
    declared ones, e.g. ``rank 0 layers.0.qkv.weight holds rows 0-191; declared 0-127, ...``."""
    degree = len(shards)
    lines = []
    for rank, shard in enumerate(shards):
        dim, declared = spec.ranges(degree, rank)
        if _bit_equal(shard, _take(full, dim, declared)):
            continue  # byte-correct, whatever repeated rows (zeros, padding) locate says
        axis = "elements" if full.dim() == 1 else _AXIS.get(dim, f"indices of dim {dim}")
        held = locate(full, shard, dim)
        declared_idx = [i for start, stop in declared for i in range(start, stop)]
        if held == declared_idx:
            lines.append(f"rank {rank} {spec.name} holds the declared {axis} "
                         f"{format_ranges(declared)}, with values changed")
            continue
        lines.append(f"rank {rank} {spec.name} holds {axis} {format_indices(held)}; "
                     f"declared {format_ranges(declared)}")
    return lines


def _take(full: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def locate(full: torch.Tensor, shard: torch.Tensor, dim: int,
           index: dict[bytes, int] | None = None) -> list[int | None]:
    """For each slice of ``shard`` along ``dim``, the index of the identical slice of ``full``
    along ``dim`` (the first, if repeated), or None if no slice of ``full`` has those bytes.
    ``index`` is ``slice_index(full, dim)`` when the caller keeps one."""
    if full.shape[:dim] + full.shape[dim + 1:] != shard.shape[:dim] + shard.shape[dim + 1:]:
        return [None] * shard.shape[dim]
    index = index if index is not None else slice_index(full, dim)
    return [index.get(key) for key in _slice_keys(shard, dim)]


def slice_index(full: torch.Tensor, dim: int) -> dict[bytes, int]:
    """The bytes of each slice of ``full`` along ``dim`` -> its first index."""
    index: dict[bytes, int] = {}
    for i, key in enumerate(_slice_keys(full, dim)):
        index.setdefault(key, i)
    return index


def _slice_keys(x: torch.Tensor, dim: int) -> list[bytes]:
    raw = x.detach().contiguous().view(_SAME_WIDTH_INT[x.element_size()])  # bf16 has no numpy
    rows = np.ascontiguousarray(raw.movedim(dim, 0).reshape(x.shape[dim], -1).numpy())
    return [row.tobytes() for row in rows]


def format_indices(indices: list[int | None]) -> str:
    """``[0, 1, 2, 7, None, None]`` -> ``"0-2, 7, ? x2"``: runs of consecutive source
    indices, and runs of slices found nowhere in the full tensor."""
    runs: list[tuple[int | None, int]] = []  # (start, stop) or (None, count)
    for i in indices:
        if runs and i is None and runs[-1][0] is None:
            runs[-1] = (None, runs[-1][1] + 1)
        elif runs and i is not None and runs[-1][0] is not None and i == runs[-1][1]:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((None, 1) if i is None else (i, i + 1))
    return ", ".join(("?" if n == 1 else f"? x{n}") if a is None else format_ranges([(a, n)])
                     for a, n in runs)

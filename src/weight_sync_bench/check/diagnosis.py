"""What a shard that differs from the declared layout really holds.

Shards are compared with the declared split bit for bit (``mismatching``); for the first
parameter that differs, each rank's slices are matched to the full tensor's so the report
says which rows the rank holds against the declared ones (``diagnose``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from weight_sync_bench.conventions.meta import permute_index
from weight_sync_bench.layout.placements import format_ranges

if TYPE_CHECKING:
    from weight_sync_bench.conventions.maps import Piece
    from weight_sync_bench.layout.table import ShardSpec
    from weight_sync_bench.model.config import ModelConfig


Params = dict[str, torch.Tensor]

def mismatching(shards: list[Params], declared: list[Params], names: Iterable[str]) -> list[str]:
    """Those of ``names`` (in their order: a layout's, or a convention's stored names) whose
    bytes differ from the declared shards on any rank."""
    return [name for name in names
            if any(not bit_equal(s[name], d[name]) for s, d in zip(shards, declared))]


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
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
        if bit_equal(shard, _take(full, dim, declared)):
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


def diagnose_piece(canonical: Mapping[str, torch.Tensor], config: ModelConfig, name: str,
                   declared: list[Piece], shards: list[torch.Tensor], *,
                   index: Callable[[str, int], dict[bytes, int]] | None = None) -> list[str]:
    """For each rank whose ``name`` is not the declared one: which canonical indices it
    holds (its slices matched by bytes to the full canonical tensor's; an all-zero slice
    reads as padding) against the declared ones, in heads for the fused qkv."""
    lines = []
    for rank, (piece, shard) in enumerate(zip(declared, shards)):
        full = canonical[piece.source]
        if bit_equal(shard, piece.take(full)):
            continue
        held: list[int | None] = locate(full, shard, piece.dim, index(piece.source, piece.dim)
                                        if index is not None else None)
        zero = (shard.movedim(piece.dim, 0).reshape(shard.shape[piece.dim], -1) == 0).all(1)
        held = [-1 if i is None and z else i for i, z in zip(held, zero.tolist())]
        want = piece.idx.tolist()
        if held == want:
            lines.append(f"rank {rank} {name} holds the declared "
                         f"{describe(want, piece, config)}, with values changed")
            continue
        lines.append(f"rank {rank} {name} holds {describe(held, piece, config)}; "
                     f"declared {describe(want, piece, config)}")
    return lines


def describe(indices: list[int | None], piece: Piece, config: ModelConfig) -> str:
    """Canonical indices as a person reads them: ``Q heads 0-3, K head 1, V head 1`` for the
    fused qkv (``... in pair order`` for Meta's interleaved-pair rows), ``gate rows 0-351,
    up rows 0-351`` for gate_up, else ``rows 0-15999, padding x64`` (``?`` for a slice found
    nowhere in the canonical tensor)."""
    if piece.dim == 0 and piece.source.endswith(("qkv.weight", "qkv.bias")):
        heads = _in_heads(indices, config)
        if heads is not None:
            return heads
    if piece.dim == 0 and piece.source.endswith("gate_up.weight"):
        blocks = _in_blocks(indices, [("gate", 0, config.ffn), ("up", config.ffn, 2 * config.ffn)])
        if blocks is not None:
            return blocks
    axis = ("elements" if len(config.param_shapes()[piece.source]) == 1
            else {0: "rows", 1: "columns"}.get(piece.dim, f"indices of dim {piece.dim}"))
    return f"{axis} {_with_padding(indices)}"


def _with_padding(indices: list[int | None]) -> str:
    """``format_indices``, with each run of padding (-1) written ``padding xN``."""
    return ", ".join(f"padding x{len(run)}" if pad else format_indices(run)
                     for pad, group in itertools.groupby(indices, key=lambda i: i == -1)
                     for run in [list(group)])


def _in_blocks(indices: list[int | None], blocks: list[tuple[str, int, int]]) -> str | None:
    """``gate rows 0-351, up rows 0-351``: each run of indices inside one named block."""
    out: list[tuple[str, list[int]]] = []
    for i in indices:
        if i is None or i < 0:
            return None
        label, start = next((lb, a) for lb, a, b in blocks if a <= i < b)
        if out and out[-1][0] == label:
            out[-1][1].append(i - start)
        else:
            out.append((label, [i - start]))
    return ", ".join(f"{label} rows {format_indices(list(rows))}" for label, rows in out)


def _in_heads(indices: list[int | None], config: ModelConfig) -> str | None:
    """The fused qkv's canonical rows as whole heads, or None when they are not whole heads
    (each hd-row unit one head's rows, in rotate-half or Meta's pair order)."""
    hd, q, kv = config.head_dim, config.q_rows, config.kv_rows
    if len(indices) % hd or any(i is None or i < 0 for i in indices):
        return None
    pair = [int(x) for x in torch.argsort(permute_index(hd, 1)).tolist()]  # Meta row order
    units: list[tuple[str, int, str]] = []  # (block, head, order)
    for u in range(0, len(indices), hd):
        unit = [int(i) for i in indices[u:u + hd]]  # type: ignore[arg-type]
        block, base = ("Q", 0) if unit[0] < q else ("K", q) if unit[0] < q + kv else ("V", q + kv)
        head, offsets = (unit[0] - base) // hd, [i - base - ((unit[0] - base) // hd) * hd
                                                   for i in unit]
        order = "" if offsets == list(range(hd)) else " in pair order" if offsets == pair else None
        if order is None:
            return None
        units.append((block, head, order))
    parts: list[tuple[str, int, int, str]] = []  # (block, first head, last head, order)
    for block, head, order in units:
        if parts and parts[-1][0] == block and parts[-1][2] == head - 1 and parts[-1][3] == order:
            parts[-1] = (block, parts[-1][1], head, order)
        else:
            parts.append((block, head, head, order))
    return ", ".join(f"{b} head {a}{o}" if a == z else f"{b} heads {a}-{z}{o}"
                     for b, a, z, o in parts)

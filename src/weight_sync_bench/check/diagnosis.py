"""What a shard that differs from the declared one really holds, in the convention's words.

Shards are compared with the declared ones bit for bit (``bit_equal``, ``mismatching``). For
the first stored tensor that differs, each rank's slices along its piece's dim are matched by
their bytes to the slices of the full canonical parameter it is cut from, and the report says
which canonical indices the rank holds against the declared ones (``diagnose``), in the words
of what that parameter is (``VOCABULARY``): heads of the fused qkv (``Q heads 0-3, K head 0,
V head 0``; ``in pair order`` for Meta's interleaved-pair rows), halves of the fused gate_up
(``gate rows 0-351, up rows 0-351``), vocabulary rows and padding of the embedding and the
output layer; rows, columns or elements of anything else.

Every check speaks through it: ``check_split`` and ``check_reshard`` as the ``plain``
convention's pieces (``conventions.plain``), ``check_convert`` and ``verify_checkpoint`` as
the destination convention's, the streamed checks while the canonical tensor is at hand, and
phase 2's element check after regenerating the one canonical parameter it needs.
"""

from __future__ import annotations

import dataclasses

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from weight_sync_bench.conventions.maps import placed
from weight_sync_bench.conventions.meta import permute_index
from weight_sync_bench.layout.placements import format_ranges
from weight_sync_bench.model.reference import step_of

if TYPE_CHECKING:
    from weight_sync_bench.conventions.maps import Piece
    from weight_sync_bench.layout.table import ShardSpec
    from weight_sync_bench.model.config import ModelConfig


Params = dict[str, torch.Tensor]
# An index of a slice a rank holds, as ``diagnose`` reads it: a canonical index; ``None``
# for a slice found nowhere in the canonical tensor; ``PADDING`` where the declared piece
# pads (a zero slice, ``maps.Piece``'s -1) and the rank holds it; ``ZEROS`` for an all-zero
# slice found nowhere where the declared piece holds data (a slice nothing wrote).
Index = int | None
PADDING, ZEROS = -1, -2


def mismatching(shards: list[Params], declared: list[Params], names: Iterable[str]) -> list[str]:
    """Those of ``names`` (in their order: a layout's, or a convention's stored names) whose
    bytes differ from the declared shards on any rank declared to hold them."""
    return [name for name in names
            if any(not bit_equal(s[name], d[name]) for s, d in zip(shards, declared)
                   if name in d)]


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
    if a.numel() <= _SMALL:  # torch.equal's call costs a quarter of numpy's round trip
        # the integer views of the same width, whatever the strides: no copy, no detach
        # (torch.equal reads a strided view in place, and no gradient flows through it)
        as_int = _SAME_WIDTH_INT[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    x, y = (raw(t).numpy() for t in (a, b))
    return bool(np.array_equal(x, y))  # 2-4x faster than torch.equal from 64 Ki elements


# Elements below which torch.equal of the integer views is faster than numpy's (one call's
# overhead: ~3 us against ~11 us); above, numpy's comparison runs 2-4x faster (1 Mi fp32:
# 0.21 ms against 0.87 ms, torch 2.13 on this machine). Integers compare bit for bit either way.
_SMALL = 1 << 14


def raw(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bytes as integers of its element width, its shape kept: any dtype, bf16 too
    (NaN equals NaN bit for bit, -0.0 is not 0.0)."""
    return x.detach().contiguous().view(_SAME_WIDTH_INT[x.element_size()])


_CHUNK = 1 << 22  # elements per comparison: a 4 Mi-element (16 MiB fp32) slab


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def diagnose(canonical: Mapping[str, torch.Tensor], config: ModelConfig, name: str,
             declared: Sequence[Piece | None], shards: Sequence[torch.Tensor | None], *,
             index: Callable[[str, int], dict[bytes, int]] | None = None) -> list[str]:
    """For each rank whose stored tensor ``name`` is not its declared piece (``declared[r]``,
    cut from ``canonical[piece.source]``; None where rank r is not declared to store it, as
    on another pipeline stage), a line saying which canonical indices it holds against the
    declared ones (``diagnose_rank``). ``index(source, dim)``: a kept ``slice_index`` of a
    canonical parameter, when the caller keeps one."""
    lines = []
    for rank, (piece, shard) in enumerate(zip(declared, shards)):
        if piece is None or shard is None:
            continue
        moved = diagnose_layer(canonical, config, name, rank, piece, shard)
        if moved is not None:
            lines.append(moved)
            continue
        full = canonical[piece.source]
        line = diagnose_rank(full, config, name, rank, piece, shard,
                             index(piece.source, piece.dim) if index is not None else None)
        if line is not None:
            lines.append(line)
    return lines


def diagnose_layer(canonical: Mapping[str, torch.Tensor], config: ModelConfig, name: str,
                   rank: int, piece: Piece, shard: torch.Tensor) -> str | None:
    """``rank {rank} {name} holds layer k's ...`` where ``shard`` is another layer's same
    parameter, cut as declared (``held_layer``), else None."""
    layer = held_layer(canonical, config, piece, shard)
    if layer is None:
        return None
    return (f"rank {rank} {name} holds layer {layer}'s {describe_whole(piece)} byte for byte; "
            f"declared layer {piece.source.split('.')[1]}'s: a layer stored under another "
            "layer's index (a stage's local index read as global, or its offset wrong)")


def held_layer(canonical: Mapping[str, torch.Tensor], config: ModelConfig, piece: Piece,
               shard: torch.Tensor) -> int | None:
    """The other layer whose same parameter, cut as ``piece`` cuts its own, is ``shard``
    byte for byte (None: not a layer's parameter, or no other layer's)."""
    parts = piece.source.split(".")
    if parts[0] != "layers" or len(parts) < 3:
        return None
    own = int(parts[1])
    for k in range(config.n_layers):
        source = ".".join(["layers", str(k), *parts[2:]])
        if k == own or source not in canonical:
            continue
        other = canonical[source]
        if other.shape == canonical[piece.source].shape and bit_equal(
                shard, dataclasses.replace(piece, source=source).take(other)):
            return k
    return None


def describe_whole(piece: Piece) -> str:
    """A layer parameter's kind as its canonical name says it (``qkv.weight``)."""
    return ".".join(piece.source.split(".")[2:]) + " (its declared cut)"


def diagnose_plain(full: torch.Tensor, config: ModelConfig, spec: ShardSpec,
                   shards: Sequence[torch.Tensor]) -> list[str]:
    """``diagnose`` of a parameter of the plain layout (``check_split``, ``check_reshard``):
    the ``plain`` convention's pieces of ``spec`` at ``len(shards)`` ranks, cut from ``full``."""
    degree = len(shards)
    pieces = [placed(spec, degree, rank) for rank in range(degree)]
    return diagnose({spec.name: full}, config, spec.name, pieces, shards)


def diagnose_rank(full: torch.Tensor, config: ModelConfig, name: str, rank: int, piece: Piece,
                  shard: torch.Tensor, index: dict[bytes, int] | None = None) -> str | None:
    """``rank {rank} {name} holds {what}; declared {what}`` where ``shard`` is not ``piece``
    of ``full`` (the canonical parameter) byte for byte, else None. Each slice along
    ``piece.dim`` is told by the canonical index whose bytes it holds: the declared one where
    it holds the declared bytes, else the first index holding its bytes (``locate``), else
    zeros or ``?`` (``Index``)."""
    want = piece.take(full)
    if bit_equal(shard, want):
        return None  # byte-correct, whatever repeated slices (zeros, padding) locate says
    if piece.is_stacked:  # a stacked tensor (vLLM's w13) is told by the selection it stacks
        if shard.shape != want.shape:
            return f"rank {rank} {name} has shape {list(shard.shape)}; declared {list(want.shape)}"
        shard, want = piece.flat(shard), piece.flat(want)
    dim, declared = piece.dim, piece.idx.tolist()
    keys = _slice_keys(shard, dim)
    found: list[Index] = [None] * len(keys)
    if _across(full, dim) == _across(shard, dim):  # else no slice of it is one of full's
        index = index if index is not None else slice_index(full, dim)
        found = [index.get(key) for key in keys]  # ``locate``'s
    same = ([a == b for a, b in zip(keys, _slice_keys(want, dim))]
            if shard.shape == want.shape and shard.dtype == want.dtype else [False] * len(keys))
    zero = (shard.movedim(dim, 0).reshape(shard.shape[dim], -1) == 0).all(1).tolist()
    held: list[Index] = [d if s else ZEROS if i is None and z else i
                         for i, s, z, d in zip(found, same, zero, declared)]
    want_text = describe(declared, piece, config, full.dim())
    if held == declared:  # every slice where declared: the bytes differ in another way
        return f"rank {rank} {name} holds the declared {want_text}, with values changed"
    return f"rank {rank} {name} holds {describe(held, piece, config, full.dim())}; " \
           f"declared {want_text}"


# What a canonical parameter's indices along one dim are called, by what the parameter is
# (``model.reference.step_of``'s ``what``, the same for every layer) and the dim: the
# convention's own words. Each entry gives the words, or None where the indices are not
# whole units of them (``describe`` then says rows, columns or elements). A parameter kind
# the model gains (an expert's gate_up) adds its entry here.
Words = Callable[[list[Index], "ModelConfig"], str | None]


def _qkv(indices: list[Index], config: ModelConfig) -> str:
    """The fused qkv's canonical rows by head: ``Q heads 0-3, K head 0, V head 0`` for whole
    heads (``in pair order`` for Meta's interleaved-pair rows), ``Q head 0 rows 1-7`` for part
    of one (rows counted from the head's first), and slices found nowhere, padding and zeros
    between them as ``_with_padding`` writes them."""
    hd, q, kv = config.head_dim, config.q_rows, config.kv_rows
    pair = [int(x) for x in torch.argsort(permute_index(hd, 1)).tolist()]  # Meta row order
    base = {"Q": 0, "K": q, "V": q + kv}

    def head(i: Index) -> tuple[str, int] | None:
        if i is None or i < 0:
            return None
        block = "Q" if i < q else "K" if i < q + kv else "V"
        return block, (i - base[block]) // hd

    parts: list[str | tuple[str, int, int, str]] = []  # text, or (block, first, last, order)
    for key, group in itertools.groupby(indices, key=head):
        run = list(group)
        if key is None:
            parts.append(_with_padding(run))
            continue
        block, h = key
        offsets = [int(i) - base[block] - h * hd for i in run]  # type: ignore[arg-type]
        order = ("" if offsets == list(range(hd)) else
                 " in pair order" if offsets == pair else None)
        last = parts[-1] if parts else None
        if order is None:
            parts.append(f"{block} head {h} rows {format_indices(list(offsets))}")
        elif isinstance(last, tuple) and last[0] == block and last[2] == h - 1 \
                and last[3] == order:
            parts[-1] = (block, last[1], h, order)
        else:
            parts.append((block, h, h, order))
    return ", ".join(p if isinstance(p, str) else
                     f"{p[0]} head {p[1]}{p[3]}" if p[1] == p[2] else
                     f"{p[0]} heads {p[1]}-{p[2]}{p[3]}" for p in parts)


def _gate_up(indices: list[Index], config: ModelConfig) -> str:
    """``gate rows 0-351, up rows 0-351``: the two halves of the fused gate_up."""
    return _in_blocks(indices, [("gate", 0, config.ffn), ("up", config.ffn, 2 * config.ffn)])


def _experts(indices: list[Index], config: ModelConfig, down: bool = False) -> str:
    """An MoE layer's experts side by side, told per expert: ``experts 0-3 gate rows 0-63,
    up rows 0-63; expert 5 up rows 0-63, gate rows 0-63`` (its down columns: ``expert 2
    columns 0-63``); consecutive experts that hold the same rows of each share one phrase."""
    f = config.expert_ffn
    width = f if down else 2 * f
    blocks = [("columns", 0, f)] if down else [("gate", 0, f), ("up", f, 2 * f)]

    def expert(i: Index) -> int | None:
        return None if i is None or i < 0 else i // width

    phrases: list[tuple[int | None, int | None, str]] = []  # (first, last expert, text)
    for e, group in itertools.groupby(indices, key=expert):
        run = list(group)
        if e is None:
            phrases.append((None, None, _with_padding(run)))
            continue
        text = _in_blocks([i - e * width for i in run], blocks)  # type: ignore[operator]
        text = text.replace("columns rows", "columns")
        last = phrases[-1] if phrases else None
        if last and last[0] is not None and last[1] == e - 1 and last[2] == text:
            phrases[-1] = (last[0], e, text)
        else:
            phrases.append((e, e, text))
    return "; ".join(t if a is None else f"expert {a} {t}" if a == b else f"experts {a}-{b} {t}"
                     for a, b, t in phrases)


def _vocabulary(indices: list[Index], config: ModelConfig) -> str:
    """``vocabulary rows 0-15999, padding x64``: token ids, and the rows a convention pads."""
    return _in_blocks(indices, [("vocabulary", 0, math.inf)])


VOCABULARY: dict[tuple[str, int], Words] = {
    ("qkv.weight", 0): _qkv,
    ("qkv.bias", 0): _qkv,
    ("gate_up.weight", 0): _gate_up,
    ("tok_embeddings.weight", 0): _vocabulary,
    ("lm_head.weight", 0): _vocabulary,
    ("experts.gate_up.weight", 0): _experts,
    ("experts.down.weight", 1): lambda indices, config: _experts(indices, config, down=True),
}

_AXIS = {0: "rows", 1: "columns"}


def describe(indices: list[Index], piece: Piece, config: ModelConfig,
             ndim: int | None = None) -> str:
    """Canonical indices of ``piece``'s source along its dim as a person reads them: in the
    words ``VOCABULARY`` has for that parameter and dim, else ``rows 0-15999, padding x64``,
    ``columns ?, 353-703`` or ``elements 0-4, ?, 6-255`` (``?`` for a slice found nowhere
    in the canonical tensor, ``zeros`` for an all-zero one, ``Index``). ``ndim``: the
    canonical tensor's (default: its shape's in ``config``)."""
    words = VOCABULARY.get((step_of(piece.source)[1], piece.dim))
    if words is not None and (text := words(indices, config)) is not None:
        return text
    ndim = ndim if ndim is not None else len(config.param_shapes()[piece.source])
    axis = "elements" if ndim == 1 else _AXIS.get(piece.dim, f"indices of dim {piece.dim}")
    return f"{axis} {_with_padding(indices)}"


def _with_padding(indices: list[Index]) -> str:
    """``format_indices``, with each run of padding written ``padding xN`` and each run of
    zero slices found nowhere ``zeros xN``."""
    words = {PADDING: "padding", ZEROS: "zeros"}
    return ", ".join(f"{words[kind]} x{len(run)}" if kind in words else format_indices(run)
                     for kind, group in itertools.groupby(
                         indices, key=lambda i: i if i in words else None)
                     for run in [list(group)])


def _in_blocks(indices: list[Index], blocks: list[tuple[str, int, float]]) -> str:
    """Each run of indices inside one named block, counted from the block's start:
    ``gate rows 0-351, up rows 0-351``; slices found nowhere, padding and zeros between
    them as ``_with_padding`` writes them."""
    def block(i: Index) -> tuple[str, int] | None:
        if i is None or i < 0:
            return None
        return next((label, a) for label, a, b in blocks if a <= i < b)

    parts = []
    for key, group in itertools.groupby(indices, key=block):
        run = list(group)
        if key is None:
            parts.append(_with_padding(run))
        else:
            label, start = key
            offsets: list[int | None] = [int(i) - start for i in run]  # type: ignore[arg-type]
            parts.append(f"{label} rows {format_indices(offsets)}")
    return ", ".join(parts)


def locate(full: torch.Tensor, shard: torch.Tensor, dim: int,
           index: dict[bytes, int] | None = None) -> list[int | None]:
    """For each slice of ``shard`` along ``dim``, the index of the identical slice of ``full``
    along ``dim`` (the first, if repeated), or None if no slice of ``full`` has those bytes.
    ``index`` is ``slice_index(full, dim)`` when the caller keeps one."""
    if _across(full, dim) != _across(shard, dim):
        return [None] * shard.shape[dim]
    index = index if index is not None else slice_index(full, dim)
    return [index.get(key) for key in _slice_keys(shard, dim)]


def _across(x: torch.Tensor, dim: int) -> tuple[int, ...]:
    """The shape of one slice of ``x`` along ``dim``."""
    return tuple(x.shape[:dim] + x.shape[dim + 1:])


def slice_index(full: torch.Tensor, dim: int) -> dict[bytes, int]:
    """The bytes of each slice of ``full`` along ``dim`` -> its first index."""
    index: dict[bytes, int] = {}
    for i, key in enumerate(_slice_keys(full, dim)):
        index.setdefault(key, i)
    return index


def _slice_keys(x: torch.Tensor, dim: int) -> list[bytes]:
    raw_x = raw(x)  # bf16 has no numpy
    rows = np.ascontiguousarray(raw_x.movedim(dim, 0).reshape(x.shape[dim], -1).numpy())
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

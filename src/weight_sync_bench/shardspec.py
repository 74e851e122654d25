"""Placements, ShardSpec and LayoutTable: the declared tensor-parallel layout, as data.

A placement says which part of a full tensor each rank holds at degree t. DTensor's
vocabulary (Shard, Replicate) cannot say it for the two fused tensors, whose rank-local
shard is a non-contiguous selection of source rows, so the harness adds two placements:

- ``HeadPartitioned``: fused qkv ``[(n_heads + 2 * n_kv_heads) * head_dim, d_model]``
  stored as the plain concatenation ``[Q | K | V]``; rank r holds its Q heads, its K heads
  and its V heads: three disjoint row ranges, concatenated in that order.
- ``FusedPaired``: fused gate_up ``[first + second, d_model]`` stored as ``[gate | up]``;
  rank r holds its slice of gate and the matching slice of up: two row ranges.

Placement is a sum type (a closed union of frozen dataclasses), not a record with
independent fields, so a parameter cannot be declared both split and replicated at once.
Every placement divides evenly or is rejected: an uneven split is an ``UnsupportedLayout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, assert_never

from weight_sync_bench.errors import UnsupportedLayout

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from weight_sync_bench.config import ModelConfig

Shape = tuple[int, ...]


def _need(ok: bool, name: str, placement: Placement, degree: int, rule: str, values: str) -> None:
    if not ok:
        raise UnsupportedLayout(f"{name}: {placement.kind} needs {rule} ({values}, t={degree})")


def _check_degree(name: str, degree: int) -> None:
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise UnsupportedLayout(f"{name}: degree must be a positive int, got t={degree!r}")


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    kind = "Replicate"

    def validate(self, shape: Shape, degree: int, name: str) -> None:
        _check_degree(name, degree)

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Rank r holds the r-th of t equal contiguous chunks along ``dim``
    (``torch.chunk(x, t, dim)[r]``, with ``shape[dim] % t == 0`` required)."""

    dim: int
    kind = "Shard"

    def validate(self, shape: Shape, degree: int, name: str) -> None:
        _check_degree(name, degree)
        _need(0 <= self.dim < len(shape), name, self, degree, "0 <= dim < ndim",
              f"dim={self.dim}, ndim={len(shape)}")
        _need(shape[self.dim] % degree == 0, name, self, degree, f"shape[{self.dim}] % t == 0",
              f"shape[{self.dim}]={shape[self.dim]}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class HeadPartitioned:
    """Fused ``[Q | K | V]`` rows split per head: rank r holds Q heads
    ``[r*n_heads/t, (r+1)*n_heads/t)`` and the matching K and V heads, concatenated as
    ``[Q_r | K_r | V_r]``. Needs both head counts divisible by t: fewer KV heads than
    ranks would mean replicating KV heads, which this placement does not state. Applies
    to the fused weight and, 1-D, to its bias, whose rows are split alike."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    kind = "HeadPartitioned"

    @property
    def rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def validate(self, shape: Shape, degree: int, name: str) -> None:
        _check_degree(name, degree)
        _need(len(shape) in (1, 2) and shape[0] == self.rows, name, self, degree,
              "shape[0] == (n_heads + 2 * n_kv_heads) * head_dim",
              f"shape={list(shape)}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
              f"head_dim={self.head_dim}")
        _need(self.n_heads % degree == 0, name, self, degree, "n_heads % t == 0",
              f"n_heads={self.n_heads}")
        _need(self.n_kv_heads % degree == 0, name, self, degree, "n_kv_heads % t == 0",
              f"n_kv_heads={self.n_kv_heads}")

    def __str__(self) -> str:
        return f"HP({self.n_heads},{self.n_kv_heads},{self.head_dim})"


@dataclass(frozen=True)
class FusedPaired:
    """Fused ``[first | second]`` rows split pairwise: rank r holds the r-th chunk of the
    first block and the r-th chunk of the second, concatenated, so that matching neurons
    (gate and up) sit on the same rank."""

    first: int
    second: int
    kind = "FusedPaired"

    def validate(self, shape: Shape, degree: int, name: str) -> None:
        _check_degree(name, degree)
        _need(len(shape) >= 1 and shape[0] == self.first + self.second, name, self, degree,
              "shape[0] == first + second",
              f"shape={list(shape)}, first={self.first}, second={self.second}")
        _need(self.first % degree == 0, name, self, degree, "first % t == 0", f"first={self.first}")
        _need(self.second % degree == 0, name, self, degree, "second % t == 0",
              f"second={self.second}")

    def __str__(self) -> str:
        return f"FP({self.first},{self.second})"


Placement = Replicate | Shard | HeadPartitioned | FusedPaired


def _chunk(start: int, size: int, degree: int, rank: int) -> tuple[int, int]:
    width = size // degree
    return (start + rank * width, start + (rank + 1) * width)


def index_ranges(placement: Placement, shape: Shape, degree: int, rank: int
                 ) -> tuple[int, list[tuple[int, int]]]:
    """The ``(dim, [(start, stop), ...])`` of the full tensor that ``rank`` holds, in the
    order the ranges are concatenated into its local shard. Assumes a validated placement."""
    match placement:
        case Replicate():
            return 0, [(0, shape[0])]
        case Shard(dim=dim):
            return dim, [_chunk(0, shape[dim], degree, rank)]
        case HeadPartitioned(n_heads=nh, n_kv_heads=nkv, head_dim=hd):
            q, kv = nh * hd, nkv * hd
            return 0, [_chunk(0, q, degree, rank), _chunk(q, kv, degree, rank),
                       _chunk(q + kv, kv, degree, rank)]
        case FusedPaired(first=first, second=second):
            return 0, [_chunk(0, first, degree, rank), _chunk(first, second, degree, rank)]
        case _:
            assert_never(placement)


def local_shape(placement: Placement, shape: Shape, degree: int) -> Shape:
    dim, ranges = index_ranges(placement, shape, degree, 0)
    local = list(shape)
    local[dim] = sum(stop - start for start, stop in ranges)
    return tuple(local)


def format_ranges(ranges: list[tuple[int, int]]) -> str:
    """``[(0, 128), (256, 288)]`` -> ``"0-127, 256-287"`` (inclusive, as a person reads rows)."""
    return ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in ranges)


@dataclass(frozen=True)
class ShardSpec:
    """One parameter's declared layout: its full shape and its placement."""

    name: str
    shape: Shape
    placement: Placement

    def validate(self, degree: int) -> None:
        self.placement.validate(self.shape, degree, self.name)

    def local_shape(self, degree: int) -> Shape:
        self.validate(degree)
        return local_shape(self.placement, self.shape, degree)

    def ranges(self, degree: int, rank: int) -> tuple[int, list[tuple[int, int]]]:
        self.validate(degree)
        if not 0 <= rank < degree:
            raise UnsupportedLayout(f"{self.name}: rank {rank} is outside 0..{degree - 1} at t={degree}")
        return index_ranges(self.placement, self.shape, degree, rank)


@dataclass(frozen=True)
class LayoutTable:
    """The declared layout of a whole model: parameter name -> ShardSpec, in forward order."""

    specs: tuple[ShardSpec, ...]

    @classmethod
    def from_mapping(cls, shapes: Mapping[str, Shape], placements: Mapping[str, Placement]
                     ) -> LayoutTable:
        return cls(tuple(ShardSpec(name, tuple(shape), placements[name])
                         for name, shape in shapes.items()))

    def __iter__(self) -> Iterator[ShardSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, name: str) -> ShardSpec:
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def validate(self, degree: int) -> None:
        """Raise the first parameter's UnsupportedLayout at this degree, if any."""
        for spec in self.specs:
            spec.validate(degree)

    def supports(self, degree: int) -> bool:
        try:
            self.validate(degree)
        except UnsupportedLayout:
            return False
        return True

    def supported_degrees(self, max_degree: int = 64) -> list[int]:
        """Every degree in 1..max_degree at which every placement validates (found by probing,
        never listed by hand)."""
        return [t for t in range(1, max_degree + 1) if self.supports(t)]

    def render(self, degrees: list[int] | None = None) -> str:
        """A table: each parameter, its full shape, its placement and its local shape at each
        degree (``-`` where the placement rejects that degree)."""
        degrees = degrees if degrees is not None else self.supported_degrees()
        header = ["parameter", "shape", "placement", *[f"t={t}" for t in degrees]]
        rows = [header]
        for spec in self.specs:
            cells = [spec.name, _shape_str(spec.shape), str(spec.placement)]
            for t in degrees:
                try:
                    cells.append(_shape_str(spec.local_shape(t)))
                except UnsupportedLayout:
                    cells.append("-")
            rows.append(cells)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                         for row in rows)

    def __str__(self) -> str:
        return self.render()


def _shape_str(shape: Shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def layout_for(config: ModelConfig) -> LayoutTable:
    """The declared Megatron-style TP layout of the toy model.

    Column-parallel fused qkv and gate_up, row-parallel o_proj and down (split on the input
    dim, partial sums all-reduced), vocab-parallel embedding and lm_head, replicated norms.
    Only the parameters ``config.param_shapes()`` has are laid out (no lm_head when tied,
    biases only with ``config.bias``); the vocab tables have ``config.padded_vocab`` rows.
    """
    placements: dict[str, Placement] = {
        "tok_embeddings.weight": Shard(0), "norm.weight": Replicate(), "lm_head.weight": Shard(0)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        placements[p + "attn_norm.weight"] = Replicate()
        placements[p + "qkv.weight"] = HeadPartitioned(config.n_heads, config.n_kv_heads,
                                                       config.head_dim)
        # Biases (config.bias): the qkv bias follows its rows; a row-parallel bias is
        # replicated and added once, after the partial sums meet.
        placements[p + "qkv.bias"] = placements[p + "qkv.weight"]
        placements[p + "o_proj.bias"] = Replicate()
        placements[p + "down.bias"] = Replicate()
        placements[p + "o_proj.weight"] = Shard(1)
        placements[p + "ffn_norm.weight"] = Replicate()
        placements[p + "gate_up.weight"] = FusedPaired(config.ffn, config.ffn)
        placements[p + "down.weight"] = Shard(1)
    return LayoutTable.from_mapping(config.param_shapes(), placements)

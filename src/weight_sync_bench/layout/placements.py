"""Placements, ShardSpec and LayoutTable: the declared tensor-parallel layout, as data.

A placement says which part of a full tensor each rank holds at degree t. DTensor's
vocabulary (Shard, Replicate) cannot say it for the two fused tensors, whose rank-local
shard is a non-contiguous selection of source rows, so the harness adds two placements:

- ``HeadPartitioned``: fused qkv ``[(n_heads + 2 * n_kv_heads) * head_dim, d_model]``
  stored as the plain concatenation ``[Q | K | V]``; rank r holds its Q heads, its K heads
  and its V heads: three disjoint row ranges, concatenated in that order.
- ``HeadReplicated``: the same fused qkv when there are fewer KV heads than ranks (vLLM's
  ``QKVParallelLinear`` with ``num_kv_head_replicas > 1``): rank r holds its Q heads and a
  whole copy of KV head ``r * n_kv_heads // t``, so each KV head is replicated on
  ``t / n_kv_heads`` consecutive ranks.
- ``FusedPaired``: fused gate_up ``[first + second, d_model]`` stored as ``[gate | up]``;
  rank r holds its slice of gate and the matching slice of up: two row ranges.

Placement is a sum type (a closed union of frozen dataclasses), not a record with
independent fields, so a parameter cannot be declared both split and replicated at once.
Every placement divides evenly or is rejected: an uneven split is an ``UnsupportedLayout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from weight_sync_bench.errors import UnsupportedLayout

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


def _need_heads(placement: HeadPartitioned | HeadReplicated, shape: Shape, degree: int,
                name: str) -> None:
    """What both head placements need: the fused qkv's row count, Q heads split evenly."""
    nh, nkv, hd = placement.n_heads, placement.n_kv_heads, placement.head_dim
    _need(len(shape) in (1, 2) and shape[0] == placement.rows, name, placement, degree,
          "shape[0] == (n_heads + 2 * n_kv_heads) * head_dim",
          f"shape={list(shape)}, n_heads={nh}, n_kv_heads={nkv}, head_dim={hd}")
    _need(nh % degree == 0, name, placement, degree, "n_heads % t == 0", f"n_heads={nh}")


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
        _need_heads(self, shape, degree, name)
        _need(self.n_kv_heads % degree == 0, name, self, degree, "n_kv_heads % t == 0",
              f"n_kv_heads={self.n_kv_heads}")

    def __str__(self) -> str:
        return f"HP({self.n_heads},{self.n_kv_heads},{self.head_dim})"


@dataclass(frozen=True)
class HeadReplicated:
    """Fused ``[Q | K | V]`` rows with fewer KV heads than ranks: rank r holds Q heads
    ``[r*n_heads/t, (r+1)*n_heads/t)`` and a whole copy of KV head ``r * n_kv_heads // t``
    (its K rows, then its V rows), as ``[Q_r | K_g | V_g]``. Valid only where
    ``HeadPartitioned`` is not: ``t > n_kv_heads`` and ``t % n_kv_heads == 0``, so each KV
    head has ``t / n_kv_heads`` replicas on consecutive ranks (vLLM ``QKVParallelLinear``:
    ``num_kv_head_replicas = t / n_kv_heads``, KV shard ``tp_rank // num_kv_head_replicas``).
    Applies to the fused weight and, 1-D, to its bias."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    kind = "HeadReplicated"

    @property
    def rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def kv_head(self, degree: int, rank: int) -> int:
        """The KV head rank ``rank`` holds a copy of: ``rank * n_kv_heads // t``."""
        return rank * self.n_kv_heads // degree

    def validate(self, shape: Shape, degree: int, name: str) -> None:
        _check_degree(name, degree)
        _need_heads(self, shape, degree, name)
        _need(degree > self.n_kv_heads, name, self, degree,
              "t > n_kv_heads (otherwise HeadPartitioned splits the KV heads)",
              f"n_kv_heads={self.n_kv_heads}")
        _need(degree % self.n_kv_heads == 0, name, self, degree, "t % n_kv_heads == 0",
              f"n_kv_heads={self.n_kv_heads}")

    def __str__(self) -> str:
        return f"HR({self.n_heads},{self.n_kv_heads},{self.head_dim})"


def local_kv_heads(n_kv_heads: int, degree: int) -> int:
    """KV heads each rank attends with: ``n_kv_heads / t`` when they split
    (``HeadPartitioned``), one replicated head when there are fewer than ranks
    (``HeadReplicated``): ``max(1, n_kv_heads // t)``, vLLM's ``num_kv_heads``."""
    return max(1, n_kv_heads // degree)


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


Placement = Replicate | Shard | HeadPartitioned | HeadReplicated | FusedPaired


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
        case HeadReplicated(n_heads=nh, n_kv_heads=nkv, head_dim=hd):
            q, kv, g = nh * hd, nkv * hd, placement.kv_head(degree, rank)
            return 0, [_chunk(0, q, degree, rank), (q + g * hd, q + (g + 1) * hd),
                       (q + kv + g * hd, q + kv + (g + 1) * hd)]
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

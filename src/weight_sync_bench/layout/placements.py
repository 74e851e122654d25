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
- ``Experts``: a Mixture-of-Experts layer's experts side by side along one dim (each
  expert's ``[gate | up]`` rows, or its down columns), split over expert-parallel ranks (which
  experts a rank holds: contiguous, vLLM's "linear" or "round_robin") and expert-TP ranks
  (which chunk of each of its experts' blocks): a rank may hold no expert at all.

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


EXPERT_ORDERS = ("contiguous", "linear", "round_robin")


@dataclass(frozen=True)
class Experts:
    """``n_experts`` experts side by side along ``dim``, each a run of ``blocks`` (its
    ``[gate | up]`` rows: ``(F, F)``; its down columns: ``(F,)``), split over ``ep``
    expert-parallel and ``etp`` expert-TP ranks (``etp`` 0: every rank of the degree not taken
    by ``ep``, ``t / ep``). A rank's coordinates follow Megatron-Core's expert rank order
    (``parallel_state.initialize_model_parallel``: ``RankGenerator(tp=etp, ep=ep, dp=edp)``,
    order "tp-cp-ep-dp-pp", the first fastest): ``etp_rank = r % etp``, ``ep_rank = (r //
    etp) % ep``, ``edp_rank = r // (etp * ep)``; ``edp = t / (ep * etp)`` ranks hold each
    expert chunk. Rank r holds, for each of its EP rank's experts (``experts_of``, in local
    order), chunk ``etp_rank`` of each block.

    Which experts an EP rank holds (``order``): ``contiguous`` (Megatron-Core
    ``BaseMoELayer``: ``ep_rank * E/ep + i``, ``E % ep == 0``; SGLang's ranges), ``linear``
    (vLLM ``determine_expert_map``: ``E // ep`` each, the remainder one each to the *first*
    ``E % ep`` ranks, starting at ``ep_rank * (E // ep) + min(ep_rank, E % ep)``; its docstring
    says the last), ``round_robin`` (vLLM: ``ep_rank, ep_rank + ep, ...``)."""

    n_experts: int
    blocks: tuple[int, ...]
    dim: int = 0
    ep: int = 1
    etp: int = 0
    order: str = "contiguous"
    kind = "Experts"

    def __post_init__(self) -> None:
        # a tuple, whatever sequence it was given as: a placement is a cache key (layout.table)
        object.__setattr__(self, "blocks", tuple(self.blocks))

    @property
    def width(self) -> int:
        """One expert's extent along ``dim``."""
        return sum(self.blocks)

    def expert_tp(self, degree: int) -> int:
        return self.etp or degree // self.ep

    def coordinates(self, degree: int, rank: int) -> tuple[int, int, int]:
        """``(etp_rank, ep_rank, edp_rank)`` of ``rank`` at degree ``degree``."""
        etp = self.expert_tp(degree)
        return rank % etp, (rank // etp) % self.ep, rank // (etp * self.ep)

    def replicas(self, degree: int) -> int:
        """``edp``: how many ranks hold each expert chunk."""
        return degree // (self.ep * self.expert_tp(degree))

    def experts_of(self, ep_rank: int) -> list[int]:
        """The global expert ids EP rank ``ep_rank`` holds, in its local order."""
        e, p = self.n_experts, self.ep
        match self.order:
            case "round_robin":
                return list(range(ep_rank, e, p))
            case "linear":
                base, rem = divmod(e, p)
                start = ep_rank * base + min(ep_rank, rem)
                return list(range(start, start + base + (1 if ep_rank < rem else 0)))
            case _:
                return list(range(ep_rank * (e // p), (ep_rank + 1) * (e // p)))

    def owners(self, expert: int) -> int:
        """The EP rank that holds ``expert``."""
        return next(p for p in range(self.ep) if expert in self.experts_of(p))

    def validate(self, shape: Shape, degree: int, name: str) -> None:
        _check_degree(name, degree)
        _need(0 <= self.dim < len(shape), name, self, degree, "0 <= dim < ndim",
              f"dim={self.dim}, ndim={len(shape)}")
        _need(shape[self.dim] == self.n_experts * self.width, name, self, degree,
              f"shape[{self.dim}] == n_experts * sum(blocks)",
              f"shape={list(shape)}, n_experts={self.n_experts}, blocks={list(self.blocks)}")
        _need(self.order in EXPERT_ORDERS, name, self, degree, f"order in {EXPERT_ORDERS}",
              f"order={self.order!r}")
        _need(self.ep >= 1 and self.etp >= 0, name, self, degree, "ep >= 1 and etp >= 0",
              f"ep={self.ep}, etp={self.etp}")
        _need(degree % self.ep == 0, name, self, degree, "t % ep == 0", f"ep={self.ep}")
        etp = self.expert_tp(degree)
        _need(degree % (self.ep * etp) == 0, name, self, degree, "t % (ep * etp) == 0",
              f"ep={self.ep}, etp={etp}")
        _need(self.order != "contiguous" or self.n_experts % self.ep == 0, name, self, degree,
              "n_experts % ep == 0 (contiguous experts)",
              f"n_experts={self.n_experts}, ep={self.ep}")
        for b in self.blocks:
            _need(b % etp == 0, name, self, degree, "each block % etp == 0 (an expert's "
                  "intermediate size splits over its expert-TP ranks)",
                  f"blocks={list(self.blocks)}, etp={etp}")

    def __str__(self) -> str:
        parts = [str(self.n_experts)]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.etp:
            parts.append(f"etp={self.etp}")
        if self.order != "contiguous":
            parts.append(self.order)
        return f"EX({','.join(parts)})"


@dataclass(frozen=True)
class DataParallel:
    """``inner`` over a TP group of ``tp`` ranks, repeated on each of ``t / tp`` data-parallel
    replicas: rank r holds what TP rank ``r % tp`` holds (Megatron-Core's rank order, TP
    fastest). A Megatron layout whose experts spread over more ranks than its TP group
    (``ep * etp > tp``) holds its dense layers so."""

    inner: Replicate | Shard | HeadPartitioned | HeadReplicated | FusedPaired
    tp: int
    kind = "DataParallel"

    def validate(self, shape: Shape, degree: int, name: str) -> None:
        _check_degree(name, degree)
        _need(self.tp >= 1 and degree % self.tp == 0, name, self, degree, "t % tp == 0",
              f"tp={self.tp}")
        self.inner.validate(shape, self.tp, name)

    def __str__(self) -> str:
        return f"{self.inner}@tp{self.tp}"


Placement = (Replicate | Shard | HeadPartitioned | HeadReplicated | FusedPaired | Experts
             | DataParallel)


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
        case DataParallel(inner=inner, tp=tp):
            return index_ranges(inner, shape, tp, rank % tp)
        case Experts(dim=dim):
            etp_rank, ep_rank, _ = placement.coordinates(degree, rank)
            etp, out = placement.expert_tp(degree), []
            for e in placement.experts_of(ep_rank):
                at = e * placement.width
                for b in placement.blocks:
                    out.append(_chunk(at, b, etp, etp_rank))
                    at += b
            return dim, out
        case _:
            assert_never(placement)


def local_shape(placement: Placement, shape: Shape, degree: int, rank: int = 0) -> Shape:
    """Rank ``rank``'s local shape (every rank's but under ``Experts`` with an uneven expert
    count: vLLM's "linear" and "round_robin" give some EP ranks one expert more)."""
    dim, ranges = index_ranges(placement, shape, degree, rank)
    local = list(shape)
    local[dim] = sum(stop - start for start, stop in ranges)
    return tuple(local)


def format_ranges(ranges: list[tuple[int, int]]) -> str:
    """``[(0, 128), (256, 288)]`` -> ``"0-127, 256-287"`` (inclusive, as a person reads rows)."""
    return ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in ranges)


def index_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive indices as ``(start, stop)`` runs: ``[0, 1, 2, 5]`` -> ``[(0, 3), (5, 6)]``."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out

"""split / gather / reshard: pure data movement under a LayoutTable, exact to the bit.

These functions know layouts and tensors, nothing of the model. ``gather`` is the exact
inverse of ``split`` (``gather(split(x, t)) == x`` byte for byte), and
``reshard(split(x, s), d) == split(x, d)`` for every ordered pair of supported degrees.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.errors import InvalidShards, WrongShardShape
from weight_sync_bench.layout.placements import Replicate

if TYPE_CHECKING:
    from weight_sync_bench.layout.table import LayoutTable, ShardSpec


Params = dict[str, torch.Tensor]


def split_tensor(x: torch.Tensor, spec: ShardSpec, degree: int) -> list[torch.Tensor]:
    """Rank-local shards of one full tensor; each is a fresh contiguous tensor (no aliasing)."""
    if tuple(x.shape) != spec.shape:
        raise InvalidShards(f"{spec.name}: full tensor has shape {list(x.shape)}, "
                            f"layout declares {list(spec.shape)}")
    shards = []
    for rank in range(degree):
        dim, ranges = spec.ranges(degree, rank)
        pieces = [x.narrow(dim, start, stop - start) for start, stop in ranges]
        shards.append(_joined(pieces, x, dim).clone(memory_format=torch.contiguous_format)
                      if len(pieces) < 2 else torch.cat(pieces, dim=dim))
    return shards


def _joined(pieces: list[torch.Tensor], x: torch.Tensor, dim: int) -> torch.Tensor:
    """One piece as it is (a view), several concatenated, none an empty slice of ``x``
    (an ``Experts`` rank that holds no expert)."""
    if not pieces:
        return x.narrow(dim, 0, 0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def shard_of(x: torch.Tensor, spec: ShardSpec, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of one full tensor, byte for byte ``split_tensor``'s, as a view
    of ``x`` where one range holds it (no copy: what a comparison reads and drops)."""
    dim, ranges = spec.ranges(degree, rank)
    return _joined([x.narrow(dim, start, stop - start) for start, stop in ranges], x, dim)


def gather_tensor(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from its rank-local shards: the exact inverse of ``split_tensor``.

    A replicated parameter is taken from rank 0 (replicas that disagree are a layout
    violation that ``check`` reports; gather does not guess which copy is right).
    """
    _check_local_shapes(shards, spec)
    if isinstance(spec.placement, Replicate):
        return shards[0].clone()
    full = torch.empty(spec.shape, dtype=shards[0].dtype)
    for piece, index in declared_pieces(shards, spec):
        full[index].copy_(piece)
    return full


def declared_pieces(shards: Sequence[torch.Tensor], spec: ShardSpec
                    ) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
    """Each rank's shard cut into ``(view of the shard, index of the global tensor)``: the
    view holds ``full[index]`` of the full tensor it was split from, so a comparison reads
    every shard against its declared slice of a global tensor without assembling one. In
    ``gather_tensor``'s order, which copies each view to its index; a replicated parameter is
    rank 0's copy against the whole tensor, as ``gather_tensor`` takes it."""
    if isinstance(spec.placement, Replicate):
        return [(shards[0], ())]
    out = []
    for rank, shard in enumerate(shards):
        dim, ranges = spec.ranges(len(shards), rank)
        offset = 0
        for start, stop in ranges:
            index = (slice(None),) * dim + (slice(start, stop),)
            out.append((shard.narrow(dim, offset, stop - start), index))
            offset += stop - start
    return out


def split(full: Mapping[str, torch.Tensor], layout: LayoutTable, degree: int) -> list[Params]:
    """Every parameter split to ``degree`` ranks: ``result[rank][name]`` is rank-local."""
    layout.validate(degree)
    _check_names(full.keys(), layout, "full params")
    per_rank: list[Params] = [{} for _ in range(degree)]
    for spec in layout:
        for rank, shard in enumerate(split_tensor(full[spec.name], spec, degree)):
            per_rank[rank][spec.name] = shard
    return per_rank


def gather(shards: list[Params], layout: LayoutTable) -> Params:
    """Full parameters from rank-local shards: the exact inverse of ``split``."""
    if not shards:
        raise InvalidShards("gather needs at least one rank's shards, got none")
    layout.validate(len(shards))
    for rank, params in enumerate(shards):
        _check_names(params.keys(), layout, f"rank {rank}")
    return {spec.name: gather_tensor([params[spec.name] for params in shards], spec)
            for spec in layout}


def reshard_tensor(shards: list[torch.Tensor], spec: ShardSpec, dst: int) -> list[torch.Tensor]:
    """One parameter's shards at degree ``len(shards)`` -> its shards at ``dst``, copying each
    byte once: every destination range is cut straight from the source shards that hold it,
    without materialising the full tensor."""
    _check_local_shapes(shards, spec)
    if isinstance(spec.placement, Replicate):
        return [shards[0].clone() for _ in range(dst)]
    out = []
    for dim, plan in _plan(spec, len(shards), dst):
        pieces = [piece for _, piece in _views(shards, dim, plan)]
        out.append(_joined(pieces, shards[0], dim).clone(memory_format=torch.contiguous_format)
                   if len(pieces) < 2 else torch.cat(pieces, dim=dim))
    return out


def reshard_pieces(shards: list[torch.Tensor], spec: ShardSpec, dst: int, rank: int
                   ) -> list[tuple[int, torch.Tensor]]:
    """Destination rank ``rank``'s shard at ``dst`` as views of the source shards (degree
    ``len(shards)``): ``(offset along the placement's dim in the destination shard, view)``
    in order, so their concatenation is ``reshard_tensor``'s shard and a comparison reads
    them without copying. A replicated parameter is rank 0's copy, whole."""
    if isinstance(spec.placement, Replicate):
        return [(0, shards[0])]
    return _views(shards, *_plan(spec, len(shards), dst)[rank])


def _views(shards: list[torch.Tensor], dim: int, plan: tuple[tuple[int, int, int, int], ...]
           ) -> list[tuple[int, torch.Tensor]]:
    """One destination rank's pieces as ``(offset in its shard, view of a source shard)``."""
    return [(at, shards[r].narrow(dim, offset, size)) for at, r, offset, size in plan]


def _reshard_plan(spec: ShardSpec, src: int, dst: int
                  ) -> tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]:
    """Where each destination rank's shard at ``dst`` comes from at ``src``: per rank, its dim
    and ``(offset in the destination shard, source rank, offset in that rank's shard, size)``
    of each piece, in order. A replicated range (HeadReplicated's KV head) is read from its
    lowest rank, as gather does."""
    segments = []  # (global start, global stop, source rank, offset in that rank's shard)
    seen: set[tuple[int, int]] = set()
    for src_rank in range(src):
        _, ranges = spec.ranges(src, src_rank)
        offset = 0
        for start, stop in ranges:
            if (start, stop) not in seen:
                seen.add((start, stop))
                segments.append((start, stop, src_rank, offset))
            offset += stop - start
    plans = []
    for rank in range(dst):
        dim, ranges = spec.ranges(dst, rank)
        pieces, at = [], 0
        for a, b in ranges:
            for sa, sb, r, off in segments:
                if sa < b and a < sb:
                    size = min(b, sb) - max(a, sa)
                    pieces.append((at, r, off + max(a, sa) - sa, size))
                    at += size
        plans.append((dim, tuple(pieces)))
    return tuple(plans)


# once per (spec, src, dst); the uncached function is what mutation testing mutates
_plan = functools.lru_cache(maxsize=1 << 14)(_reshard_plan)


def reshard(shards: list[Params], layout: LayoutTable, dst: int) -> list[Params]:
    """Shards at degree ``len(shards)`` -> shards at degree ``dst`` under the same layout,
    equal byte for byte to ``split(gather(shards), dst)`` but copying each byte once."""
    if not shards:
        raise InvalidShards("reshard needs at least one rank's shards, got none")
    layout.validate(len(shards))
    layout.validate(dst)
    for rank, params in enumerate(shards):
        _check_names(params.keys(), layout, f"rank {rank}")
    out: list[Params] = [{} for _ in range(dst)]
    for spec in layout:
        for rank, shard in enumerate(reshard_tensor([p[spec.name] for p in shards], spec, dst)):
            out[rank][spec.name] = shard
    return out


def validate_shards(shards: object, layout: LayoutTable, degree: int,
                       dtype: torch.dtype | Mapping[str, torch.dtype] = torch.float32) -> None:
    """Raise unless ``shards`` is a list of ``degree`` dicts with exactly the layout's names,
    local shapes and dtypes (``dtype``: one for all, or per parameter name).

    ``InvalidShards`` for a wrong container, rank count or names; ``WrongShardShape``
    (naming rank, parameter, expected and actual) for the first wrong shape or dtype.
    """
    layout.validate(degree)
    if not isinstance(shards, Sequence) or isinstance(shards, (str, bytes)):
        raise InvalidShards(f"expected a list of {degree} rank dicts, got {type(shards).__name__}")
    if len(shards) != degree:
        raise InvalidShards(f"expected {degree} rank dicts at t={degree}, got {len(shards)}")
    for rank, params in enumerate(shards):
        if not isinstance(params, Mapping):
            raise InvalidShards(f"rank {rank}: expected a dict of tensors, got "
                                f"{type(params).__name__}")
        missing = [n for n in layout.names if n not in params]
        extra = sorted(set(params) - set(layout.names))
        if missing or extra:
            parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unexpected {', '.join(extra)}"] if extra else [])
            raise InvalidShards(f"rank {rank}: {'; '.join(parts)}")
        for spec in layout:
            x = params[spec.name]
            if not isinstance(x, torch.Tensor):
                raise InvalidShards(f"rank {rank} {spec.name}: expected a Tensor, got "
                                    f"{type(x).__name__}")
            want, actual = spec.local_shape(degree, rank), tuple(x.shape)
            if actual != want:
                raise WrongShardShape(
                    f"rank {rank} {spec.name}: shape {list(actual)}, declared {list(want)} "
                    f"({spec.placement} at t={degree})",
                    rank=rank, name=spec.name, expected=want, actual=actual)
            expected = dtype if isinstance(dtype, torch.dtype) else dtype[spec.name]
            if x.dtype != expected:
                raise WrongShardShape(f"rank {rank} {spec.name}: dtype {x.dtype}, expected "
                                      f"{expected}", rank=rank, name=spec.name,
                                      expected_dtype=expected, actual_dtype=x.dtype)


def _check_local_shapes(shards: list[torch.Tensor], spec: ShardSpec) -> None:
    for rank, (shard, expected) in enumerate(zip(shards, _local_shapes(spec, len(shards)))):
        if tuple(shard.shape) != expected:
            raise InvalidShards(f"rank {rank} {spec.name}: shape {list(shard.shape)}, "
                                f"expected {list(expected)} at t={len(shards)}")


def _every_local_shape(spec: ShardSpec, degree: int) -> tuple[tuple[int, ...], ...]:
    """Every rank's local shape of ``spec`` at ``degree``."""
    return tuple(tuple(spec.local_shape(degree, rank)) for rank in range(degree))


_local_shapes = functools.lru_cache(maxsize=1 << 14)(_every_local_shape)


def clear_caches() -> None:
    """Forget the cached plans and local shapes (``table.clear_caches`` says why)."""
    _plan.cache_clear()
    _local_shapes.cache_clear()


def _check_names(names: object, layout: LayoutTable, where: str) -> None:
    have, want = set(names), set(layout.names)  # type: ignore[call-overload]
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(extra)}"] if extra else [])
        raise InvalidShards(f"{where}: {'; '.join(parts)}")

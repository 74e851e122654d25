"""The planner: source and destination covers intersected into transfers, as data.

For every canonical parameter, one sweep along the dim the source boxes split it on, over
the sorted endpoints of the source and destination intervals (output-sensitive, never all
pairs of boxes). Between two consecutive endpoints the set of source boxes holding the
segment and the set of destination boxes needing it are constant; each needing box takes
the segment from

- its own rank's copy, when that rank holds it (a local copy, no bytes on the wire);
- else from the source ranks holding it: one holder, or, when it is replicated (DP
  replicas, replicated norms, vLLM's replicated KV heads), split in equal row ranges over
  the holders, the largest part to the least-loaded, so the bytes each rank sends stay
  level.

Pieces of the same (source box, destination box) on adjacent segments are coalesced, so
a transfer is a maximal region. When source and destination split a parameter along
different dims (Meta's embedding on the hidden dim, the others on the vocabulary) the
regions are rectangles: every pair intersects, which is what the sweep then enumerates.

A ``Plan`` prints (``str``: the summary), lists its transfers (``describe``), counts its
bytes per rank, and cuts each rank pair's transfers into messages of at most a bucket
(``messages``), the unit the executor sends. ``plan_for`` caches plans per (source layout,
destination layout), i.e. per layout pair and geometry, and records each build time.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from weight_sync_bench.errors import InvalidNumber
from weight_sync_bench.sync.boxes import Box, Cover, cover_of

if TYPE_CHECKING:
    from weight_sync_bench.sync.layouts import SyncLayout

Region = tuple[tuple[int, int], ...]  # canonical (start, stop) per dim
ELEMENT_SIZE = 4  # fp32: every parameter the harness makes


@dataclass(frozen=True)
class Transfer:
    """Canonical ``region`` of ``param`` from ``src_rank``'s stored ``src_name`` (the region's
    corner at local index ``src_at``) into ``dst_rank``'s ``dst_name`` (corner ``dst_at``).
    ``src_rank == dst_rank``: a local copy."""

    param: str
    src_rank: int
    src_name: str
    dst_rank: int
    dst_name: str
    region: Region
    src_at: tuple[int, ...]
    dst_at: tuple[int, ...]

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    @property
    def numel(self) -> int:
        return int(np.prod([b - a for a, b in self.region]))

    def along(self, shape: tuple[int, ...]) -> list[int]:
        """The dims along which the region is not the whole tensor."""
        return [d for d, (a, b) in enumerate(self.region) if (a, b) != (0, shape[d])]

    def __str__(self) -> str:
        dims = ", ".join(f"{a}-{b - 1}" for a, b in self.region)
        how = "local" if self.local else f"rank {self.src_rank} -> rank {self.dst_rank}"
        return (f"{how}: {self.param}[{dims}] from {self.src_name} at {list(self.src_at)} "
                f"into {self.dst_name} at {list(self.dst_at)} ({self.numel} elements)")


@dataclass(frozen=True)
class Segment:
    """Part of a transfer that one message carries: ``region`` inside ``transfers[index]``."""

    index: int
    region: Region

    @property
    def numel(self) -> int:
        return int(np.prod([b - a for a, b in self.region]))


@dataclass(frozen=True)
class Message:
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)


@dataclass(frozen=True, eq=False)
class Plan:
    """Every transfer from ``src`` to ``dst`` over ``world = max(src.world, dst.world)``
    ranks (a destination rank is also the source rank of the same number)."""

    src: SyncLayout
    dst: SyncLayout
    transfers: tuple[Transfer, ...]
    build_seconds: float
    mutation: str | None = None
    _messages: dict[int, dict[tuple[int, int], list[Message]]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def world(self) -> int:
        return max(self.src.world, self.dst.world)

    @property
    def label(self) -> str:
        base = f"{self.src} -> {self.dst}"
        return base + (f" (mutation {self.mutation})" if self.mutation else "")

    def remote(self) -> list[Transfer]:
        return [t for t in self.transfers if not t.local]

    def local_copies(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.local and t.dst_rank == rank]

    @property
    def bytes_between_ranks(self) -> int:
        return ELEMENT_SIZE * sum(t.numel for t in self.remote())

    def sent(self) -> list[int]:
        """Bytes each rank sends to other ranks, by the plan."""
        out = [0] * self.world
        for t in self.remote():
            out[t.src_rank] += ELEMENT_SIZE * t.numel
        return out

    def received(self) -> list[int]:
        out = [0] * self.world
        for t in self.remote():
            out[t.dst_rank] += ELEMENT_SIZE * t.numel
        return out

    def pairs(self) -> dict[tuple[int, int], int]:
        """Bytes per ordered pair (src rank, dst rank) of different ranks."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for t in self.remote():
            out[(t.src_rank, t.dst_rank)] += ELEMENT_SIZE * t.numel
        return dict(sorted(out.items()))

    def messages(self, bucket_bytes: int) -> dict[tuple[int, int], list[Message]]:
        """Each ordered rank pair's remote transfers, in plan order, cut along dim 0 of
        their regions and packed into messages of at most ``bucket_bytes`` (cached per
        bucket). ``InvalidNumber`` if one index of a region (a row) exceeds the bucket."""
        if bucket_bytes not in self._messages:
            self._messages[bucket_bytes] = _pack(self, bucket_bytes)
        return self._messages[bucket_bytes]

    def with_transfers(self, transfers: list[Transfer], mutation: str) -> Plan:
        """A copy with other transfers (the planner's mutations), messages recomputed."""
        return replace(self, transfers=tuple(transfers), mutation=mutation, _messages={})

    def summary(self) -> str:
        remote = self.remote()
        sent, received = self.sent(), self.received()
        head = (f"plan {self.label} for {self.src.config.name}: world {self.world}, "
                f"{len(self.transfers)} transfers ({len(self.transfers) - len(remote)} local "
                f"copies, {len(remote)} between ranks over {len(self.pairs())} rank pairs), "
                f"{self.bytes_between_ranks} bytes between ranks, built in "
                f"{self.build_seconds * 1e3:.2f} ms")
        lines = [head]
        lines.append("  rank  sent bytes  received bytes  local copy bytes")
        local = [0] * self.world
        for t in self.transfers:
            if t.local:
                local[t.dst_rank] += ELEMENT_SIZE * t.numel
        for r in range(self.world):
            lines.append(f"  {r:<4}  {sent[r]:<10}  {received[r]:<14}  {local[r]}")
        return "\n".join(lines)

    def describe(self, limit: int | None = 20) -> str:
        """The transfers, one a line (the first ``limit``; None for all)."""
        shown = self.transfers if limit is None else self.transfers[:limit]
        more = len(self.transfers) - len(shown)
        return "\n".join([str(t) for t in shown] + ([f"... {more} more"] if more else []))

    def __str__(self) -> str:
        return self.summary()


_CACHE: dict[tuple[object, object], Plan] = {}


def plan_for(src: SyncLayout, dst: SyncLayout) -> Plan:
    """The plan from ``src`` to ``dst`` (both covers validated first), cached per
    (layout pair, geometry): a second call returns the same object, with the first build's
    ``build_seconds``."""
    key = (src.key, dst.key)
    if key not in _CACHE:
        _CACHE[key] = build_plan(cover_of(src), cover_of(dst))
    return _CACHE[key]


def build_plan(src: Cover, dst: Cover) -> Plan:
    """Intersect two covers (see the module docstring); not cached, not validated."""
    paused = gc.isenabled()
    gc.disable()  # a collection of the caller's heap is not the planner's time
    try:
        started = time.perf_counter()
        load: dict[int, int] = defaultdict(int)  # bytes each source rank sends so far
        transfers: list[Transfer] = []
        for param in src.layout.config.param_shapes():
            transfers += _sweep(param, src, dst, load)
        seconds = time.perf_counter() - started
    finally:
        if paused:
            gc.enable()
    return Plan(src.layout, dst.layout, tuple(transfers), seconds)


def _sweep(param: str, src: Cover, dst: Cover, load: dict[int, int]) -> list[Transfer]:
    shape = src.layout.config.param_shapes()[param]
    sources, needs = src.boxes(param), dst.boxes(param)
    if not needs:
        return []
    axis = sources[0].dim  # the sweep dim: the one the source splits along

    def interval(b: Box) -> tuple[int, int]:
        return (b.start, b.stop) if b.dim == axis else (0, shape[axis])

    events = sorted([(interval(b)[0], 1, 0, i) for i, b in enumerate(sources)]
                    + [(interval(b)[1], 0, 0, i) for i, b in enumerate(sources)]
                    + [(interval(b)[0], 1, 1, i) for i, b in enumerate(needs)]
                    + [(interval(b)[1], 0, 1, i) for i, b in enumerate(needs)])
    active: tuple[dict[int, Box], dict[int, Box]] = ({}, {})
    pieces: list[list[int]] = []  # [need index, source index, start, stop] on the sweep dim
    last: dict[tuple[int, int], int] = {}  # (need, source) -> its newest piece
    pos, i = 0, 0
    while i < len(events):
        nxt = events[i][0]
        if nxt > pos and active[1]:
            holders = list(active[0].items())
            for n, need in active[1].items():
                per_index = ELEMENT_SIZE * int(np.prod(
                    [need.length if d == need.dim else size
                     for d, size in enumerate(shape) if d != axis]))
                for s, start, stop in _choose(holders, need.rank, pos, nxt, load, per_index):
                    j = last.get((n, s))
                    if j is not None and pieces[j][3] == start:
                        pieces[j][3] = stop  # coalesce with the adjacent segment
                    else:
                        last[(n, s)] = len(pieces)
                        pieces.append([n, s, start, stop])
        pos = nxt
        while i < len(events) and events[i][0] == nxt:
            _, opening, side, index = events[i]
            if opening:
                active[side][index] = (sources, needs)[side][index]
            else:
                active[side].pop(index, None)
            i += 1
    out = [_transfer(param, shape, axis, sources[s], needs[n], start, stop)
           for n, s, start, stop in pieces]
    out.sort(key=lambda t: (t.dst_rank, t.dst_name, t.dst_at, t.src_rank))
    return out


def _choose(holders: list[tuple[int, Box]], rank: int, start: int, stop: int,
            load: dict[int, int], unit_bytes: int) -> list[tuple[int, int, int]]:
    """``(source box index, start, stop)`` parts of ``[start, stop)`` for a box on ``rank``:
    the local copy if ``rank`` holds one, else equal parts over the holders, the largest to
    the least loaded (ties: lowest rank)."""
    for s, box in holders:
        if box.rank == rank:
            return [(s, start, stop)]
    if not holders:
        raise AssertionError("a validated cover holds every index")  # pragma: no cover
    ranked = sorted(holders, key=lambda h: (load[h[1].rank], h[1].rank))
    n = stop - start
    k = min(len(ranked), n)
    parts = []
    at = start
    for j, (s, box) in enumerate(ranked[:k]):
        size = n // k + (1 if j < n % k else 0)
        parts.append((s, at, at + size))
        load[box.rank] += size * unit_bytes
        at += size
    return parts


def _transfer(param: str, shape: tuple[int, ...], axis: int, source: Box, need: Box,
              start: int, stop: int) -> Transfer:
    region = [(0, size) for size in shape]
    region[axis] = (start, stop)
    if need.dim != axis:
        region[need.dim] = (need.start, need.stop)
    src_at = [a for a, _ in region]
    src_at[source.dim] = region[source.dim][0] - source.start + source.offset
    dst_at = [a for a, _ in region]
    dst_at[need.dim] = region[need.dim][0] - need.start + need.offset
    return Transfer(param, source.rank, source.name, need.rank, need.name, tuple(region),
                    tuple(src_at), tuple(dst_at))


def _pack(plan: Plan, bucket_bytes: int) -> dict[tuple[int, int], list[Message]]:
    bucket_bytes = InvalidNumber.count("bucket_bytes", bucket_bytes, minimum=ELEMENT_SIZE)
    bucket = bucket_bytes // ELEMENT_SIZE
    out: dict[tuple[int, int], list[Message]] = defaultdict(list)
    open_: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    filled: dict[tuple[int, int], int] = defaultdict(int)  # elements in each open message
    for index, t in enumerate(plan.transfers):
        if t.local:
            continue
        pair = (t.src_rank, t.dst_rank)
        (a, b), rest = t.region[0], t.region[1:]
        row = int(np.prod([z - y for y, z in rest]))
        if row > bucket:
            raise InvalidNumber(f"bucket_bytes={bucket_bytes} is smaller than one row of "
                                f"{t.param} ({row} elements = {row * ELEMENT_SIZE} bytes, "
                                f"rank {t.src_rank} -> rank {t.dst_rank})")
        while a < b:
            rows = min(b - a, (bucket - filled[pair]) // row)
            if rows == 0:
                out[pair].append(Message(tuple(open_.pop(pair))))
                filled[pair] = 0
                continue
            open_[pair].append(Segment(index, ((a, a + rows), *rest)))
            filled[pair] += rows * row
            a += rows
    for pair, segments in open_.items():
        if segments:
            out[pair].append(Message(tuple(segments)))
    return dict(out)

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
class Run:
    """``count`` blocks of shape ``extents`` copied as one strided view on each side: block i
    from the stored ``src_name`` at local index ``src_at + i * src_step`` into the stored
    ``dst_name`` at ``dst_at + i * dst_step`` and, in a message, at staging element offset
    ``buf_at + i * block`` (the staging holds a message's runs one after another).

    A per-row cover (Meta's q and k rows interleave the two halves of each HF head,
    ``permute`` in transformers' ``convert_llama_weights_to_hf``) makes one transfer per
    row: hundreds of thousands at a real width, each a Python-level copy. Grouped into runs
    they are one copy per (head, half)."""

    src_name: str
    dst_name: str
    extents: tuple[int, ...]
    src_at: tuple[int, ...]
    dst_at: tuple[int, ...]
    src_step: tuple[int, ...]
    dst_step: tuple[int, ...]
    count: int
    buf_at: int = 0

    @property
    def block(self) -> int:
        return int(np.prod(self.extents))

    @property
    def numel(self) -> int:
        return self.block * self.count


Block = tuple[str, tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]
# (src name, src local corner, dst name, dst local corner, extents)


def runs(blocks: list[Block]) -> tuple[Run, ...]:
    """``blocks`` grouped into ``Run`` s: in copy order, consecutive blocks of the same source
    and destination tensors and extents whose corners advance by the same non-negative step
    on both sides are one run. The copy order is by source tensor and corner when no two
    destination blocks overlap (then the order of the writes cannot matter), else the given
    order, kept (a mutated plan's overlapping boxes: the later write wins, as it did block
    by block). Staging offsets follow the runs."""
    order = sorted(blocks) if _disjoint(blocks) else blocks
    out: list[Run] = []
    buf = 0
    for src, src_at, dst, dst_at, extents in order:
        r = out[-1] if out else None
        if r is not None and (r.src_name, r.dst_name, r.extents) == (src, dst, extents):
            if r.count == 1:
                src_step = tuple(b - a for a, b in zip(r.src_at, src_at))
                dst_step = tuple(b - a for a, b in zip(r.dst_at, dst_at))
                if min(src_step + dst_step) >= 0 and any(dst_step):
                    out[-1] = replace(r, src_step=src_step, dst_step=dst_step, count=2)
                    buf += r.block
                    continue
            elif (all(a + r.count * d == b for a, d, b in zip(r.src_at, r.src_step, src_at))
                  and all(a + r.count * d == b for a, d, b in zip(r.dst_at, r.dst_step, dst_at))):
                out[-1] = replace(r, count=r.count + 1)
                buf += r.block
                continue
        zero = (0,) * len(extents)
        out.append(Run(src, dst, extents, src_at, dst_at, zero, zero, 1, buf))
        buf += int(np.prod(extents))
    return tuple(out)


def _disjoint(blocks: list[Block]) -> bool:
    """Whether no two blocks write an element of the same destination tensor in common (a
    sweep along dim 0 per tensor, each block checked only against those still open)."""
    by_name: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = defaultdict(list)
    for _, _, dst, at, extents in blocks:
        if all(extents):
            by_name[dst].append((at, tuple(a + e for a, e in zip(at, extents))))
    for boxes in by_name.values():
        boxes.sort()
        open_: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for lo, hi in boxes:
            open_ = [(a, b) for a, b in open_ if b[0] > lo[0]]
            if any(all(x < d and c < y for x, y, c, d in zip(lo, hi, a, b)) for a, b in open_):
                return False
            open_.append((lo, hi))
    return True


@dataclass(frozen=True)
class Message:
    """Segments sent as one message, and the ``runs`` the sender packs them by and the
    receiver unpacks them by (the same object at both ends: the staging layout)."""

    segments: tuple[Segment, ...]
    runs: tuple[Run, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)


def _overlap(a: Transfer, b: Transfer) -> bool:
    """Whether two transfers into one destination tensor write a common element."""
    return all(x < y + (d - c) and y < x + (bb - aa)
               for x, y, (aa, bb), (c, d) in zip(a.dst_at, b.dst_at, a.region, b.region))


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
    _local: dict[int, tuple[Run, ...]] = field(default_factory=dict, repr=False,
                                               compare=False)

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

    def local_runs(self, rank: int) -> tuple[Run, ...]:
        """``rank``'s local copies grouped into runs (``runs``), cached per rank."""
        if rank not in self._local:
            self._local[rank] = runs([_block(t, t.region) for t in self.local_copies(rank)])
        return self._local[rank]

    def prepare(self, bucket_bytes: int) -> Plan:
        """Make what the executor reads from the plan (``messages(bucket_bytes)`` and every
        rank's ``local_runs``) now, cached on the plan, so that a plan shipped to the ranks
        carries it and their timed region does not compute it."""
        self.messages(bucket_bytes)
        for rank in range(self.world):
            self.local_runs(rank)
        return self

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

    def writes(self, limit: int = 8) -> tuple[str, ...]:
        """Where the plan does not write every element of every destination tensor exactly
        once (padding excepted): ``rank 1 model.layers.2.mlp.down_proj.weight: 45056 of 45056
        elements never written`` or ``... written twice: <transfer> and <transfer>``, naming
        the writers; at most ``limit`` lines, then a count. Empty for a correct plan. From the
        transfers alone, before anything moves: a destination written twice by a second
        writer holding the same bytes still counts."""
        by: dict[tuple[int, str], list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            by[t.dst_rank, t.dst_name].append(t)
        twice_lines: list[str] = []
        never_lines: list[str] = []
        for rank, stored in enumerate(cover_of(self.dst, validate=False).ranks):
            for name, s in stored.items():
                across = s.numel // s.shape[s.dim] if s.shape[s.dim] else 0
                want = sum(b.length for b in s.boxes if b.source is not None) * across
                mine = by.get((rank, name), [])
                twice = next(((a, b) for i, a in enumerate(mine) for b in mine[i + 1:]
                              if _overlap(a, b)), None)
                got = sum(t.numel for t in mine)
                if twice is not None:
                    twice_lines.append(f"rank {rank} {name}: written twice: {twice[0]} and "
                                       f"{twice[1]}")
                elif got < want:
                    never_lines.append(f"rank {rank} {name}: {want - got} of {want} elements "
                                       "never written"
                                       + ("" if mine else " (no transfer writes it)"))
        if not twice_lines and not never_lines:
            return ()
        head = (f"{len(twice_lines)} destination tensors written twice, {len(never_lines)} "
                "with elements never written")
        half = max(1, limit // 2)
        shown = twice_lines[:half] + never_lines[:limit - min(half, len(twice_lines))]
        rest = len(twice_lines) + len(never_lines) - len(shown)
        return (head, *shown, *([f"... and {rest} more"] if rest else []))

    def with_transfers(self, transfers: list[Transfer], mutation: str) -> Plan:
        """A copy with other transfers (the planner's mutations), messages recomputed."""
        return replace(self, transfers=tuple(transfers), mutation=mutation, _messages={},
                       _local={})

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
                out[pair].append(_message(plan, open_.pop(pair)))
                filled[pair] = 0
                continue
            open_[pair].append(Segment(index, ((a, a + rows), *rest)))
            filled[pair] += rows * row
            a += rows
    for pair, segments in open_.items():
        if segments:
            out[pair].append(_message(plan, segments))
    return dict(out)


def _block(t: Transfer, region: Region) -> Block:
    """Canonical ``region`` (inside ``t.region``) as a block of ``t``'s stored tensors."""
    src_at = tuple(at + a - o for at, (a, _), (o, _) in zip(t.src_at, region, t.region))
    dst_at = tuple(at + a - o for at, (a, _), (o, _) in zip(t.dst_at, region, t.region))
    return (t.src_name, src_at, t.dst_name, dst_at, tuple(b - a for a, b in region))


def _message(plan: Plan, segments: list[Segment]) -> Message:
    return Message(tuple(segments),
                   runs([_block(plan.transfers[s.index], s.region) for s in segments]))

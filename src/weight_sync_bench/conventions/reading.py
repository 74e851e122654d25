"""How a framework's forward reads its own local tensors, as inputs of the harness forward.

For a convention at degree t, ``Convention.forward_layout`` says which canonical rows each
rank's forward consumes (``layout_for``'s placements, with KV heads per ``HeadReplicated``
where replicated and the embedding per ``Shard(1)`` where split on the hidden dimension,
over the vocabulary padded as the convention pads it). ``reading_plan`` computes, from the
declared index maps only (never from the data), a per-rank permutation: for every forward
parameter, which stored tensors to concatenate and which of their slices to take, e.g.
Megatron's grouped qkv de-interleaved on the rank, Meta's q and k rows put back in
rotate-half order. ``forward_inputs`` applies it to whatever tensors a user supplied, so a
wrong shard computes the wrong logits the framework would, instead of failing in the harness.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective, InProcessGroups
from weight_sync_bench.conventions.maps import Piece, rows
from weight_sync_bench.conventions.staging import unstage
from weight_sync_bench.model.sharded import ShardedModel

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Convention, Endpoint, ForwardLayout
    from weight_sync_bench.model.sharded import RoutingGuard
    from weight_sync_bench.model.config import ModelConfig


Params = dict[str, torch.Tensor]


@dataclass(frozen=True, eq=False)
class Selection:
    """One forward input on one rank: the stored tensors ``names`` concatenated along ``dim``,
    then the slices at ``positions`` (None: the single stored tensor as it is); ``zero``
    lists output slices with no stored counterpart (padding the convention does not store),
    filled with zeros."""

    names: tuple[str, ...]
    dim: int
    positions: torch.Tensor | None
    zero: torch.Tensor | None
    pieces: tuple[Piece, ...] = ()  # the stored tensors' pieces: how each unstacks

    def apply(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        flat = [p.flat(stored[n]) if p.is_stacked else stored[n]
                for n, p in zip(self.names, self.pieces)] if self.pieces else [
                    stored[n] for n in self.names]
        pool = flat[0] if len(flat) == 1 else torch.cat(flat, dim=self.dim)
        if self.positions is None:
            return pool
        out = pool.index_select(self.dim, self.positions)
        if self.zero is not None:
            out.index_fill_(self.dim, self.zero, 0.0)
        return out


@dataclass(frozen=True)
class ReadingPlan:
    """The forward layout and, per rank, ``{canonical parameter: Selection}``."""

    forward: ForwardLayout
    ranks: tuple[dict[str, Selection], ...]

    @property
    def identity(self) -> bool:
        """True where every forward input is a stored tensor as it is (plain, vLLM)."""
        return all(s.positions is None for rank in self.ranks for s in rank.values())


def _select(pieces: list[tuple[str, Piece]], needed: torch.Tensor, dim: int, where: str
            ) -> Selection:
    """Positions in the concatenated pieces of each needed canonical index (-1: padding)."""
    names = tuple(name for name, _ in pieces)
    stacked = tuple(p for _, p in pieces)
    pool = torch.cat([p.idx for _, p in pieces]).numpy() if pieces else np.zeros(0, np.int64)
    need = needed.numpy()
    if len(pieces) == 1 and np.array_equal(pool, need) and not stacked[0].is_stacked:
        return Selection(names, dim, None, None, stacked)
    positions = np.full(need.shape, -1, dtype=np.int64)
    real = need >= 0
    values, first = np.unique(pool, return_index=True)  # first occurrence of each index
    at = np.searchsorted(values, need[real]).clip(max=len(values) - 1)
    found = values[at] == need[real]
    # An index the forward reads that the rank does not store: the declared maps disagree
    # with the declared forward layout, a bug of the convention, never of the user's data.
    assert found.all(), (f"{where}: rank stores no copy of canonical indices "
                         f"{need[real][~found][:8].tolist()} its forward reads")
    positions[real] = first[at]
    pad_in, pad_out = np.flatnonzero(pool < 0), np.flatnonzero(~real)
    k = min(len(pad_in), len(pad_out))
    positions[pad_out[:k]] = pad_in[:k]  # the stored padding slices, read as stored
    zero = pad_out[k:]
    positions_t = torch.from_numpy(positions.clip(min=0))
    return Selection(names, dim, positions_t, torch.from_numpy(zero) if len(zero) else None,
                     stacked)


def reading_plan(convention: Convention, config: ModelConfig, degree: int | Endpoint
                 ) -> ReadingPlan:
    """The per-rank permutation from ``convention``'s stored tensors (at a TP degree, or an
    endpoint) to the forward inputs; a staged endpoint's is its unstaged one's, over the
    tensors ``stages.unstage`` gathers from every stage."""
    at = convention.at(degree)
    if at.staged:
        convention.pieces(config, at)  # its rules first
        at = at.unstaged()
    return _reading_plan(convention, config, at)


@functools.lru_cache(maxsize=256)
def _reading_plan(convention: Convention, config: ModelConfig, at: Endpoint) -> ReadingPlan:
    forward = convention.forward_layout(config, at)
    canonical = config.param_shapes()
    world = at.world
    tp = forward.tp or world
    every = convention.pieces(config, at)
    ranks = []
    for rank, stored in enumerate(every):
        by_source: dict[str, list[tuple[str, Piece]]] = {}
        for name, piece in stored.items():
            if piece.source not in forward.gathered:
                by_source.setdefault(piece.source, []).append((name, piece))
        for q in _tp_group(rank, tp):  # the gathered ones: every TP rank's, in rank order
            for name, piece in every[q].items():
                if piece.source in forward.gathered:
                    by_source.setdefault(piece.source, []).append((f"{name}@{q}", piece))
        plan = {}
        for spec in forward.layout:
            dim, ranges = spec.ranges(world, rank)
            needed = torch.cat([rows(a, b) for a, b in ranges]) if ranges else rows(0, 0)
            needed[needed >= canonical[spec.name][dim]] = -1  # the forward's padded rows
            pieces = by_source[spec.name]
            assert all(p.dim == dim for _, p in pieces), (convention.name, spec.name, dim)
            plan[spec.name] = _select(pieces, needed, dim, f"{at} rank {rank} {spec.name}")
        ranks.append(plan)
    return ReadingPlan(forward, tuple(ranks))


def _tp_group(rank: int, tp: int) -> range:
    """The ranks of ``rank``'s TP group (TP rank fastest)."""
    return range(rank // tp * tp, rank // tp * tp + tp)


def forward_inputs(shards: Sequence[Mapping[str, torch.Tensor]], convention: Convention,
                   config: ModelConfig, degree: int | Endpoint) -> list[Params]:
    """Each rank's forward inputs (canonical names, the forward layout's local shapes) read
    from that rank's stored tensors, as the framework's forward reads them."""
    plan = reading_plan(convention, config, degree)
    at = convention.at(degree)
    if at.staged:
        shards = unstage(shards, config, at)
    if plan.forward.gathered:  # what the forward's all-gather hands each rank: name@rank
        tp = plan.forward.tp or len(shards)
        shards = [{**mine, **{f"{n}@{q}": x for q in _tp_group(r, tp)
                              for n, x in shards[q].items()}}
                  for r, mine in enumerate(shards)]
    return [{name: selection.apply(stored) for name, selection in rank.items()}
            for stored, rank in zip(shards, plan.ranks)]


def forward_model(forward: ForwardLayout, inputs: Sequence[Mapping[str, torch.Tensor]], *,
                  guard: RoutingGuard | None = None) -> ShardedModel:
    """The in-process forward of a convention's layout over its forward inputs (one dict per
    rank of the endpoint's world): ``ShardedModel`` over one TP group, or, where the world is
    wider than TP (Megatron's experts spread over data-parallel replicas of the dense layers),
    over the replicas' TP groups side by side (``InProcessGroups``, TP rank fastest) with the
    experts' partial outputs summed over the whole world; the embedding and the experts as the
    forward layout places them. The one place a convention's forward is built."""
    world = len(inputs)
    tp = forward.tp or world
    if tp == world:
        collective, experts_group = InProcessCollective(world), None
    else:
        collective = InProcessGroups([[d * tp + r for r in range(tp)]
                                      for d in range(world // tp)])
        experts_group = InProcessCollective(world)
    return ShardedModel(forward.config, inputs, collective, embedding=forward.embedding,
                        experts=forward.experts, experts_group=experts_group, guard=guard)

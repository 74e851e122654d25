"""Where each rank of an endpoint sits: its coordinates in the framework's rank order, what a
converter needs to turn a rank's local names global (``rank_coordinates``).

Megatron's order is ``parallel_state``'s "tp-cp-ep-dp-pp" (TP fastest, the pipeline rank
slowest): rank g is pipeline stage ``g // (world / pp)``; within its stage, attention TP rank
``g % tp`` of data-parallel replica ``g // tp``, and the experts' EP / expert-TP /
expert-DP ranks as the experts' placement says (``layout.placements.Experts``). The other
conventions' ranks are one TP group (vLLM with EP: the experts' EP rank is the TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.model.config import ModelConfig


@dataclass(frozen=True)
class RankCoordinates:
    """One rank of an endpoint: ``rank`` (global), ``pp`` (its pipeline stage), ``tp`` and
    ``dp`` (attention TP rank and data-parallel replica within the stage), ``ep``, ``etp``,
    ``edp`` (the experts' ranks; 0 for a dense model), ``layers`` (the global layers of each
    of its model chunks, in chunk order: ``((1,), (3,))`` for stage 1 of 4 layers at pp 2,
    vpp 2; a rank stores chunk v's layer ``layers[v][j]`` as local ``j``) and ``experts``
    (the global expert ids it holds, in its local order)."""

    rank: int
    pp: int
    tp: int
    dp: int
    ep: int
    etp: int
    edp: int
    layers: tuple[tuple[int, ...], ...]
    experts: tuple[int, ...]


def rank_coordinates(config: ModelConfig, at: Endpoint, rank: int) -> RankCoordinates:
    """``rank``'s coordinates in ``at`` (``conventions.endpoint("megatron:tp=2,pp=2")``)."""
    if not 0 <= rank < at.world:
        raise ValueError(f"{at} has ranks 0..{at.world - 1}, not {rank}")
    inner = at.unstaged() if at.staged else at
    per_stage = inner.world
    stage, g = divmod(rank, per_stage)
    forward = at.convention.forward_layout(config, at)
    tp = forward.tp or per_stage
    chunks = (at.pipeline.chunks(config.n_layers)[stage] if at.staged
              else (range(config.n_layers),))
    experts = forward.experts
    if experts is None:
        ep = etp = edp = 0
        held: tuple[int, ...] = ()
    else:
        etp, ep, edp = experts.coordinates(per_stage, g)
        held = tuple(experts.experts_of(ep))
    return RankCoordinates(rank, stage, g % tp, g // tp, ep, etp, edp,
                           tuple(tuple(c) for c in chunks), held)

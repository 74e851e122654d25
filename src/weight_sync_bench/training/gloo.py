"""Training equivalence over gloo: one process per rank of the DP x CP x TP mesh, through the
phase 1b rank side (the rank pool, or a torchrun job standing in for it).

Rank ``g`` of a task of ``dp * cp * tp`` ranks is DP rank ``d``, CP rank ``j``, TP rank ``r``
with ``g = d * cp * tp + j * tp + r``: the in-process mesh's flat position ``e = j * tp + r``
inside replica ``d`` (``Mesh``). Its TP, CP and DP groups are made first by every rank of
the pool, as Megatron's ``initialize_model_parallel`` makes them (every rank calls
``new_group`` for every group, in one order; ``use_local_synchronization`` would spare the
non-members, but hangs over the pool's ``FileStore``), and kept for the rank process's
life (``groups_task``). Then each rank runs
the very ``TrainStep`` the in-process mesh runs, on its one replica and position:
``ShardedModel`` over ``GlooCollective`` on the TP group, the CP group as its ``context``,
the vocab-parallel loss, the seed on TP rank 0, the TP reduction of replicated gradients,
the CP reduction, the DP reduction over ``GlooCollective`` on the DP group, AdamW; every
collective a real ``torch.distributed`` call whose backward is the forward's adjoint.

Every rank holds the whole batch, so the global valid-token denominator is counted from
every DP rank's rows on every rank (the recipe's own ``count`` over all of them, as in
process), with no collective. The parent reads the results through the declared layout
and compares them with the dense reference exactly as in process, against the phase 1b
training floor (``training_tolerance --phase 1b``): gloo sums in an order of its own, so the
in-process floor is not reused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync_bench.collectives.gloo.collective import GlooCollective
from weight_sync_bench.collectives.gloo.rank import RankContext
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import InvalidMesh
from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.training.compare import Trace, held
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import (
    TRAINING_MUTATIONS,
    MatrixRow,
    TrainingMutation,
    mutation_matrix,
)
from weight_sync_bench.training.optimizer import AdamW, hyperparameters, moments
from weight_sync_bench.training.step import (
    CORRECT,
    Recipe,
    TrainingCase,
    TrainStep,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from weight_sync_bench.collectives.gloo.pool import RankPool
    from weight_sync_bench.collectives.protocol import Collective
    from weight_sync_bench.model.config import ModelConfig
    from weight_sync_bench.training.batches import TrainBatch


Params = dict[str, torch.Tensor]
_GROUPS: dict[tuple[int, ...], Any] = {}  # per rank process: (ranks) -> its process group


def coordinates(rank: int, mesh: Mesh) -> tuple[int, int, int]:
    """``(dp rank, cp rank, tp rank)`` of global rank ``rank`` (module docstring)."""
    d, e = divmod(rank, mesh.replica_size)
    j, r = divmod(e, mesh.tp)
    return d, j, r


def mesh_ranks(rank: int, mesh: Mesh) -> tuple[list[int], list[int], list[int]]:
    """The global ranks of ``rank``'s TP, CP and DP groups, each in group-rank order."""
    d, j, r = coordinates(rank, mesh)
    base = d * mesh.replica_size
    return ([base + j * mesh.tp + x for x in range(mesh.tp)],
            [base + x * mesh.tp + r for x in range(mesh.cp)],
            [x * mesh.replica_size + j * mesh.tp + r for x in range(mesh.dp)])


def all_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """Every TP, CP and DP group of ``mesh``'s ranks, in one order every rank agrees on."""
    world = mesh.dp * mesh.replica_size
    seen: dict[tuple[int, ...], None] = {}
    for g in range(world):
        for ranks in mesh_ranks(g, mesh):
            if len(ranks) > 1 and ranks != list(range(world)):
                seen.setdefault(tuple(ranks), None)
    return list(seen)


def groups_task(ctx: RankContext, *, mesh: Mesh) -> int:
    """On every rank of the pool (``new_group`` is collective over the whole world, members
    or not, as in Megatron's ``initialize_model_parallel``): make the mesh's groups that this
    rank process has not made yet. Returns how many it made."""
    made = 0
    for ranks in all_groups(mesh):
        if ranks not in _GROUPS:
            _GROUPS[ranks] = dist.new_group(list(ranks))
            made += 1
    return made


def _group(ctx: RankContext, ranks: list[int]) -> RankContext:
    """A ``RankContext`` over the process group of ``ranks`` (made by ``groups_task``)."""
    key = tuple(ranks)
    group = ctx.group if key == tuple(range(ctx.degree)) else _GROUPS[key]
    return RankContext(ranks.index(ctx.rank), len(ranks), group, ctx.tracer)


class _CountEveryDPRank:
    """The recipe's ``count`` over every DP rank's targets, whatever rows this rank trains:
    the in-process step counts all replicas' parts, a gloo rank holds one replica."""

    def __init__(self, count: Callable[[list[torch.Tensor], Mesh], int],
                 targets: list[torch.Tensor]) -> None:
        self.count, self.targets = count, targets

    def __call__(self, _local: list[torch.Tensor], mesh: Mesh) -> int:
        return self.count(self.targets, mesh)


def train_rank_task(ctx: RankContext, *, config: ModelConfig, shards: Params,
                    batches: list[TrainBatch], adamw: AdamW, recipe: Recipe,
                    mesh: Mesh | None = None, sp: bool = False) -> dict[str, Any]:
    """One rank's training run: the in-process mesh's ``TrainStep`` on this rank's replica
    and position (``mesh``; default one TP group of the task's degree, SP if ``sp``).
    Returns the losses, the first step's input-gradient share and the positions it holds,
    the gradients, and the parameters after every step; the moments after every step only
    on DP replica 0's CP rank 0, whose TP ranks hold the model ``train_gloo`` compares (the
    other ranks' copies are compared through their gradients and parameters, ``_spread``):
    moments nobody reads made a TOY rank's result 2.5x larger, and ran the phase 1b
    sequence floor's TOY meshes out of this 23 GB machine's memory."""
    mesh = mesh or Mesh(1, ctx.degree, sp=sp)
    if mesh.dp * mesh.replica_size != ctx.degree:
        raise InvalidMesh(f"{config.name}: mesh {mesh} has {mesh.dp * mesh.replica_size} "
                          f"ranks, the task {ctx.degree}")
    d, j, r = coordinates(ctx.rank, mesh)
    tp_ranks, cp_ranks, dp_ranks = mesh_ranks(ctx.rank, mesh)
    tp: Collective = GlooCollective(_group(ctx, tp_ranks)) if mesh.tp > 1 else \
        InProcessCollective(1)  # a group of one, as in process: no communication
    cp: Collective | None = GlooCollective(_group(ctx, cp_ranks)) if mesh.cp > 1 else None
    dp: Collective = GlooCollective(_group(ctx, dp_ranks)) if mesh.dp > 1 else \
        InProcessCollective(1)
    local = {n: s.clone().requires_grad_(True) for n, s in shards.items()}
    step = TrainStep(config, [[local]], mesh, recipe, adamw, groups=lambda: (tp, cp), dp=dp)
    out: dict[str, Any] = {"coordinates": (d, j, r), "losses": [], "params": [],
                           "moments": [], "hyperparameters": hyperparameters(step.optims[0][0])}
    for k, batch in enumerate(batches):
        blocks = mesh.row_blocks(batch.spec.rows)
        every = [batch.rows(blocks[x], shift=recipe.mask_shift(x, mesh)).targets
                 for x in range(mesh.dp)]
        step.recipe = replace(recipe, count=_CountEveryDPRank(recipe.count, every))
        result = step(batch, [d], keep_grads=k == 0)
        (objective,), (embedded,), (where,) = (result.objectives[0], result.embedded[0],
                                               result.positions[0])
        out["losses"].append(objective.item())
        if k == 0:
            out["input_grad"] = embedded.grad.detach().clone()
            out["positions"] = where
            out["rows"] = len(blocks[d])
            out["grads"] = result.grads[0][0]
        out["params"].append({n: p.detach().clone() for n, p in local.items()})
        if d == 0 and j == 0:
            out["moments"].append(moments(step.optims[0][0], local))
    return out


def train_gloo(case: TrainingCase, pool: RankPool, recipe: Recipe = CORRECT) -> Trace:
    """``case`` trained over gloo on ``pool``, one process per rank of ``case.mesh``
    (``dp * cp * tp`` ranks, at most the pool's size)."""
    mesh = case.mesh
    world = mesh.dp * mesh.replica_size
    if world > pool.size:
        raise InvalidMesh(f"{case.config.name}: mesh {mesh} needs {world} ranks over gloo, the "
                          f"rank pool has {pool.size}")
    assert case.params is not None
    layout = layout_for(case.config)
    declared = split(case.params, layout, mesh.tp)
    pool.run(groups_task, pool.size, kwargs={"mesh": mesh})
    results = pool.run(train_rank_task, world,
                       kwargs={"config": case.config, "batches": case.batches,
                               "adamw": case.adamw, "recipe": recipe, "mesh": mesh},
                       rank_kwargs=[{"shards": declared[coordinates(g, mesh)[2]]}
                                    for g in range(world)])
    first = results[:mesh.tp]  # DP replica 0, CP rank 0: its TP ranks hold the whole model
    return Trace(losses=[sum(r["losses"][k] for r in results if r["coordinates"][2] == 0)
                         for k in range(len(case.batches))],
                 input_grad=_input_grad(results, mesh),
                 grads=held([r["grads"] for r in first], layout),
                 params=[held([r["params"][k] for r in first], layout)
                         for k in range(len(case.batches))],
                 replica_spread=_spread(results, layout, mesh),
                 exp_avg=[held([r["moments"][k][0] for r in first], layout)
                          for k in range(len(case.batches))],
                 exp_avg_sq=[held([r["moments"][k][1] for r in first], layout)
                             for k in range(len(case.batches))],
                 hyperparameters=[r["hyperparameters"] for r in results])


def _input_grad(results: list[dict[str, Any]], mesh: Mesh) -> torch.Tensor:
    """Per DP rank, each of its ranks' input-gradient share added at the positions it holds
    (the whole chunk on every TP rank without SP: a sum over them; disjoint slices with SP
    and CP); the DP ranks' rows concatenated in order."""
    replicas = []
    for d in range(mesh.dp):
        mine = [r for r in results if r["coordinates"][0] == d]
        first = mine[0]["input_grad"]
        out = torch.zeros(mine[0]["rows"], max(r["positions"][1] for r in mine),
                          first.shape[-1], dtype=first.dtype)
        for r in mine:
            start, stop = r["positions"]
            out[:, start:stop] += r["input_grad"]
        replicas.append(out)
    return torch.cat(replicas, dim=0)


def _spread(results: list[dict[str, Any]], layout: Any, mesh: Mesh) -> float:
    """Max |difference| between copies that must be identical: a replicated gradient or
    parameter across a TP group, every gradient and parameter across CP ranks and DP
    replicas (``step._spread``'s pairs: each copy against its TP rank 0, CP rank 0 and DP
    replica 0 counterparts). NaN counts as infinitely far."""
    replicated = {spec.name for spec in layout if isinstance(spec.placement, Replicate)}
    at = {r["coordinates"]: r for r in results}
    worst = 0.0
    for (d, j, r), mine in at.items():
        peers = ([at[(0, j, r)]] if d else []) + ([at[(d, 0, r)]] if j else [])
        tp0 = at[(d, j, 0)] if r else None
        for name in mine["grads"]:
            others = peers + ([tp0] if tp0 is not None and name in replicated else [])
            for other in others:
                pairs = [(mine["grads"][name], other["grads"][name])]
                pairs += [(p[name], q[name]) for p, q in zip(mine["params"], other["params"])]
                for a, b in pairs:
                    diff = float((a - b).abs().max())
                    worst = max(worst, diff if diff == diff else float("inf"))
    return worst


def gloo_mutation_matrix(cases: list[TrainingCase], thresholds: dict[str, float],
                         pool: RankPool,
                         mutations: tuple[TrainingMutation, ...] = TRAINING_MUTATIONS
                         ) -> list[MatrixRow]:
    """``mutations.mutation_matrix`` with the sharded side trained over gloo on ``pool``:
    every mutation on every case where it is not the identity (one reference per case)."""
    return mutation_matrix(cases, thresholds, mutations,
                           train=lambda case, recipe: train_gloo(case, pool, recipe))

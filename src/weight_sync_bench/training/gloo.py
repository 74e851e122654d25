"""Training equivalence over gloo: one process per TP rank, through the phase 1b rank pool.

Each rank of a TP group of degree t receives its own shards and the batch, and runs the
same steps the in-process mesh runs (``ShardedModel`` over ``GlooCollective``, the
vocab-parallel loss, the seed on group rank 0, the TP reduction of replicated gradients,
AdamW), now with every collective a real ``torch.distributed`` call whose backward is the
forward's adjoint. The parent gathers the results through the declared layout and compares
them with the dense reference exactly as in process, against the phase 1b training floor
(``training_tolerance --phase 1b``): gloo sums in an order of its own, so the in-process
floor is not reused.

Data parallelism stays in process: the pool's groups are TP groups, so a gloo check runs
``dp = 1`` (one TP group holding the whole batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.collectives.gloo.collective import GlooCollective
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import InvalidMesh
from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.layout.reshard import gather, split
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.training.compare import Trace
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.optimizer import AdamW, hyperparameters, moments
from weight_sync_bench.training.step import (
    CORRECT,
    Recipe,
    TrainingCase,
    TrainStep,
)

if TYPE_CHECKING:
    from weight_sync_bench.collectives.gloo.pool import RankPool
    from weight_sync_bench.collectives.gloo.rank import RankContext
    from weight_sync_bench.model.config import ModelConfig
    from weight_sync_bench.training.batches import TrainBatch


Params = dict[str, torch.Tensor]


def train_rank_task(ctx: RankContext, *, config: ModelConfig, shards: Params,
                    batches: list[TrainBatch], adamw: AdamW, recipe: Recipe,
                    sp: bool = False) -> dict[str, Any]:
    """One TP rank's training run: the in-process mesh's ``TrainStep`` with dp = 1 (and SP
    if ``sp``) over this rank's ``GlooCollective``. Returns the losses, the first step's
    input-gradient share and the positions it holds, the gradients, and the parameters
    after every step."""
    mesh = Mesh(1, ctx.degree, sp=sp)
    coll = GlooCollective(ctx)
    local = {n: s.clone().requires_grad_(True) for n, s in shards.items()}
    step = TrainStep(config, [[local]], mesh, recipe, adamw, groups=lambda: (coll, None),
                     dp=InProcessCollective(1))
    out: dict[str, Any] = {"losses": [], "params": [], "moments": [],
                           "hyperparameters": hyperparameters(step.optims[0][0])}
    for k, batch in enumerate(batches):
        result = step(batch, [0], keep_grads=k == 0)
        (objective,), (embedded,), (where,) = (result.objectives[0], result.embedded[0],
                                               result.positions[0])
        out["losses"].append(objective.item())
        if k == 0:
            out["input_grad"] = embedded.grad.detach().clone()
            out["positions"] = where
            out["grads"] = result.grads[0][0]
        out["params"].append({n: p.detach().clone() for n, p in local.items()})
        out["moments"].append(moments(step.optims[0][0], local))
    return out


def train_gloo(case: TrainingCase, pool: RankPool, recipe: Recipe = CORRECT) -> Trace:
    """``case`` trained over gloo on ``pool`` (``case.mesh.dp`` must be 1)."""
    if case.mesh.dp != 1 or case.mesh.cp != 1:
        raise InvalidMesh(f"{case.config.name}: over gloo the mesh is one TP group, got "
                          f"dp={case.mesh.dp} cp={case.mesh.cp} (data and context "
                          "parallelism run in process)")
    assert case.params is not None
    layout = layout_for(case.config)
    shards = split(case.params, layout, case.mesh.tp)
    results = pool.run(train_rank_task, case.mesh.tp,
                       kwargs={"config": case.config, "batches": case.batches,
                               "adamw": case.adamw, "recipe": recipe, "sp": case.mesh.sp},
                       rank_kwargs=[{"shards": s} for s in shards])
    return Trace(losses=results[0]["losses"],
                 input_grad=_input_grad(results),
                 grads=gather([r["grads"] for r in results], layout),
                 params=[gather([r["params"][k] for r in results], layout)
                         for k in range(len(case.batches))],
                 replica_spread=_spread(results, layout),
                 exp_avg=[gather([r["moments"][k][0] for r in results], layout)
                          for k in range(len(case.batches))],
                 exp_avg_sq=[gather([r["moments"][k][1] for r in results], layout)
                             for k in range(len(case.batches))],
                 hyperparameters=[r["hyperparameters"] for r in results])


def _input_grad(results: list[dict[str, Any]]) -> torch.Tensor:
    """Each rank's input-gradient share added at the positions it holds: the whole
    sequence on every rank without SP (a sum over ranks), disjoint slices with SP."""
    first = results[0]["input_grad"]
    b, d = first.shape[0], first.shape[-1]
    out = torch.zeros(b, max(r["positions"][1] for r in results), d, dtype=first.dtype)
    for r in results:
        start, stop = r["positions"]
        out[:, start:stop] += r["input_grad"]
    return out


def _spread(results: list[dict[str, Any]], layout: Any) -> float:
    """Max |difference| between ranks' copies of a replicated gradient or parameter."""
    worst = 0.0
    for spec in layout:
        if isinstance(spec.placement, Replicate):
            for r in results[1:]:
                for a, b in [(r["grads"][spec.name], results[0]["grads"][spec.name]),
                             *[(p[spec.name], q[spec.name])
                               for p, q in zip(r["params"], results[0]["params"])]]:
                    diff = float((a - b).abs().max())
                    worst = max(worst, diff if diff == diff else float("inf"))
    return worst

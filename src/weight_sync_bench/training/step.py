"""Training equivalence: the sharded model trained on a DP x TP mesh against the dense one.

A correct forward does not prove the backward mappings, and a right printed loss does not
prove the gradients use the right denominator. So the check trains both models from the
same parameters on the same data and compares, each with its own measured threshold:

- ``loss``: the printed global loss of the first step;
- ``input_grad``: the gradient with respect to the embedding output, every token;
- ``param_grad``: every parameter's gradient after every reduction, each rank's shard
  against its declared slice of the reference's (``compare.Shards``);
- ``kv_grad``: the K and V rows of every qkv gradient, which GQA shares between heads;
- ``params_step1`` / ``params_final``: the parameters after one AdamW step from identical
  state, and after ``steps`` steps on fresh batches;
- ``replicas``: copies that must be identical (replicated gradients across TP ranks after
  their reduction, every gradient and parameter across DP replicas after each step),
  compared exactly. In process the DP replicas' parameters are one storage, stepped once
  (a correct DP all-reduce gives them one gradient, so their steps are one step), and their
  gradients are compared at every step; over gloo each rank steps its own copy;
- ``padding_grad``: the gradient of the padded vocab rows, which must be exactly zero.

The mesh runs in process. Each data-parallel rank holds different rows of the batch, so a
different number of valid tokens; its tensor-parallel group (an ``InProcessCollective``)
runs ``ShardedModel`` on its own copy of the shards, as one autograd graph. That graph is
the collectives' adjoint, and it contains both conjugate pairs. The all-reduce hands
one shared tensor to every rank: forward, the partial sums meet (all-reduce) and each
rank reads the sum (identity); backward, autograd sums every rank's gradient into that
tensor (all-reduce) and passes it unchanged to each partial (identity). Megatron's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward) and
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) are the
two halves; the gloo collective computes the same adjoint one rank per process. Every rank
holds a copy of the group's loss; backward is seeded on group rank 0's copy only
(``seed_group_rank0``): seeding every copy would count the TP ranks as extra examples.

Each gradient reduction is accounted for exactly once:

1. the objective of DP rank d is ``sum of its token losses / total valid tokens of the
   whole batch`` (``loss.local_objective``); the shares add up to the global mean;
2. a replicated parameter's copy on TP rank r only sees rank r's branch, so its gradient is
   a partial sum: summed over the TP group (and nothing else is);
3. every gradient is summed over the DP replicas (a sum, because step 1 already divided by
   the global count).

Sequence and context parallelism are two more dimensions of the same mesh (``Mesh.sp``,
``Mesh.cp``), not a second harness: a DP replica is ``cp x tp`` ranks; each CP rank holds
one contiguous chunk of the sequence, its labels and its own copy of every parameter; SP
shards each TP group's residual stream along the chunk (``sharded`` says how). Two more
accountings, each once: with SP a replicated norm weight's copy sees only its sequence
shard, a partial sum already covered by step 2; with CP every parameter's copy sees only
its chunk's queries, so 2b. every gradient is summed over the CP group
(``reduce_over_context``) before the DP sum. The objective needs nothing new: each chunk's
token losses over the global valid count are shares of the same mean.

Deviations are relative to the reference's own scale, per parameter (``deviation``), so
one threshold serves parameters whose gradients differ by orders of magnitude
(``training_compare``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import InvalidMesh
from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.training import QUANTITIES
from weight_sync_bench.training.batches import (
    BatchSpec,
    TrainBatch,
    default_spec,
    make_batch,
)
from weight_sync_bench.training.compare import (
    EXACT,
    Comparison,
    Held,
    Trace,
    TrainingReport,
    deviations,
    held,
    max_abs_difference_in_dtype,
)
from weight_sync_bench.training.loss import (
    IGNORE_INDEX,
    local_objective,
    valid_count,
    vocab_parallel_token_losses,
)
from weight_sync_bench.training.mesh import Mesh, mesh_groups
from weight_sync_bench.training.optimizer import (
    AdamW,
    hyperparameters,
    moments,
    same_optimizer,
)

if TYPE_CHECKING:
    from weight_sync_bench.collectives.protocol import Collective, Tensors


Params = dict[str, torch.Tensor]
BATCH_SEED_OFFSET = 1000  # step k of seed s draws its batch from 1000 + 100 * s + k


def count_valid(targets: list[torch.Tensor], mesh: Mesh) -> int:
    """The global denominator: valid tokens summed over the DP ranks (TP ranks share theirs)."""
    return sum(valid_count(t) for t in targets)


def global_mean_share(token_losses: torch.Tensor, targets: torch.Tensor, total: int,
                      mesh: Mesh) -> torch.Tensor:
    return local_objective(token_losses, total)


def sum_over_group(grads: Tensors, group: Collective, tag: str) -> Tensors:
    return group.all_reduce(grads, tag=tag)


def no_shift(dp_rank: int, mesh: Mesh) -> int:
    return 0


def seed_group_rank0(ranks: tuple[int, ...]) -> list[float]:
    """The weight backward starts from on each local copy of the group's loss: 1 on group
    rank 0, 0 elsewhere. Every rank holds the same loss, a function of every rank's
    parameters through the collectives, whose backward is their forward's adjoint
    (all-reduce's is an all-reduce, all-gather's a reduce-scatter: in process, one shared
    graph). Seeding one copy yields the gradient of the loss; seeding all t would yield t
    times it. With one rank per process the others seed 0 and still run backward, to take
    part in its collectives."""
    return [1.0 if rank == 0 else 0.0 for rank in ranks]


@dataclass(frozen=True)
class Recipe:
    """How one training step is distributed. ``CORRECT`` is the specified one; a training
    mutation replaces exactly one field (``training_mutations``)."""

    model: type[ShardedModel] = ShardedModel
    mask_padding: bool = True  # padded vocab columns masked out of the softmax
    count: Callable[[list[torch.Tensor], Mesh], int] = count_valid
    objective: Callable[[torch.Tensor, torch.Tensor, int, Mesh], torch.Tensor] = global_mean_share
    tp_reduce: Callable[[Tensors, Collective, str], Tensors] = sum_over_group
    cp_reduce: Callable[[Tensors, Collective, str], Tensors] = sum_over_group
    mask_shift: Callable[[int, Mesh], int] = no_shift
    seed: Callable[[tuple[int, ...]], list[float]] = seed_group_rank0
    optimizer: Callable[[AdamW], AdamW] = same_optimizer  # the sharded side's AdamW


CORRECT = Recipe()


def batches_for(config: ModelConfig, spec: BatchSpec, seed: int, steps: int) -> list[TrainBatch]:
    """One batch per step: fresh tokens and labels, the same layout (documents, padding and
    ignored positions), so every step has the first step's valid-token counts."""
    first = BATCH_SEED_OFFSET + 100 * seed
    return [make_batch(config, spec, first + k, layout_seed=first) for k in range(steps)]


def train_reference(config: ModelConfig, params: Params, batches: Sequence[TrainBatch],
                    adamw: AdamW = AdamW()) -> Trace:
    """The dense model on the full batch: ``F.cross_entropy`` mean over valid labels."""
    live = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    optim = adamw.make(list(live.values()))
    model = ReferenceModel(config, live)
    losses, after = [], []
    exp_avg: list[Params] = []
    exp_avg_sq: list[Params] = []
    input_grad, grads = torch.empty(0), {}
    last = len(batches) - 1
    for step, batch in enumerate(batches):
        optim.zero_grad(set_to_none=True)
        logits = model(batch.tokens, batch.model_segments)  # (B, T, V)
        embedded = model.embedding_output
        assert embedded is not None
        embedded.retain_grad()
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), batch.targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        loss.backward()
        losses.append(loss.item())
        if step == 0:  # kept, not copied: AdamW reads a gradient, zero_grad drops it
            input_grad = embedded.grad.detach().clone()
            grads = {n: p.grad.detach() for n, p in live.items()}
        optim.step()
        # a copy of each step's parameters but the last, which nothing steps again
        after.append({n: p.detach() if step == last else p.detach().clone()
                      for n, p in live.items()})
        first, second = moments(optim, live, copy=step != last)
        exp_avg.append(first)
        exp_avg_sq.append(second)
    return Trace(losses, input_grad, grads, after, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                 hyperparameters=[hyperparameters(optim)])


def train_sharded(config: ModelConfig, params: Params, batches: Sequence[TrainBatch],
                  mesh: Mesh, recipe: Recipe = CORRECT, adamw: AdamW = AdamW(),
                  collective: Callable[[int], Collective] = InProcessCollective) -> Trace:
    """The sharded model on the DP x TP mesh: split, replicate over DP, train; the trace
    holds the TP ranks' shards of DP replica 0 (``compare.Shards``).

    ``collective(t)`` makes each TP group's collective (every rank in this process); any
    whose backward is its forward's adjoint trains the same."""
    mesh.validate(config, batches[0].spec.rows, batches[0].spec.seq_len)
    layout = layout_for(config)
    declared = split(params, layout, mesh.tp)  # fresh tensors, aliasing nothing
    # replicas[0][e]: DP replica 0, flat position e (CP rank e // tp, TP rank e % tp), its
    # own leaf tensors (a tied table is one leaf): the split's own tensors for the first
    # copy of each TP rank's shards, a clone for every other. Every other DP replica d holds
    # leaves of its own (its own gradients) over replica 0's storage, stepped once by
    # replica 0's optimizers (``TrainStep``): replicas whose reduced gradients are equal,
    # bit for bit (compared at every step, ``_spread``), from equal parameters and states
    # step to equal parameters. Stepping each replica's copy apart cost the check as much as
    # the reference step.
    first = [{n: (s if e < mesh.tp else s.detach().clone()).requires_grad_(True)
              for n, s in declared[e % mesh.tp].items()} for e in range(mesh.replica_size)]
    replicas = [first] + [[{n: p.detach().requires_grad_(True) for n, p in local.items()}
                           for local in first] for _ in range(mesh.dp - 1)]
    step = TrainStep(config, replicas, mesh, recipe, adamw,
                     groups=lambda: mesh_groups(mesh, collective), dp=collective(mesh.dp))
    losses, after, spread = [], [], 0.0
    exp_avg: list[Held] = []
    exp_avg_sq: list[Held] = []
    input_grad, grads = torch.empty(0), {}
    last = len(batches) - 1
    for k, batch in enumerate(batches):
        # every step's reduced gradients (kept, not copied) for their spread: the DP replicas
        # share their parameters, so a replica whose gradient differs (a DP reduction that
        # hands one replica another sum) shows there, before the one step of their storage
        result = step(batch, range(mesh.dp), keep_grads=True)
        # the group's share: one copy per context chunk (its TP rank 0's)
        losses.append(sum(o.item() for objective, ranks in zip(result.objectives, result.ranks)
                          for o, r in zip(objective, ranks) if r == 0))
        if k == 0:  # a rank's copy of the embedding output holds its share of the gradient
            input_grad = torch.cat([_assemble(h, where, part.tokens.shape) for h, where, part
                                    in zip(result.embedded, result.positions, result.parts)],
                                   dim=0)
            grads = held(result.grads[0][:mesh.tp], layout)  # kept: no step writes them
        spread = max(spread, _spread(result.grads, step.replicated, mesh.tp, lambda g: g),
                     _spread(replicas, step.replicated, mesh.tp, lambda p: p))
        # the TP ranks' shards, compared in place (``Shards``): a copy of each step's but
        # the last, which nothing steps again
        after.append(held([{n: p.detach() if k == last else p.detach().clone()
                            for n, p in local.items()} for local in replicas[0][:mesh.tp]],
                          layout))
        state = [moments(optim, local, copy=k != last)
                 for optim, local in zip(step.optims[0][:mesh.tp], replicas[0][:mesh.tp])]
        exp_avg.append(held([first for first, _ in state], layout))
        exp_avg_sq.append(held([second for _, second in state], layout))
    return Trace(losses, input_grad.detach(), grads, after, spread, exp_avg, exp_avg_sq,
                 [hyperparameters(o) for group in step.optims for o in group])


@dataclass
class StepResult:
    """What one training step leaves to observe, per local DP replica ``d``: its rows of the
    batch (``parts[d]``), each local rank's objective and TP rank (``objectives[d]``,
    ``ranks[d]``), embedding output and the global positions it holds, and (when asked)
    copies of the gradients after every reduction, before the update (``grads[d][e]``)."""

    parts: list[TrainBatch]
    objectives: list[Tensors]
    ranks: list[tuple[int, ...]]
    embedded: list[Tensors]
    positions: list[list[tuple[int, int]]]
    grads: list[list[Params]]


class TrainStep:
    """One training step of the local ranks, the same code in process and on a gloo rank.

    ``replicas[d][e]`` are the leaf parameters of local DP replica d, flat position e (all of
    the mesh in process; one TP rank of one replica on a gloo rank). A step: zero the grads;
    per replica, the forward, the vocab-parallel loss and backward (``group_backward``); the
    TP reduction of replicated gradients, the CP reduction, the DP reduction, each exactly
    once; AdamW. ``groups()`` makes one replica's TP and CP collectives, ``dp`` is the
    collective over the DP replicas (degree 1 with one replica).
    """

    def __init__(self, config: ModelConfig, replicas: list[list[Params]], mesh: Mesh,
                 recipe: Recipe, adamw: AdamW, *,
                 groups: Callable[[], tuple[Collective, Collective | None]],
                 dp: Collective) -> None:
        self.config, self.replicas, self.mesh, self.recipe = config, replicas, mesh, recipe
        self.groups, self.dp = groups, dp
        self.optims = [[recipe.optimizer(adamw).make(list(local.values())) for local in group]
                       for group in replicas]
        # the optimizers that step: all but those of a replica over replica 0's storage
        # (``train_sharded`` in process), which would step it a second time; they still
        # zero their own leaves' gradients, and their hyperparameters are compared
        self.stepping = [optim for group, optims in zip(replicas, self.optims)
                         for local, first, optim in zip(group, replicas[0], optims)
                         if local is first or not _aliases(local, first)]
        self.replicated = [spec.name for spec in layout_for(config)
                           if isinstance(spec.placement, Replicate)]

    def __call__(self, batch: TrainBatch, dp_ranks: Sequence[int], *,
                 keep_grads: bool = False) -> StepResult:
        """Train on ``batch``, of which local replica i holds DP rank ``dp_ranks[i]``'s rows
        (the mesh's row blocks); ``keep_grads`` copies the reduced gradients before AdamW."""
        mesh, recipe = self.mesh, self.recipe
        for group in self.optims:
            for optim in group:
                optim.zero_grad(set_to_none=True)
        blocks = mesh.row_blocks(batch.spec.rows)
        parts = [batch.rows(blocks[d], shift=recipe.mask_shift(d, mesh)) for d in dp_ranks]
        total = recipe.count([part.targets for part in parts], mesh)
        objectives, ranks, embedded, positions = [], [], [], []
        for part, group in zip(parts, self.replicas):
            tp_group, cp_group = self.groups()
            objective, h, where = group_backward(self.config, group, tp_group, part, total,
                                                 mesh, recipe, cp_group)
            objectives.append(objective)
            ranks.append(tp_group.ranks)
            embedded.append(h)
            positions.append(where)
        with torch.no_grad():
            for group in self.replicas:
                tp_group, cp_group = self.groups()
                reduce_replicated(group, self.replicated, tp_group, recipe)
                if cp_group is not None:
                    reduce_over_context(group, cp_group, recipe)
            _reduce_over_dp(self.replicas, self.dp)
        # kept, not copied: AdamW only reads a gradient and the next zero_grad drops it
        grads = [[{n: _grad(p).detach() for n, p in local.items()} for local in group]
                 for group in self.replicas] if keep_grads else []
        for optim in self.stepping:
            optim.step()
        return StepResult(parts, objectives, ranks, embedded, positions, grads)


def _aliases(local: Params, first: Params) -> bool:
    """Whether every parameter of ``local`` is a view of ``first``'s storage, at the same
    place: the same values, stepped once by ``first``'s optimizer."""
    return all(_same_memory(p, first[n]) for n, p in local.items())


def _same_memory(p: torch.Tensor, q: torch.Tensor) -> bool:
    return (p.data_ptr() == q.data_ptr() and p.shape == q.shape and p.stride() == q.stride()
            and p.dtype == q.dtype)


def _assemble(embedded: Tensors, positions: list[tuple[int, int]], shape: torch.Size
              ) -> torch.Tensor:
    """One DP rank's input gradient ``(B, T, d)`` from its ranks' embedding outputs: each
    distinct tensor's gradient added at the global positions it holds (TP ranks without SP
    share one tensor; SP and CP shards hold disjoint positions)."""
    seen: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}
    for h, where in zip(embedded, positions):
        seen.setdefault(id(h), (h, where))
    out = None
    for h, (a, b) in seen.values():
        g = h.grad if h.grad is not None else torch.zeros_like(h)
        if out is None:
            out = torch.zeros(*shape, g.shape[-1], dtype=g.dtype)  # (B, T, d)
        out[:, a:b] += g
    assert out is not None
    return out


def _distinct(xs: Tensors) -> Tensors:
    """The distinct tensor objects of a per-rank list (in process, ranks share one)."""
    seen: dict[int, torch.Tensor] = {}
    for x in xs:
        seen.setdefault(id(x), x)
    return list(seen.values())


def group_backward(config: ModelConfig, group: list[Params], coll: Collective,
                   batch: TrainBatch, total: int, mesh: Mesh, recipe: Recipe,
                   context: Collective | None = None
                   ) -> tuple[Tensors, Tensors, list[tuple[int, int]]]:
    """One DP replica's forward, vocab-parallel loss and backward on its rows, for the local
    ranks ``coll`` (TP) and ``context`` (CP, or None) hold (all of them in process, one over
    gloo). Returns each local rank's objective (its copy of its TP group's share of the
    global mean), its embedding output, whose gradient is kept, and the global positions
    ``[start, stop)`` that output holds."""
    model = recipe.model(config, group, coll, sequence_parallel=mesh.sp, context=context)
    local_logits = model(batch.tokens, batch.model_segments, gather_logits=False)
    targets = [batch.targets[:, a:b] for a, b in model.chunks(batch.tokens.shape[1])]
    token_losses = vocab_parallel_token_losses(local_logits, targets, coll, vocab=config.vocab,
                                               mask_padding=recipe.mask_padding)
    objective = [recipe.objective(x, y, total, mesh) for x, y in zip(token_losses, targets)]
    assert model.embedding_output is not None and model.embedding_positions is not None
    for h in _distinct(model.embedding_output):
        h.retain_grad()
    seeds = list(zip(objective, recipe.seed(coll.ranks)))
    torch.autograd.backward([o for o, _ in seeds], [torch.tensor(w) for _, w in seeds])
    return objective, model.embedding_output, model.embedding_positions


def reduce_replicated(group: list[Params], replicated: list[str], coll: Collective,
                      recipe: Recipe) -> None:
    """A replicated parameter's gradient on each TP rank is that rank's partial sum: reduce
    it over the group (``recipe.tp_reduce``; a sum) and give every rank the result."""
    for name in replicated:
        reduced = recipe.tp_reduce([_grad(local[name]) for local in group], coll, name)
        for local, g in zip(group, reduced):
            local[name].grad = g  # shared by the ranks in process: nothing writes a gradient


def reduce_over_context(group: list[Params], cp: Collective, recipe: Recipe) -> None:
    """Every parameter is replicated over the CP group and each copy saw only its chunk's
    queries: its gradient summed over the CP group (``recipe.cp_reduce``) exactly once."""
    for name in group[0]:
        reduced = recipe.cp_reduce([_grad(local[name]) for local in group], cp, name)
        for local, g in zip(group, reduced):
            local[name].grad = g


def _reduce_over_dp(replicas: list[list[Params]], dp: Collective) -> None:
    """Every gradient summed over the DP replicas; every replica gets the sum."""
    for rank in range(len(replicas[0])):
        for name in replicas[0][rank]:
            reduced = dp.all_reduce([_grad(group[rank][name]) for group in replicas], tag=name)
            for group, g in zip(replicas, reduced):
                group[rank][name].grad = g


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _spread(replicas: list[list[Params]], replicated: list[str], tp: int,
            get: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Max |a - b| over copies that must be equal: a replicated parameter's across TP ranks,
    every parameter across CP ranks and DP replicas (NaN counts as infinitely far)."""
    worst = 0.0
    for d, group in enumerate(replicas):
        for e, local in enumerate(group):
            r = e % tp  # TP rank; e - r is TP rank 0 of the same CP rank
            for name, p in local.items():
                peers = ([replicas[0][e][name]] if d else []) + (
                    [group[e - r][name]] if r and name in replicated else []) + (
                    [group[r][name]] if e >= tp else [])
                for q in peers:
                    if _same_memory(get(p), get(q)):  # one tensor: equal by construction
                        continue
                    diff = max_abs_difference_in_dtype(get(p), get(q))
                    worst = max(worst, diff if diff == diff else float("inf"))
    return worst


@dataclass
class TrainingCase:
    """Everything one check needs: the config, parameters, batches and mesh."""

    config: ModelConfig
    mesh: Mesh
    seed: int = 0
    steps: int = 2
    spec: BatchSpec | None = None
    params: Params | None = None
    adamw: AdamW = field(default_factory=AdamW)
    batches: list[TrainBatch] = field(init=False)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InvalidMesh(f"{self.config.name}: steps must be >= 1, got {self.steps}")
        self.spec = self.spec or default_spec(self.config, packed=False)
        self.params = self.params if self.params is not None else init_params(self.config,
                                                                              self.seed)
        self.batches = batches_for(self.config, self.spec, self.seed, self.steps)
        self.mesh.validate(self.config, self.spec.rows, self.spec.seq_len)

    def reference(self) -> Trace:
        assert self.params is not None
        return train_reference(self.config, self.params, self.batches, self.adamw)

    def sharded(self, recipe: Recipe = CORRECT,
                collective: Callable[[int], Collective] = InProcessCollective) -> Trace:
        assert self.params is not None
        return train_sharded(self.config, self.params, self.batches, self.mesh, recipe,
                             self.adamw, collective)

    def check(self, thresholds: dict[str, float], *, recipe: Recipe = CORRECT,
              reference: Trace | None = None, mutation: str | None = None,
              collective: Callable[[int], Collective] = InProcessCollective,
              trained: Trace | None = None) -> TrainingReport:
        """Every quantity of the sharded run (``trained``, else trained here with ``recipe``
        over ``collective``) against the reference run (computed unless given)."""
        assert self.params is not None and self.spec is not None
        ref = reference if reference is not None else self.reference()
        got = trained if trained is not None else self.sharded(recipe, collective)
        devs = deviations(self.config, self.params, ref, got)
        comparisons = [Comparison(q, devs[q][0], thresholds[q], devs[q][1]) for q in QUANTITIES]
        comparisons += [Comparison(q, devs[q][0], 0.0, devs[q][1]) for q in EXACT]
        return TrainingReport(self.config.name, self.mesh, self.steps, self.spec.packed,
                              tuple(comparisons), mutation, (got.losses[0], ref.losses[0]))

    def with_spec(self, spec: BatchSpec) -> TrainingCase:
        return replace(self, spec=spec)

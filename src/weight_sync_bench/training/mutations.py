"""Training bugs injected into one stage of the distributed step, to prove the check sees them.

Each mutation replaces exactly one field of the correct ``Recipe`` (or the model's
row-parallel reduction) with the bug as it is written in real trainers, and declares where
it is the identity, so a test never demands detection of a no-op:

- ``equal_average_local_means``: each DP rank's (and CP chunk's) loss is its local mean,
  and the means are averaged. Identity at dp=cp=1, or where every DP rank and CP chunk
  holds as many valid tokens.
- ``extra_tp_averaging``: replicated gradients averaged over the TP group, not summed
  (an extra 1/t). Identity at tp=1.
- ``tp_ranks_as_examples``: backward seeded from every TP rank's copy of the loss, as if
  each held its own examples; the printed loss stays right. Identity at tp=1.
- ``row_bias_every_rank``: the row-parallel bias added to each partial sum before the
  all-reduce. Identity at tp=1, or without biases.
- ``padded_vocab_unmasked``: padded vocab columns left in the softmax. Identity where the
  vocab needs no padding.
- ``ignored_labels_counted``: every label position, ignored and padding included, counted
  in the denominator. Identity where no label is ignored or padding.
- ``doc_mask_offset``: the last DP rank's document boundaries one position late. Identity
  when unpacked, or where no valid label depends on a position the shift changes.
- ``adamw_beta2_0999`` / ``adamw_lr_half_percent_high``: the sharded side's optimizer with
  beta2 0.999 instead of 0.95, or lr 0.5% high. Never the identity: caught at step 1 by the
  moments (beta2), the masked first update (lr) and the exact hyperparameter comparison.

``SEQUENCE_MUTATIONS``, the sequence- and context-parallel bugs (not in the default matrix
of ``TRAINING_MUTATIONS``, whose cases have no SP or CP; ``ALL_TRAINING_MUTATIONS`` is
both):

- ``norm_grad_unreduced`` / ``norm_grad_reduced_twice``: the replicated norm weights'
  gradients not summed over the sequence shards, or summed twice. Identity at tp=1.
- ``cp_grad_unreduced``: gradients not summed over the CP group. Identity at cp=1.
- ``cp_key_offset``: the last CP rank reads the gathered K and V one chunk off. Identity
  at cp=1, or where no valid label depends on a last-chunk query (only those read them)
  whose set of visible keys the rotation changes.
- ``cp_local_causal``: the causal boundary on local query positions. Identity at cp=1, or
  where no valid label depends on a query whose visible keys change.
- ``cp_doc_boundary_ignored``: document boundaries ignored across a CP chunk edge.
  Identity at cp=1, unpacked, or where no valid label depends on a changed query.
- ``sp_gather_backward_split``: the all-gather entering each column-parallel region has a
  split as its backward, not a reduce-scatter (the forward swap changes shapes). Identity
  without SP or at tp=1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.errors import UnknownMutation
from weight_sync_bench.model.reference import document_mask
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.training.compare import TrainingReport
from weight_sync_bench.training.loss import IGNORE_INDEX, valid_count
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.optimizer import AdamW
from weight_sync_bench.training.step import CORRECT, Recipe, TrainingCase

if TYPE_CHECKING:
    from weight_sync_bench.collectives.protocol import Collective, Tensors


# (the case) -> why the mutation changes nothing there, or None where it does
IdentityRule = Callable[[TrainingCase], str | None]


def _equal_average(token_losses: torch.Tensor, targets: torch.Tensor, total: int,
                   mesh: Mesh) -> torch.Tensor:
    return token_losses.sum() / valid_count(targets) / (mesh.dp * mesh.cp)  # CP chunks: ranks too


def _mean_over_group(grads: Tensors, group: Collective, tag: str) -> Tensors:
    return [g / group.degree for g in group.all_reduce(grads, tag=tag)]


def _seed_every_rank(ranks: tuple[int, ...]) -> list[float]:
    return [1.0] * len(ranks)


class BiasEveryRankModel(ShardedModel):
    """Adds the row-parallel bias to every rank's partial sum before the all-reduce: the
    bias arrives t times."""

    def reduce_row_parallel(self, partial: Tensors, layer: str) -> Tensors:
        biased = [x if p.get(layer + ".bias") is None else x + p[layer + ".bias"]
                  for x, p in zip(partial, self.shards)]
        return self.leave_region(biased, layer + ".weight")  # all-reduce, or SP's reduce-scatter


def _count_every_label(targets: list[torch.Tensor], mesh: Mesh) -> int:
    return sum(t.numel() for t in targets)


def _last_rank_late(dp_rank: int, mesh: Mesh) -> int:
    return 1 if dp_rank == mesh.dp - 1 else 0


def _equal_counts(case: TrainingCase) -> str | None:
    if case.mesh.dp * case.mesh.cp == 1:
        return "dp=1: one local mean is the global mean"
    blocks = case.mesh.row_blocks(case.spec.rows)
    width = case.spec.seq_len // case.mesh.cp
    for batch in case.batches:
        counts = {valid_count(batch.targets[rows][:, j * width:(j + 1) * width])
                  for rows in blocks for j in range(case.mesh.cp)}
        if len(counts) > 1:
            return None
    return "every DP rank holds the same number of valid tokens"


def _tp1(case: TrainingCase) -> str | None:
    return "tp=1: a group of one rank" if case.mesh.tp == 1 else None


def _never(case: TrainingCase) -> str | None:
    return None  # the optimizer steps every parameter of every case


def _beta2_0999(adamw: AdamW) -> AdamW:
    # torch's default beta2, where the recipe asks for 0.95 (Llama, Megatron configs)
    return replace(adamw, betas=(adamw.betas[0], 0.999))


def _lr_half_percent_high(adamw: AdamW) -> AdamW:
    # a learning-rate schedule one warmup tick off on one side: lr 0.5% high
    return replace(adamw, lr=adamw.lr * 1.005)


def _no_row_bias(case: TrainingCase) -> str | None:
    c = case.config  # o_proj's bias (bias or o_bias), down's (bias)
    return _tp1(case) or (None if c.has_o_bias or c.has_down_bias else
                          "config has no row-parallel bias")


def _no_vocab_padding(case: TrainingCase) -> str | None:
    c = case.config
    return None if c.padded_vocab != c.vocab else f"vocab {c.vocab} needs no padding"


def _all_labels_valid(case: TrainingCase) -> str | None:
    if any((batch.targets == IGNORE_INDEX).any() for batch in case.batches):
        return None
    return "no label is ignored or padding"


def _no_boundary_on_last_rank(case: TrainingCase) -> str | None:
    if not case.spec.packed:
        return "unpacked: attention is plainly causal, no document mask"
    rows = case.mesh.row_blocks(case.spec.rows)[-1]
    for batch in case.batches:
        right, late = batch.rows(rows), batch.rows(rows, shift=1)
        if _reaches_a_label(document_mask(right.segments), document_mask(late.segments),
                            right.targets != IGNORE_INDEX, case.config.n_layers):
            return None
    return ("on the last DP rank no valid label depends on a position whose visible keys "
            "the late boundaries change")


def _reaches_a_label(right: torch.Tensor, late: torch.Tensor, valid: torch.Tensor,
                     layers: int) -> bool:
    """Whether a changed mask row reaches a valid label through ``layers`` attention layers:
    a position's output changes at the first layer if its row of the mask changed, and at
    each later layer also if it sees a position that changed."""
    changed = (right != late).any(-1)[:, 0]  # (B, T)
    sees = late[:, 0].float()  # (B, T, T)
    for _ in range(layers - 1):
        changed = changed | (torch.bmm(sees, changed.float()[..., None])[..., 0] > 0)
    return bool((changed & valid).any())


@dataclass(frozen=True)
class TrainingMutation:
    """A named training bug: the recipe that carries it, and where it changes nothing."""

    name: str
    description: str
    recipe: Recipe
    identity: IdentityRule

    def identity_reason(self, case: TrainingCase) -> str | None:
        return self.identity(case)

    def check(self, case: TrainingCase, thresholds: dict[str, float], **kwargs: object
              ) -> TrainingReport:
        return case.check(thresholds, recipe=self.recipe, mutation=self.name,
                          **kwargs)  # type: ignore[arg-type]

    def broken_claim(self, case: TrainingCase, thresholds: dict[str, float]) -> str | None:
        """Why the mutation's claim fails on ``case`` (a declared identity that the check
        flags, or a real change it misses), or None where the claim holds."""
        reason = self.identity_reason(case)
        report = self.check(case, thresholds)
        if reason and not report.passed:
            return f"{self.name}: declared identity ({reason}) but {report.worst}"
        if not reason and report.passed:
            return f"{self.name}: not the identity, yet undetected (worst {report.worst})"
        return None


TRAINING_MUTATIONS: tuple[TrainingMutation, ...] = (
    TrainingMutation("equal_average_local_means",
                     "each DP rank (and CP chunk) divides by its own valid count; the local "
                     "means are averaged",
                     replace(CORRECT, objective=_equal_average), _equal_counts),
    TrainingMutation("extra_tp_averaging",
                     "replicated parameters' gradients averaged over the TP group (extra 1/t)",
                     replace(CORRECT, tp_reduce=_mean_over_group), _tp1),
    TrainingMutation("tp_ranks_as_examples",
                     "backward seeded from every TP rank's copy of the loss, as if each rank "
                     "held its own examples (the printed loss stays right)",
                     replace(CORRECT, seed=_seed_every_rank), _tp1),
    TrainingMutation("row_bias_every_rank",
                     "row-parallel bias added to every rank's partial sum before the all-reduce",
                     replace(CORRECT, model=BiasEveryRankModel), _no_row_bias),
    TrainingMutation("padded_vocab_unmasked",
                     "padded vocab columns left in the softmax as extra classes",
                     replace(CORRECT, mask_padding=False), _no_vocab_padding),
    TrainingMutation("ignored_labels_counted",
                     "every label position, ignored and padding included, counted in the "
                     "denominator",
                     replace(CORRECT, count=_count_every_label), _all_labels_valid),
    TrainingMutation("doc_mask_offset",
                     "the last DP rank's document boundaries one position late",
                     replace(CORRECT, mask_shift=_last_rank_late), _no_boundary_on_last_rank),
    TrainingMutation("adamw_beta2_0999",
                     "the sharded side's AdamW with beta2 0.999 instead of 0.95 (torch's default)",
                     replace(CORRECT, optimizer=_beta2_0999), _never),
    TrainingMutation("adamw_lr_half_percent_high",
                     "the sharded side's AdamW learning rate 0.5% high",
                     replace(CORRECT, optimizer=_lr_half_percent_high), _never),
)


def _norm_unreduced(grads: Tensors, group: Collective, tag: str) -> Tensors:
    if "norm" in tag:  # each rank keeps the gradient of its own sequence shard only
        return list(grads)
    return group.all_reduce(grads, tag=tag)


def _norm_reduced_twice(grads: Tensors, group: Collective, tag: str) -> Tensors:
    reduced = group.all_reduce(grads, tag=tag)
    return group.all_reduce(reduced, tag=tag) if "norm" in tag else reduced


def _keep_own(grads: Tensors, group: Collective, tag: str) -> Tensors:
    return list(grads)  # no reduction: each CP rank steps with its own chunk's gradient


class KeyOffsetModel(ShardedModel):
    """The last CP rank places the gathered keys and values one chunk late: chunk j is
    read as if it sat at chunk j + 1 (mod cp), the offset of a ring step counted wrong."""

    def gather_context(self, kv: Tensors, tag: str) -> Tensors:
        assert self.context is not None
        gathered = super().gather_context(kv, tag)
        last, width = self.context.degree - 1, kv[0].shape[1]
        return [g.roll(width, dims=1) if j == last else g
                for g, j in zip(gathered, self.context.ranks)]


class LocalCausalModel(ShardedModel):
    """The causal boundary drawn with the chunk's LOCAL query positions against global keys
    (``is_causal`` on a (Tc, T) score block: query i sees keys 0..i)."""

    @staticmethod
    def chunk_mask(segments: torch.Tensor | None, start: int, stop: int, seq_len: int
                   ) -> torch.Tensor:
        local = torch.arange(seq_len)[None, :] <= torch.arange(stop - start)[:, None]  # (Tc, T)
        right = ShardedModel.chunk_mask(segments, start, stop, seq_len)
        beyond = ShardedModel.chunk_mask(None, start, stop, seq_len)  # global causal alone
        return (right | ~beyond) & local  # the document rule kept, causality local


class DocEdgeModel(ShardedModel):
    """Document boundaries applied only among the chunk's own keys: a query sees every
    earlier remote key across a CP chunk edge, whatever its document."""

    @staticmethod
    def chunk_mask(segments: torch.Tensor | None, start: int, stop: int, seq_len: int
                   ) -> torch.Tensor:
        right = ShardedModel.chunk_mask(segments, start, stop, seq_len)
        if segments is None:
            return right
        causal = ShardedModel.chunk_mask(None, start, stop, seq_len)  # (1, 1, Tc, T)
        remote = (torch.arange(seq_len) < start) | (torch.arange(seq_len) >= stop)  # (T,)
        real = (segments[:, start:stop] >= 0)[:, None, :, None]  # (B, 1, Tc, 1)
        return right | (causal & remote & real)


class GatherBackwardSplitModel(ShardedModel):
    """At each column-parallel region's entry the all-gather's backward is a split (each
    rank keeps its own slice of its own gradient) where the reduce-scatter belongs: the
    reduce-scatter / all-gather pair swapped in backward. The forward swap is not
    shape-preserving (a reduce-scatter of a ``(B, Tc / t, d)`` shard gives
    ``(B, Tc / t^2, d)``, which the next matmul rejects), so it is injected in backward."""

    def enter_region(self, xs: Tensors, tag: str) -> Tensors:
        if not self.sequence_parallel:
            return xs
        full = self.collective.all_gather([x.detach() for x in xs], dim=1, tag=tag)
        out = []
        for x, g, r in zip(xs, full, self.collective.ranks):
            w = x.shape[1]
            out.append(torch.cat([g[:, :r * w], x, g[:, (r + 1) * w:]], dim=1))  # (B, Tc, d)
        return out


def _cp1(case: TrainingCase) -> str | None:
    return "cp=1: one context chunk, no remote keys" if case.mesh.cp == 1 else None


def _offset_reaches_no_label(case: TrainingCase) -> str | None:
    """Only the last chunk's queries read the rolled keys (causality keeps every other
    query off them, at every layer), and query q then sees the key contents at positions
    ``{p - w : p visible}``: the same set, in another order, where its mask row is
    invariant under that rotation (a query that sees every key). Identity unless a valid
    label depends on a query whose set of visible contents changes."""
    if reason := _cp1(case):
        return reason
    for batch in case.batches:
        rows, seq_len = batch.tokens.shape
        width = seq_len // case.mesh.cp
        right = full_mask(ShardedModel, batch.model_segments, rows, seq_len, case.mesh.cp)
        seen = right.clone()
        seen[:, :, seq_len - width:] = right[:, :, seq_len - width:].roll(-width, dims=-1)
        if _reaches_a_label(right, seen, batch.targets != IGNORE_INDEX, case.config.n_layers):
            return None
    return ("no valid label depends on a last-chunk query whose set of visible keys the "
            "offset changes")


def _no_sp(case: TrainingCase) -> str | None:
    if not case.mesh.sp:
        return "no sequence parallelism: no all-gather enters a region"
    return _tp1(case)


def full_mask(model: type[ShardedModel], segments: torch.Tensor | None, rows: int,
              seq_len: int, cp: int) -> torch.Tensor:
    """The ``(B, 1, T, T)`` mask a model's CP chunks assemble, chunk rows stacked."""
    width = seq_len // cp
    parts = [model.chunk_mask(segments, j * width, (j + 1) * width, seq_len) for j in range(cp)]
    return torch.cat([p.expand(rows, 1, width, seq_len) for p in parts], dim=2)


def _mask_identity(mutant: type[ShardedModel]) -> IdentityRule:
    def rule(case: TrainingCase) -> str | None:
        if reason := _cp1(case):
            return reason
        for batch in case.batches:
            rows, seq_len = batch.tokens.shape
            right = full_mask(ShardedModel, batch.model_segments, rows, seq_len, case.mesh.cp)
            wrong = full_mask(mutant, batch.model_segments, rows, seq_len, case.mesh.cp)
            if _reaches_a_label(right, wrong, batch.targets != IGNORE_INDEX,
                                case.config.n_layers):
                return None
        return "no valid label depends on a query whose visible keys the mutant changes"
    return rule


SEQUENCE_MUTATIONS: tuple[TrainingMutation, ...] = (
    TrainingMutation("norm_grad_unreduced",
                     "replicated norm weights' gradients not summed over the sequence shards "
                     "(each TP rank keeps its own); also wrong without SP, where each copy "
                     "saw only its rank's branch", replace(CORRECT, tp_reduce=_norm_unreduced),
                     _tp1),
    TrainingMutation("norm_grad_reduced_twice",
                     "replicated norm weights' gradients summed over the sequence shards twice",
                     replace(CORRECT, tp_reduce=_norm_reduced_twice), _tp1),
    TrainingMutation("cp_grad_unreduced",
                     "parameters' gradients not summed over the CP group: each CP rank steps "
                     "with its own chunk's share", replace(CORRECT, cp_reduce=_keep_own), _cp1),
    TrainingMutation("cp_key_offset",
                     "the last CP rank's gathered keys and values offset by one chunk",
                     replace(CORRECT, model=KeyOffsetModel), _offset_reaches_no_label),
    TrainingMutation("cp_local_causal",
                     "the causal boundary drawn with local rather than global query positions",
                     replace(CORRECT, model=LocalCausalModel), _mask_identity(LocalCausalModel)),
    TrainingMutation("cp_doc_boundary_ignored",
                     "document boundaries ignored across a CP chunk edge (remote keys of "
                     "other documents visible)", replace(CORRECT, model=DocEdgeModel),
                     _mask_identity(DocEdgeModel)),
    TrainingMutation("sp_gather_backward_split",
                     "SP region entry: the all-gather's backward a split where the "
                     "reduce-scatter belongs (forward swap is not shape-preserving)",
                     replace(CORRECT, model=GatherBackwardSplitModel), _no_sp),
)
ALL_TRAINING_MUTATIONS = TRAINING_MUTATIONS + SEQUENCE_MUTATIONS

BY_NAME: dict[str, TrainingMutation] = {m.name: m for m in ALL_TRAINING_MUTATIONS}


def training_mutation(name: str) -> TrainingMutation:
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnknownMutation(f"unknown training mutation {name!r}; known: "
                              f"{', '.join(BY_NAME)}") from None


@dataclass(frozen=True)
class MatrixRow:
    """One (mutation, case) cell: skipped with its identity reason, or its report."""

    mutation: str
    case: str
    identity: str | None
    report: TrainingReport | None

    @property
    def detected(self) -> bool | None:
        return None if self.report is None else not self.report.passed


def mutation_matrix(cases: list[TrainingCase], thresholds: dict[str, float],
                    mutations: tuple[TrainingMutation, ...] = TRAINING_MUTATIONS, *,
                    train: Callable[[TrainingCase, Recipe], object] | None = None
                    ) -> list[MatrixRow]:
    """Every mutation on every case where it is not the identity (one reference per case).
    ``train(case, recipe)`` trains the sharded side elsewhere (``training.gloo``: over a rank
    pool) and returns what ``TrainingCase.check`` takes as ``trained``; default in process."""
    rows = []
    for case in cases:
        label = f"{case.config.name} {case.mesh}{' packed' if case.spec.packed else ''}"
        reference = case.reference()
        for m in mutations:
            reason = m.identity_reason(case)
            if reason:
                report = None
            elif train is None:
                report = m.check(case, thresholds, reference=reference)
            else:
                report = case.check(thresholds, reference=reference, mutation=m.name,
                                    trained=train(case, m.recipe))
            rows.append(MatrixRow(m.name, label, reason, report))
    return rows

"""Training bugs injected into one stage of the distributed step, to prove the check sees them.

Each mutation replaces exactly one field of the correct ``Recipe`` (or the model's
row-parallel reduction) with the bug as it is written in real trainers, and declares where
it is the identity, so a test never demands detection of a no-op:

- ``equal_average_local_means``: each DP rank's loss is its local mean, and the means are
  averaged. Identity at dp=1, or where every DP rank holds as many valid tokens.
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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.errors import UnknownMutation
from weight_sync_bench.loss import IGNORE_INDEX, valid_count
from weight_sync_bench.model import document_mask
from weight_sync_bench.sharded import ShardedModel
from weight_sync_bench.training import CORRECT, Mesh, Recipe, TrainingCase
from weight_sync_bench.training_compare import TrainingReport

if TYPE_CHECKING:
    from weight_sync_bench.sharded import Collective, Tensors

# (the case) -> why the mutation changes nothing there, or None where it does
IdentityRule = Callable[[TrainingCase], str | None]


def _equal_average(token_losses: torch.Tensor, targets: torch.Tensor, total: int,
                   mesh: Mesh) -> torch.Tensor:
    return token_losses.sum() / valid_count(targets) / mesh.dp


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
        return self.collective.all_reduce(biased, tag=layer + ".weight")


def _count_every_label(targets: list[torch.Tensor], mesh: Mesh) -> int:
    return sum(t.numel() for t in targets)


def _last_rank_late(dp_rank: int, mesh: Mesh) -> int:
    return 1 if dp_rank == mesh.dp - 1 else 0


# -- where each is the identity --------------------------------------------------------

def _equal_counts(case: TrainingCase) -> str | None:
    if case.mesh.dp == 1:
        return "dp=1: one local mean is the global mean"
    blocks = case.mesh.row_blocks(case.spec.rows)
    for batch in case.batches:
        counts = {valid_count(batch.targets[rows]) for rows in blocks}
        if len(counts) > 1:
            return None
    return "every DP rank holds the same number of valid tokens"


def _tp1(case: TrainingCase) -> str | None:
    return "tp=1: a group of one rank" if case.mesh.tp == 1 else None


def _no_row_bias(case: TrainingCase) -> str | None:
    return _tp1(case) or (None if case.config.bias else "config has no row-parallel bias")


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


TRAINING_MUTATIONS: tuple[TrainingMutation, ...] = (
    TrainingMutation("equal_average_local_means",
                     "each DP rank divides by its own valid count; the local means are averaged",
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
)

BY_NAME: dict[str, TrainingMutation] = {m.name: m for m in TRAINING_MUTATIONS}


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
                    mutations: tuple[TrainingMutation, ...] = TRAINING_MUTATIONS
                    ) -> list[MatrixRow]:
    """Every mutation on every case where it is not the identity (one reference per case)."""
    rows = []
    for case in cases:
        label = f"{case.config.name} {case.mesh}{' packed' if case.spec.packed else ''}"
        reference = case.reference()
        for m in mutations:
            reason = m.identity_reason(case)
            report = None if reason else m.check(case, thresholds, reference=reference)
            rows.append(MatrixRow(m.name, label, reason, report))
    return rows

"""How many collectives of each kind one training step runs, per forward and per backward.

As PyTorch's ``CommDebugMode`` tests count the collectives a DTensor program issues, this
counts what one DP replica's step asks of its groups, in process: the forward's calls
(model and vocab-parallel loss) as each group records them, the backward's from the
autograd hooks ``InProcessCollective`` sets (the adjoint each forward collective's
backward amounts to: all-reduce for all-reduce, reduce-scatter for all-gather, all-gather
for reduce-scatter; none for the loss's detached maximum), and the gradient reductions
after backward. ``expected_counts`` is the same table derived from the layout alone;
a test asserts the two agree for every mesh shape.

Counts are per group: with CP each of the cp TP groups runs the TP count, each of the tp
CP groups the CP count. ``spans`` says which flat positions each (axis, op) touched.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.training.mesh import Mesh, mesh_groups
from weight_sync_bench.training.step import (
    CORRECT,
    Recipe,
    TrainingCase,
    group_backward,
    reduce_over_context,
    reduce_replicated,
)

if TYPE_CHECKING:
    from weight_sync_bench.collectives.protocol import Collective
    from weight_sync_bench.model.config import ModelConfig


Key = tuple[str, str, str]  # (stage: forward | backward | reduction, axis: tp | cp, op)


@dataclass(frozen=True)
class CollectiveCounts:
    """Collectives per group of each axis, by (stage, axis, op); and the spans seen."""

    mesh: Mesh
    counts: dict[Key, int]
    spans: dict[tuple[str, str], frozenset[tuple[int, ...]]]  # (axis, op) -> positions

    def format(self) -> str:
        return ", ".join(f"{stage} {axis} {op} x{n}"
                         for (stage, axis, op), n in sorted(self.counts.items()))


def _records(coll: Collective, attr: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, span) of every recorded call; a single group spans all its ranks."""
    return [(call[0], call[2] if len(call) == 3 else tuple(coll.ranks))
            for call in getattr(coll, attr)]


def count_collectives(case: TrainingCase, recipe: Recipe = CORRECT) -> CollectiveCounts:
    """One step of DP replica 0 of ``case`` (its first batch), counted."""
    config, mesh = case.config, case.mesh
    assert case.params is not None
    layout = layout_for(config)
    declared = split(case.params, layout, mesh.tp)
    group = [{n: s.clone().requires_grad_(True) for n, s in declared[e % mesh.tp].items()}
             for e in range(mesh.replica_size)]
    batch = case.batches[0]
    part = batch.rows(mesh.row_blocks(case.spec.rows)[0])
    tp, cp = mesh_groups(mesh)
    group_backward(config, group, tp, part, max(part.valid, 1), mesh, recipe, cp)
    tp_red, cp_red = mesh_groups(mesh)
    replicated = [s.name for s in layout if isinstance(s.placement, Replicate)]
    reduce_replicated(group, replicated, tp_red, recipe)
    if cp_red is not None:
        reduce_over_context(group, cp_red, recipe)
    counts: Counter[Key] = Counter()
    spans: dict[tuple[str, str], set[tuple[int, ...]]] = {}
    for axis, stage, coll, attr, groups in (
            ("tp", "forward", tp, "calls", mesh.cp), ("tp", "backward", tp, "backward_calls", mesh.cp),
            ("tp", "reduction", tp_red, "calls", mesh.cp),
            ("cp", "forward", cp, "calls", mesh.tp), ("cp", "backward", cp, "backward_calls", mesh.tp),
            ("cp", "reduction", cp_red, "calls", mesh.tp)):
        if coll is None:
            continue
        for op, span in _records(coll, attr):
            counts[(stage, axis, op)] += 1
            spans.setdefault((axis, op), set()).add(span)
        for key in [k for k in counts if k[:2] == (stage, axis)]:
            if counts[key] % groups:
                raise AssertionError(f"{key}: {counts[key]} calls over {groups} groups")
            counts[key] //= groups  # per group
    return CollectiveCounts(mesh, dict(counts), {k: frozenset(v) for k, v in spans.items()})


def expected_counts(config: ModelConfig, mesh: Mesh) -> dict[Key, int]:
    """The per-group counts the layout implies for one training step (L layers):

    - TP forward: without SP, all-reduce 1 (embedding) + 2L (o_proj, down) + 2 (the loss's
      sum of exponentials and target logit) and all-gather 1 (the loss's maximum); with
      SP, reduce-scatter 1 + 2L where those all-reduces were, all-gather 2L + 1 (entering
      qkv, gate_up and lm_head) + 1 (the maximum), all-reduce 2 (the loss);
    - TP backward: each differentiable forward collective's adjoint once (the maximum is
      detached);
    - TP reduction: one all-reduce per replicated parameter (norms, row biases);
    - CP forward: all-gather L (K and V); backward: reduce-scatter L; reduction: one
      all-reduce per parameter (every one is replicated over CP).
    """
    n = config.n_layers
    layout = layout_for(config)
    out: dict[Key, int] = {}
    if mesh.sp:
        out.update({("forward", "tp", "reduce_scatter"): 1 + 2 * n,
                    ("forward", "tp", "all_gather"): 2 * n + 2,
                    ("forward", "tp", "all_reduce"): 2,
                    ("backward", "tp", "all_gather"): 1 + 2 * n,
                    ("backward", "tp", "reduce_scatter"): 2 * n + 1,
                    ("backward", "tp", "all_reduce"): 2})
    else:
        out.update({("forward", "tp", "all_reduce"): 1 + 2 * n + 2,
                    ("forward", "tp", "all_gather"): 1,
                    ("backward", "tp", "all_reduce"): 1 + 2 * n + 2})
    out[("reduction", "tp", "all_reduce")] = sum(isinstance(s.placement, Replicate)
                                                 for s in layout)
    if mesh.cp > 1:
        out.update({("forward", "cp", "all_gather"): n, ("backward", "cp", "reduce_scatter"): n,
                    ("reduction", "cp", "all_reduce"): len(list(layout))})
    return out

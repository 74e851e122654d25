"""Where an MoE conversion mutation is invisible to the forward on one example's tokens.

A Mixture-of-Experts forward computes an expert only for the tokens routed to it, so a bug
can change bytes the example's forward never reads: a selection bias whose change moves no
token's choice of experts, or the weights of experts no token of the example is routed to
(with 4 tokens, 8 experts and top-1, at least 4 experts take none). The measured MoE
validation met both: ``expert_bucket_not_sent`` and ``local_expert_id_as_global`` at 0.0x the
threshold where the experts they change took no token, ``router_bias_not_synced`` at 0.0x
where the only choice it moved was near-tied, so the routing check kept the reference's.
Such an example is an identity example for the forward (``fuzz.case.Outcome.unchanged``):
only the byte comparison can show the bug there, and it must.

``forward_unchanged`` says why, or None where the forward reads what the mutation changed.
The routing it reads is the reference's (``RoutingGuard.routings``): a correct sharded
forward makes the same choices on every token not near-tied (its own routing deviation is
validated ``SAFETY`` x below the bound, ``tolerance.sampled_moe``), and takes the reference's
on the near-tied ones.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from weight_sync_bench.check.conversion import ConversionChecker
from weight_sync_bench.check.diagnosis import raw
from weight_sync_bench.conventions.maps import Piece, gather_canonical
from weight_sync_bench.conventions.mutations import (
    ROUTER_BIAS,
    Conversion,
    ConversionMutation,
)
from weight_sync_bench.model.reference import ReferenceModel

_EXPERT = re.compile(r"layers\.(\d+)\.experts\.(gate_up|down)\.weight")


def forward_unchanged(checker: ConversionChecker, conversion: Conversion,
                      mutation: ConversionMutation,
                      shards: Sequence[Mapping[str, torch.Tensor]]) -> str | None:
    """Why ``mutation``'s ``shards`` (the destination's, mutated) change nothing the forward
    computes on ``checker``'s tokens, or None where they may: a selection-only mutation whose
    bias moves no choice the routing check leaves to the forward (``selection_unchanged``),
    an expert-weight one that changes only experts no token is routed to
    (``unrouted_only``). A dense model's: always None."""
    if not checker.config.n_experts:
        return None
    if mutation.changes == ROUTER_BIAS:
        return selection_unchanged(checker, conversion, shards)
    return unrouted_only(checker, conversion, shards)


def selection_unchanged(checker: ConversionChecker, conversion: Conversion,
                        shards: Sequence[Mapping[str, torch.Tensor]]) -> str | None:
    """Where the selection bias the destination holds moves no token's choice of experts at
    any layer (the reference run again with that bias; a choice is a set of experts, its
    order aside: found by the MoE validation, a zeroed bias that only reordered three chosen
    experts changed the logits by exactly 0), except choices near-tied in the reference,
    where the routing check gives the forward the reference's choice: why, else None.

    A near-tied choice moved at one layer moves the next layer's input in the run with the
    bias and not in the checked forward: a move it causes later counts as seen, the stricter
    answer (the kill is then demanded)."""
    config = checker.config
    names = [n for n in config.param_shapes() if re.fullmatch(ROUTER_BIAS, n)]
    held = gather_canonical(shards, conversion.dst.pieces(config), config.param_shapes(), names)
    guard = checker.checker.guard
    assert guard is not None and checker.checker.tokens is not None
    model = ReferenceModel(config, {**checker.checker.full, **held})
    model(checker.checker.tokens)
    changed = {i: _moved(model.routings[i].experts, guard.routings[i].experts)
               for i in guard.routings}
    if not any(bool((changed[i] & ~guard.near(i)).any()) for i in changed):
        near = sum(int((changed[i] & guard.near(i)).sum()) for i in changed)
        return ("the selection bias it leaves moves no token's choice of experts on these "
                "tokens" + (f" but {near} near-tied, where the routing check keeps the "
                            "reference's" if near else ""))
    return None


def _moved(experts: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: the tokens whose chosen experts ``(N, k)`` differ from ``before`` as
    sets. The order is the scores' (descending), which the bias may permute among the
    chosen; each expert's weight is its own gate score whatever its rank, so a permuted
    choice computes the same sum (in another order: rounding, not a change)."""
    return (experts.sort(-1).values != before.sort(-1).values).any(-1)


def unrouted_only(checker: ConversionChecker, conversion: Conversion,
                  shards: Sequence[Mapping[str, torch.Tensor]]) -> str | None:
    """Where ``shards`` differ from the destination's declared ones only in the rows or
    columns of experts no token is routed to (the reference's choices, per MoE layer): why,
    else None (a difference in anything else, or in an expert some token takes)."""
    config, target = checker.config, conversion.dst
    guard = checker.checker.guard
    assert guard is not None
    touched = experts_touched(config.expert_ffn, target.pieces(config), shards,
                              checker.declared(target))
    if touched is None or not touched:
        return None
    routed = {layer: set(routing.experts.flatten().tolist())
              for layer, routing in guard.routings.items()}
    if any(touched[layer] & routed.get(layer, set()) for layer in touched):
        return None
    where = "; ".join(f"layer {layer}: {', '.join(map(str, sorted(experts)))}"
                      for layer, experts in sorted(touched.items()))
    return f"it changes only experts no token is routed to on these tokens ({where})"


def experts_touched(expert_ffn: int, pieces: Sequence[Mapping[str, Piece]],
                    shards: Sequence[Mapping[str, torch.Tensor]],
                    declared: Sequence[Mapping[str, torch.Tensor]]) -> dict[int, set[int]] | None:
    """Per layer, the experts whose stored rows (``experts.gate_up``: ``2 expert_ffn`` each)
    or columns (``experts.down``: ``expert_ffn`` each) ``shards`` change against
    ``declared``, on any rank; None where they change a stored tensor that holds no expert,
    or a padding slice."""
    touched: dict[int, set[int]] = {}
    for rank, (mine, theirs) in enumerate(zip(shards, declared)):
        for name, piece in pieces[rank].items():
            x, y = raw(piece.flat(mine[name])), raw(piece.flat(theirs[name]))
            if torch.equal(x, y):  # equal bytes (NaN == NaN, -0.0 != 0.0)
                continue
            match = _EXPERT.fullmatch(piece.source)
            if match is None:
                return None
            differ = (x != y).movedim(piece.dim, 0).reshape(x.shape[piece.dim], -1).any(-1)
            idx = piece.idx[differ]
            if bool((idx < 0).any()):
                return None
            width = expert_ffn * (2 if match.group(2) == "gate_up" else 1)
            touched.setdefault(int(match.group(1)), set()).update(
                (idx // width).tolist())
    return touched


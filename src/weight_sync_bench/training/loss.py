"""Vocab-parallel cross-entropy over the lm_head shards, and the global valid-token mean.

Each tensor-parallel rank holds logits for its own slice of the padded vocabulary,
``[rank * w, (rank + 1) * w)`` with ``w = padded_vocab / t``. The loss of one token is
``log(sum_v exp(z_v)) - z_target`` over the whole vocabulary, which no rank can compute
alone: the maximum (for a stable exp), the sum of exponentials and the target's logit may
each sit on a different rank. Three collectives over the group assemble them:

- the global maximum, gathered from every rank's local maximum (detached: subtracting any
  constant leaves the loss unchanged, so it carries no gradient);
- the sum of ``exp(z - max)`` over every rank's slice, all-reduced;
- the target's logit, taken on the one rank that owns the target and all-reduced (zero
  elsewhere).

Padded vocabulary columns (global index >= vocab) are set to -inf before any of that, so
they never become a class: they add nothing to the sum and receive no gradient.

The objective is the global valid-token mean: token losses summed over every valid token
of every data-parallel rank, divided by the total valid count. ``valid_count`` and
``local_objective`` are the two halves a data-parallel rank needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from weight_sync_bench.collectives.protocol import Collective, Tensors


IGNORE_INDEX = -100  # a label that is not a valid token: padding, or ignored on purpose


def vocab_parallel_token_losses(local_logits: Tensors,
                                targets: torch.Tensor | Sequence[torch.Tensor],
                                collective: Collective, *, vocab: int,
                                mask_padding: bool = True) -> Tensors:
    """Per-token cross-entropy ``(B, T)`` per local rank; exactly 0 where the label is ignored.

    ``local_logits[i]`` is rank ``collective.ranks[i]``'s vocab slice ``(B, T, w)``;
    ``targets`` ``(B, T)`` holds global class ids or ``IGNORE_INDEX``: one tensor every rank
    shares, or one per local rank (each context-parallel chunk its own labels).
    ``mask_padding=False`` leaves padded columns in the softmax: the bug
    ``padded_vocab_unmasked`` injects.
    """
    width = local_logits[0].shape[-1]
    per_rank = ([targets] * len(local_logits) if isinstance(targets, torch.Tensor)
                else list(targets))
    masked, local_max = [], []
    for z, rank in zip(local_logits, collective.ranks):
        start = rank * width
        if mask_padding and start + width > vocab:
            padding = torch.arange(start, start + width) >= vocab  # (w,)
            z = z.masked_fill(padding, float("-inf"))
        masked.append(z)
        local_max.append(z.detach().amax(dim=-1, keepdim=True))  # (B, T, 1)
    gathered = collective.all_gather(local_max, dim=-1, tag="loss.max")  # (B, T, t) each
    sum_exp, target_logit = [], []
    valids = [t != IGNORE_INDEX for t in per_rank]  # (B, T) each
    for z, rank, m, labels, valid in zip(masked, collective.ranks, gathered, per_rank, valids):
        start = rank * width
        z = z - m.amax(dim=-1, keepdim=True)  # (B, T, w), every entry <= 0
        sum_exp.append(z.exp().sum(dim=-1))  # (B, T)
        local = labels - start
        owned = valid & (local >= 0) & (local < width)  # (B, T)
        picked = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)  # (B, T)
        target_logit.append(torch.where(owned, picked, torch.zeros_like(picked)))
    sum_exp = collective.all_reduce(sum_exp, tag="loss.sum_exp")
    target_logit = collective.all_reduce(target_logit, tag="loss.target_logit")
    return [torch.where(valid, s.log() - z_t, torch.zeros_like(z_t))
            for s, z_t, valid in zip(sum_exp, target_logit, valids)]


def valid_count(targets: torch.Tensor) -> int:
    """Tokens whose label counts: not padding, not ignored."""
    return int((targets != IGNORE_INDEX).sum())


def local_objective(token_losses: torch.Tensor, global_valid: int) -> torch.Tensor:
    """One data-parallel rank's share of the global valid-token mean: its summed token
    losses over the valid count of the whole batch. The shares sum to the mean, so the
    data-parallel gradient reduction that goes with it is a plain sum."""
    return token_losses.sum() / global_valid

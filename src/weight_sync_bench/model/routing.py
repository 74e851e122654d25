"""Top-k routing of a Mixture-of-Experts layer, and how close each token's choice is to flipping.

A router gives each token a logit per expert (``x @ router.T``, ``(N, E)``). What the top-k
compares, the *selection score*, is the router's own:

- ``softmax`` (Mixtral, Qwen2-MoE, Qwen3-MoE: transformers' ``Qwen3MoeSparseMoeBlock``,
  vLLM's ``fused_topk``): the softmax of the logits, whose order is the logits' order, so
  the logits themselves are the scores;
- ``sigmoid`` (DeepSeek-V3: transformers' ``DeepseekV3TopkRouter``, vLLM's ``grouped_topk``):
  ``sigmoid(logits) + bias``, where the bias (``e_score_correction_bias``) takes part in the
  selection only, never in the weights.

With ``n_groups > 1`` the choice is group-limited (DeepSeek-V3's ``n_group`` /
``topk_group``): each group of ``E / n_groups`` experts scores the sum of its top two scores,
the ``topk_groups`` best groups are kept, and the top ``top_k`` experts are chosen among
theirs. The weights are the chosen experts' softmax probabilities (or sigmoids), renormalised
to sum to one with ``norm_topk``.

Choosing is discontinuous: scores that differ in the last bits (a correct sharded forward
sums in another order) can flip a token whose k-th and (k+1)-th scores nearly tie. ``margin``
says how far each token is from that: the smallest change of any one score that could
change its choice (half the gap between the k-th and (k+1)-th expert score; a quarter of
the gap between the kept and the first dropped group, whose scores sum two expert scores).
The check uses it to tell a flip a layout bug caused from one rounding can cause
(``check`` module docstrings: the routing check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from weight_sync_bench.model.config import ModelConfig


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing of N tokens: ``experts`` ``(N, k)`` the chosen expert ids in
    descending score order, ``scores`` ``(N, E)`` the selection scores they were chosen by,
    ``margin`` ``(N,)`` how far each token's choice is from flipping (in score units)."""

    experts: torch.Tensor
    scores: torch.Tensor
    margin: torch.Tensor


def selection_scores(logits: torch.Tensor, config: ModelConfig,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the top-k compares: the logits (softmax routers: the softmax keeps their order),
    or ``sigmoid(logits) + bias`` (sigmoid routers; the bias only where there is one)."""
    if config.router == "softmax":
        return logits
    scores = torch.sigmoid(logits)
    return scores if bias is None else scores + bias


def route(logits: torch.Tensor, config: ModelConfig, bias: torch.Tensor | None = None
          ) -> Routing:
    """The experts each token ``(N, E)`` logits choose, and the margin of that choice."""
    scores = selection_scores(logits, config, bias)
    experts, margin = choose(scores, config)
    return Routing(experts, scores, margin)


def choose(scores: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(experts (N, k), margin (N,))`` of selection scores ``(N, E)``: the top ``top_k``,
    group-limited when ``n_groups > 1``."""
    n, e, k = scores.shape[0], config.n_experts, config.top_k
    inf = torch.full((n,), float("inf"))
    allowed = scores
    group_margin = inf
    if config.n_groups > 1:
        g, kg = config.n_groups, config.topk_groups
        grouped = scores.view(n, g, e // g)  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        ranked = group_scores.sort(dim=-1, descending=True).values
        if kg < g:
            group_margin = (ranked[:, kg - 1] - ranked[:, kg]) / 4
        kept = group_scores.topk(kg, dim=-1).indices  # (N, kg)
        mask = torch.ones(n, g, dtype=torch.bool).scatter_(1, kept, False)  # True: dropped
        allowed = grouped.masked_fill(mask[:, :, None], float("-inf")).view(n, e)
    top = allowed.topk(min(k + 1, e), dim=-1)
    expert_margin = inf
    if k < e:
        after = top.values[:, k]
        # a dropped group's -inf is no competitor: only the kept groups' experts are
        expert_margin = torch.where(torch.isinf(after), inf, (top.values[:, k - 1] - after) / 2)
    return top.indices[:, :k], torch.minimum(group_margin, expert_margin)


def gate_weights(logits: torch.Tensor, experts: torch.Tensor, config: ModelConfig
                 ) -> torch.Tensor:
    """The chosen experts' weights ``(N, k)``: softmax probabilities over every expert (or
    sigmoids) at the chosen ids, renormalised to sum to one with ``norm_topk`` (the sigmoid
    router adds 1e-20 to the sum, as DeepSeek-V3 does). The selection bias takes no part."""
    probs = torch.softmax(logits, dim=-1) if config.router == "softmax" else torch.sigmoid(logits)
    weights = probs.gather(1, experts)
    if config.norm_topk:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if config.router == "sigmoid" else total)
    return weights


def by_expert(experts: torch.Tensor, weights: torch.Tensor, n_experts: int
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per expert, the tokens routed to it and their weights: ``[(tokens (n_e,), weights
    (n_e,)), ...]``, tokens ascending (the order transformers' MoE blocks gather them in).
    An expert id of -1 routes nowhere (a token another rank serves)."""
    flat = experts.flatten()  # (N k,)
    tokens = torch.arange(experts.shape[0]).repeat_interleave(experts.shape[1])
    keep = flat >= 0
    flat, tokens, w = flat[keep], tokens[keep], weights.flatten()[keep]
    order = torch.argsort(flat * experts.shape[0] + tokens)  # by expert, then token
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    w = w[order]
    t = tokens[order]
    out, at = [], 0
    for count in counts:
        out.append((t[at:at + count], w[at:at + count]))
        at += count
    return out


def score_deviation(own: Mapping[int, Sequence[Routing]], reference: Mapping[int, Routing]
                    ) -> float:
    """The largest change of any selection score a sharded forward made against the
    reference, over every MoE layer and every rank's own routing (``ShardedModel.routings``
    against ``ReferenceModel.routings``): what a routing floor measures. 0 for a dense model."""
    worst = 0.0
    for layer, ranks in own.items():
        for routing in ranks:
            worst = max(worst, float((routing.scores - reference[layer].scores).abs().max()))
    return worst

"""``model.routing`` (issue 30, the mutation pass over ``model/routing.py``): what a Mixture-
of-Experts router compares, which experts it chooses, with what weights, and how far each
choice is from flipping.

The rules are the frameworks' own, written out here as they have them:

- softmax routers (transformers 5.x ``Qwen3MoeTopKRouter.forward``, Mixtral's and Qwen2-MoE's
  the same): ``topk(softmax(logits))``, the weights renormalised by their plain sum with
  ``norm_topk_prob``. The softmax keeps the logits' order, so the harness's selection score
  is the logit itself and its margins are in logit units;
- DeepSeek-V3's sigmoid router (transformers ``DeepseekV3TopkRouter.get_topk_indices`` and
  ``forward``; vLLM's ``grouped_topk`` with an ``e_score_correction_bias``): the choice by
  ``sigmoid(logits) + e_score_correction_bias``, each group scored by the sum of its top two,
  the ``topk_group`` best groups kept; the weights the unbiased sigmoids, divided by their sum
  ``+ 1e-20``. ``routed_scaling_factor`` is not modelled (the harness's is 1).

Pinned here: the selection scores a router hands the routing check, group-limited choice at
two groups and at every group kept, a top-k of every expert (no competitor: an infinite
margin), the group margin's quarter gap, DeepSeek's epsilon where every chosen sigmoid
underflows, and the score deviation a routing floor measures. ``test_moe.py`` has the top-k,
the expert margin and the weights on ordinary logits."""

from __future__ import annotations

import math

import pytest
import torch

from weight_sync_bench.model.config import TOY
from weight_sync_bench.model.routing import (
    Routing,
    choose,
    gate_weights,
    route,
    score_deviation,
    selection_scores,
)

SMALL = {"vocab": 256, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "ffn": 96,
         "n_layers": 2}
SOFTMAX = TOY.replace(name="sm", **SMALL, n_experts=8, top_k=2, expert_ffn=32, norm_topk=True)
SIGMOID = TOY.replace(name="sg", **SMALL, n_experts=8, top_k=2, expert_ffn=32, norm_topk=True,
                      router="sigmoid")  # no selection bias
BIASED = SIGMOID.replace(name="ds", router_bias=True)


def deepseek_v3_choice(scores: torch.Tensor, n_group: int, topk_group: int, top_k: int
                       ) -> list[set[int]]:
    """transformers' ``DeepseekV3TopkRouter.get_topk_indices`` on biased scores (the masked
    experts at -inf, as vLLM's ``grouped_topk`` has them), each token's chosen set."""
    n, e = scores.shape
    group_scores = scores.view(n, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(n, e)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return [set(row) for row in torch.topk(masked, k=top_k, dim=-1)[1].tolist()]


def test_a_softmax_routers_selection_scores_are_its_logits_and_a_sigmoid_ones_its_sigmoids():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    r = route(logits, SOFTMAX)
    assert torch.equal(r.scores, logits)  # the softmax keeps their order: margins in logits
    top = logits.topk(3, dim=-1).values
    assert torch.equal(r.margin, (top[:, 1] - top[:, 2]) / 2)
    # Qwen3MoeTopKRouter: topk of the softmax; the same experts as topk of the logits
    probs = torch.softmax(logits, dim=-1)
    assert [set(x) for x in r.experts.tolist()] == [
        set(x) for x in probs.topk(2, dim=-1).indices.tolist()]
    # a sigmoid router without a selection bias compares the sigmoids themselves
    assert torch.equal(selection_scores(logits, SIGMOID), logits.sigmoid())
    assert torch.equal(route(logits, SIGMOID).scores, logits.sigmoid())
    bias = torch.linspace(-0.5, 0.5, 8)
    assert torch.equal(route(logits, BIASED, bias).scores, logits.sigmoid() + bias)


def test_two_groups_keep_one_where_the_best_two_experts_lie_in_both():
    c = SIGMOID.replace(n_experts=4, n_groups=2, topk_groups=1)
    # group 0 = experts 0, 1 (sum 1.0), group 1 = experts 2, 3 (sum 1.5): only group 1 kept,
    # so not experts 0 and 2, the best two over all
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.7]])
    experts, margin = choose(scores, c)
    assert set(experts[0].tolist()) == {2, 3} == deepseek_v3_choice(scores, 2, 1, 2)[0]
    # the kept group beats the dropped one by 0.5, its two sum: a quarter of that flips it;
    # expert 3 has no competitor in the kept group
    assert torch.allclose(margin, torch.tensor([0.125]))


def test_the_group_margin_is_a_quarter_of_the_gap_between_the_last_kept_and_first_dropped():
    c = SIGMOID.replace(n_experts=8, n_groups=4, topk_groups=2, top_k=2)
    # group sums 1.6, 1.0, 0.9, 0.2: groups 0 and 1 kept, group 2 the first dropped
    scores = torch.tensor([[0.9, 0.7, 0.6, 0.4, 0.5, 0.4, 0.1, 0.1]])
    experts, margin = choose(scores, c)
    assert set(experts[0].tolist()) == {0, 1} == deepseek_v3_choice(scores, 4, 2, 2)[0]
    # expert margin: (0.7 - 0.6) / 2 = 0.05; group margin: (1.0 - 0.9) / 4 = 0.025
    assert torch.allclose(margin, torch.tensor([0.025]))
    # and where the groups are far apart the experts' half gap is the margin
    far = torch.tensor([[0.9, 0.7, 0.6, 0.4, 0.1, 0.1, 0.1, 0.1]])
    assert torch.allclose(choose(far, c)[1], torch.tensor([0.05]))


def test_every_group_kept_is_the_plain_top_k_with_no_group_margin():
    c = SIGMOID.replace(n_experts=8, n_groups=2, topk_groups=2, top_k=3)
    scores = torch.rand(50, 8, generator=torch.Generator().manual_seed(4))
    experts, margin = choose(scores, c)
    plain, plain_margin = choose(scores, SIGMOID.replace(top_k=3))
    assert torch.equal(experts, plain) and torch.equal(margin, plain_margin)
    assert [set(x) for x in experts.tolist()] == deepseek_v3_choice(scores, 2, 2, 3)


@pytest.mark.parametrize("changes", [
    {"n_experts": 4, "top_k": 4},
    {"n_experts": 1, "top_k": 1},  # one expert: no group of two to score, nothing to flip
    {"n_experts": 4, "top_k": 4, "n_groups": 2, "topk_groups": 2},
])
def test_a_top_k_of_every_expert_chooses_them_all_and_can_never_flip(changes):
    c = SIGMOID.replace(**changes)
    scores = torch.rand(5, c.n_experts, generator=torch.Generator().manual_seed(5))
    experts, margin = choose(scores, c)
    assert [sorted(x) for x in experts.tolist()] == [list(range(c.n_experts))] * 5
    assert margin.tolist() == [math.inf] * 5


def test_sigmoid_weights_keep_deepseeks_epsilon_where_every_chosen_sigmoid_underflows():
    # DeepseekV3TopkRouter.forward: topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    logits = torch.tensor([[-80.0, -81.0, 3.0, -100.0],  # sigmoids ~1e-35: far below 1e-20
                           [-200.0, -300.0, 2.0, -250.0],  # sigmoids exactly 0
                           [0.5, -0.5, 1.0, 2.0]])
    chosen = torch.tensor([[0, 1], [0, 3], [2, 3]])
    c = SIGMOID.replace(n_experts=4)
    s = logits.sigmoid().gather(1, chosen)
    assert s[1].tolist() == [0.0, 0.0] and 0 < float(s[0, 0]) < 1e-34
    w = gate_weights(logits, chosen, c)
    assert torch.equal(w, s / (s.sum(dim=-1, keepdim=True) + 1e-20))
    assert w[1].tolist() == [0.0, 0.0]  # not 0 / 0
    assert bool((w[0] > 0).all()) and bool((w[0] < 1e-14).all())  # not 1/2 each, nor < 0
    # Qwen3MoeTopKRouter: router_top_value /= router_top_value.sum(dim=-1, keepdim=True), on
    # its top-k (whose sum is at least k / E: no epsilon needed)
    p, top = torch.softmax(logits, dim=-1).topk(2, dim=-1)
    assert torch.equal(gate_weights(logits, top, SOFTMAX.replace(n_experts=4)),
                       p / p.sum(dim=-1, keepdim=True))


def _routing(scores: list[list[float]]) -> Routing:
    s = torch.tensor(scores)
    return Routing(torch.zeros(len(scores), 1, dtype=torch.long), s, torch.zeros(len(scores)))


def test_the_score_deviation_is_the_largest_change_over_every_layer_and_rank():
    reference = {0: _routing([[0.5, 0.25]]), 3: _routing([[0.125, 0.5]])}
    own = {0: [_routing([[0.5, 0.25]]), _routing([[0.5, 0.3125]])],  # rank 1: +0.0625
           3: [_routing([[0.0, 0.5]]), _routing([[0.125, 0.5]])]}  # rank 0: -0.125
    assert score_deviation(own, reference) == 0.125
    assert score_deviation({3: own[3][1:]}, reference) == 0.0
    assert score_deviation({}, {}) == 0.0  # a dense model

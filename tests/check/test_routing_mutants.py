"""``check.routing`` (issue 30, the mutation pass over ``check/routing.py``): where a
selection bias hides from the forward (it moves no token's choice, or only near-tied ones the
routing check gives the reference's), a choice compared as a set, and the experts an
unrouted-only change names. ``test_routing.py`` has the expert-weight rule."""

from __future__ import annotations

import math

import pytest
import torch

from tests.sync.conftest import MOE_FEW
from weight_sync_bench.check import routing
from weight_sync_bench.check.convert import conversion_checker
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.mutations import MUTATIONS, Conversion
from weight_sync_bench.model.sharded import RoutingGuard

# DeepSeek-V3's selection bias; 4 tokens, top-2 of 8 experts, 2 MoE layers
DS = MOE_FEW.replace(name="ds_few", router="sigmoid", router_bias=True)
HF = endpoint("hf")
BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"
NO_MOVE = "the selection bias it leaves moves no token's choice of experts on these tokens"


def checker_at(bound):
    """A checker of DS whose routing guard keeps the reference's choice within ``bound``."""
    checker = conversion_checker(DS, threshold=1.0)
    guard = checker.checker.guard
    checker.checker.guard = RoutingGuard(guard.routings, bound)
    return checker


def biased(checker, experts, by):
    """The declared HF shards with every layer's selection bias moved by ``by`` on
    ``experts``."""
    shards = [{n: t.clone() for n, t in rank.items()} for rank in checker.declared(HF)]
    for layer in range(DS.n_layers):
        shards[0][BIAS.format(layer)][list(experts)] += by
    return shards


def chosen(checker):
    return {layer: {e for row in r.experts.tolist() for e in row}
            for layer, r in checker.checker.guard.routings.items()}


def test_a_bias_that_moves_no_choice_hides_from_the_forward_and_says_so():
    checker = checker_at(math.inf)  # every token near-tied: none moved, none to count
    unchosen = set(range(DS.n_experts)) - set().union(*chosen(checker).values())
    assert unchosen  # an expert no token takes at any layer
    shards = biased(checker, sorted(unchosen)[:1], -100.0)  # made less likely still
    conversion = Conversion(DS, HF, HF)
    assert routing.selection_unchanged(checker, conversion, shards) == NO_MOVE
    bias = MUTATIONS["router_bias_not_synced"]
    assert routing.forward_unchanged(checker, conversion, bias, shards) == NO_MOVE
    assert routing.selection_unchanged(checker, conversion, checker.declared(HF)) == NO_MOVE


def test_a_bias_that_moves_choices_is_seen_unless_every_move_is_near_tied():
    every = DS.batch * DS.seq_len * DS.n_layers
    conversion = Conversion(DS, HF, HF)
    far = checker_at(0.0)
    shards = biased(far, [0, 1], 100.0)  # every token takes experts 0 and 1
    assert not any({0, 1} == set(row) for r in far.checker.guard.routings.values()
                   for row in r.experts.tolist())  # no reference choice was {0, 1}
    assert routing.selection_unchanged(far, conversion, shards) is None
    near = checker_at(math.inf)
    assert routing.selection_unchanged(near, conversion, biased(near, [0, 1], 100.0)) == (
        NO_MOVE + f" but {every} near-tied, where the routing check keeps the reference's")


def test_a_choice_is_compared_as_a_set_per_token():
    experts = torch.tensor([[1, 3], [2, 0], [5, 4]])
    before = torch.tensor([[3, 1], [0, 1], [5, 4]])
    assert torch.equal(routing._moved(experts, before), torch.tensor([False, True, False]))


def test_an_unrouted_only_change_names_every_expert_it_changes_at_each_layer():
    checker = conversion_checker(DS, threshold=1.0)
    idle = sorted(set(range(DS.n_experts)) - chosen(checker)[0])[:2]
    shards = [{n: t.clone() for n, t in rank.items()} for rank in checker.declared(HF)]
    for e in idle:
        shards[0][f"model.layers.0.mlp.experts.{e}.down_proj.weight"] += 1.0
    assert routing.unrouted_only(checker, Conversion(DS, HF, HF), shards) == (
        "it changes only experts no token is routed to on these tokens "
        f"(layer 0: {idle[0]}, {idle[1]})")


def test_a_dense_models_forward_reads_everything_it_is_given():
    from tests.sync.conftest import tiny

    dense = tiny(2, n_layers=1)
    checker = conversion_checker(dense, threshold=1.0)
    shards = checker.declared(HF)
    for mutation in ("router_bias_not_synced", "expert_bucket_not_sent"):
        assert routing.forward_unchanged(checker, Conversion(dense, HF, HF),
                                         MUTATIONS[mutation], shards) is None


@pytest.mark.parametrize("by", [0.0, 100.0])
def test_a_selection_mutation_is_judged_by_its_bias_an_expert_one_by_its_experts(by):
    checker = checker_at(0.0)
    shards = biased(checker, [0, 1], by)
    conversion = Conversion(DS, HF, HF)
    got = routing.forward_unchanged(checker, conversion, MUTATIONS["router_bias_not_synced"],
                                    shards)
    assert got == (NO_MOVE if by == 0.0 else None)
    # an expert-weight mutation reads the experts: a bias change is outside them
    expert = routing.forward_unchanged(checker, conversion,
                                       MUTATIONS["expert_bucket_not_sent"], shards)
    assert expert is None


@pytest.mark.parametrize("name,row", [("w13_weight", 11), ("w2_weight", 5)])
def test_a_change_in_a_tensor_of_every_expert_names_the_expert_it_is_in(name, row):
    """vLLM stores a layer's experts in one tensor (``w13_weight [E, 2F, d]``, ``w2_weight
    [E, d, F]``): the element changed is found in its expert's rows, not another's."""
    checker = conversion_checker(DS, threshold=1.0)
    vllm = endpoint("vllm:1")
    idle = max(set(range(DS.n_experts)) - chosen(checker)[1])
    shards = [{n: t.clone() for n, t in rank.items()} for rank in checker.declared(vllm)]
    tensor = next(t for n, t in shards[0].items()
                  if n.endswith(name) and ".layers.1." in n)
    tensor[idle, row, 3] += 1.0
    assert routing.unrouted_only(checker, Conversion(DS, HF, vllm), shards) == (
        f"it changes only experts no token is routed to on these tokens (layer 1: {idle})")


def test_a_selection_bias_is_judged_alone_whatever_else_the_destination_holds():
    """Only the bias is taken from the destination: a change elsewhere (here every expert of
    layer 0 scaled, which moves layer 1's choices) is the byte check's and the forward's,
    not a move of the selection bias."""
    checker = checker_at(0.0)
    shards = [{n: t.clone() for n, t in rank.items()} for rank in checker.declared(HF)]
    for e in range(DS.n_experts):
        shards[0][f"model.layers.0.mlp.experts.{e}.down_proj.weight"] *= 1000.0
    assert routing.selection_unchanged(checker, Conversion(DS, HF, HF), shards) == NO_MOVE

"""``conventions.stages`` (issue 30, the mutation pass over ``conventions/stages.py``):
Megatron's pipeline split. ``test_stages.py`` checks every accepted split against a
sequential fill; this file pins what it does not: the exact text of each refusal, which rule
refuses each split of the grid (so a rule that refuses too much is seen, not only one that
refuses too little), a split's description and where a layer lives."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from weight_sync_bench.conventions.stages import Pipeline
from weight_sync_bench.errors import UnsupportedConvention

NEEDS = "megatron: decoder.layers needs "


def refusal(pipeline, n_layers):
    with pytest.raises(UnsupportedConvention) as exc:
        pipeline.chunks(n_layers)
    return str(exc.value)


@pytest.mark.parametrize("pipeline, n_layers, message", [
    (Pipeline(4), 30, "num_layers divisible by pp (Megatron-Core asserts it; older versions "
     "built 7 per stage, 28 in all, losing 2: Megatron-LM #1304) (pp=4, num_layers=30: "
     "30 % 4 = 2)"),
    (Pipeline(4, embedding=True), 8, "num_layers (embedding and loss counted) divisible by pp "
     "(Megatron-Core asserts it; older versions built 2 per stage, 8 in all, losing 1: "
     "Megatron-LM #1304) (pp=4, embedding counted, num_layers=8: 9 % 4 = 1)"),
    (Pipeline(2, 4), 12, "each stage's layers divisible by vpp (pp=2, vpp=4, num_layers=12: "
     "6 per stage)"),
    (Pipeline(1, 2), 8, "pp > 1 for virtual stages (they interleave pipeline ranks) (pp=1, "
     "vpp=2, num_layers=8)"),
    (Pipeline(1, first=2), 8, "pp > 1 for an uneven first or last stage (pp=1, pp_first=2, "
     "num_layers=8)"),
    (Pipeline(4, first=2, embedding=True), 8, "uneven first/last stages or the embedding/loss "
     "counted as a layer, not both (TransformerConfig) (pp=4, pp_first=2, embedding counted, "
     "num_layers=8)"),
    (Pipeline(4, 2, first=3), 11, "num_layers_in_first_pipeline_stage divisible by vpp (pp=4, "
     "vpp=2, pp_first=3, num_layers=11)"),
    (Pipeline(4, 2, last=3), 11, "num_layers_in_last_pipeline_stage divisible by vpp (pp=4, "
     "vpp=2, pp_last=3, num_layers=11)"),
    (Pipeline(4, first=2), 9, "the middle layers divisible by the middle stages (pp=4, "
     "pp_first=2, num_layers=9: 7 layers over 3 stages)"),
    (Pipeline(4, 2, first=2), 5, "each middle stage's layers divisible by vpp (pp=4, vpp=2, "
     "pp_first=2, num_layers=5: 1 per stage)"),
    (Pipeline(2, first=3, last=3), 8, "middle layers exactly where there are middle stages "
     "(pp=2, pp_first=3, pp_last=3, num_layers=8: 2 middle layers, 0 middle stages)"),
    (Pipeline(2, 2, first=2, last=2), 4, "a middle stage when both first and last stages are "
     "set with vpp > 1 (get_transformer_layer_offset divides by the middle stages) (pp=2, "
     "vpp=2, pp_first=2, pp_last=2, num_layers=4)"),
    (Pipeline(3, first=6, last=6), 8, "the first and last stages to hold at most num_layers "
     "(pp=3, pp_first=6, pp_last=6, num_layers=8)"),
    (Pipeline(0), 4, "pp a positive int (pp=0, num_layers=4)"),
    (Pipeline(2, 0), 4, "vpp a positive int (pp=2, vpp=0, num_layers=4)"),
    (Pipeline(True), 4, "pp a positive int (pp=True, num_layers=4)"),
    (Pipeline(2.0), 4, "pp a positive int (pp=2.0, num_layers=4)"),
    (Pipeline(2, first=-2), 4, "num_layers_in_first/last_pipeline_stage larger than 0 (pp=2, "
     "pp_first=-2, num_layers=4)"),
    (Pipeline(2, embedding=True), -1, "a layer for the embedding/loss to stand in for (pp=2, "
     "embedding counted, num_layers=-1)"),
    (Pipeline(1, embedding=True, loss=True), -1, "a layer for the embedding/loss to stand in "
     "for (pp=1, embedding counted, loss counted, num_layers=-1)"),
])
def test_each_refusal_says_the_rule_and_the_numbers(pipeline, n_layers, message):
    assert refusal(pipeline, n_layers) == NEEDS + message


GRID = itertools.product(range(1, 17), (1, 2, 3, 4), (1, 2, 4), (0, 1, 2, 4), (0, 1, 2, 4),
                         (False, True), (False, True))


def test_each_split_of_the_grid_is_refused_by_the_rule_megatron_states_and_no_other():
    """Over test_stages.py's grid: how many splits each rule refuses, the first rule broken
    naming it, and how many are accepted. A rule that refused too much would move these."""
    refused, accepted = Counter(), 0
    for n, pp, vpp, first, last, embedding, loss in GRID:
        try:
            Pipeline(pp, vpp, first, last, embedding, loss).chunks(n)
            accepted += 1
        except UnsupportedConvention as exc:
            text = str(exc)
            refused[re.sub(r"\d+", "N", text[len(NEEDS):text.rindex(" (")])] += 1
    assert accepted == 578
    assert refused == {
        "a middle stage when both first and last stages are set with vpp > N "
        "(get_transformer_layer_offset divides by the middle stages)": 5,
        "each middle stage's layers divisible by vpp": 122,
        "each stage's layers divisible by vpp": 89,
        "middle layers exactly where there are middle stages": 214,
        "num_layers (embedding and loss counted) divisible by pp (Megatron-Core asserts it; "
        "older versions built N per stage, N in all, losing N: Megatron-LM #N)": 276,
        "num_layers divisible by pp (Megatron-Core asserts it; older versions built N per "
        "stage, N in all, losing N: Megatron-LM #N)": 93,
        "num_layers_in_first_pipeline_stage divisible by vpp": 576,
        "num_layers_in_last_pipeline_stage divisible by vpp": 336,
        "pp > N for an uneven first or last stage": 960,
        "pp > N for virtual stages (they interleave pipeline ranks)": 2048,
        "the first and last stages to hold at most num_layers": 246,
        "the middle layers divisible by the middle stages": 265,
        "uneven first/last stages or the embedding/loss counted as a layer, not both "
        "(TransformerConfig)": 6480}


def test_edge_splits_megatron_accepts():
    assert [[list(c) for c in s] for s in Pipeline(2, 2, embedding=True, loss=True).chunks(2)] \
        == [[[], [1]], [[0], []]]  # the embedding and the loss each stand in for a layer
    assert [[list(c) for c in s] for s in Pipeline(1, embedding=True, loss=True).chunks(1)] \
        == [[[0]]]
    assert [[list(c) for c in s] for s in Pipeline(4, 2, first=2, last=2).chunks(12)] == [
        [[0], [6]], [[1, 2], [7, 8]], [[3, 4], [9, 10]], [[5], [11]]]
    assert [[list(c) for c in s] for s in Pipeline(4, 2, embedding=True).chunks(7)] == [
        [[], [3]], [[0], [4]], [[1], [5]], [[2], [6]]]


def test_a_split_describes_itself_by_what_is_set():
    assert str(Pipeline()) == "pp=1"
    assert str(Pipeline(2, 2, 1, 3, True, True)) == (
        "pp=2, vpp=2, pp_first=1, pp_last=3, embedding counted, loss counted")
    assert str(Pipeline(4, last=2)) == "pp=4, pp_last=2"
    assert str(Pipeline(2, loss=True)) == "pp=2, loss counted"


def test_where_a_layer_lives():
    assert Pipeline(2, 2).where(8, 5) == (0, 1, 1)
    assert Pipeline(2, 2).where(8, 0) == (0, 0, 0)
    assert Pipeline(2, 2).where(8, 7) == (1, 1, 1)
    with pytest.raises(ValueError) as exc:
        Pipeline(2).where(4, 9)
    assert str(exc.value) == "layer 9 of 4"

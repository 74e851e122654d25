"""Megatron's pipeline stage assignment (``conventions.stages``) against values computed
independently: a sequential fill of the chunks in interleaved order (virtual stage major,
pipeline rank minor) with the per-chunk counts, the embedding and loss taking the first and
last slot where counted, and hand tables from Megatron-Core's own comments and issues."""

from __future__ import annotations

import itertools

import pytest

from weight_sync_bench.conventions.stages import Pipeline
from weight_sync_bench.errors import UnsupportedConvention


def filled(n_layers, pp, vpp, first, last, embedding, loss):
    """Each chunk's layers by filling slots in Megatron's execution order: chunk v of every
    rank before chunk v + 1; written from the schedule, not from the offset formula."""
    if first or last:
        ranks = pp - bool(first) - bool(last)
        middle = (n_layers - first - last) // ranks if ranks else 0
        per_rank = [first if p == 0 and first else last if p == pp - 1 and last else middle
                    for p in range(pp)]
        sizes = {(p, v): per_rank[p] // vpp for p in range(pp) for v in range(vpp)}
    else:
        size = (n_layers + embedding + loss) // (pp * vpp)
        sizes = {(p, v): size for p in range(pp) for v in range(vpp)}
    slots = (["E"] if embedding else []) + list(range(n_layers)) + (["L"] if loss else [])
    out = [[None] * vpp for _ in range(pp)]
    at = 0
    for v in range(vpp):
        for p in range(pp):
            out[p][v] = [s for s in slots[at:at + sizes[p, v]] if s not in ("E", "L")]
            at += sizes[p, v]
    assert at == len(slots)
    return out


def as_lists(chunks):
    return [[list(chunk) for chunk in stage] for stage in chunks]


GRID = [dict(n_layers=n, pp=pp, vpp=vpp, first=f, last=la, embedding=e, loss=lo)
        for n, pp, vpp, f, la, e, lo in itertools.product(
            range(1, 17), (1, 2, 3, 4), (1, 2, 4), (0, 1, 2, 4), (0, 1, 2, 4), (False, True),
            (False, True))]


def branch(case):
    kind = "uneven" if case["first"] or case["last"] else (
        "counted" if case["embedding"] or case["loss"] else "even")
    return kind + (" vpp" if case["vpp"] > 1 else "")


def test_every_split_megatron_accepts_is_the_sequential_fill():
    seen = {}
    for case in GRID:
        pipeline = Pipeline(case["pp"], case["vpp"], case["first"], case["last"],
                            case["embedding"], case["loss"])
        try:
            chunks = pipeline.chunks(case["n_layers"])
        except UnsupportedConvention:
            continue
        assert as_lists(chunks) == filled(**case), case
        seen[branch(case)] = seen.get(branch(case), 0) + 1
    # every branch of get_num_layers_to_build / get_transformer_layer_offset is exercised
    assert set(seen) == {"even", "even vpp", "counted", "counted vpp", "uneven", "uneven vpp"}
    assert min(seen.values()) >= 5, seen


@pytest.mark.parametrize(("pipeline", "n_layers", "expected"), [
    # transformer_block.py's comments: 8 layers, 2 stages, 4 and 2 model chunks
    (Pipeline(2, 4), 8, [[[0], [2], [4], [6]], [[1], [3], [5], [7]]]),
    (Pipeline(2, 2), 8, [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
    (Pipeline(4), 8, [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]),
    # uneven: one layer first, three last, the middle six over two stages
    (Pipeline(4, first=1, last=3), 10, [[[0]], [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]),
    # only the last stage's size set, with virtual stages (Megatron-LM #1584 / PR #1583)
    (Pipeline(3, 2, last=2), 10, [[[0, 1], [5, 6]], [[2, 3], [7, 8]], [[4], [9]]]),
    (Pipeline(2, 2, first=2), 6, [[[0], [3]], [[1, 2], [4, 5]]]),
    # the embedding / the loss counted as a layer
    (Pipeline(4, embedding=True), 7, [[[0]], [[1, 2]], [[3, 4]], [[5, 6]]]),
    (Pipeline(4, loss=True), 7, [[[0, 1]], [[2, 3]], [[4, 5]], [[6]]]),
    (Pipeline(4, embedding=True, loss=True), 6, [[[0]], [[1, 2]], [[3, 4]], [[5]]]),
    (Pipeline(2, 2, embedding=True), 7, [[[0], [3, 4]], [[1, 2], [5, 6]]]),
])
def test_hand_tables(pipeline, n_layers, expected):
    assert as_lists(pipeline.chunks(n_layers)) == expected
    layer = expected[-1][-1][-1]
    p, v, local = pipeline.where(n_layers, layer)
    assert (p, v) == (len(expected) - 1, len(expected[-1]) - 1)
    assert local == len(expected[-1][-1]) - 1


@pytest.mark.parametrize(("pipeline", "n_layers", "match"), [
    (Pipeline(4), 30, r"divisible by pp .*built 7 per stage, 28 in all, losing 2: "
                      r"Megatron-LM #1304.*30 % 4 = 2"),
    (Pipeline(4, embedding=True), 8, r"embedding and loss counted.*9 % 4 = 1"),
    (Pipeline(2, 4), 12, r"each stage's layers divisible by vpp.*6 per stage"),
    (Pipeline(1, 2), 8, r"pp > 1 for virtual stages"),
    (Pipeline(1, first=2), 8, r"pp > 1 for an uneven"),
    (Pipeline(4, first=2, embedding=True), 8, r"not both"),
    (Pipeline(4, 2, first=3), 11, r"num_layers_in_first_pipeline_stage divisible by vpp"),
    (Pipeline(4, first=2), 9, r"middle layers divisible by the middle stages.*7 layers over 3"),
    (Pipeline(2, first=3, last=3), 8, r"middle layers exactly where there are middle stages"),
    (Pipeline(2, 2, first=2, last=2), 4, r"divides by the middle stages"),
    (Pipeline(3, first=6, last=6), 8, r"at most num_layers"),
])
def test_what_megatron_rejects_is_refused_with_its_rule(pipeline, n_layers, match):
    with pytest.raises(UnsupportedConvention, match=match):
        pipeline.chunks(n_layers)


def test_the_refused_splits_are_the_ones_the_fill_cannot_make():
    # the twin of the refusals: a split the fill makes with every layer once is accepted
    # unless one of Megatron's own rules (not the harness's arithmetic) forbids it
    accepted = 0
    for case in GRID:
        pipeline = Pipeline(case["pp"], case["vpp"], case["first"], case["last"],
                            case["embedding"], case["loss"])
        try:
            pipeline.chunks(case["n_layers"])
            accepted += 1
        except UnsupportedConvention as e:
            assert "every layer on exactly one stage" not in str(e), (case, e)
    assert accepted > 100

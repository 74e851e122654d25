"""``conventions.staging`` (issue 30, the mutation pass over ``conventions/staging.py``): which
stage holds what, from the stage arithmetic alone, agreeing with what each rank stores;
a rank described in words a verdict shows; a staged endpoint's shards read back as its
unstaged one's. What a staged conversion checks is ``test_pipeline.py``'s."""

from __future__ import annotations

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.staging import (
    describe_rank,
    stage_holds,
    staged,
    unstage,
)
from weight_sync_bench.model.config import init_params

ENDS = ["megatron:tp=2,pp=2", "megatron:tp=1,pp=2,vpp=2", "megatron:tp=1,pp=2,pp_first=1",
        "megatron:tp=1,pp=4"]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("at", ENDS)
def test_what_a_stage_holds_by_arithmetic_is_what_its_ranks_store(at, tied):
    config, where = tiny(2, n_layers=4, tie_embeddings=tied), endpoint(at)
    layout = staged(config, where)
    for stage in range(where.pp):
        stored = {p.source for rank, pieces in enumerate(layout.pieces)
                  if layout.stage_of(rank) == stage for p in pieces.values()}
        for source in config.param_shapes():
            assert stage_holds(config, where, source, stage) == (source in stored), (
                stage, source)


def test_the_embedding_is_on_the_first_stage_the_head_on_the_last_a_tied_copy_on_both():
    where = endpoint("megatron:tp=1,pp=2")
    untied, tied = tiny(2, n_layers=2), tiny(2, n_layers=2, tie_embeddings=True)
    assert [stage_holds(untied, where, "tok_embeddings.weight", s) for s in (0, 1)] == [
        True, False]
    assert [stage_holds(tied, where, "tok_embeddings.weight", s) for s in (0, 1)] == [
        True, True]
    assert [stage_holds(untied, where, "norm.weight", s) for s in (0, 1)] == [False, True]
    assert [stage_holds(untied, where, "layers.1.qkv.weight", s) for s in (0, 1)] == [
        False, True]


@pytest.mark.parametrize("at,layers,said", [
    ("megatron:tp=2,pp=2", 4, ["rank 0 is pipeline stage 0 of 2: global layers 0-1 as local 0-1",
                               "rank 1 is pipeline stage 0 of 2: global layers 0-1 as local 0-1",
                               "rank 2 is pipeline stage 1 of 2: global layers 2-3 as local 0-1",
                               "rank 3 is pipeline stage 1 of 2: global layers 2-3 as local 0-1"]),
    ("megatron:tp=1,pp=2,vpp=2", 4, [
        "rank 0 is pipeline stage 0 of 2: chunk 0 (model0.) global layer 0 as local 0; "
        "chunk 1 (model1.) global layer 2 as local 0",
        "rank 1 is pipeline stage 1 of 2: chunk 0 (model0.) global layer 1 as local 0; "
        "chunk 1 (model1.) global layer 3 as local 0"]),
    ("megatron:tp=1,pp=2,pp_account=embedding", 1, [
        "rank 0 is pipeline stage 0 of 2: no layers",
        "rank 1 is pipeline stage 1 of 2: global layer 0 as local 0"]),
])
def test_a_rank_is_described_by_its_stage_and_its_layers_global_and_local(at, layers, said):
    config, where = tiny(2, n_layers=layers), endpoint(at)
    assert [describe_rank(config, where, r) for r in range(where.world)] == said


@pytest.mark.parametrize("at", ENDS)
def test_a_staged_endpoints_shards_read_back_as_its_unstaged_ones(at):
    config, where = tiny(2, n_layers=4), endpoint(at)
    params = init_params(config, 0)
    back = unstage(materialize(where.pieces(config), params), config, where)
    flat = materialize(where.unstaged().pieces(config), params)
    assert len(back) == len(flat) == where.world // where.pp
    for mine, want in zip(back, flat):
        assert mine.keys() == want.keys()
        assert all(torch.equal(mine[n], want[n]) for n in want)

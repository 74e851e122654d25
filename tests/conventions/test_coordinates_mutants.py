"""``conventions.coordinates.rank_coordinates`` (issue 30, the mutation pass over
``conventions/coordinates.py``): where each rank of an endpoint sits, as a converter reads it:
its stage, its attention TP rank and data-parallel replica, its experts' ranks and ids, the
global layers of its chunks."""

from __future__ import annotations

import pytest

from tests.sync.conftest import MOE_FEW as MOE
from tests.sync.conftest import tiny
from weight_sync_bench.conventions import endpoint, rank_coordinates


def coordinates(config, at):
    where = endpoint(at)
    return [rank_coordinates(config, where, r) for r in range(where.world)]


def test_a_dense_tp_endpoints_ranks_are_one_tp_group_holding_every_layer():
    config = tiny(2, n_layers=3)
    got = coordinates(config, "vllm:2")
    assert [(c.rank, c.pp, c.tp, c.dp, c.ep, c.etp, c.edp) for c in got] == [
        (0, 0, 0, 0, 0, 0, 0), (1, 0, 1, 0, 0, 0, 0)]
    assert all(c.layers == ((0, 1, 2),) and c.experts == () for c in got)


def test_a_staged_endpoints_ranks_count_the_stage_slowest_and_tp_fastest():
    config = tiny(2, n_layers=4)
    got = coordinates(config, "megatron:tp=2,pp=2")
    assert [(c.pp, c.tp, c.dp) for c in got] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [c.layers for c in got] == [((0, 1),), ((0, 1),), ((2, 3),), ((2, 3),)]
    vpp = coordinates(config, "megatron:tp=1,pp=2,vpp=2")
    assert [c.layers for c in vpp] == [((0,), (2,)), ((1,), (3,))]


def test_an_moe_endpoints_ranks_hold_their_experts_with_attention_replicas_counted():
    got = coordinates(MOE, "megatron:tp=2,ep=4")  # 8 ranks: 4 replicas of attention TP 2
    assert [(c.tp, c.dp) for c in got] == [(r % 2, r // 2) for r in range(8)]
    held = [e for c in got if c.etp == 0 and c.edp == 0 for e in c.experts]
    assert sorted(held) == list(range(MOE.n_experts))  # every expert once, over the EP group
    assert all(len(c.experts) == MOE.n_experts // 4 for c in got)
    vllm = coordinates(MOE, "vllm:tp=4,ep=4")
    assert [(c.tp, c.dp, c.ep) for c in vllm] == [(r, 0, r) for r in range(4)]
    assert [c.experts for c in vllm] == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("rank", [-1, 2])
def test_a_rank_outside_the_endpoint_is_refused_naming_its_ranks(rank):
    with pytest.raises(ValueError, match=rf"^vllm:2 has ranks 0\.\.1, not {rank}$"):
        rank_coordinates(tiny(2, n_layers=1), endpoint("vllm:2"), rank)

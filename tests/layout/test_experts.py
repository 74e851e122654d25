"""The ``Experts`` and ``DataParallel`` placements: which experts and which chunk of each every
rank holds, against the frameworks' own arithmetic written out here (Megatron-Core's rank
generators, vLLM's ``determine_expert_map``), and an exact split / gather round trip."""

from __future__ import annotations

import re

import pytest
import torch

from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.layout.placements import DataParallel, Experts, FusedPaired, Shard
from weight_sync_bench.layout.reshard import gather_tensor, reshard_tensor, split_tensor
from weight_sync_bench.layout.table import ShardSpec


def _vllm_expert_map(e: int, ep_size: int, ep_rank: int, strategy: str) -> list[int]:
    """vLLM 0.33.0 ``expert_map_manager.py::determine_expert_map``, the global ids a rank holds
    in local order (its expert_map inverted)."""
    base, remainder = e // ep_size, e % ep_size
    local = base + 1 if ep_rank < remainder else base
    if strategy == "linear":
        start = ep_rank * base + min(ep_rank, remainder)
        return list(range(start, start + local))
    return list(range(ep_rank, e, ep_size))


@pytest.mark.parametrize("e, ep", [(8, 4), (10, 4), (60, 8), (6, 8), (128, 8)])
@pytest.mark.parametrize("order", ["linear", "round_robin"])
def test_vllms_expert_maps(e, ep, order):
    p = Experts(e, (2,), ep=ep, etp=1, order=order)
    assert [p.experts_of(r) for r in range(ep)] == [_vllm_expert_map(e, ep, r, order)
                                                    for r in range(ep)]
    assert sorted(x for r in range(ep) for x in p.experts_of(r)) == list(range(e))


def test_linear_gives_the_remainder_to_the_first_ranks():
    assert [Experts(10, (2,), ep=4, etp=1, order="linear").experts_of(r) for r in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


# Megatron-Core RankGenerator (order "tp-cp-ep-dp-pp"), run on CPU over 8 ranks (research
# notes section 2.6): tp=2, ep=4 (etp defaults to 2): ep_rank = g // 2, etp_rank = g % 2;
# tp=2, ep=4, etp=1: ep_rank = g % 4, expert-DP = g // 4.
@pytest.mark.parametrize("etp, expected", [
    (2, [(g % 2, g // 2, 0) for g in range(8)]),
    (1, [(0, g % 4, g // 4) for g in range(8)]),
])
def test_megatron_rank_order(etp, expected):
    p = Experts(8, (4, 4), ep=4, etp=etp)
    assert [p.coordinates(8, g) for g in range(8)] == expected
    assert p.replicas(8) == 8 // (4 * etp)


def test_a_ranks_ranges_are_its_experts_chunks_of_each_block():
    p = Experts(4, (4, 4), ep=2, etp=2)  # [gate | up] of 4 rows each, 4 experts
    # rank 3: etp 1, ep 1 -> experts 2, 3; the second half of gate and of up of each
    assert p.coordinates(4, 3) == (1, 1, 0)
    spec = ShardSpec("x", (32, 3), p)
    assert spec.ranges(4, 3) == (0, [(18, 20), (22, 24), (26, 28), (30, 32)])
    down = ShardSpec("d", (3, 16), Experts(4, (4,), dim=1, ep=2, etp=2))
    assert down.ranges(4, 0) == (1, [(0, 2), (4, 6)])


@pytest.mark.parametrize("placement, degree", [
    (Experts(8, (4, 4)), 2), (Experts(8, (4, 4), ep=2, etp=1), 2),
    (Experts(8, (4, 4), ep=2, etp=1), 4),  # expert-DP 2
    (Experts(6, (2, 2), ep=4, etp=1, order="linear"), 4),  # uneven: 2, 2, 1, 1
    (Experts(3, (2, 2), ep=4, etp=1, order="linear"), 4),  # a rank holds no expert
    (Experts(8, (4, 4), ep=2, etp=2, order="round_robin"), 4),
])
def test_split_then_gather_is_exact_and_reshard_is_split(placement, degree):
    shape = (placement.n_experts * placement.width, 3)
    x = torch.randn(shape)
    spec = ShardSpec("x", shape, placement)
    shards = split_tensor(x, spec, degree)
    assert [tuple(s.shape) for s in shards] == [spec.local_shape(degree, r)
                                                for r in range(degree)]
    assert torch.equal(gather_tensor(shards, spec), x)
    plain = ShardSpec("x", shape, Experts(placement.n_experts, placement.blocks))
    for src in (1, 2):
        moved = reshard_tensor(split_tensor(x, spec, degree), spec, degree)
        assert all(torch.equal(a, b) for a, b in zip(moved, shards))
        assert torch.equal(gather_tensor(split_tensor(x, plain, src), plain), x)


@pytest.mark.parametrize("placement, degree, rule", [
    (Experts(8, (4, 4), ep=3, etp=1), 3, "n_experts % ep == 0 (contiguous experts) "
                                         "(n_experts=8, ep=3, t=3)"),
    (Experts(8, (4, 4), ep=2), 3, "t % ep == 0 (ep=2, t=3)"),
    (Experts(8, (5, 3), ep=1, etp=2), 2, "each block % etp == 0"),
    (Experts(8, (4, 4), ep=2, etp=2), 2, "t % (ep * etp) == 0 (ep=2, etp=2, t=2)"),
    (Experts(8, (4, 4), order="random"), 2, "order in ('contiguous', 'linear', 'round_robin')"),
    (Experts(7, (4, 4)), 1, "shape[0] == n_experts * sum(blocks)"),
])
def test_an_expert_split_that_cannot_be_made_names_its_rule(placement, degree, rule):
    with pytest.raises(UnsupportedLayout, match=re.escape(rule)):
        ShardSpec("x", (64, 3), placement).validate(degree)


def test_data_parallel_repeats_the_tp_groups_split():
    spec = ShardSpec("x", (8, 3), DataParallel(FusedPaired(4, 4), 2))
    assert [spec.ranges(6, r) for r in range(6)] == [
        (0, [(0, 2), (4, 6)]), (0, [(2, 4), (6, 8)])] * 3
    with pytest.raises(UnsupportedLayout, match=re.escape("t % tp == 0 (tp=2, t=3)")):
        spec.validate(3)
    assert str(DataParallel(Shard(1), 4)) == "S(1)@tp4"

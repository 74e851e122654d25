"""The mutation layer: shapes preserved, inputs untouched, identities declared truthfully,
and each new bug class doing what its name says on a case small enough to read."""

import pytest
import torch

from weight_sync_bench.check.checker import Checker
from weight_sync_bench.check.diagnosis import locate
from weight_sync_bench.check.mutations import (
    BUG_CLASS_MUTATIONS,
    MUTATIONS,
    SEED_MUTATIONS,
    interleaved_qkv_order,
    mutation_by_name,
)
from weight_sync_bench.errors import UnknownMutation
from weight_sync_bench.fuzz.domain import DOMAIN, fuzz_params
from weight_sync_bench.layout.reshard import split

# n_kv_heads 2 (degrees 1, 2), and n_kv_heads 4 (degrees 1, 2, 4); head_dim 2, tiny widths
KV2 = DOMAIN.config(n_kv_heads=2, group=2, head_dim=2, d_model=8, ffn_per_kv_head=2,
                    vocab_per_kv_head=8, n_layers=1, batch=1, seq_len=2)
KV4 = KV2.replace(n_kv_heads=4, n_heads=8, ffn=8, vocab=32)
KV1 = KV2.replace(n_kv_heads=1, n_heads=2, ffn=2, vocab=8)  # only t=1


@pytest.fixture(scope="module")
def checkers():
    return {c.n_kv_heads: Checker(c, threshold=1.0, params=fuzz_params(c, 0))
            for c in (KV1, KV2, KV4)}


def test_at_least_eight_bug_class_mutations_beyond_the_seed_four_with_unique_names():
    assert len(SEED_MUTATIONS) == 4 and len(BUG_CLASS_MUTATIONS) >= 8
    assert len(MUTATIONS) == len(SEED_MUTATIONS) + len(BUG_CLASS_MUTATIONS)


CELLS = [(m, c, t) for m in MUTATIONS.values() for c in (KV1, KV2, KV4)
         for t in (1, 2, 4) if t <= c.n_kv_heads]


@pytest.mark.parametrize("mutation, config, degree", CELLS,
                         ids=[f"{m.name}-kv{c.n_kv_heads}-t{t}" for m, c, t in CELLS])
def test_mutation_preserves_shapes_leaves_input_alone_and_is_identity_exactly_where_declared(
        checkers, mutation, config, degree):
    checker = checkers[config.n_kv_heads]
    declared = checker.declared(degree)
    before = [{n: x.clone() for n, x in p.items()} for p in declared]
    mutated = mutation.apply(declared, checker.layout, config)
    changed = False
    for rank, (old, new) in enumerate(zip(before, mutated)):
        for name in old:
            assert torch.equal(declared[rank][name], old[name])  # input untouched
            assert new[name].shape == old[name].shape and new[name].dtype == old[name].dtype
            changed |= not torch.equal(new[name], old[name])
    reason = mutation.identity_reason(config, degree)
    assert changed == (reason is None), f"{mutation.name} at t={degree}: declared {reason!r}"


def test_interleaved_qkv_order_groups_each_kv_head_with_its_query_heads():
    # n_heads 4, n_kv_heads 2, head_dim 1: Q rows 0-3, K rows 4-5, V rows 6-7
    assert interleaved_qkv_order(4, 2, 1).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    # one KV head: interleaved and plain coincide, which is why the mutation declares it
    assert interleaved_qkv_order(2, 1, 2).tolist() == list(range(8))


def test_kv_swapped_puts_v_rows_where_k_rows_belong(checkers):
    checker = checkers[2]
    name = "layers.0.qkv.weight"
    mutated = mutation_by_name("kv_swapped").apply(checker.declared(2), checker.layout, KV2)
    # rank 0 declares Q rows 0-3, K rows 8-9, V rows 12-13 (q_rows 8, kv_rows 4)
    assert locate(checker.full[name], mutated[0][name], 0) == [0, 1, 2, 3, 12, 13, 8, 9]


def test_q_head_boundary_shifted_starts_each_rank_one_head_late(checkers):
    checker = checkers[2]
    name = "layers.0.qkv.weight"
    mutated = mutation_by_name("q_head_boundary_shifted").apply(checker.declared(2),
                                                                  checker.layout, KV2)
    held = [locate(checker.full[name], mutated[r][name], 0)[:4] for r in range(2)]
    assert held == [[2, 3, 4, 5], [6, 7, 0, 1]]  # heads 1-2 and 3-0, each 2 rows


def test_replica_scaled_changes_only_the_last_ranks_copy(checkers):
    checker = checkers[4]
    mutated = mutation_by_name("replica_scaled").apply(checker.declared(4), checker.layout, KV4)
    assert torch.equal(mutated[0]["norm.weight"], checker.full["norm.weight"])
    assert torch.allclose(mutated[3]["norm.weight"], 1.05 * checker.full["norm.weight"])


def test_shard_dropped_and_duplicated_touch_the_ranks_they_name(checkers):
    checker = checkers[2]
    shards = split(checker.full, checker.layout, 2)
    dropped = mutation_by_name("down_shard_dropped").apply(shards, checker.layout, KV2)
    assert not dropped[1]["layers.0.down.weight"].any()
    assert torch.equal(dropped[0]["layers.0.down.weight"], shards[0]["layers.0.down.weight"])
    dup = mutation_by_name("qkv_rank0_duplicated").apply(shards, checker.layout, KV2)
    assert torch.equal(dup[1]["layers.0.qkv.weight"], shards[0]["layers.0.qkv.weight"])


def test_unknown_mutation_is_a_typed_error_listing_the_known_ones():
    with pytest.raises(UnknownMutation, match=r"unknown mutation 'kv_swap'; known: contiguous_qkv"):
        mutation_by_name("kv_swap")

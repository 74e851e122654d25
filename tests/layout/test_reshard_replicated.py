"""Resharding a layout that replicates KV heads (``HeadReplicated``) reads each replicated
range once: ``reshard(split(x, s), d) == split(x, d)`` byte for byte for every pair."""

import pytest
import torch

from weight_sync_bench.layout.placements import HeadReplicated
from weight_sync_bench.layout.reshard import gather_tensor, reshard_tensor, split_tensor
from weight_sync_bench.layout.table import ShardSpec

SPEC = ShardSpec("layers.0.qkv.weight", ((8 + 2 * 2) * 4, 3), HeadReplicated(8, 2, 4))
PAIRS = [(s, d) for s in (4, 8) for d in (4, 8)]  # HeadReplicated needs t > n_kv_heads = 2


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_reshard_of_replicated_kv_heads_equals_the_destination_split(src, dst):
    x = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(src * 10 + dst))
    out = reshard_tensor(split_tensor(x, SPEC, src), SPEC, dst)
    want = split_tensor(x, SPEC, dst)
    assert [o.shape for o in out] == [w.shape for w in want]
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    assert torch.equal(gather_tensor(out, SPEC), x)


def test_a_replica_that_differs_is_not_read_a_lower_rank_is():
    """Each replicated range is read from its lowest rank, as gather takes it: a corrupted
    higher replica does not reach the output, and a corrupted lowest one does."""
    x = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(0))
    shards = split_tensor(x, SPEC, 8)  # KV head 0 on ranks 0-3, KV head 1 on ranks 4-7
    high = [s.clone() for s in shards]
    high[1][-8:] += 1.0  # rank 1's copy of K and V head 0
    assert all(torch.equal(o, w) for o, w in zip(reshard_tensor(high, SPEC, 4),
                                                 split_tensor(x, SPEC, 4)))
    low = [s.clone() for s in shards]
    low[0][-8:] += 1.0
    assert not all(torch.equal(o, w) for o, w in zip(reshard_tensor(low, SPEC, 4),
                                                     split_tensor(x, SPEC, 4)))

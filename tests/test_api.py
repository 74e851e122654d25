"""The public surface users validate their own code with, importable from the package."""

import weight_sync_bench

PROMISED = ("ModelConfig TOY TOY_KV4 layout_for Replicate Shard HeadPartitioned FusedPaired "
            "ShardSpec LayoutTable UnsupportedLayout split gather reshard ReferenceModel "
            "ShardedModel InProcessCollective check_split check_reshard").split()


def test_every_promised_name_is_exported_and_resolves():
    assert set(PROMISED) <= set(weight_sync_bench.__all__)
    missing = [n for n in weight_sync_bench.__all__ if not hasattr(weight_sync_bench, n)]
    assert missing == []

"""ShardSpec and LayoutTable claims that mutation testing found unpinned (mutation/report.md):
the rank bound and its message, the key a missing name raises, the degree probe's bounds, and
``str(table)`` rendering at every supported degree."""

import pytest

from weight_sync_bench import TOY, UnsupportedLayout, layout_for
from weight_sync_bench.layout.placements import Replicate, Shard
from weight_sync_bench.layout.table import LayoutTable, ShardSpec

SPEC = ShardSpec("layers.0.down.weight", (8, 6), Shard(dim=1))


@pytest.mark.parametrize("rank", [-1, 2, 3])  # 2: one past the last rank at t=2
def test_a_rank_outside_the_group_is_rejected_with_the_valid_range_named(rank):
    with pytest.raises(UnsupportedLayout) as raised:
        SPEC.ranges(2, rank)
    assert str(raised.value) == f"layers.0.down.weight: rank {rank} is outside 0..1 at t=2"


def test_the_last_rank_of_the_group_is_inside_it():
    assert SPEC.ranges(2, 1) == (1, [(3, 6)])


def test_a_missing_parameter_raises_a_key_error_naming_it():
    with pytest.raises(KeyError) as raised:
        layout_for(TOY)["layers.9.qkv.weight"]
    assert raised.value.args == ("layers.9.qkv.weight",)


def test_degree_probe_covers_one_to_max_degree_inclusive_and_never_zero():
    replicated = LayoutTable((ShardSpec("norm.weight", (4,), Replicate()),))
    assert replicated.supported_degrees(4) == [1, 2, 3, 4]
    # the default probe stops at 64: a layout every degree divides still lists 64 of them
    assert replicated.supported_degrees() == list(range(1, 65))
    # an empty table rejects nothing, yet t=0 is still no degree
    assert LayoutTable(()).supported_degrees(3) == [1, 2, 3]


def test_str_of_a_table_renders_every_supported_degree():
    layout = layout_for(TOY)
    text = str(layout)
    assert text == layout.render(layout.supported_degrees())
    header = text.splitlines()[0].split()
    assert header == ["parameter", "shape", "placement",
                      *[f"t={t}" for t in layout.supported_degrees()]]


def test_a_shape_given_as_a_list_is_kept_as_a_tuple_and_its_lookups_work():
    """The layout's lookups are cached by (placement, shape, ...): a list shape, which
    cannot be a cache key, is made a tuple, and the answers are the tuple's."""
    listed = ShardSpec("layers.0.down.weight", [8, 6], Shard(dim=1))
    assert listed.shape == (8, 6) and listed == SPEC
    assert listed.ranges(2, 1) == SPEC.ranges(2, 1) == (1, [(3, 6)])
    assert LayoutTable((listed,)).supported_degrees(6) == [1, 2, 3, 6]


def test_experts_blocks_given_as_a_list_are_kept_as_a_tuple():
    from weight_sync_bench.layout.placements import Experts

    listed = ShardSpec("experts.w13", (16, 3), Experts(2, [4, 4]))
    assert listed.placement.blocks == (4, 4)
    assert listed.ranges(2, 1) == ShardSpec("experts.w13", (16, 3), Experts(2, (4, 4))).ranges(2, 1)

import re

import pytest

from weight_sync_bench import (
    TOY,
    TOY_KV4,
    FusedPaired,
    HeadPartitioned,
    HeadReplicated,
    Replicate,
    Shard,
    ShardSpec,
    UnsupportedLayout,
    layout_for,
)


def test_supported_degrees_are_probed_from_the_placements():
    assert layout_for(TOY).supported_degrees() == [1, 2]
    assert layout_for(TOY_KV4).supported_degrees() == [1, 2, 4]


def test_toy_at_t4_is_rejected_inside_head_partitioned_with_the_rule_named():
    with pytest.raises(UnsupportedLayout) as info:
        layout_for(TOY).validate(4)
    assert str(info.value) == (
        "layers.0.qkv.weight: HeadPartitioned needs n_kv_heads % t == 0 (n_kv_heads=2, t=4)")


def test_qkv_rank_local_rows_are_the_three_ranges_of_the_seed_diagram():
    spec = layout_for(TOY)["layers.0.qkv.weight"]
    assert spec.ranges(2, 0) == (0, [(0, 128), (256, 288), (320, 352)])
    assert spec.ranges(2, 1) == (0, [(128, 256), (288, 320), (352, 384)])


def test_gate_up_rank_local_rows_pair_gate_with_up():
    spec = layout_for(TOY)["layers.0.gate_up.weight"]
    assert spec.ranges(2, 0) == (0, [(0, 352), (704, 1056)])
    assert spec.ranges(2, 1) == (0, [(352, 704), (1056, 1408)])


CASES = [
    # placement, shape, degree, local shape (None: rejected, with the reason)
    (Replicate(), (256,), 4, (256,)),
    (Shard(0), (32000, 256), 4, (8000, 256)),
    (Shard(1), (256, 704), 4, (256, 176)),
    (Shard(0), (10, 4), 3, None),  # uneven: 10 % 3 != 0, the harness never pads silently
    (Shard(2), (10, 4), 1, None),  # dim out of range for a 2-D tensor
    (HeadPartitioned(8, 4, 32), (512, 256), 4, (128, 256)),
    (HeadPartitioned(8, 2, 32), (384, 256), 4, None),  # fewer KV heads than ranks: no replication
    (HeadPartitioned(6, 3, 8), (96, 16), 2, None),  # 6 query heads split 2 ways but 3 KV heads don't
    (HeadPartitioned(8, 2, 32), (383, 256), 1, None),  # row count is not (8 + 2*2) * 32
    (HeadReplicated(8, 2, 32), (384, 256), 4, (128, 256)),  # 2 Q heads + a copy of 1 KV head
    (HeadReplicated(8, 2, 32), (384,), 8, (96,)),  # the bias, 1-D, alike
    (HeadReplicated(8, 2, 32), (384, 256), 2, None),  # t == n_kv_heads: HeadPartitioned's job
    (HeadReplicated(6, 2, 8), (80, 16), 3, None),  # t=3 is no multiple of 2 KV heads
    (HeadReplicated(8, 2, 32), (384, 256), 16, None),  # 8 Q heads do not split 16 ways
    (FusedPaired(704, 704), (1408, 256), 4, (352, 256)),
    (FusedPaired(6, 6), (12, 4), 4, None),  # 6 % 4 != 0
    (FusedPaired(4, 4), (12, 4), 1, None),  # 4 + 4 != 12 rows
]


@pytest.mark.parametrize("placement, shape, degree, local", CASES)
def test_placement_validates_shape_and_degree(placement, shape, degree, local):
    spec = ShardSpec("w", shape, placement)
    if local is None:
        with pytest.raises(UnsupportedLayout, match=rf"^w: {placement.kind} needs .*t={degree}\)$"):
            spec.validate(degree)
    else:
        assert spec.local_shape(degree) == local


def test_placements_print_compactly_and_repr_machine_readably():
    assert [str(p) for p in (Replicate(), Shard(1), HeadPartitioned(8, 2, 32),
                             HeadReplicated(8, 2, 32), FusedPaired(7, 7))] == [
        "R", "S(1)", "HP(8,2,32)", "HR(8,2,32)", "FP(7,7)"]
    assert repr(Shard(1)) == "Shard(dim=1)"


@pytest.mark.parametrize("degree", [0, -2, True, 2.0])
def test_degree_must_be_a_positive_int(degree):
    with pytest.raises(UnsupportedLayout, match=f"degree must be a positive int, got t={degree}"):
        ShardSpec("w", (4,), Replicate()).validate(degree)


def test_layout_table_prints_placement_and_local_shape_per_degree():
    text = layout_for(TOY).render([1, 2, 4])
    lines = text.splitlines()
    assert lines[0].split() == ["parameter", "shape", "placement", "t=1", "t=2", "t=4"]
    qkv = next(line for line in lines if line.startswith("layers.0.qkv.weight"))
    assert re.split(r"\s{2,}", qkv) == ["layers.0.qkv.weight", "[384, 256]", "HP(8,2,32)",
                                      "[384, 256]", "[192, 256]", "-"]
    assert len(lines) == 1 + len(layout_for(TOY))


def test_head_replicated_rank_r_holds_kv_head_r_times_n_kv_over_t():
    # TOY's qkv at t=4: Q heads 2r, 2r+1 (32 rows each), then K and V of head r // 2
    spec = ShardSpec("layers.0.qkv.weight", (384, 256), HeadReplicated(8, 2, 32))
    assert [spec.ranges(4, r) for r in range(4)] == [
        (0, [(0, 64), (256, 288), (320, 352)]), (0, [(64, 128), (256, 288), (320, 352)]),
        (0, [(128, 192), (288, 320), (352, 384)]), (0, [(192, 256), (288, 320), (352, 384)])]
    assert [HeadReplicated(8, 2, 32).kv_head(8, r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_head_replicated_names_the_replication_rule_it_needs():
    with pytest.raises(UnsupportedLayout) as info:
        ShardSpec("layers.0.qkv.weight", (80, 16), HeadReplicated(6, 2, 8)).validate(3)
    assert str(info.value) == ("layers.0.qkv.weight: HeadReplicated needs t % n_kv_heads == 0 "
                               "(n_kv_heads=2, t=3)")

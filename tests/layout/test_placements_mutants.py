"""Exact pins on ``layout/placements.py``: every rejection's full text (the parameter, the
placement, the rule, the values, the degree), the shapes each placement accepts, and how
ranges print, written against the mutants that survived the behavioural tests
(mutation/report.md). A user reads these messages to fix a layout, so each word is pinned."""

import pytest

from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.layout.placements import (
    FusedPaired,
    HeadPartitioned,
    HeadReplicated,
    Replicate,
    Shard,
    format_ranges,
    index_ranges,
    local_shape,
)

HP, HR, FP = HeadPartitioned(4, 2, 2), HeadReplicated(4, 1, 2), FusedPaired(4, 6)
QKV = "shape[0] == (n_heads + 2 * n_kv_heads) * head_dim"


@pytest.mark.parametrize(("placement", "shape", "degree", "message"), [
    (Replicate(), (4,), 0, "w: degree must be a positive int, got t=0"),
    (Shard(0), (4, 2), "2", "w: degree must be a positive int, got t='2'"),
    (Shard(2), (4, 2), 2, "w: Shard needs 0 <= dim < ndim (dim=2, ndim=2, t=2)"),
    (Shard(0), (5, 2), 2, "w: Shard needs shape[0] % t == 0 (shape[0]=5, t=2)"),
    (HP, (16, 8), True, "w: degree must be a positive int, got t=True"),
    (HP, (15, 8), 2, (f"w: HeadPartitioned needs {QKV} "
                     "(shape=[15, 8], n_heads=4, n_kv_heads=2, head_dim=2, t=2)")),
    (HP, (16, 8, 1), 2, (f"w: HeadPartitioned needs {QKV} "
                        "(shape=[16, 8, 1], n_heads=4, n_kv_heads=2, head_dim=2, t=2)")),
    (HeadPartitioned(6, 2, 2), (20, 8), 4, ("w: HeadPartitioned needs n_heads % t == 0 "
                                           "(n_heads=6, t=4)")),
    (HeadPartitioned(4, 1, 2), (12, 8), 2, ("w: HeadPartitioned needs n_kv_heads % t == 0 "
                                           "(n_kv_heads=1, t=2)")),
    (HR, (12, 8), -1, "w: degree must be a positive int, got t=-1"),
    (HR, (14, 8), 2, (f"w: HeadReplicated needs {QKV} "
                     "(shape=[14, 8], n_heads=4, n_kv_heads=1, head_dim=2, t=2)")),
    (HeadReplicated(6, 1, 2), (16, 8), 4, ("w: HeadReplicated needs n_heads % t == 0 "
                                          "(n_heads=6, t=4)")),
    (HeadReplicated(4, 2, 2), (16, 8), 2, ("w: HeadReplicated needs t > n_kv_heads (otherwise "
                                          "HeadPartitioned splits the KV heads) "
                                          "(n_kv_heads=2, t=2)")),
    (HeadReplicated(8, 3, 2), (28, 8), 4, ("w: HeadReplicated needs t % n_kv_heads == 0 "
                                          "(n_kv_heads=3, t=4)")),
    (FP, (10, 8), 0, "w: degree must be a positive int, got t=0"),
    (FP, (), 2, ("w: FusedPaired needs shape[0] == first + second "
                "(shape=[], first=4, second=6, t=2)")),
    (FP, (11, 8), 2, ("w: FusedPaired needs shape[0] == first + second "
                     "(shape=[11, 8], first=4, second=6, t=2)")),
    (FusedPaired(3, 6), (9, 8), 2, "w: FusedPaired needs first % t == 0 (first=3, t=2)"),
    (FusedPaired(4, 5), (9, 8), 2, "w: FusedPaired needs second % t == 0 (second=5, t=2)"),
])
def test_each_rejection_names_the_parameter_the_rule_the_values_and_the_degree(
        placement, shape, degree, message):
    with pytest.raises(UnsupportedLayout) as err:
        placement.validate(shape, degree, "w")
    assert str(err.value) == message


@pytest.mark.parametrize(("placement", "shape", "degree"), [
    (HP, (16, 8), 2), (HP, (16,), 2), (HR, (12, 8), 2), (HR, (12,), 4),
    (FP, (10, 8), 2), (FP, (10,), 2),  # 1-D: a fused bias splits as its weight's rows do
    (Shard(1), (3, 4), 4), (Replicate(), (7,), 3),
])
def test_the_shapes_a_placement_accepts_include_a_1d_bias(placement, shape, degree):
    placement.validate(shape, degree, "w")


def test_every_rank_holds_the_local_shape_it_reports():
    for placement, shape, degree in [(HP, (16, 8), 2), (HR, (12, 8), 4), (FP, (10, 3), 2),
                                     (Shard(1), (3, 8), 4)]:
        want = local_shape(placement, shape, degree)
        for rank in range(degree):
            dim, ranges = index_ranges(placement, shape, degree, rank)
            assert sum(b - a for a, b in ranges) == want[dim]


def test_ranges_print_inclusive_with_a_single_row_as_one_number():
    assert format_ranges([(4, 6), (8, 9), (10, 20)]) == "4-5, 8, 10-19"
    assert format_ranges([]) == ""


def test_a_value_that_is_no_placement_is_refused_by_name_not_read_as_none():
    with pytest.raises(AssertionError, match="got: 'S0'"):
        index_ranges("S0", (4,), 2, 0)

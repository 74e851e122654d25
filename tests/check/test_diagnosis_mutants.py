"""Diagnosis claims that mutation testing found unpinned (mutation/report.md): a correct rank
after rank 0 is not reported, the axis word for 1-D and 3-D tensors, a shard of another
dtype, a shard of another width, runs after unknown slices, and the kept slice index."""

import pytest
import torch

from weight_sync_bench import TOY
from weight_sync_bench.check import diagnosis
from weight_sync_bench.check.diagnosis import (
    diagnose_plain,
    format_indices,
    locate,
    mismatching,
)
from weight_sync_bench.layout.placements import Shard
from weight_sync_bench.layout.reshard import split_tensor
from weight_sync_bench.layout.table import ShardSpec


def diagnose(full, spec, shards):
    """The plain layout's diagnosis of ``spec`` (no VOCABULARY words for these names)."""
    return diagnose_plain(full, TOY, spec, shards)


def _arange(*shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


ROWS = ShardSpec("layers.0.up.weight", (8, 3), Shard(dim=0))


def test_only_the_wrong_rank_is_reported_when_the_others_hold_their_declared_rows():
    full = _arange(8, 3)
    shards = split_tensor(full, ROWS, 4)
    shards[2] = shards[2].flip(0)  # rank 2 holds its rows reversed; ranks 1 and 3 are right
    assert diagnose(full, ROWS, shards) == [
        "rank 2 layers.0.up.weight holds rows 5, 4; declared rows 4-5"]


@pytest.mark.parametrize("shape, dim, axis", [
    ((8,), 0, "elements"),  # a 1-D tensor's slices are elements, whatever its dim
    ((2, 3, 8), 2, "indices of dim 2"),  # no word for a third dim
])
def test_the_axis_is_named_by_the_tensor_rank_and_dim(shape, dim, axis):
    spec = ShardSpec("w", shape, Shard(dim=dim))
    full = _arange(*shape)
    shards = split_tensor(full, spec, 2)
    shards[0], shards[1] = shards[1], shards[0]
    assert diagnose(full, spec, shards) == [f"rank 0 w holds {axis} 4-7; declared {axis} 0-3",
                                            f"rank 1 w holds {axis} 0-3; declared {axis} 4-7"]


def test_the_declared_bytes_under_another_dtype_are_the_declared_rows_with_values_changed():
    full = _arange(8, 3)
    shards = [s.view(torch.int32) for s in split_tensor(full, ROWS, 2)]  # same bytes, same width
    assert mismatching([{"w": s} for s in shards],
                       [{"w": s} for s in split_tensor(full, ROWS, 2)], ["w"]) == ["w"]
    assert diagnose(full, ROWS, shards) == [
        "rank 0 layers.0.up.weight holds the declared rows 0-3, with values changed",
        "rank 1 layers.0.up.weight holds the declared rows 4-7, with values changed"]


def test_a_shard_of_another_width_is_found_nowhere():
    full = _arange(8, 3)
    narrow = [s[:, :2].contiguous() for s in split_tensor(full, ROWS, 2)]
    assert locate(full, narrow[0], 0) == [None] * 4
    assert diagnose(full, ROWS, narrow)[1] == (
        "rank 1 layers.0.up.weight holds rows ? x4; declared rows 4-7")


@pytest.mark.parametrize("indices, text", [
    ([None, 1], "?, 1"),  # a found index right after an unknown slice starts a new run
    ([None, None, 2, 3], "? x2, 2-3"),
    ([0, 1, None, 2], "0-1, ?, 2"),
])
def test_runs_after_unknown_slices_start_afresh(indices, text):
    assert format_indices(indices) == text


def test_a_kept_slice_index_is_used_instead_of_re_indexing_the_full_tensor(monkeypatch):
    full = _arange(8, 3)
    index = diagnosis.slice_index(full, 0)
    monkeypatch.setattr(diagnosis, "slice_index", lambda *a: pytest.fail("re-indexed"))
    assert locate(full, full[2:4], 0, index) == [2, 3]


def test_a_byte_correct_rank_is_not_reported_even_when_the_full_tensor_repeats_rows():
    full = torch.zeros(8, 3)
    full[:4] = _arange(4, 3) + 1  # rows 4-7 all zero, as padded vocabulary rows are
    shards = split_tensor(full, ROWS, 2)
    shards[0] = shards[0].flip(0)
    assert diagnose(full, ROWS, shards) == [
        "rank 0 layers.0.up.weight holds rows 3, 2, 1, 0; declared rows 0-3"]


@pytest.mark.parametrize("shape", [(10, 3), (4, 7), (25,), (3, 2, 4)])
def test_the_byte_comparison_in_slabs_sees_a_difference_in_any_slab_and_its_twin_passes(
        monkeypatch, shape):
    """``bit_equal`` compares ``_CHUNK`` elements at a time along dim 0 (bounded
    temporaries at real widths): a one-element difference in the first, a middle or the last
    slab, or in a strided view, is seen; equal bytes in every slab pass."""
    monkeypatch.setattr(diagnosis, "_CHUNK", 6)  # several slabs, a short last one
    a = _arange(*shape)
    assert diagnosis.bit_equal(a, a.clone())
    flat = a.numel()
    for at in (0, flat // 2, flat - 1):
        b = a.clone()
        b.view(-1)[at] = -0.0 if a.view(-1)[at] == 0 else a.view(-1)[at].neg()  # bytes only
        assert not diagnosis.bit_equal(a, b), at
    if a.dim() == 2:  # a column slice: strided, compared without a whole contiguous copy
        assert diagnosis.bit_equal(a[:, 1:], a.clone()[:, 1:])
        b = a.clone()
        b[-1, -1] += 1
        assert not diagnosis.bit_equal(a[:, 1:], b[:, 1:])
    assert not diagnosis.bit_equal(a, a.reshape(-1)) or a.dim() == 1  # shapes still compared


@pytest.mark.parametrize("shape", [(10, 3), (4, 7), (25,), (3, 2, 4)])
def test_no_byte_comparison_reads_more_than_a_slab_or_one_row(monkeypatch, shape):
    """What bounds the comparison's temporaries: every call reads at most ``_CHUNK``
    elements, or one row where a row is longer; and together they read every element."""
    monkeypatch.setattr(diagnosis, "_CHUNK", 6)
    seen = []
    real = diagnosis._equal_bytes

    def recording(a, b):
        seen.append(a.numel())
        return real(a, b)
    monkeypatch.setattr(diagnosis, "_equal_bytes", recording)
    a = _arange(*shape)
    assert diagnosis.bit_equal(a, a.clone())
    row = a.numel() // a.shape[0]
    assert max(seen) <= max(6, row) and sum(seen) == a.numel()

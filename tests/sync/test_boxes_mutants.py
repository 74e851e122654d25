"""A refused cover read back whole (issue 30's mutation testing of ``sync/boxes.py``): each
``InvalidCover`` the validation raises carries its message, parameter, rank and box, read
here in full, with the fault on the last rank; and the small pieces the planner reads (a
cover's boxes of a parameter it does not hold, the elements per index, a stored tensor's
rank and name, the runs of an index with padding in the middle). The twin of every refusal
is the declared layout, which ``test_boxes.py`` passes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.sync.conftest import tiny, with_piece
from weight_sync_bench.conventions.maps import Piece
from weight_sync_bench.errors import InvalidCover
from weight_sync_bench.sync import sync_layout
from weight_sync_bench.sync.boxes import (
    Box,
    Cover,
    _axis,
    cover_of,
    runs,
    validate_cover,
)

NORM = "norm.weight"


def _refusal(broken, declared) -> InvalidCover:
    """The refusal of ``broken`` (a layout, or a cover made by hand), after its twin: the
    ``declared`` layout it was cut from passes."""
    validate_cover(cover_of(declared))
    with pytest.raises(InvalidCover) as info:
        validate_cover(broken if isinstance(broken, Cover) else cover_of(broken, validate=False))
    return info.value


def _with_piece(text: str, rank: int, name: str, idx, dim: int | None = None):
    """A copy of tiny(2)'s ``text`` layout with one piece replaced (``with_piece``), and the
    declared layout."""
    declared = sync_layout(tiny(2), text)
    return with_piece(declared, rank, name, idx, dim), declared


def test_a_stored_tensor_reading_a_parameter_the_model_lacks_is_named_with_its_rank():
    # cover_of cannot build such a cover (it reads the parameter's shape), a cover made by
    # hand can: the last rank's norm re-labelled
    declared = sync_layout(tiny(2), "plain:2")
    good = cover_of(declared)
    ranks = [dict(r) for r in good.ranks]
    ranks[1][NORM] = replace(ranks[1][NORM], source="no.such.weight")
    err = _refusal(Cover(declared, tuple(ranks)), declared)
    assert str(err) == ("plain:2: rank 1 norm.weight reads canonical 'no.such.weight', which "
                        "tiny_kv2 does not have")
    assert (err.param, err.rank, err.box) == ("no.such.weight", 1, None)


def test_a_stored_parameter_the_statement_does_not_lay_out_is_named():
    declared = sync_layout(tiny(2), "plain:2")
    unstated = replace(declared.statement,
                       specs=tuple(s for s in declared.statement.specs if s.name != NORM))
    err = _refusal(replace(declared, statement=unstated), declared)
    assert str(err) == ("plain:2: stores canonical norm.weight, which its statement "
                        "(placements) does not lay out")
    assert (err.param, err.rank, err.box) == (NORM, None, None)


def test_a_box_along_another_dim_carries_the_box_and_its_rank():
    name = "layers.0.down.weight"  # stated S(1): split along the columns
    err = _refusal(*_with_piece("plain:2", 1, name, torch.arange(16), dim=0))
    box = Box(1, name, name, 0, 0, 16, 0)
    assert str(err) == (f"plain:2: {box} is split along dim 0; the layout states S(1) along "
                        "dim 1")
    assert (err.param, err.rank, err.box) == (name, 1, box)


def test_a_box_out_of_bounds_carries_the_box_and_cover_of_validates_unless_told():
    broken, declared = _with_piece("plain:2", 1, NORM, torch.arange(1, 33))
    err = _refusal(broken, declared)
    assert err.box == Box(1, NORM, NORM, 0, 1, 32, 0)
    assert (err.param, err.rank) == (NORM, 1)
    with pytest.raises(InvalidCover, match="out of bounds"):
        cover_of(broken)  # validated by default: the planner never sees a broken cover


def test_an_overlap_within_a_rank_carries_the_second_box():
    name = "layers.0.gate_up.weight"  # plain's stored name is the canonical one
    idx = list(range(32)) + list(range(16, 48))  # gate rows 16-31 held twice on rank 1
    broken, declared = _with_piece("plain:2", 1, name, idx)
    err = _refusal(broken, declared)
    first, second = cover_of(broken, validate=False).ranks[1][name].boxes
    assert (first.start, first.stop, second.start, second.stop) == (0, 32, 16, 48)
    assert str(err) == (f"plain:2: rank 1 holds {name} rows 16-31 twice: {first} and {second} "
                        "overlap (one rank stores each canonical index at most once)")
    assert (err.param, err.rank, err.box) == (name, 1, second)


def test_replication_over_dp_replicas_names_the_holders_and_the_dp():
    # every replica's rank 1 stores rank 0's embedding rows: rows 0-127 held 4 times
    declared = sync_layout(tiny(2), "plain:2", dp=2)
    name = "tok_embeddings.weight"
    pieces = [dict(p) for p in declared.pieces]
    for rank in range(declared.world):
        if int(pieces[rank][name].idx[0]) == 128:
            pieces[rank][name] = Piece(name, 0, torch.arange(128))
    err = _refusal(replace(declared, pieces=tuple(pieces)), declared)
    assert str(err) == (f"plain:2 x dp2: {name} rows 0-127 is held 4 times (ranks [0, 1, 2, 3]), "
                        "the layout states 2 (S(0) at t=2, dp=2)")
    assert err.param == name and err.rank == 0
    assert (err.box.rank, err.box.start, err.box.length) == (0, 0, 128)


def test_a_segment_held_once_where_twice_is_stated_says_time_in_the_singular():
    name = "model.layers.0.self_attn.qkv_proj.weight"
    idx = sync_layout(tiny(2), "vllm:4").pieces[1][name].idx.clone()
    idx[16:] += 8  # rank 1 takes KV head 1; stated: head 0 on ranks 0 and 1
    err = _refusal(*_with_piece("vllm:4", 1, name, idx))
    assert str(err) == ("vllm:4: layers.0.qkv.weight rows 64-71 is held 1 time (ranks [0]), "
                        "the layout states 2 (HR(8,2,8) at t=4)")
    assert (err.param, err.rank) == ("layers.0.qkv.weight", 0)
    assert (err.box.rank, err.box.start) == (0, 64)


def test_rows_held_by_no_rank_name_no_rank_and_no_box():
    # rank 1 drops row 128, the first of its half: rows 128-128 held by nobody; rank 0's box
    # ends right there, and is not the box that holds them
    err = _refusal(*_with_piece("plain:2", 1, "tok_embeddings.weight", torch.arange(129, 256)))
    assert str(err) == ("plain:2: tok_embeddings.weight rows 128-128 is held 0 times (ranks []), "
                        "the layout states 1 (S(0) at t=2)")
    assert (err.param, err.rank, err.box) == ("tok_embeddings.weight", None, None)


def test_a_column_box_out_of_bounds_says_columns_and_a_third_dim_its_index():
    name = "layers.0.down.weight"  # S(1): rank 1 holds columns 32-63 of 64
    err = _refusal(*_with_piece("plain:2", 1, name, torch.arange(33, 65)))
    assert str(err) == (f"plain:2: rank 1 {name}[0:32] = {name} columns 33-64 is out of "
                        f"bounds: {name} has 64 columns (0-63)")
    assert [_axis(d) for d in (0, 1, 2, 3)] == ["rows", "columns", "indices of dim 2",
                                               "indices of dim 3"]


def test_the_pieces_the_planner_reads():
    cover = cover_of(sync_layout(tiny(2), "megatron:2"))
    assert cover.boxes("no.such.weight") == []
    unit = cover.unit("layers.0.qkv.weight", 0)
    assert unit == 32 and type(unit) is int  # an element count, not 32.0
    stored = cover.ranks[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert (stored.rank, stored.name) == (1, "decoder.layers.0.self_attention.linear_qkv.weight")
    assert all((b.rank, b.name) == (stored.rank, stored.name) for b in stored.boxes)


def test_runs_cut_at_padding_in_the_middle_and_padding_starts_at_minus_one():
    # padding after a kept index and before the index that would continue it
    assert runs(np.array([5, -1, 0, 1])) == [(0, 5, 1), (1, -1, 1), (2, 0, 2)]
    assert runs(np.array([7, 8, -3, -3])) == [(0, 7, 2), (2, -1, 2)]  # any negative: padding

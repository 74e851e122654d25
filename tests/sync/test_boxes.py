"""Every rank-local tensor of every layout is a concatenation of boxes of the canonical
tensor, and a cover is validated before anything moves: bounds, no overlap within a rank,
replication exactly as stated, volume. Each broken cover is refused naming the layout, the
parameter, the rank and the box (the twin of each: the declared cover passes)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sync.conftest import tiny, with_piece
from weight_sync_bench.errors import InvalidCover
from weight_sync_bench.sync import sync_layout
from weight_sync_bench.sync.boxes import cover_of, runs, validate_cover

LAYOUTS = ["plain:1", "plain:2", "megatron:2", "megatron:4", "vllm:4", "vllm:8", "hf",
           "meta:2", "fsdp:4"]


@pytest.mark.parametrize("text", LAYOUTS)
@pytest.mark.parametrize("dp", [1, 2])
def test_every_declared_layout_is_a_valid_cover_whose_boxes_tile_each_tensor(text, dp):
    layout = sync_layout(tiny(4), text, dp=dp)  # 4 KV heads: vllm:8 replicates them
    cover = cover_of(layout)  # validates
    for rank in cover.ranks:
        for stored in rank.values():
            at = 0
            for box in stored.boxes:
                assert box.offset == at
                at += box.length
            assert at == stored.shape[stored.dim]


def test_runs_split_indices_into_consecutive_runs_and_padding():
    idx = np.array([4, 5, 6, 0, 1, -1, -1, 9])
    assert runs(idx) == [(0, 4, 3), (3, 0, 2), (5, -1, 2), (7, 9, 1)]
    assert runs(np.array([], dtype=np.int64)) == []


def test_megatron_grouped_qkv_is_one_box_per_group_range_and_padding_a_box_of_its_own():
    cover = cover_of(sync_layout(tiny(2), "megatron:2"))
    qkv = cover.ranks[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    # rank 1 holds group 1: Q heads 4-7 (rows 32-63), K head 1 (72-79), V head 1 (88-95)
    assert [(b.start, b.length, b.offset) for b in qkv.boxes] == [(32, 32, 0), (72, 8, 32),
                                                                 (88, 8, 40)]
    emb = cover.ranks[1]["embedding.word_embeddings.weight"]
    # vocab 256 padded to 128 * 2: nothing to pad; at t = 4 it pads to 512
    assert all(b.source is not None for b in emb.boxes)
    padded = cover_of(sync_layout(tiny(4), "megatron:4")).ranks[3]["output_layer.weight"]
    assert [str(b) for b in padded.boxes] == ["rank 3 output_layer.weight[0:128] padding x128"]


def _broken(text, rank, name, idx, dim=None):
    return with_piece(sync_layout(tiny(2), text), rank, name, list(idx), dim)


def test_a_box_out_of_bounds_is_refused_naming_the_rank_and_box():
    # rank 1's norm shifted by one: canonical 1..32 of a 32-element vector
    layout = _broken("plain:2", 1, "norm.weight", list(range(1, 33)))
    with pytest.raises(InvalidCover) as info:
        validate_cover(cover_of(layout, validate=False))
    assert str(info.value) == ("plain:2: rank 1 norm.weight[0:32] = norm.weight rows 1-32 is out "
                               "of bounds: norm.weight has 32 rows (0-31)")
    assert (info.value.param, info.value.rank) == ("norm.weight", 1)


def test_an_index_stored_twice_on_one_rank_is_refused():
    # rank 0's gate_up holds gate rows 0-31 and, instead of up rows 64-95, gate rows 16-47
    layout = _broken("plain:2", 0, "layers.0.gate_up.weight", list(range(32)) + list(range(16, 48)))
    with pytest.raises(InvalidCover, match=r"^plain:2: rank 0 holds layers.0.gate_up.weight rows "
                                           r"16-31 twice: .* overlap"):
        validate_cover(cover_of(layout, validate=False))


def test_replication_other_than_stated_is_refused_with_the_counts():
    # rank 1 holds rank 0's embedding rows: rows 0-127 twice, rows 128-255 nowhere
    layout = _broken("plain:2", 1, "tok_embeddings.weight", list(range(128)))
    with pytest.raises(InvalidCover) as info:
        validate_cover(cover_of(layout, validate=False))
    assert str(info.value) == ("plain:2: tok_embeddings.weight rows 0-127 is held 2 times "
                               "(ranks [0, 1]), the layout states 1 (S(0) at t=2)")


def test_a_kv_head_replicated_as_stated_passes_and_one_replica_moved_fails():
    cover_of(sync_layout(tiny(2), "vllm:4"))  # KV head g on ranks 2g, 2g + 1: as stated
    layout = sync_layout(tiny(2), "vllm:4")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    idx = layout.pieces[1][name].idx.clone()
    idx[16:] += 8  # rank 1 takes K head 1 / V head 1, stated: head 0
    with pytest.raises(InvalidCover, match=r"is held 1 time \(ranks \[0\]\), the layout states "
                                           r"2 \(HR\(8,2,8\) at t=4\)"):
        validate_cover(cover_of(_broken("vllm:4", 1, name, idx.tolist()), validate=False))


def test_a_box_along_another_dim_than_stated_is_refused():
    layout = _broken("plain:2", 0, "layers.0.down.weight", range(16), dim=0)
    with pytest.raises(InvalidCover, match=r"is split along dim 0; the layout states S\(1\)"):
        validate_cover(cover_of(layout, validate=False))

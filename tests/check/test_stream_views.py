"""The streamed checks compare through views (bounded memory, ``check.stream`` and
``check.convert.stream_convert``): each destination tensor is read run by run against the
source tensors that hold it (``conventions.maps.runs``), a declared fused slice range by
range against the full tensor. What a whole-tensor comparison would see, these must see:
a wrong element in a run, a padding row that is not zero, a replica that differs from the
rank its bytes are read from; and a correct conversion passes."""

from __future__ import annotations

import pytest
import torch

from tests.check.narrow import narrowed
from weight_sync_bench import TOY
from weight_sync_bench.check.convert import check_convert, stage_convert
from weight_sync_bench.check.stream import stream_check
from weight_sync_bench.check.streaming import declared_shard
from weight_sync_bench.layout.placements import Shard
from weight_sync_bench.layout.table import ShardSpec
from weight_sync_bench.model.plan import layout_for

SMALL = TOY.replace(name="toy_v1000", vocab=1000)  # vLLM pads the table to 1024 rows at t=4
SRC, DST = "megatron:2", "vllm:4"  # TOY's 2 KV heads replicated over ranks 0-1 and 2-3
QKV = "model.layers.1.self_attn.qkv_proj.weight"


def _corrupted(change):
    convert = stage_convert(SRC, DST, SMALL)

    def fn(shards, degree):
        out = convert(shards, degree)
        change(out)
        return out
    return fn


def _set(rank, name, index, value=1.0):
    def change(out):
        if name in out[rank]:
            out[rank][name][index] = value
    return change


@pytest.mark.parametrize("per", ["layer", "parameter"])
def test_a_correct_streamed_conversion_passes(per):
    verdict = check_convert(stage_convert(SRC, DST, SMALL), SMALL, SRC, DST, stream=per,
                            threshold=1e-3)
    assert verdict.passed and verdict.first_mismatch is None


@pytest.mark.parametrize("name, rank, index, why", [
    ("model.embed_tokens.weight", 3, (255, 0), "a padding row that is not zero"),
    ("lm_head.weight", 3, (250, 7), "the head's padding"),
    (QKV, 1, (64 + 3, 5), "rank 1's copy of KV head 0 (read from rank 0)"),
    (QKV, 2, (0, 0), "the first element of a run"),
    ("model.layers.2.mlp.down_proj.weight", 1, (100, 175), "the last column of a column shard"),
])
def test_one_element_wrong_anywhere_in_a_streamed_conversion_is_a_byte_mismatch(
        name, rank, index, why):
    verdict = check_convert(_corrupted(_set(rank, name, index, 0.5)), SMALL, SRC, DST,
                            stream="parameter", threshold=1e-3)
    assert not verdict.passed and verdict.first_mismatch == name, why
    assert verdict.diagnosis and name in verdict.diagnosis[0]


def test_a_declared_slice_is_compared_range_by_range():
    spec = layout_for(TOY)["layers.0.qkv.weight"]  # [Q_r | K_r | V_r]: three ranges
    full = torch.randn(spec.shape)
    from weight_sync_bench.layout.reshard import shard_of
    mine = shard_of(full, spec, 2, 1).clone()
    assert declared_shard(mine, full, spec, 2, 1)
    assert not declared_shard(shard_of(full, spec, 2, 0).clone(), full, spec, 2, 1)  # rank 0's
    swapped = mine.clone()
    hd = TOY.head_dim
    k = slice(spec.ranges(2, 1)[1][0][1] - spec.ranges(2, 1)[1][0][0], None)
    swapped[k] = swapped[k].roll(hd, 0)  # K and V heads of the rank exchanged
    assert not declared_shard(swapped, full, spec, 2, 1)
    assert not declared_shard(mine[:-1], full, spec, 2, 1)  # a short shard is not its slice
    rows = ShardSpec("w", (4, 6), Shard(dim=1))
    cols = torch.randn(4, 6)
    assert declared_shard(cols[:, 3:].clone(), cols, rows, 2, 1)
    assert not declared_shard(cols[:, :3].clone(), cols, rows, 2, 1)


def test_a_streamed_split_sees_one_wrong_element_of_a_fused_slice_and_its_twin_passes():
    narrow = narrowed(TOY)  # a fifth of TOY's weights to draw
    layout = layout_for(narrow)
    from weight_sync_bench.check.stream import stage_split
    split = stage_split(layout)

    def wrong(full, degree):
        out = split(full, degree)
        if "layers.1.gate_up.weight" in out[1]:  # [gate_1 | up_1]: the last row of up
            out[1]["layers.1.gate_up.weight"][-1, 0] += 1
        return out
    assert stream_check(narrow, 2, fn=split, per="parameter", threshold=1e-3).passed
    failed = stream_check(narrow, 2, fn=wrong, per="parameter", threshold=1e-3)
    assert not failed.passed and failed.first_mismatch == "layers.1.gate_up.weight"

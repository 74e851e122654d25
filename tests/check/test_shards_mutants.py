"""``check.shards.validate_convention_shards`` on the faults a converter's output can carry
past its names and shapes, each on the last rank and on the last stored tensor (a check that
reads rank 0, or stops at the first tensor, misses them): a tensor of another dtype is a
``WrongShardShape`` carrying the rank, the stored name and both dtypes; a tensor on another
device (``meta`` here: a CUDA tensor where one is lent) is refused naming it. Each has its
twin: the same shards with the fault undone pass."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.check.shards import validate_convention_shards
from weight_sync_bench.conventions import endpoint, shards_for
from weight_sync_bench.errors import InvalidShards, WrongShardShape
from weight_sync_bench.model.config import TOY_KV4

WHERE = endpoint("vllm:2")
DTYPES = {name: torch.float32 for name in TOY_KV4.param_shapes()}


def _shards():
    return shards_for(TOY_KV4, WHERE)


def _last(shards):
    rank = len(shards) - 1
    return rank, list(shards[rank])[-1]


def test_a_shard_of_another_dtype_on_the_last_rank_names_rank_tensor_and_both_dtypes():
    shards = _shards()
    validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES)  # the twin: as declared
    rank, name = _last(shards)
    shards[rank][name] = shards[rank][name].to(torch.bfloat16)
    with pytest.raises(WrongShardShape) as info:
        validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES)
    err = info.value
    assert str(err) == (f"{WHERE} rank {rank} {name}: dtype torch.bfloat16, declared "
                        "torch.float32")
    assert (err.rank, err.name) == (rank, name)
    assert (err.expected_dtype, err.actual_dtype) == (torch.float32, torch.bfloat16)
    assert err.expected is None and err.actual is None  # the shapes agree: the dtype differs


def test_a_shard_on_another_device_is_refused_naming_the_device():
    shards = _shards()
    rank, name = _last(shards)
    kept = shards[rank][name]
    shards[rank][name] = torch.empty(kept.shape, dtype=kept.dtype, device="meta")
    with pytest.raises(InvalidShards) as info:
        validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES)
    assert not isinstance(info.value, WrongShardShape)
    assert str(info.value) == (f"{WHERE} rank {rank} {name}: on the meta device: the check "
                               "compares values, so return CPU tensors")
    shards[rank][name] = kept  # the twin
    validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES)


def test_a_shard_of_another_shape_on_the_last_rank_names_rank_tensor_and_both_shapes():
    shards = _shards()
    rank, name = _last(shards)
    want = tuple(shards[rank][name].shape)
    shards[rank][name] = shards[rank][name][:-1].clone()  # one row short
    with pytest.raises(WrongShardShape) as info:
        validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES)
    err = info.value
    got = (want[0] - 1, *want[1:])
    assert str(err) == (f"{WHERE} rank {rank} {name}: shape {list(got)}, declared "
                        f"{list(want)}")
    assert (err.rank, err.name, err.expected, err.actual) == (rank, name, want, got)
    assert err.expected_dtype is None and err.actual_dtype is None  # the shape differs


def test_given_pieces_only_those_tensors_are_expected():
    """``pieces``: one stage of a streamed check. Shards holding just those tensors pass; the
    whole endpoint's shards against them hold tensors the stage does not declare."""
    every = WHERE.pieces(TOY_KV4)
    stage = [{n: p for n, p in rank.items() if p.source.startswith("layers.0.")}
             for rank in every]
    shards = _shards()
    held = [{n: x for n, x in rank.items() if n in part} for rank, part in zip(shards, stage)]
    validate_convention_shards(held, WHERE, TOY_KV4, DTYPES, pieces=stage)
    with pytest.raises(InvalidShards, match=r"rank 0: unexpected "):
        validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES, pieces=stage)


def test_names_missing_and_unexpected_are_listed_each_and_the_lacking_layer_told_singular():
    shards = _shards()
    rank = len(shards) - 1
    layer1 = [n for n in shards[rank] if n.startswith("model.layers.1.")]
    for name in layer1[:2]:
        del shards[rank][name]
    with pytest.raises(InvalidShards) as info:
        validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES)
    assert str(info.value) == (
        f"{WHERE} rank {rank}: missing {layer1[0]}, {layer1[1]}. coverage: never written on "
        f"rank {rank}: layer 1 (2 declared tensors)")
    shards = _shards()
    shards[0]["extra.a"] = shards[0]["extra.b"] = torch.zeros(1)
    del shards[0][layer1[0]]
    with pytest.raises(InvalidShards) as info:
        validate_convention_shards(shards, WHERE, TOY_KV4, DTYPES)
    assert str(info.value).startswith(
        f"{WHERE} rank 0: missing {layer1[0]}; unexpected extra.a, extra.b. coverage: never "
        "written on rank 0: layer 1 (1 declared tensor)")


def test_a_stored_output_layer_of_a_tied_model_is_told_why_it_is_unexpected():
    tied = TOY_KV4.replace(name="tied", tie_embeddings=True, vocab=512)
    dtypes = {name: torch.float32 for name in tied.param_shapes()}
    shards = shards_for(tied, WHERE)
    validate_convention_shards(shards, WHERE, tied, dtypes)  # the twin: as declared
    shards[1]["lm_head.weight"] = torch.zeros(1)
    with pytest.raises(InvalidShards) as info:
        validate_convention_shards(shards, WHERE, tied, dtypes)
    assert str(info.value) == (
        f"{WHERE} rank 1: unexpected lm_head.weight (tied embeddings: the output layer reads "
        "the embedding table, not a stored copy)")
    untied = _shards()  # the note is the tied model's: another unexpected name has none
    untied[1]["lm_head.bias"] = torch.zeros(1)
    with pytest.raises(InvalidShards) as info:
        validate_convention_shards(untied, WHERE, TOY_KV4, DTYPES)
    assert str(info.value) == f"{WHERE} rank 1: unexpected lm_head.bias"

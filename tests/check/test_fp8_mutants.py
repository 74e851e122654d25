"""``check.fp8``'s verdict read whole (issue 30, the mutation pass over ``check/fp8.py``).

- What a converter into an FP8 endpoint returns is checked by the one structural check every
  convention's shards get (``check.shards.validate_shards``): a list of one dict per rank of
  exactly the declared names, each a CPU tensor of its declared shape and dtype (FP8 bytes,
  float32 scales). Each refusal is read whole, with the fault on the last rank.
- Non-finite values are told per rank and tensor, NaN and Inf counted apart."""

from __future__ import annotations

import math

import pytest
import torch

from tests.check.test_fp8_convert import TOY_FP8
from weight_sync_bench.check.fp8 import Fp8Check
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.fp8 import FP8, SCALE_SUFFIX
from weight_sync_bench.errors import InvalidShards, WrongShardShape
from weight_sync_bench.model.config import init_params

DST = "vllm:tp=2,fp8=block128"
O_PROJ = "model.layers.1.self_attn.o_proj.weight"
O_SCALE = O_PROJ + SCALE_SUFFIX


@pytest.fixture(scope="module")
def check():
    return Fp8Check(TOY_FP8, endpoint("megatron:2"), endpoint(DST),
                    init_params(TOY_FP8, 0, dtype=torch.bfloat16))


def declared(check):
    return [{n: x.clone() for n, x in rank.items()} for rank in check.declared]


def refused(check, out, error=InvalidShards):
    with pytest.raises(error) as info:
        check.verdict(out)
    return info.value


def test_the_declared_tensors_pass_and_each_structural_fault_is_refused_whole(check):
    assert check.verdict(declared(check)).passed  # the twin of every refusal below
    assert str(refused(check, "ab")) == f"{DST}: expected a list of 2 rank dicts, got str"
    assert str(refused(check, {})) == f"{DST}: expected a list of 2 rank dicts, got dict"
    assert str(refused(check, declared(check)[:1])) == f"{DST}: expected 2 rank dicts, got 1"
    out = declared(check)
    out[1] = list(out[1].items())
    assert str(refused(check, out)) == f"{DST} rank 1: expected a dict of tensors, got list"
    out = declared(check)
    out[1][7] = out[1][O_PROJ]
    assert str(refused(check, out)) == (f"{DST} rank 1: key 7 is a int, expected a str "
                                        "parameter name")


def test_a_missing_scale_and_an_unexpected_name_are_both_said(check):
    out = declared(check)
    del out[1][O_SCALE]
    assert str(refused(check, out)) == f"{DST} rank 1: missing {O_SCALE}"
    out[1]["o_proj.scale"] = torch.ones(1)
    out[1]["a.weight"] = torch.ones(1)
    assert str(refused(check, out)) == (f"{DST} rank 1: missing {O_SCALE}; unexpected "
                                        "a.weight, o_proj.scale")
    out = declared(check)
    out[1]["a.weight"] = torch.ones(1)
    assert str(refused(check, out)) == f"{DST} rank 1: unexpected a.weight"


def test_a_wrong_dtype_shape_device_or_type_names_the_rank_tensor_and_both_values(check):
    out = declared(check)
    out[1][O_PROJ] = out[1][O_PROJ].to(torch.bfloat16)  # dequantized: not the FP8 bytes
    e = refused(check, out, WrongShardShape)
    assert str(e) == f"{DST} rank 1 {O_PROJ}: dtype torch.bfloat16, declared {FP8}"
    assert (e.rank, e.name, e.expected_dtype, e.actual_dtype) == (1, O_PROJ, FP8,
                                                                  torch.bfloat16)
    out = declared(check)
    grid = out[1][O_SCALE]
    out[1][O_SCALE] = grid.t().contiguous().reshape(-1)  # the grid flattened
    e = refused(check, out, WrongShardShape)
    assert str(e) == (f"{DST} rank 1 {O_SCALE}: shape [{grid.numel()}], declared "
                      f"{list(grid.shape)}")
    assert (e.rank, e.name, e.expected, e.actual) == (1, O_SCALE, tuple(grid.shape),
                                                      (grid.numel(),))
    out = declared(check)
    out[1][O_SCALE] = torch.empty(grid.shape, dtype=grid.dtype, device="meta")
    assert str(refused(check, out)) == (f"{DST} rank 1 {O_SCALE}: on the meta device: the "
                                        "check compares values, so return CPU tensors")
    out = declared(check)
    out[1][O_SCALE] = grid.tolist()
    assert str(refused(check, out)) == f"{DST} rank 1 {O_SCALE}: expected a Tensor, got list"


def test_non_finite_values_are_counted_per_rank_and_tensor_nan_apart_from_inf(check):
    out = declared(check)
    scale = out[1][O_SCALE].view(-1)
    scale[0], scale[1], scale[2] = float("nan"), float("inf"), float("-inf")
    verdict = check.verdict(out)
    assert not verdict.passed and verdict.max_abs_error == math.inf
    assert f"not finite: rank 1 {O_SCALE}: 1 NaN, 2 Inf" in verdict.diagnosis
    out = declared(check)  # the twin: NaN alone says no Inf
    out[1][O_SCALE].view(-1)[0] = float("nan")
    assert f"not finite: rank 1 {O_SCALE}: 1 NaN" in check.verdict(out).diagnosis
    out = declared(check)
    out[1][O_SCALE].view(-1)[0] = float("inf")
    assert f"not finite: rank 1 {O_SCALE}: 1 Inf" in check.verdict(out).diagnosis

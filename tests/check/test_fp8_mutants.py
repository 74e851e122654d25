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


# ---- what a differing tensor holds, each kind read whole, on the last rank ----

NORM = "model.layers.1.input_layernorm.weight"


def first_line(check, change):
    out = declared(check)
    change(out[1])
    verdict = check.verdict(out)
    assert not verdict.passed
    return verdict.diagnosis[0]


def powers_of_two(x):
    return torch.exp2(torch.log2(x).round())


@pytest.mark.parametrize(("change", "said"), [
    (lambda r: r[O_SCALE].fill_(torch.finfo(torch.float32).min),
     "holds vLLM's fill of an unloaded block scale (finfo(float32).min): never written"),
    (lambda r: r[O_SCALE].fill_(1.0), "holds ones (FusedMoE's initial scale): never written"),
    (lambda r: r[O_SCALE].zero_(),
     "holds zeros: a scale of 0 dequantizes every weight to 0 or NaN"),
    (lambda r: r[O_SCALE].reciprocal_(),
     "holds the reciprocal of the declared scale (448 / amax)"),
    (lambda r: r[O_SCALE].view(-1)[1:3].fill_(float("nan")), "holds NaN in 2 of 4 blocks"),
    (lambda r: r[O_SCALE].view(-1)[0:3].mul_(1.5), ": 3 of 4 block scales differ")],
    ids=["unloaded", "ones", "zeros", "reciprocal", "nan", "three_blocks"])
def test_each_kind_of_wrong_scale_is_said_whole(check, change, said):
    line = first_line(check, change)
    assert line == f"rank 1 {O_SCALE}{'' if said.startswith(':') else ' '}{said}"


def test_another_ranks_scale_is_named_by_its_rank(check):
    line = first_line(check, lambda r: r.update({O_SCALE: check.declared[0][O_SCALE]}))
    assert line == f"rank 1 {O_SCALE} holds rank 0's scale"


def test_a_stacked_experts_square_scale_grid_transposed_is_said():
    """An MoE rank's ``w2`` scales are ``(experts, 2, 2)``: the grid of each expert
    transposed (the last two dimensions), not the expert dimension."""
    from tests.check.test_fp8_convert import MOE_FP8
    moe = Fp8Check(MOE_FP8, endpoint("megatron:2"), endpoint("vllm:tp=2,ep=2,fp8=block128"),
                   init_params(MOE_FP8, 0, dtype=torch.bfloat16))
    name = "model.layers.0.mlp.experts.routed_experts.w2_weight_scale_inv"
    assert tuple(moe.declared[1][name].shape) == (2, 2, 2)
    line = first_line(moe, lambda r: r.update({name: r[name].transpose(-1, -2).contiguous()}))
    assert line == f"rank 1 {name} holds the declared scale transposed (a square block grid)"


def test_nan_in_a_weight_is_counted_and_a_zero_scale_beside_it_is_the_unclamped_block(check):
    def nan_bytes(r, n):
        r[O_PROJ].view(torch.uint8).view(-1)[:n] = 0x7F  # e4m3's NaN
    assert first_line(check, lambda r: nan_bytes(r, 3)) == (
        f"rank 1 {O_PROJ} holds NaN in 3 of 65536 elements")

    def unclamped(r):  # block (0, 0) all zero, quantized as 0 / 0 with a scale of 0
        r[O_PROJ].view(torch.uint8)[:128, :128] = 0x7F
        r[O_SCALE][0, 0] = 0.0
    assert first_line(check, unclamped) == (
        f"rank 1 {O_PROJ} holds NaN in 16384 of 65536 elements; its scale is 0 in 1 blocks "
        "(an all-zero block quantized without the amax clamp: 0 / 0, THUDM/slime PR #2256)")
    # a tensor without a scale (a norm, in bf16): the NaN, nothing said of a scale
    assert first_line(check, lambda r: r[NORM].view(-1).__setitem__(0, float("nan"))) == (
        f"rank 1 {NORM} holds NaN in 1 of 256 elements")


def test_power_of_two_scales_are_ue8m0_and_a_zero_among_them_is_not(check):
    def ue8m0(r):
        r[O_SCALE] = powers_of_two(r[O_SCALE])
        r[O_PROJ].view(torch.uint8).view(-1)[0] ^= 1  # the weights requantized with them
    assert first_line(check, ue8m0) == (
        f"rank 1 {O_PROJ} and its scale are requantized to powers of two (UE8M0, DeepGEMM's "
        "packing), where the raw scale amax / 448 is expected")

    def with_a_zero(r):
        ue8m0(r)
        r[O_SCALE][1, 1] = 0.0
    assert first_line(check, with_a_zero) == (
        f"rank 1 {O_PROJ}: 1 of 65536 elements differ from the declared bytes")


def test_differing_elements_are_counted_as_elements_in_any_dtype(check):
    def fp8_bytes(r):
        r[O_PROJ].view(torch.uint8).view(-1)[:3] ^= 1
    assert first_line(check, fp8_bytes) == (
        f"rank 1 {O_PROJ}: 3 of 65536 elements differ from the declared bytes")

    params = init_params(TOY_FP8, 0, dtype=torch.bfloat16)
    params["layers.1.o_proj.weight"][:, -128:] = 0  # rank 1's last block column: +0 bytes
    zeros = Fp8Check(TOY_FP8, endpoint("megatron:2"), endpoint(DST), params)

    def negative_zero(r):  # FP8 bytes, not values: -0 where +0 is declared differs
        assert int(r[O_PROJ].view(torch.uint8)[0, -1]) == 0
        r[O_PROJ].view(torch.uint8)[0, -2:] = 0x80
    assert first_line(zeros, negative_zero) == (
        f"rank 1 {O_PROJ}: 2 of 65536 elements differ from the declared bytes")

    def norm(r):  # bf16: two elements, four bytes
        r[NORM][:2] = -r[NORM][:2] * 3
    assert first_line(check, norm) == (
        f"rank 1 {NORM}: 2 of 256 elements differ from the declared bytes")


def test_a_ranks_own_shard_quantized_after_the_cut_is_said(check):
    """Per tensor at TP 2, o_proj's rows cut by columns: each rank's own amax differs from
    the whole tensor's. Written on the last rank only."""
    from weight_sync_bench.conventions.fp8 import shard_quantized
    target = endpoint("vllm:tp=2,fp8=tensor")
    per = Fp8Check(TOY_FP8, endpoint("megatron:2"), target,
                   init_params(TOY_FP8, 0, dtype=torch.bfloat16))
    own = shard_quantized(TOY_FP8, target, per.params)[1]
    scale = next(n for n in own if n.startswith(O_PROJ) and n != O_PROJ)
    line = first_line(per, lambda r: r.update({O_PROJ: own[O_PROJ], scale: own[scale]}))
    assert line == (
        f"rank 1 {O_PROJ} holds this rank's own shard quantized after the TP cut (the amax "
        "of its own rows); the frameworks quantize each HF tensor whole, before the cut "
        "(slime quantize_params_fp8 after the all-gather), and vLLM's loader cuts weights and "
        "scales from it")


# ---- where the threshold comes from, said whole ----

def test_the_committed_fp8_floor_is_read_only_where_it_measured_the_destination(monkeypatch):
    from weight_sync_bench.check import fp8, threshold
    from weight_sync_bench.model.config import TOY_KV4
    from weight_sync_bench.tolerance.rules import floor_for

    # the floor's environment check, made to speak: it is told which floor it reads
    monkeypatch.setattr(threshold, "check_environment", lambda artifact, what: (f"<{what}>",))
    full = init_params(TOY_KV4, 0)
    found, notes = fp8.fp8_threshold(TOY_KV4, endpoint("vllm:tp=2,fp8=tensor"), full, None,
                                     seeded=True)
    floor = floor_for(TOY_KV4, "1a", "fp8_tensor")
    assert found == floor.threshold
    assert notes == (
        f"fp8: the threshold {found:g} is the committed FP8 floor's (phase1a_fp8_tensor.json: "
        "bf16 weights quantized tensor, every kernel set measured, the reference and the "
        "sharded forward on the same dequantized weights)", "<the phase 1a fp8_tensor floor>")
    # a per-geometry floor is named by its geometry
    geometry = type(floor)(floor.threshold, floor.artifact, floor.path, "geometry")
    monkeypatch.setattr(fp8, "floor_for", lambda *a, **k: geometry)
    assert fp8.fp8_threshold(TOY_KV4, endpoint("vllm:tp=2,fp8=tensor"), full, None,
                             seeded=True)[1][1] == "<the phase 1a fp8_tensor floor of toy_kv4>"
    # the twin: the same floor without the destination's cell is not read; measured instead
    cells = [c for c in floor.artifact["cells"] if (c["config"], c["degree"]) != ("toy_kv4", 2)]
    without = type(floor)(floor.threshold, {**floor.artifact, "cells": cells}, floor.path,
                          floor.source)
    monkeypatch.setattr(fp8, "floor_for", lambda *a, **k: without)
    found, notes = fp8.fp8_threshold(TOY_KV4, endpoint("vllm:tp=2,fp8=tensor"), full, None,
                                     seeded=True)
    assert len(notes) == 1 and notes[0].startswith(
        "fp8: the reference is the dense forward on the same dequantized weights; ")
    assert "committed FP8 floor" not in notes[0]


def test_a_threshold_measured_on_the_dequantized_weights_at_every_sharded_degree(monkeypatch):
    from weight_sync_bench.check import fp8
    from weight_sync_bench.model.config import TOY_KV4
    from weight_sync_bench.model.plan import layout_for
    from weight_sync_bench.tolerance.rules import derive_threshold

    asked = []

    def measure_worst(config, ends, weights):
        asked.append((config, [str(e) for e in ends], weights))
        return 3e-6
    monkeypatch.setattr(fp8, "measure_worst", measure_worst)
    full = init_params(TOY_KV4, 0)
    found, notes = fp8.fp8_threshold(TOY_KV4, endpoint("vllm:tp=2,fp8=tensor"), full, None,
                                     seeded=False)
    every = [f"plain:{t}" for t in layout_for(TOY_KV4).supported_degrees() if t > 1]
    assert len(every) > 1  # "every" is more than the smallest
    [(config, ends, weights)] = asked
    assert config is TOY_KV4 and ends == ["vllm:2", *every] and weights is full
    assert found == derive_threshold(3e-6)
    assert notes == (
        "fp8: the reference is the dense forward on the same dequantized weights; the "
        f"dequantized weights: the threshold {found:g} was measured on them (the declared "
        "shards of the check's ends and of the plain layout at its sharded degrees, token "
        "seeds 1000-1003, 100x the worst)",)
    # the twin: a threshold given is said to be given, and nothing is measured
    asked.clear()
    assert fp8.fp8_threshold(TOY_KV4, endpoint("vllm:tp=2,fp8=tensor"), full, 0.25,
                             seeded=False) == (0.25, (
        "fp8: the reference is the dense forward on the same dequantized weights; the "
        "dequantized weights: the threshold was given",))
    assert asked == []


def test_forwards_that_sum_exactly_are_judged_by_the_committed_fp8_floor_of_the_scheme(
        tolerance, monkeypatch):
    """A floor of 0 sets no threshold: the committed FP8 floor's of the target's scheme, said
    so. Its worst is changed here so that it differs from every other phase 1a floor's."""
    import json

    from weight_sync_bench.check import fp8
    from weight_sync_bench.model.config import TOY_KV4
    from weight_sync_bench.tolerance.artifacts import write_artifact
    from weight_sync_bench.tolerance.rules import derive_threshold

    path = tolerance / "phase1a_fp8_tensor.json"
    artifact = json.loads(path.read_text())
    artifact["worst_abs"] = artifact["cells"][0]["worst_abs"] = 4e-4  # 100x: 0.1, not 0.001
    artifact["threshold"] = derive_threshold(4e-4)
    write_artifact(artifact, path)
    monkeypatch.setattr(fp8, "measure_worst", lambda config, ends, weights: 0.0)
    found, notes = fp8.fp8_threshold(TOY_KV4, endpoint("vllm:tp=2,fp8=tensor"),
                                     init_params(TOY_KV4, 0), None, seeded=False)
    assert found == derive_threshold(4e-4) == 0.1
    every = ", ".join(["vllm:2", "plain:2", "plain:4"])
    assert notes == (
        f"fp8: the sharded forwards summed exactly on these dequantized weights (floor 0 at "
        f"{every}, token seeds 1000-1003): judged by the committed FP8 floor's threshold 0.1 "
        "(phase1a_fp8_tensor.json, measured on TOY and TOY_KV4)",)


def test_an_fp8_source_is_refused_and_a_check_defaults_to_the_seeds_weights():
    with pytest.raises(InvalidShards) as info:
        Fp8Check(TOY_FP8, endpoint(DST), endpoint("hf"), init_params(TOY_FP8, 0))
    assert str(info.value) == (f"{DST}: an FP8 source is not modelled (the harness quantizes "
                               "into FP8 endpoints, not out of them)")
    from weight_sync_bench.model.config import TOY_KV4, make_tokens
    from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET
    check = Fp8Check(TOY_KV4, endpoint("megatron:2"), endpoint("vllm:tp=2,fp8=tensor"),
                     init_params(TOY_KV4, 0, dtype=torch.bfloat16))
    tokens, *_, notes = check.forward
    assert torch.equal(tokens, make_tokens(TOY_KV4, TOKEN_SEED_OFFSET))  # seed 0
    assert "committed FP8 floor" in notes[0]  # seeded: the committed floor is read


# ---- the verdict's every field ----

def test_a_failing_fp8_verdict_is_read_whole(check):
    out = declared(check)
    out[1][O_PROJ].view(torch.uint8).view(-1)[0] ^= 1
    v = check.verdict(out)
    assert (v.config, v.src, v.dst, v.passed) == ("toy_fp8", 2, 2, False)
    assert (v.first_mismatch, v.mismatches, v.own_forward) == (O_PROJ, (O_PROJ,), True)
    assert v.conventions == ("megatron:2", DST) and v.dtype == "bf16"
    assert v.threshold == check.threshold and v.notes == check.forward[4]
    assert (v.near_ties, v.route_bound) == (None, None)  # a dense model routes nothing
    assert 0 < v.max_abs_error < math.inf


def test_a_non_finite_value_the_forward_never_reads_still_fails_as_infinite(check):
    """Rank 1's embedding rows past the vocabulary (padding) are never read: the forward
    stays finite, and the verdict's error is infinite anyway."""
    name = "model.embed_tokens.weight"
    out = declared(check)
    out[1][name][-1, 0] = float("nan")  # a padding row of the last rank's cut
    v = check.verdict(out)
    assert v.max_abs_error == math.inf and v.first_mismatch == name
    assert v.diagnosis[1:] == (f"not finite: rank 1 {name}: 1 NaN",)


def test_weights_that_hold_a_non_finite_value_fail_naming_the_tensor_not_the_rank():
    """The converter is right (its output is the declared bytes), the weights are not: the
    first mismatch is the tensor's name, each rank's copy told."""
    params = init_params(TOY_FP8, 0, dtype=torch.bfloat16)
    params["layers.1.attn_norm.weight"][3] = float("inf")
    params["norm.weight"][:2] = float("nan")
    inf = Fp8Check(TOY_FP8, endpoint("megatron:2"), endpoint(DST), params)
    v = inf.verdict(declared(inf))
    assert not v.passed and v.mismatches == () and v.first_mismatch == NORM
    final = "model.norm.weight"
    assert v.diagnosis == (f"not finite: rank 0 {NORM}: 1 Inf",
                           f"not finite: rank 0 {final}: 2 NaN",
                           f"not finite: rank 1 {NORM}: 1 Inf",
                           f"not finite: rank 1 {final}: 2 NaN")


def test_weights_of_several_dtypes_are_a_mixed_check():
    params = init_params(TOY_FP8, 0, dtype=torch.bfloat16)
    params["norm.weight"] = params["norm.weight"].float()  # an fp32 norm beside bf16
    mixed = Fp8Check(TOY_FP8, endpoint("megatron:2"), endpoint(DST), params)
    v = mixed.verdict(declared(mixed))
    assert v.passed and v.dtype == "mixed"


def test_more_than_four_non_finite_tensors_are_counted_past_the_fourth(check):
    norms = [f"model.layers.{i}.{n}.weight" for i in (0, 1)
             for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm.weight"]
    out = declared(check)
    for name in norms[:4]:
        out[1][name][0] = float("nan")
    assert check.verdict(out).diagnosis[-1] == f"not finite: rank 1 {norms[3]}: 1 NaN"
    out[1][norms[4]][0] = float("nan")
    lines = check.verdict(out).diagnosis
    assert lines[-2:] == (f"not finite: rank 1 {norms[3]}: 1 NaN", "not finite: 1 more tensor")
    out[0][norms[0]][0] = float("nan")
    assert check.verdict(out).diagnosis[-1] == "not finite: 2 more tensors"


def test_an_moe_fp8_verdict_keeps_the_references_near_ties_and_says_them(guarded_layers):
    from tests.check.test_fp8_convert import MOE_FP8
    from weight_sync_bench.model.sharded import RoutingGuard
    asked = guarded_layers
    moe = Fp8Check(MOE_FP8, endpoint("megatron:2"), endpoint("vllm:tp=2,ep=2,fp8=block128"),
                   init_params(MOE_FP8, 0, dtype=torch.bfloat16))
    _, _, routings, threshold, _ = moe.forward  # its threshold's measurement routes too
    asked.clear()
    v = moe.verdict(declared(moe))
    assert v.passed and sorted(set(asked)) == list(range(MOE_FP8.n_layers))
    assert v.near_ties == RoutingGuard(routings, threshold).near_ties()
    assert v.route_bound == threshold and v.near_ties[1] > 0


# ---- check_fp8_convert and the kill matrix pass on what they are given ----

def good(shards, degree, *, config, source, target, **_):
    from tests.check.test_fp8_convert import good
    return good(shards, degree, config=config, source=source, target=target)


def test_check_fp8_convert_passes_its_threshold_seed_and_note_to_the_check():
    from weight_sync_bench.check.fp8 import check_fp8_convert
    params = init_params(TOY_FP8, 0, dtype=torch.bfloat16)
    src, dst = endpoint("megatron:2"), endpoint(DST)

    def wrong(shards, degree, **kw):
        out = good(shards, degree, **kw)
        out[1][O_PROJ].view(torch.uint8).view(-1)[0] ^= 1
        return out
    v = check_fp8_convert(wrong, TOY_FP8, src, dst, params, threshold=0.25, seed=3,
                          weights_note="my note")
    assert v.threshold == 0.25 and v.notes[-1] == "my note"
    by_hand = Fp8Check(TOY_FP8, src, dst, params, threshold=0.25, seed=3)
    assert v.max_abs_error == by_hand.verdict(wrong(by_hand.inputs(), 2, config=TOY_FP8,
                                                    source=src, target=dst)).max_abs_error
    seed0 = check_fp8_convert(wrong, TOY_FP8, src, dst, params, threshold=0.25)  # seed 0
    assert seed0.max_abs_error != v.max_abs_error  # the seed drew other tokens
    zero = Fp8Check(TOY_FP8, src, dst, params, threshold=0.25, seed=0)
    assert seed0.max_abs_error == zero.verdict(wrong(zero.inputs(), 2, config=TOY_FP8,
                                                     source=src, target=dst)).max_abs_error

    def raises(shards, degree, **kw):
        raise RuntimeError("no scales today")
    from weight_sync_bench.errors import UserCodeError
    with pytest.raises(UserCodeError, match=f"while converting toy_fp8 megatron:2 -> {DST}"):
        check_fp8_convert(raises, TOY_FP8, src, dst, params)


def test_a_check_quantizes_its_weights_once(monkeypatch):
    from weight_sync_bench.check import fp8
    from weight_sync_bench.conventions import fp8 as conventions_fp8
    calls, original = [], conventions_fp8.quantize_canonical

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(conventions_fp8, "quantize_canonical", counted)
    monkeypatch.setattr(fp8, "quantize_canonical", counted)
    Fp8Check(TOY_FP8, endpoint("megatron:2"), endpoint(DST),
             init_params(TOY_FP8, 0, dtype=torch.bfloat16))
    assert len(calls) == 1


def test_the_kill_matrix_judges_with_its_seed_and_goes_on_past_a_refused_row(monkeypatch):
    from weight_sync_bench.check import fp8
    from weight_sync_bench.conventions.fp8_mutations import FP8_MUTATIONS, Fp8Mutation
    seeds = []

    class Seen(fp8.Fp8Check):
        def __init__(self, *args, seed=0, **kwargs):
            seeds.append(seed)
            super().__init__(*args, seed=seed, **kwargs)
    monkeypatch.setattr(fp8, "Fp8Check", Seen)

    def as_bf16(shards, config, target, params):
        shards[0][O_PROJ] = shards[0][O_PROJ].to(torch.bfloat16)
        return shards
    refused_one = Fp8Mutation("as_bf16", "", as_bf16, lambda config, target: None, "")
    same = Fp8Mutation("same", "", lambda shards, *a: shards, lambda config, target: None, "")
    rows = fp8.fp8_kill_matrix(TOY_FP8, endpoint("megatron:2"), endpoint(DST),
                               init_params(TOY_FP8, 0, dtype=torch.bfloat16),
                               [refused_one, same, FP8_MUTATIONS["scale_unsent"]], seed=3)
    assert seeds == [3]
    fp8.fp8_kill_matrix(TOY_FP8, endpoint("megatron:2"), endpoint(DST),
                        init_params(TOY_FP8, 0, dtype=torch.bfloat16), [same])
    assert seeds == [3, 0]  # seed 0 by default
    assert [(r.mutation, r.outcome) for r in rows] == [
        ("as_bf16", "refused"), ("same", "identity"), ("scale_unsent", "killed")]
    assert rows[0].reason == f"{DST} rank 0 {O_PROJ}: dtype torch.bfloat16, declared {FP8}"
    assert rows[1].reason == "the declared bytes here" and rows[1].ratio is None

"""The per-tensor FP8 scheme (``fp8=tensor``): one float32 ``weight_scale`` per HF tensor,
``amax / 448`` (slime ``_quantize_param`` without a block size). Checked against the
definition computed another way (the amax by a Python max, the rounding by the same
enumerated e4m3 table as the block quantizer's test), and each vLLM rank's scales against
the HF tensors' own: one per part it holds, by part index, the same on every TP rank, the
experts' ``[E, 2]`` and ``[E]``."""

from __future__ import annotations

import pytest
import torch

from tests.conventions.test_fp8 import CONFIG, MOE, nearest_e4m3
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.fp8 import (
    E4M3_MAX,
    FP8,
    dequantize_canonical,
    dequantize_stored,
    fp8_shapes,
    fp8_shards,
    quantize_canonical,
    quantize_tensor,
    shard_quantized,
)
from weight_sync_bench.model.config import init_params


def test_the_per_tensor_quantizer_is_its_definition():
    w = torch.randn(96, 200, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale = quantize_tensor(w)
    amax = max(abs(v) for v in w.float().flatten().tolist())
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (1,)
    assert torch.equal(scale, torch.tensor([amax], dtype=torch.float32) / E4M3_MAX)
    want = nearest_e4m3((w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX))
    assert torch.equal(q.double().flatten(), want)
    # an all-zero tensor: the clamp keeps the scale finite and the weights zero
    q0, s0 = quantize_tensor(torch.zeros(4, 4))
    assert s0.item() > 0 and not q0.float().any()


def test_vllm_ranks_hold_one_scale_per_part_by_part_index_on_every_tp_rank():
    p = init_params(CONFIG, 2)
    (hf,) = fp8_shards(CONFIG, endpoint("hf:fp8=tensor"), p)
    pre = "model.layers.1."
    attn, mlp = pre + "self_attn.", pre + "mlp."
    assert tuple(hf[attn + "q_proj.weight_scale"].shape) == (1,)
    for t in (1, 2, 4):
        for rank in fp8_shards(CONFIG, endpoint(f"vllm:tp={t},fp8=tensor"), p):
            assert torch.equal(rank[attn + "qkv_proj.weight_scale"], torch.cat(
                [hf[attn + f"{x}_proj.weight_scale"] for x in "qkv"]))
            assert torch.equal(rank[mlp + "gate_up_proj.weight_scale"], torch.cat(
                [hf[mlp + "gate_proj.weight_scale"], hf[mlp + "up_proj.weight_scale"]]))
            assert torch.equal(rank[attn + "o_proj.weight_scale"], hf[attn + "o_proj.weight_scale"])
            assert torch.equal(rank[mlp + "down_proj.weight_scale"],
                               hf[mlp + "down_proj.weight_scale"])
            assert "model.embed_tokens.weight_scale" not in rank


def test_experts_hold_w13_scales_by_expert_and_part_and_w2_by_expert():
    p = init_params(MOE, 0)
    (hf,) = fp8_shards(MOE, endpoint("hf:fp8=tensor"), p)
    for kernel in ("", ",kernel=flashinfer_cutlass"):  # up rows first: scales still by part
        ranks = fp8_shards(MOE, endpoint(f"vllm:tp=2,ep=2{kernel},fp8=tensor"), p)
        pre = "model.layers.0.mlp.experts."
        for r, rank in enumerate(ranks):
            w13 = rank[pre + "routed_experts.w13_weight_scale"]
            w2 = rank[pre + "routed_experts.w2_weight_scale"]
            assert tuple(w13.shape) == (2, 2) and tuple(w2.shape) == (2,)
            for j in range(2):
                e = r * 2 + j
                assert torch.equal(w13[j], torch.cat([hf[pre + f"{e}.gate_proj.weight_scale"],
                                                      hf[pre + f"{e}.up_proj.weight_scale"]]))
                assert torch.equal(w2[j:j + 1], hf[pre + f"{e}.down_proj.weight_scale"])


@pytest.mark.parametrize("where", ["vllm:tp=2,fp8=tensor", "vllm:tp=4,fp8=tensor",
                                   "vllm:tp=2,ep=2,kernel=flashinfer_cutlass,fp8=tensor"])
def test_a_ranks_dequantized_tensors_are_the_dequantized_model_cut(where):
    """Each part times its own scale, wherever the part lies in the rank's tensor (the
    flashinfer layout puts up's rows first): the cut of the dequantized model, bit for
    bit."""
    config = MOE if "ep" in where else CONFIG
    at = endpoint(where)
    p = init_params(config, 3)
    values, scales = quantize_canonical(config, p, "tensor")
    full = dequantize_canonical(config, values, scales, p, "tensor")
    pieces = at.unquantized().pieces(config)
    for rank, want, held in zip(fp8_shards(config, at, p), materialize(pieces, full), pieces):
        for name, x in want.items():
            got = rank[name]
            if got.dtype == FP8:
                got = dequantize_stored(config, held[name], got, rank[name + "_scale"],
                                        "tensor")
            assert torch.equal(got, x), name


def test_no_degree_is_refused_per_tensor_and_the_shapes_agree():
    """Per-tensor scales are not cut, so an MLP width that is not whole blocks (refused
    per block at TP 2) is held; ``fp8_shapes`` says what ``fp8_shards`` stores."""
    config = CONFIG.replace(ffn=320)
    at = endpoint("vllm:tp=2,fp8=tensor")
    shards = fp8_shards(config, at, init_params(config, 0))
    for rank, shapes in zip(shards, fp8_shapes(config, at)):
        assert set(rank) == set(shapes)
        for name, (shape, dtype) in shapes.items():
            assert tuple(rank[name].shape) == shape and dtype in (None, rank[name].dtype)


def test_quantizing_per_shard_differs_per_tensor_at_tp2_and_not_at_tp1():
    """A rank's own rows have their own amax: per shard is not the full tensor's scale at
    TP 2 (what the check tells apart); at TP 1 a rank's tensor is the whole one (the
    twin)."""
    p = init_params(CONFIG, 1)
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    for t, same in ((1, True), (2, False)):
        at = endpoint(f"vllm:tp={t},fp8=tensor")
        own, declared = shard_quantized(CONFIG, at, p), fp8_shards(CONFIG, at, p)
        # the rank whose rows hold the amax agrees; the others do not
        assert all(torch.equal(o[name], d[name]) for o, d in zip(own, declared)) == same

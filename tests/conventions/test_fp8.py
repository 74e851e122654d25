"""The reference FP8 quantizer and what each rank stores at a block-FP8 endpoint
(``conventions.fp8``). The quantizer is checked against its definition computed another way
(every block's amax by loops; each value the nearest of the 256 e4m3 values, ties to even,
from an enumerated table, not torch's cast); the per-rank layout against the HF tensors'
own FP8 bytes and scale grids, cut by hand as vLLM's loader cuts them; the refusals name
vLLM's rule."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.fp8 import (
    AMAX_FLOOR,
    E4M3_MAX,
    FP8,
    dequantize_blocks,
    dequantize_canonical,
    fp8_shards,
    quantize_blocks,
    quantize_canonical,
)
from weight_sync_bench.errors import UnsupportedConvention
from weight_sync_bench.model.config import ModelConfig, init_params

# head_dim 128: every q, k, v part and every MLP half is whole blocks at TP 1, 2 and 4
# (TP 4 replicates the two KV heads); the vocabulary is not (it stays unquantized).
CONFIG = ModelConfig(name="fp8", vocab=1000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=128, ffn=512)
MOE = CONFIG.replace(name="fp8_moe", n_experts=4, top_k=2, expert_ffn=256)


def e4m3_table() -> torch.Tensor:
    """Every finite float8_e4m3fn value, from its bits (sign, 4 exponent bits with bias 7,
    3 mantissa bits; subnormals at exponent 0; S.1111.111 is NaN), ascending."""
    values = set()
    for bits in range(256):
        sign, exp, man = bits >> 7, (bits >> 3) & 0xF, bits & 0x7
        if exp == 0xF and man == 0x7:
            continue
        v = (man / 8) * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        values.add(-v if sign else v)
    return torch.tensor(sorted(values), dtype=torch.float64)


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest table value, ties to the one whose mantissa is even."""
    table = e4m3_table()
    x = x.double().flatten()
    i = torch.searchsorted(table, x).clamp(1, len(table) - 1)
    lo, hi = table[i - 1], table[i]
    pick = torch.where((x - lo).abs() < (hi - x).abs(), lo, hi)
    tie = (x - lo).abs() == (hi - x).abs()
    # at a tie, the neighbour whose 3-bit mantissa (the lowest bit of its byte) is even;
    # the table's values are exact in e4m3, so casting them to read their bits rounds nothing
    lo_bits = torch.tensor(lo.tolist(), dtype=torch.float32).to(FP8).view(torch.uint8)
    pick = torch.where(tie, torch.where(lo_bits % 2 == 0, lo, hi), pick)
    return pick


def test_the_quantizer_is_its_definition():
    """Each block's scale is its amax / 448 (loops over blocks, a partial one at each edge),
    each value the nearest e4m3 of w / scale."""
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # blocks of very different scales
    q, scale = quantize_blocks(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert tuple(scale.shape) == (3, 2)
    for i in range(3):
        for j in range(2):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            want = block.abs().max().clamp(min=AMAX_FLOOR) / E4M3_MAX
            assert scale[i, j].item() == want.item()
            ratio = (block / want).clamp(-E4M3_MAX, E4M3_MAX)
            got = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].double().flatten()
            assert torch.equal(got, nearest_e4m3(ratio)), (i, j)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= E4M3_MAX
    assert torch.equal(dequantize_blocks(q, scale),
                       q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
                       [:300, :200])


def test_an_all_zero_block_gets_a_finite_scale_and_zero_weights():
    """slime PR #2256: amax clamped to 1e-12 (the twin, the unclamped definition, gives
    scale 0 and NaN weights)."""
    w = torch.zeros(130, 260)
    w[129, 259] = 5.0  # one block not zero
    q, scale = quantize_blocks(w)
    assert scale[0, 0].item() == torch.tensor(AMAX_FLOOR / E4M3_MAX, dtype=torch.float32).item()
    assert q[:128, :128].float().abs().max() == 0 and torch.isfinite(dequantize_blocks(q, scale)).all()
    unclamped = (w[:128, :128] / (w[:128, :128].abs().max() / E4M3_MAX)).to(FP8)
    assert torch.isnan(unclamped.float()).all()


def test_each_part_is_quantized_on_its_own():
    """qkv as q, k and v (each its own grid); a block never spans two parts."""
    p = init_params(CONFIG, 1)
    values, scales = quantize_canonical(CONFIG, p)
    qkv = p["layers.0.qkv.weight"]
    q_rows, kv_rows = CONFIG.q_rows, CONFIG.kv_rows
    for (a, b), grid in zip([(0, q_rows), (q_rows, q_rows + kv_rows),
                             (q_rows + kv_rows, q_rows + 2 * kv_rows)],
                            scales["layers.0.qkv.weight"]):
        q, s = quantize_blocks(qkv[a:b])
        assert torch.equal(grid, s)
        assert torch.equal(values["layers.0.qkv.weight"][a:b].view(torch.uint8),
                           q.view(torch.uint8))
    assert "layers.0.attn_norm.weight" not in values and "tok_embeddings.weight" not in values
    back = dequantize_canonical(CONFIG, values, scales, p)
    assert torch.equal(back["norm.weight"], p["norm.weight"])
    assert (back["layers.0.qkv.weight"] - qkv).abs().max() < 0.1 * qkv.abs().max()


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


@pytest.mark.parametrize("t", [1, 2, 4])
def test_vllm_ranks_hold_the_hf_tensors_cut_as_its_loader_cuts_them(t):
    """vLLM rank r of ``qkv_proj``: rows and scale rows of q (block r), then k and v
    (block r // replicas); ``gate_up_proj``: gate's then up's; ``o_proj`` / ``down_proj``:
    the scale's columns of block r. Compared with the HF FP8 tensors cut by hand."""
    p = init_params(CONFIG, 2)
    (hf,) = fp8_shards(CONFIG, endpoint("hf:fp8=block128"), p)
    ranks = fp8_shards(CONFIG, endpoint(f"vllm:tp={t},fp8=block128"), p)
    pre = "model.layers.1."
    hd, kv = CONFIG.head_dim, CONFIG.n_kv_heads
    for r, rank in enumerate(ranks):
        g = r * kv // t if t > kv else r  # the KV head block rank r reads
        qn, kn = CONFIG.q_rows // t, max(CONFIG.kv_rows // t, hd)
        want = [hf[pre + "self_attn.q_proj.weight"][r * qn:(r + 1) * qn],
                hf[pre + "self_attn.k_proj.weight"][g * kn:(g + 1) * kn],
                hf[pre + "self_attn.v_proj.weight"][g * kn:(g + 1) * kn]]
        assert torch.equal(_bytes(rank[pre + "self_attn.qkv_proj.weight"]),
                           torch.cat([_bytes(x) for x in want]))
        scale = [hf[pre + "self_attn.q_proj.weight_scale_inv"][r * qn // 128:(r + 1) * qn // 128],
                 hf[pre + "self_attn.k_proj.weight_scale_inv"][g * kn // 128:(g + 1) * kn // 128],
                 hf[pre + "self_attn.v_proj.weight_scale_inv"][g * kn // 128:(g + 1) * kn // 128]]
        assert torch.equal(rank[pre + "self_attn.qkv_proj.weight_scale_inv"], torch.cat(scale))
        f = CONFIG.ffn // t
        assert torch.equal(rank[pre + "mlp.gate_up_proj.weight_scale_inv"], torch.cat(
            [hf[pre + "mlp.gate_proj.weight_scale_inv"][r * f // 128:(r + 1) * f // 128],
             hf[pre + "mlp.up_proj.weight_scale_inv"][r * f // 128:(r + 1) * f // 128]]))
        k = CONFIG.q_rows // t
        assert torch.equal(rank[pre + "self_attn.o_proj.weight_scale_inv"],
                           hf[pre + "self_attn.o_proj.weight_scale_inv"]
                           [:, r * k // 128:(r + 1) * k // 128])
        assert torch.equal(_bytes(rank[pre + "mlp.down_proj.weight"]),
                           _bytes(hf[pre + "mlp.down_proj.weight"])[:, r * f:(r + 1) * f])
        assert rank["model.embed_tokens.weight"].dtype == torch.float32  # not quantized


def test_a_ranks_dequantized_tensors_are_the_dequantized_model_cut():
    """Dequantizing what a rank stores gives the rank's cut of the dequantized canonical
    model, bit for bit: the forward of an FP8 endpoint and its reference read the same
    values."""
    p = init_params(CONFIG, 3)
    values, scales = quantize_canonical(CONFIG, p)
    full = dequantize_canonical(CONFIG, values, scales, p)
    where = endpoint("vllm:tp=2,fp8=block128")
    declared = materialize(where.unquantized().pieces(CONFIG), full)
    for rank, want in zip(fp8_shards(CONFIG, where, p), declared):
        for name, x in want.items():
            got = rank[name]
            if got.dtype == FP8:
                got = dequantize_blocks(got, rank[name + "_scale_inv"])
            assert torch.equal(got, x), name


def test_experts_are_stacked_with_their_scales_member_by_member():
    p = init_params(MOE, 0)
    (hf,) = fp8_shards(MOE, endpoint("hf:fp8=block128"), p)
    ranks = fp8_shards(MOE, endpoint("vllm:tp=2,ep=2,fp8=block128"), p)
    pre = "model.layers.0.mlp.experts."
    for r, rank in enumerate(ranks):
        w13 = rank[pre + "routed_experts.w13_weight_scale_inv"]
        w2 = rank[pre + "routed_experts.w2_weight_scale_inv"]
        assert rank[pre + "routed_experts.w13_weight"].dtype == FP8
        assert tuple(w13.shape) == (2, 4, 2) and tuple(w2.shape) == (2, 2, 2)
        for j in range(2):
            e = r * 2 + j  # EP: contiguous experts
            assert torch.equal(w13[j], torch.cat([hf[pre + f"{e}.gate_proj.weight_scale_inv"],
                                                  hf[pre + f"{e}.up_proj.weight_scale_inv"]]))
            assert torch.equal(w2[j],
                               hf[pre + f"{e}.down_proj.weight_scale_inv"])
    assert rank["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays


@pytest.mark.parametrize(("config", "where", "rule"), [
    (CONFIG.replace(ffn=320), "vllm:tp=2", r"gate_up_proj.weight needs each part's rows on "
                                        r"128-blocks .* \(rows 0-159 of part 0 \(320 rows\)"),
    (CONFIG.replace(head_dim=64, n_kv_heads=1), "vllm:tp=1", r"qkv_proj.weight needs each "
                                                          r"part's rows on 128-blocks .*rows "
                                                          r"0-63 of part 1 \(64 rows\)"),
    (MOE.replace(expert_ffn=64), "vllm:tp=1", r"w13_weight needs each part's rows on 128-blocks "
                                           r".*Fp8MoEMethod"),
], ids=["gate_up_at_tp2", "merged_qkv_at_tp1", "moe_at_tp1"])
def test_a_cut_that_splits_a_block_is_refused_with_vllms_rule(config, where, rule):
    with pytest.raises(UnsupportedConvention, match=rule):
        fp8_shards(config, endpoint(where + ",fp8=block128"), init_params(config, 0))


def test_unaligned_widths_are_whole_tensors_with_ceil_grids_at_hf():
    """The twin of the refusals: an HF tensor of any width is one part, its grid rounded
    up (DeepSeek-V3: a partial block zero-padded for its scale, then cropped)."""
    config = CONFIG.replace(ffn=320, d_model=200)
    (hf,) = fp8_shards(config, endpoint("hf:fp8=block128"), init_params(config, 0))
    assert tuple(hf["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape) == (3, 2)
    assert tuple(hf["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == (2, 3)


def test_a_row_parallel_cut_off_the_blocks_is_refused():
    """vLLM's row-parallel rule (``input_size_per_partition % block_k``): a column cut of
    o_proj that starts inside a block; the twin, a cut on block boundaries, is the scale's
    columns."""
    from weight_sync_bench.conventions.fp8 import stored_scale
    from weight_sync_bench.conventions.maps import Piece, rows

    grids = quantize_canonical(CONFIG, init_params(CONFIG, 0))[1]["layers.0.o_proj.weight"]
    where = endpoint("vllm:tp=4,fp8=block128")
    with pytest.raises(UnsupportedConvention, match=r"o_proj.weight needs a cut along dim 1 on "
                                                    r"128-blocks .*block_k = 128.*columns 64-127"):
        stored_scale(CONFIG, where, "o_proj.weight", Piece("layers.0.o_proj.weight", 1,
                                                           rows(64, 128)), grids)
    ok = stored_scale(CONFIG, where, "o_proj.weight", Piece("layers.0.o_proj.weight", 1,
                                                            rows(128, 256)), grids)
    assert torch.equal(ok, grids[0][:, 1:2])


def test_dividing_by_the_scale_is_told_apart_from_multiplying_by_its_reciprocal():
    """At a tie of e4m3 (1.0625, between 1 and 1.125) ``w / scale`` lands exactly on it and
    rounds to even (1.0), where ``w * (1 / scale)`` (slime's Triton kernel) lands an ulp
    above and rounds up: the definition is division, and a converter that multiplies is a
    byte difference (values found by search: amax 1.0002460479736328)."""
    amax = torch.tensor(1.0002460479736328)
    w = torch.zeros(128, 128)
    w[0, 0], w[0, 1] = amax, 0.002372235292568803
    q, scale = quantize_blocks(w)
    assert (w[0, 1] / scale[0, 0]).item() == 1.0625  # the tie, exactly
    assert q[0, 1].float().item() == 1.0 and q[0, 0].float().item() == 448.0
    by_reciprocal = (w[0, 1] * (1 / scale[0, 0])).to(FP8).float().item()
    assert by_reciprocal == 1.125


def test_flashinfers_up_then_gate_order_holds_for_the_scales_too():
    """vLLM's FlashInfer FP8 MoE backend swaps w13 to [w3; w1] for the weights and the
    scales alike (``swap_w13_to_w31``): each expert's scale rows are up's, then gate's."""
    p = init_params(MOE, 0)
    (hf,) = fp8_shards(MOE, endpoint("hf:fp8=block128"), p)
    ranks = fp8_shards(MOE, endpoint("vllm:tp=2,ep=2,kernel=flashinfer_cutlass,fp8=block128"), p)
    pre = "model.layers.0.mlp.experts."
    for r, rank in enumerate(ranks):
        w13 = rank[pre + "routed_experts.w13_weight_scale_inv"]
        for j in range(2):
            e = r * 2 + j
            assert torch.equal(w13[j], torch.cat([hf[pre + f"{e}.up_proj.weight_scale_inv"],
                                                  hf[pre + f"{e}.gate_proj.weight_scale_inv"]]))

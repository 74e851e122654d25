"""``check_convert`` into a block-FP8 endpoint (``vllm:tp=2,fp8=block128``): a correct
quantizing converter passes; each of the field's FP8 sync bugs, planted in it, fails, named
(``FP8_BUGS``, each with the public bug it is): at a toy geometry whose heads are 128 wide,
at a reduced real one (Qwen3-8B's head and MLP widths over fewer heads and layers) and
with MoE experts over EP. ``fp8_kill_matrix`` is the table the closing note reports."""

from __future__ import annotations

import math

import pytest
import torch

from weight_sync_bench import check_convert
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.fp8 import (
    AMAX_FLOOR,
    E4M3_MAX,
    FP8,
    SCALE_SUFFIX,
    SCALE_SUFFIXES,
    expand,
    fp8_shards,
    is_scale,
    quantize_blocks,
    quantize_tensor,
    scheme_of,
)
from weight_sync_bench.conventions.maps import gather_canonical
from weight_sync_bench.errors import UnsupportedConvention, WrongShardShape
from weight_sync_bench.model.config import TOY_KV4, ModelConfig, init_params

TOY_FP8 = ModelConfig(name="toy_fp8", vocab=1000, d_model=256, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=128, ffn=512)
# Qwen3-8B's head_dim (128), GQA ratio (4:1) and MLP width per head, over fewer heads
QWEN3_8B_REDUCED = ModelConfig(name="qwen3_8b_reduced", vocab=2048, d_model=512, n_layers=2,
                               n_heads=8, n_kv_heads=2, head_dim=128, ffn=1536, qk_norm=True)
MOE_FP8 = TOY_FP8.replace(name="toy_fp8_moe", n_experts=4, top_k=2, expert_ffn=256,
                          qk_norm=True)


def good(shards, degree, *, config, source, target, **_):
    """A correct quantizing converter: the source's canonical weights, then the FP8
    destination's tensors."""
    full = gather_canonical(shards, source.pieces(config), config.param_shapes())
    return fp8_shards(config, target, full)


def _first(out, suffix, rank=0):
    return next(n for n in out[rank] if n.endswith(suffix))


def _sfx(kw):
    """The scale's suffix at the converter's destination (per block or per tensor)."""
    return SCALE_SUFFIXES[scheme_of(kw["target"])]


def scale_zero(shards, degree, **kw):
    """THUDM/slime PR #2256: an all-zero block's scale left at amax / 448 = 0, its weights
    0 / 0 = NaN."""
    out = good(shards, degree, **kw)
    name = _first(out, "o_proj.weight")
    out[0][name + _sfx(kw)].view(-1)[0] = 0.0
    out[0][name].view(torch.uint8)[:128, :128] = 0x7F  # e4m3fn NaN
    return out


def scale_unsent(shards, degree, **kw):
    """vllm PR #45835, vime PR #248: a layerwise reload that never sends one
    ``weight_scale_inv``: the engine's parameter keeps its initial fill (vLLM's block scale:
    finfo(float32).min)."""
    out = good(shards, degree, **kw)
    name = _first(out, "o_proj.weight" + _sfx(kw), rank=1)
    out[1][name] = torch.full_like(out[1][name], torch.finfo(torch.float32).min)
    return out


def scale_transposed(shards, degree, **kw):
    """vllm PR #23280: ``weight_scale_inv`` transposed (CUTLASS's layout) where the raw one
    is expected; shape-preserving where the block grid is square (o_proj at TP 2 here)."""
    out = good(shards, degree, **kw)
    name = next(n for n in out[0] if n.endswith(SCALE_SUFFIX) and out[0][n].dim() == 2
                and out[0][n].shape[0] == out[0][n].shape[1]
                and not torch.equal(out[0][n], out[0][n].t()))
    out[0][name] = out[0][name].t().contiguous()
    return out


def scale_other_rank(shards, degree, **kw):
    """A scale of another rank: rank 0's first scale that differs from rank 1's, on rank 1
    (per block, qkv's rows of another TP rank; per tensor, where TP ranks hold the same
    scales, another EP rank's experts')."""
    out = good(shards, degree, **kw)
    name = next(n for n in out[0] if is_scale(n) and n in out[1]
                and not torch.equal(out[0][n], out[1][n]))
    out[1][name] = out[0][name].clone()
    return out


def scale_ue8m0(shards, degree, **kw):
    """sglang PR #30761, vime PR #133: scales in another packing: rounded up to powers of
    two (DeepGEMM's UE8M0) and the weights requantized to them, where the raw ones are
    expected."""
    out = good(shards, degree, **kw)
    for rank in out:
        for name in [n for n in rank if rank[n].dtype == FP8 and rank[n].dim() == 2]:
            w = rank[name].float() * expand(rank[name + SCALE_SUFFIX], *rank[name].shape)
            scale = torch.exp2(torch.ceil(torch.log2(rank[name + SCALE_SUFFIX])))
            rank[name] = (w / expand(scale, *w.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
            rank[name + SCALE_SUFFIX] = scale
    return out


def scale_reciprocal(shards, degree, **kw):
    """Dequantization by multiplying with the inverse of ``weight_scale_inv``: the converter
    stores 448 / amax (the quantizing multiplier) under the dequantizing one's name."""
    out = good(shards, degree, **kw)
    name = _first(out, "o_proj.weight" + _sfx(kw))
    for rank in out:
        rank[name] = 1 / rank[name]
    return out


def scale_per_shard(shards, degree, **kw):
    """A converter that quantizes after its TP cut: each rank's o_proj and down_proj (one
    part each) quantized on its own, with its own rows' amax (per tensor at TP > 1 not the
    full tensor's scale; per block, at a degree vLLM accepts, the same bytes)."""
    out = good(shards, degree, **kw)
    full = kw["target"].unquantized()
    from weight_sync_bench import convert

    plain = convert(shards, kw["source"], full, kw["config"])
    for rank, own in zip(out, plain):
        for name in [n for n in rank if n.endswith(("o_proj.weight", "down_proj.weight"))]:
            rank[name], rank[name + _sfx(kw)] = quantize_tensor(own[name])
    return out


def fused_quantized(shards, degree, *, config, source, target, **_):
    """gate and up quantized as one fused tensor, not each on its own: identical where
    the MLP width is whole blocks; where it is not, blocks straddle gate and up."""
    out = good(shards, degree, config=config, source=source, target=target)
    full = gather_canonical(shards, source.pieces(config), config.param_shapes())
    q, _ = quantize_blocks(full["layers.0.gate_up.weight"])
    f = config.ffn
    name = "model.layers.0.mlp.gate_proj.weight"
    out[0][name] = q[:f].clone()
    return out


FP8_BUGS = {"scale_zero": scale_zero, "scale_unsent": scale_unsent,
            "scale_transposed": scale_transposed, "scale_other_rank": scale_other_rank,
            "scale_ue8m0": scale_ue8m0, "scale_reciprocal": scale_reciprocal}
DIAGNOSED = {"scale_zero": "scale is 0 in 1 blocks", "scale_unsent": "never written",
             "scale_transposed": "transposed", "scale_other_rank": "rank 0's scale",
             "scale_ue8m0": "powers of two", "scale_reciprocal": "reciprocal"}


# per tensor: no block grid to transpose or repack; another rank's scale only where ranks'
# scales differ (EP: per-tensor scales are the same on every TP rank); quantizing per shard
# is a bug at TP > 1
TENSOR_BUGS = {"scale_zero": scale_zero, "scale_unsent": scale_unsent,
               "scale_other_rank": scale_other_rank, "scale_reciprocal": scale_reciprocal,
               "scale_per_shard": scale_per_shard}
DIAGNOSED["scale_per_shard"] = "own shard quantized after the TP cut"


# the bugs that need a second rank (another rank's scale; the unsent one is rank 1's; a
# rank's own shard is the whole tensor at one rank)
MULTI_RANK = ("scale_unsent", "scale_other_rank", "scale_per_shard")


def fp8_kill_matrix(config, src="megatron:2", dst="vllm:tp=2,fp8=block128", **kw):
    """``{bug: (passed, ratio, first mismatch, diagnosis)}`` with the clean converter as
    ``"none"``; at a one-rank destination, the bugs that need two ranks are left out, and
    per tensor another rank's scale only where the destination has EP."""
    rows = {}
    at = endpoint(dst)
    one_rank = at.world == 1
    bugs = FP8_BUGS if scheme_of(at) == "block128" else TENSOR_BUGS
    for name, fn in {"none": good, **bugs}.items():
        if one_rank and name in MULTI_RANK or (name == "scale_other_rank" and bugs is
                                               TENSOR_BUGS and at.ep == 1):
            continue
        v = check_convert(fn, config, src, dst, **kw)
        rows[name] = (v.passed, v.max_abs_error / v.threshold, v.first_mismatch, v.diagnosis)
    return rows


@pytest.mark.parametrize(("config", "dst"), [
    (TOY_FP8, "vllm:tp=2,fp8=block128"), (QWEN3_8B_REDUCED, "vllm:tp=2,fp8=block128"),
    (MOE_FP8, "vllm:tp=2,ep=2,fp8=block128"),
    # TOY_KV4's MLP (704 rows) is not whole blocks, so vLLM refuses it at every degree; an HF
    # FP8 checkpoint quantizes each tensor on its own, partial blocks and all
    (TOY_KV4, "hf:fp8=block128"),
    # per tensor: no cut is refused, so TOY_KV4 is held by vLLM at TP 2 too
    (TOY_FP8, "vllm:tp=2,fp8=tensor"), (QWEN3_8B_REDUCED, "vllm:tp=2,fp8=tensor"),
    (MOE_FP8, "vllm:tp=2,ep=2,fp8=tensor"), (TOY_KV4, "vllm:tp=2,fp8=tensor")],
    ids=["toy", "qwen3_8b_reduced", "moe_ep", "toy_kv4_hf", "tensor_toy",
         "tensor_qwen3_8b_reduced", "tensor_moe_ep", "tensor_toy_kv4"])
def test_a_correct_quantizer_passes_and_every_fp8_bug_fails_named(config, dst):
    rows = fp8_kill_matrix(config, dst=dst, dtype="bf16")
    passed, ratio, first, _ = rows.pop("none")
    assert passed and first is None and ratio < 1, rows
    for name, (passed, ratio, first, diagnosis) in rows.items():
        assert not passed and first is not None, name
        assert any(DIAGNOSED[name] in line for line in diagnosis), (name, diagnosis)
        assert ratio > 1 or math.isinf(ratio) or name == "scale_ue8m0", (name, ratio)


def test_the_verdict_reports_the_quantization_error_apart_from_the_threshold():
    v = check_convert(good, TOY_FP8, "megatron:2", "vllm:tp=2,fp8=block128", dtype="bf16")
    (error,) = [n for n in v.notes if n.startswith("fp8 quantization error")]
    figure = float(error.rsplit(" ", 1)[1])
    assert figure > 100 * v.threshold  # quantization moves the logits far beyond the floor,
    assert v.passed                    # and is never what the check judges


def test_a_fused_quantization_is_told_apart_where_blocks_straddle_gate_and_up():
    """At HF with an MLP width that is not whole blocks, quantizing gate_up as one tensor
    differs from quantizing gate and up each on its own (the definition); where the width
    is whole blocks the two are the same bytes, and the converter passes (its twin)."""
    odd = TOY_FP8.replace(name="toy_fp8_odd", ffn=320)
    weights = init_params(odd, 5)
    weights["layers.0.gate_up.weight"][320:] *= 10  # up's rows hold each straddling block's amax
    v = check_convert(fused_quantized, odd, "megatron:1", "hf:fp8=block128", weights=weights)
    assert not v.passed and v.first_mismatch == "model.layers.0.mlp.gate_proj.weight"
    weights = init_params(TOY_FP8, 5)
    weights["layers.0.gate_up.weight"][512:] *= 10
    assert check_convert(fused_quantized, TOY_FP8, "megatron:1", "hf:fp8=block128",
                         weights=weights).passed


def test_a_quantized_router_and_an_unaligned_cut_are_refused():
    """The router stays in the source dtype (vLLM builds mlp.gate with quant_config=None):
    a converter that sends it FP8 is a wrong dtype; a TP cut that splits a block is refused
    before the converter runs, with vLLM's rule."""
    def router_fp8(shards, degree, **kw):
        out = good(shards, degree, **kw)
        for rank in out:
            name = _first(out, "mlp.gate.weight")
            rank[name] = rank[name].to(FP8)
        return out

    with pytest.raises(WrongShardShape, match=r"mlp.gate.weight: dtype torch.float8_e4m3fn, "
                                              r"declared torch.bfloat16"):
        check_convert(router_fp8, MOE_FP8, "megatron:2", "vllm:tp=2,ep=2,fp8=block128",
                      dtype="bf16")
    ran = []
    with pytest.raises(UnsupportedConvention, match=r"128-blocks"):
        check_convert(lambda s, d, **kw: ran.append(1), TOY_FP8.replace(ffn=320), "megatron:2",
                      "vllm:tp=2,fp8=block128")
    assert not ran


def test_an_all_zero_block_is_quantized_finite_and_its_unclamped_twin_is_nan():
    """A trainer's weights with an all-zero block (slime #2256's case): the definition's
    scale is 1e-12 / 448 and the converter passes; the unclamped quantizer's NaN fails."""
    weights = {n: x.to(torch.bfloat16) for n, x in init_params(TOY_FP8, 4).items()}
    weights["layers.0.down.weight"][:128, :128] = 0

    def unclamped(shards, degree, **kw):
        out = good(shards, degree, **kw)
        name = "model.layers.0.mlp.down_proj.weight"
        assert out[0][name + SCALE_SUFFIX][0, 0].item() == pytest.approx(AMAX_FLOOR / E4M3_MAX)
        out[0][name + SCALE_SUFFIX][0, 0] = 0.0
        out[0][name].view(torch.uint8)[:128, :128] = 0x7F
        return out

    assert check_convert(good, TOY_FP8, "megatron:2", "vllm:tp=2,fp8=block128",
                         weights=weights).passed
    v = check_convert(unclamped, TOY_FP8, "megatron:2", "vllm:tp=2,fp8=block128",
                      weights=weights)
    assert not v.passed and math.isinf(v.max_abs_error)
    assert any(line.startswith("not finite: rank 0 model.layers.0.mlp.down_proj.weight")
               for line in v.diagnosis), v.diagnosis


def test_an_fp8_endpoint_is_refused_where_a_check_does_not_take_it():
    """Every other path reads a convention's index maps, which do not hold scales: they
    refuse an FP8 endpoint by name instead of treating its weights as bf16."""
    with pytest.raises(UnsupportedConvention, match=r"no fp8 option here"):
        endpoint("vllm:tp=2,fp8=block128").pieces(TOY_FP8)


def per_shard(shards, degree, *, config, source, target, **_):
    """Quantizes each rank's own tensor (its merged q/k/v rows or gate/up rows as one, each
    stacked expert on its own), as a converter that quantizes after its TP cut does."""
    from weight_sync_bench import convert

    out = convert(shards, source, target.unquantized(), config)
    declared = fp8_shards(config, target, gather_canonical(shards, source.pieces(config),
                                                           config.param_shapes()))
    for rank, want in zip(out, declared):
        for name in [n for n in want if want[n].dtype == FP8]:
            x = rank[name]
            pairs = [quantize_blocks(m) for m in x] if x.dim() == 3 else [quantize_blocks(x)]
            rank[name] = torch.stack([q for q, _ in pairs]) if x.dim() == 3 else pairs[0][0]
            rank[name + SCALE_SUFFIX] = (torch.stack([s for _, s in pairs]) if x.dim() == 3
                                         else pairs[0][1])
    return out


@pytest.mark.parametrize("dst", ["vllm:tp=1,fp8=block128", "vllm:tp=2,fp8=block128",
                                 "vllm:tp=4,fp8=block128"])
def test_quantizing_per_shard_equals_the_full_tensor_at_every_degree_vllm_accepts(dst):
    """vLLM's rules put every TP cut and every part boundary on a block edge, so a rank's
    own tensor quantized whole has the full tensor's blocks: the same bytes (a degree that
    would split a block is refused before any converter runs, as the test above shows)."""
    assert check_convert(per_shard, TOY_FP8, "megatron:2", dst, dtype="bf16").passed


def test_quantizing_per_shard_per_tensor_passes_at_one_rank():
    """The twin of the per-tensor kill matrix's ``scale_per_shard``: at TP 1 a rank's tensor
    is the whole one, its amax the full tensor's."""
    assert check_convert(scale_per_shard, TOY_FP8, "megatron:2", "vllm:tp=1,fp8=tensor",
                         dtype="bf16").passed

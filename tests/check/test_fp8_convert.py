"""``check_convert`` into a block-FP8 endpoint (``vllm:tp=2,fp8=block128``): a correct
quantizing converter passes; each of the field's FP8 sync bugs, planted in it, fails, named
(``conventions.fp8_mutations``, each with the public bug it is): at a toy geometry whose
heads are 128 wide, at a reduced real one (Qwen3-8B's head and MLP widths over fewer heads
and layers), with MoE experts over EP, and at TOY_KV4; per block and per tensor.
``check.fp8.fp8_kill_matrix`` is the table (``bench/fp8_kill_matrix.py`` prints it)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.breadth import breadth
from tests.check.narrow import narrowed
from weight_sync_bench import check_convert
from weight_sync_bench.check.fp8 import fp8_kill_matrix
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.fp8 import (
    AMAX_FLOOR,
    E4M3_MAX,
    FP8,
    SCALE_SUFFIX,
    fp8_shards,
    quantize_blocks,
    scheme_of,
)
from weight_sync_bench.conventions.fp8_mutations import FP8_MUTATIONS, mutated
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


# TOY_KV4 over a 512-word vocabulary: its MLP's partial blocks, a fifth of its weights
TOY_KV4_NARROW = narrowed(TOY_KV4)
# By default: each scheme on TOY, block on an MoE and an HF destination (TOY_KV4's partial
# blocks over a narrower vocabulary, its threshold measured here); the reduced Qwen3-8B, the
# HF cell on TOY_KV4 itself (judged by its committed FP8 floor: committed FP8 floors judge
# checks by default in test_fp8_floor.py, per tensor at toy_kv4, and test_fp8_checkpoint.py,
# block at HF on toy) and the rest of the per-tensor cells in the long run.
FP8_CELLS = [
    (TOY_FP8, "vllm:tp=2,fp8=block128"), (QWEN3_8B_REDUCED, "vllm:tp=2,fp8=block128"),
    (MOE_FP8, "vllm:tp=2,ep=2,fp8=block128"),
    # TOY_KV4's MLP (704 rows) is not whole blocks, so vLLM refuses it at every degree; an HF
    # FP8 checkpoint quantizes each tensor on its own, partial blocks and all
    (TOY_KV4, "hf:fp8=block128"), (TOY_KV4_NARROW, "hf:fp8=block128"),
    # per tensor: no cut is refused, so TOY_KV4 is held by vLLM at TP 2 too
    (TOY_FP8, "vllm:tp=2,fp8=tensor"), (QWEN3_8B_REDUCED, "vllm:tp=2,fp8=tensor"),
    (MOE_FP8, "vllm:tp=2,ep=2,fp8=tensor"), (TOY_KV4, "vllm:tp=2,fp8=tensor")]
FP8_CELL_IDS = ["toy", "qwen3_8b_reduced", "moe_ep", "toy_kv4_hf", "toy_kv4_vocab512_hf",
                "tensor_toy",
                "tensor_qwen3_8b_reduced", "tensor_moe_ep", "tensor_toy_kv4"]


@pytest.mark.parametrize(("config", "dst"), breadth(
    [pytest.param(*cell, id=name) for cell, name in zip(FP8_CELLS, FP8_CELL_IDS)],
    keep={"toy", "moe_ep", "toy_kv4_vocab512_hf", "tensor_toy"}, name=lambda p: p.id))
def test_a_correct_quantizer_passes_and_every_fp8_bug_fails_named(config, dst):
    """The clean converter passes; each FP8 mutation (``conventions.fp8_mutations``) that
    can occur here fails with its diagnosis (the quantized router: refused by name); the
    rest say why they cannot occur, and nothing else is left out."""
    clean = check_convert(good, config, "megatron:2", dst, dtype="bf16")
    assert clean.passed and clean.first_mismatch is None and clean.ratio < 1
    at = endpoint(dst)
    rows = fp8_kill_matrix(config, endpoint("megatron:2"), at,
                           init_params(config, 0, dtype=torch.bfloat16))
    assert [row.mutation for row in rows] == list(FP8_MUTATIONS)  # every one, in order
    expected_out = {"scale_transposed": at.world == 1 and at.name == "vllm"
                    or scheme_of(at) == "tensor", "scale_ue8m0": scheme_of(at) == "tensor",
                    "scale_other_rank": at.world == 1 or scheme_of(at) == "tensor"
                    and at.ep == 1, "scale_per_shard": at.world == 1,
                    "router_quantized": not config.n_experts}
    for row in rows:
        mutation = FP8_MUTATIONS[row.mutation]
        if row.outcome == "not applicable":
            assert expected_out.get(row.mutation) and row.reason, (row.mutation, row.reason)
            continue
        assert not expected_out.get(row.mutation), row.mutation
        if row.mutation == "scale_per_shard" and scheme_of(at) == "block128":
            assert row.outcome == "identity" and row.reason, row  # cuts on block edges only
            continue
        if row.outcome == "refused":
            assert row.mutation == "router_quantized" and mutation.named in row.reason
            continue
        assert row.outcome == "killed", row
        v = row.verdict
        assert not v.passed and v.first_mismatch is not None, row.mutation
        assert v.threshold == clean.threshold  # every row judged as the clean check is
        # the diagnosis names the rank and the tensor that differs first
        assert v.diagnosis[0].startswith("rank ") and v.first_mismatch in v.diagnosis[0] \
            or v.diagnosis[0].startswith("not finite: rank "), v.diagnosis
        assert any(mutation.named in line for line in v.diagnosis), (row.mutation, v.diagnosis)
        assert v.ratio > 1 or math.isinf(v.ratio) or row.mutation == "scale_ue8m0", row


def test_the_verdict_reports_the_quantization_error_apart_from_the_threshold():
    v = check_convert(good, TOY_FP8, "megatron:2", "vllm:tp=2,fp8=block128", dtype="bf16")
    (error,) = [n for n in v.notes if n.startswith("fp8 quantization error")]
    figure = float(error.rsplit(" ", 1)[1])
    # quantization moves the logits far beyond the threshold (67x the committed FP8 floor's,
    # which judges where the sharded forwards sum exactly, as on an AVX-512 Intel CPU; more
    # where the threshold is measured), and is never what the check judges
    assert figure > 10 * v.threshold
    assert v.passed


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
    at = endpoint("vllm:tp=2,ep=2,fp8=block128")
    out = mutated(FP8_MUTATIONS["router_quantized"], MOE_FP8, at,
                  init_params(MOE_FP8, 0, dtype=torch.bfloat16))
    with pytest.raises(WrongShardShape, match=r"mlp.gate.weight: dtype torch.float8_e4m3fn, "
                                              r"declared torch.bfloat16"):
        check_convert(lambda shards, degree: out, MOE_FP8, "megatron:2", at, dtype="bf16")
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
    at = endpoint("vllm:tp=1,fp8=tensor")
    out = mutated(FP8_MUTATIONS["scale_per_shard"], TOY_FP8, at, init_params(TOY_FP8, 0))
    assert check_convert(lambda shards, degree: out, TOY_FP8, "megatron:2", at).passed


def test_a_negative_zero_where_a_zero_is_declared_fails_on_its_bytes():
    """Data movement bit for bit: an all-zero block quantizes to e4m3 +0 (byte 0x00); a
    converter writing -0 (0x80) there dequantizes to the same values, and fails on its bytes
    anyway (a value comparison would pass it). The twin: the declared zeros pass."""
    weights = init_params(TOY_FP8, 4)
    weights["layers.0.down.weight"][:128, :128] = 0
    name = "model.layers.0.mlp.down_proj.weight"

    def negative_zero(shards, degree, **kw):
        out = good(shards, degree, **kw)
        block = out[0][name].view(torch.uint8)[:128, :128]
        assert bool((block == 0).all())  # the declared zeros
        block.fill_(0x80)
        return out

    at = "vllm:tp=2,fp8=block128"
    assert check_convert(good, TOY_FP8, "megatron:2", at, weights=weights).passed
    v = check_convert(negative_zero, TOY_FP8, "megatron:2", at, weights=weights)
    assert not v.passed and v.first_mismatch == name
    assert v.max_abs_error <= v.threshold  # the forward cannot see it: only the bytes can


def _scale_set(how):
    """A converter whose rank 0 o_proj scale is changed by ``how`` (the grid, in place)."""
    def converter(shards, degree, **kw):
        out = good(shards, degree, **kw)
        name = _scale_of(out, "o_proj.weight")
        out[0][name] = how(out[0][name].clone())
        return out
    return converter


def _scale_of(out, suffix):
    return next(n for n in out[0] if n.endswith(suffix + SCALE_SUFFIX))


@pytest.mark.parametrize(("how", "said"), [
    (lambda s: torch.ones_like(s), "holds ones (FusedMoE's initial scale): never written"),
    (lambda s: torch.zeros_like(s), "holds zeros: a scale of 0 dequantizes every weight to 0"),
    (lambda s: s.view(-1).index_fill_(0, torch.tensor([1]), float("nan")).view(s.shape),
     "holds NaN in 1 of 4 blocks"),
    (lambda s: s.view(-1).index_fill_(0, torch.tensor([0]), 1.5).view(s.shape),
     ": 1 of 4 block scales differ")],
    ids=["ones", "zeros", "nan", "one_block"])
def test_each_kind_of_wrong_scale_is_named_as_what_it_holds(how, said):
    """The scale diagnoses one by one, at rank 0's o_proj (a 2 x 2 grid at TP 2): vLLM
    FusedMoE's initial ones, zeros, NaN in one block (a count), and one block changed (a
    count)."""
    v = check_convert(_scale_set(how), TOY_FP8, "megatron:2", "vllm:tp=2,fp8=block128",
                      dtype="bf16")
    name = "model.layers.0.self_attn.o_proj.weight" + SCALE_SUFFIX
    assert not v.passed and v.first_mismatch == name
    assert v.diagnosis[0].startswith(f"rank 0 {name}") and said in v.diagnosis[0], v.diagnosis

"""``conventions.fp8``'s quantization and its parts (issue 30, the mutation pass over
``conventions/fp8.py``).

DeepSeek-V3's block scheme (``weight_scale_inv``, one float32 scale per 128 x 128 tile,
``amax / 448``) and the per-tensor one, computed here tile by tile from their definition,
at another block size too (the block is a parameter); and the HF tensors each canonical
parameter is quantized as, each on its own: a shared expert's gate and up
(Qwen2-MoE's ``shared_expert.gate_proj`` / ``up_proj``) and each routed expert's down
columns (``experts.{x}.down_proj``), where a fused quantization would give other scales."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.fp8 import (
    AMAX_FLOOR,
    E4M3_MAX,
    FP8,
    dequantize_blocks,
    fp8_shards,
    parts,
    quantize_blocks,
    quantize_canonical,
    quantize_tensor,
    scheme_of,
    shard_quantized,
)
from weight_sync_bench.model.config import ModelConfig, init_params


def tiles(w, block):
    """Each tile of ``w``, ``(i, j, rows, cols)``: the scheme's definition, partial tiles at
    the far edges."""
    n, k = w.shape
    for i in range(0, n, block):
        for j in range(0, k, block):
            yield i // block, j // block, slice(i, i + block), slice(j, j + block)


@pytest.mark.parametrize("block", [64, 128])
def test_block_quantization_is_each_tiles_amax_over_448_at_any_block_size(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(150, 200, generator=g) * torch.linspace(0.01, 3, 200)
    w[:block, :block] = 0.0  # an all-zero tile: the amax floor, not 0 / 0
    q, s = quantize_blocks(w, block)
    grid = (-(-150 // block), -(-200 // block))
    assert s.shape == grid and s.dtype == torch.float32 and q.dtype == FP8
    want_q = torch.empty_like(q)
    for i, j, r, c in tiles(w, block):
        scale = w[r, c].abs().amax().clamp(min=AMAX_FLOOR) / E4M3_MAX
        assert s[i, j] == scale, (i, j)
        want_q[r, c] = (w[r, c] / scale).to(FP8)  # the cast saturates at +-448 itself
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert s[0, 0] == AMAX_FLOOR / E4M3_MAX and not q[:block, :block].float().any()
    back = dequantize_blocks(q, s, block)
    for i, j, r, c in tiles(w, block):
        assert torch.equal(back[r, c], q[r, c].float() * s[i, j]), (i, j)


def test_per_tensor_quantization_is_one_amax_over_448():
    w = torch.randn(30, 40, generator=torch.Generator().manual_seed(1))
    q, s = quantize_tensor(w)
    scale = w.abs().amax() / E4M3_MAX
    assert s.shape == (1,) and s.item() == scale.item()
    assert torch.equal(q.view(torch.uint8), (w / scale).to(FP8).view(torch.uint8))


def test_the_scheme_of_an_endpoint_that_is_not_fp8_is_an_error_naming_it():
    assert scheme_of(endpoint("vllm:tp=2,fp8=tensor")) == "tensor"
    assert scheme_of(endpoint("hf:fp8=block128")) == "block128"
    with pytest.raises(AssertionError, match="vllm:2"):
        scheme_of(endpoint("vllm:tp=2"))


MOE = ModelConfig(name="moe_shared", vocab=64, d_model=32, n_layers=1, n_heads=4,
                  n_kv_heads=2, head_dim=8, ffn=24, n_experts=3, top_k=2, expert_ffn=8,
                  shared_ffn=12, batch=1, seq_len=4)


@pytest.mark.parametrize("scheme", ["block128", "tensor"])
def test_a_shared_experts_gate_and_up_and_each_experts_down_are_quantized_on_their_own(
        scheme):
    """Every part below is narrower than a block: quantized fused, each of these would
    get one scale where HF's tensors have two or three."""
    params = init_params(MOE, 0)
    values, scales = quantize_canonical(MOE, params, scheme)

    def alone(w):
        return quantize_blocks(w) if scheme == "block128" else quantize_tensor(w)

    s = MOE.shared_ffn
    shared = params["layers.0.shared.gate_up.weight"]
    assert parts(MOE, "layers.0.shared.gate_up.weight") == (0, [(0, s), (s, 2 * s)])
    want = [alone(shared[:s]), alone(shared[s:])]
    got = values["layers.0.shared.gate_up.weight"]
    assert got.shape == shared.shape
    assert torch.equal(got.view(torch.uint8), torch.cat(
        [q.view(torch.uint8) for q, _ in want]))
    assert [x.tolist() for x in scales["layers.0.shared.gate_up.weight"]] == [
        x.tolist() for _, x in want]

    g, e = MOE.expert_ffn, MOE.n_experts
    down = params["layers.0.experts.down.weight"]
    assert parts(MOE, "layers.0.experts.down.weight") == (
        1, [(x * g, (x + 1) * g) for x in range(e)])
    want = [alone(down[:, x * g:(x + 1) * g]) for x in range(e)]
    got = values["layers.0.experts.down.weight"]
    assert torch.equal(got.view(torch.uint8), torch.cat(
        [q.view(torch.uint8) for q, _ in want], 1))
    assert [x.tolist() for x in scales["layers.0.experts.down.weight"]] == [
        x.tolist() for _, x in want]


def test_an_hf_fp8_checkpoints_quantization_config_per_block_and_per_tensor():
    """DeepSeek-V3's config.json (README_WEIGHTS.md) per block; vLLM's ``Fp8Config`` reads
    a config without ``weight_block_size`` as per tensor."""
    from weight_sync_bench.conventions.fp8 import (
        QUANTIZATION_CONFIG,
        quantization_config,
    )

    block = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": [128, 128]}
    assert quantization_config("block128") == block
    assert quantization_config("tensor") == {k: v for k, v in block.items()
                                             if k != "weight_block_size"}
    assert QUANTIZATION_CONFIG == block  # deleting the key per tensor left the table whole


# every stored layout: dense and MoE (w13 / w2 stacked, a shared expert), vLLM's TP and EP
# and an HF checkpoint's one rank, per block and per tensor
# (an expert's width is not d_model: its down's scale grid is not square; one of d_model 128:
# its down's grid one block high, which a stacked [E, 1, k] keeps)
MOE_BLOCKS = ModelConfig(name="moe_blocks", vocab=1000, d_model=256, n_layers=1, n_heads=4,
                         n_kv_heads=2, head_dim=128, ffn=512, n_experts=4, top_k=2,
                         expert_ffn=512, shared_ffn=256, qk_norm=True)
DENSE_BLOCKS = MOE_BLOCKS.replace(name="dense_blocks", n_experts=0, top_k=0, expert_ffn=0,
                                  shared_ffn=0, qk_norm=False)
MOE_NARROW = MOE_BLOCKS.replace(name="moe_narrow", d_model=128, n_heads=2, n_kv_heads=1,
                                expert_ffn=256)
LAYOUTS = [(DENSE_BLOCKS, "vllm:tp=2,fp8=block128"), (DENSE_BLOCKS, "vllm:tp=2,fp8=tensor"),
           (MOE_BLOCKS, "vllm:tp=2,ep=2,fp8=block128"), (MOE_BLOCKS, "vllm:tp=2,ep=2,fp8=tensor"),
           (MOE_BLOCKS, "vllm:tp=2,fp8=block128"), (MOE_BLOCKS, "hf:fp8=block128"),
           (MOE_BLOCKS, "hf:fp8=tensor"), (MOE_NARROW, "vllm:tp=2,ep=2,fp8=block128")]
IDS = ["dense_block", "dense_tensor", "moe_ep_block", "moe_ep_tensor", "moe_tp_block",
       "moe_hf_block", "moe_hf_tensor", "moe_narrow_ep_block"]


@pytest.fixture(scope="module", params=range(len(LAYOUTS)), ids=IDS)
def stored(request):
    config, dst = LAYOUTS[request.param]
    at = endpoint(dst)
    params = init_params(config, 0)
    return config, at, params, fp8_shards(config, at, params)


def test_the_shapes_said_before_quantizing_are_the_stored_tensors(stored):
    from weight_sync_bench.conventions.fp8 import fp8_shapes, require_stored

    config, at, params, shards = stored
    said = fp8_shapes(config, at)
    assert len(said) == len(shards)
    for rank, (shapes, tensors) in enumerate(zip(said, shards)):
        assert list(shapes) == list(tensors), rank
        for name, (shape, dtype) in shapes.items():
            x = tensors[name]
            assert tuple(x.shape) == shape, (rank, name)
            assert dtype is None and x.dtype == params[next(iter(params))].dtype \
                or x.dtype == dtype, (rank, name, dtype)
    require_stored(config, at)  # the twin of the refusal below: nothing raised


def test_each_stored_tensor_dequantizes_to_its_cut_of_the_dequantized_model(stored):
    """``dequantize_stored`` of every FP8 tensor a rank holds, beside its scale, is the
    rank's cut (the convention's own map) of the canonical model dequantized part by part."""
    from weight_sync_bench.conventions.fp8 import (
        dequantize_canonical,
        dequantize_stored,
        is_scale,
        scale_name,
    )

    config, at, params, shards = stored
    scheme = scheme_of(at)
    values, scales = quantize_canonical(config, params, scheme)
    model = dequantize_canonical(config, values, scales, params, scheme)
    seen = 0
    for rank, pieces in zip(shards, at.unquantized().pieces(config)):
        for name, piece in pieces.items():
            if rank[name].dtype != FP8:
                continue
            assert not is_scale(name)
            got = dequantize_stored(config, piece, rank[name], rank[scale_name(name, scheme)],
                                    scheme)
            assert torch.equal(got, piece.take(model[piece.source])), name
            seen += 1
    assert seen >= 4


def test_a_shard_quantized_after_its_cut_is_each_part_it_holds_quantized_on_its_own(stored):
    """``shard_quantized`` against its definition: each rank's FP8 tensor, dequantized
    through the canonical map, is the rank's float cut with each HF part it holds (each
    stacked expert's gate and up, its down) quantized alone, and its scale the parts' own
    (per tensor: one per part held, by part index)."""
    from weight_sync_bench.conventions.fp8 import is_quantized, scale_name, segments

    config, at, params, _ = stored
    scheme = scheme_of(at)
    own = shard_quantized(config, at, params)
    for rank, pieces in zip(own, at.unquantized().pieces(config)):
        names = [n for n, p in pieces.items() if is_quantized(p.source)]
        assert sorted(rank) == sorted(names + [scale_name(n, scheme) for n in names])
        for name in names:
            piece = pieces[name]
            local = piece.take(params[piece.source])
            members = piece.members() if piece.is_stacked else [piece]
            xs = local if piece.is_stacked else [local]
            qs, ss = [], []
            for m, x in zip(members, xs):
                dim, segs = segments(config, m)
                alone = {p: (quantize_blocks(x.narrow(dim, a, b - a)) if scheme == "block128"
                             else quantize_tensor(x.narrow(dim, a, b - a)))
                         for a, b, p in segs}
                qs.append(torch.cat([alone[p][0].view(torch.uint8) for _, _, p in segs], dim))
                ss.append(torch.cat([alone[p][1] for _, _, p in segs], dim)
                          if scheme == "block128" else
                          torch.cat([alone[p][1] for p in sorted(alone)]))
            want_q = torch.stack(qs) if piece.is_stacked else qs[0]
            want_s = torch.stack(ss) if piece.is_stacked else ss[0]
            if piece.is_stacked and scheme == "tensor" and want_s.shape[1] == 1:
                want_s = want_s.squeeze(1)  # w2: one part a member, [E]
            assert torch.equal(rank[name].view(torch.uint8), want_q), name
            assert torch.equal(rank[scale_name(name, scheme)], want_s), name


def test_a_refused_fp8_cut_names_the_tensor_vllms_rule_and_the_rows():
    from weight_sync_bench.conventions.fp8 import require_stored
    from weight_sync_bench.errors import UnsupportedConvention

    config = DENSE_BLOCKS.replace(name="c4", n_heads=6, head_dim=64, d_model=384)
    rule = ("each part's rows on 128-blocks (vLLM validate_fp8_block_shape: Weight "
            "output_partition_size is not divisible by weight quantization block_n = 128; "
            "Fp8MoEMethod: the output_size of gate's and up's weight)")
    text = (f"vllm: model.layers.0.self_attn.qkv_proj.weight needs {rule} "
            "(rows 0-191 of part 0 (384 rows), t=2)")
    for refuse in (require_stored, lambda c, at: fp8_shards(c, at, init_params(c, 0))):
        with pytest.raises(UnsupportedConvention) as info:
            refuse(config, endpoint("vllm:tp=2,fp8=block128"))
        assert str(info.value) == text
    # per tensor, no cut is refused (the twin)
    require_stored(config, endpoint("vllm:tp=2,fp8=tensor"))


def test_an_hf_checkpoint_quantizes_a_part_that_starts_off_a_block_whole():
    """An HF checkpoint stores q, k and v apart, each quantized whole: k starts at row 96
    of the canonical qkv, off every block edge, and is accepted with its own partial
    block (the rule reads the rows from the part's own start)."""
    from weight_sync_bench.conventions.fp8 import require_stored

    config = ModelConfig(name="q96", vocab=64, d_model=96, n_layers=1, n_heads=3,
                         n_kv_heads=1, head_dim=32, ffn=160, batch=1, seq_len=4)
    at = endpoint("hf:fp8=block128")
    require_stored(config, at)
    (rank,) = fp8_shards(config, at, init_params(config, 0))
    k = "model.layers.0.self_attn.k_proj.weight"
    assert rank[k].shape == (32, 96) and rank[k + "_scale_inv"].shape == (1, 1)

"""FP8 linear weights (``float8_e4m3fn``), in two schemes (an endpoint's ``fp8=`` option):
``block128``, a float32 ``weight_scale_inv`` per 128 x 128 block, and ``tensor``, one float32
``weight_scale`` per HF tensor. The harness's reference quantizer, and what each rank of a
convention stores when its linear weights are FP8, weights and scales cut as the engine's
loader cuts them.

The quantizer, from the definition (slime ``tools/convert_hf_to_fp8.py::block_fp8`` after
THUDM/slime PR #2256, and DeepSeek-V3 ``README_WEIGHTS.md``): each HF tensor on its own and
whole (as slime quantizes after the TP all-gather and the HF rename), cut into 128 x 128
blocks (a partial block at the end of a dim is zero-padded for its amax, then cropped);
per block ``scale = max(amax, 1e-12) / 448`` in float32 (the clamp is #2256's: an all-zero
block once gave scale 0 and NaN weights), stored as ``weight_scale_inv`` (the dequantizing
multiplier, DeepSeek's name); ``q = clamp(w / scale, -448, 448)`` cast to ``float8_e4m3fn``
by torch (round to nearest even). Dequantized: ``q.float() * scale`` broadcast per block
(DeepSeek ``inference/kernel.py::weight_dequant``). The per-tensor scheme is the same
definition with one block as large as the tensor (slime ``quantizer_fp8.py::_quantize_param``
without ``weight_block_size``, THUDM/slime 624b824a: ``scale = amax.clamp(min=1e-12) / 448``
of shape ``[1]``, stored as ``weight_scale``, the same dequantizing multiplier under another
name). Other quantizers round differently
(slime's Triton kernel multiplies by an approximate reciprocal with an amax floor of 1e-10;
HF stores ``1 / (448 / amax)``): a converter is compared with this definition bit for bit,
so a different rounding is a difference the check reports, never absorbed.

What is quantized (vLLM ``Fp8Config.get_quant_method``: only ``LinearBase`` and ``FusedMoE``
layers; the MoE router ``mlp.gate`` is built with ``quant_config=None`` in
``qwen3_moe.py`` / ``qwen2_moe.py``, ``shared_expert_gate`` is a plain ``nn.Linear``; slime
``quantizer_fp8.py::quantize_params_fp8`` skips embeddings, the output layer, norms, the
router, the shared-expert gate and biases): the attention ``qkv`` and ``o_proj``, the MLP's
``gate_up`` and ``down``, the experts' and the shared experts'. Everything else stays in the
source dtype.

The HF tensors a canonical parameter is quantized as (``parts``): ``qkv`` as q, k and v;
``gate_up`` as gate and up; each expert's gate, up and down; the rest whole. A stored
tensor's scale is cut from its parts' scale grids along the dim the convention cuts the
weight (vLLM's loader: ``adjust_block_scale_shard`` divides offsets and sizes by 128,
``load_qkv_weight`` / ``load_merged_column_weight`` stack the parts' scale rows in the
weight's order, ``load_row_parallel_weight`` narrows the scale's columns, FusedMoE
``_load_w13`` / ``_load_w2`` per expert; vllm ``linear.py``, ``parameter.py``,
``fused_moe/layer.py``, 2026). A cut that splits a block cannot be made:
``UnsupportedConvention`` with vLLM's own rule (``fp8_utils.py::validate_fp8_block_shape``,
``Fp8MoEMethod.create_weights``). Per-tensor scales are not cut: a rank stores one scale per
part it holds, indexed by the part (vLLM ``create_fp8_scale_parameter``: a
``PerTensorScaleParameter`` of ``len(output_partition_sizes)``, loaded at the shard id's
index: ``[3]`` for ``qkv_proj``, ``[2]`` for ``gate_up_proj``, ``[1]`` for ``o_proj`` and
``down_proj``; ``Fp8MoEMethod.create_weights``: ``w13_weight_scale`` ``[E, 2]``, ``w2_weight_scale``
``[E]``), as loaded, before ``process_fp8_weight_tensor_strategy`` requantizes a merged
tensor to the largest of its scales. No cut splits anything, so no degree is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.convention import need

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.conventions.maps import Piece
    from weight_sync_bench.model.config import ModelConfig

BLOCK = 128
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-12  # slime PR #2256's clamp: an all-zero block gets a finite scale
FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv (DeepSeek-V3, vLLM's loader)
# Each scheme's scale name: block scales weight_scale_inv, per-tensor ones weight_scale
# (slime _quantize_param, vLLM Fp8LinearMethod.create_weights)
SCALE_SUFFIXES = {"block128": SCALE_SUFFIX, "tensor": "_scale"}
# The canonical parameters whose weights are FP8 (per layer, "layers.{i}." before each).
QUANTIZED = ("qkv.weight", "o_proj.weight", "gate_up.weight", "down.weight",
             "experts.gate_up.weight", "experts.down.weight", "shared.gate_up.weight",
             "shared.down.weight")

Params = dict[str, torch.Tensor]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scheme_of(where: Endpoint) -> str:
    """An FP8 endpoint's scheme (its ``fp8=`` option): ``block128`` or ``tensor``."""
    scheme = dict(where.options).get("fp8", "none")
    assert scheme in SCALE_SUFFIXES, (str(where), scheme)
    return scheme


def scale_name(name: str, scheme: str) -> str:
    """The name of the scale stored beside the FP8 tensor ``name``."""
    return name + SCALE_SUFFIXES[scheme]


def is_scale(name: str) -> bool:
    """Whether a stored name is a scale (either scheme's)."""
    return name.endswith(tuple(SCALE_SUFFIXES.values()))


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor as FP8 weights and their float32 ``weight_scale_inv``
    ``[cdiv(n, block), cdiv(k, block)]`` (the module docstring's definition)."""
    assert w.dim() == 2, w.shape
    n, k = w.shape
    x = w.float()
    padded = torch.zeros(cdiv(n, block) * block, cdiv(k, block) * block)
    padded[:n, :k] = x
    tiles = padded.view(cdiv(n, block), block, cdiv(k, block), block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    q = (x / expand(scale, n, k, block)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor as FP8 weights and its one float32 ``weight_scale`` ``[1]`` (the per-tensor
    scheme: the block definition with one block)."""
    x = w.float()
    scale = x.abs().amax().clamp(min=AMAX_FLOOR).reshape(1) / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` quantized by ``scheme``: FP8 weights and their scale."""
    return quantize_blocks(w) if _block(scheme) else quantize_tensor(w)


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """One part's FP8 weights times its scale: per block, or the one per-tensor scale."""
    return dequantize_blocks(q, scale) if _block(scheme) else q.float() * scale


def _block(scheme: str) -> bool:
    """Whether ``scheme`` is the block one; a name that is neither scheme is refused (it
    would otherwise read as per tensor)."""
    if scheme not in SCALE_SUFFIXES:
        raise ValueError(f"FP8 scheme {scheme!r}: expected one of {sorted(SCALE_SUFFIXES)}")
    return scheme == "block128"


def expand(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """A scale grid as one value per element of the ``[n, k]`` tensor it scales."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``q.float() * scale`` per block: the float32 weights an FP8 forward computes with."""
    n, k = q.shape
    return q.float() * expand(scale, n, k, block)


def parts(config: ModelConfig, source: str) -> tuple[int, list[tuple[int, int]]]:
    """The HF tensors the canonical parameter ``source`` is quantized as: the dim they tile
    and each one's ``(start, stop)`` along it (q, k, v rows of ``qkv``; gate, up rows of a
    ``gate_up``; each expert's gate and up rows, or its down columns)."""
    kind = source.split(".", 2)[-1]
    q, kv, f, e = config.q_rows, config.kv_rows, config.ffn, config.n_experts
    if kind == "qkv.weight":
        return 0, [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    if kind == "gate_up.weight":
        return 0, [(0, f), (f, 2 * f)]
    if kind == "shared.gate_up.weight":
        s = config.shared_ffn
        return 0, [(0, s), (s, 2 * s)]
    if kind == "experts.gate_up.weight":
        g = config.expert_ffn
        return 0, [(x * 2 * g + h, x * 2 * g + h + g) for x in range(e) for h in (0, g)]
    if kind == "experts.down.weight":
        g = config.expert_ffn
        return 1, [(x * g, (x + 1) * g) for x in range(e)]
    shape = config.param_shapes()[source]
    return 0, [(0, shape[0])]


def is_quantized(source: str) -> bool:
    """Whether the canonical parameter ``source`` is stored FP8."""
    return source.split(".", 2)[-1] in QUANTIZED


def quantize_canonical(config: ModelConfig, params: Mapping[str, torch.Tensor],
                       scheme: str = "block128"
                       ) -> tuple[Params, dict[str, list[torch.Tensor]]]:
    """Every quantized canonical parameter as FP8 values in the canonical layout (each HF
    part quantized whole, on its own), and each one's parts' scales (block grids, or
    ``[1]`` per tensor), in ``parts`` order."""
    values: Params = {}
    scales: dict[str, list[torch.Tensor]] = {}
    for source, w in params.items():
        if not is_quantized(source):
            continue
        dim, spans = parts(config, source)
        pieces, grids = [], []
        for a, b in spans:
            q, s = quantize(w.narrow(dim, a, b - a), scheme)
            pieces.append(q)
            grids.append(s)
        values[source] = torch.cat([p.view(torch.uint8) for p in pieces], dim).view(FP8)
        scales[source] = grids
    return values, scales


def dequantize_canonical(config: ModelConfig, values: Mapping[str, torch.Tensor],
                         scales: Mapping[str, list[torch.Tensor]],
                         params: Mapping[str, torch.Tensor], scheme: str = "block128"
                         ) -> Params:
    """The canonical parameters an FP8 endpoint's forward computes with: the quantized ones
    dequantized, part by part, the rest ``params``' own, all float32."""
    out = {}
    for source, w in params.items():
        if source not in values:
            out[source] = w.float()
            continue
        dim, spans = parts(config, source)
        out[source] = torch.cat([dequantize(values[source].narrow(dim, a, b - a), s, scheme)
                                 for (a, b), s in zip(spans, scales[source])], dim)
    return out


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """``idx`` as maximal runs of consecutive indices, ``(start, stop)``."""
    out: list[tuple[int, int]] = []
    for i in idx.tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def segments(config: ModelConfig, piece: Piece) -> tuple[int, list[tuple[int, int, int]]]:
    """Where a plain (unstacked) piece's parts lie in the stored tensor: the dim the parts
    tile and ``(start, stop, part)`` along it, in stored order (a dim the piece does not cut
    holds every part whole, where it is in the canonical tensor)."""
    dim, spans = parts(config, piece.source)
    if piece.dim != dim:
        return dim, [(a, b, p) for p, (a, b) in enumerate(spans)]
    out: list[tuple[int, int, int]] = []
    at = 0
    for a, b in _runs(piece.idx):
        while a < b:  # a run may cross from one part into the next
            p = next(p for p, (s, e) in enumerate(spans) if s <= a < e)
            stop = min(b, spans[p][1])
            out.append((at, at + stop - a, p))
            at, a = at + stop - a, stop
    return dim, out


def _tensor_scale(config: ModelConfig, piece: Piece, scales: list[torch.Tensor]
                  ) -> torch.Tensor:
    """The per-tensor ``weight_scale`` beside a piece: one per part it holds, by part index
    (vLLM loads each at its shard id's index); stacked experts ``[E, 2]`` for ``w13``, ``[E]``
    where each member holds one part (``w2``)."""
    if piece.is_stacked:
        out = torch.stack([_tensor_scale(config, m, scales) for m in piece.members()])
        return out.squeeze(1) if out.shape[1] == 1 else out
    held = sorted({p for _, _, p in segments(config, piece)[1]})
    return torch.cat([scales[p] for p in held])


def stored_scale(config: ModelConfig, where: Endpoint, name: str, piece: Piece,
                 grids: list[torch.Tensor]) -> torch.Tensor:
    """The scale a rank stores beside the FP8 tensor ``name`` (``piece`` of its canonical
    parameter): per tensor, ``_tensor_scale``; per block, the parts' scale blocks of the rows
    (or columns) the piece selects, in its order, stacked pieces (vLLM's ``w13_weight``)
    member by member."""
    if scheme_of(where) == "tensor":
        return _tensor_scale(config, piece, grids)
    if piece.is_stacked:
        return torch.stack([stored_scale(config, where, name, m, grids)
                            for m in piece.members()])
    dim, spans = parts(config, piece.source)
    assert piece.padding is None, (name, "FP8 weights have no padding rows")
    runs = _runs(piece.idx)
    if piece.dim != dim:  # the parts tile the other dim: each part's grid, cut along this one
        blocks = []
        for a, b in runs:
            need(a % BLOCK == 0 and (b - a) % BLOCK == 0 or len(runs) == 1 and a == 0,
                 where.name, name, where.degree,
                 f"a cut along dim {piece.dim} on 128-blocks (vLLM validate_fp8_block_shape: "
                 "Weight input_size_per_partition is not divisible by weight quantization "
                 "block_k = 128)", f"columns {a}-{b - 1}")
            blocks.append((a // BLOCK, cdiv(b, BLOCK)))
        return torch.cat([torch.cat([g.narrow(piece.dim, x, y - x) for x, y in blocks],
                                    piece.dim) for g in grids], dim)
    out = []
    # several parts in one stored tensor (vLLM's merged qkv_proj, gate_up_proj, w13): every
    # part's rows whole blocks, even at TP 1 (validate_fp8_block_shape's merged-GEMM rule)
    merged = len({p for a, b in runs for p, (s, e) in enumerate(spans) if s < b and a < e}) > 1
    for a, b in runs:
        while a < b:  # a run may cross from one part into the next
            p = next(p for p, (s, e) in enumerate(spans) if s <= a < e)
            s, e = spans[p]
            stop = min(b, e)
            whole = stop == e and not merged
            need((a - s) % BLOCK == 0 and ((stop - a) % BLOCK == 0 or whole and a == s),
                 where.name, name, where.degree,
                 "each part's rows on 128-blocks (vLLM validate_fp8_block_shape: Weight "
                 "output_partition_size is not divisible by weight quantization block_n = "
                 "128; Fp8MoEMethod: the output_size of gate's and up's weight)",
                 f"rows {a - s}-{stop - s - 1} of part {p} ({e - s} rows)")
            out.append(grids[p].narrow(dim, (a - s) // BLOCK, cdiv(stop - s, BLOCK) -
                                       (a - s) // BLOCK))
            a = stop
    return torch.cat(out, dim)


def fp8_shards(config: ModelConfig, where: Endpoint, params: Mapping[str, torch.Tensor], *,
               quantized: tuple[Params, dict[str, list[torch.Tensor]]] | None = None
               ) -> list[Params]:
    """What each rank of ``where`` stores when its linear weights are FP8: the FP8 weights
    cut from the quantized canonical parameters by the convention's own index maps, each
    beside its scale; the other tensors as ``where`` stores them, in ``params``' dtype.
    ``quantized``: ``quantize_canonical(config, params, scheme)`` where the caller has it."""
    scheme = scheme_of(where)
    values, scales = quantized or quantize_canonical(config, params, scheme)
    out = []
    for rank in where.unquantized().pieces(config):
        shards: Params = {}
        for name, piece in rank.items():
            if piece.source not in values:
                shards[name] = piece.take(params[piece.source])
                continue
            raw = values[piece.source].view(torch.uint8)
            shards[name] = piece.take(raw).view(FP8)
            shards[scale_name(name, scheme)] = stored_scale(config, where, name, piece,
                                                            scales[piece.source])
        out.append(shards)
    return out


def shard_quantized(config: ModelConfig, where: Endpoint, params: Mapping[str, torch.Tensor]
                    ) -> list[Params]:
    """What each rank would store if its own shard were quantized after the TP cut (each
    part it holds on its own, each stacked expert on its own), as a converter that
    quantizes per shard writes: the full tensor's bytes wherever every cut is on a block
    edge (always, at a degree vLLM accepts), another amax per shard for per-tensor scales
    at TP > 1. The diagnosis names it."""
    scheme = scheme_of(where)
    out = []
    for rank in where.unquantized().pieces(config):
        shards: Params = {}
        for name, piece in rank.items():
            if not is_quantized(piece.source):
                continue
            local = piece.take(params[piece.source])
            pairs = [_quantize_segments(config, m, x, scheme) for m, x in
                     zip(piece.members(), local if piece.is_stacked else [local])]
            if piece.is_stacked:
                shards[name] = torch.stack([q.view(torch.uint8) for q, _ in pairs]).view(FP8)
                scale = torch.stack([s for _, s in pairs])
                shards[scale_name(name, scheme)] = (scale.squeeze(1) if scheme == "tensor"
                                                    and scale.shape[1] == 1 else scale)
            else:
                shards[name], shards[scale_name(name, scheme)] = pairs[0]
        out.append(shards)
    return out


def _quantize_segments(config: ModelConfig, piece: Piece, local: torch.Tensor, scheme: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain piece's stored tensor quantized part by part where it lies (``segments``)."""
    dim, segs = segments(config, piece)
    pairs = {p: quantize(local.narrow(dim, a, b - a), scheme) for a, b, p in segs}
    q = torch.cat([pairs[p][0].view(torch.uint8) for _, _, p in segs], dim).view(FP8)
    if scheme == "tensor":
        return q, torch.cat([pairs[p][1] for p in sorted(pairs)])
    return q, torch.cat([pairs[p][1] for _, _, p in segs], dim)


def dequantize_stored(config: ModelConfig, piece: Piece, q: torch.Tensor,
                      scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """A stored FP8 tensor as the float32 weights a forward computes with: per block, or
    each part it holds times that part's per-tensor scale; member by member where
    stacked."""
    if piece.is_stacked:
        return torch.stack([dequantize_stored(config, m, x, s, scheme) for m, x, s in
                            zip(piece.members(), q, scale)])
    if scheme == "block128":
        return dequantize_blocks(q, scale)
    dim, segs = segments(config, piece)
    held = sorted({p for _, _, p in segs})
    out = q.float()
    for a, b, p in segs:
        out.narrow(dim, a, b - a).mul_(scale.reshape(-1)[held.index(p)])
    return out


# An HF FP8 checkpoint's config.json (DeepSeek-V3 README_WEIGHTS.md; slime
# tools/convert_hf_to_fp8.py writes the same four keys).
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [BLOCK, BLOCK]}


def quantization_config(scheme: str) -> dict[str, object]:
    """The ``quantization_config`` of an HF FP8 checkpoint in ``scheme``: per tensor, the
    same without ``weight_block_size`` (vLLM ``Fp8Config``: no block size is per-tensor)."""
    out = dict(QUANTIZATION_CONFIG)
    if scheme == "tensor":
        del out["weight_block_size"]
    return out


def fp8_shapes(config: ModelConfig, where: Endpoint) -> list[dict[str, tuple[tuple[int, ...],
                                                                         torch.dtype | None]]]:
    """Each rank's stored names at an FP8 endpoint with their shapes and dtypes (None: the
    source dtype, whatever it is), without quantizing anything: the scale grids' shapes
    come from ``stored_scale`` on grids of zeros (vLLM's refusals included)."""
    shapes = config.param_shapes()
    scheme = scheme_of(where)
    grids: dict[str, list[torch.Tensor]] = {}
    for source, shape in shapes.items():
        if not is_quantized(source):
            continue
        dim, spans = parts(config, source)
        other = shape[1 - dim]
        grids[source] = [torch.zeros(1) if scheme == "tensor" else
                         torch.zeros((cdiv(b - a, BLOCK), cdiv(other, BLOCK)) if dim == 0
                                     else (cdiv(other, BLOCK), cdiv(b - a, BLOCK)))
                         for a, b in spans]
    out = []
    for rank in where.unquantized().pieces(config):
        held: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
        for name, piece in rank.items():
            local = piece.local_shape(shapes[piece.source])
            if piece.source not in grids:
                held[name] = (local, None)
                continue
            held[name] = (local, FP8)
            scale = stored_scale(config, where, name, piece, grids[piece.source])
            held[scale_name(name, scheme)] = (tuple(scale.shape), torch.float32)
        out.append(held)
    return out


def require_stored(config: ModelConfig, where: Endpoint) -> None:
    """Refuse an endpoint that cannot store ``config`` (``UnsupportedConvention``, naming the
    rule): its convention's own rules and, where it is FP8, vLLM's block rules for its
    scales too (``fp8_shapes``), before anything is converted."""
    where.unquantized().pieces(config)
    if where.quantized:
        fp8_shapes(config, where)

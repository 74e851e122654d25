"""The field's FP8 sync bugs as mutations of a correct FP8 destination: each takes what a
correct quantizing converter writes (``conventions.fp8.fp8_shards``) and returns what one
with the bug writes, with the same names, shapes and dtypes (a shape error torch would
catch; a dtype error ``check.fp8`` refuses by name), different bytes. Each names the public
report it is, where it cannot occur (``not_applicable``) and the words the diagnosis uses
for it (``named``); ``check.fp8.fp8_kill_matrix`` runs them.

- ``scale_zero``: an all-zero block quantized without the amax clamp: scale 0, weights 0 / 0
  = NaN (THUDM/slime PR #2256). The mutation plants the zero block's result in the first
  block of o_proj (per tensor: its one scale);
- ``scale_unsent``: a layerwise reload that never sends one scale, which keeps the engine's
  initial fill (vLLM's ``create_fp8_scale_parameter``: ``finfo(float32).min``; vllm PR
  #45835, vime PR #248), on the last rank;
- ``scale_transposed``: ``weight_scale_inv`` in CUTLASS's transposed layout where the raw one
  is expected (vllm PR #23280): shape-preserving only where a block grid is square and not
  symmetric (o_proj at TP 2 of 128-wide heads, here);
- ``scale_other_rank``: the last rank holding the first rank's scale (TP ranks' block
  scales differ; per-tensor ones are the same on every TP rank, so only EP ranks' experts
  give one);
- ``scale_ue8m0``: weights requantized to power-of-two scales (DeepGEMM's UE8M0 packing)
  where the raw ``amax / 448`` is expected (sglang PR #30761, vime PR #133); block scales;
- ``scale_reciprocal``: dequantization by multiplying with the inverse of the scale: 448 /
  amax stored under the dequantizing multiplier's name;
- ``scale_per_shard``: quantized after the TP cut, each rank's o_proj and down_proj with its
  own rows' amax: per tensor at TP > 1 another scale; per block at every degree vLLM
  accepts the same bytes (its identity, said so);
- ``router_quantized``: a tensor that must stay in the source dtype sent FP8 (the MoE
  router: vLLM builds ``mlp.gate`` with ``quant_config=None``): a dtype the check refuses
  by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.fp8 import (
    E4M3_MAX,
    FP8,
    expand,
    fp8_shards,
    is_scale,
    quantize,
    scale_name,
    scheme_of,
    shard_quantized,
)

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.model.config import ModelConfig

Params = dict[str, torch.Tensor]
Apply = Callable[[list[Params], "ModelConfig", "Endpoint", Mapping[str, torch.Tensor]],
                 list[Params]]


@dataclass(frozen=True)
class Fp8Mutation:
    """One FP8 bug: ``apply(shards, config, target, params)`` mutates a copy of the correct
    destination's shards (``params``: the canonical source weights, for a bug that
    quantizes them differently); ``not_applicable(config, target)`` says why it cannot occur
    there (None: it can); ``named``: what the verdict's diagnosis says of it."""

    name: str
    report: str
    apply: Apply
    not_applicable: Callable[[ModelConfig, Endpoint], str | None]
    named: str


def _first(shards: list[Params], suffix: str, rank: int = 0) -> str:
    return next(n for n in shards[rank] if n.endswith(suffix))


def _scale_zero(shards: list[Params], config: ModelConfig, target: Endpoint,
                params: Mapping[str, torch.Tensor]) -> list[Params]:
    name = _first(shards, "o_proj.weight")
    shards[0][scale_name(name, scheme_of(target))].view(-1)[0] = 0.0
    shards[0][name].view(torch.uint8)[:128, :128] = 0x7F  # e4m3fn NaN: 0 / 0
    return shards


def _scale_unsent(shards: list[Params], config: ModelConfig, target: Endpoint,
                  params: Mapping[str, torch.Tensor]) -> list[Params]:
    last = len(shards) - 1
    name = scale_name(_first(shards, "o_proj.weight", last), scheme_of(target))
    shards[last][name] = torch.full_like(shards[last][name], torch.finfo(torch.float32).min)
    return shards


def _square(shards: list[Params]) -> str | None:
    """The first block scale on rank 0 whose grid is square and not its own transpose."""
    return next((n for n, x in shards[0].items() if is_scale(n) and x.dim() == 2
                 and x.shape[0] == x.shape[1] and not torch.equal(x, x.t())), None)


def _scale_transposed(shards: list[Params], config: ModelConfig, target: Endpoint,
                      params: Mapping[str, torch.Tensor]) -> list[Params]:
    name = _square(shards)
    assert name is not None
    shards[0][name] = shards[0][name].t().contiguous()
    return shards


def _no_square_grid(config: ModelConfig, target: Endpoint) -> str | None:
    if scheme_of(target) != "block128":
        return "a per-tensor scale has no block grid to transpose"
    from weight_sync_bench.conventions.fp8 import fp8_shapes

    square = any(is_scale(n) and len(s) == 2 and s[0] == s[1] and s[0] > 1
                 for n, (s, _) in fp8_shapes(config, target)[0].items())
    return None if square else ("no square block grid here (transposing any other changes "
                                "its shape, which torch refuses before any check)")


def _differing(shards: list[Params]) -> str | None:
    return next((n for n in shards[0] if is_scale(n) and n in shards[-1]
                 and not torch.equal(shards[0][n], shards[-1][n])), None)


def _scale_other_rank(shards: list[Params], config: ModelConfig, target: Endpoint,
                      params: Mapping[str, torch.Tensor]) -> list[Params]:
    name = _differing(shards)
    assert name is not None
    shards[-1][name] = shards[0][name].clone()
    return shards


def _one_rank_or_same(config: ModelConfig, target: Endpoint) -> str | None:
    if target.world == 1:
        return "one rank: no other rank's scale"
    if scheme_of(target) == "tensor" and target.ep == 1:
        return "per-tensor scales are the same on every TP rank (only EP ranks' differ)"
    return None


def _scale_ue8m0(shards: list[Params], config: ModelConfig, target: Endpoint,
                 params: Mapping[str, torch.Tensor]) -> list[Params]:
    for rank in shards:
        for name in [n for n in rank if rank[n].dtype == FP8 and rank[n].dim() == 2]:
            key = scale_name(name, "block128")
            w = rank[name].float() * expand(rank[key], *rank[name].shape)
            scale = torch.exp2(torch.ceil(torch.log2(rank[key])))
            rank[name] = (w / expand(scale, *w.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
            rank[key] = scale
    return shards


def _block_only(config: ModelConfig, target: Endpoint) -> str | None:
    return None if scheme_of(target) == "block128" else "UE8M0 packs block scales"


def _scale_reciprocal(shards: list[Params], config: ModelConfig, target: Endpoint,
                      params: Mapping[str, torch.Tensor]) -> list[Params]:
    name = scale_name(_first(shards, "o_proj.weight"), scheme_of(target))
    for rank in shards:
        rank[name] = 1 / rank[name]
    return shards


def _scale_per_shard(shards: list[Params], config: ModelConfig, target: Endpoint,
                     params: Mapping[str, torch.Tensor]) -> list[Params]:
    scheme = scheme_of(target)
    own = shard_quantized(config, target, params)
    for rank, mine in zip(shards, own):
        for name in [n for n in rank if n.endswith(("o_proj.weight", "down_proj.weight"))]:
            rank[name] = mine[name]
            rank[scale_name(name, scheme)] = mine[scale_name(name, scheme)]
    return shards


def _one_rank(config: ModelConfig, target: Endpoint) -> str | None:
    return "one rank: its shard is the whole tensor" if target.world == 1 else None


def _router_quantized(shards: list[Params], config: ModelConfig, target: Endpoint,
                      params: Mapping[str, torch.Tensor]) -> list[Params]:
    for rank in shards:
        for name in [n for n in rank if n.endswith("mlp.gate.weight")]:
            rank[name] = quantize(rank[name], "tensor")[0]
    return shards


def _no_router(config: ModelConfig, target: Endpoint) -> str | None:
    return None if config.n_experts else "a dense model has no router"


FP8_MUTATIONS = {m.name: m for m in (
    Fp8Mutation("scale_zero", "THUDM/slime PR #2256", _scale_zero,
                lambda config, target: None, "scale is 0 in"),
    Fp8Mutation("scale_unsent", "vllm PR #45835, vime PR #248", _scale_unsent,
                lambda config, target: None, "never written"),
    Fp8Mutation("scale_transposed", "vllm PR #23280", _scale_transposed, _no_square_grid,
                "transposed"),
    Fp8Mutation("scale_other_rank", "a scale of another rank", _scale_other_rank,
                _one_rank_or_same, "rank 0's scale"),
    Fp8Mutation("scale_ue8m0", "sglang PR #30761, vime PR #133", _scale_ue8m0, _block_only,
                "powers of two"),
    Fp8Mutation("scale_reciprocal", "dequantizing by the inverse of the scale",
                _scale_reciprocal, lambda config, target: None, "reciprocal"),
    Fp8Mutation("scale_per_shard", "quantized after the TP cut", _scale_per_shard, _one_rank,
                "own shard quantized after the TP cut"),
    Fp8Mutation("router_quantized", "vLLM builds mlp.gate with quant_config=None",
                _router_quantized, _no_router, "dtype torch.float8_e4m3fn, declared"),
)}


def mutated(mutation: Fp8Mutation, config: ModelConfig, target: Endpoint,
            params: Mapping[str, torch.Tensor]) -> list[Params]:
    """What a converter with ``mutation``'s bug writes at ``target`` for ``params``."""
    return mutation.apply(fp8_shards(config, target, params), config, target, params)

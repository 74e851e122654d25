"""``check_convert``: the verdict on a user's converter between two frameworks' conventions.

``fn(shards, degree)`` gets the source convention's rank-local tensors (``shards_for``) and
returns the destination's. The verdict is ``check_split``'s, for conventions:

- the output's structure first: a list of ``degree`` dicts of exactly the destination's
  names, shapes and dtypes, else ``InvalidShards`` naming the convention, rank and name;
- data movement, bit-exactly, against ``shards_for(config, dst)``; the first parameter that
  differs is diagnosed in CANONICAL terms, each rank's rows matched by their bytes to the
  rows of the full canonical tensor, in heads for the fused qkv
  (``rank 1 model.layers.0.self_attn.qkv_proj.weight holds Q heads 0-3, K head 0, V head 0;
  declared Q heads 4-7, K head 1, V head 1``);
- computation: the destination's forward, reading the tensors as that framework does
  (``conventions.reading``), against the dense reference within the threshold
  ``check_split`` uses for the config. Non-finite logits never pass; a byte mismatch fails
  even when the logits stay within tolerance.

Which floor judges a conversion: the geometry's phase floor (``tolerance.rules.floor_for``:
the committed artifact that records it, else the per-geometry one cached under
``tolerance_dir()/geometry/``, else ``FloorNotMeasured``), the same one ``check_split``
reads. It covers the conversion's forward because, once ``reading_plan`` has put each rank's
stored rows in forward order, that forward IS the plain layout's sharded forward at the
destination degree: the same ``ShardedModel`` steps over ``layout_for``'s placements, so the
same row-parallel partial sums (o_proj and down over t contiguous chunks of their input
dimension, the all-reduced vocab-parallel embedding), which are the only source of rounding
a layout adds; the two departures add none (Meta's hidden-split embedding is an all-gather,
a concatenation; vLLM's replicated KV heads are copies, each Q head's attention computed on
one rank as under the plain layout). The one degree the plain floor cannot have measured is
vLLM's t > n_kv_heads (``HeadPartitioned`` rejects it): its o_proj sums t partials where the
floor's largest degree summed fewer. So a floor measures that forward too, in cells of its own
(``check.floor``: ``"forward": "vllm-replicated-kv"``), and a conversion whose destination
forward has no cell at its degree in the floor that judges it is refused before the
converter runs (``require_cell``: ``FloorNotMeasured`` naming the geometry, the degree, the
convention and the command that measures it), never judged by the plain cells' threshold.

``dtype`` (``"bf16"``, ``"fp16"``): the synced weights' dtype, as for ``check_split``: the
source shards are in it, the output is compared bit for bit in it (an fp32 tensor where
bf16 is declared is ``WrongShardShape`` naming rank, name and both dtypes), both forwards
compute in fp32 from those values, judged by that dtype's floor. ``stream="layer"`` (or
``"parameter"``) streams the check as ``check.stream`` does a split: ``fn`` called once per
stage (or canonical parameter) with that stage's stored tensors only, memory bounded by
the largest parameter (``stream_convert``).

The modules behind it, one concept each: ``check.conversion`` (``ConversionChecker``, the
verdict on a destination's shards, and ``require_cell``), ``check.shards`` (their structure),
``check.streamed_conversion`` (``stream_convert``, ``stage_convert``), ``check.checkpoint``
(``verify_checkpoint``) and ``check.forwards`` (the destination forward over gloo). Their
public names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check.checker import Verdict
from weight_sync_bench.check.checkpoint import verify_checkpoint
from weight_sync_bench.check.conversion import (
    ConversionChecker,
    conversion_checker,
    require_cell,
)
from weight_sync_bench.check.shards import validate_convention_shards
from weight_sync_bench.check.streamed_conversion import (
    ConvertFn,
    stage_convert,
    stream_convert,
)
from weight_sync_bench.check.fp8 import check_fp8_convert
from weight_sync_bench.check.user_code import call
from weight_sync_bench.check.weights import (
    dtypes_of,
    held_weights,
    measure_threshold,
    weights_threshold,
)
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.errors import InvalidNumber
from weight_sync_bench.model.config import init_params, parse_dtype

if TYPE_CHECKING:
    from weight_sync_bench.check.streaming import Progress
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.model.config import ModelConfig

# Defined by the modules behind this one (the module docstring), importable from here too.
__all__ = ["ConversionChecker", "ConvertFn", "check_convert", "conversion_checker",
           "measure_threshold", "require_cell", "stage_convert", "stream_convert",
           "validate_convention_shards", "verify_checkpoint"]


def check_convert(fn: ConvertFn, config: ModelConfig, src: str, dst: str, *, seed: int = 0,
                  backend: str = "inprocess", threshold: float | None = None,
                  dtype: torch.dtype | str = torch.float32, measure_floor: bool = False,
                  stream: str | None = None,
                  progress: Callable[[Progress], None] | None = None,
                  weights: Mapping[str, torch.Tensor] | str | Path | None = None) -> Verdict:
    """Check a user's converter ``fn(shards, degree)`` from ``src`` to ``dst`` (``"megatron:4"``,
    ``"vllm:2"``, ``"hf"`` for degree 1): it gets fresh copies of ``shards_for(config, src)``
    and the destination degree, and must return ``shards_for(config, dst)`` byte for byte.

    The threshold is the one ``check_split`` uses for ``config`` (the floor that covers its
    geometry, ``tolerance.rules.floor_for``; ``FloorNotMeasured`` naming the command where
    none does, unless ``measure_floor`` measures and caches it), or ``threshold`` when given;
    a floor without a cell of the destination's forward at its degree (vLLM past
    ``n_kv_heads``) refuses the check before ``fn`` runs (``require_cell``).
    ``dtype``, ``stream`` and ``progress``: see the module docstring. ``backend="gloo"``
    runs the destination forward one process per rank (phase 1b), its forward inputs
    scattered by ``GlooTransport`` under the destination's forward layout (Meta's
    hidden-split embedding and vLLM's replicated KV heads included).

    ``weights``: real weights instead of the seed's: canonical parameters of ``config`` (a
    mapping, in one dtype, which becomes the check's ``dtype``), or a checkpoint directory
    (``conventions.checkpoint.read_weights``: a Hugging Face directory, checked against
    ``config``, e.g. ``checkpoint_geometry(directory, endpoint("hf"))``; a Megatron
    ``torch_dist`` or legacy ``torch`` checkpoint, its ``args`` checked against ``config``). Bytes are
    compared as always; the forward's threshold, unless given, is measured on those weights
    (``measure_threshold``: the source's and destination's declared shards over four token
    seeds, 100x the worst), never a floor measured on other weights, and the verdict says
    so."""
    InvalidNumber.seed("seed", seed)
    source, target = endpoint(src), endpoint(dst)
    source.pieces(config)  # both conventions' rules, before the user's code runs
    target.unquantized().pieces(config)
    if target.quantized:  # an FP8 destination: weights and scales (check.fp8)
        if stream is not None or backend != "inprocess" or measure_floor:
            raise ValueError(f"{target}: an FP8 destination is checked whole, in process, "
                             "with a threshold measured on its dequantized weights: drop "
                             "stream=, backend= and measure_floor=")
        if weights is not None:
            held = held_weights(weights, config)
            return check_fp8_convert(fn, config, source, target, held, threshold=threshold,
                                     seed=seed, weights_note=dtypes_of(held)[1],
                                     seeded=False)
        return check_fp8_convert(fn, config, source, target,
                                 init_params(config, seed, dtype=parse_dtype(dtype)),
                                 threshold=threshold, seed=seed)
    if weights is not None:
        if stream is not None:
            raise ValueError("weights= runs the whole-model check; stream= draws the seed's "
                             "weights stage by stage")
        if parse_dtype(dtype) != torch.float32:
            raise ValueError("weights= checks the weights in their own dtype: drop dtype=")
        return _check_weights(fn, config, source, target, held_weights(weights, config),
                              backend=backend, threshold=threshold)
    if stream is not None:
        if backend != "inprocess":
            raise ValueError(f"stream={stream!r} runs in process (phase 1a); backend "
                             f"{backend!r} holds the whole model on rank 0")
        return stream_convert(fn, config, source, target, per=stream, seed=seed, dtype=dtype,
                              threshold=threshold, measure_floor=measure_floor,
                              progress=progress)
    checker = conversion_checker(config, seed=seed, backend=backend, threshold=threshold,
                                 dtype=dtype, measure_floor=measure_floor)
    checker.require(target)  # refused before the user's code runs
    out = call(fn, (checker.source(source), target.world), role="converter", config=config,
               during=f"while converting {config.name} {source} -> {target}",
               ends=(source, target))
    return checker.verdict(out, src=source, dst=target)


def _check_weights(fn: ConvertFn, config: ModelConfig, source: Endpoint, target: Endpoint,
                   weights: dict[str, torch.Tensor], *, backend: str,
                   threshold: float | None) -> Verdict:
    """``check_convert`` on ``weights`` (see it): the threshold measured on them."""
    threshold, note = weights_threshold(config, [source, target], weights, threshold)
    dtype, several = dtypes_of(weights)
    checker = conversion_checker(config, backend=backend, threshold=threshold, dtype=dtype,
                                 params=weights, mixed=several is not None)
    checker.checker.notes += (note, *([several] if several else []))
    out = call(fn, (checker.source(source), target.world), role="converter", config=config,
               during=f"while converting {config.name} {source} -> {target}",
               ends=(source, target))
    return checker.verdict(out, src=source, dst=target)

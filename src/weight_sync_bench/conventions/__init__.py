"""Storage conventions of real frameworks, as data: how Megatron-Core, vLLM, Hugging Face and
Meta's original checkpoints name, order and split every tensor of the harness's
Llama-style model at a TP degree, and how each framework's forward reads them.

- ``CONVENTIONS``: ``plain`` (the harness's own), ``megatron``, ``vllm``, ``hf``, ``meta``;
- ``shards_for(config, convention, degree, *, seed=0)``: the declared rank-local tensors, what
  a correct converter must produce;
- ``convert(shards, src, dst, config)``: the harness's own converter (gather to the canonical
  model through the source's index maps, then cut the destination's);
- ``endpoint("megatron:4")``: a convention at a degree (``"hf"`` is degree 1);
- ``render(config, convention)``: its layout as a printable table;
- ``checkpoint``: each convention's files on disk (``write_checkpoint``,
  ``read_checkpoint``), for converters that are command-line tools.

Everything is built from one primitive (``maps.Piece``): each stored tensor is an index
selection of one canonical parameter, so conversions are exact data movement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weight_sync_bench.conventions.coordinates import RankCoordinates, rank_coordinates
from weight_sync_bench.conventions.convention import (
    Convention,
    Endpoint,
    ForwardLayout,
    parse_endpoint,
)
from weight_sync_bench.conventions.hf import HF
from weight_sync_bench.conventions.maps import Piece, gather_canonical, materialize
from weight_sync_bench.conventions.megatron import MEGATRON
from weight_sync_bench.conventions.meta import META
from weight_sync_bench.conventions.plain import PLAIN
from weight_sync_bench.conventions.reading import forward_inputs, forward_model, reading_plan
from weight_sync_bench.conventions.table import render
from weight_sync_bench.conventions.vllm import VLLM
from weight_sync_bench.errors import UnknownConvention, UnsupportedLayout
from weight_sync_bench.model.config import ModelConfig, init_params

CONVENTIONS: dict[str, Convention] = {c.name: c for c in (PLAIN, MEGATRON, VLLM, HF, META)}

__all__ = ["CONVENTIONS", "Convention", "Endpoint", "ForwardLayout", "Piece", "RankCoordinates",
           "convention_by_name", "convert", "endpoint", "forward_inputs", "forward_model",
           "gather_canonical", "moe_endpoints", "materialize", "rank_coordinates",
           "reading_plan", "render", "shards_for"]


def convention_by_name(name: str | Convention) -> Convention:
    if isinstance(name, Convention):
        return name
    try:
        return CONVENTIONS[name]
    except (KeyError, TypeError):
        raise UnknownConvention(f"unknown convention {name!r}; known: "
                                f"{', '.join(CONVENTIONS)}") from None


def endpoint(text: str | Endpoint) -> Endpoint:
    """``"megatron:4"`` -> the megatron convention at degree 4; ``"hf"`` -> degree 1."""
    return parse_endpoint(text, CONVENTIONS)


def shards_for(config: ModelConfig, convention: str | Convention | Endpoint,
               degree: int | None = None, *, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The declared rank-local tensors of ``convention`` at ``degree`` (or of an endpoint,
    ``"megatron:tp=2,ep=4"``) for the parameters ``init_params(config, seed)``:
    ``result[rank][stored name]``. Raises ``UnsupportedConvention`` naming the rule where the
    convention cannot store ``config`` there."""
    if degree is None:
        pieces = endpoint(convention if not isinstance(convention, Convention)
                          else convention.name).pieces(config)
    else:
        pieces = convention_by_name(convention).pieces(config, degree)
    return materialize(pieces, init_params(config, seed))


def convert(shards: Sequence[Mapping[str, torch.Tensor]], src: str | Endpoint,
            dst: str | Endpoint, config: ModelConfig) -> list[dict[str, torch.Tensor]]:
    """The harness's own converter: ``src`` shards (``len(shards)`` ranks; ``src`` may omit the
    degree) -> ``dst`` shards, gathering the canonical model through ``src``'s index maps
    and cutting ``dst``'s. Exact: ``convert(shards_for(c, a, s), a, b, c)`` equals
    ``shards_for(c, b, d)`` byte for byte."""
    source = endpoint(src)
    if source.world != len(shards) and str(source) == f"{source.name}:{source.degree}":
        source = Endpoint(source.convention, len(shards))  # "megatron" given for 4 shards
    canonical = gather_canonical(shards, source.pieces(config), config.param_shapes())
    return materialize(endpoint(dst).pieces(config), canonical)


def moe_endpoints(config: ModelConfig, max_world: int = 8) -> list[Endpoint]:
    """Every MoE endpoint that can store ``config`` with at most ``max_world`` ranks: each
    convention at each TP degree (a divisor of ``n_heads``), with expert parallelism (EP 2, 4,
    or the TP degree, expert-TP 1 or the default) and the options that change a layout
    (Megatron's SequentialMLP, vLLM's round-robin map and FlashInfer's [w3; w1], HF v5's fused
    experts); smallest world first."""
    degrees = [t for t in range(1, config.n_heads + 1) if config.n_heads % t == 0]
    texts = []
    for t in degrees:
        texts += [f"plain:{t}", f"megatron:{t}", f"vllm:{t}",
                  f"vllm:tp={t},kernel=flashinfer_cutlass"]
        for ep in sorted({2, 4, t} - {1}):
            texts += [f"plain:tp={t},ep={ep}", f"megatron:tp={t},ep={ep}",
                      f"megatron:tp={t},ep={ep},etp=1",
                      f"megatron:tp={t},ep={ep},experts=sequential"]
        if t > 1:
            texts += [f"vllm:tp={t},ep={t}", f"vllm:tp={t},ep={t},placement=round_robin"]
    texts += ["hf", "hf:experts=fused"]
    found = []
    for text in texts:
        ep = endpoint(text)
        try:
            ep.pieces(config)
        except UnsupportedLayout:
            continue
        if ep.world <= max_world:
            found.append(ep)
    return sorted(found, key=lambda e: e.world)

"""What each rank of a staged Megatron endpoint stores (``megatron:tp=2,pp=2,vpp=2``), and how
its forward reads them back.

What each rank stores (``staged``): the tensors of its coordinate in the unstaged endpoint
(``Endpoint.unstaged``; ranks in ``parallel_state``'s "tp-cp-ep-dp-pp" order, pipeline
rank slowest: rank ``g`` is stage ``g // (world / pp)``), only those of its stage:

- a model chunk's layers under LOCAL indices (``decoder.layers.{j}``, j from 0 in each chunk:
  ``TransformerBlock`` builds ``self.layers`` as a list, ``layer_number`` offset only for its
  own numbering); a converter must add the chunk's offset;
- with virtual stages, each chunk's names prefixed ``model{v}.``, as Megatron's checkpoint
  keeps one state dict per chunk (``megatron/training/checkpointing.py::generate_state_dict``:
  ``'model%d' % i`` where there are several);
- the embedding on the first chunk of the first stage (``pre_process``), the final norm and
  the output layer on the last chunk of the last stage (``post_process``); with tied
  embeddings and pp > 1 the last stage stores its own copy, ``output_layer.weight``
  (``language_module.py::setup_embeddings_and_output_layer``: allocated where not
  ``pre_process``, filled from the first stage's embedding by an all-reduce over the
  embedding group), which must hold the embedding's rows byte for byte.

The forward of a staged endpoint is its unstaged one's: pipeline stages pass activations
by copies, so each rank of the unstaged world reads the tensors of its coordinate on every
stage (``unstage``, by the declared names only, never the data). The tied copy on the last
stage is compared byte for byte, not read by that forward: the harness's tied forward reads
one table.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weight_sync_bench.conventions.stages import LAYERS

if TYPE_CHECKING:
    import torch

    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.conventions.maps import Pieces
    from weight_sync_bench.model.config import ModelConfig

EMBEDDING = "embedding.word_embeddings.weight"
TIED_COPY = "output_layer.weight"


@dataclass(frozen=True)
class Staged:
    """A staged endpoint's stored pieces over ``pp * inner`` ranks and, per rank,
    ``{stored name: the unstaged endpoint's name}`` (the tied copy has none), ``inner`` the
    unstaged world."""

    pieces: Pieces
    names: tuple[dict[str, str], ...]
    inner: int

    def stage_of(self, rank: int) -> int:
        return rank // self.inner


@functools.lru_cache(maxsize=256)
def staged(config: ModelConfig, at: Endpoint) -> Staged:
    """What each rank of a staged Megatron endpoint stores (see the module docstring)."""
    chunks = at.pipeline.chunks(config.n_layers)
    flat = at.unstaged().pieces(config)
    inner, pp, vpp = len(flat), at.pp, at.vpp
    where = {layer: (p, v, chunk.start) for p, stage in enumerate(chunks)
             for v, chunk in enumerate(stage) for layer in chunk}
    prefix = [f"model{v}." if vpp > 1 else "" for v in range(vpp)]
    pieces, names = [], []
    for g in range(inner * pp):
        p, mine = g // inner, flat[g % inner]
        stored, renamed = {}, {}
        for name, piece in mine.items():
            parts = piece.source.split(".")
            if parts[0] == "layers":
                layer = int(parts[1])
                stage, v, start = where[layer]
                if stage != p:
                    continue
                key = f"{LAYERS}.{layer}."
                assert name.startswith(key), (name, key)
                new = prefix[v] + f"{LAYERS}.{layer - start}." + name[len(key):]
            elif piece.source == "tok_embeddings.weight":
                if p != 0:
                    continue
                new = prefix[0] + name
            else:  # the final norm and the output layer
                if p != pp - 1:
                    continue
                new = prefix[vpp - 1] + name
            stored[new], renamed[new] = piece, name
        if config.tie_embeddings and pp > 1 and p == pp - 1:
            stored[prefix[vpp - 1] + TIED_COPY] = mine[EMBEDDING]
        pieces.append(stored)
        names.append(renamed)
    return Staged(pieces, tuple(names), inner)


def stage_holds(config: ModelConfig, at: Endpoint, source: str, stage: int) -> bool:
    """Whether pipeline ``stage`` of ``at`` stores canonical ``source``, from the stage
    arithmetic alone (``stages.Pipeline``), never from the stored maps: a layer's on its
    stage, the embedding on the first (and, tied with pp > 1, its copy on the last), the
    final norm and output layer on the last."""
    parts = source.split(".")
    last = at.pp - 1
    if parts[0] == "layers":
        return any(int(parts[1]) in chunk for chunk in at.pipeline.chunks(config.n_layers)[stage])
    if source == "tok_embeddings.weight":
        return stage == 0 or (config.tie_embeddings and stage == last)
    return stage == last


def describe_rank(config: ModelConfig, at: Endpoint, rank: int) -> str:
    """``rank 2 is pipeline stage 1 of 2: chunk 0 (model0.) global layer 1 as local 0; ...``."""
    layout = staged(config, at)
    p = layout.stage_of(rank)
    chunks = at.pipeline.chunks(config.n_layers)[p]
    held = "; ".join(
        (f"chunk {v} (model{v}.) " if at.vpp > 1 else "") + (
            (f"global layer {c.start} as local 0" if len(c) == 1 else
             f"global layers {c.start}-{c.stop - 1} as local 0-{len(c) - 1}") if len(c) else
            "no layers") for v, c in enumerate(chunks))
    return f"rank {rank} is pipeline stage {p} of {at.pp}: {held}"


def unstage(shards: Sequence[Mapping[str, torch.Tensor]], config: ModelConfig, at: Endpoint
            ) -> list[dict[str, torch.Tensor]]:
    """A staged endpoint's shards as its unstaged endpoint's (``world / pp`` rank dicts):
    rank i's tensors gathered from rank i of every stage under their unstaged names."""
    layout = staged(config, at)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.inner)]
    for g, (held, names) in enumerate(zip(shards, layout.names)):
        for name, flat in names.items():
            out[g % layout.inner][flat] = held[name]
    return out

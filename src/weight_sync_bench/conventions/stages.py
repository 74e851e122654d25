"""Pipeline stages as data: which global transformer layers each (pipeline rank, virtual stage)
of a Megatron-Core model holds, and the rules Megatron checks before it builds one.

Followed (NVIDIA/Megatron-LM @ d98e8a64, core 0.20):

- ``megatron/core/transformer/transformer_block.py::get_num_layers_to_build``: how many layers
  a model chunk builds. Even split: ``(L + e + l) / pp`` per pipeline rank, ``/ vpp`` per
  virtual stage, where ``e`` and ``l`` are 1 when the embedding or the loss is counted as a
  layer (``account_for_embedding_in_pipeline_split``, ``..._loss_...``), the first chunk of
  the first rank (the last chunk of the last rank) building one fewer. Uneven split: the
  first (last) rank builds ``num_layers_in_first_pipeline_stage`` (``..._last_...``), the
  ranks between share the rest evenly, each ``/ vpp`` per chunk;
- ``megatron/core/transformer/transformer_layer.py::get_transformer_layer_offset``: the
  global index of a chunk's first layer. With virtual stages a rank's chunks interleave:
  chunk ``v`` of rank ``p`` starts at ``v * L / vpp`` plus the layers of chunk ``v`` on the
  ranks before ``p`` (8 layers, pp 2, vpp 4: rank 0 holds [0] [2] [4] [6], rank 1 [1] [3]
  [5] [7]); counted embedding: every chunk but the very first starts one earlier;
- the rules: ``transformer_config.py::TransformerConfig.__post_init__`` (uneven stages and
  counted embedding/loss are exclusive; each given stage size positive and divisible by
  vpp; the middle layers divisible by the middle ranks, and by vpp per rank; with counted
  embedding/loss, ``L + e + l`` divisible by pp, and by ``pp * vpp``) and
  ``get_num_layers_to_build``'s assertions (``L + e + l`` divisible by pp on an even split:
  older Megatron floor-divided instead, so 30 layers on pp 4 built 28, Megatron-LM #1304;
  the harness refuses that with the arithmetic, as the current code asserts);
- ``megatron/training/arguments.py``: vpp only with pp > 1 (virtual stages interleave
  pipeline ranks); ``--pipeline-model-parallel-layout`` (an explicit list of layers per
  stage) is not modelled.

What each rank of a staged endpoint stores is ``staging``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from weight_sync_bench.errors import UnsupportedConvention

NAME = "megatron"
LAYERS = "decoder.layers"


def need(ok: bool, rule: str, values: str) -> None:
    """``UnsupportedConvention``: ``megatron: decoder.layers needs {rule} ({values})``."""
    if not ok:
        raise UnsupportedConvention(f"{NAME}: {LAYERS} needs {rule} ({values})")


@dataclass(frozen=True)
class Pipeline:
    """A Megatron pipeline split: ``pp`` ranks, ``vpp`` virtual stages (model chunks) on
    each, ``first`` / ``last`` the layers of an uneven first / last rank (0: not set),
    ``embedding`` / ``loss`` whether those count as a layer of the split."""

    pp: int = 1
    vpp: int = 1
    first: int = 0
    last: int = 0
    embedding: bool = False
    loss: bool = False

    def chunks(self, n_layers: int) -> tuple[tuple[range, ...], ...]:
        """``chunks[p][v]``: the global layers model chunk ``v`` of pipeline rank ``p``
        holds, after Megatron's rules (``UnsupportedConvention`` naming the rule broken)."""
        self.check(n_layers)
        out = tuple(tuple(range(self._offset(n_layers, p, v),
                                self._offset(n_layers, p, v) + self._count(n_layers, p, v))
                          for v in range(self.vpp)) for p in range(self.pp))
        held = sorted(layer for stage in out for chunk in stage for layer in chunk)
        # Megatron's two formulas (how many, where from) agree wherever its rules hold; a
        # split they would not tile is refused, never stored with a layer lost or doubled.
        need(held == list(range(n_layers)), "every layer on exactly one stage",
             f"{self}: stages hold {held}")
        return out

    def where(self, n_layers: int, layer: int) -> tuple[int, int, int]:
        """``(pipeline rank, virtual stage, local index)`` of a global layer."""
        for p, stage in enumerate(self.chunks(n_layers)):
            for v, chunk in enumerate(stage):
                if layer in chunk:
                    return p, v, layer - chunk.start
        raise ValueError(f"layer {layer} of {n_layers}")

    def check(self, n_layers: int) -> None:
        """Megatron-Core's rules for this split of ``n_layers`` layers."""
        values = f"{self}, num_layers={n_layers}"
        for key in ("pp", "vpp"):
            value = getattr(self, key)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{key} a positive int", values)
        need(self.vpp == 1 or self.pp > 1,
             "pp > 1 for virtual stages (they interleave pipeline ranks)", values)
        uneven = bool(self.first or self.last)
        need(not uneven or self.pp > 1, "pp > 1 for an uneven first or last stage", values)
        need(not (uneven and (self.embedding or self.loss)), "uneven first/last stages or the "
             "embedding/loss counted as a layer, not both (TransformerConfig)", values)
        need(self.first >= 0 and self.last >= 0,
             "num_layers_in_first/last_pipeline_stage larger than 0", values)
        if uneven:
            for key in ("first", "last"):
                need(getattr(self, key) % self.vpp == 0,
                     f"num_layers_in_{key}_pipeline_stage divisible by vpp", values)
            middle, ranks = self._middle(n_layers)
            need(middle >= 0, "the first and last stages to hold at most num_layers", values)
            need(bool(middle) == bool(ranks), "middle layers exactly where there are middle "
                 "stages", f"{values}: {middle} middle layers, {ranks} middle stages")
            if ranks:
                need(middle % ranks == 0, "the middle layers divisible by the middle stages",
                     f"{values}: {middle} layers over {ranks} stages")
                need(middle // ranks % self.vpp == 0, "each middle stage's layers divisible "
                     "by vpp", f"{values}: {middle // ranks} per stage")
            # get_transformer_layer_offset's virtual-stage branch divides by the number of
            # middle stages for every rank but the first: ZeroDivisionError when there are none
            need(ranks or self.vpp == 1 or not (self.first and self.last), "a middle stage when "
                 "both first and last stages are set with vpp > 1 "
                 "(get_transformer_layer_offset divides by the middle stages)", values)
            return
        total = n_layers + self.embedding + self.loss
        counted = " (embedding and loss counted)" if self.embedding or self.loss else ""
        need(total % self.pp == 0, f"num_layers{counted} divisible by pp (Megatron-Core "
             f"asserts it; older versions built {total // self.pp} per stage, "
             f"{total // self.pp * self.pp} in all, losing {total % self.pp}: Megatron-LM "
             f"#1304)", f"{values}: {total} % {self.pp} = {total % self.pp}")
        need(total // self.pp % self.vpp == 0, "each stage's layers divisible by vpp",
             f"{values}: {total // self.pp} per stage")
        chunk = total // (self.pp * self.vpp)
        need(chunk - self.embedding >= 0 and chunk - self.loss >= 0 and (
            self.pp * self.vpp > 1 or chunk - self.embedding - self.loss >= 0),
            "a layer for the embedding/loss to stand in for", values)

    def _middle(self, n_layers: int) -> tuple[int, int]:
        ranks = self.pp - bool(self.first) - bool(self.last)
        return n_layers - self.first - self.last, ranks

    def _count(self, n_layers: int, p: int, v: int) -> int:
        """``get_num_layers_to_build`` for (p, v)."""
        is_first, is_last = p == 0, p == self.pp - 1
        if self.first or self.last:
            middle, ranks = self._middle(n_layers)
            per_rank = middle // ranks if ranks else 0
            if is_first and self.first:
                per_rank = self.first
            if is_last and self.last:
                per_rank = self.last
            count = per_rank // self.vpp
        else:
            count = (n_layers + self.embedding + self.loss) // self.pp // self.vpp
        if self.embedding and is_first and v == 0:
            count -= 1
        if self.loss and is_last and v == self.vpp - 1:
            count -= 1
        return count

    def _offset(self, n_layers: int, p: int, v: int) -> int:
        """``get_transformer_layer_offset`` for (p, v)."""
        if self.pp == 1:
            return 0
        if self.first or self.last:
            middle, ranks = self._middle(n_layers)
            first_chunk = self.first // self.vpp
            middle_chunk = middle // self.vpp  # every middle rank's chunk v, together
            per_chunk = (first_chunk + middle_chunk + self.last // self.vpp)  # = L / vpp
            if p == 0:
                return v * per_chunk
            middle_rank = p - 1 if self.first else p
            return v * per_chunk + first_chunk + middle_rank * (middle_chunk // ranks if ranks
                                                                else 0)
        total = n_layers + self.embedding + self.loss
        per_stage_chunk = total // self.pp // self.vpp
        offset = v * (total // self.vpp) + p * per_stage_chunk
        if self.embedding and not (p == 0 and v == 0):
            offset -= 1
        return offset

    def __str__(self) -> str:
        parts = [f"pp={self.pp}"] + ([f"vpp={self.vpp}"] if self.vpp != 1 else []) + (
            [f"pp_first={self.first}"] if self.first else []) + (
            [f"pp_last={self.last}"] if self.last else []) + (
            ["embedding counted"] if self.embedding else []) + (
            ["loss counted"] if self.loss else [])
        return ", ".join(parts)

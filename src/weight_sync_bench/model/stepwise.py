"""The forwards taken one parameter at a time, in the order the parameters are drawn.

``model.config.iter_params`` draws the parameters one at a time in the forward's order;
``ReferenceModel`` and ``ShardedModel`` advance one parameter at a time (``begin``, ``step``
per parameter, ``finish``). ``ReferenceSteps`` and ``ShardedSteps`` pair the two: each takes
the next parameters in draw order (a stage's, or one), upcasts each to fp32 only while its
step reads it (``computing``) and lets it go, so a streamed check or floor measurement holds
one stage of the model, never the whole (``check.streaming``, ``check.floor``).

The forward's stages (``stages``): the embedding, each layer, the final norm and head. A tied
head reads the embedding, which both steppers keep (in the synced dtype) from the first stage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.memory import trim
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import EMBEDDING, RoutingGuard, ShardedModel

if TYPE_CHECKING:
    from weight_sync_bench.collectives.protocol import Collective
    from weight_sync_bench.layout.placements import Experts, Placement
    from weight_sync_bench.model.config import ModelConfig

Params = dict[str, torch.Tensor]


def computing(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters as the forward computes with them: fp32, upcast exactly from bf16 or fp16
    (the synced values, not the fp32 draws they were rounded from); fp32 ones as they are."""
    return {n: x if x.dtype == torch.float32 else x.float() for n, x in params.items()}


def stages(config: ModelConfig) -> list[tuple[str, list[str]]]:
    """The forward's stages and the parameters each reads, in the order they are drawn:
    ``embedding``, ``layers.0`` ... ``layers.{n-1}``, ``head`` (the final norm, and lm_head
    unless tied: the tied head reads the embedding, kept from the first stage)."""
    names = list(config.param_shapes())
    out: list[tuple[str, list[str]]] = [("embedding", ["tok_embeddings.weight"])]
    for i in range(config.n_layers):
        out.append((f"layers.{i}", [n for n in names if n.startswith(f"layers.{i}.")]))
    out.append(("head", [n for n in ("norm.weight", "lm_head.weight") if n in names]))
    assert [n for _, group in out for n in group] == names, "stages must follow the draw order"
    return out


def draw(draws: Iterator[tuple[str, torch.Tensor]], names: list[str]) -> Params:
    """The next ``names`` of ``iter_params``' draws, which must come in that order."""
    full = {}
    for want in names:
        got, x = next(draws)
        assert got == want, f"drawn {got}, the stage reads {want}"
        full[got] = x
    return full


class ReferenceSteps:
    """The reference forward, taking parameters in draw order (a stage's, or one at a time):
    each is upcast to fp32 only while its step reads it. A tied head reads the embedding,
    kept (in the synced dtype) from the first stage. ``expected``: the logits, once the
    last parameter has been taken."""

    def __init__(self, config: ModelConfig, tokens: torch.Tensor) -> None:
        self.config, self.tokens = config, tokens
        self.model = ReferenceModel(config, {})
        self.last = config.head_params[-1]
        self.tied: torch.Tensor | None = None
        self.expected: torch.Tensor | None = None

    def take(self, names: list[str], full: Params) -> None:
        """The steps that read ``names`` (the next parameters in draw order) from ``full``."""
        for n in names:
            given = {n: full[n]}
            if n == "norm.weight" and self.tied is not None:
                given["tok_embeddings.weight"] = self.tied
            self.model.params = computing(given)
            if n == "tok_embeddings.weight":
                self.state = self.model.begin(self.tokens)
                if self.config.tie_embeddings:
                    self.tied = full[n]
            else:
                self.model.step(self.state, n)
            self.model.params = {}
            del given
        if self.last in names:
            self.expected = self.model.finish(self.state)


class ShardedSteps:
    """The sharded forward (``model``: over ``InProcessCollective``, every rank's shards
    here; over ``GlooCollective``, this rank's), taking its local ranks' shards in draw order
    (a stage's, or one parameter's), each upcast only while its step reads it; a tied head
    reads the embedding shards kept from the first stage. ``logits``: rank 0's (of the local
    ranks, the first), once the last parameter has been taken."""

    def __init__(self, model: ShardedModel, tokens: torch.Tensor) -> None:
        self.config, self.tokens, self.model = model.config, tokens, model
        self.local = len(model.shards)
        self.last = self.config.head_params[-1]
        self.tied: list[torch.Tensor] | None = None
        self.logits: torch.Tensor | None = None

    @classmethod
    def over(cls, config: ModelConfig, collective: Collective, tokens: torch.Tensor, *,
             embedding: Placement = EMBEDDING, experts: Experts | None = None,
             guard: RoutingGuard | None = None) -> ShardedSteps:
        """The forward of ``config`` over ``collective``'s local ranks; ``embedding`` and
        ``experts``: the embedding's and the experts' placements (a destination convention's
        forward may split the hidden dimension, or place experts over EP ranks:
        ``conventions.reading_plan``); ``guard``: an MoE forward's routing guard, over the
        reference steps' routings (``ReferenceSteps.model.routings``)."""
        return cls(ShardedModel(config, [{} for _ in collective.ranks], collective,
                                embedding=embedding, experts=experts, guard=guard), tokens)

    def take(self, names: list[str], shards: list[Params]) -> None:
        """The steps that read ``names`` from ``shards`` (per local rank), which are emptied
        as each is read: a parameter's shards in the synced dtype are dropped once upcast."""
        for n in names:
            given = [o.pop(n) for o in shards]
            self.model.shards = [computing({n: x}) for x in given]
            if n == "norm.weight" and self.tied is not None:
                for s, table in zip(self.model.shards, self.tied):
                    s["tok_embeddings.weight"] = computing({n: table})[n]
            if n == "tok_embeddings.weight":
                self.state = self.model.begin(self.tokens)
                if self.config.tie_embeddings:
                    self.tied = given
            else:
                self.model.step(self.state, n)
            self.model.shards = [{} for _ in range(self.local)]
            del given
        if self.last in names:
            self.logits = self.model.finish(self.state)[0]
        trim()  # the unit's shards are dropped: glibc would keep those under 32 MiB resident

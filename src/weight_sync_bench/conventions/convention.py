"""What a storage convention is: a name, its index maps and the layout its forward reads.

``Convention.pieces(config, t)`` is the list over ranks of ``{stored name: Piece}`` (see
``maps``): how the framework names, orders and splits every tensor at degree t. It raises
``UnsupportedConvention`` naming the convention, the stored parameter, the degree and the
rule where the framework cannot store the config at that degree (or rejects it), so the
supported degrees are found by probing, as ``LayoutTable.supported_degrees`` does.

``Convention.forward_layout(config, t)`` is how the framework's forward consumes its local
tensors, said in the harness's own vocabulary: a forward config (the vocabulary padded the
way the convention pads it) and a ``LayoutTable`` of canonical parameters whose placements
say which canonical rows each rank's forward reads (``HeadReplicated`` where KV heads are
replicated, ``Shard(1)`` for an embedding split on the hidden dimension). ``reading`` turns
stored tensors into those forward inputs by a per-rank permutation computed from the maps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weight_sync_bench.errors import (
    UnknownConvention,
    UnsupportedConvention,
    UnsupportedLayout,
)

if TYPE_CHECKING:
    import torch

    from weight_sync_bench.conventions.maps import Pieces, Shape
    from weight_sync_bench.layout.placements import Placement
    from weight_sync_bench.layout.table import LayoutTable
    from weight_sync_bench.model.config import ModelConfig


@dataclass(frozen=True)
class ForwardLayout:
    """How a convention's forward reads its tensors at one degree: the forward's config
    (the canonical one, its vocabulary padded as the convention pads it) and the placement
    of every canonical parameter it consumes."""

    config: ModelConfig
    layout: LayoutTable

    @property
    def embedding(self) -> Placement:
        return self.layout["tok_embeddings.weight"].placement


@dataclass(frozen=True)
class Convention:
    """A framework's storage convention for the harness's Llama-style model, as data.

    ``build(config, t)`` returns the index maps (after checking the framework's rules);
    ``reads(config, t)`` the forward layout. ``summary`` says in a line what it stores.
    """

    name: str
    summary: str
    build: Callable[[ModelConfig, int], Pieces]
    reads: Callable[[ModelConfig, int], ForwardLayout]

    def pieces(self, config: ModelConfig, degree: int) -> Pieces:
        """Every rank's ``{stored name: Piece}`` at ``degree`` (cached; do not mutate)."""
        return _pieces(self, config, degree)

    def forward_layout(self, config: ModelConfig, degree: int) -> ForwardLayout:
        self.pieces(config, degree)  # the rules first: errors name the stored parameter
        return _forward_layout(self, config, degree)

    def names(self, config: ModelConfig, degree: int) -> list[str]:
        """The stored names, in forward order (every rank stores the same names)."""
        return list(self.pieces(config, degree)[0])

    def local_shapes(self, config: ModelConfig, degree: int) -> list[dict[str, Shape]]:
        shapes = config.param_shapes()
        return [{name: piece.local_shape(shapes[piece.source]) for name, piece in rank.items()}
                for rank in self.pieces(config, degree)]

    def supports(self, config: ModelConfig, degree: int) -> bool:
        try:
            self.pieces(config, degree)
        except UnsupportedLayout:
            return False
        return True

    def supported_degrees(self, config: ModelConfig, max_degree: int = 64) -> list[int]:
        """Every degree in 1..max_degree the convention can store ``config`` at (probed)."""
        return [t for t in range(1, max_degree + 1) if self.supports(config, t)]

    def __str__(self) -> str:
        return self.name


@functools.lru_cache(maxsize=512)
def _pieces(convention: Convention, config: ModelConfig, degree: int) -> Pieces:
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise UnsupportedConvention(f"{convention.name}: degree must be a positive int, "
                                    f"got t={degree!r}")
    return convention.build(config, degree)


@functools.lru_cache(maxsize=512)
def _forward_layout(convention: Convention, config: ModelConfig, degree: int) -> ForwardLayout:
    out = convention.reads(config, degree)
    out.layout.validate(degree)
    return out


@dataclass(frozen=True)
class Endpoint:
    """One side of a conversion: a convention at a degree, written ``"vllm:2"`` (``"hf"``
    alone means degree 1)."""

    convention: Convention
    degree: int

    @property
    def name(self) -> str:
        return self.convention.name

    def pieces(self, config: ModelConfig) -> Pieces:
        return self.convention.pieces(config, self.degree)

    def __str__(self) -> str:
        return f"{self.convention.name}:{self.degree}"


def need(ok: bool, convention: str, name: str, degree: int, rule: str, values: str) -> None:
    """Raise ``UnsupportedConvention`` unless ``ok``:
    ``"{convention}: {name} needs {rule} ({values}, t={degree})"`` (``(t={degree})`` when
    ``values`` is empty)."""
    if not ok:
        numbers = f"{values}, t={degree}" if values else f"t={degree}"
        raise UnsupportedConvention(f"{convention}: {name} needs {rule} ({numbers})")


def need_unpadded(convention: str, name: str, config: ModelConfig, degree: int) -> None:
    """Every convention but ``plain`` pads the vocabulary by its own rule, so the canonical
    model it starts from has none of its own (its padding rows are not stored anywhere)."""
    need(config.vocab_multiple == 1, convention, name, degree,
         "an unpadded canonical vocabulary (vocab_multiple == 1: the convention pads by its "
         "own rule)", f"vocab_multiple={config.vocab_multiple}")


def relaid(layout: LayoutTable, placements: dict[str, Placement]) -> LayoutTable:
    """``layout`` with the placements of the named parameters replaced (the forward of a
    convention reads most parameters as ``layout_for`` declares them, a few otherwise)."""
    from weight_sync_bench.layout.table import LayoutTable, ShardSpec

    return LayoutTable(tuple(ShardSpec(s.name, s.shape, placements.get(s.name, s.placement))
                             for s in layout))


# One canonical parameter stored as several tensors (HF's q/k/v from the fused qkv), or in an
# order of the convention's own (Megatron's grouped qkv): per stored name template, the
# canonical indices (along dim 0) rank r holds.
Cuts = Mapping[str, Sequence[tuple[str, Callable[[int], "torch.Tensor"]]]]


def renamed(config: ModelConfig, degree: int, layout: LayoutTable, names: Mapping[str, str],
            cuts: Cuts | None = None) -> Pieces:
    """A convention's pieces as data: every canonical parameter (in forward order) stored
    under ``names[template]`` (templates name layer i as ``{i}``: ``"layers.{i}.qkv.weight"``)
    as its placement in ``layout`` cuts it, except those in ``cuts``. Rows of ``layout``'s
    tables past the canonical ones (the convention's vocabulary padding) are zeros."""
    from weight_sync_bench.conventions.maps import Piece, placed

    cuts = cuts or {}
    shapes = config.param_shapes()
    out: Pieces = []
    for rank in range(degree):
        stored = {}
        for canonical, shape in shapes.items():
            parts = canonical.split(".")
            layer = parts[1] if parts[0] == "layers" else None
            template = (".".join(["layers", "{i}", *parts[2:]]) if layer is not None
                        else canonical)
            if template in cuts:
                for name, idx in cuts[template]:
                    stored[name.format(i=layer)] = Piece(canonical, 0, idx(rank))
                continue
            spec = layout[canonical]
            dim, _ = spec.ranges(degree, rank)
            stored[names[template].format(i=layer)] = placed(spec, degree, rank, real=shape[dim])
        out.append(stored)
    return out


def parse_endpoint(text: str | Endpoint, known: dict[str, Convention]) -> Endpoint:
    """``"megatron:4"`` -> Endpoint(megatron, 4); ``"hf"`` -> degree 1."""
    if isinstance(text, Endpoint):
        return text
    if not isinstance(text, str):
        raise UnknownConvention(f"a conversion endpoint is a 'name:degree' string, got "
                                f"{type(text).__name__} {text!r}")
    name, sep, degree_text = text.partition(":")
    if name not in known:
        raise UnknownConvention(f"unknown convention {name!r} in {text!r}; known: "
                                f"{', '.join(known)}")
    if not sep:
        return Endpoint(known[name], 1)
    if not degree_text.isdigit() or int(degree_text) < 1:
        raise UnknownConvention(f"{text!r}: the degree after ':' must be a positive integer")
    return Endpoint(known[name], int(degree_text))

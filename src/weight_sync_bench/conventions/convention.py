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
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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

from weight_sync_bench.conventions.stages import Pipeline
from weight_sync_bench.layout.placements import DataParallel, Experts


@dataclass(frozen=True)
class ForwardLayout:
    """How a convention's forward reads its tensors at one endpoint: the forward's config
    (the canonical one, its vocabulary padded as the convention pads it), the placement of
    every canonical parameter it consumes over the endpoint's ``world`` ranks, and its TP
    degree ``tp`` (0: the world; less where the ranks hold ``world / tp`` data-parallel
    replicas of the dense layers, Megatron's experts spread over them); ``gathered`` the
    parameters each rank's forward reads from its whole TP group's stored tensors."""

    config: ModelConfig
    layout: LayoutTable
    tp: int = 0
    # canonical parameters whose stored tensors the forward gathers over its TP group before
    # reading them (Megatron's linear_qkv at t > n_kv_heads: the mixed_qkv all-gather)
    gathered: frozenset[str] = frozenset()

    @property
    def embedding(self) -> Placement:
        """How each TP group's forward reads the embedding (on each data-parallel replica)."""
        placement = self.layout["tok_embeddings.weight"].placement
        return placement.inner if isinstance(placement, DataParallel) else placement

    @property
    def experts(self) -> Experts | None:
        """The experts' placement (every MoE layer's is the same), None for a dense model."""
        for spec in self.layout:
            if spec.name.endswith("experts.gate_up.weight"):
                assert isinstance(spec.placement, Experts)
                return spec.placement
        return None


def tp_world(at: Endpoint) -> int:
    """Most conventions' ranks: one per TP rank."""
    return at.degree


@dataclass(frozen=True)
class Convention:
    """A framework's storage convention for the harness's model, as data.

    ``build(config, at)`` returns the index maps at endpoint ``at`` (after checking the
    framework's rules); ``reads(config, at)`` the forward layout; ``world(at)`` how many
    ranks store it (the TP degree, unless experts spread over more: Megatron's
    ``lcm(tp, ep * etp)``). ``options`` names each endpoint option the convention takes and
    its values, the framework's default first. ``summary`` says in a line what it stores.
    """

    name: str
    summary: str
    build: Callable[[ModelConfig, Endpoint], Pieces]
    reads: Callable[[ModelConfig, Endpoint], ForwardLayout]
    options: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False,
                                                   compare=False)
    world: Callable[[Endpoint], int] = field(default=tp_world, hash=False,
                                             compare=False)
    stages: bool = False  # whether it stores pipeline stages (``pp``, ``vpp``, ...)

    def at(self, where: int | Endpoint) -> Endpoint:
        """This convention at a TP degree, or ``where`` itself (an endpoint of it)."""
        if isinstance(where, Endpoint):
            return where
        return Endpoint(self, where)

    def pieces(self, config: ModelConfig, degree: int | Endpoint) -> Pieces:
        """Every rank's ``{stored name: Piece}`` at a TP degree or an endpoint (cached; do
        not mutate)."""
        return _pieces(self, config, self.at(degree))

    def forward_layout(self, config: ModelConfig, degree: int | Endpoint) -> ForwardLayout:
        """How the forward reads the tensors at ``degree``. Pipeline stages pass activations
        from stage to stage by copies: the forward of a staged endpoint is its unstaged
        one's (``Endpoint.unstaged``), over ``world / pp`` ranks, each reading the tensors of
        its coordinate on every stage (``reading.forward_inputs``)."""
        self.pieces(config, degree)  # the rules first: errors name the stored parameter
        at = self.at(degree)
        return _forward_layout(self, config, at.unstaged() if at.staged else at)

    def names(self, config: ModelConfig, degree: int | Endpoint) -> list[str]:
        """The stored names, in forward order: every rank's (each rank of a pipeline stage
        stores its stage's only), each once."""
        return list(dict.fromkeys(n for rank in self.pieces(config, degree) for n in rank))

    def local_shapes(self, config: ModelConfig, degree: int | Endpoint
                     ) -> list[dict[str, Shape]]:
        shapes = config.param_shapes()
        return [{name: piece.local_shape(shapes[piece.source]) for name, piece in rank.items()}
                for rank in self.pieces(config, degree)]

    def supports(self, config: ModelConfig, degree: int | Endpoint) -> bool:
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


# A refusal is cached apart from the answers: ``supported_degrees`` probes 64 degrees at a
# time, most of them refused, and 512 answers of index maps (~0.6 MiB each at TOY's width)
# would otherwise be evicted by the probes (an exception is not cached by ``lru_cache``).
_REFUSALS_KEPT = 8192
_refusals: OrderedDict[tuple[Convention, ModelConfig, Endpoint],
                       tuple[type[UnsupportedLayout], tuple[object, ...]]] = OrderedDict()


def _pieces(convention: Convention, config: ModelConfig, at: Endpoint) -> Pieces:
    key = (convention, config, at)
    refused = _refusals.get(key)
    if refused is not None:
        _refusals.move_to_end(key)
        kind, args = refused
        raise kind(*args)  # a fresh one: the message the rule gave, not its old traceback
    try:
        return _answer(convention, config, at)
    except UnsupportedLayout as e:
        _refusals[key] = (type(e), e.args)
        if len(_refusals) > _REFUSALS_KEPT:
            _refusals.popitem(last=False)
        raise


def clear_caches() -> None:
    """Forget every convention's cached answers and refusals."""
    _answer.cache_clear()
    _refusals.clear()
    _forward_layout.cache_clear()


@functools.lru_cache(maxsize=512)
def _answer(convention: Convention, config: ModelConfig, at: Endpoint) -> Pieces:
    for key, value in (("tp", at.degree), ("ep", at.ep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnsupportedConvention(f"{convention.name}: {key} must be a positive int, "
                                        f"got {key}={value!r}")
    if not isinstance(at.etp, int) or isinstance(at.etp, bool) or at.etp < 0:
        raise UnsupportedConvention(f"{convention.name}: etp must be a positive int, "
                                    f"got etp={at.etp!r}")
    for key, least in (("pp", 1), ("vpp", 1), ("pp_first", 0), ("pp_last", 0)):
        value = getattr(at, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise UnsupportedConvention(f"{convention.name}: {key} must be an int >= {least}, "
                                        f"got {key}={value!r}")
    if not config.n_experts:
        need(at.ep == 1 and at.etp == 0, convention.name, "the experts", at.degree,
             "an MoE config for ep or etp (a dense model has no experts)",
             f"ep={at.ep}, etp={at.etp}")
    need(not at.quantized, convention.name, "the linear weights", at.degree,
         "no fp8 option here: an FP8 endpoint's tensors are conventions.fp8.fp8_shards' "
         "(weights and their scales), which check_convert compares; this path takes the "
         "unquantized endpoint", str(at))
    need(convention.stages or not at.staged, convention.name, "the layers", at.degree,
         "pp=1 (the harness models the pipeline stages of megatron only)",
         f"pp={at.pp}, vpp={at.vpp}, pp_first={at.pp_first}, pp_last={at.pp_last}")
    pieces = convention.build(config, at)
    assert len(pieces) == at.world, (convention.name, at, len(pieces))
    return pieces


@functools.lru_cache(maxsize=512)
def _forward_layout(convention: Convention, config: ModelConfig, at: Endpoint) -> ForwardLayout:
    out = convention.reads(config, at)
    out.layout.validate(at.world)
    return out


@dataclass(frozen=True)
class Endpoint:
    """One side of a conversion: a convention at its parallel degrees and options, written
    ``"vllm:2"`` (TP 2; ``"hf"`` alone means 1) or ``"megatron:tp=2,ep=4,etp=1"``,
    ``"vllm:tp=4,ep=4"``, ``"hf:experts=fused"``, ``"megatron:tp=2,pp=2,vpp=2"``
    (``parse_endpoint``). ``degree`` is the TP degree, ``ep`` and ``etp`` the expert-parallel
    and expert-TP degrees of an MoE model's experts (``etp`` 0: the convention's default),
    ``options`` the convention's own choices (``Convention.options``), as sorted
    ``(key, value)`` pairs; ``pp``, ``vpp``, ``pp_first``, ``pp_last`` its pipeline split
    (``stages.Pipeline``: pipeline ranks, virtual stages, an uneven first / last stage's
    layers, 0 unset); ``world`` the number of ranks."""

    convention: Convention
    degree: int
    ep: int = 1
    etp: int = 0
    options: tuple[tuple[str, str], ...] = ()
    pp: int = 1
    vpp: int = 1
    pp_first: int = 0
    pp_last: int = 0

    @property
    def staged(self) -> bool:
        """Whether it names pipeline stages (``pp``, ``vpp``, ``pp_first``, ``pp_last``)."""
        return (self.pp, self.vpp, self.pp_first, self.pp_last) != (1, 1, 0, 0) or any(
            k in STAGE_OPTIONS for k, _ in self.options)

    @property
    def pipeline(self) -> Pipeline:
        """Its pipeline split (``pp_account``: the embedding and/or loss counted as layers)."""
        account = dict(self.options).get("pp_account", "none")
        return Pipeline(self.pp, self.vpp, self.pp_first, self.pp_last,
                        account in ("embedding", "both"), account in ("loss", "both"))

    def unstaged(self) -> Endpoint:
        """The same endpoint on one pipeline stage: what each stage's ranks are a slice of."""
        return Endpoint(self.convention, self.degree, self.ep, self.etp,
                        tuple((k, v) for k, v in self.options if k not in STAGE_OPTIONS))

    @property
    def name(self) -> str:
        return self.convention.name

    @property
    def tp(self) -> int:
        return self.degree

    @property
    def world(self) -> int:
        """How many ranks store this endpoint (``len(shards)``)."""
        return self.convention.world(self)

    def option(self, key: str) -> str:
        """The value of one of the convention's options (its default when not given)."""
        return dict(self.options).get(key, self.convention.options[key][0])

    def pieces(self, config: ModelConfig) -> Pieces:
        return self.convention.pieces(config, self)

    @property
    def quantized(self) -> bool:
        """Whether its linear weights are FP8 (``fp8=block128`` or ``fp8=tensor``:
        ``conventions.fp8``)."""
        return dict(self.options).get("fp8", "none") != "none"

    def unquantized(self) -> Endpoint:
        """The same endpoint with its weights in the source dtype: the index maps an FP8
        endpoint's tensors are cut by, and the forward that reads them dequantized."""
        return replace(self, options=tuple((k, v) for k, v in self.options if k != "fp8"))

    def __str__(self) -> str:
        if self.ep == 1 and not self.etp and not self.options and not self.staged:
            return f"{self.convention.name}:{self.degree}"
        stages = [f"{k}={getattr(self, k)}" for k, unset in (
            ("pp", 1), ("vpp", 1), ("pp_first", 0), ("pp_last", 0)) if getattr(self, k) != unset]
        parts = ([f"tp={self.degree}"] if self.degree != 1 or self.ep != 1 or self.etp
                 or stages else []) + stages + (
            [f"ep={self.ep}"] if self.ep != 1 else []) + (
            [f"etp={self.etp}"] if self.etp else []) + [f"{k}={v}" for k, v in self.options]
        return f"{self.convention.name}:{','.join(parts)}"


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


def need_unbiased_mixtral(convention: str, name: str, config: ModelConfig, degree: int
                          ) -> None:
    """A convention that stores Mixtral as transformers and vLLM build it holds no attention
    bias there: ``MixtralAttention``'s projections have ``bias=False`` in both (transformers
    4.57.6 ``modeling_mixtral.py``, vLLM ``models/mixtral.py`` @ f0e26957)."""
    need(not (config.n_experts and config.moe_style == "mixtral"
              and (config.has_qkv_bias or config.has_o_bias)), convention, name, degree,
         "no attention biases in a Mixtral (MixtralAttention's have bias=False)",
         f"qkv_bias={config.qkv_bias}, o_bias={config.o_bias}, bias={config.bias}")


def relaid(layout: LayoutTable, placements: dict[str, Placement]) -> LayoutTable:
    """``layout`` with the placements of the named parameters replaced (the forward of a
    convention reads most parameters as ``layout_for`` declares them, a few otherwise)."""
    from weight_sync_bench.layout.table import LayoutTable, ShardSpec

    return LayoutTable(tuple(ShardSpec(s.name, s.shape, placements.get(s.name, s.placement))
                             for s in layout))


# One canonical parameter stored as several tensors (HF's q/k/v from the fused qkv), or in an
# order of the convention's own (Megatron's grouped qkv): per stored name template, the
# canonical indices (along dim 0) rank r holds, or ``(dim, indices[, stack])``.
Cuts = Mapping[str, Sequence[tuple[str, Callable[[int], "torch.Tensor | tuple"]]]]


def renamed(config: ModelConfig, degree: int, layout: LayoutTable, names: Mapping[str, str],
            cuts: Cuts | None = None) -> Pieces:
    """A convention's pieces as data: every canonical parameter (in forward order) stored
    under ``names[template]`` (templates name layer i as ``{i}``: ``"layers.{i}.qkv.weight"``;
    an MoE layer's dense-layer names are looked up as ``"moe:" + template`` first) as its
    placement in ``layout`` cuts it, except those in ``cuts``, on each of ``degree`` ranks.
    A cut's function gives a rank's canonical rows (dim 0), or ``(dim, indices[, stack])``
    (``Piece``'s fields: another dim, a stacked tensor). Rows of ``layout``'s tables past the canonical ones (the convention's vocabulary
    padding) are zeros."""
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
            if layer is not None and config.is_moe_layer(int(layer)) and (
                    "moe:" + template in names or "moe:" + template in cuts):
                template = "moe:" + template
            if template in cuts:
                for name, idx in cuts[template]:
                    got = idx(rank)  # rows, or (dim, indices[, stack])
                    stored[name.format(i=layer)] = (Piece(canonical, *got) if isinstance(got, tuple)
                                                    else Piece(canonical, 0, got))
                continue
            spec = layout[canonical]
            dim, _ = spec.ranges(degree, rank)
            stored[names[template].format(i=layer)] = placed(spec, degree, rank, real=shape[dim])
        out.append(stored)
    return out


def replicated(layout: LayoutTable, tp: int) -> LayoutTable:
    """``layout``'s dense placements over ``world / tp`` data-parallel replicas of the TP
    group (``DataParallel``), its experts' as they are (they already span every rank)."""
    from weight_sync_bench.layout.table import LayoutTable, ShardSpec

    return LayoutTable(tuple(
        s if isinstance(s.placement, Experts) else ShardSpec(s.name, s.shape,
                                                              DataParallel(s.placement, tp))
        for s in layout))


PARALLEL_KEYS = ("tp", "ep", "etp", "pp", "vpp", "pp_first", "pp_last")
STAGE_OPTIONS = ("pp_account",)  # the options that say how stages split the layers


def parse_endpoint(text: str | Endpoint, known: dict[str, Convention]) -> Endpoint:
    """An endpoint from its text: ``"megatron:4"`` (TP 4), ``"hf"`` (TP 1),
    ``"megatron:tp=2,ep=4,etp=1,experts=sequential"``, ``"vllm:tp=4,ep=4"``,
    ``"megatron:tp=2,pp=2,vpp=2"``: after the convention's name, a TP degree alone or
    ``key=value`` items, the keys ``tp``, ``ep``, ``etp``, ``pp``, ``vpp``, ``pp_first``,
    ``pp_last`` (positive integers) and the convention's options (``Convention.options``)."""
    if isinstance(text, Endpoint):
        return text
    if not isinstance(text, str):
        raise UnknownConvention(f"a conversion endpoint is a 'name:degree' string, got "
                                f"{type(text).__name__} {text!r}")
    name, sep, spec = text.partition(":")
    if name not in known:
        raise UnknownConvention(f"unknown convention {name!r} in {text!r}; known: "
                                f"{', '.join(known)}")
    convention = known[name]
    if not sep:
        return Endpoint(convention, 1)
    if "=" not in spec:  # a TP degree alone
        if not spec.isdigit() or int(spec) < 1:
            raise UnknownConvention(f"{text!r}: the degree after ':' must be a positive integer")
        return Endpoint(convention, int(spec))
    values: dict[str, str] = {}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise UnknownConvention(f"{text!r}: after ':' a TP degree alone or key=value items "
                                    f"(e.g. {name}:tp=4,ep=2), got {item!r}")
        if key in values:
            raise UnknownConvention(f"{text!r}: {key} given twice")
        keys = PARALLEL_KEYS if convention.stages else PARALLEL_KEYS[:3]
        if key not in keys and key not in convention.options:
            allowed = [*keys, *convention.options]
            raise UnknownConvention(f"{text!r}: {name} has no option {key!r}; known: "
                                    f"{', '.join(allowed)}")
        if key in convention.options and value not in convention.options[key]:
            raise UnknownConvention(f"{text!r}: {name} option {key}={value!r}; known: "
                                    f"{', '.join(convention.options[key])}")
        values[key] = value
    degrees = {}
    for key in PARALLEL_KEYS:
        if key in values:
            if not values[key].isdigit() or int(values[key]) < 1:
                raise UnknownConvention(f"{text!r}: {key} must be a positive integer, got "
                                        f"{values[key]!r}")
            degrees[key] = int(values.pop(key))
    return Endpoint(convention, degrees.get("tp", 1), degrees.get("ep", 1), degrees.get("etp", 0),
                    tuple(sorted(values.items())), degrees.get("pp", 1), degrees.get("vpp", 1),
                    degrees.get("pp_first", 0), degrees.get("pp_last", 0))

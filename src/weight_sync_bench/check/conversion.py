"""``ConversionChecker``: the verdict on one conversion's destination shards.

The verdict is ``check_split``'s, for conventions (``check.convert``):

- the output's structure first: a list of ``degree`` dicts of exactly the destination's
  names, shapes and dtypes, else ``InvalidShards`` naming the convention, rank and name
  (``check.shards``);
- data movement, bit-exactly, against ``shards_for(config, dst)``; the first parameter that
  differs is diagnosed in the convention's own terms (``check.diagnosis``);
- computation: the destination's forward, reading the tensors as that framework does
  (``conventions.reading``), against the dense reference within the threshold of the
  ``Checker`` it is given. Non-finite logits never pass; a byte mismatch fails even when the
  logits stay within tolerance.

``require_cell``: a conversion whose destination forward has no cell at its degree in the
floor that judges it is refused (``FloorNotMeasured`` naming the command that measures it),
never judged by the plain cells' threshold (see ``check.convert`` and ``check.floor``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.check.checker import Checker, Verdict, checker_for
from weight_sync_bench.check.diagnosis import (
    bit_equal,
    diagnose,
    held_layer,
    mismatching,
    slice_index,
)
from weight_sync_bench.check.floor import (
    REPLICATED_MAX_DEGREE,
    convention_logits,
    forward_of,
)
from weight_sync_bench.check.naming import conversion_naming, name_shards
from weight_sync_bench.check.shards import validate_convention_shards
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.mutations import Conversion
from weight_sync_bench.conventions.staging import describe_rank
from weight_sync_bench.errors import FloorNotMeasured, Uncovered
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.phase import PLAIN_FORWARD, measured_degrees
from weight_sync_bench.tolerance.rules import measure_command, weights_dtype

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.model.config import ModelConfig
    from weight_sync_bench.tolerance.rules import Floor


Params = dict[str, torch.Tensor]


@dataclass
class ConversionChecker:
    """Checks conversions of the geometry, weights and tokens of ``checker``: the reference
    and threshold are its own (computed once), each destination's declared shards and their
    forward once; a shard set byte-identical to the declared one reuses that forward. The
    destination forward runs where ``checker``'s does (its phase: 1a in process, 1b over
    gloo). ``conversion_checker`` makes one from a config and the options of ``checker_for``;
    the fuzz passes its own ``Checker`` (fuzz weights, tokens and threshold rule)."""

    checker: Checker
    _declared: dict[str, list[Params]] = field(init=False, default_factory=dict)
    _declared_error: dict[str, float] = field(init=False, default_factory=dict)
    _slices: dict[tuple[str, int], dict[bytes, int]] = field(init=False, default_factory=dict)

    @property
    def config(self) -> ModelConfig:
        return self.checker.config

    def source(self, where: str | Endpoint) -> list[Params]:
        """Fresh copies of a convention's declared shards (what ``fn`` receives)."""
        return materialize(endpoint(where).pieces(self.config), self.checker.full)

    def declared(self, where: str | Endpoint) -> list[Params]:
        """``shards_for(config, where)`` at the checker's seed (cached; do not mutate)."""
        key = str(endpoint(where))
        if key not in self._declared:
            self._declared[key] = self.source(where)
        return self._declared[key]

    def error(self, where: str | Endpoint, shards: Sequence[Mapping[str, torch.Tensor]]) -> float:
        """Max |logits - reference| of ``where``'s forward reading ``shards``."""
        tokens = self.checker.tokens
        assert tokens is not None
        return self.checker.deviation(convention_logits(
            endpoint(where), self.config, shards, tokens, self.checker.phase,
            guard=self.checker.guard))

    def require(self, where: str | Endpoint) -> None:
        """``require_cell`` of the floor this checker's threshold came from (none where the
        threshold was given: the caller's choice)."""
        require_cell(self.checker.floor, self.config, endpoint(where))

    def slice_index(self, source: str, dim: int) -> dict[bytes, int]:
        """``diagnosis.slice_index`` of a canonical parameter (cached: a diagnosis matches
        every shard's slices against it)."""
        if (source, dim) not in self._slices:
            self._slices[source, dim] = slice_index(self.checker.full[source], dim)
        return self._slices[source, dim]

    def declared_error(self, where: str | Endpoint) -> float:
        key = str(endpoint(where))
        if key not in self._declared_error:
            self._declared_error[key] = self.error(where, self.declared(where))
        return self._declared_error[key]

    def verdict(self, shards: object, *, src: str | Endpoint, dst: str | Endpoint,
                mutation: str | None = None) -> Verdict:
        """Validate, compare bytes with the declared destination, run a forward only if
        they differ (with a diagnosis of the first parameter that does)."""
        source, target = endpoint(src), endpoint(dst)
        self.require(target)  # a destination forward its floor never measured: refused
        try:
            validate_convention_shards(shards, target, self.config,
                                       {n: x.dtype for n, x in self.checker.full.items()})
        except Uncovered as e:  # say what the layers that were written hold instead
            assert isinstance(shards, Sequence)
            raise Uncovered(str(e) + self.misplaced(target, shards), missing=e.missing) from None
        assert isinstance(shards, Sequence)
        checked = [dict(params) for params in shards]
        declared = self.declared(target)
        pieces = target.pieces(self.config)
        stored = target.convention.names(self.config, target)
        differ = mismatching(checked, declared, stored)
        assert self.checker.threshold is not None
        common: dict[str, Any] = {
            "config": self.config.name, "src": source.degree, "dst": target.degree,
            "threshold": self.checker.threshold, "phase": self.checker.phase,
            "mutation": mutation, "conventions": (endpoint_name(source), endpoint_name(target)),
            "notes": self.checker.notes,
            "dtype": self.checker.dtype_name, **self.checker.routing}
        if not differ:
            return Verdict(max_abs_error=self.declared_error(target), first_mismatch=None,
                           **common)
        first = differ[0]
        lines = diagnose(self.checker.full, self.config, first, [p.get(first) for p in pieces],
                         [s.get(first) for s in checked], index=self.slice_index)
        if target.staged:  # where each differing rank sits in the pipeline
            lines += [describe_rank(self.config, target, r) for r, (s, d) in
                      enumerate(zip(checked, declared)) if first in d
                      and not bit_equal(s[first], d[first])]
        assert isinstance(self.checker.dtype, torch.dtype)
        naming = conversion_naming(Conversion(self.config, source, target), declared,
                                   self.checker.dtype,
                                   self.checker.layout if target.name == "plain" else None)
        named = name_shards(naming, checked, declared, differ, stored)
        return Verdict(max_abs_error=self.error(target, checked), first_mismatch=first,
                       mismatches=tuple(differ), own_forward=True, diagnosis=tuple(lines),
                       named_mutation=named.mutation, named_meaning=named.meaning, **common)


    def misplaced(self, target: Endpoint, shards: Sequence[object]) -> str:
        """``; written layers holding another layer's weights: rank 0 layer 0 holds layer
        2's, ...``: for each rank and layer, its first stored tensor whose bytes are the same
        parameter of another layer (``diagnosis.held_layer``); empty where none is."""
        found = []
        for rank, (held, pieces) in enumerate(zip(shards, target.pieces(self.config))):
            if not isinstance(held, Mapping):
                continue
            seen: set[str] = set()
            for name, piece in pieces.items():
                parts = piece.source.split(".")
                x = held.get(name)
                if parts[0] != "layers" or parts[1] in seen or not isinstance(x, torch.Tensor):
                    continue
                seen.add(parts[1])
                other = held_layer(self.checker.full, self.config, piece, x)
                if other is not None:
                    found.append(f"rank {rank} layer {parts[1]} holds layer {other}'s")
        if not found:
            return ""
        return ("; written layers holding another layer's weights byte for byte: "
                f"{', '.join(found)} (two stages publishing the same local indices, or a "
                "stage's offset wrong)")


def endpoint_name(where: Endpoint) -> str:
    """An endpoint as a verdict names it: the convention's name where the TP degree says the
    rest (``vllm``), else the whole endpoint (``megatron:tp=2,ep=4``)."""
    text = str(where)
    return where.name if text == f"{where.name}:{where.degree}" else text


def conversion_checker(config: ModelConfig, *, seed: int = 0, backend: str = "inprocess",
                       threshold: float | None = None,
                       dtype: torch.dtype | str = torch.float32,
                       measure_floor: bool = False,
                       params: Params | None = None, mixed: bool = False) -> ConversionChecker:
    """A ``ConversionChecker`` over ``checker_for(config, ...)``'s checker: the seed's weights
    in ``dtype``, the destination forward in process (``"inprocess"``, phase 1a) or over gloo
    (``"gloo"``, phase 1b), judged by ``threshold`` or by the floor that covers the geometry
    (``measure_floor``: measured and cached where none does)."""
    return ConversionChecker(checker_for(config, seed=seed, backend=backend,
                                         threshold=threshold, dtype=dtype,
                                         measure_floor=measure_floor, params=params,
                                         mixed=mixed))


def require_cell(floor: Floor | None, config: ModelConfig, target: Endpoint) -> None:
    """Raise ``FloorNotMeasured`` unless ``floor`` (the one judging a conversion to
    ``target``; None for a threshold given explicitly) measured the destination's forward
    (``check.floor.forward_of``: vLLM's replicated KV heads at t > n_kv_heads, else the plain
    layout's) at its degree. The error names the geometry, the degree, the convention, what
    the floor measured and the command that measures the missing cell."""
    if floor is None:
        return
    # a staged endpoint's forward is its unstaged one's (``Convention.forward_layout``)
    degree = (target.unstaged() if target.staged else target).world
    forward = forward_of(target.convention, config, target)
    measured = measured_degrees(floor.artifact, config.name, forward)
    if degree in measured:
        return
    phase, dtype = str(floor.artifact.get("phase", "1a")), weights_dtype(floor.artifact)
    plain = measured_degrees(floor.artifact, config.name, PLAIN_FORWARD)
    had = (f"measured it at t={', '.join(map(str, measured))}" if measured
           else "never measured it")
    why = (f"{config.name}: no measured floor covers the forward of {target} (phase {phase}, "
           f"{dtype} weights, d_model {config.d_model}, n_heads {config.n_heads}, n_kv_heads "
           f"{config.n_kv_heads}): {target.convention.name} at t={degree} runs the {forward} "
           f"forward, and {floor.path.name} {had} (its plain cells: t="
           f"{', '.join(map(str, plain)) or 'none'}); a threshold measured on another forward "
           "or degree does not judge it")
    if forward == PLAIN_FORWARD and not layout_for(config).supports(degree):
        raise FloorNotMeasured(  # the plain layout cannot store t: no floor measurement can
            f"{why}. The plain layout cannot store t={degree}, so no floor measurement has "
            "this cell; pass threshold= explicitly (e.g. check.convert.measure_threshold)")
    command = _cell_command(floor, config, phase, dtype, degree)
    raise FloorNotMeasured(f"{why}. Measure it with `{command}`", command=command)


def _cell_command(floor: Floor, config: ModelConfig, phase: str, dtype: str,
                  degree: int) -> str:
    """What measures ``floor`` again with the cell at ``degree``: the committed floor's
    measuring command, or the per-geometry floor's (``--force``: it is cached already); a
    Python call where the degree is past ``REPLICATED_MAX_DEGREE`` (the command's bound)."""
    tail = (f" --phase {phase}" if phase != "1a" else "") + (
        f" --dtype {dtype}" if dtype != "fp32" else "")
    if degree > REPLICATED_MAX_DEGREE:
        what = "measure" if floor.source == "committed" else "measure_geometry"
        configs = f"configs=[{config.name}], replicated=True, " if what == "measure" else (
            "config, ")
        return (f"weight_sync_bench.check.floor.{what}({configs}phase={phase!r}, "
                f"dtype={dtype!r}, max_degree={degree})")
    if floor.source == "committed":
        return f"python -m weight_sync_bench.tolerance{tail} --write"
    command = measure_command(config, phase, dtype)
    return f"{command} --force" if command.startswith("python -m") else command

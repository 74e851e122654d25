"""Name the bug: shards that differ from the declared ones, matched against the catalogues.

Where the observed shards are, bit for bit on every stored tensor, what a catalogued
mutation makes of the declared ones (the same source), the verdict names it and says what
it means for the code that made them (``Verdict.named_mutation``). The catalogues a check
tries:

- a plain layout (``check_split``, ``check_reshard``): the layout mutations
  (``check.mutations.MUTATIONS``) and the dtype round trips (``DTYPE_MUTATIONS``);
- a conversion (``check_convert``, ``verify_checkpoint``): the conversion mutations that
  apply to it (``conventions.mutations``), the dtype round trips, and where the destination
  is the plain layout, the layout mutations too.

Only mutations that are not the identity there are tried (their own ``identity_reason``);
shards equal to the declared ones are never named (nothing is tried). Where several
mutations give the same bytes at a geometry, all of them are named.

The planner mutations (``sync.mutations``) are not in it: they change a plan, not shards,
so what they make depends on the plan's transfers (the first run of rank 0, the largest
transfer), not on what a converter wrote; ``wsb sync --mutation`` names the one it runs.

Cost, only when the shards differ: each candidate is applied once per verdict (a layout
mutation parameter by parameter, as asked; a conversion mutation to the whole declared set,
on first use), compared on the parameters that differ first, then on the rest, and dropped
at its first difference; parameters a layout mutation does not touch are equal to the
declared ones by construction and not compared.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.check.mutations import DTYPE_MUTATIONS, MUTATIONS
from weight_sync_bench.conventions.mutations import CONVERSION_MUTATIONS, Conversion
from weight_sync_bench.layout.reshard import split_tensor
from weight_sync_bench.model.config import iter_params

if TYPE_CHECKING:
    from weight_sync_bench.check.mutations import Mutation
    from weight_sync_bench.conventions.mutations import ConversionMutation
    from weight_sync_bench.layout.table import LayoutTable, ShardSpec
    from weight_sync_bench.model.config import ModelConfig

Params = dict[str, torch.Tensor]
Tensors = Sequence[torch.Tensor]


@dataclass
class Candidate:
    """One catalogued mutation, as a verdict tries it: ``mutated(name, declared)`` is what it
    makes of the declared per-rank tensors of stored tensor ``name`` (the declared tensors
    themselves where it leaves them alone)."""

    name: str
    meaning: str
    mutated: Callable[[str, Tensors], Tensors]
    # Whether it may change stored tensor ``name`` at all (a layout mutation's target, the
    # parameters a conversion mutation changes): where it may not, it is never applied to
    # it, and a streamed check does not draw that parameter again for it.
    touches: Callable[[str], bool] = lambda name: True


@dataclass(frozen=True)
class Named:
    """The mutations the shards are exactly (catalogue order), and what each means."""

    names: tuple[str, ...]
    meanings: tuple[str, ...]

    @property
    def mutation(self) -> str | None:
        """``Verdict.named_mutation``: the name, or the names of those that coincide."""
        return ", ".join(self.names) or None

    @property
    def meaning(self) -> str | None:
        """``Verdict.named_meaning``: one line; each name's where several coincide."""
        if len(self.names) <= 1:
            return self.meanings[0] if self.meanings else None
        return "; ".join(f"`{n}`: {m}" for n, m in zip(self.names, self.meanings))


NONE = Named((), ())


def same(a: Tensors, b: Tensors) -> bool:
    """The same tensors, bit for bit, rank by rank; a different number of ranks is not."""
    return len(a) == len(b) and all(x is y or bit_equal(x, y) for x, y in zip(a, b))


@dataclass
class Naming:
    """The candidates still alive for one verdict, narrowed stored tensor by stored tensor:
    ``observe`` each (in any order: a whole check takes the differing ones first, a streamed
    one takes them as they come) until none is left; ``named`` is then the candidates every
    observed tensor agreed with."""

    alive: list[Candidate]

    def observe(self, name: str, declared: Tensors, observed: Tensors, *, differs: bool) -> None:
        """Keep the candidates whose tensors ``name`` are ``observed`` bit for bit; ``differs``:
        whether ``observed`` differs from ``declared`` (the caller has compared them). A
        candidate that leaves ``name`` alone is kept exactly where it does not differ."""
        kept = []
        for c in self.alive:
            mine = c.mutated(name, declared) if c.touches(name) else declared
            if all(m is d for m, d in zip(mine, declared)):  # left alone: declared's own
                if not differs:
                    kept.append(c)
            elif same(mine, observed):
                kept.append(c)
        self.alive = kept

    @property
    def done(self) -> bool:
        return not self.alive

    def named(self) -> Named:
        return Named(tuple(c.name for c in self.alive), tuple(c.meaning for c in self.alive))


def name_shards(naming: Naming, observed: Sequence[Mapping[str, torch.Tensor]],
                declared: Sequence[Mapping[str, torch.Tensor]], differ: Sequence[str],
                names: Iterable[str]) -> Named:
    """What a whole shard set is, exactly: ``naming``'s candidates narrowed on the stored
    tensors that differ (``differ``, first), then on the others of ``names``, stopping when
    none is left. Nothing is tried when nothing differs."""
    if not differ:
        return NONE
    differing = set(differ)
    for name in [*differ, *(n for n in names if n not in differing)]:
        if naming.done:
            break
        held = [r for r, d in enumerate(declared) if name in d]  # a stage's ranks only
        naming.observe(name, [declared[r][name] for r in held],
                       [observed[r][name] for r in held], differs=name in differing)
    return naming.named()


def observe_redrawn(naming: Naming, before: list[str], config: ModelConfig,
                    layout: LayoutTable, dst: int, seed: int, weights: torch.dtype) -> None:
    """Narrow ``naming`` on parameters the pass found equal to the declared ones before the
    first difference, and dropped: drawn again, one at a time, only those a candidate still
    alive touches (a candidate that leaves a parameter alone agrees with it)."""
    touched = {n for n in before for c in naming.alive if c.touches(n)}
    if not touched:
        return
    for name, x in iter_params(config, seed, dtype=weights):
        if name in touched:
            declared = split_tensor(x, layout[name], dst)
            naming.observe(name, declared, declared, differs=False)
            touched.discard(name)
        del x
        if not touched or naming.done:
            return


# ---------------------------------------------------------------- the catalogues

def _layout_candidate(m: Mutation, layout: LayoutTable, config: ModelConfig) -> Candidate:
    def mutated(name: str, declared: Tensors) -> Tensors:
        if not re.fullmatch(m.target, name):
            return declared
        return m.bug(list(declared), layout[name], config)
    return Candidate(m.name, m.description, mutated,
                     lambda name: re.fullmatch(m.target, name) is not None)


def layout_naming(config: ModelConfig, layout: LayoutTable, degree: int,
                  dtype: torch.dtype) -> Naming:
    """The plain layout's catalogue at ``degree`` for ``dtype`` weights: every layout mutation
    and dtype round trip that is not the identity there (``Mutation.identity_reason``)."""
    return Naming([_layout_candidate(m, layout, config)
                   for m in (*MUTATIONS.values(), *DTYPE_MUTATIONS)
                   if m.identity_reason(config, degree, dtype) is None])


def _conversion_candidate(m: ConversionMutation, conversion: Conversion,
                          whole: Sequence[Mapping[str, torch.Tensor]],
                          source_of: Mapping[str, str]) -> Candidate:
    made: list[list[Params]] = []  # the mutation applied to the whole declared set, once

    def mutated(name: str, declared: Tensors) -> Tensors:
        if not made:
            made.append(m.apply(list(whole), conversion))  # type: ignore[arg-type]
        return [rank[name] for rank in made[0] if name in rank]  # a stage's ranks only
    return Candidate(m.name, f"{m.description}; modelled on {m.models}", mutated,
                     lambda name: re.fullmatch(m.changes, source_of[name]) is not None)


def _round_trip_candidate(m: Mutation, config: ModelConfig) -> Candidate:
    def mutated(name: str, declared: Tensors) -> Tensors:
        # a round trip is a function of each tensor alone: it reads no layout spec
        return m.bug(list(declared), cast("ShardSpec", None), config)
    return Candidate(m.name, m.description, mutated)


def conversion_naming(conversion: Conversion, declared: Sequence[Mapping[str, torch.Tensor]],
                      dtype: torch.dtype, layout: LayoutTable | None = None) -> Naming:
    """A conversion's catalogue: the conversion mutations that apply to it and are not the
    identity there, the dtype round trips that are not, and, where the destination is the
    plain layout (``layout``: its table), the layout mutations that are not."""
    config, degree = conversion.config, conversion.dst.degree
    source_of = {name: piece.source for rank in conversion.dst.pieces(config)
                 for name, piece in rank.items()}
    found = [_conversion_candidate(m, conversion, declared, source_of)
             for m in CONVERSION_MUTATIONS
             if m.not_applicable(conversion) is None and m.identity_reason(conversion) is None]
    if layout is not None:
        found += [_layout_candidate(m, layout, config) for m in MUTATIONS.values()
                  if m.identity_reason(config, degree, dtype) is None]
    found += [_round_trip_candidate(m, config) for m in DTYPE_MUTATIONS
              if m.identity_reason(config, degree, dtype) is None]
    return Naming(found)

"""Strategies for fuzzing a user's own splitter, resharder or converter.

- ``narrow(domain, **ranges)``: the fuzz domain cut down to what the user's function supports
  (``max_d_model=64``, ``kv_heads=(1, 2)``, ``gqa=False``, ``vocab_multiple=8``). A narrowed
  domain is a subset of the sampled one, never wider: the threshold for a fuzzed geometry is
  derived from floor samples over ``DOMAIN`` and says nothing outside it;
- ``convention_degrees(name, config)``: the degrees a storage convention can store a
  geometry at (probed, as ``Convention.supported_degrees`` does), up to ``MAX_DEGREE``;
- ``user_cases(role, ...)``: a ``Case`` for the user's function: a geometry of the narrowed
  domain, the degrees (drawn from what the layout, or the conventions, support there, or
  fixed), a seed; a converter's ends drawn over its conventions' TP degrees and, for
  Megatron, its pipeline splits (``convention_ends``).

Everything shrinks as ``geometries`` does (toward the domain's smallest geometry), the
degrees toward the smallest supported, the seed toward 0.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from hypothesis import assume
from hypothesis import strategies as st
from weight_sync_bench.fuzz.strategies import geometries, seeds
from weight_sync_bench.fuzz.strategies.conventions import case_end, staged_endpoints

from weight_sync_bench.conventions import CONVENTIONS, Endpoint, convention_by_name, endpoint
from weight_sync_bench.conventions.fp8 import require_stored
from weight_sync_bench.conventions.stages import Pipeline
from weight_sync_bench.errors import InvalidConfig, UnsupportedLayout
from weight_sync_bench.fuzz.case import Case, ConversionCase, end_of, options_only
from weight_sync_bench.fuzz.domain import DOMAIN, FuzzDomain, IntRange
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.plan import layout_for

ROLES = ("splitter", "resharder", "converter")
MAX_DEGREE = 8  # the largest convention degree a converter is fuzzed at (vLLM's KV replication)
FIELDS = tuple(f.name for f in dataclasses.fields(FuzzDomain))

Range = int | tuple[int, int] | IntRange


def _members(r: IntRange) -> list[int]:
    return list(range(r.lo, r.hi + 1, r.step))


def _as_range(field: str, members: list[int], asked: str) -> IntRange:
    """``members`` (ascending, non-empty) as an IntRange, or an error saying why not."""
    if not members:
        raise InvalidConfig(f"{asked}: no {field} of the fuzz domain ({getattr(DOMAIN, field)}) "
                            "is left")
    steps = {b - a for a, b in itertools.pairwise(members)}
    if len(steps) > 1:
        raise InvalidConfig(f"{asked}: the {field} values left ({members}) are not evenly spaced")
    return IntRange(members[0], members[-1], steps.pop() if steps else 1)


def _within(domain: FuzzDomain, field: str, value: Range, asked: str) -> IntRange:
    """``domain.field`` cut to ``value`` (an int, ``(lo, hi)`` or an IntRange); a value that
    reaches outside the domain is an error naming the domain's range."""
    current: IntRange = getattr(domain, field)
    if isinstance(value, IntRange):
        wanted = value
    elif isinstance(value, bool):
        raise InvalidConfig(f"{asked}: expected an int or (lo, hi), got {value!r}")
    elif isinstance(value, int):
        wanted = IntRange(value, value)
    elif isinstance(value, Sequence) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        wanted = IntRange(value[0], value[1])
    else:
        raise InvalidConfig(f"{asked}: expected an int or (lo, hi), got {value!r}")
    if wanted.lo < current.lo or wanted.hi > current.hi:
        raise InvalidConfig(
            f"{asked}: the fuzz domain has {field} {current}; the threshold of a fuzzed geometry "
            "is derived from floor samples over that domain, so it cannot be widened (narrow "
            "it, or measure a floor over a wider one: wsb floor --random N)")
    return _as_range(field, [v for v in _members(current) if v in wanted], asked)


def narrow(domain: FuzzDomain = DOMAIN, *, max_d_model: int | None = None,
           kv_heads: Range | None = None, gqa: bool | None = None,
           vocab_multiple: int | None = None, **ranges: Range) -> FuzzDomain:
    """``domain`` narrowed to what a user's function supports.

    - ``FIELD=(lo, hi)`` or ``FIELD=n`` for any field of ``FuzzDomain`` (``n_kv_heads``,
      ``group``, ``head_dim``, ``d_model``, ``ffn_per_kv_head``, ``vocab_per_kv_head``,
      ``n_layers``, ``batch``, ``seq_len``, ``seed``); ``kv_heads`` is ``n_kv_heads``;
    - ``max_d_model=N``: ``d_model <= N``;
    - ``gqa=False``: MHA only (``n_heads == n_kv_heads``); ``gqa=True``: GQA only
      (``n_heads >= 2 n_kv_heads``);
    - ``vocab_multiple=k``: every vocabulary a multiple of k (``vocab_per_kv_head`` a
      multiple of k).

    Every range must lie inside ``domain``: ``InvalidConfig`` names the field and the
    domain's range otherwise, and says when nothing is left."""
    if kv_heads is not None:
        if "n_kv_heads" in ranges:
            raise InvalidConfig("give kv_heads or n_kv_heads, not both")
        ranges["n_kv_heads"] = kv_heads
    unknown = sorted(set(ranges) - set(FIELDS))
    if unknown:
        raise InvalidConfig(f"unknown domain field {unknown[0]!r}; known: "
                            f"{', '.join(FIELDS)}, kv_heads, max_d_model, gqa, vocab_multiple")
    changes = {f: _within(domain, f, v, f"{f}={_show(v)}") for f, v in ranges.items()}
    out = dataclasses.replace(domain, **changes)
    if max_d_model is not None:
        keep = [d for d in _members(out.d_model) if d <= max_d_model]
        out = dataclasses.replace(out, d_model=_as_range("d_model", keep,
                                                         f"max_d_model={max_d_model}"))
    if gqa is not None:
        keep = [g for g in _members(out.group) if (g >= 2) == gqa]
        out = dataclasses.replace(out, group=_as_range("group", keep, f"gqa={gqa}"))
    if vocab_multiple is not None:
        if isinstance(vocab_multiple, bool) or not isinstance(vocab_multiple, int) \
                or vocab_multiple < 1:
            raise InvalidConfig(f"vocab_multiple must be an int >= 1, got {vocab_multiple!r}")
        keep = [v for v in _members(out.vocab_per_kv_head) if v % vocab_multiple == 0]
        out = dataclasses.replace(out, vocab_per_kv_head=_as_range(
            "vocab_per_kv_head", keep, f"vocab_multiple={vocab_multiple}"))
    return out


def _show(value: Range) -> str:
    if isinstance(value, tuple):
        return f"{value[0]}-{value[1]}"
    return str(value)


def convention_degrees(name: str, config: ModelConfig, max_degree: int = MAX_DEGREE
                       ) -> list[int]:
    """The degrees in 1..``max_degree`` convention ``name`` can store ``config`` at (with its
    options, ``"vllm:fp8=block128"``: where that endpoint holds it too, vLLM's FP8 block
    rules included); for a whole endpoint (``"megatron:tp=2,pp=2"``, fixed by the user) its
    world, where it stores ``config``."""
    if options_only(name):
        return [t for t in convention_by_name(name.partition(":")[0]).supported_degrees(
            config, max_degree) if holds(end_of(name, t), config)]
    if ":" in name:
        at = endpoint(name)
        return [at.world] if at.convention.supports(config, at) else []
    return convention_by_name(name).supported_degrees(config, max_degree)


def holds(at: Endpoint, config: ModelConfig) -> bool:
    """Whether endpoint ``at`` stores ``config`` (``conventions.fp8.require_stored``: an FP8
    one with its scales, vLLM's block rules included)."""
    try:
        require_stored(config, at)
    except UnsupportedLayout:
        return False
    return True


def convention_ends(name: str, config: ModelConfig, max_degree: int = MAX_DEGREE
                    ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The ends a converter of ``name`` is fuzzed at on ``config``, as a ``ConversionCase``
    names them: ``(name, t)`` at every TP degree the convention stores it at, and, for a
    convention with pipeline stages (Megatron), its splits of ``config`` within
    ``max_degree`` ranks (``staged_endpoints``: even, virtual, uneven first or last, the
    embedding or loss counted) as ``(endpoint text, world)``. A whole endpoint the user
    fixed is that endpoint alone (no staged ones beside it)."""
    plain = [(name, d) for d in convention_degrees(name, config, max_degree)]
    if ":" in name or not convention_by_name(name).stages:
        return plain, []
    return plain, [case_end(at) for at in staged_endpoints(config, max_degree)
                   if at.name == name]


def _layers_for(domain: FuzzDomain, conventions: tuple[str, str] | None) -> FuzzDomain:
    """``domain`` with its layer counts cut to those every staged end can split (Megatron's
    rules, ``stages.Pipeline``): ``InvalidConfig`` naming the endpoint where none is left."""
    staged = [endpoint(c) for c in conventions or () if ":" in c and endpoint(c).staged]
    if not staged:
        return domain
    layers = [n for n in _members(domain.n_layers)
              if all(_splits(at.pipeline, n) for at in staged)]
    if not layers:
        raise InvalidConfig(f"{', '.join(map(str, staged))}: no layer count of the domain "
                            f"(n_layers {domain.n_layers}, never wider than the sampled "
                            f"{DOMAIN.n_layers}) is split by its pipeline: fuzz a split those "
                            "layers allow (pp=2 at 2 layers, pp=3 or pp=2,pp_last=2 at 3), or "
                            "check this one with check_convert / wsb check --converter")
    return dataclasses.replace(domain, n_layers=IntRange(layers[0], layers[-1]))


def _splits(pipeline: Pipeline, n_layers: int) -> bool:
    try:
        pipeline.chunks(n_layers)
    except UnsupportedLayout:  # Megatron's rules refuse the split
        return False
    return True


def _supported(role: str, config: ModelConfig, conventions: tuple[str, str] | None
               ) -> tuple[list[int], list[int]]:
    """(source degrees, destination degrees) the role can be checked at on ``config``."""
    if role == "converter":
        assert conventions is not None
        return (convention_degrees(conventions[0], config),
                convention_degrees(conventions[1], config))
    degrees = layout_for(config).supported_degrees()
    return ([1] if role == "splitter" else degrees), degrees


def kv_head_choices(role: str, domain: FuzzDomain, src: int | None, dst: int | None,
                    conventions: tuple[str, str] | None = None) -> list[int]:
    """The ``n_kv_heads`` of ``domain`` at which fixed degrees ``src`` / ``dst`` can be
    supported, probed on the smallest and the largest geometry with that many KV heads (what
    the layout and the conventions support depends on the head and ffn counts; a drawn
    geometry that still does not support them is rejected); all of them when no degree is
    fixed. ``InvalidConfig`` when none is left."""
    choices = []
    for kv in _members(domain.n_kv_heads):
        at = dataclasses.replace(domain, n_kv_heads=IntRange(kv, kv))
        for probe in (at.smallest(), at.largest()):
            srcs, dsts = _supported(role, probe, conventions)
            if (src is None or src in srcs) and (dst is None or dst in dsts):
                choices.append(kv)
                break
    if not choices:
        fixed = ", ".join(f"{k}={v}" for k, v in (("src", src), ("dst", dst)) if v is not None)
        raise InvalidConfig(f"no geometry of the domain (n_kv_heads {domain.n_kv_heads}) "
                            f"supports the fixed degrees {fixed} for this {role}")
    return choices


def user_cases(role: str, *, domain: FuzzDomain = DOMAIN, src: int | None = None,
               dst: int | None = None, conventions: tuple[str, str] | None = None,
               phase: str = "1a", stages: tuple[bool, bool] = (True, True)
               ) -> st.SearchStrategy[Case | ConversionCase]:
    """Cases for a user's ``role`` function: a geometry of ``domain`` (``n_kv_heads`` drawn
    first, from the values at which the fixed degrees are supported), then the degrees: a
    splitter's source is 1 (the full model), a resharder's pair is drawn from the degrees
    ``layout_for`` supports, a converter's from those each convention supports (up to
    ``MAX_DEGREE``: a ``ConversionCase``); ``src`` / ``dst`` fix them. A converter's end of
    a convention with pipeline stages (Megatron) is drawn at its splits too, where
    ``stages`` says that end may be (``fuzz.user`` allows it where the converter takes
    ``source=`` / ``target=``: without the endpoint a rank's local layer names cannot be
    placed). Shrinks toward the smallest geometry, the smallest degrees, TP only, and seed
    0."""
    if role not in ROLES:
        raise InvalidConfig(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    if role == "converter":
        if conventions is None or any(c.partition(":")[0] not in CONVENTIONS
                                      for c in conventions):
            raise InvalidConfig(f"a converter needs two conventions of {', '.join(CONVENTIONS)} "
                                f"(or whole endpoints of them), got {conventions!r}")
        domain = _layers_for(domain, conventions)
    elif conventions is not None:
        raise InvalidConfig(f"a {role} has no conventions (they are a converter's)")
    if role == "splitter" and src not in (None, 1):
        raise InvalidConfig(f"a split starts from the full model (degree 1), got src={src}")
    kv_choices = kv_head_choices(role, domain, src, dst, conventions)
    return _user_cases(role, domain, src, dst, conventions, phase, tuple(kv_choices), stages)


@st.composite
def _user_cases(draw: st.DrawFn, role: str, domain: FuzzDomain, src: int | None,
                dst: int | None, conventions: tuple[str, str] | None, phase: str,
                kv_choices: tuple[int, ...], stages: tuple[bool, bool]
                ) -> Case | ConversionCase:
    kv = draw(st.sampled_from(kv_choices))
    config = draw(geometries(dataclasses.replace(domain, n_kv_heads=IntRange(kv, kv))))
    if role == "converter":
        assert conventions is not None
        ends = [_end(draw, conventions[i], config, fixed, stages[i])
                for i, fixed in enumerate((src, dst))]
        assume(all(e is not None for e in ends))
        (sc, s), (dc, d) = ends  # type: ignore[misc]
        return ConversionCase(config=config, src_convention=sc, src=s, dst_convention=dc,
                              dst=d, seed=draw(seeds(domain)), phase=phase)
    srcs, dsts = _supported(role, config, conventions)
    if (src is not None and src not in srcs) or (dst is not None and dst not in dsts):
        assume(False)  # the fixed degree needs more than the head counts (rare; see kv_choices)
    assume(srcs and dsts)  # a staged end whose pipeline does not split this layer count
    s = src if src is not None else draw(st.sampled_from(srcs))
    d = dst if dst is not None else draw(st.sampled_from(dsts))
    return make_case(config, s, d, draw(seeds(domain)), conventions, phase)


def _end(draw: st.DrawFn, name: str, config: ModelConfig, fixed: int | None, stages: bool
         ) -> tuple[str, int] | None:
    """One end of a converter's case: a TP degree of ``name``, or (drawn as often, shrinking
    to TP; where ``stages``) one of its pipeline splits (``convention_ends``); ``fixed``:
    that TP degree. None where nothing is left (the fixed degree needs more than the head
    counts)."""
    plain, staged = convention_ends(name, config)
    if fixed is not None or not stages:
        plain, staged = [(c, t) for c, t in plain if fixed in (None, t)], []
    if staged and draw(st.booleans()):
        return draw(st.sampled_from(staged))
    return draw(st.sampled_from(plain)) if plain else None


def make_case(config: ModelConfig, src: int, dst: int, seed: int,
              conventions: tuple[str, str] | None = None, phase: str = "1a"
              ) -> Case | ConversionCase:
    """A ``Case``, or with ``conventions`` a ``ConversionCase`` (a converter's degrees are
    its conventions')."""
    if conventions is None:
        return Case(config=config, src=src, dst=dst, seed=seed, phase=phase)
    return ConversionCase(config=config, src_convention=conventions[0], src=src,
                          dst_convention=conventions[1], dst=dst, seed=seed, phase=phase)


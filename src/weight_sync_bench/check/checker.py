"""The verdict: run the model under the layout and compare it with the dense reference.

A round trip ``gather(split(x))`` returns ``x`` whatever the layout, so bytes alone prove
nothing about the layout a consumer expects. The check therefore does two things:

- data movement, bit-exactly: are the rank-local shards exactly the declared layout's split?
  If not, which parameter differs first, and which rows does each rank really hold?
- computation, within a measured tolerance: do the sharded logits under those shards match
  the reference?

Cost grows with the work, not with the pairs: a ``Checker`` computes the reference once per
(config, seed, tokens) and one sharded forward per destination degree under the declared
split; a shard set that is byte-identical to the declared split cannot change the logits,
so it reuses that forward. Only shards that differ get a forward (and a diagnosis) of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check import stream
from weight_sync_bench.check.diagnosis import bit_equal, diagnose_plain, mismatching
from weight_sync_bench.check.forwards import BACKENDS, Forward, inprocess_forward
from weight_sync_bench.check.naming import layout_naming, name_shards
from weight_sync_bench.check.threshold import environment_notes, resolve_floor
from weight_sync_bench.check.user_code import call_user
from weight_sync_bench.check.verdict import Verdict, format_verdicts
from weight_sync_bench.check.weights import Weights, dtypes_of, held_weights, weights_threshold
from weight_sync_bench.errors import InvalidNumber, InvalidShards
from weight_sync_bench.layout.reshard import (
    reshard,
    reshard_tensor,
    split,
    validate_shards,
)
from weight_sync_bench.model.config import (
    ModelConfig,
    dtype_name,
    init_params,
    make_tokens,
    parse_dtype,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.model.stepwise import computing
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, Floor, ThresholdRule

if TYPE_CHECKING:
    from weight_sync_bench.check.mutations import Mutation
    from weight_sync_bench.layout.table import LayoutTable

# Defined by the modules below, named here too: where the package's users have imported them.
__all__ = ["BACKENDS", "Checker", "Forward", "ReshardFn", "SplitFn", "ThresholdRule", "Verdict",
           "check_reshard", "check_split", "checker_for", "degree_pairs", "environment_notes",
           "format_verdicts", "resolve_floor", "sweep"]

Params = dict[str, torch.Tensor]
SplitFn = Callable[[dict[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]
ReshardFn = Callable[[list[dict[str, torch.Tensor]], int], list[dict[str, torch.Tensor]]]


@dataclass
class Checker:
    """Checks shard sets of one (config, seed) against its reference.

    The reference logits are computed once, each destination degree's declared split and
    its forward once; ``verdict`` then costs a byte comparison unless the shards differ.

    ``dtype`` is the synced weights' dtype (``"fp32"``, ``"bf16"``, ``"fp16"`` or a
    ``torch.dtype``): the parameters are drawn in fp32 and rounded to it, shards are
    compared with the declared split bit for bit in it, and both forwards compute in fp32
    from those values (a layout bug does not depend on the dtype), judged by that dtype's
    own measured floor. The threshold comes from a floor that covers the geometry
    (``tolerance.rules.floor_for``): the committed one, or one measured for this geometry
    and cached; with none, ``FloorNotMeasured`` names the command that measures it, unless
    ``measure_floor`` measures it now (``check.floor.measure_geometry``).
    """

    config: ModelConfig
    seed: int = 0
    threshold: float | None = None
    phase: str = "1a"
    forward: Forward = inprocess_forward
    params: Params | None = None
    # Used when ``threshold`` is None: the threshold as a function of the geometry and the
    # reference logits (fuzzed geometries have no measured floor of their own; see ``floor``).
    threshold_rule: ThresholdRule | None = None
    layout: LayoutTable = field(init=False)
    # The check's input, ``(batch, seq_len)``; default ``make_tokens(config, 1000 + seed)``.
    # The fuzz passes tokens that reach every rank's vocab slice (``domain.fuzz_tokens``).
    tokens: torch.Tensor | None = None  # type: ignore[assignment]
    reference: torch.Tensor = field(init=False)
    _declared: dict[int, list[Params]] = field(init=False, default_factory=dict)
    _declared_error: dict[int, float] = field(init=False, default_factory=dict)
    _scratch: torch.Tensor = field(init=False)  # reused for |logits - reference|: no page faults
    notes: tuple[str, ...] = field(init=False, default=())
    dtype: torch.dtype | str = torch.float32  # the synced dtype (see the class docstring)
    measure_floor: bool = False  # measure (and cache) an unmeasured geometry's floor
    floor: Floor | None = field(init=False, default=None)  # where the threshold came from
    # An MoE model's routing check: the reference's choices where within ``route_bound`` of
    # flipping, kept in every sharded forward (``model.sharded.RoutingGuard``); the bound is
    # the threshold (every committed MoE floor cell records the routing deviation it bounds,
    # ``check.floor``), None for a dense model.
    guard: RoutingGuard | None = field(init=False, default=None)
    # ``params`` of several dtypes (a user's weights: bf16 beside an fp32 bias), each
    # compared in its own; ``dtype`` then names the check (``check.weights.dtypes_of``)
    mixed: bool = False

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        self.layout = layout_for(self.config)
        if self.threshold is None and self.threshold_rule is None:
            self.floor = self.resolve_floor()  # refused before anything is drawn
            self.threshold = self.floor.threshold
            self.notes = environment_notes(self.floor, self.config, self.phase, self.dtype_name)
        if self.params is None:
            self.params = init_params(self.config, self.seed, dtype=self.dtype)
        odd = [(n, x.dtype) for n, x in self.params.items() if x.dtype != self.dtype]
        if odd and not self.mixed:
            raise InvalidShards(f"params {odd[0][0]}: dtype {odd[0][1]}, the check syncs "
                                f"{self.dtype} ({len(odd)} parameters differ)")
        if self.tokens is None:
            self.tokens = make_tokens(self.config, TOKEN_SEED_OFFSET + self.seed)
        model = ReferenceModel(self.config, computing(self.params))
        self.reference = model(self.tokens)
        self._scratch = torch.empty_like(self.reference)
        if self.threshold is None and self.threshold_rule is not None:
            self.threshold = self.threshold_rule(self.config, self.reference)
        if self.config.n_experts:
            assert self.threshold is not None
            self.guard = RoutingGuard(model.routings, self.threshold)
        self.notes = (*self.notes, *self.config.notes)  # what the geometry does not model

    @property
    def dtype_name(self) -> str:
        assert isinstance(self.dtype, torch.dtype)
        return dtype_name(self.dtype)

    def resolve_floor(self) -> Floor:
        return resolve_floor(self.config, self.phase, self.dtype_name,
                             measure=self.measure_floor, forward=self.forward)

    @property
    def full(self) -> Params:
        assert self.params is not None
        return self.params

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors it keeps: the parameters, the reference logits (and the
        scratch of their shape), and each declared split made so far."""
        kept = [*self.full.values(), self.reference, self._scratch,
                *(x for shards in self._declared.values() for p in shards for x in p.values())]
        return sum(x.nbytes for x in kept)

    def declared(self, degree: int) -> list[Params]:
        """The declared layout's split at ``degree`` (cached)."""
        if degree not in self._declared:
            self._declared[degree] = split(self.full, self.layout, degree)
        return self._declared[degree]

    def error(self, shards: list[Params]) -> float:
        """Max |sharded logits - reference| under these shards (NaN/inf pass through)."""
        guard = {} if self.guard is None else {"guard": self.guard}
        return self.deviation(self.forward(self.config, [computing(p) for p in shards],
                                           self.tokens, **guard))

    def deviation(self, logits: torch.Tensor) -> float:
        """Max |logits - reference| (NaN/inf pass through): ``logits`` the reference's shape,
        or stacked per data-parallel replica (``check.floor.convention_logits``)."""
        if logits.shape != self.reference.shape:
            return float((logits - self.reference).abs().max())
        return float(torch.sub(logits, self.reference, out=self._scratch).abs_().max())

    @property
    def routing(self) -> dict[str, object]:
        """The routing check's figures for a verdict (none for a dense model)."""
        if self.guard is None:
            return {}
        return {"near_ties": self.guard.near_ties(), "route_bound": self.guard.bound}

    def declared_error(self, degree: int) -> float:
        if degree not in self._declared_error:
            self._declared_error[degree] = self.error(self.declared(degree))
        return self._declared_error[degree]

    def verdict(self, shards: Sequence[Mapping[str, torch.Tensor]], *, dst: int,
                src: int | None = None, mutation: str | None = None) -> Verdict:
        """Validate, compare bytes with the declared split, run a forward only if they differ."""
        validate_shards(shards, self.layout, dst, {n: x.dtype for n, x in self.full.items()})
        checked = [dict(params) for params in shards]
        declared = self.declared(dst)
        differ = mismatching(checked, declared, self.layout.names)
        assert self.threshold is not None
        common = dict(config=self.config.name, src=src, dst=dst, threshold=self.threshold,
                      phase=self.phase, mutation=mutation, notes=self.notes,
                      dtype=self.dtype_name, **self.routing)
        if not differ:
            return Verdict(max_abs_error=self.declared_error(dst), first_mismatch=None, **common)
        first = differ[0]
        assert isinstance(self.dtype, torch.dtype)
        named = name_shards(layout_naming(self.config, self.layout, dst, self.dtype), checked,
                            declared, differ, self.layout.names)
        return Verdict(max_abs_error=self.error(checked), first_mismatch=first,
                       mismatches=tuple(differ), own_forward=True,
                       diagnosis=tuple(diagnose_plain(self.full[first], self.config,
                                                      self.layout[first],
                                                      [p[first] for p in checked])),
                       named_mutation=named.mutation, named_meaning=named.meaning, **common)


    def reshard_matches(self, src: int, dst: int) -> bool:
        """Whether ``reshard(declared(src), dst)`` is the declared split at ``dst`` byte for
        byte, streamed: each parameter is resharded and compared with the declared split at
        once, while its bytes are still in cache, and dropped (3x faster than resharding the
        whole model, then comparing); the first parameter that differs ends it, and so does
        one resharded to another number of ranks than ``dst``."""
        source, declared = self.declared(src), self.declared(dst)
        for spec in self.layout:
            name = spec.name
            out = reshard_tensor([params[name] for params in source], spec, dst)
            if len(out) != len(declared):  # zip would read the ranks both have, and pass
                return False
            for mine, theirs in zip(out, declared):
                if not bit_equal(mine, theirs[name]):
                    return False
        return True

    def reshard_verdict(self, src: int, dst: int) -> Verdict:
        """``reshard(declared(src), dst)`` checked, streamed (``reshard_matches``). Only a
        shard set that differs is resharded whole, for its own forward and diagnosis."""
        if not self.reshard_matches(src, dst):
            return self.verdict(reshard(self.declared(src), self.layout, dst), src=src, dst=dst)
        assert self.threshold is not None
        return Verdict(config=self.config.name, src=src, dst=dst, threshold=self.threshold,
                       phase=self.phase, max_abs_error=self.declared_error(dst),
                       first_mismatch=None, notes=self.notes, dtype=self.dtype_name,
                       **self.routing)


def degree_pairs(layout: LayoutTable) -> list[tuple[int, int]]:
    """Every ordered pair (src, dst) of supported degrees, src == dst included."""
    degrees = layout.supported_degrees()
    return [(s, d) for s in degrees for d in degrees]


def checker_for(config: ModelConfig, *, seed: int = 0, backend: str = "inprocess",
                threshold: float | None = None, dtype: torch.dtype | str = torch.float32,
                measure_floor: bool = False, params: Params | None = None,
                mixed: bool = False) -> Checker:
    """A Checker whose sharded forward runs in this process (phase 1a, ``InProcessCollective``)
    or one process per rank over gloo (phase 1b, the shared rank pool), with that phase's
    threshold for ``dtype`` weights (see ``Checker``); ``params``: the weights to check
    with instead of the seed's (in ``dtype``)."""
    if backend == "inprocess":
        return Checker(config, seed=seed, threshold=threshold, dtype=dtype,
                       measure_floor=measure_floor, params=params, mixed=mixed)
    if backend == "gloo":
        from weight_sync_bench.check.forwards import (
            gloo_forward,  # rank processes start on first use
        )

        return Checker(config, seed=seed, threshold=threshold, phase="1b", forward=gloo_forward(),
                       dtype=dtype, measure_floor=measure_floor, params=params, mixed=mixed)
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


def sweep(config: ModelConfig, *, seed: int = 0, pairs: Iterable[tuple[int, int]] | None = None,
          mutation: Mutation | None = None, checker: Checker | None = None,
          backend: str = "inprocess", dtype: torch.dtype | str = torch.float32
          ) -> list[Verdict]:
    """The invariant over degree pairs: ``reshard(split(full, src), dst)`` (mutated, if a
    mutation is given) checked against the reference. One reference forward, one declared
    forward per destination, one more forward per shard set that differs."""
    InvalidNumber.seed("seed", seed)
    checker = checker or checker_for(config, seed=seed, backend=backend, dtype=dtype)
    verdicts = []
    for src, dst in (pairs if pairs is not None else degree_pairs(checker.layout)):
        if mutation is None:
            verdicts.append(checker.reshard_verdict(src, dst))
            continue
        shards = mutation.apply(reshard(checker.declared(src), checker.layout, dst),
                                checker.layout, config)
        verdicts.append(checker.verdict(shards, src=src, dst=dst, mutation=mutation.name))
    return verdicts


def check_split(fn: SplitFn, config: ModelConfig, degree: int, *, seed: int = 0,
                threshold: float | None = None, backend: str = "inprocess",
                dtype: torch.dtype | str = torch.float32, measure_floor: bool = False,
                stream: str | None = None, progress: Callable[..., None] | None = None,
                weights: Weights | None = None) -> Verdict:
    """Check a user's split function ``fn(full, degree) -> [rank-local dict] * degree``
    (the harness's parameter names) against the declared layout at ``degree``. What ``fn``
    raises, or returns that is not shards, is framed as its own (``UserCodeError``); a
    shard of the wrong shape or dtype is ``WrongUserShard`` naming the rank, the parameter,
    the expected and the actual. ``dtype``: the synced weights' dtype (``fn`` gets and
    returns tensors of it; see ``Checker``); ``measure_floor``: measure an unmeasured
    geometry's floor rather than refuse the check. ``stream="layer"`` (or ``"parameter"``)
    streams the check (``check.stream``): memory bounded by the largest parameter, ``fn``
    called once per layer (or parameter) with a dict of just those parameters, the same
    verdict; ``progress`` gets a ``stream.Progress`` after each stage. ``weights``: real
    weights instead of the seed's (``check.weights``: canonical parameters, or a checkpoint
    directory), checked in their own dtype, the threshold measured on them unless given."""
    InvalidNumber.seed("seed", seed)
    layout_for(config).validate(degree)
    if weights is not None:
        checker = _weights_checker(config, weights, [f"plain:{degree}"], threshold=threshold,
                                   backend=backend, dtype=dtype, stream=stream,
                                   measure_floor=measure_floor)
    elif stream is not None:
        return _streamed(fn, config, degree, None, seed=seed, threshold=threshold,
                         backend=backend, dtype=dtype, measure_floor=measure_floor,
                         per=stream, progress=progress)
    else:
        checker = checker_for(config, seed=seed, threshold=threshold, backend=backend,
                              dtype=dtype, measure_floor=measure_floor)
    full = {name: t.clone() for name, t in checker.full.items()}
    shards = call_user(fn, (full, degree), role="splitter", config=config,
                       during=f"while splitting {config.name} for t={degree}",
                       layout=checker.layout, degree=degree, dtypes=_dtypes(checker))
    return checker.verdict(shards, dst=degree)


def check_reshard(fn: ReshardFn, config: ModelConfig, src: int, dst: int, *, seed: int = 0,
                  threshold: float | None = None, backend: str = "inprocess",
                  dtype: torch.dtype | str = torch.float32, measure_floor: bool = False,
                  stream: str | None = None, progress: Callable[..., None] | None = None,
                  weights: Weights | None = None) -> Verdict:
    """Check a user's reshard function ``fn(shards_at_src, dst) -> shards_at_dst`` starting
    from the declared split at ``src``. What ``fn`` raises, or returns that is not shards, is
    framed as its own (``UserCodeError``, ``WrongUserShard`` for a shape or dtype).
    ``dtype``, ``measure_floor``, ``stream`` and ``progress`` as for ``check_split`` (streamed,
    ``fn`` gets per rank the src shards of one layer or parameter), ``weights`` as for
    ``check_split``."""
    InvalidNumber.seed("seed", seed)
    layout_for(config).validate(src)
    layout_for(config).validate(dst)
    if weights is not None:
        checker = _weights_checker(config, weights, [f"plain:{src}", f"plain:{dst}"],
                                   threshold=threshold, backend=backend, dtype=dtype,
                                   stream=stream, measure_floor=measure_floor)
    elif stream is not None:
        return _streamed(fn, config, dst, src, seed=seed, threshold=threshold,
                         backend=backend, dtype=dtype, measure_floor=measure_floor,
                         per=stream, progress=progress)
    else:
        checker = checker_for(config, seed=seed, threshold=threshold, backend=backend,
                              dtype=dtype, measure_floor=measure_floor)
    source = [{n: t.clone() for n, t in params.items()} for params in checker.declared(src)]
    shards = call_user(fn, (source, dst), role="resharder", config=config,
                       during=f"while resharding {config.name} {src} -> {dst}",
                       layout=checker.layout, degree=dst, dtypes=_dtypes(checker))
    return checker.verdict(shards, src=src, dst=dst)


def _weights_checker(config: ModelConfig, weights: Weights, ends: list[str], *,
                     threshold: float | None, backend: str, dtype: torch.dtype | str,
                     stream: str | None, measure_floor: bool) -> Checker:
    """The checker of a check on real weights (``check.weights``): their own dtype, the
    threshold measured on them over ``ends`` unless given, the note saying which."""
    if stream is not None:
        raise ValueError("weights= runs the whole-model check; stream= draws the seed's "
                         "weights stage by stage")
    if parse_dtype(dtype) != torch.float32 or measure_floor:
        raise ValueError("weights= checks the weights in their own dtype with a threshold "
                         "measured on them: drop dtype= and measure_floor=")
    held = held_weights(weights, config)
    threshold, note = weights_threshold(config, ends, held, threshold)
    own, several = dtypes_of(held)
    checker = checker_for(config, threshold=threshold, backend=backend, dtype=own, params=held,
                          mixed=several is not None)
    checker.notes = (*checker.notes, note, *([several] if several else []))
    return checker


def _streamed(fn: Callable[..., list[dict[str, torch.Tensor]]], config: ModelConfig, dst: int,
              src: int | None, *, seed: int, threshold: float | None, backend: str,
              dtype: torch.dtype | str, measure_floor: bool, per: str,
              progress: Callable[..., None] | None) -> Verdict:
    return stream.stream_check(config, dst, fn=fn, src=src, per=per, seed=seed, dtype=dtype,
                               threshold=threshold, measure_floor=measure_floor,
                               progress=progress, backend=backend)


def _dtypes(checker: Checker) -> dict[str, torch.dtype]:
    return {n: x.dtype for n, x in checker.full.items()}

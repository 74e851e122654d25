"""One fuzzed check as data (``Case``), and running it (``run_case`` -> ``Outcome``).

A case is everything that rebuilds the check on any machine and any Hypothesis version:
the geometry, the ordered degree pair, the model seed, the mutation (or none) and the
phase. Weights come from ``domain.fuzz_params``, tokens from ``domain.fuzz_tokens`` (both
built from the seed with a ``torch.Generator``). Two claims
are judged on an outcome:

- ``invariant``: the check passes (deviation finite and within the threshold);
- ``kill``: a mutation that is not the identity there deviates by at least ``KILL_MARGIN``
  x the threshold; one that is the identity leaves the shards byte-identical and passes.

A ``ConversionCase`` is the same for a conversion between two frameworks' storage
conventions (``conventions``) through the harness's own converter (``conventions.convert``),
a conversion mutation (``conventions.mutations``) applied to its output. Two more claims:

- ``convert``: the converted shards are byte-identical to the destination's declared ones
  and the destination's forward (reading them as that framework does) passes;
- ``convert_kill``: ``kill``, for a conversion mutation.

``moe_convert`` and ``moe_convert_kill`` make the same two claims on Mixture-of-Experts
geometries, between their MoE endpoints (``conventions.moe_endpoints``: expert parallelism,
expert-TP, the engines' expert layouts), for the MoE conversion mutations. Each of their
outcomes carries how many of the reference's expert choices were near-tied
(``Outcome.near_ties``: within the threshold of flipping, where the routing check kept the
reference's choice), which the runner tallies.

What running a case costs is ``model.footprint``'s estimate of its geometry, so that a
replay can refuse a case before allocating it.

Within one property run (``keeping_checkers``, which ``runner.run_property`` opens), an
example whose geometry, seed and phase an earlier example drew (Hypothesis draws them again
with another degree pair, or with another mutation's destination) reuses that example's
``Checker``: its weights, tokens, reference forward, declared splits and their forwards. Each
pair is still resharded and compared anew; nothing is kept from one run to the next.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weight_sync_bench.check.checker import Checker, Forward, ThresholdRule
from weight_sync_bench.check.convert import ConversionChecker
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import KILL_MARGIN, mutation_by_name
from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.fuzz.domain import fuzz_params, fuzz_tokens
from weight_sync_bench.check.routing import forward_unchanged
from weight_sync_bench.fuzz.threshold import (
    FuzzThreshold,
    fuzz_threshold_rule,
    require_moe,
    require_replicated_kv,
)
from weight_sync_bench.layout.reshard import reshard
from weight_sync_bench.model.config import VARIANT_FIELDS, ModelConfig

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint

PROPERTIES = ("invariant", "kill", "convert", "convert_kill", "moe_convert", "moe_convert_kill")
CONVERSION_PROPERTIES = ("convert", "convert_kill", "moe_convert", "moe_convert_kill")
MOE_PROPERTIES = ("moe_convert", "moe_convert_kill")  # a conversion of an MoE geometry
# The claim each property makes: the check passes, or the mutation is killed
CLAIMS = {"invariant": "invariant", "kill": "kill", "convert": "invariant",
          "convert_kill": "kill", "moe_convert": "invariant", "moe_convert_kill": "kill"}
@dataclass(frozen=True)
class Case:
    config: ModelConfig
    src: int
    dst: int
    seed: int
    mutation: str | None = None
    phase: str = "1a"

    def identity_reason(self) -> str | None:
        """Why the mutation changes nothing here (None: it does, or there is no mutation)."""
        if self.mutation is None:
            return None
        return mutation_by_name(self.mutation).identity_reason(self.config, self.dst)

    def key(self) -> dict[str, Any]:
        """The fields that identify the case (what a corpus entry's name is a hash of)."""
        return {"geometry": self.config.geometry(), "degrees": {"src": self.src, "dst": self.dst},
                "seed": self.seed, "mutation": self.mutation, "phase": self.phase}

    def __str__(self) -> str:
        g = self.config
        what = f", mutation {self.mutation}" if self.mutation else ""
        return (f"d_model={g.d_model} layers={g.n_layers} heads={g.n_heads}/{g.n_kv_heads} "
                f"head_dim={g.head_dim} ffn={g.ffn} vocab={g.vocab} tokens={g.batch}x{g.seq_len}"
                f", {self.src} -> {self.dst}, seed {self.seed}{what} (phase {self.phase})")


@dataclass(frozen=True)
class Outcome:
    case: Case
    deviation: float  # max |sharded - reference| logit
    threshold: float
    shards_differ: bool  # the mutated shards differ from the declared split somewhere
    # Why an MoE mutation changes nothing the forward computes on this example's tokens: a
    # router's bias that moves no token's choice, or experts no token is routed to
    # (``check.routing.forward_unchanged``). Only the bytes can show it there; the example
    # counts as an identity one for the forward.
    unchanged: str | None = None
    # An MoE example's (near-tied, all) (layer, token) expert choices of the reference: those
    # within the threshold of flipping took the reference's choice (``RoutingGuard``)
    near_ties: tuple[int, int] | None = None

    @property
    def identity_reason(self) -> str | None:
        """Why the mutation changes nothing here: the case's rule, or this example's data."""
        return self.case.identity_reason() or self.unchanged

    @property
    def ratio(self) -> float:
        return self.deviation / self.threshold

    @property
    def check_passed(self) -> bool:
        return math.isfinite(self.deviation) and self.deviation <= self.threshold

    @property
    def killed(self) -> bool:
        """Detected with the margin the kill matrix demands (NaN and inf count as killed)."""
        return not math.isfinite(self.deviation) or self.ratio >= KILL_MARGIN

    def holds(self, prop: str) -> bool:
        """Whether ``prop`` (one of ``PROPERTIES``) holds on this outcome."""
        if prop == "invariant":
            return self.check_passed
        if CLAIMS.get(prop) == "kill":
            if self.case.identity_reason() is not None:
                return self.check_passed and not self.shards_differ
            if self.unchanged is not None:  # the byte comparison catches it, not the forward
                return self.shards_differ
            return self.killed
        if prop in ("convert", "moe_convert"):
            return self.check_passed and not self.shards_differ
        raise ValueError(f"unknown property {prop!r}; known: {', '.join(PROPERTIES)}")

    def describe(self) -> str:
        return (f"{self.case}: deviation {self.deviation:.4g}, threshold {self.threshold:.4g} "
                f"({self.ratio:.3g}x)")


def make_checker(config: ModelConfig, seed: int, *, phase: str = "1a",
                 forward: Forward = inprocess_forward,
                 threshold_rule: ThresholdRule | None = None) -> Checker:
    """A Checker over the fuzz weights of (config, seed), thresholded by ``threshold_rule``
    (default: the phase's random-geometry rule, see ``floor``)."""
    if threshold_rule is None:
        threshold_rule = fuzz_threshold_rule(phase)
    return Checker(config, seed=seed, phase=phase, forward=forward,
                   params=fuzz_params(config, seed), tokens=fuzz_tokens(config, seed),
                   threshold_rule=threshold_rule)


def run_case(case: Case, checker: Checker | None = None, *,
             forward: Forward = inprocess_forward,
             threshold_rule: ThresholdRule | None = None) -> Outcome:
    """Reshard the declared split from ``src`` to ``dst``, apply the mutation, compare the
    sharded logits with the reference. ``checker`` (for the same config and seed) saves the
    reference forward when several cases share it."""
    if isinstance(case, ConversionCase):
        return run_conversion_case(case, threshold_rule=threshold_rule)
    checker = checker or make_checker(case.config, case.seed, phase=case.phase,
                                      forward=forward, threshold_rule=threshold_rule)
    if case.mutation is None:  # each parameter resharded and compared at once
        if checker.reshard_matches(case.src, case.dst):
            # what reshard_verdict says of a match, without building its Verdict: the
            # declared split's forward judges bytes equal to it
            assert checker.threshold is not None
            return Outcome(case, checker.declared_error(case.dst), checker.threshold,
                           shards_differ=False)
        verdict = checker.reshard_verdict(case.src, case.dst)  # whole: its own forward
    else:
        shards = reshard(checker.declared(case.src), checker.layout, case.dst)
        shards = mutation_by_name(case.mutation).apply(shards, checker.layout, case.config)
        verdict = checker.verdict(shards, src=case.src, dst=case.dst, mutation=case.mutation)
    return Outcome(case, verdict.max_abs_error, verdict.threshold,
                   shards_differ=verdict.first_mismatch is not None)


@dataclass
class KeptCheckers:
    """The checkers of one property run, the most recently used last, while there are at
    most ``size`` of them holding at most ``budget`` bytes (``Checker.nbytes``) together: a
    checker over the budget alone is not kept. A checker is found again only for the same
    geometry, seed and phase under the same forward and threshold rule (the same objects)."""

    budget: int = 64 * 2**20  # a few of the fuzz domain's largest (~11 MiB each at t=1, 2, 4)
    size: int = 8
    # (geometry, seed, phase) -> (forward, threshold rule, checker, its bytes when kept)
    kept: OrderedDict[tuple[ModelConfig, int, str],
                      tuple[Forward, ThresholdRule | None, Checker, int]] = field(
        default_factory=OrderedDict)

    def find(self, case: Case, forward: Forward, threshold_rule: ThresholdRule | None
             ) -> Checker | None:
        key = (case.config, case.seed, case.phase)
        found = self.kept.get(key)
        if found is None or found[0] is not forward or found[1] is not threshold_rule:
            return None
        self.kept.move_to_end(key)
        return found[2]

    def keep(self, case: Case, forward: Forward, threshold_rule: ThresholdRule | None,
             checker: Checker) -> None:
        key = (case.config, case.seed, case.phase)
        self.kept.pop(key, None)
        self.kept[key] = (forward, threshold_rule, checker, checker.nbytes)
        held = self.nbytes
        while self.kept and (len(self.kept) > self.size or held > self.budget):
            held -= self.kept.popitem(last=False)[1][3]

    @property
    def nbytes(self) -> int:
        return sum(entry[3] for entry in self.kept.values())


_KEPT: ContextVar[KeptCheckers | None] = ContextVar("kept_checkers", default=None)


@contextmanager
def keeping_checkers(kept: KeptCheckers | None = None) -> Iterator[KeptCheckers]:
    """For the length of the block (one property run), ``run_pairs`` reuses the checker of an
    earlier example of the same geometry, seed and phase (``KeptCheckers``); after it,
    nothing is kept."""
    kept = kept if kept is not None else KeptCheckers()
    token = _KEPT.set(kept)
    try:
        yield kept
    finally:
        _KEPT.reset(token)


def run_pairs(case: Case | ConversionCase, *, forward: Forward = inprocess_forward,
              threshold_rule: ThresholdRule | None = None) -> list[Outcome]:
    """The invariant at every ordered degree pair of ``case``'s geometry and seed, ``case``'s
    own pair first: what does not depend on the pair (parameters, tokens, the reference
    forward, the layout table) is made once, each degree's declared split and forward once
    (``Checker``; inside ``keeping_checkers``, once for every example of the same geometry
    and seed), and each pair costs its reshard and byte comparison. Each outcome names its
    pair, so a failure (and its corpus entry) is the pair that failed. A case with a
    mutation is its one pair (``run_case``, with the kept checker too); a conversion is its
    one pair, never kept."""
    if isinstance(case, ConversionCase):
        return [run_case(case, forward=forward, threshold_rule=threshold_rule)]
    kept = _KEPT.get()
    checker = kept.find(case, forward, threshold_rule) if kept is not None else None
    if checker is None:
        checker = make_checker(case.config, case.seed, phase=case.phase, forward=forward,
                               threshold_rule=threshold_rule)
    if case.mutation is not None:
        outcomes = [run_case(case, checker)]
    else:
        degrees = checker.layout.supported_degrees()
        pairs = [(case.src, case.dst), *((s, d) for s in degrees for d in degrees
                                         if (s, d) != (case.src, case.dst))]
        outcomes = [run_case(dataclasses.replace(case, src=s, dst=d), checker)
                    for s, d in pairs]
    if kept is not None:
        kept.keep(case, forward, threshold_rule, checker)
    return outcomes


@dataclass(frozen=True)
class ConversionCase:
    """A fuzzed conversion: the geometry, the source and destination conventions at their
    degrees (``src`` and ``dst`` are degrees, as in ``Case``), the model seed, a conversion
    mutation (``conventions.mutations``) or none, and the phase (1a: conversions are fuzzed
    in process). The mutation must apply to the conversion (``not_applicable``)."""

    config: ModelConfig
    src_convention: str
    src: int
    dst_convention: str
    dst: int
    seed: int
    mutation: str | None = None
    phase: str = "1a"

    def __post_init__(self) -> None:
        from weight_sync_bench.conventions.mutations import mutation_by_name as conversion_mutation

        if self.phase != "1a":
            raise InvalidConfig(f"{self}: conversions are fuzzed in process (phase 1a), got "
                                f"phase {self.phase!r}")
        conversion = self.conversion()
        from weight_sync_bench.conventions.fp8 import require_stored

        for end in (conversion.src, conversion.dst):
            require_stored(self.config, end)  # its rules: UnsupportedConvention names one
        if self.mutation is not None:
            why = conversion_mutation(self.mutation).not_applicable(conversion)
            if why is not None:
                raise InvalidConfig(f"{self}: mutation {self.mutation} does not apply here: {why}")

    def conversion(self):  # -> conventions.mutations.Conversion
        from weight_sync_bench.conventions.mutations import Conversion

        return Conversion(self.config, end_of(self.src_convention, self.src),
                          end_of(self.dst_convention, self.dst))

    def identity_reason(self) -> str | None:
        """Why the conversion mutation changes no byte here (None: it does, or none is set)."""
        if self.mutation is None:
            return None
        from weight_sync_bench.conventions.mutations import mutation_by_name as conversion_mutation

        return conversion_mutation(self.mutation).identity_reason(self.conversion())

    def key(self) -> dict[str, Any]:
        return {"geometry": self.config.geometry(), "degrees": {"src": self.src, "dst": self.dst},
                "conventions": {"src": self.src_convention, "dst": self.dst_convention},
                "seed": self.seed, "mutation": self.mutation, "phase": self.phase}

    def __str__(self) -> str:
        g = self.config
        variants = {k: v for k, v in g.geometry().items() if k in VARIANT_FIELDS}
        what = f", mutation {self.mutation}" if self.mutation else ""
        extra = "".join(f" {k}={v}" for k, v in variants.items())
        return (f"d_model={g.d_model} layers={g.n_layers} heads={g.n_heads}/{g.n_kv_heads} "
                f"head_dim={g.head_dim} ffn={g.ffn} vocab={g.vocab} tokens={g.batch}x{g.seq_len}"
                f"{extra}, {end_of(self.src_convention, self.src)} -> "
                f"{end_of(self.dst_convention, self.dst)}"
                f", seed {self.seed}{what} (phase {self.phase})")


def options_only(convention: str) -> bool:
    """Whether ``convention`` names a convention with some of its own options but no degree
    (``"vllm:fp8=block128"``, ``"hf:fp8=tensor"``): fuzzed, like a bare name, at every TP
    degree it stores a geometry at, each end with those options. Any degree key
    (``vllm:tp=2,fp8=...``, ``megatron:tp=2,pp=2``) makes it a whole endpoint, fixed."""
    from weight_sync_bench.conventions import CONVENTIONS, convention_by_name

    name, sep, rest = convention.partition(":")
    if not sep or not rest or name not in CONVENTIONS:
        return False
    items = [item.partition("=") for item in rest.split(",")]
    return all(eq and key in convention_by_name(name).options for key, eq, _ in items)


def parse_end(text: str) -> tuple[str, int | None]:
    """A converter's end as ``wsb fuzz --from/--to`` and ``testing.convert_property`` take it:
    ``"megatron:4"`` -> ``("megatron", 4)``; ``"megatron"`` -> ``("megatron", None)``
    (drawn); options only, ``"vllm:fp8=block128"`` -> itself, drawn (each end with them); a
    whole endpoint, ``"megatron:tp=2,pp=2"``, is fixed: ``("megatron:tp=2,pp=2", 4)`` (its
    world)."""
    from weight_sync_bench.conventions import endpoint

    ep = endpoint(text)
    if options_only(text):
        return text, None
    if "=" in text:
        return str(ep), ep.world
    return ep.name, (ep.degree if ":" in text else None)


def end_of(convention: str, degree: int) -> Endpoint:
    """A conversion case's end: a convention at a TP degree (``"vllm"``, 2; with options,
    ``"vllm:fp8=block128"``, 2: ``vllm:tp=2,fp8=block128``), or a whole endpoint
    (``"megatron:tp=2,ep=4"``, its world 8)."""
    from weight_sync_bench.conventions import endpoint

    if ":" not in convention:
        return endpoint(f"{convention}:{degree}")
    if options_only(convention):
        name, _, rest = convention.partition(":")
        return endpoint(f"{name}:tp={degree},{rest}")
    found = endpoint(convention)
    if found.world != degree:
        raise InvalidConfig(f"{convention}: {found.world} ranks, the case says {degree}")
    return found


def run_conversion_case(case: ConversionCase, checker: ConversionChecker | None = None, *,
                        threshold_rule: ThresholdRule | None = None) -> Outcome:
    """Convert the source convention's declared shards with the harness's converter
    (``conventions.convert``), apply the conversion mutation, and judge the result as
    ``check_convert`` does: bytes against the destination's declared shards, then the
    destination's forward against the reference. A destination whose forward replicates
    KV heads (vLLM at t > n_kv_heads) is judged by the default rule only where a measurement
    of that forward validates it (``fuzz.threshold.require_replicated_kv``: ``FloorNotMeasured``
    otherwise, naming the command); a ``threshold_rule`` given is the caller's. An MoE
    geometry is judged by the fuzz's rule (none given, or a ``FuzzThreshold``: what the
    runner passes) only where the MoE validation measured the destination's forward at its
    world (``fuzz.threshold.require_moe``), refused before anything is drawn."""
    from weight_sync_bench.check.floor import REPLICATED_KV, forward_of
    from weight_sync_bench.conventions import convert
    from weight_sync_bench.conventions.mutations import mutation_by_name as conversion_mutation

    target = case.conversion().dst
    if case.config.n_experts:
        if threshold_rule is None or isinstance(threshold_rule, FuzzThreshold):
            require_moe(case.config, case.phase, where=target)
    elif threshold_rule is None and forward_of(target.convention, case.config,
                                               target) == REPLICATED_KV:
        require_replicated_kv(case.config, case.dst, case.phase)  # refused before any draw
    drawn = case
    mutation = conversion_mutation(case.mutation) if case.mutation is not None else None
    config = case.config
    if mutation is not None and config.seq_len < mutation.min_seq_len:
        # a RoPE pairing bug grows with relative position: its forward runs the length the
        # mutation states (ConversionMutation.min_seq_len), the geometry is otherwise the case's
        config = dataclasses.replace(config, seq_len=mutation.min_seq_len)
        case = dataclasses.replace(case, config=config)
    if checker is None or case is not drawn:  # a checker made for the drawn length won't do
        checker = ConversionChecker(make_checker(case.config, case.seed,
                                                 threshold_rule=threshold_rule))
    conversion = case.conversion()
    shards = convert(checker.source(conversion.src), conversion.src, conversion.dst, case.config)
    if mutation is not None:
        shards = mutation.apply(shards, conversion)
    verdict = checker.verdict(shards, src=conversion.src, dst=conversion.dst,
                              mutation=case.mutation)
    unchanged = None
    if mutation is not None and verdict.first_mismatch is not None:
        unchanged = forward_unchanged(checker, conversion, mutation, shards)
    return Outcome(drawn, verdict.max_abs_error, verdict.threshold,
                   shards_differ=verdict.first_mismatch is not None, unchanged=unchanged,
                   near_ties=verdict.near_ties)


"""The fuzz front end: the properties as runnable tests under the harness's Hypothesis
profiles (``fuzz.profiles``), and the runner.

A property failure is shrunk by Hypothesis and the shrunk case written to the corpus, with
the worst deviation seen before shrinking. The runner is a generator of progress events;
only the CLI prints. Phase 1b plugs in by passing its ``forward`` (the rank pool's).

A rank fault (``RankFailure``: a rank killed, stopped, stalled or raising) is a fault of the
harness, not a counterexample: the property body turns it into ``HarnessAbort``, a
``BaseException`` that is not an ``Exception``, which Hypothesis lets through at once instead
of shrinking it as a failure. ``run_property`` records it on the tally (``HarnessFault``) and
re-raises the typed ``RankFailure``; ``fuzz`` records it in the report, lets the pool
restart on its next task, and goes on, up to ``max_faults``. Nothing is written to the
corpus for it. A ``KeyboardInterrupt`` (raised in a round, or thrown into the generator at
a ``Progress``) ends ``fuzz`` with a partial report (``FuzzReport.interrupted``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
from hypothesis import Phase, event, example, given, settings, target
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from weight_sync_bench.check.checker import Forward, ThresholdRule
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.errors import (
    InvalidNumber,
    LauncherCrash,
    MissingArtifacts,
    RankFailure,
    WsbError,
)
from weight_sync_bench.conventions.mutations import (
    DENSE_MUTATIONS,
    MOE_MUTATIONS,
    PIPELINE_MUTATIONS,
)
from weight_sync_bench.conventions.mutations import MUTATIONS as CONVERSION_MUTATIONS
from weight_sync_bench.fuzz.case import (
    CLAIMS,
    CONVERSION_PROPERTIES,
    MOE_PROPERTIES,
    Case,
    ConversionCase,
    Outcome,
    keeping_checkers,
    run_pairs,
)
from weight_sync_bench.fuzz.corpus import load_corpus, make_entry, save_entry, writable_corpus
from weight_sync_bench.fuzz.threshold import fuzz_threshold_rule
from weight_sync_bench.fuzz.domain import MOE_DOMAIN
from weight_sync_bench.fuzz.profiles import PROFILES, profile_name
from weight_sync_bench.fuzz.strategies import cases, geometries, moe_geometries, seeds
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.paths import corpus_dir

# What runs one drawn case: its outcome, or the outcomes of every pair it stands for
CaseRunner = Callable[..., "Outcome | list[Outcome]"]


@dataclass(frozen=True)
class HarnessFault:
    """A rank fault seen while ``label`` ran ``case``: never a counterexample, never shrunk,
    never written to the corpus. ``error`` is the typed ``RankFailure``."""

    label: str
    case: Case | None
    error: RankFailure

    @property
    def rank(self) -> int | None:
        return self.error.rank

    @property
    def how(self) -> str:
        """``killed by SIGKILL``, ``stopped (process state T)``, ``stalled past the
        deadline``, ``raised``: what happened to the rank, in a few words."""
        e = self.error
        if isinstance(e, LauncherCrash):  # not the rank's doing: its parent went away
            return (f"exited: its parent, the {e.launcher} (pid {e.launcher_pid}), ended "
                    f"({e.launcher_end})")
        signal_name = getattr(e, "signal_name", None)
        if signal_name:
            return f"killed by {signal_name}"
        if getattr(e, "exit_code", None) is not None:
            return f"exited with code {e.exit_code}"
        states = getattr(e, "states", None)
        if states and e.rank in states:
            return f"stopped (process state {states[e.rank]})"
        if hasattr(e, "stuck"):
            return "stalled past the watchdog deadline"
        return "raised"

    def __str__(self) -> str:
        first = str(self.error).splitlines()[0] if str(self.error) else type(self.error).__name__
        return (f"{type(self.error).__name__} during {self.label}: rank {self.rank} {self.how}"
                f"; breadcrumb: {self.error.breadcrumb or '-'}\n  {first}"
                + (f"\n  case: {self.case}" if self.case else ""))


class HarnessAbort(BaseException):
    """Carries a ``RankFailure`` out of a Hypothesis test body. A ``BaseException`` that is
    not an ``Exception``: Hypothesis neither shrinks it nor reports it as a failure."""

    def __init__(self, error: RankFailure, case: Case) -> None:
        super().__init__(str(error))
        self.error, self.case = error, case


class PropertyFailed(AssertionError):
    """A property that does not hold on a case; carries the outcome for the corpus."""

    def __init__(self, prop: str, outcome: Outcome) -> None:
        super().__init__(f"{prop} fails on {outcome.describe()}")
        self.prop, self.outcome = prop, outcome
        self.tally: Tally | None = None  # the run's tally, set once the failure is recorded
        self.entry: Path | None = None  # its corpus entry (new, or already there)


@dataclass
class Tally:
    """What one property saw over a run: examples, identity examples, extremes, failures."""

    prop: str
    mutation: str | None
    examples: int = 0
    identity: int = 0
    failures: int = 0
    killed: int = 0
    min_ratio: float = math.inf  # over non-identity examples
    max_ratio: float = 0.0
    min_at: Case | None = None
    max_at: Case | None = None
    # what the campaign summary reports (fuzz.summary): the largest ratio over examples the
    # property held on, and the smallest ratio over killed examples (finite ones)
    max_passing_ratio: float = 0.0
    max_passing_at: Case | None = None
    min_kill_ratio: float = math.inf
    min_kill_at: Case | None = None
    worst_failing: Outcome | None = None  # before shrinking
    new_entries: list[Path] = field(default_factory=list)
    faults: list[HarnessFault] = field(default_factory=list)
    # MoE examples (``Outcome.near_ties``): those whose reference had an expert choice within
    # the threshold of flipping (the routing check kept the reference's there), how many such
    # (layer, token) choices of how many, and how many of those examples the property failed on
    near_tie_examples: int = 0
    near_tie_choices: int = 0
    routed_choices: int = 0
    near_tie_failures: int = 0

    @property
    def label(self) -> str:
        return self.prop if self.mutation is None else f"{self.prop}[{self.mutation}]"

    def add(self, outcome: Outcome) -> None:
        self.examples += 1
        if outcome.identity_reason is not None:
            self.identity += 1
        else:
            self.killed += outcome.killed
            if outcome.ratio < self.min_ratio:
                self.min_ratio, self.min_at = outcome.ratio, outcome.case
            if outcome.ratio > self.max_ratio:
                self.max_ratio, self.max_at = outcome.ratio, outcome.case
            if outcome.killed and outcome.ratio < self.min_kill_ratio:
                self.min_kill_ratio, self.min_kill_at = outcome.ratio, outcome.case
        if outcome.holds(self.prop) and outcome.ratio > self.max_passing_ratio:
            self.max_passing_ratio, self.max_passing_at = outcome.ratio, outcome.case
        if outcome.near_ties is not None:
            near, choices = outcome.near_ties
            self.routed_choices += choices
            if near:
                self.near_tie_examples += 1
                self.near_tie_choices += near
                self.near_tie_failures += not outcome.holds(self.prop)
        if not outcome.holds(self.prop):
            worst = self.worst_failing
            more = (outcome.ratio > worst.ratio if CLAIMS.get(self.prop) == "invariant"
                    else outcome.ratio < worst.ratio) if worst else True
            if more:
                self.worst_failing = outcome


def corpus_examples(prop: str, mutation: str | None) -> list[Case]:
    """The corpus cases a property takes as explicit examples: entries without a mutation
    feed the invariant; entries with mutation m feed m's kill property; conversion entries
    feed the convert properties, an MoE geometry's the ``moe_`` ones."""
    conversion = prop in CONVERSION_PROPERTIES  # conversion entries feed the convert ones
    moe = prop in MOE_PROPERTIES
    entries = [e for e in load_corpus()  # a user function's entries are its own (fuzz.user)
               if isinstance(e.case, ConversionCase) == conversion and not e.user
               and bool(e.case.config.n_experts) == moe]
    if CLAIMS.get(prop) == "invariant" and mutation is None:
        return [e.case for e in entries if e.case.mutation is None]
    if CLAIMS.get(prop) == "kill":
        return [e.case for e in entries if e.case.mutation == mutation]
    return []


def default_strategy(prop: str, mutation: str | None, phase: str = "1a"
                     ) -> SearchStrategy[Case] | SearchStrategy[ConversionCase]:
    """What ``prop`` draws: ``cases`` for the layout properties, ``conversion_cases`` (the
    conventions, through the harness's own converter) for the convert ones,
    ``moe_conversion_cases`` (MoE geometries between their MoE endpoints) for the ``moe_``
    ones."""
    if prop in MOE_PROPERTIES:
        from weight_sync_bench.fuzz.strategies.conventions import moe_conversion_cases
        return moe_conversion_cases(mutation)
    if prop in CONVERSION_PROPERTIES:
        from weight_sync_bench.fuzz.strategies.conventions import conversion_cases
        return conversion_cases(mutation)
    return cases(mutation=mutation, phase=phase)


def property_test(prop: str, mutation: str | None, tally: Tally, *, phase: str = "1a",
                  forward: Forward = inprocess_forward, threshold_rule: ThresholdRule,
                  examples: list[Case] = (),
                  strategy: SearchStrategy[Case] | None = None,
                  case_runner: CaseRunner = run_pairs) -> Callable[[], None]:
    """A Hypothesis test of ``prop`` over ``strategy`` (default ``cases(mutation, phase)``)
    plus ``examples``, counting into ``tally``; settings come from the caller. Each case runs
    through ``case_runner(case, forward=, threshold_rule=)``: an outcome, or a list of them
    (default ``run_pairs``, the harness's own reshard: the invariant at every degree pair of
    the drawn geometry; ``fuzz.user`` passes the user's function). Every outcome is tallied;
    the first one the property does not hold on fails the example."""

    @given(case=strategy if strategy is not None else default_strategy(prop, mutation, phase))
    def test(case: Case) -> None:
        try:
            ran = case_runner(case, forward=forward, threshold_rule=threshold_rule)
        except RankFailure as error:  # the harness failed, not the property: do not shrink
            raise HarnessAbort(error, case) from error
        _judge(prop, ran if isinstance(ran, list) else [ran], tally)

    for case in examples:
        test = example(case=case)(test)
    return test


def _judge(prop: str, outcomes: list[Outcome], tally: Tally) -> None:
    """One example's outcomes: each tallied, Hypothesis steered by the one furthest along the
    property's direction, and the example failed on the first the property does not hold on
    (the body of ``property_test``'s test, outside it so mutation testing reaches it)."""
    looks_up = CLAIMS.get(prop) == "invariant"  # large deviations; a kill, small ones
    ratios = []
    for outcome in outcomes:
        tally.add(outcome)
        identity = outcome.identity_reason
        event(f"t={outcome.case.src}->{outcome.case.dst}" + (" identity" if identity else ""))
        if identity is None and math.isfinite(outcome.ratio):
            ratios.append(outcome.ratio if looks_up else -outcome.ratio)
    if ratios:  # one target per example and label: the pair furthest along it
        target(max(ratios), label="ratio" if looks_up else "-ratio")
    for outcome in outcomes:
        if not outcome.holds(prop):
            raise PropertyFailed(prop, outcome)


def run_property(prop: str, mutation: str | None = None, *, profile: str | None = None,
                 max_examples: int | None = None, seed: int | None = None,
                 phase: str = "1a", forward: Forward = inprocess_forward,
                 threshold_rule: ThresholdRule | None = None, corpus: bool = True,
                 corpus_path: Path | None = None,
                 strategy: SearchStrategy[Case] | None = None, tally: Tally | None = None,
                 examples: list[Case] | None = None,
                 case_runner: CaseRunner = run_pairs,
                 entry_fields: dict[str, Any] | None = None) -> Tally:
    """Run one property under a profile (explicit examples from the corpus first). On a
    failure the shrunk case goes to the corpus (``corpus_path`` or ``corpus/``) and the
    failure is re-raised; otherwise returns the tally (``tally``, if given, counts). A rank
    fault is recorded in ``tally.faults`` and its ``RankFailure`` re-raised, unshrunk and
    not written to the corpus. ``examples`` replace the corpus's explicit examples (still
    only with ``corpus``), ``case_runner`` runs each case (``property_test``) and
    ``entry_fields`` are added to a failure's corpus entry (``fuzz.user``: the user's
    function)."""
    name = profile_name(profile)
    if max_examples is not None:
        InvalidNumber.count("max_examples", max_examples)
    tally = tally if tally is not None else Tally(prop, mutation)
    rule = threshold_rule or fuzz_threshold_rule(phase)
    examples = ((list(examples) if examples is not None else corpus_examples(prop, mutation))
                if corpus else [])
    if Phase.generate not in PROFILES[name].phases and not examples:
        return tally  # nothing to run (Hypothesis would raise SkipTest)
    test = property_test(prop, mutation, tally, phase=phase, forward=forward,
                         threshold_rule=rule, examples=examples, strategy=strategy,
                         case_runner=case_runner)
    overrides = {"max_examples": max_examples} if max_examples is not None else {}
    if seed is not None:
        overrides["derandomize"] = False
        test = hypothesis.seed(seed)(test)
    test = settings(PROFILES[name], **overrides)(test)
    try:
        with keeping_checkers():  # an example drawn again reuses its checker, in this run only
            test()
    except HarnessAbort as abort:
        tally.faults.append(HarnessFault(tally.label, abort.case, abort.error))
        abort.error.add_note(f"a harness fault during {tally.label} on {abort.case}: not a "
                             "counterexample, not shrunk, not written to the corpus")
        raise abort.error from None
    except PropertyFailed as failure:
        worst = tally.worst_failing or failure.outcome
        entry = make_entry(prop, failure.outcome, worst_deviation=worst.deviation,
                           worst_ratio=worst.ratio, profile=name, hypothesis_seed=seed,
                           hypothesis_version=hypothesis.__version__)
        entry.update(entry_fields or {})
        saved = save_entry(entry, corpus_path)
        if saved.created:
            tally.new_entries.append(saved.path)
        tally.failures += 1
        failure.tally, failure.entry = tally, saved.path
        failure.args = (f"{failure.args[0]}\n  {saved.note}",)
        raise
    except Exception as exc:
        interrupt = _interrupt_behind(exc)
        if interrupt is None:
            raise
        raise interrupt from None  # a Ctrl-C, whatever Hypothesis wrapped it in
    return tally


def find_smallest(mutation: str, *, profile: str | None = None, phase: str = "1a",
                  forward: Forward = inprocess_forward, corpus_path: Path | None = None
                  ) -> PropertyFailed:
    """Run the invariant on shards with ``mutation`` applied: it fails wherever the check
    detects the mutation, and Hypothesis shrinks that failure to the mutation's smallest
    geometry, which lands in the corpus (how the committed seed entries were born). Returns
    the failure; raises ``WsbError`` if the invariant held, i.e. the mutation went unseen,
    and ``CorpusNotWritable`` before it runs where the corpus directory cannot be written."""
    writable_corpus(corpus_path)
    try:
        run_property("invariant", mutation, profile=profile, phase=phase, forward=forward,
                     corpus=False, corpus_path=corpus_path)
    except PropertyFailed as failure:
        return failure
    raise WsbError(f"mutation {mutation}: the invariant held on every example, so the check "
                   "never detected it")


def targets(mutations: list[str] | None = None, invariant: bool = True,
            conversions: bool = True) -> list[tuple[str, str | None]]:
    """The (property, mutation) pairs a fuzz run cycles through: the invariant, then (with
    ``conversions``) the invariant through the harness's converter between conventions
    (``convert``) and between an MoE geometry's MoE endpoints (``moe_convert``), then each
    layout mutation's ``kill``, each dense (and pipeline-stage) conversion mutation's
    ``convert_kill`` and each MoE
    one's ``moe_convert_kill``. ``mutations`` None means all of them; a list names some (of
    any kind), and then ``convert`` (``moe_convert``) runs only if a dense (an MoE) conversion
    mutation is among them."""
    moe_names = {m.name for m in MOE_MUTATIONS}
    if mutations is None:
        names = list(MUTATIONS) + ([m.name for m in (*DENSE_MUTATIONS, *PIPELINE_MUTATIONS,
                                                     *MOE_MUTATIONS)] if conversions else [])
    else:
        names = list(mutations)
    converted = [m for m in names if m in CONVERSION_MUTATIONS and m not in moe_names]
    routed = [m for m in names if m in moe_names]
    out: list[tuple[str, str | None]] = [("invariant", None)] if invariant else []
    if invariant and conversions and (mutations is None or converted):
        out.append(("convert", None))
    if invariant and conversions and (mutations is None or routed):
        out.append(("moe_convert", None))
    return (out + [("kill", m) for m in names if m not in CONVERSION_MUTATIONS]
            + [("convert_kill", m) for m in converted]
            + [("moe_convert_kill", m) for m in routed])


def moe_targets() -> list[tuple[str, str | None]]:
    """The Mixture-of-Experts properties of ``targets``: ``moe_convert``, then each MoE
    mutation's ``moe_convert_kill`` (``wsb fuzz --moe``)."""
    return [t for t in targets() if t[0] in MOE_PROPERTIES]


def _same_counterexample(a: PropertyFailed, b: PropertyFailed) -> bool:
    """Whether two failures are one counterexample: the same property on the same case."""
    return a.prop == b.prop and a.outcome.case.key() == b.outcome.case.key()


@dataclass(frozen=True)
class Progress:
    examples: int
    failures: int
    elapsed: float
    current: str

    @property
    def rate(self) -> float:
        return self.examples / self.elapsed if self.elapsed > 0 else 0.0

    def line(self) -> str:
        return (f"{self.examples} examples, {self.failures} failures, {self.rate:.1f} examples/s,"
                f" {self.elapsed:.0f}s elapsed ({self.current})")


@dataclass(frozen=True)
class FuzzReport:
    """What a run did. ``faults``: rank faults (harness, not counterexamples); ``stopped``:
    why the run ended before its budget, if it did; ``interrupted``: the KeyboardInterrupt
    (or subclass) that ended it; ``corpus``: where new entries went."""

    tallies: list[Tally]
    elapsed: float
    profile: str
    master_seed: int
    failures: list[PropertyFailed]
    faults: list[HarnessFault] = field(default_factory=list)
    stopped: str | None = None
    interrupted: BaseException | None = None
    corpus: Path | None = None

    @property
    def examples(self) -> int:
        return sum(t.examples for t in self.tallies)

    @property
    def new_entries(self) -> list[Path]:
        return [p for t in self.tallies for p in t.new_entries]


def fuzz(*, minutes: float | None = None, examples: int | None = None, phase: str = "1a",
         profile: str | None = None, mutations: list[str] | None = None,
         invariant: bool = True, chunk: int = 25, master_seed: int | None = None,
         forward: Forward = inprocess_forward, threshold_rule: ThresholdRule | None = None,
         corpus_path: Path | None = None, max_faults: int = 3,
         work: list[tuple[str, str | None]] | None = None,
         run: Callable[..., Tally] = run_property) -> Iterator[Progress | FuzzReport]:
    """Cycle through the properties in rounds of ``chunk`` examples, each round under its own
    Hypothesis seed (drawn from ``master_seed``), until ``minutes`` have passed or about
    ``examples`` examples have run (``examples`` is per property when only a budget in
    examples is given: every property gets at least that many; an example of the invariant
    checks every degree pair of its geometry, each pair counted, so it may pass the budget
    by one round's pairs). Yields a ``Progress`` after every
    round and a ``FuzzReport`` last. Failures are written to the corpus, not raised; rank
    faults are recorded, and after ``max_faults`` of them the run stops; a
    ``KeyboardInterrupt`` ends it with the report of what ran. ``work`` replaces the
    (property, mutation) pairs of ``targets``, ``run`` the ``run_property`` each round calls
    (``fuzz.user.fuzz_run``: a user's function, ``work`` its one label)."""
    if (minutes is None) == (examples is None):
        raise WsbError("fuzz needs exactly one budget: minutes or examples")
    if minutes is not None:
        InvalidNumber.positive("minutes", minutes)
    if examples is not None:
        InvalidNumber.count("examples", examples)
    InvalidNumber.count("chunk", chunk)
    InvalidNumber.count("max_faults", max_faults)
    if master_seed is not None:
        InvalidNumber.seed("master_seed", master_seed)
    name = profile_name(profile)
    rule = threshold_rule or fuzz_threshold_rule(phase)
    corpus = corpus_path or _corpus_or_none()
    if corpus is not None:  # refused now, not when a counterexample has nowhere to go
        writable_corpus(corpus)
    master_seed = master_seed if master_seed is not None else random.SystemRandom().getrandbits(32)
    rng = random.Random(master_seed)
    work = (work if work is not None
            else targets(mutations, invariant, conversions=phase == "1a"))  # conversions: in process
    merged = {t: Tally(*t) for t in work}
    failures: list[PropertyFailed] = []
    exhausted: set[tuple[str, str | None]] = set()  # ran nothing: wsb-replay after the corpus
    stopped: str | None = None
    interrupted: BaseException | None = None
    start, first = time.monotonic(), True
    # A KeyboardInterrupt can land at any line, not only inside a property's run or at a
    # yield: one between a round's steps (its tallying) ends the run as those do, with the
    # report of what ran, rather than escaping the generator with the report lost.
    try:
        while stopped is None:
            active = [t for t in work if t not in exhausted
                      and (examples is None or merged[t].examples < examples)]
            if not active or (minutes is not None and time.monotonic() - start >= minutes * 60):
                break
            for prop, mutation in active:
                done = merged[(prop, mutation)].examples
                budget = chunk if examples is None else min(chunk, examples - done)
                tally = Tally(prop, mutation)
                try:
                    run(prop, mutation, profile=name, max_examples=budget,
                        seed=rng.getrandbits(32), phase=phase, forward=forward,
                        threshold_rule=rule, corpus=first, corpus_path=corpus_path, tally=tally)
                except PropertyFailed as failure:
                    # a counterexample found again in a later round (the corpus entry it
                    # was saved as is replayed first) is one counterexample: listed and
                    # counted once, by the progress line and the summary alike
                    if not any(_same_counterexample(failure, f) for f in failures):
                        failures.append(failure)
                except RankFailure:
                    pass  # recorded in tally.faults; the pool restarts on its next task
                except KeyboardInterrupt as exc:  # SIGINT, or the CLI's SIGTERM: report it
                    interrupted, stopped = exc, f"interrupted ({type(exc).__name__})"
                if tally.examples == 0 and not tally.faults and interrupted is None:
                    exhausted.add((prop, mutation))
                _merge(merged[(prop, mutation)], tally)
                faults = sum(len(t.faults) for t in merged.values())
                if stopped is None and faults >= max_faults:
                    stopped = (f"stopped after {faults} harness faults "
                               f"(max_faults={max_faults})")
                elapsed = time.monotonic() - start
                if interrupted is None:
                    try:
                        yield Progress(sum(t.examples for t in merged.values()),
                                       len(failures), elapsed, merged[(prop, mutation)].label)
                    except KeyboardInterrupt as exc:  # thrown in by the consumer
                        interrupted, stopped = exc, f"interrupted ({type(exc).__name__})"
                if stopped is not None or (minutes is not None and elapsed >= minutes * 60):
                    break
            first = False
    except KeyboardInterrupt as exc:
        interrupted, stopped = exc, f"interrupted ({type(exc).__name__})"
    yield FuzzReport(list(merged.values()), time.monotonic() - start, name, master_seed,
                     failures, faults=[f for t in merged.values() for f in t.faults],
                     stopped=stopped, interrupted=interrupted, corpus=corpus)


def _interrupt_behind(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt ``exc`` is, or was raised while handling. Hypothesis replaces
    one that lands in its engine before the engine is set up with an ``AssertionError`` of its
    own, chained to it: that is still an interrupt, not an error of the run."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _corpus_or_none() -> Path | None:
    try:
        return corpus_dir()
    except MissingArtifacts:
        return None


def _merge(into: Tally, tally: Tally) -> None:
    into.examples += tally.examples
    into.identity += tally.identity
    into.failures += tally.failures
    into.killed += tally.killed
    into.near_tie_examples += tally.near_tie_examples
    into.near_tie_choices += tally.near_tie_choices
    into.routed_choices += tally.routed_choices
    into.near_tie_failures += tally.near_tie_failures
    into.new_entries.extend(tally.new_entries)
    into.faults.extend(tally.faults)
    if tally.min_ratio < into.min_ratio:
        into.min_ratio, into.min_at = tally.min_ratio, tally.min_at
    if tally.max_ratio > into.max_ratio:
        into.max_ratio, into.max_at = tally.max_ratio, tally.max_at
    if tally.max_passing_ratio > into.max_passing_ratio:
        into.max_passing_ratio, into.max_passing_at = tally.max_passing_ratio, tally.max_passing_at
    if tally.min_kill_ratio < into.min_kill_ratio:
        into.min_kill_ratio, into.min_kill_at = tally.min_kill_ratio, tally.min_kill_at


def format_report(report: FuzzReport, *, matrix: bool = False) -> str:
    """The closing table: per property, examples, identity examples, failures and the ratio
    extremes (``matrix``: the kill matrix's columns, killed and smallest ratio)."""
    if matrix:
        rows = [["mutation", "tried", "identity", "killed", "smallest ratio", "at"]]
        for t in report.tallies:
            live = t.examples - t.identity
            rows.append([t.mutation or "-", str(t.examples), str(t.identity),
                         f"{t.killed}/{live}", f"{t.min_ratio:.3g}x" if live else "-",
                         str(t.min_at) if t.min_at else "-"])
    else:
        rows = [["property", "examples", "identity", "failures", "min ratio", "max ratio",
                 "new corpus entries"]]
        for t in report.tallies:
            rows.append([t.label, str(t.examples), str(t.identity), str(t.failures),
                         f"{t.min_ratio:.3g}x" if math.isfinite(t.min_ratio) else "-",
                         f"{t.max_ratio:.3g}x", ", ".join(p.name for p in t.new_entries) or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if matrix:
        lines += [f"note, {t.mutation}: {MUTATIONS[t.mutation].note}" for t in report.tallies
                  if t.mutation in MUTATIONS and MUTATIONS[t.mutation].note]
    routed = [t for t in report.tallies if t.routed_choices]
    if routed:
        near = sum(t.near_tie_examples for t in routed)
        lines.append(f"near ties (MoE): {near} of {sum(t.examples for t in routed)} examples "
                     f"had an expert choice within the threshold of flipping "
                     f"({sum(t.near_tie_choices for t in routed)} of "
                     f"{sum(t.routed_choices for t in routed)} choices: the reference's was "
                     f"kept there); {sum(t.near_tie_failures for t in routed)} of them failed")
    rate = report.examples / report.elapsed if report.elapsed else 0.0
    lines.append(f"{report.examples} examples in {report.elapsed:.1f}s ({rate:.1f}/s), "
                 f"{len(report.failures)} failures, {len(report.faults)} harness faults; "
                 f"profile {report.profile}, master seed {report.master_seed}")
    new = report.new_entries
    if report.corpus is not None:
        entries = "entry" if len(new) == 1 else "entries"
        lines.append(f"corpus: {report.corpus} ({len(new)} new {entries})")
    if report.stopped:
        lines.append(f"{report.stopped}: a partial run, not the whole budget")
    return "\n".join(lines)


def draw_floor_cases(n: int, *, seed: int | None = None, profile: str = "wsb-generate"
                     ) -> tuple[list[tuple[ModelConfig, int]], int]:
    """``n`` (geometry, seed) cases from the fuzz strategies under the generate-only
    profile, the domain's smallest and largest geometry first; and the Hypothesis seed."""
    from weight_sync_bench.fuzz.domain import DOMAIN
    InvalidNumber.count("n", n)
    seed = seed if seed is not None else random.SystemRandom().getrandbits(32)
    InvalidNumber.seed("seed", seed)
    drawn: list[tuple[ModelConfig, int]] = [(DOMAIN.smallest(), 0), (DOMAIN.largest(), 0)]

    @hypothesis.seed(seed)
    @settings(PROFILES[profile], max_examples=max(n - len(drawn), 1))
    @given(config=geometries(), model_seed=seeds())
    def collect(config: ModelConfig, model_seed: int) -> None:
        drawn.append((config, model_seed))

    collect()
    return drawn[:n], seed


def draw_moe_cases(n: int, *, seed: int, profile: str = "wsb-generate"
                   ) -> list[tuple[ModelConfig, int, str | None]]:
    """``n`` (MoE geometry, model seed, purpose) cases drawn as the MoE fuzz draws them, under
    the generate-only profile and the Hypothesis seed ``seed`` (the same cases for the same
    seed and Hypothesis version): each draw first picks its purpose, ``moe_convert`` (None) or
    one MoE mutation's ``moe_convert_kill`` (its name), then ``moe_geometries`` with what that
    needs to be live (``strategies.conventions.moe_needs_for``: a selection bias, a wide
    shared expert and its gate, q/k norms, square experts, an odd expert count, two KV
    heads), so every mutation is drawn for in about one case in twelve. The first two are
    ``MOE_DOMAIN``'s smallest and largest geometry (purpose None)."""
    from weight_sync_bench.fuzz.strategies.conventions import moe_needs_for

    InvalidNumber.count("n", n)
    InvalidNumber.seed("seed", seed)
    drawn: list[tuple[ModelConfig, int, str | None]] = [(MOE_DOMAIN.smallest(), 0, None),
                                                          (MOE_DOMAIN.largest(), 0, None)]
    purposes = [None, *(m.name for m in MOE_MUTATIONS)]

    @hypothesis.seed(seed)
    @settings(PROFILES[profile], max_examples=max(n - len(drawn), 1))
    @given(purposed=st.sampled_from(purposes).flatmap(
        lambda m: st.tuples(moe_geometries(needs=moe_needs_for(m)), st.just(m))),
        model_seed=seeds())
    def collect(purposed: tuple[ModelConfig, str | None], model_seed: int) -> None:
        drawn.append((purposed[0], model_seed, purposed[1]))

    collect()
    return drawn[:n]


def search_worst_floors(examples: int, *, keep: int, seed: int, phase: str = "1a",
                        forward: Forward = inprocess_forward) -> list[tuple[ModelConfig, int]]:
    """Hypothesis's target phase aimed at the largest floor / max |reference logit|: the
    ``keep`` worst distinct (geometry, seed) cases of ``examples`` tried."""
    from weight_sync_bench.fuzz.floor import relative_floor
    InvalidNumber.count("examples", examples)
    InvalidNumber.count("keep", keep)
    InvalidNumber.seed("seed", seed)
    found: dict[tuple[tuple[tuple[str, int], ...], int], tuple[float, ModelConfig, int]] = {}

    @hypothesis.seed(seed)
    @settings(PROFILES["wsb-generate"], max_examples=examples,
              phases=(Phase.generate, Phase.target))
    @given(config=geometries(), model_seed=seeds())
    def search(config: ModelConfig, model_seed: int) -> None:
        worst = relative_floor(config, model_seed, forward=forward, phase=phase)
        target(worst, label="floor / max|reference logit|")
        found[(tuple(sorted(config.geometry().items())), model_seed)] = (worst, config, model_seed)

    search()
    ranked = sorted(found.values(), key=lambda item: -item[0])[:keep]
    return [(config, model_seed) for _, config, model_seed in ranked]

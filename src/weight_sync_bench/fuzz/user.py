"""Fuzzing the user's own code: their splitter, resharder or converter, over random geometries.

``wsb fuzz --resharder mod:fn`` and ``weight_sync_bench.testing.reshard_property(fn)`` both
come here. A case is a ``Case`` (geometry, degrees, seed; a split's source degree is 1, the
full model; a converter's degrees are its conventions'); ``run_user_case`` calls the user's
function as ``check_split`` / ``check_reshard`` / ``check_convert`` do, through
``check.user_code.call``, with the geometry, which here changes from example to example:
``config=`` (the ``ModelConfig``) when the signature accepts it, and for a converter
``hf_config=`` too (``ModelConfig.to_hf_config``, what a real converter reads from
``config.json``). ``UserFunction`` is the fuzz's record of the function (role, import path,
conventions, source file); it binds and calls nothing itself. The verdict is the fixed
checks': the shards byte for byte against the declared layout, then the forward within the
fuzz threshold rule (``floor.fuzz_threshold_rule``). What the function raises, or returns
that is not shards of the layout, is a counterexample too, shrunk like any other.

- ``Unsupported`` raised by the function declines the case: counted (``UserStats``), the
  smallest declined case kept, never a pass, never a failure;
- every shipped ``config.json`` geometry (``real_geometries``: 1 layer, hidden, intermediate
  and head sizes / 16, the head counts and head_dim ratio kept, vocabulary 520) runs first as
  an explicit example, judged by a threshold measured for it (``check.convert.measure_threshold``).
  Hypothesis does not shrink an explicit example, so a failure there is held back while
  random draws look for a smaller one, and raised at the end only if they found none;
- a shrunk failure is written to the corpus like the harness's, plus a ``user`` block: the
  role, the import path, the source file and its sha256 (``fuzz.replay.replay_entry``
  re-runs it and says when the source changed).

The Hypothesis test is the runner's (``runner.property_test`` / ``run_property``) with this
module's case runner: the same profiles, budgets, progress and corpus as ``wsb fuzz``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
from hypothesis import settings as Settings

from weight_sync_bench.check.checker import Checker, Forward, ThresholdRule, Verdict
from weight_sync_bench.check.convert import ConversionChecker, measure_threshold
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.user_code import (
    call,
    call_user,
    check_signature,
    describe,
    geometry_keywords,
    require_callable,
)
from weight_sync_bench.conventions import CONVENTIONS, Endpoint, endpoint
from weight_sync_bench.errors import (
    InvalidConfig,
    InvalidShards,
    Unsupported,
    UserCodeError,
    WsbError,
)
from weight_sync_bench.fuzz.case import (
    Case,
    ConversionCase,
    Outcome,
    end_of,
    make_checker,
)
from weight_sync_bench.fuzz.corpus import (
    Entry,
    entry_paths,
    load_corpus,
    make_entry,
    save_entry,
)
from weight_sync_bench.fuzz.domain import DOMAIN, FP8_DOMAIN, FuzzDomain
from weight_sync_bench.fuzz.runner import (
    FuzzReport,
    HarnessAbort,
    PropertyFailed,
    Tally,
    property_test,
    run_property,
)
from weight_sync_bench.fuzz.strategies.user import (
    ROLES,
    convention_degrees,
    make_case,
    user_cases,
)
from weight_sync_bench.fuzz.threshold import fuzz_threshold_rule
from weight_sync_bench.model.config import HF_CONFIGS, ModelConfig, shipped_hf_config
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.paths import user_corpus_dir

REAL_SHRINK = 16  # shipped geometries reduced: hidden, intermediate, head_dim / 16
REAL_VOCAB = 520  # 8 x 65: every degree up to 8 divides it, and 64 does not


@dataclass(frozen=True)
class UserFunction:
    """A user's function and how the harness calls it: ``role`` (splitter, resharder,
    converter), ``name`` (its import path, ``module:function``; default ``describe(fn)``)
    and, for a converter, the source and destination conventions (``"megatron"``)."""

    fn: Callable[..., Any]
    role: str
    src: str | None = None
    dst: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidConfig(f"unknown role {self.role!r}; known: {', '.join(ROLES)}")
        require_callable(self.fn, self.role)
        if (self.role == "converter") != (self.src is not None and self.dst is not None):
            raise InvalidConfig("a converter needs src and dst conventions, and only a "
                                f"converter has them (role={self.role}, src={self.src}, "
                                f"dst={self.dst})")
        for end in (self.src, self.dst):
            if end is not None and end.partition(":")[0] not in CONVENTIONS:
                raise InvalidConfig(f"unknown convention {end!r}; known: {', '.join(CONVENTIONS)}")
            if end is not None and ":" in end:  # a whole endpoint: it must parse
                endpoint(end)
        if not self.name:
            object.__setattr__(self, "name", describe(self.fn))

    @property
    def prop(self) -> str:
        """The claim, as the corpus names it: ``invariant`` (the declared split everywhere),
        ``convert`` for a converter (the destination's declared shards everywhere)."""
        return "convert" if self.role == "converter" else "invariant"

    @property
    def conventions(self) -> tuple[str, str] | None:
        return (self.src, self.dst) if self.src is not None and self.dst is not None else None

    @property
    def stages(self) -> tuple[bool, bool]:
        """Whether a converter's source / destination is fuzzed over pipeline stages too:
        where it takes ``source=`` / ``target=`` (a staged rank stores its layers under local
        indices; the endpoint's ``rank_coordinates`` place them)."""
        if self.role != "converter":
            return (False, False)
        keywords = geometry_keywords(self.fn, self.role)
        return ("source" in keywords, "target" in keywords)

    @property
    def quantized(self) -> bool:
        """Whether this is a converter into an FP8 destination (``vllm:fp8=block128``)."""
        return self.dst is not None and ":" in self.dst and endpoint(self.dst).quantized

    def domain(self, domain: FuzzDomain) -> FuzzDomain:
        """Where this function is fuzzed: ``FP8_DOMAIN`` in place of the default ``DOMAIN``
        for a converter into an FP8 destination (the small widths of ``DOMAIN`` are not
        whole 128-row blocks anywhere: vLLM would refuse every case), a domain the user
        narrowed as it is."""
        return FP8_DOMAIN if self.quantized and domain == DOMAIN else domain

    @property
    def label(self) -> str:
        """``resharder mod:fn`` (``converter mod:fn megatron -> vllm``)."""
        ends = f" {self.src} -> {self.dst}" if self.conventions else ""
        return f"{self.role} {self.name}{ends}"

    def check_callable(self) -> None:
        """Refuse, before any example runs, a function the harness cannot call (as every
        case calls it: ``check.user_code.call``, with the geometry keywords it accepts)."""
        check_signature(self.fn, (None, None), role=self.role,
                        keywords=geometry_keywords(self.fn, self.role))

    def source(self) -> tuple[str | None, str | None]:
        """The function's source file and the sha256 of its bytes (None where there is none)."""
        try:
            path = inspect.getsourcefile(inspect.unwrap(self.fn))
        except TypeError:
            return None, None
        if path is None or not Path(path).is_file():
            return path, None
        return path, hashlib.sha256(Path(path).read_bytes()).hexdigest()

    def entry_fields(self) -> dict[str, Any]:
        """The ``user`` block of a corpus entry for this function."""
        path, digest = self.source()
        return {"user": {"role": self.role, "function": self.name, "source_file": path,
                         "source_sha256": digest}}

    def owns(self, entry: Entry) -> bool:
        """Whether a corpus entry was written for this function (role and import path, and a
        converter's conventions)."""
        user = entry.user
        if not user or user.get("function") != self.name or user.get("role") != self.role:
            return False
        case = entry.case
        if not isinstance(case, ConversionCase) or self.conventions is None:
            return not isinstance(case, ConversionCase) and self.conventions is None
        # a convention named alone owns the cases drawn at its pipeline splits too
        return all(end == mine or (":" not in mine and end.partition(":")[0] == mine)
                   for end, mine in zip((case.src_convention, case.dst_convention),
                                        self.conventions))


@dataclass(frozen=True)
class UserOutcome(Outcome):
    """One case of the user's function: the ``verdict`` (None when the function raised or
    returned what is not shards: ``error`` says what), or ``declined`` (its ``Unsupported``
    message). ``skip``: not judged here (declined, or a shipped geometry's failure held back
    until the random draws are done)."""

    function: UserFunction | None = None
    verdict: Verdict | None = None
    error: str | None = None
    declined: str | None = None
    skip: bool = False

    @property
    def check_passed(self) -> bool:
        return self.verdict is not None and self.verdict.passed

    def holds(self, prop: str) -> bool:
        return self.skip or self.check_passed

    def describe(self) -> str:
        return report(self)


def format_geometry(config: ModelConfig) -> str:
    """Every field of the geometry: the sizes, the token shape, the RoPE base and norm eps."""
    fields = {**config.geometry(), "rope_theta": config.rope_theta, "norm_eps": config.norm_eps}
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in fields.items())


def degrees_text(function: UserFunction | None, case: Case) -> str:
    if function is not None and function.role == "splitter":
        return f"split of the full model -> t={case.dst}"
    if function is not None and function.conventions:
        return " -> ".join(_endpoints(function, case))
    return f"t={case.src} -> t={case.dst}"


def report(outcome: UserOutcome) -> str:
    """The counterexample as the user reads it: the function, the geometry (every field), the
    degrees, the first parameter that differs with the rows each rank holds against the
    declared ones, the deviation and the threshold."""
    case, fn = outcome.case, outcome.function
    name = fn.label if fn is not None else "?"
    where = f" ({case.config.name}, a shipped geometry)" if case.config.name in HF_CONFIGS else ""
    lines = [f"your {name}", f"  geometry{where}: {format_geometry(case.config)}",
             f"  degrees: {degrees_text(fn, case)}; seed {case.seed} (tokens {1000 + case.seed}), "
             f"phase {case.phase}"]
    if outcome.declined is not None:
        lines.append(f"  declined: Unsupported: {outcome.declined}")
    elif outcome.error is not None:
        lines.extend("  " + line for line in outcome.error.splitlines())
        if not math.isnan(outcome.threshold):  # an FP8 check measures its own, after the bytes
            lines.append(f"  threshold {outcome.threshold:.4g} (no forward ran)")
    else:
        assert outcome.verdict is not None
        lines.extend(str(outcome.verdict).splitlines()[1:])  # the fixed check's own words
    return "\n".join(lines)


# -- one case


def real_geometries() -> list[ModelConfig]:
    """Every shipped ``config.json`` geometry (``HF_CONFIGS``), at 1 layer, hidden,
    intermediate and head sizes divided by ``REAL_SHRINK`` (head counts, GQA grouping and the
    head_dim ratio kept) and a vocabulary of ``REAL_VOCAB``."""
    return [shipped_hf_config(name, shrink=REAL_SHRINK, n_layers=1, vocab=REAL_VOCAB)
            for name in HF_CONFIGS]


def _is_real(config: ModelConfig) -> bool:
    return config.name in HF_CONFIGS


def _ends(function: UserFunction, case: Case) -> tuple[Endpoint, Endpoint]:
    """A converter's two endpoints in ``case``: the case's conventions (a ``ConversionCase``),
    else the function's at the case's degrees."""
    assert function.src is not None and function.dst is not None
    if isinstance(case, ConversionCase):
        return (end_of(case.src_convention, case.src), end_of(case.dst_convention, case.dst))
    return end_of(function.src, case.src), end_of(function.dst, case.dst)


def _endpoints(function: UserFunction, case: Case) -> tuple[str, ...]:
    if function.conventions:
        return tuple(str(e) for e in _ends(function, case))
    return (f"plain:{case.src}", f"plain:{case.dst}")


@functools.lru_cache(maxsize=64)
def _real_threshold(config: ModelConfig, endpoints: tuple[str, ...]) -> float:
    """A shipped geometry has no sampled floor: its threshold is measured for it, over the
    endpoints the case reads (``measure_threshold``, 4 seeds, 100x headroom)."""
    return measure_threshold(config, endpoints)


def _checker(function: UserFunction, case: Case, forward: Forward,
             threshold_rule: ThresholdRule | None) -> Checker:
    """A fuzzed geometry's checker (fuzz weights and tokens, the fuzz threshold rule); a
    shipped geometry's (``init_params`` and ``make_tokens``, as its threshold was measured)."""
    if _is_real(case.config):
        return Checker(case.config, seed=case.seed, phase=case.phase, forward=forward,
                       threshold=_real_threshold(case.config, _endpoints(function, case)))
    if function.role == "converter" and threshold_rule is None:
        from weight_sync_bench.check.floor import REPLICATED_KV, forward_of

        target = _ends(function, case)[1]
        if forward_of(target.convention, case.config, target) == REPLICATED_KV:
            from weight_sync_bench.fuzz.threshold import require_replicated_kv
            # the rule judges vLLM's replicated-KV forward only where a measurement of
            # that forward validates it, as for the harness's own conversions (fuzz.case)
            require_replicated_kv(case.config, case.dst, case.phase)
    return make_checker(case.config, case.seed, phase=case.phase, forward=forward,
                        threshold_rule=threshold_rule)


def run_user_case(function: UserFunction, case: Case, *, forward: Forward = inprocess_forward,
                  threshold_rule: ThresholdRule | None = None) -> UserOutcome:
    """Call the user's function on ``case`` as the fixed checks do, with the geometry, and
    judge what it returns. What it raises or returns that is not shards is the outcome's
    ``error``; ``Unsupported`` is ``declined``. A converter into an FP8 destination is
    judged as ``check_convert`` judges one (``check.fp8``: weights and scales against the
    reference quantizer's, bit for bit; its own threshold), on the fuzz weights."""
    if function.role == "converter" and _ends(function, case)[1].quantized:
        return _fp8_case(function, case)
    checker = _checker(function, case, forward, threshold_rule)
    assert checker.threshold is not None
    config, fn, role, name = case.config, function.fn, function.role, function.name
    dtypes = {n: x.dtype for n, x in checker.full.items()}
    common = {"case": case, "threshold": checker.threshold, "function": function}
    try:
        if role == "splitter":
            full = {n: t.clone() for n, t in checker.full.items()}
            shards = call_user(fn, (full, case.dst), role=role, config=config, name=name,
                               during=f"while splitting {config.name} for t={case.dst}",
                               layout=checker.layout, degree=case.dst, dtypes=dtypes)
            verdict = checker.verdict(shards, dst=case.dst)
        elif role == "resharder":
            source = [{n: t.clone() for n, t in p.items()} for p in checker.declared(case.src)]
            shards = call_user(fn, (source, case.dst), role=role, config=config, name=name,
                               during=f"while resharding {config.name} {case.src} -> {case.dst}",
                               layout=checker.layout, degree=case.dst, dtypes=dtypes)
            verdict = checker.verdict(shards, src=case.src, dst=case.dst)
        else:
            assert function.src is not None and function.dst is not None
            conv = ConversionChecker(checker)  # the fuzz weights, tokens and threshold
            src, dst = _ends(function, case)
            out = call(fn, (conv.source(src), case.dst), role=role, config=config, name=name,
                       during=f"while converting {config.name} {src} -> {dst}",
                       ends=(src, dst))
            verdict = conv.verdict(out, src=src, dst=dst)
    except UserCodeError as err:
        if isinstance(err.__cause__, Unsupported):
            return UserOutcome(deviation=math.nan, shards_differ=False,
                               declined=str(err.__cause__) or "(no reason given)", **common)
        return UserOutcome(deviation=math.nan, shards_differ=True, error=str(err), **common)
    except InvalidShards as err:  # a converter's output that is not the convention's shards
        return UserOutcome(deviation=math.nan, shards_differ=True,
                           error=f"your converter `{function.name}` returned shards that do not "
                                 f"fit the convention: {err}", **common)
    return UserOutcome(deviation=verdict.max_abs_error, shards_differ=verdict.first_mismatch
                       is not None, verdict=verdict, **common)


def _fp8_case(function: UserFunction, case: Case) -> UserOutcome:
    """A converter's case into an FP8 destination (``run_user_case``)."""
    from weight_sync_bench.check.fp8 import check_fp8_convert
    from weight_sync_bench.fuzz.domain import fuzz_params

    src, dst = _ends(function, case)
    common: dict[str, Any] = {"case": case, "function": function}
    try:
        verdict = check_fp8_convert(function.fn, case.config, src, dst,
                                    fuzz_params(case.config, case.seed), seed=case.seed,
                                    name=function.name)  # as every other case names it
    except UserCodeError as err:
        if isinstance(err.__cause__, Unsupported):
            return UserOutcome(deviation=math.nan, shards_differ=False, threshold=math.nan,
                               declined=str(err.__cause__) or "(no reason given)", **common)
        return UserOutcome(deviation=math.nan, shards_differ=True, threshold=math.nan,
                           error=str(err), **common)
    except InvalidShards as err:  # names, shapes or dtypes that are not the destination's
        return UserOutcome(deviation=math.nan, shards_differ=True, threshold=math.nan,
                           error=f"your converter `{function.name}` returned shards that do not "
                                 f"fit the convention: {err}", **common)
    return UserOutcome(deviation=verdict.max_abs_error, shards_differ=verdict.first_mismatch
                       is not None, threshold=verdict.threshold, verdict=verdict, **common)


# -- a run


def _size(case: Case) -> tuple[int, int, int]:
    return (case.config.n_params, case.src, case.dst)


@dataclass
class UserStats:
    """What a run of the user's function saw beyond the runner's tally: the cases declined
    (``Unsupported``) and the smallest of them, the examples run before the first failure,
    and the shipped geometries' outcomes (explicit examples)."""

    examples: int = 0  # every case run, declined ones included
    declined: int = 0
    smallest_declined: UserOutcome | None = None
    first_failure_at: int | None = None  # examples run when the first failing one was seen
    real: dict[str, UserOutcome] = field(default_factory=dict)  # by geometry name

    @property
    def checked(self) -> int:
        return self.examples - self.declined

    def add(self, outcome: UserOutcome) -> None:
        self.examples += 1
        if outcome.declined is not None:
            self.declined += 1
            if self.smallest_declined is None or \
                    _size(outcome.case) < _size(self.smallest_declined.case):
                self.smallest_declined = outcome
        elif not outcome.check_passed and self.first_failure_at is None:
            self.first_failure_at = self.examples
        if _is_real(outcome.case.config):
            self.real[outcome.case.config.name] = outcome

    def held_back(self) -> list[UserOutcome]:
        """The shipped geometries that failed (raised only if the draws found nothing)."""
        return [o for o in self.real.values() if o.declined is None and not o.check_passed]

    def lines(self) -> list[str]:
        """The summary's lines about declined cases and the shipped geometries."""
        out = [f"{self.checked} cases checked, {self.declined} declined (Unsupported: skipped, "
               "not passed)"]
        if self.smallest_declined is not None:
            o = self.smallest_declined
            out.append(f"smallest declined: {format_geometry(o.case.config)}, "
                       f"{degrees_text(o.function, o.case)}: {o.declined}")
        if self.first_failure_at is not None:
            out.append(f"first failing example: the {_ordinal(self.first_failure_at)} run")
        if self.real:
            out.append("shipped geometries (explicit examples, 1 layer, sizes / "
                       f"{REAL_SHRINK}, vocab {REAL_VOCAB}): " + ", ".join(
                           f"{name} {degrees_text(o.function, o.case)} "
                           + ("declined" if o.declined is not None
                              else "PASS" if o.check_passed else "FAIL")
                           for name, o in self.real.items()))
        return out


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def real_cases(function: UserFunction, *, domain: FuzzDomain = DOMAIN, src: int | None = None,
               dst: int | None = None, phase: str = "1a") -> list[Case]:
    """The shipped geometries as cases: a splitter to the largest degree, a resharder from
    the largest to the smallest other one above 1 (else 1), a converter from its source
    convention's largest degree to its destination's smallest other one above 1 (``src`` / ``dst`` where fixed, a geometry
    that does not support them left out), seed 0. A geometry outside a field the user
    narrowed (``domain`` differs there from the function's default domain, ``DOMAIN`` or, for
    an FP8 destination, ``FP8_DOMAIN``) is left out too: the harness's own choice of domain
    narrows nothing, the destination's degrees decide what it stores."""
    default = function.domain(DOMAIN)
    narrowed = {f.name for f in dataclasses.fields(FuzzDomain)
                if getattr(domain, f.name) != getattr(default, f.name)}
    out = []
    for config in real_geometries():
        if any(v.split("=")[0] in narrowed for v in domain.violations(config)):
            continue
        if function.conventions:
            srcs = convention_degrees(function.conventions[0], config)
            dsts = convention_degrees(function.conventions[1], config)
        else:
            dsts = layout_for(config).supported_degrees()
            srcs = [1] if function.role == "splitter" else dsts
        s = src if src is not None else max(srcs)
        others = [t for t in dsts if t != s]  # a reshard that moves rows, between ranks if any
        d = dst if dst is not None else (max(dsts) if function.role == "splitter" else min(
            [t for t in others if t > 1] or others or [s]))
        if s in srcs and d in dsts:
            out.append(make_case(config, s, d, 0, function.conventions, phase))
    return out


def corpus_cases(function: UserFunction) -> list[Case]:
    """The corpus entries written for this function (``paths.user_corpus_dir``), as cases."""
    return [e.case for e in load_corpus(entry_paths(user_corpus_dir())) if function.owns(e)]


def case_runner(function: UserFunction, stats: UserStats) -> Callable[..., Outcome]:
    """The runner's case runner for ``function``: runs the case, counts it into ``stats``,
    and marks a declined case or a shipped geometry's failure ``skip`` (neither is a
    counterexample Hypothesis should shrink)."""

    def run(case: Case, *, forward: Forward = inprocess_forward,
            threshold_rule: ThresholdRule | None = None) -> Outcome:
        outcome = run_user_case(function, case, forward=forward, threshold_rule=threshold_rule)
        stats.add(outcome)
        if outcome.declined is not None or (_is_real(case.config) and not outcome.check_passed):
            return dataclasses.replace(outcome, skip=True)
        return outcome

    return run


def _held_back_failure(stats: UserStats) -> PropertyFailed | None:
    held = stats.held_back()
    if not held:
        return None
    failure = PropertyFailed(held[0].function.prop if held[0].function else "invariant", held[0])
    failure.args = (f"{failure.args[0]}\n  (a shipped geometry, run as an explicit example: "
                    "not shrunk, not written to the corpus; no random draw failed)",)
    return failure


def fuzz_run(function: UserFunction, *, domain: FuzzDomain = DOMAIN, src: int | None = None,
             dst: int | None = None, stats: UserStats, real: bool = True, phase: str = "1a"
             ) -> Callable[..., Tally]:
    """A ``run_property`` for ``runner.fuzz(run=...)``: the user's property over
    ``user_cases`` with this function's case runner, the corpus entries written for it and
    the shipped geometries as explicit examples (in the first round), failures written to the
    corpus with the function's ``user`` block. A shipped geometry's failure is raised after
    the first round when that round's draws found none."""
    function.check_callable()
    domain = function.domain(domain)
    strategy = user_cases(function.role, domain=domain, src=src, dst=dst,
                          conventions=function.conventions, phase=phase,
                          stages=function.stages)

    def run(prop: str, mutation: str | None, *, corpus: bool = True, phase: str = "1a",
            **kwargs: Any) -> Tally:
        examples = ([*corpus_cases(function),
                     *(real_cases(function, domain=domain, src=src, dst=dst, phase=phase)
                       if real else [])] if corpus else [])
        kwargs["corpus_path"] = kwargs.get("corpus_path") or user_corpus_dir()
        tally = run_property(prop, mutation, corpus=corpus, phase=phase, strategy=strategy,
                             examples=examples, case_runner=case_runner(function, stats),
                             entry_fields=function.entry_fields(), **kwargs)
        held = _held_back_failure(stats) if corpus else None
        if held is not None:
            tally.failures += 1
            held.tally = tally
            raise held
        return tally

    return run


def user_report(report: FuzzReport, stats: UserStats) -> FuzzReport:
    """``report`` as the user's run means it (one tally, the function's): examples are the
    cases checked (a declined case is not one), and a counterexample found again in a later
    round is listed, and counted, once."""
    seen, failures = set(), []
    for failure in report.failures:
        key = repr(failure.outcome.case.key())
        if key not in seen:
            seen.add(key)
            failures.append(failure)
    tallies = [dataclasses.replace(t, examples=t.examples - stats.declined,
                                   failures=len(failures)) for t in report.tallies]
    return dataclasses.replace(report, tallies=tallies, failures=failures)


# -- from pytest


def user_property(function: UserFunction, *, domain: FuzzDomain = DOMAIN,
                  src: int | None = None, dst: int | None = None,
                  settings: Settings | None = None, real: bool = True, corpus: bool = True,
                  phase: str = "1a", forward: Forward = inprocess_forward,
                  corpus_path: Path | None = None) -> Callable[[], None]:
    """A test function pytest collects: the user's property under the current Hypothesis
    settings (the profile loaded, or ``settings``), the corpus entries written for this
    function and the shipped geometries first. A shrunk failure is written to the corpus
    (``corpus_path``, else ``WSB_CORPUS_DIR`` / ``wsb-corpus/`` in the current directory, where there is
    one) and raised as ``PropertyFailed`` with the report; declined cases are reported as a
    warning, and a run where every case was declined fails. ``test.stats`` is the last
    run's ``UserStats``."""
    function.check_callable()
    domain = function.domain(domain)
    strategy = user_cases(function.role, domain=domain, src=src, dst=dst,
                          conventions=function.conventions, phase=phase,
                          stages=function.stages)

    def test() -> None:
        stats = UserStats()
        test.stats = stats  # type: ignore[attr-defined]
        tally = Tally(function.prop, function.label)
        examples = ([*(corpus_cases(function) if corpus else []),
                     *(real_cases(function, domain=domain, src=src, dst=dst, phase=phase)
                       if real else [])])
        inner = property_test(function.prop, None, tally, phase=phase, forward=forward,
                              threshold_rule=fuzz_threshold_rule(phase), examples=examples,
                              strategy=strategy, case_runner=case_runner(function, stats))
        # the user's settings as given; else the profile loaded now, without its deadline:
        # one example checks a whole model (a reference forward, the function, a sharded
        # forward), hundreds of milliseconds, which Hypothesis's 200 ms default would fail
        inner = (settings if settings is not None else Settings(deadline=None))(inner)
        try:
            inner()
        except HarnessAbort as abort:
            raise abort.error from None
        except PropertyFailed as failure:
            _record(failure, tally, function, corpus_path)
            failure.args = ("\n  ".join([failure.args[0], *stats.lines()]),)
            raise
        held = _held_back_failure(stats)
        if held is not None:
            raise held
        if stats.examples == 0:  # no draw and no explicit example: nothing to say passed
            raise WsbError(f"{function.label}: no case ran, so nothing was checked")
        if stats.checked == 0:
            raise WsbError(f"{function.label}: every one of the {stats.declined} cases was "
                              "declined (Unsupported), so nothing was checked: narrow the domain")
        if stats.declined:
            warnings.warn(f"{function.label}: " + "; ".join(stats.lines()[:2]), stacklevel=2)

    test.__name__ = test.__qualname__ = f"test_{function.role}_property"
    test.__doc__ = f"The {function.label} gives the declared shards on every fuzzed geometry."
    return test


def _record(failure: PropertyFailed, tally: Tally, function: UserFunction,
            corpus_path: Path | None) -> None:
    """Write a pytest property's shrunk failure to the corpus, where there is one."""
    from weight_sync_bench.errors import MissingArtifacts

    worst = tally.worst_failing or failure.outcome
    entry = make_entry(function.prop, failure.outcome, worst_deviation=worst.deviation,
                       worst_ratio=worst.ratio, profile=None, hypothesis_seed=None,
                       hypothesis_version=hypothesis.__version__)
    entry.update(function.entry_fields())
    try:
        saved = save_entry(entry, corpus_path or user_corpus_dir())
    except MissingArtifacts as exc:
        failure.args = (f"{failure.args[0]}\n  corpus entry not written: {exc}",)
        return
    failure.entry = saved.path
    failure.args = (f"{failure.args[0]}\n  {saved.note}",)

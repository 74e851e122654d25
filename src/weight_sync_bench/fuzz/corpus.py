"""The corpus: shrunk failing cases, one readable JSON file each, that rebuild on any machine.

Hypothesis's example database is an opaque cache keyed by test and version; this is the
part that lasts. An entry names the case (geometry, degrees, seeds, mutation, phase), the
property that failed on it, what was measured (deviation, threshold, ratio, and the worst
deviation seen before shrinking) and where it was found (versions, commit, profile,
Hypothesis seed). The file name is a hash of the property and the case, so two workers
(or two runs sharing one directory) that shrink to the same case write one file; each
writer writes a temporary file of its own (pid and random suffix) and links it into place,
so an entry is whole or absent, never overwritten, and no temporary file is left behind.
A directory that cannot be written is a typed error (``CorpusNotWritable``); a
counterexample that cannot be saved is printed whole instead (``save_entry``).

An entry is born failing: ``invariant`` failed (the check failed on it; with a mutation,
that is the mutation detected, found at its smallest geometry) or ``kill`` failed (a
mutation slipped under the margin). ``fuzz.replay`` re-measures and classifies each entry
(``classify``); it never deletes or rewrites one.

Each entry records its ``origin``, so the corpus keeps real discoveries apart from planted
bugs: ``seeded`` is a mutation planted on purpose and found by the invariant at its smallest
geometry (``find_smallest``: the committed mutation cases), ``discovered`` is a failure
nobody planted (the invariant failing on unmutated code, or a mutation slipping under the
kill margin: a weakness of the check). ``make_entry`` derives it (``origin_of``); an entry
written before the field existed has its origin inferred by the same rule, with a note
(``Entry.origin_note``).

Reading is bounded: an entry whose geometry would need more memory or work than
``ReplayLimits`` allow (``model.footprint``, from the geometry alone, each entry alone) is
refused before anything is allocated, naming the field furthest outside the fuzz domain. ``scan_corpus`` reads
every entry it can and reports each bad one with its file and field, so one bad file never
blocks the good ones.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import platform
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weight_sync_bench.check.mutations import mutation_by_name
from weight_sync_bench.conventions.mutations import mutation_by_name as conversion_mutation
from weight_sync_bench.errors import (
    CorpusEntryTooLarge,
    CorpusNotWritable,
    CorruptCorpusEntry,
    InvalidConfig,
    InvalidNumber,
    UnknownConvention,
    UnknownMutation,
    UnsafeFile,
    UnsupportedLayout,
)
from weight_sync_bench.files import read_bounded
from weight_sync_bench.fuzz.case import (
    CONVERSION_PROPERTIES,
    PROPERTIES,
    Case,
    ConversionCase,
    Outcome,
    end_of,
    options_only,
)
from weight_sync_bench.model.config import BOOL_FIELDS, MOE_FIELDS, VARIANT_FIELDS, ModelConfig
from weight_sync_bench.model.footprint import Limits, driving_field, footprint, sizes
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.paths import corpus_dir
from weight_sync_bench.tolerance.artifacts import PHASES, cpu_vendor, environment
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

SCHEMA = 1
KIND = "weight-sync-bench corpus entry"
ORIGINS = ("seeded", "discovered")
STATUSES = ("still failing", "fixed", "drifted", "environment changed", "declined")
# What a replay compares with where an entry was found: a deviation that differs under other
# versions or on another CPU vendor (MKL and oneDNN sum in another order there) is the
# environment's doing; entries found before the vendor was recorded name none.
_VERSION_KEYS = ("torch", "numpy", "python", "platform", "cpu_vendor")


def versions(hypothesis_version: str | None = None) -> dict[str, str | None]:
    return {"torch": torch.__version__, "numpy": np.__version__,
            "hypothesis": hypothesis_version, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_vendor": cpu_vendor()}


def entry_name(prop: str, case: Case, user: dict[str, Any] | None = None) -> str:
    """``<hash>.json``: 16 hex digits of the SHA-256 of the property and the case key (and,
    for a user function's entry, its role and import path: two functions failing on the same
    case keep an entry each)."""
    who = {"user": {"role": user.get("role"), "function": user.get("function")}} if user else {}
    key = json.dumps({"property": prop, **case.key(), **who}, sort_keys=True,
                     separators=(",", ":"))
    return hashlib.sha256(key.encode()).hexdigest()[:16] + ".json"


def origin_of(prop: str, case: Case) -> str:
    """``seeded`` where the failure is a planted mutation detected (the invariant over a
    mutated case), ``discovered`` otherwise (see the module doc)."""
    return "seeded" if prop == "invariant" and case.mutation is not None else "discovered"


def make_entry(prop: str, outcome: Outcome, *, worst_deviation: float, worst_ratio: float,
               profile: str | None, hypothesis_seed: int | None,
               hypothesis_version: str | None, origin: str | None = None) -> dict[str, Any]:
    """The entry for a shrunk failing ``outcome`` of ``prop``; ``origin`` defaults to
    ``origin_of(prop, case)``."""
    case = outcome.case
    origin = origin if origin is not None else origin_of(prop, case)
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {', '.join(ORIGINS)}, got {origin!r}")
    env = environment()
    return {
        "schema": SCHEMA, "kind": KIND, "property": prop, "origin": origin,
        "case": {"geometry": case.config.geometry(),
                 "degrees": {"src": case.src, "dst": case.dst},
                 "seeds": {"param": case.seed, "token": TOKEN_SEED_OFFSET + case.seed},
                 "mutation": case.mutation, "phase": case.phase,
                 **({"conventions": {"src": case.src_convention, "dst": case.dst_convention}}
                    if isinstance(case, ConversionCase) else {})},
        "measured": {"deviation": _num(outcome.deviation), "threshold": outcome.threshold,
                     "ratio": _num(outcome.ratio),
                     "worst_deviation_before_shrinking": _num(worst_deviation),
                     "worst_ratio_before_shrinking": _num(worst_ratio)},
        "found": {"versions": versions(hypothesis_version), "commit": env["commit"],
                  "src_dirty": env["src_dirty"], "profile": profile,
                  "hypothesis_seed": hypothesis_seed,
                  "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
    }


def _num(x: float) -> float | str:
    """JSON has no NaN or inf: those are written as strings."""
    return x if math.isfinite(x) else repr(x)


def _temporary(directory: Path, name: str) -> Path:
    """A name no other writer uses: this process's pid and a random suffix."""
    return directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def _not_writable(directory: Path, exc: OSError) -> CorpusNotWritable:
    reason = exc.strerror or str(exc)
    return CorpusNotWritable(
        f"the corpus directory {directory} cannot be written ({reason}"
        f"{': ' + exc.filename if exc.filename and exc.filename != str(directory) else ''}): "
        "set WSB_CORPUS_DIR to a writable directory", directory=str(directory), reason=reason)


def writable_corpus(directory: Path | None = None) -> Path:
    """``directory`` (default the corpus directory) shown writable, or ``CorpusNotWritable``
    naming it and why: a fuzz run asks before it runs anything, not when it has a
    counterexample to save. An existing directory is shown writable by creating and removing
    a file of its own; a missing one is not created (a run that finds nothing leaves
    nothing), its nearest existing ancestor must be a directory this process may write."""
    directory = directory or corpus_dir()
    if directory.exists() or directory.is_symlink():
        probe = _temporary(directory, "probe")
        try:
            probe.touch(exist_ok=False)
            probe.unlink()
        except OSError as exc:
            raise _not_writable(directory, exc) from None
        return directory
    ancestor = directory.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _not_writable(directory, NotADirectoryError(errno.ENOTDIR,
                                                          os.strerror(errno.ENOTDIR)))
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise _not_writable(directory, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    return directory


def write_entry(entry: dict[str, Any], directory: Path | None = None) -> tuple[Path, bool]:
    """Write ``entry`` as ``<hash>.json`` atomically; ``(path, created)``. An existing file
    of that name (the same case, found by another worker or run) is left as it is.
    ``CorpusNotWritable`` where the directory cannot be created or written."""
    directory = directory or corpus_dir()
    case = case_from(entry, directory / "<new>")
    path = directory / entry_name(entry["property"], case, entry.get("user"))
    tmp = _temporary(directory, path.name)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry, indent=2) + "\n")
        os.link(tmp, path)  # atomic, and fails rather than replace an existing entry
        return path, True
    except FileExistsError:
        return path, False
    except OSError as exc:
        raise _not_writable(directory, exc) from None
    finally:
        if tmp.exists():  # False too where the directory itself is missing or not one
            tmp.unlink()


@dataclass(frozen=True)
class Saved:
    """Where a counterexample went: ``path`` (None where it could not be written),
    ``created`` (False: the same entry was already there), and ``note``, the line (or, for an
    entry that could not be written, the lines and the entry itself) its report carries."""

    path: Path | None
    created: bool
    note: str


def save_entry(entry: dict[str, Any], directory: Path | None = None) -> Saved:
    """``write_entry``, for a counterexample in hand: where the directory cannot be written
    (``CorpusNotWritable``), the entry is not lost but printed whole in the note, with the
    file name it would have had, to save and replay (``wsb replay FILE``)."""
    try:
        path, created = write_entry(entry, directory)
    except CorpusNotWritable as exc:
        case = case_from(entry, Path("<unsaved>"))
        name = entry_name(entry["property"], case, entry.get("user"))
        return Saved(None, False, f"corpus entry NOT written: {exc}\n  the entry, to save as "
                                  f"{name} (wsb replay FILE replays it):\n"
                                  + json.dumps(entry, indent=2))
    return Saved(path, created, f"corpus entry: {path}{'' if created else ' (already there)'}")


def _field(data: Any, dotted: str, kind: type | tuple[type, ...], path: Path) -> Any:
    value = data
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise CorruptCorpusEntry(f"{path}: missing field {dotted!r}", path=str(path),
                                     field=dotted)
        value = value[part]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise CorruptCorpusEntry(
            f"{path}: field {dotted!r} is {value!r}, expected "
            + " or ".join(k.__name__ for k in _as_tuple(kind)), path=str(path), field=dotted)
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


_GEOMETRY = ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "batch",
             "seq_len")
_MOE_TEXT = ("router", "moe_style")  # the MoE fields recorded as text, not as integers

GIB = 2**30


@dataclass(frozen=True)
class ReplayLimits(Limits):
    """The most one corpus entry may cost to load and run (``model.footprint``):
    ``max_bytes`` held (default 2 GiB) and ``max_flops`` (default 50 GFLOP, about a minute on
    one thread), tighter than a command's ``Limits`` (an entry is a file from elsewhere).
    ``wsb replay --max-gib / --max-gflop`` raise them."""

    max_bytes: int = 2 * GIB
    max_flops: float = 50e9


def _check_footprint(config: ModelConfig, path: Path, limits: ReplayLimits) -> None:
    """Refuse a geometry over the limits, naming the field furthest above the fuzz domain's
    largest geometry (what drives the estimate; the MoE domain's for an MoE entry) and the
    estimate."""
    from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN

    cost = footprint(config)
    over = limits.over(cost)
    if not over:
        return
    top = (MOE_DOMAIN if config.n_experts else DOMAIN).largest()
    largest = driving_field(config, sizes(top))
    # the field furthest outside the fuzz domain drives the estimate; inside it, no one does
    field = f"case.geometry.{largest}" if largest is not None else "case.geometry"
    what = f"{getattr(config, largest)}" if largest is not None else "inside the fuzz domain"
    raise CorpusEntryTooLarge(
        f"{path}: field '{field}' is {what}: replaying this entry "
        f"would need {' and '.join(over)}, refused before allocating anything (estimate: "
        f"{cost.formula()})",
        path=str(path), field=field, estimate=cost.bytes, flops=cost.flops)


def case_from(entry: Any, path: Path, limits: ReplayLimits | None = None) -> Case:
    """The Case an entry names, every field checked; ``CorruptCorpusEntry`` names the file
    and the first bad field, ``CorpusEntryTooLarge`` a geometry over ``limits`` (default
    ``ReplayLimits()``), before anything of it is built."""
    schema = _field(entry, "schema", int, path)
    if schema != SCHEMA:
        raise CorruptCorpusEntry(f"{path}: field 'schema' is {schema}, this code reads {SCHEMA}",
                                 path=str(path), field="schema")
    prop = _field(entry, "property", str, path)
    if prop not in PROPERTIES:
        raise CorruptCorpusEntry(f"{path}: field 'property' is {prop!r}, expected one of "
                                 f"{', '.join(PROPERTIES)}", path=str(path), field="property")
    geometry = {k: _field(entry, f"case.geometry.{k}", int, path) for k in _GEOMETRY}
    recorded = _field(entry, "case.geometry", dict, path)
    for k in VARIANT_FIELDS:  # recorded only where not the default (bools as 0/1)
        if k in recorded:
            value = _field(entry, f"case.geometry.{k}", int, path)
            geometry[k] = value if k == "vocab_multiple" else bool(value)
    if "n_experts" in recorded:  # an MoE geometry records every MoE field (ModelConfig.geometry)
        for k in MOE_FIELDS:
            value = _field(entry, f"case.geometry.{k}", str if k in _MOE_TEXT else int, path)
            geometry[k] = bool(value) if k in BOOL_FIELDS else value
    conventions = (_field(entry, "case.conventions", dict, path)
                   if isinstance(entry.get("case"), dict) and "conventions" in entry["case"]
                   else None)
    try:
        config = ModelConfig(name=f"corpus:{path.stem}", **geometry)
    except InvalidConfig as exc:
        raise CorruptCorpusEntry(f"{path}: field 'case.geometry': {exc}", path=str(path),
                                 field="case.geometry") from None
    _check_footprint(config, path, limits or ReplayLimits())
    mutation = _field(entry, "case.mutation", (str, type(None)), path)
    if mutation is not None:
        try:
            (conversion_mutation if conventions is not None else mutation_by_name)(mutation)
        except UnknownMutation as exc:
            raise CorruptCorpusEntry(f"{path}: field 'case.mutation': {exc}", path=str(path),
                                     field="case.mutation") from None
    phase = _field(entry, "case.phase", str, path)
    if phase not in PHASES:
        raise CorruptCorpusEntry(f"{path}: field 'case.phase' is {phase!r}, expected one of "
                                 f"{', '.join(PHASES)}", path=str(path), field="case.phase")
    seed = _field(entry, "case.seeds.param", int, path)
    if not 0 <= seed <= InvalidNumber.SEED_MAX:
        raise CorruptCorpusEntry(f"{path}: field 'case.seeds.param' is {seed}, expected a seed "
                                 "in 0..2^63-1", path=str(path), field="case.seeds.param")
    token = _field(entry, "case.seeds.token", int, path)
    if token != TOKEN_SEED_OFFSET + seed:
        raise CorruptCorpusEntry(f"{path}: field 'case.seeds.token' is {token}, this code "
                                 f"draws tokens from {TOKEN_SEED_OFFSET} + param = "
                                 f"{TOKEN_SEED_OFFSET + seed}", path=str(path),
                                 field="case.seeds.token")
    if (conventions is not None) != (prop in CONVERSION_PROPERTIES):
        raise CorruptCorpusEntry(
            f"{path}: field 'case.conventions' is set, but property {prop!r} is not a "
            "conversion's" if conventions is not None else
            f"{path}: field 'case.conventions' is missing: property {prop!r} is a conversion's",
            path=str(path), field="case.conventions")
    if conventions is not None:
        return _conversion_case_from(entry, config, conventions, mutation, phase, seed, path)
    supported = layout_for(config).supported_degrees()
    degrees = {}
    for end in ("src", "dst"):
        degrees[end] = _field(entry, f"case.degrees.{end}", int, path)
        if degrees[end] not in supported:
            raise CorruptCorpusEntry(
                f"{path}: field 'case.degrees.{end}' is {degrees[end]}, the geometry supports "
                f"t in {supported}", path=str(path), field=f"case.degrees.{end}")
    return Case(config=config, src=degrees["src"], dst=degrees["dst"], seed=seed,
                mutation=mutation, phase=phase)


def _conversion_case_from(entry: Any, config: ModelConfig, conventions: dict[str, Any],
                          mutation: str | None, phase: str, seed: int, path: Path
                          ) -> ConversionCase:
    """A conversion entry's case (``case.conventions`` present): each end's convention named
    and able to store the geometry at its degree, or a whole endpoint
    (``megatron:tp=2,ep=4``, an MoE conversion's) that parses, stores the geometry and has as
    many ranks as its degree says; the mutation applying to the conversion."""
    from weight_sync_bench.conventions import CONVENTIONS, endpoint

    ends = {}
    for end in ("src", "dst"):
        name = conventions.get(end)
        if isinstance(name, str) and ":" in name:  # a whole endpoint, or options at a degree
            degree = _field(entry, f"case.degrees.{end}", int, path)
            try:
                where = end_of(name, degree) if options_only(name) else endpoint(name)
                where.unquantized().pieces(config)
            except (UnknownConvention, UnsupportedLayout) as exc:
                raise CorruptCorpusEntry(f"{path}: field 'case.conventions.{end}' is {name!r}: "
                                         f"{exc}", path=str(path),
                                         field=f"case.conventions.{end}") from None
            if where.world != degree:
                raise CorruptCorpusEntry(
                    f"{path}: field 'case.degrees.{end}' is {degree}, the endpoint {name} has "
                    f"{where.world} ranks", path=str(path), field=f"case.degrees.{end}")
            ends[end] = (name, degree)
            continue
        if not isinstance(name, str) or name not in CONVENTIONS:
            raise CorruptCorpusEntry(f"{path}: field 'case.conventions.{end}' is {name!r}, "
                                     f"expected one of {', '.join(CONVENTIONS)} (or a whole "
                                     "endpoint, megatron:tp=2,ep=4)", path=str(path),
                                     field=f"case.conventions.{end}")
        degree = _field(entry, f"case.degrees.{end}", int, path)
        if not CONVENTIONS[name].supports(config, degree):
            raise CorruptCorpusEntry(
                f"{path}: field 'case.degrees.{end}' is {degree}, {name} stores the geometry at "
                f"t in {CONVENTIONS[name].supported_degrees(config, 16)}", path=str(path),
                field=f"case.degrees.{end}")
        ends[end] = (name, degree)
    try:
        return ConversionCase(config=config, src_convention=ends["src"][0], src=ends["src"][1],
                              dst_convention=ends["dst"][0], dst=ends["dst"][1], seed=seed,
                              mutation=mutation, phase=phase)
    except InvalidConfig as exc:
        raise CorruptCorpusEntry(f"{path}: field 'case': {exc}", path=str(path),
                                 field="case") from None


@dataclass(frozen=True)
class Entry:
    path: Path
    data: dict[str, Any]
    case: Case

    @property
    def prop(self) -> str:
        return self.data["property"]

    @property
    def user(self) -> dict[str, Any] | None:
        """A user function's entry (``fuzz.user``): its ``role``, ``function`` (import path),
        ``source_file`` and ``source_sha256``; None for the harness's own entries."""
        return self.data.get("user")

    @property
    def deviation(self) -> float:
        return float(self.data["measured"]["deviation"])

    @property
    def origin(self) -> str:
        """``seeded`` or ``discovered`` (recorded; inferred for an entry older than the field)."""
        return self.data.get("origin") or origin_of(self.prop, self.case)

    @property
    def origin_note(self) -> str | None:
        """Why the origin is inferred (the entry has no ``origin`` field), or None."""
        if "origin" in self.data:
            return None
        return (f"no 'origin' field (written before origins were recorded): counted as "
                f"{self.origin}, inferred from property {self.prop!r} and mutation "
                f"{self.case.mutation!r}")


def load_entry(path: Path, limits: ReplayLimits | None = None) -> Entry:
    try:  # bounded, and never blocked by a FIFO (files.read_bounded)
        data = json.loads(read_bounded(os.path.realpath(path), shown=path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCorpusEntry(f"{path}: not valid JSON ({exc})", path=str(path)) from None
    except UnsafeFile as exc:
        raise CorruptCorpusEntry(str(exc), path=str(path)) from None
    except OSError as exc:
        raise CorruptCorpusEntry(f"{path}: cannot be read ({exc.strerror or exc})",
                                 path=str(path)) from None
    case = case_from(data, Path(path), limits)
    if isinstance(data, dict) and "origin" in data and data["origin"] not in ORIGINS:
        raise CorruptCorpusEntry(f"{path}: field 'origin' is {data['origin']!r}, expected one "
                                 f"of {', '.join(ORIGINS)}", path=str(path), field="origin")
    _field(data, "measured.deviation", (int, float, str), Path(path))
    _field(data, "found.versions", dict, Path(path))
    return Entry(Path(path), data, case)


def entry_paths(directory: Path | None = None) -> list[Path]:
    directory = directory or corpus_dir()
    return sorted(directory.glob("*.json")) if directory.is_dir() else []


def _files(paths: Iterable[Path] | None) -> list[Path]:
    if paths is None:
        return entry_paths()
    return [q for p in paths for q in (entry_paths(Path(p)) if Path(p).is_dir() else [Path(p)])]


def load_corpus(paths: Iterable[Path] | None = None,
                limits: ReplayLimits | None = None) -> list[Entry]:
    """Every entry (of ``paths``, or of the corpus directory), all checked before any is
    used: one corrupt file stops the load with its name and field (the fuzz's explicit
    examples must all be sound; ``scan_corpus`` reads past bad files)."""
    return [load_entry(p, limits) for p in _files(paths)]


@dataclass(frozen=True)
class Scan:
    """Every entry that loaded, and every file that did not with its typed error."""

    entries: list[Entry]
    bad: list[CorruptCorpusEntry]


def scan_corpus(paths: Iterable[Path] | None = None,
                limits: ReplayLimits | None = None) -> Scan:
    """Like ``load_corpus``, but a bad file (corrupt, unreadable, over ``limits``) is
    recorded and the rest still loads."""
    entries, bad = [], []
    for path in _files(paths):
        try:
            entries.append(load_entry(path, limits))
        except CorruptCorpusEntry as exc:
            bad.append(exc)
    return Scan(entries, bad)


@dataclass(frozen=True)
class Replayed:
    entry: Entry
    outcome: Outcome
    status: str  # one of STATUSES
    note: str | None = None  # a user function's entry: its source changed, it now declines

    @property
    def claim_holds(self) -> bool:
        """The project's claim on this case: no mutation -> the check passes; a mutation ->
        detected by ``KILL_MARGIN`` x wherever it is not the identity."""
        conversion = isinstance(self.entry.case, ConversionCase)
        if self.entry.case.mutation is None:
            return self.outcome.holds("convert" if conversion else "invariant")
        return self.outcome.holds("convert_kill" if conversion else "kill")


def classify(entry: Entry, outcome: Outcome, running: dict[str, Any] | None = None) -> str:
    """still failing (the same deviation, bit for bit), fixed (the property holds now),
    environment changed (a different deviation under different versions or on another CPU
    vendor, or where the entry recorded none), drifted (a different deviation in the same
    environment)."""
    if outcome.holds(entry.prop):
        return "fixed"
    recorded = entry.data["measured"]["deviation"]
    if _num(outcome.deviation) == recorded:
        return "still failing"
    running = running or versions()
    then = entry.data["found"]["versions"]
    if any(then.get(k) != running.get(k) for k in _VERSION_KEYS):
        return "environment changed"
    return "drifted"


def format_replay(results: list[Replayed]) -> str:
    """One table per origin, discovered first (real bugs), then seeded (planted mutations),
    each with its count; a line per entry whose origin is inferred."""
    out = []
    for origin in reversed(ORIGINS):
        group = [r for r in results if r.entry.origin == origin]
        if not group:
            continue
        rows = [["entry", "property", "mutation", "src -> dst", "deviation", "ratio", "status",
                 "claim"]]
        for r in group:
            case = r.entry.case
            route = (f"{case.src_convention}:{case.src} -> {case.dst_convention}:{case.dst}"
                     if isinstance(case, ConversionCase) else f"{case.src} -> {case.dst}")
            rows.append([r.entry.path.name, r.entry.prop, case.mutation or "-",
                         route, f"{r.outcome.deviation:.4g}",
                         f"{r.outcome.ratio:.3g}x", r.status,
                         "holds" if r.claim_holds else "BROKEN"])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        holds = sum(r.claim_holds for r in group)
        out.append(f"{origin} ({len(group)} entr{'y' if len(group) == 1 else 'ies'}, the claim "
                   f"holds on {holds}):")
        out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        out += [f"note, {r.entry.path.name}: {r.entry.origin_note}" for r in group
                if r.entry.origin_note]
        out += [f"note, {r.entry.path.name}: the {r.entry.user.get('role')} "
                f"{r.entry.user.get('function')}" + (f"; {r.note}" if r.note else "")
                for r in group if r.entry.user]
        out.append("")
    return "\n".join(out).rstrip("\n")

"""A fuzz campaign's summary as data: what ``wsb fuzz`` (and ``wsb mutants``) ran, found and
measured, written as one JSON file a person or CI reads after the run.

``build_summary(report, ...)`` is a pure function of the runner's ``FuzzReport`` (its
``Tally`` per property, the failures and harness faults) plus what the report does not hold
(the phase, the budget, the command); ``write_summary`` writes it atomically. The fields:

- ``properties``: per property (``invariant``, ``kill[m]``), the examples, identity examples
  (a mutation that changes nothing there), failures, killed examples and the corpus entries
  its failures wrote (file names); an MoE property (``moe_convert``, ``moe_convert_kill[m]``)
  also its ``near_ties``: the examples whose reference had an expert choice within the
  threshold of flipping (where the routing check kept the reference's), the near-tied
  (layer, token) choices of all, and how many of those examples failed;
- ``invariant.worst_ratio``: the largest deviation / threshold over the examples the
  invariant held on (1.0 would be a deviation at the threshold), and the case;
- ``kill[m].smallest_kill_ratio``: per mutation property, the smallest deviation / threshold
  over the examples that were killed (>= ``KILL_MARGIN``, 10), and the case;
  ``smallest_ratio`` is the same over every non-identity example, killed or not (below 10
  means a mutation slipped under the margin somewhere, and the property failed);
- ``near_ties``: the same summed over every MoE property (None where no MoE example ran);
- ``failures``: each counterexample (property, case, deviation, threshold, ratio, corpus
  entry file name); ``harness_faults``: rank faults (never counterexamples);
- ``campaign``: profile, phase, budget, master seed (each round's Hypothesis seed is drawn
  from it: ``random.Random(master_seed).getrandbits(32)`` in turn), duration, whether it
  stopped early or was interrupted, corpus directory;
- ``environment``: git commit and whether ``src/`` was dirty, torch, numpy, Hypothesis,
  Python and platform.

Ratios that are not finite (a NaN or infinite deviation) are written as strings (``"inf"``),
as corpus entries write them: JSON has no NaN.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis

from weight_sync_bench.fuzz.case import CLAIMS
from weight_sync_bench.fuzz.corpus import versions
from weight_sync_bench.paths import fuzz_dir
from weight_sync_bench.tolerance.artifacts import environment

if TYPE_CHECKING:
    from weight_sync_bench.fuzz.runner import FuzzReport, Tally

SCHEMA = 1
KIND = "weight-sync-bench fuzz campaign summary"


def _num(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else repr(x)


def _case(case: object) -> str | None:
    return None if case is None else str(case)


def _property(t: Tally) -> dict[str, Any]:
    live = t.examples - t.identity
    out: dict[str, Any] = {
        "property": t.prop, "mutation": t.mutation, "claim": CLAIMS.get(t.prop, t.prop),
        "examples": t.examples, "identity": t.identity, "live": live,
        "failures": t.failures, "killed": t.killed,
        "new_entries": [p.name for p in t.new_entries], "harness_faults": len(t.faults)}
    if CLAIMS.get(t.prop) == "invariant":
        passed = t.examples - t.failures
        out["worst_ratio"] = _num(t.max_passing_ratio) if passed else None
        out["worst_at"] = _case(t.max_passing_at)
        out["max_ratio"] = _num(t.max_ratio) if t.examples else None  # failing ones included
    else:
        out["smallest_kill_ratio"] = (_num(t.min_kill_ratio) if t.min_kill_at is not None
                                      else None)
        out["smallest_kill_at"] = _case(t.min_kill_at)
        out["smallest_ratio"] = _num(t.min_ratio) if live else None
        out["smallest_at"] = _case(t.min_at)
    if t.routed_choices:
        out["near_ties"] = _near_ties([t])
    return out


def _near_ties(tallies: list[Tally]) -> dict[str, int]:
    return {"examples": sum(t.near_tie_examples for t in tallies),
            "choices": sum(t.near_tie_choices for t in tallies),
            "of_choices": sum(t.routed_choices for t in tallies),
            "failed": sum(t.near_tie_failures for t in tallies)}


def build_summary(report: FuzzReport, *, phase: str | None = None, command: str = "fuzz",
                  budget: dict[str, Any] | None = None,
                  env: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary of ``report`` (see the module doc). ``env`` (default
    ``tolerance.artifacts.environment()``, which asks git) is where the run ran."""
    env = env if env is not None else environment()
    props = [_property(t) for t in report.tallies]
    invariants = [p for p in props if p["claim"] == "invariant" and p["worst_ratio"] is not None]
    kills = {p["mutation"]: p["smallest_kill_ratio"] for p in props if p["claim"] == "kill"}
    failures = []
    for f in report.failures:
        entries = [f.entry.name] if f.entry is not None else []
        failures.append({"property": f.prop, "label": f.tally.label if f.tally else f.prop,
                         "case": str(f.outcome.case), "deviation": _num(f.outcome.deviation),
                         "threshold": f.outcome.threshold, "ratio": _num(f.outcome.ratio),
                         "corpus_entries": entries})
    worst = max(invariants, key=lambda p: _sortable(p["worst_ratio"]), default=None)
    return {
        "schema": SCHEMA, "kind": KIND, "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "campaign": {"profile": report.profile, "phase": phase, "budget": budget or {},
                     "master_seed": report.master_seed,
                     "hypothesis_seeds": "random.Random(master_seed).getrandbits(32), one per "
                                         "property per round",
                     "duration_s": round(report.elapsed, 3), "stopped": report.stopped,
                     "interrupted": (type(report.interrupted).__name__
                                     if report.interrupted is not None else None),
                     "corpus": str(report.corpus) if report.corpus is not None else None},
        "totals": {"examples": report.examples, "properties": len(props),
                   "failures": len(report.failures), "harness_faults": len(report.faults),
                   "new_entries": [p.name for p in report.new_entries]},
        "worst_invariant_ratio": worst["worst_ratio"] if worst else None,
        "worst_invariant_property": worst["property"] if worst else None,
        "smallest_kill_ratios": kills,
        "near_ties": (_near_ties(report.tallies)
                      if any(t.routed_choices for t in report.tallies) else None),
        "properties": props,
        "failures": failures,
        "harness_faults": [{"property": f.label, "type": type(f.error).__name__, "rank": f.rank,
                            "how": f.how, "case": _case(f.case)} for f in report.faults],
        "environment": {"commit": env.get("commit"), "src_dirty": env.get("src_dirty"),
                        **versions(hypothesis.__version__)},
    }


def _sortable(x: float | str | None) -> float:
    return float(x) if x is not None else -math.inf


def default_summary_path(summary: dict[str, Any]) -> Path:
    """``<paths.fuzz_dir()>/summaries/<command>-<UTC time>-seed<master seed>.json`` (raises
    ``MissingArtifacts`` outside a checkout when ``WSB_FUZZ_DIR`` is unset)."""
    stamp = summary["date"].replace("-", "").replace(":", "")
    return (fuzz_dir() / "summaries"
            / f"{summary['command']}-{stamp}-seed{summary['campaign']['master_seed']}.json")


def write_summary(summary: dict[str, Any], path: Path | None = None) -> Path:
    """Write ``summary`` atomically (a temporary file of this process's beside it); returns
    the path. A ``path`` given is replaced (``os.replace``): the caller named it. The default
    (``default_summary_path``) never replaces another run's summary: two runs with one master
    seed finishing within the same second (two terminals, two CI jobs on one checkout) would
    have one name, so the later one links its file to the first free ``<name>-2.json``,
    ``<name>-3.json``..."""
    given = path is not None
    path = Path(path) if path is not None else default_summary_path(summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        if given:
            os.replace(tmp, path)
            return path
        base = path
        for n in itertools.count(2):
            try:
                os.link(tmp, path)  # atomic, and fails rather than replace a file
                return path
            except FileExistsError:
                path = base.with_name(f"{base.stem}-{n}{base.suffix}")
        raise AssertionError("unreachable: itertools.count never ends")
    finally:
        tmp.unlink(missing_ok=True)

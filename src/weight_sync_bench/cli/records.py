"""The ``--json`` records: one schema for every subcommand, the README's table of it.

``KEYS`` names every kind's keys and ``SUMMARY_KEYS`` every command's summary's (after
``command`` and ``exit_code``); ``Output.record`` refuses a record whose keys are not its
kind's, so a kind's keys are the same in every record of it, from every command (a key that
does not apply is ``null``). A record carries what its text says: a check's conventions,
degrees, dtype, diagnosis lines, named mutation and notes, the same through ``wsb check``
and ``wsb verify`` (``verdict_record``), a fuzz counterexample's (``counterexample_record``)
and a replayed entry's route (``replay_record``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weight_sync_bench.check.checker import Verdict

TALLY = ("property", "mutation", "examples", "identity", "failures", "killed", "min_ratio",
         "max_ratio", "min_at", "new_entries", "faults")
KEYS: dict[str, tuple[str, ...]] = {
    "check": ("config", "phase", "conventions", "src", "dst", "dtype", "mutation",
              "named_mutation", "max_abs_error", "threshold", "ratio", "forward", "passed",
              "first_mismatch", "mismatches", "diagnosis", "near_ties", "route_bound", "notes",
              "directory"),
    "property": TALLY,
    "mutant": TALLY,
    "counterexample": ("property", "case", "conventions", "src", "dst", "mutation",
                       "named_mutation", "deviation", "threshold", "ratio", "first_mismatch",
                       "diagnosis", "error", "message"),
    "harness_fault": ("property", "entry", "type", "rank", "how", "breadcrumb", "case",
                      "message"),
    "smallest": ("mutation", "case", "message"),
    "user_function": ("role", "function", "domain", "checked", "declined", "smallest_declined",
                      "first_failure_at"),
    "replay": ("entry", "property", "mutation", "phase", "conventions", "src", "dst",
               "deviation", "threshold", "ratio", "status", "claim_holds", "origin",
               "origin_note", "user", "note"),
    "bad_entry": ("entry", "field", "type", "message"),
    "train": ("config", "mesh", "packed", "phase", "passed", "comparisons"),
    "train_mutation": ("mutation", "case", "identity", "detected", "ratio", "quantity"),
    "sync": ("plan", "fn", "bytes_moved", "b_min", "ratio", "naive_bytes", "seconds", "t_min",
             "bandwidth", "sent_max_over_mean", "plan_seconds", "ranks", "elements_passed",
             "coverage", "into", "max_abs_error", "threshold", "passed"),
    "state": ("endpoint", "rank", "passed", "counts", "coverage", "outcomes"),
    "note": ("text",),
    "error": ("command", "exit_code", "type", "message"),
}
FUZZ_SUMMARY = ("examples", "failures", "harness_faults", "elapsed", "profile", "master_seed",
                "corpus", "new_entries", "stopped", "summary_file", "found")
SUMMARY_KEYS: dict[str, tuple[str, ...]] = {
    "check": ("checks", "ran", "passed", "failed", "interrupted", "skipped"),
    "verify": ("checks", "ran", "passed", "failed", "interrupted", "skipped"),
    "verify-state": ("checks", "ran", "passed", "failed", "interrupted", "skipped"),
    "fuzz": FUZZ_SUMMARY,
    "mutants": FUZZ_SUMMARY,
    "replay": ("replayed", "broken", "bad", "harness_faults", "phases", "statuses", "origins"),
    "train-check": ("checks", "passed", "failed", "phase", "steps", "seed", "cells", "ran",
                    "missed"),
    "sync": ("passed",),
}


def keys_of(kind: str, command: str) -> tuple[str, ...]:
    """The keys of a ``kind`` record (a summary's: of ``command``'s), ``kind`` not counted."""
    if kind == "summary":
        return ("command", "exit_code", *SUMMARY_KEYS[command])
    return KEYS[kind]


def _pair(conventions: tuple[str, str] | None) -> dict[str, str] | None:
    """A conversion's conventions, as a corpus entry's case names them (null for none)."""
    return None if conventions is None else {"src": conventions[0], "dst": conventions[1]}


def verdict_record(v: Verdict, *, directory: str | None = None) -> dict[str, Any]:
    """A ``check`` record: what ``str(v)`` says, field by field (``directory``: the
    checkpoint ``wsb verify`` read)."""
    return {"config": v.config, "phase": v.phase, "conventions": _pair(v.conventions),
            "src": v.src, "dst": v.dst, "dtype": v.dtype, "mutation": v.mutation,
            "named_mutation": v.named_mutation, "max_abs_error": v.max_abs_error,
            "threshold": v.threshold, "ratio": v.ratio,
            "forward": "own" if v.own_forward else "declared", "passed": v.passed,
            "first_mismatch": v.first_mismatch, "mismatches": list(v.mismatches),
            "diagnosis": list(v.diagnosis),
            "near_ties": list(v.near_ties) if v.near_ties is not None else None,
            "route_bound": v.route_bound, "notes": list(v.notes), "directory": directory}


def _conventions_of(outcome: Any) -> dict[str, str] | None:
    """A fuzzed case's conventions: a conversion case's, or the user's converter's."""
    case = outcome.case
    if hasattr(case, "src_convention"):
        return _pair((case.src_convention, case.dst_convention))
    function = getattr(outcome, "function", None)
    return _pair(function.conventions if function is not None else None)


def counterexample_record(failure: Any) -> dict[str, Any]:
    """A ``counterexample`` record (a ``runner.PropertyFailed``): the case, its route, and
    where the outcome has a verdict (a user's function's), its diagnosis and named mutation;
    ``error``: what the user's function raised or returned that is not shards."""
    outcome = failure.outcome
    verdict = getattr(outcome, "verdict", None)
    return {"property": failure.prop, "case": str(outcome.case),
            "conventions": _conventions_of(outcome), "src": outcome.case.src,
            "dst": outcome.case.dst, "mutation": outcome.case.mutation,
            "named_mutation": verdict.named_mutation if verdict is not None else None,
            "deviation": outcome.deviation, "threshold": outcome.threshold,
            "ratio": outcome.ratio,
            "first_mismatch": verdict.first_mismatch if verdict is not None else None,
            "diagnosis": list(verdict.diagnosis) if verdict is not None else None,
            "error": getattr(outcome, "error", None), "message": str(failure)}


def replay_record(r: Any) -> dict[str, Any]:
    """A ``replay`` record (a ``corpus.Replayed``), its route as the table prints it."""
    case = r.entry.case
    return {"entry": str(r.entry.path), "property": r.entry.prop, "mutation": case.mutation,
            "phase": case.phase, "conventions": _conventions_of(r.outcome), "src": case.src,
            "dst": case.dst, "deviation": r.outcome.deviation,
            "threshold": r.outcome.threshold, "ratio": r.outcome.ratio, "status": r.status,
            "claim_holds": r.claim_holds, "origin": r.entry.origin,
            "origin_note": r.entry.origin_note, "user": r.entry.user, "note": r.note}

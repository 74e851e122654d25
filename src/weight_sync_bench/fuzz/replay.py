"""Replay: each corpus entry re-measured and classified (``corpus.classify``: still failing,
fixed, environment changed, drifted), the harness's own through ``case.run_case``, a user
function's against that function (``replay_entry``). Reads only: nothing is deleted or
rewritten.

It sits above both the corpus (which reads and writes entries) and ``fuzz.user`` (which
runs a user's function on a case), so neither imports the other to replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from weight_sync_bench.check.checker import Forward, ThresholdRule
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.fuzz.case import ConversionCase, run_case
from weight_sync_bench.fuzz.corpus import Entry, Replayed, classify
from weight_sync_bench.fuzz.user import UserFunction, run_user_case


def replay(entries: Iterable[Entry], *, forward: Forward = inprocess_forward,
           threshold_rule: ThresholdRule | None = None,
           load: Callable[[str, str], Callable[..., Any]] | None = None) -> Iterator[Replayed]:
    """Re-measure each entry and classify it. Reads only: nothing is deleted or rewritten. A
    user function's entry is re-run against that function, imported by ``load(import path,
    role)`` (``check.user_code.load_function``; ``replay_entry``)."""
    for entry in entries:
        if entry.user:
            if load is None:
                raise InvalidConfig(f"{entry.path}: a user function's entry "
                                    f"({entry.user.get('function')}): replay needs load=")
            yield replay_entry(entry, load=load, forward=forward, threshold_rule=threshold_rule)
            continue
        outcome = run_case(entry.case, forward=forward, threshold_rule=threshold_rule)
        yield Replayed(entry, outcome, classify(entry, outcome))


def replay_entry(entry: Entry, *, load: Callable[[str, str], Callable[..., Any]],
                 forward: Forward = inprocess_forward,
                 threshold_rule: ThresholdRule | None = None) -> Replayed:
    """Re-run a user function's corpus entry against that function (``load(import path,
    role)`` imports it: ``check.user_code.load_function``), classified as the harness's
    entries are; the note says when its source file changed since the entry was written, or
    that the function now declines the case."""
    user, case = entry.data["user"], entry.case
    fn = load(user["function"], user["role"])
    ends = ((case.src_convention, case.dst_convention) if isinstance(case, ConversionCase)
            else (None, None))
    function = UserFunction(fn, user["role"], src=ends[0], dst=ends[1], name=user["function"])
    outcome = run_user_case(function, entry.case, forward=forward, threshold_rule=threshold_rule)
    notes = []
    path, digest = function.source()
    if user.get("source_sha256") and digest != user["source_sha256"]:
        notes.append(f"the source of {user['function']} ({path}) changed since the entry was "
                     f"written (sha256 {user['source_sha256'][:12]} -> {(digest or '?')[:12]})")
    if outcome.declined is not None:
        notes.append(f"{user['function']} now declines the case (Unsupported: "
                     f"{outcome.declined})")
        return Replayed(entry, outcome, "declined", note="; ".join(notes))
    return Replayed(entry, outcome, classify(entry, outcome), note="; ".join(notes) or None)

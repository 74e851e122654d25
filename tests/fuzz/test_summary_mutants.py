"""A fuzz campaign's summary, field by field (issue 30, the mutation pass over
``fuzz/summary.py``).

The summary is a pure function of the runner's ``FuzzReport`` (``fuzz.summary``'s module
doc lists its fields). Here the report is built by hand: tallies of every kind of property
(an invariant that held, one that failed on every example, a kill property with kills and an
identity example, one whose mutation changed nothing anywhere, MoE ones with near ties),
each count and ratio distinct, so a field read from the wrong tally attribute, a count off
by the identity examples, a ratio kept for a failing example, or a non-finite ratio written
as a number fails here. ``write_summary``: the bytes written, the names taken when the
default name is held (``-2``, ``-3``), and that no temporary file is left even when the
write fails. The campaign-level behaviour (a real run's tallies, ``wsb fuzz --summary``) is
``tests/fuzz/test_summary.py``'s.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import hypothesis
import pytest

from weight_sync_bench.fuzz import summary as S
from weight_sync_bench.fuzz.corpus import versions
from weight_sync_bench.fuzz.runner import (
    FuzzReport,
    HarnessFault,
    PropertyFailed,
    Tally,
)

ENV = {"commit": "c" * 40, "src_dirty": True, "ignored": "x"}


class Case:
    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def tally(prop, mutation=None, **fields):
    t = Tally(prop, mutation)
    for k, v in fields.items():
        setattr(t, k, v)
    return t


def tallies():
    held = tally("invariant", examples=9, identity=0, failures=2, killed=0, min_ratio=0.01,
                 max_ratio=3.5, min_at=Case("inv-min"), max_at=Case("inv-max"),
                 max_passing_ratio=0.75, max_passing_at=Case("inv-passing"),
                 new_entries=[Path("/c/e1.json"), Path("/c/e2.json")])
    kill = tally("kill", "kv_swapped", examples=7, identity=2, failures=1, killed=4,
                 min_ratio=4.5, min_at=Case("kill-min"), max_ratio=900.0,
                 min_kill_ratio=12.5, min_kill_at=Case("kill-min-kill"),
                 new_entries=[Path("/c/e3.json")])
    fault = HarnessFault("convert", Case("faulted"), SimpleNamespace(rank=3))
    convert = tally("convert", examples=3, max_passing_ratio=math.inf,
                    max_passing_at=Case("conv-inf"), max_ratio=math.nan, faults=[fault])
    moe = tally("moe_convert", examples=4, failures=1, max_passing_ratio=0.5,
                max_passing_at=Case("moe"), max_ratio=2.0, near_tie_examples=3,
                near_tie_choices=5, routed_choices=64, near_tie_failures=1)
    moe_kill = tally("moe_convert_kill", "router_bias", examples=6, identity=6,
                     near_tie_examples=1, near_tie_choices=2, routed_choices=16,
                     near_tie_failures=0)
    return [held, kill, convert, moe, moe_kill]


class Error(Exception):
    rank = 1


def failure(prop, t, case, deviation, threshold, ratio, entry):
    f = PropertyFailed(prop, SimpleNamespace(case=Case(case), deviation=deviation,
                                            threshold=threshold, ratio=ratio,
                                            describe=lambda: case))
    f.tally, f.entry = t, entry
    return f


def report(**kw):
    ts = tallies()
    failures = [failure("invariant", ts[0], "inv-fail", 0.25, 0.125, 2.0, Path("/c/e1.json")),
                failure("kill", ts[1], "kill-fail", math.inf, 0.5, math.inf, None),
                failure("orphan", None, "orph", 1.0, 2.0, 0.5, None)]
    faults = [HarnessFault("kill[kv_swapped]", Case("f1"), Error("x")),
              HarnessFault("convert", None, Error("y"))]
    fields = {"tallies": ts, "elapsed": 12.34567, "profile": "nightly", "master_seed": 77,
              "failures": failures, "faults": faults, "stopped": "deadline",
              "interrupted": KeyboardInterrupt(), "corpus": Path("/c")}
    return FuzzReport(**{**fields, **kw})


def test_every_property_field():
    props = S.build_summary(report(), env=ENV)["properties"]
    assert props[0] == {
        "property": "invariant", "mutation": None, "claim": "invariant", "examples": 9,
        "identity": 0, "live": 9, "failures": 2, "killed": 0,
        "new_entries": ["e1.json", "e2.json"], "harness_faults": 0, "worst_ratio": 0.75,
        "worst_at": "inv-passing", "max_ratio": 3.5}
    assert props[1] == {
        "property": "kill", "mutation": "kv_swapped", "claim": "kill", "examples": 7,
        "identity": 2, "live": 5, "failures": 1, "killed": 4, "new_entries": ["e3.json"],
        "harness_faults": 0, "smallest_kill_ratio": 12.5, "smallest_kill_at": "kill-min-kill",
        "smallest_ratio": 4.5, "smallest_at": "kill-min"}
    assert props[2] == {
        "property": "convert", "mutation": None, "claim": "invariant", "examples": 3,
        "identity": 0, "live": 3, "failures": 0, "killed": 0, "new_entries": [],
        "harness_faults": 1, "worst_ratio": "inf", "worst_at": "conv-inf",
        "max_ratio": "nan"}
    assert props[3]["claim"] == "invariant" and props[3]["near_ties"] == {
        "examples": 3, "choices": 5, "of_choices": 64, "failed": 1}
    assert props[4] == {
        "property": "moe_convert_kill", "mutation": "router_bias", "claim": "kill",
        "examples": 6, "identity": 6, "live": 0, "failures": 0, "killed": 0,
        "new_entries": [], "harness_faults": 0, "smallest_kill_ratio": None,
        "smallest_kill_at": None, "smallest_ratio": None, "smallest_at": None,
        "near_ties": {"examples": 1, "choices": 2, "of_choices": 16, "failed": 0}}


def test_an_invariant_failing_on_every_example_has_no_worst_passing_ratio():
    failed = tally("invariant", examples=2, failures=2, max_ratio=5.0, max_at=Case("m"),
                   max_passing_ratio=0.0)
    empty = tally("convert")
    (a, b) = S.build_summary(report(tallies=[failed, empty], failures=[], faults=[]),
                             env=ENV)["properties"]
    assert (a["worst_ratio"], a["worst_at"], a["max_ratio"]) == (None, None, 5.0)
    assert (b["worst_ratio"], b["worst_at"], b["max_ratio"]) == (None, None, None)
    assert "near_ties" not in a and "near_ties" not in b


def test_a_property_whose_only_live_example_was_not_killed():
    t = tally("kill", "m", examples=3, identity=2, min_ratio=0.5, min_at=Case("slipped"),
              min_kill_ratio=math.inf, min_kill_at=None)
    (p,) = S.build_summary(report(tallies=[t], failures=[], faults=[]), env=ENV)["properties"]
    assert (p["smallest_kill_ratio"], p["smallest_kill_at"]) == (None, None)
    assert (p["smallest_ratio"], p["smallest_at"], p["live"]) == (0.5, "slipped", 1)


def test_an_infinite_smallest_kill_ratio_is_written_as_a_string():
    t = tally("kill", "m", examples=1, min_ratio=math.inf, min_kill_ratio=math.inf,
              min_kill_at=Case("k"), min_at=Case("k"))
    s = S.build_summary(report(tallies=[t], failures=[], faults=[]), env=ENV)
    assert s["properties"][0]["smallest_kill_ratio"] == "inf"
    assert s["properties"][0]["smallest_ratio"] == "inf"
    assert s["smallest_kill_ratios"] == {"m": "inf"}


def test_the_campaign_totals_failures_and_faults():
    s = S.build_summary(report(), phase="1b", command="mutants", budget={"minutes": 3},
                        env=ENV)
    assert list(s) == ["schema", "kind", "command", "date", "campaign", "totals",
                       "worst_invariant_ratio", "worst_invariant_property",
                       "smallest_kill_ratios", "near_ties", "properties", "failures",
                       "harness_faults", "environment"]
    assert (s["schema"], s["kind"], s["command"]) == (
        1, "weight-sync-bench fuzz campaign summary", "mutants")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s["date"])
    assert s["campaign"] == {
        "profile": "nightly", "phase": "1b", "budget": {"minutes": 3}, "master_seed": 77,
        "hypothesis_seeds": "random.Random(master_seed).getrandbits(32), one per property "
                            "per round",
        "duration_s": 12.346, "stopped": "deadline", "interrupted": "KeyboardInterrupt",
        "corpus": "/c"}
    assert s["totals"] == {"examples": 29, "properties": 5, "failures": 3,
                           "harness_faults": 2,
                           "new_entries": ["e1.json", "e2.json", "e3.json"]}
    # the worst over the invariants that held somewhere: "inf" (convert) beats 0.75 and 0.5
    assert (s["worst_invariant_ratio"], s["worst_invariant_property"]) == ("inf", "convert")
    assert s["smallest_kill_ratios"] == {"kv_swapped": 12.5, "router_bias": None}
    assert s["near_ties"] == {"examples": 4, "choices": 7, "of_choices": 80, "failed": 1}
    assert s["failures"] == [
        {"property": "invariant", "label": "invariant", "case": "inv-fail",
         "deviation": 0.25, "threshold": 0.125, "ratio": 2.0, "corpus_entries": ["e1.json"]},
        {"property": "kill", "label": "kill[kv_swapped]", "case": "kill-fail",
         "deviation": "inf", "threshold": 0.5, "ratio": "inf", "corpus_entries": []},
        {"property": "orphan", "label": "orphan", "case": "orph", "deviation": 1.0,
         "threshold": 2.0, "ratio": 0.5, "corpus_entries": []}]
    assert s["harness_faults"] == [
        {"property": "kill[kv_swapped]", "type": "Error", "rank": 1, "how": "raised",
         "case": "f1"},
        {"property": "convert", "type": "Error", "rank": 1, "how": "raised", "case": None}]
    assert s["environment"] == {"commit": "c" * 40, "src_dirty": True,
                                **versions(hypothesis.__version__)}
    assert json.loads(json.dumps(s, allow_nan=False)) == s


def test_a_plain_campaign_has_its_defaults():
    t = tally("invariant", examples=2, max_passing_ratio=0.125, max_passing_at=Case("w"),
              max_ratio=0.125)
    s = S.build_summary(FuzzReport([t], 0.0004, "wsb-test", 5, []), env=ENV)
    assert s["command"] == "fuzz"
    assert s["campaign"]["phase"] is None and s["campaign"]["budget"] == {}
    assert (s["campaign"]["duration_s"], s["campaign"]["stopped"],
            s["campaign"]["interrupted"], s["campaign"]["corpus"]) == (0.0, None, None, None)
    assert s["near_ties"] is None and s["smallest_kill_ratios"] == {}
    assert (s["worst_invariant_ratio"], s["worst_invariant_property"]) == (0.125, "invariant")
    assert s["failures"] == [] and s["harness_faults"] == []


def test_the_worst_invariant_is_the_largest_finite_one_and_none_without_one():
    a = tally("invariant", examples=1, max_passing_ratio=0.25, max_passing_at=Case("a"))
    b = tally("convert", examples=1, max_passing_ratio=0.5, max_passing_at=Case("b"))
    c = tally("moe_convert", examples=1, max_passing_ratio=0.375, max_passing_at=Case("c"))
    s = S.build_summary(FuzzReport([a, b, c], 1.0, "p", 1, []), env=ENV)
    assert (s["worst_invariant_ratio"], s["worst_invariant_property"]) == (0.5, "convert")
    k = tally("kill", "m", examples=1)
    s = S.build_summary(FuzzReport([k], 1.0, "p", 1, []), env=ENV)
    assert (s["worst_invariant_ratio"], s["worst_invariant_property"]) == (None, None)


def test_the_environment_is_asked_of_git_when_not_given(monkeypatch):
    monkeypatch.setattr(S, "environment", lambda: {"commit": "g", "src_dirty": False})
    s = S.build_summary(FuzzReport([], 1.0, "p", 1, []))
    assert (s["environment"]["commit"], s["environment"]["src_dirty"]) == ("g", False)


def test_the_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("WSB_FUZZ_DIR", str(tmp_path))
    summary = {"date": "2026-12-05T04:05:06Z", "command": "mutants",
               "campaign": {"master_seed": 42}}
    assert S.default_summary_path(summary) == (
        tmp_path / "summaries" / "mutants-20261205T040506Z-seed42.json")


def test_a_held_default_name_takes_the_next_free_number(monkeypatch, tmp_path):
    monkeypatch.setenv("WSB_FUZZ_DIR", str(tmp_path))
    summary = {"date": "2026-12-05T04:05:06Z", "command": "fuzz",
               "campaign": {"master_seed": 1}, "n": 1}
    first = S.write_summary(summary)
    assert first.read_text() == json.dumps(summary, indent=2) + "\n"
    second = S.write_summary({**summary, "n": 2})
    third = S.write_summary({**summary, "n": 3})
    assert (second.name, third.name) == ("fuzz-20261205T040506Z-seed1-2.json",
                                         "fuzz-20261205T040506Z-seed1-3.json")
    assert [json.loads(p.read_text())["n"] for p in (first, second, third)] == [1, 2, 3]
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(
        p.name for p in (first, second, third))


def test_a_given_path_is_replaced_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    given = tmp_path / "a" / "b" / "s.json"
    assert S.write_summary({"n": 1}, given) == given
    assert S.write_summary({"n": 2}, given) == given
    assert given.read_text() == '{\n  "n": 2\n}\n'
    assert [p.name for p in given.parent.iterdir()] == ["s.json"]

    def refused(src, dst):
        raise PermissionError("no")
    monkeypatch.setattr(S.os, "replace", refused)
    with pytest.raises(PermissionError):
        S.write_summary({"n": 3}, given)
    assert [p.name for p in given.parent.iterdir()] == ["s.json"]
    assert json.loads(given.read_text()) == {"n": 2}


def test_a_property_the_claims_do_not_name_is_its_own_claim():
    t = tally("custom", "m", examples=1, min_ratio=20.0, min_at=Case("c"), killed=1,
              min_kill_ratio=20.0, min_kill_at=Case("c"))
    (p,) = S.build_summary(FuzzReport([t], 1.0, "p", 1, []), env=ENV)["properties"]
    assert p["claim"] == "custom" and p["smallest_kill_ratio"] == 20.0


def test_the_date_is_utc_whatever_the_local_zone(monkeypatch):
    import time
    from datetime import UTC, datetime

    monkeypatch.setenv("TZ", "XST-9")  # nine hours east of UTC
    time.tzset()
    try:
        s = S.build_summary(FuzzReport([], 1.0, "p", 1, []), env=ENV)
        now = datetime.now(UTC).replace(tzinfo=None)
    finally:
        monkeypatch.undo()
        time.tzset()
    stamped = datetime.strptime(s["date"], "%Y-%m-%dT%H:%M:%SZ")
    assert abs((now - stamped).total_seconds()) < 60

"""The figures ``wsb floor`` prints side by side when a measurement replaces an artifact
(issue 30, the mutation pass over ``cli/floor_report.py``'s ``figures`` and ``compared``; its
tables are pinned elsewhere): per kind, the sample and the thresholds or rule it implies,
re-derived from the record (a floor's threshold is the smallest power of ten at or above
100x its worst, ``tolerance.rules.derive_threshold``), every figure under the same name in
both columns, a figure one side lacks shown as ``-``, an unreadable artifact one row naming
why. Pure functions of small literal artifacts: milliseconds.
"""

from __future__ import annotations

import json

import pytest

from weight_sync_bench.cli import floor_report as report
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.training import QUANTITIES

VALIDATED = {"false_positives": 0, "min_headroom": 123.4, "min_route_headroom": 56.6,
             "min_kill_ratio": 1234.5678, "min_drawn_kill_ratio": 0.0123456}


class Rule:
    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


@pytest.fixture
def rule(monkeypatch):
    """``rule_from`` stood in: the rule's text is the test's."""
    texts = []

    def rule_from(artifact):
        texts.append(artifact["id"])
        return Rule(artifact["rule text"])
    monkeypatch.setattr(report, "rule_from", rule_from)
    return texts


def sampled(**fields):
    return {"id": "a", "geometries": 500, "searched": 25, "search_examples": 10000,
            "samples": [{}] * 7, "chosen": "relative", "validated": VALIDATED, **fields}


def test_the_random_floor_by_its_sample_and_the_rule_it_chooses(rule):
    artifact = sampled(**{"rule text": "relative: 3.2e-05 x max|reference logit|"})
    assert report.figures("random", artifact) == [
        ("geometries", "500 (+25 searched of 10000)"), ("samples", "7"),
        ("rule", "3.2e-05 x max|reference logit| (relative)")]
    assert rule == ["a"]
    # the rule's name cut once, at its first ": "
    assert report.figures("random", sampled(**{"rule text": "r: a: b"}))[-1] == (
        "rule", "a: b (relative)")
    assert report.figures("random", sampled(**{"rule text": "no name"}))[-1] == (
        "rule", "no name (relative)")


def test_a_sampled_artifact_without_its_counts_shows_what_it_lacks(rule):
    assert report.figures("random", {"id": "b", "rule text": "x: 1"}) == [
        ("geometries", "? (+0 searched of 0)"), ("samples", "0"), ("rule", "1 (None)")]


def test_the_committed_random_floor_by_the_rule_its_samples_choose():
    """The rule re-derived from the samples (``sampled.rule_from``) is the one the artifact
    records as chosen: ``relative``, 0.00062 x max|reference logit|, in ``rules``."""
    artifact = json.loads(artifact_path("1a", kind="random_floor").read_text())
    chosen = next(r for r in artifact["rules"] if r["rule"] == artifact["chosen"])
    assert (chosen["kind"], chosen["value"]) == ("relative", 0.00062)
    assert report.figures("random", artifact) == [
        ("geometries", "500 (+25 searched of 10000)"),
        ("samples", str(len(artifact["samples"]))),
        ("rule", f"{chosen['value']:.2g} x max|reference logit| (relative)")]


def test_a_replicated_kv_validation_by_its_false_positives_and_headroom():
    assert report.figures("replicated-kv", sampled()) == [
        ("geometries", "500 (+25 searched of 10000)"), ("samples", "7"),
        ("false positives", "0"), ("min headroom", "123x")]


def test_an_moe_validation_adds_the_routes_headroom_and_the_kill_ratios():
    assert report.figures("moe", sampled(searched=0, search_examples=0)) == [
        ("geometries", "500 (+0 searched of 0)"), ("samples", "7"),
        ("false positives", "0"), ("min headroom", "123x"), ("route headroom", "57x"),
        ("min kill ratio", "1.23e+03x"), ("min kill ratio, drawn for it", "0.0123x")]


@pytest.mark.parametrize("kind", ["phase", "geometry"])
def test_a_phase_floor_by_its_cells_worst_error_and_threshold(kind):
    artifact = {"repetitions": 3, "cells": [{}] * 5, "worst_abs": 2.345678e-6}
    assert report.figures(kind, artifact) == [
        ("repetitions", "3"), ("cells", "5"), ("worst |error|", "2.346e-06"),
        ("threshold", "0.001")]  # 100 x 2.3e-6 = 2.3e-4: the next power of ten
    assert report.figures(kind, {"cells": [], "worst_abs": 1e-5})[:1] == [("repetitions", "?")]


def training(worst):
    return {q: {"worst": worst} for q in QUANTITIES}


@pytest.mark.parametrize("kind", ["training", "sequence"])
def test_a_training_floor_by_its_thresholds_per_regime_and_quantity(kind):
    artifact = {"repetitions": 2, "steps": 3, "cells": [{}] * 4,
                "regimes": {"plain": training(3e-7), "cancelling": training(2e-4)}}
    assert report.figures(kind, artifact) == [
        ("repetitions", "2"), ("steps", "3"), ("cells", "4"),
        *[(f"plain {q}", "0.0001") for q in QUANTITIES],
        *[(f"cancelling {q}", "0.1") for q in QUANTITIES]]
    only = {"cells": [], "regimes": {"cancelling": training(1e-9)}}
    assert report.figures(kind, only) == [
        ("repetitions", "?"), ("steps", "?"), ("cells", "0"),
        *[(f"cancelling {q}", "1e-07") for q in QUANTITIES]]


@pytest.mark.parametrize(("kind", "artifact", "why"), [
    ("training", {"cells": []}, "KeyError: 'regimes'"),
    ("phase", {"cells": 3, "worst_abs": 1.0}, "TypeError: object of type 'int' has no len()"),
    ("moe", {"samples": []}, "KeyError: 'validated'"),
    ("phase", {"cells": [], "worst_abs": 0.0},
     "ToleranceMismatch: worst observation is 0: a floor of exactly zero admits no "),
])
def test_an_unreadable_artifact_is_one_row_naming_why(kind, artifact, why):
    ((name, text),) = report.figures(kind, artifact)
    assert name == "unreadable" and text.startswith(why)


def test_compared_puts_each_figure_of_both_side_by_side_new_figures_first():
    old = {"repetitions": 1, "cells": [{}] * 2, "worst_abs": 1e-7}
    new = {"repetitions": 2, "cells": [{}] * 3, "worst_abs": 1e-6}
    assert report.compared("phase", old, new) == [
        ("repetitions", "1", "2"), ("cells", "2", "3"), ("worst |error|", "1e-07", "1e-06"),
        ("threshold", "1e-05", "0.0001")]
    unreadable = report.figures("phase", {})[0][1]
    assert report.compared("phase", {}, new) == [
        ("repetitions", "-", "2"), ("cells", "-", "3"), ("worst |error|", "-", "1e-06"),
        ("threshold", "-", "0.0001"), ("unreadable", unreadable, "-")]
    assert report.compared("phase", new, {}) == [
        ("unreadable", "-", unreadable), ("repetitions", "2", "-"), ("cells", "3", "-"),
        ("worst |error|", "1e-06", "-"), ("threshold", "0.0001", "-")]


def test_compared_reads_both_with_the_kind_given():
    old = {"repetitions": 1, "steps": 2, "cells": [], "regimes": {"plain": training(1e-9)}}
    rows = report.compared("sequence", old, {**old, "steps": 5})
    assert rows[:3] == [("repetitions", "1", "1"), ("steps", "2", "5"), ("cells", "0", "0")]
    assert rows[3] == ("plain loss", "1e-07", "1e-07") and len(rows) == 3 + len(QUANTITIES)
    assert report.compared("moe", sampled(), sampled(samples=[]))[1] == ("samples", "7", "0")

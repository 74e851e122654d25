"""The fuzz campaign summary (``fuzz.summary``): its numbers are the runner's tallies, a
failing campaign lists its failure and corpus entry, the file is written atomically, and
``wsb fuzz`` writes it to ``--summary`` or under ``WSB_FUZZ_DIR``, never into the checkout."""

import argparse
import json
import math

from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.cli.fuzz import register
from weight_sync_bench.fuzz.runner import fuzz
from weight_sync_bench.fuzz.summary import build_summary, write_summary
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.paths import checkout

ENV = {"commit": "0" * 40, "src_dirty": False}  # no git call: the tests say where it ran


def _report(**kwargs):
    *_, report = fuzz(master_seed=11, **kwargs)
    return report


def test_the_summary_numbers_are_the_tallies():
    report = _report(examples=5, chunk=5, mutations=["kv_swapped", "lm_head_reversed"])
    summary = build_summary(report, phase="1a", budget={"examples": 5}, env=ENV)
    by_label = {t.label: t for t in report.tallies}
    props = {(p["property"] if p["mutation"] is None else f"{p['property']}[{p['mutation']}]"): p
             for p in summary["properties"]}
    assert set(props) == set(by_label)
    for label, t in by_label.items():
        p = props[label]
        assert (p["examples"], p["identity"], p["failures"], p["killed"]) == (
            t.examples, t.identity, t.failures, t.killed)
    inv = by_label["invariant"]
    assert summary["worst_invariant_ratio"] == inv.max_passing_ratio == inv.max_ratio
    assert 0 < summary["worst_invariant_ratio"] <= 1.0
    assert props["invariant"]["worst_at"] == str(inv.max_passing_at)
    for m in ("kv_swapped", "lm_head_reversed"):
        t = by_label[f"kill[{m}]"]
        assert summary["smallest_kill_ratios"][m] == t.min_kill_ratio >= 10
        assert props[f"kill[{m}]"]["smallest_ratio"] == t.min_ratio
    assert summary["totals"]["examples"] == report.examples == sum(
        t.examples for t in by_label.values())
    assert report.examples >= 15  # the budget, plus the corpus entries run as explicit examples
    assert summary["failures"] == [] and summary["totals"]["failures"] == 0
    campaign = summary["campaign"]
    assert (campaign["master_seed"], campaign["profile"], campaign["phase"]) == (11, "wsb-test",
                                                                                 "1a")
    assert campaign["duration_s"] == round(report.elapsed, 3)
    env = summary["environment"]
    assert env["commit"] == "0" * 40 and env["src_dirty"] is False and env["torch"]
    assert json.loads(json.dumps(summary)) == summary  # plain JSON throughout


def _mutated_forward(name):
    """The correct forward of shards with mutation ``name`` applied: the invariant over it
    is the invariant of a harness with that bug (the runner cannot tell them apart)."""
    mutation = MUTATIONS[name]

    def forward(config, shards, tokens):
        return inprocess_forward(config, mutation.apply(shards, layout_for(config), config),
                                 tokens)
    return forward


def test_a_failing_campaign_lists_its_failure_and_corpus_entry(tmp_path):
    report = _report(examples=3, chunk=3, mutations=[], forward=_mutated_forward("kv_swapped"),
                     corpus_path=tmp_path)
    summary = build_summary(report, phase="1a", env=ENV)
    (failure,) = summary["failures"]
    (entry,) = tmp_path.glob("*.json")
    assert failure["property"] == "invariant" and failure["corpus_entries"] == [entry.name]
    assert failure["ratio"] > 1 and failure["case"] == str(report.failures[0].outcome.case)
    (inv,) = summary["properties"]
    assert inv["failures"] == 1 and inv["new_entries"] == [entry.name]
    # the worst ratio is over the examples the invariant held on, never the failing one
    assert inv["worst_ratio"] is None or inv["worst_ratio"] <= 1.0
    assert inv["max_ratio"] > 1.0


def test_twin_the_same_campaign_with_the_correct_forward_lists_no_failure(tmp_path):
    report = _report(examples=3, chunk=3, mutations=[], forward=inprocess_forward,
                     corpus_path=tmp_path)
    summary = build_summary(report, phase="1a", env=ENV)
    assert summary["failures"] == [] and list(tmp_path.iterdir()) == []
    assert summary["worst_invariant_ratio"] <= 1.0


def test_non_finite_ratios_are_strings_and_the_write_is_atomic(tmp_path):
    report = _report(examples=2, chunk=2, mutations=["kv_swapped"])
    report.tallies[1].min_kill_ratio = math.inf
    summary = build_summary(report, env=ENV)
    assert summary["smallest_kill_ratios"]["kv_swapped"] == "inf"
    path = write_summary(summary, tmp_path / "deep" / "s.json")
    assert json.loads(path.read_text()) == summary
    assert [p.name for p in path.parent.iterdir()] == ["s.json"]  # no temporary file left


def _wsb(*argv):
    parser = argparse.ArgumentParser(prog="wsb")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_wsb_fuzz_writes_the_summary_where_told_and_by_default_under_the_fuzz_dir(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path / "corpus"))
    target = tmp_path / "out" / "summary.json"
    assert _wsb("fuzz", "--examples", "2", "--chunk", "2", "--seed", "3",
                "--mutation", "kv_swapped", "--summary", str(target)) == 0
    data = json.loads(target.read_text())
    assert data["campaign"]["master_seed"] == 3 and data["command"] == "fuzz"
    assert f"campaign summary: {target}" in capsys.readouterr().out

    monkeypatch.setenv("WSB_FUZZ_DIR", str(tmp_path / "fuzzdir"))
    assert _wsb("mutants", "--examples", "2", "--chunk", "2", "--seed", "4",
                "--mutation", "kv_swapped") == 0
    (written,) = (tmp_path / "fuzzdir" / "summaries").glob("mutants-*-seed4.json")
    assert json.loads(written.read_text())["smallest_kill_ratios"]["kv_swapped"] >= 10
    root = checkout()
    assert root is None or root not in written.resolve().parents


def test_two_runs_with_one_default_summary_name_keep_both_and_a_given_path_is_replaced(
        tmp_path, monkeypatch):
    """Two runs with one master seed finishing in the same second have one default name: the
    second takes ``-2`` instead of replacing the first; a path the caller names is replaced."""
    monkeypatch.setenv("WSB_FUZZ_DIR", str(tmp_path))
    summary = build_summary(_report(examples=1, chunk=1, mutations=[]), env=ENV)
    first = write_summary(summary)
    other = {**summary, "totals": {**summary["totals"], "examples": -1}}  # another run's
    second = write_summary(other)
    assert second == first.with_name(f"{first.stem}-2.json")
    assert json.loads(first.read_text()) == summary and json.loads(second.read_text()) == other
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, second.name])
    given = tmp_path / "given.json"
    write_summary(summary, given)
    assert write_summary(other, given) == given and json.loads(given.read_text()) == other

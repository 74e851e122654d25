"""Corpus provenance: every entry says whether it is a planted mutation found at its smallest
geometry (``seeded``) or a failure nobody planted (``discovered``); the runner records it
when it writes an entry, replay reports the two apart, and an entry older than the field
still replays, counted by the same rule with a note."""

import argparse
import json

import pytest

from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.cli.fuzz import register
from weight_sync_bench.errors import CorruptCorpusEntry
from weight_sync_bench.fuzz.corpus import (
    ORIGINS,
    entry_paths,
    load_entry,
    origin_of,
)
from weight_sync_bench.fuzz.replay import replay
from weight_sync_bench.fuzz.runner import PropertyFailed, find_smallest, run_property
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.paths import checkout

COMMITTED = sorted((checkout() / "corpus").glob("*.json")) if checkout() else []


@pytest.mark.skipif(not COMMITTED, reason="no checkout: the committed corpus is not here")
def test_every_committed_entry_records_its_origin_and_the_rule_agrees():
    for path in COMMITTED:
        data = json.loads(path.read_text())
        assert data.get("origin") in ORIGINS, path.name
        entry = load_entry(path)
        assert entry.origin == data["origin"] == origin_of(entry.prop, entry.case), path.name
        assert entry.origin_note is None


def _mutated_forward(name):
    mutation = MUTATIONS[name]

    def forward(config, shards, tokens):
        return inprocess_forward(config, mutation.apply(shards, layout_for(config), config),
                                 tokens)
    return forward


def test_a_real_failure_is_written_as_discovered(tmp_path):
    """The invariant failing on unmutated cases (here: a harness whose forward has the
    kv_swapped bug built in, which the runner cannot tell from a real bug) is a discovery."""
    with pytest.raises(PropertyFailed) as err:
        run_property("invariant", None, forward=_mutated_forward("kv_swapped"), corpus=False,
                     corpus_path=tmp_path, max_examples=5)
    (path,) = tmp_path.glob("*.json")
    assert err.value.entry == path
    assert json.loads(path.read_text())["origin"] == "discovered"
    assert load_entry(path).origin == "discovered"


def test_twin_a_planted_mutation_found_at_its_smallest_geometry_is_seeded(tmp_path):
    failure = find_smallest("kv_swapped", corpus_path=tmp_path)
    (path,) = tmp_path.glob("*.json")
    assert failure.entry == path and json.loads(path.read_text())["origin"] == "seeded"


def test_a_mutation_slipping_under_the_margin_is_discovered(tmp_path):
    with pytest.raises(PropertyFailed):
        run_property("kill", "replica_scaled", corpus=False, corpus_path=tmp_path,
                     threshold_rule=lambda config, ref: 0.01 * float(ref.abs().max()))
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["origin"] == "discovered"


def _legacy(tmp_path, name="legacy.json"):
    """A committed entry as it was before origins were recorded (the field removed)."""
    data = json.loads(entry_paths()[0].read_text())
    data.pop("origin", None)
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=2))
    return path


def test_an_entry_without_the_field_replays_counted_as_seeded_with_a_note(tmp_path):
    entry = load_entry(_legacy(tmp_path))
    assert entry.origin == "seeded"
    assert "no 'origin' field" in entry.origin_note and "counted as seeded" in entry.origin_note
    (result,) = replay([entry])
    assert result.claim_holds


def test_an_origin_outside_the_known_ones_names_the_file_and_field(tmp_path):
    path = _legacy(tmp_path)
    data = json.loads(path.read_text()) | {"origin": "found it"}
    path.write_text(json.dumps(data))
    with pytest.raises(CorruptCorpusEntry, match=r"field 'origin' is 'found it'") as err:
        load_entry(path)
    assert err.value.field == "origin"


def _wsb(*argv):
    parser = argparse.ArgumentParser(prog="wsb")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_wsb_replay_reports_seeded_and_discovered_apart(tmp_path, capsys):
    legacy = _legacy(tmp_path)
    with pytest.raises(PropertyFailed):
        run_property("invariant", None, forward=_mutated_forward("kv_swapped"), corpus=False,
                     corpus_path=tmp_path, max_examples=5)
    # the discovered entry replays against the correct code: fixed, its claim holds
    assert _wsb("replay", str(tmp_path), "--json") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_entry = {r["entry"]: r for r in records if r["kind"] == "replay"}
    assert by_entry[str(legacy)]["origin"] == "seeded"
    assert "counted as seeded" in by_entry[str(legacy)]["origin_note"]
    (found,) = [r for e, r in by_entry.items() if e != str(legacy)]
    assert found["origin"] == "discovered" and found["status"] == "fixed"
    (summary,) = [r for r in records if r["kind"] == "summary"]
    assert summary["origins"] == {"discovered": 1, "seeded": 1}

    assert _wsb("replay", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.index("discovered (1 entry") < out.index("seeded (1 entry")
    assert "discovered: 1 (claim holds on 1); seeded: 1 (claim holds on 1)" in out
    assert f"note, {legacy.name}: no 'origin' field" in out

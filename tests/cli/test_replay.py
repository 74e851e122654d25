"""Replay is bounded and complete: a geometry too large to replay is refused before anything
is allocated, naming the field and the estimate; one bad file never blocks the good ones
(each reported with its file and field; exit 2, or 1 when a claim is broken); bare ``wsb
replay`` over a corpus holding both phases replays each phase."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from weight_sync_bench.cli import main
from weight_sync_bench.errors import CorpusEntryTooLarge
from weight_sync_bench.fuzz.corpus import ReplayLimits, entry_paths, load_entry, scan_corpus
from weight_sync_bench.model.footprint import footprint
from weight_sync_bench.fuzz.domain import DOMAIN
from weight_sync_bench.tolerance.artifacts import environment

# the layout entries (a conversion entry is phase 1a only, so it cannot stand in for the
# phase-1b edits below)
COMMITTED = [p for p in entry_paths() if "conventions" not in json.loads(p.read_text())["case"]]
ROOT = Path(__file__).resolve().parents[2]


def _edited(path: Path, target: Path, **geometry: int) -> Path:
    data = json.loads(path.read_text())
    data["case"]["geometry"].update(geometry)
    target.write_text(json.dumps(data))
    return target


@pytest.mark.parametrize(("field", "value"), [("d_model", 10**9), ("n_layers", 10**6),
                                              ("seq_len", 10**6)])
def test_a_geometry_too_large_is_refused_before_allocating_naming_field_and_estimate(
        tmp_path, field, value):
    path = _edited(COMMITTED[0], tmp_path / "huge.json", **{field: value})
    start = time.monotonic()
    with pytest.raises(CorpusEntryTooLarge) as caught:
        load_entry(path)
    # nothing built: no tensor, no loop over layers (milliseconds when idle; building any
    # of these would take minutes or exhaust memory, so 5 s only detects that)
    assert time.monotonic() - start < 5.0
    error = caught.value
    assert error.field == f"case.geometry.{field}" and error.path == str(path)
    assert str(error).startswith(f"{path}: field 'case.geometry.{field}' is {value}: replaying "
                                 "this entry would need about ")
    assert "refused before allocating anything" in str(error) and error.estimate > 2**31


def test_the_limit_is_a_limit_not_a_refusal_of_everything():
    """The twin: every committed entry, and the fuzz domain's largest geometry, fit with
    room; a limit raised above an entry's estimate lets it through."""
    assert all(load_entry(p) for p in COMMITTED)
    assert footprint(DOMAIN.largest()).bytes < ReplayLimits().max_bytes / 100
    tiny = ReplayLimits(max_bytes=1000)
    with pytest.raises(CorpusEntryTooLarge, match=r"field 'case\.geometry' is inside the fuzz "
                                                  r"domain: .* \(limit 9\.31e-07 GiB; raise it "
                                                  r"with --max-gib\)"):
        load_entry(COMMITTED[0], tiny)
    cost = footprint(load_entry(COMMITTED[0]).case.config)
    assert load_entry(COMMITTED[0], ReplayLimits(max_bytes=cost.bytes, max_flops=cost.flops))


def test_one_bad_file_does_not_block_the_good_ones_and_the_exit_code_says_so(tmp_path, capsys):
    good = shutil.copy(COMMITTED[0], tmp_path / "good.json")
    (tmp_path / "broken.json").write_text("{not json")
    _edited(COMMITTED[1], tmp_path / "huge.json", d_model=10**9)
    scan = scan_corpus([tmp_path])
    assert [e.path for e in scan.entries] == [Path(good)]
    assert [(Path(b.path).name, b.field) for b in scan.bad] == [
        ("broken.json", None), ("huge.json", "case.geometry.d_model")]
    code = main(["replay", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 2
    assert "good.json" in out and "claim holds on 1/1; 2 bad entries" in out
    assert f"BAD ENTRY {tmp_path / 'broken.json'} (field -): " in out
    assert f"BAD ENTRY {tmp_path / 'huge.json'} (field case.geometry.d_model): " in out
    assert main(["replay", str(good)]) == 0  # the twin: the good one alone passes
    capsys.readouterr()


def test_a_broken_claim_exits_1_even_beside_a_bad_file(tmp_path, monkeypatch, capsys):
    """A floor sample set whose rule admits deviations of 100 makes every mutation
    'undetected': the kill claims break, which is a counterexample (1), not bad input (2)."""
    tolerance = tmp_path / "tolerance"
    shutil.copytree(ROOT / "tolerance", tolerance)
    geometry = DOMAIN.smallest().geometry()
    samples = [{"geometry": geometry, "seed": s, "degree": 2, "scale": 1.0, "floor": 1.0,
                "kills": {}} for s in range(8)]
    (tolerance / "random_floor_1a.json").write_text(json.dumps({
        "schema": 1, "phase": "1a", "domain": DOMAIN.to_json(), "samples": samples,
        "chosen": "absolute_pow10", "environment": environment()}))
    monkeypatch.setenv("WSB_TOLERANCE_DIR", str(tolerance))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(COMMITTED[0], corpus)
    (corpus / "broken.json").write_text("[]")
    assert main(["replay", str(corpus), "--json"]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in records] == ["bad_entry", "replay", "summary"]
    assert records[1]["claim_holds"] is False and records[1]["ratio"] < 10
    assert records[2]["exit_code"] == 1 and records[2]["bad"] == 1


def test_bare_replay_over_both_phases_replays_each_through_its_forward(tmp_path, monkeypatch,
                                                                      capsys):
    shutil.copy(COMMITTED[0], tmp_path)
    data = json.loads(COMMITTED[1].read_text())
    data["case"]["phase"] = "1b"
    (tmp_path / "one_b.json").write_text(json.dumps(data))
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert main(["replay", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    replayed = [r for r in records if r["kind"] == "replay"]
    assert sorted(r["phase"] for r in replayed) == ["1a", "1b"]
    assert all(r["claim_holds"] for r in replayed)
    assert records[-1]["phases"] == ["1a", "1b"] and records[-1]["exit_code"] == 0


def test_an_empty_corpus_checks_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert main(["replay"]) == 2
    assert "no corpus entries to replay: nothing was checked" in capsys.readouterr().out


def test_a_replayed_conversion_entry_names_its_conventions_in_json_as_its_row_does(
        tmp_path, capsys):
    (path,) = [p for p in entry_paths() if "conventions" in json.loads(p.read_text())["case"]][:1]
    shutil.copy(path, tmp_path)
    case = json.loads(path.read_text())["case"]
    assert main(["replay", str(tmp_path)]) in (0, 1)
    text = capsys.readouterr().out
    main(["replay", str(tmp_path), "--json"])
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()
                 if json.loads(line)["kind"] == "replay"]
    assert record["conventions"] == case["conventions"]
    route = (f"{record['conventions']['src']}:{record['src']} -> "
             f"{record['conventions']['dst']}:{record['dst']}")
    assert f"{path.name}  " in text and route in text

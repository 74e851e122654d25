"""The corpus: every committed entry replays as a test, writes are atomic and de-duplicated,
replay classifies without touching a file, and a corrupt entry names its file and field."""

import json
import multiprocessing
import shutil

import pytest

from weight_sync_bench.errors import CorpusNotWritable, CorruptCorpusEntry
from weight_sync_bench.fuzz.case import Case, ConversionCase, run_case
from weight_sync_bench.fuzz.corpus import (
    classify,
    corpus_dir,
    entry_paths,
    load_corpus,
    load_entry,
    make_entry,
    save_entry,
    versions,
    writable_corpus,
    write_entry,
)
from weight_sync_bench.fuzz.domain import DOMAIN
from weight_sync_bench.fuzz.replay import replay
from weight_sync_bench.fuzz.runner import PropertyFailed, corpus_examples, run_property

# Names, not paths: the session's corpus copy is made per pytest session (conftest), and a
# module imported once may serve several sessions (mutmut runs them in one process).
COMMITTED = [p.name for p in entry_paths()]


def test_the_committed_corpus_is_not_empty():
    assert len(COMMITTED) >= 4


@pytest.mark.parametrize("name", COMMITTED, ids=[n.removesuffix(".json") for n in COMMITTED])
def test_committed_entry_replays_with_the_projects_claim_holding(name):
    (result,) = replay([load_entry(corpus_dir() / name)])
    assert result.claim_holds, result.outcome.describe()
    if result.entry.case.mutation is not None and result.entry.prop == "invariant":
        # a mutation's entry is born failing: "fixed" would mean a detection was lost (an
        # entry of a real bug, by contrast, is fixed when the bug is)
        assert result.status != "fixed"


def test_corpus_entries_are_fed_to_the_properties_as_explicit_examples():
    by_property = {}  # a conversion's entries feed the convert properties, a layout's the others
    for entry in load_corpus():
        conversion = isinstance(entry.case, ConversionCase)
        prop = (("convert" if conversion else "invariant") if entry.case.mutation is None
                else ("convert_kill" if conversion else "kill"))
        by_property.setdefault((prop, entry.case.mutation), []).append(entry.case)
    for (prop, mutation), entries in by_property.items():
        assert corpus_examples(prop, mutation) == entries
    by_mutation = {m: cases for (prop, m), cases in by_property.items() if prop == "kill"}
    mutation = next(m for m in by_mutation if m is not None)
    tally = run_property("kill", mutation, profile="wsb-replay")  # explicit examples only
    assert tally.examples == len(by_mutation[mutation]) and tally.killed == tally.examples


CASE = Case(DOMAIN.smallest().replace(n_kv_heads=2, n_heads=2, ffn=4, vocab=16), src=1, dst=2,
            seed=0, mutation="lm_head_reversed")


def _entry(outcome=None, **found):
    outcome = outcome or run_case(CASE)
    entry = make_entry("invariant", outcome, worst_deviation=outcome.deviation,
                       worst_ratio=outcome.ratio, profile="wsb-test", hypothesis_seed=7,
                       hypothesis_version="6.170.17")
    entry["found"].update(found)
    return entry


def test_entry_records_case_measurement_and_provenance(tmp_path):
    path, created = write_entry(_entry(), tmp_path)
    data = json.loads(path.read_text())
    assert created and data["schema"] == 1 and data["property"] == "invariant"
    assert data["case"]["degrees"] == {"src": 1, "dst": 2}
    assert data["case"]["seeds"] == {"param": 0, "token": 1000}
    assert set(data["found"]["versions"]) == {"torch", "numpy", "hypothesis", "python", "platform",
                                              "cpu_vendor"}
    assert data["found"]["hypothesis_seed"] == 7 and data["found"]["profile"] == "wsb-test"
    assert data["measured"]["ratio"] > 10
    assert load_entry(path).case == Case(CASE.config.replace(name=f"corpus:{path.stem}"),
                                         1, 2, 0, "lm_head_reversed")


def test_the_same_case_written_twice_is_one_file_left_as_first_written(tmp_path):
    first, created = write_entry(_entry(), tmp_path)
    text = first.read_text()
    second, again = write_entry(_entry(date="later"), tmp_path)
    assert (second, created, again) == (first, True, False)
    assert first.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no temp file left


def _write_in_child(args):
    entry, directory = args
    return write_entry(entry, directory)[1]


def test_concurrent_writers_of_one_case_create_exactly_one_file(tmp_path):
    entry = _entry()
    with multiprocessing.get_context("fork").Pool(4) as pool:
        created = pool.map(_write_in_child, [(entry, tmp_path)] * 8)
    assert sum(created) == 1 and len(list(tmp_path.iterdir())) == 1


def _blocked(tmp_path):
    """A corpus directory that cannot be made, even by root: a file is where it would go."""
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file" / "corpus"


def test_a_corpus_directory_that_cannot_be_written_is_a_typed_error_naming_it(tmp_path):
    blocked = _blocked(tmp_path)
    for write in (lambda: writable_corpus(blocked), lambda: write_entry(_entry(), blocked)):
        with pytest.raises(CorpusNotWritable, match=f"the corpus directory {blocked} cannot be "
                           r"written \(Not a directory\)") as caught:
            write()
        assert (caught.value.directory, caught.value.reason) == (str(blocked), "Not a directory")
    # the twins: a directory that is missing but can be made is not made before it has an
    # entry (a run that finds nothing leaves nothing); an existing one is probed, left empty
    fine = tmp_path / "deep" / "corpus"
    assert writable_corpus(fine) == fine and not (tmp_path / "deep").exists()
    fine.mkdir(parents=True)
    assert writable_corpus(fine) == fine and list(fine.iterdir()) == []


def test_a_counterexample_that_cannot_be_saved_is_printed_whole_not_lost(tmp_path):
    """A directory that became unwritable during a run (the run checks it at the start): the
    failure still raises, its message carrying the whole entry and the file name it would have
    had; the entry read back from the message is the one the twin writes to a good directory."""
    blocked = _blocked(tmp_path)
    with pytest.raises(PropertyFailed) as caught:
        run_property("invariant", "lm_head_reversed", max_examples=10, seed=1, corpus=False,
                     corpus_path=blocked)
    message = str(caught.value)
    assert caught.value.entry is None
    assert (f"  corpus entry NOT written: the corpus directory {blocked} cannot be written (Not "
            "a directory): set WSB_CORPUS_DIR to a writable directory\n  the entry, to save "
            "as ") in message
    name, printed = message.split("the entry, to save as ")[1].split(" (wsb replay FILE "
                                                                     "replays it):\n")
    unsaved = json.loads(printed)
    (tmp_path / "good").mkdir()
    saved = save_entry(unsaved, tmp_path / "good")  # the twin: a directory that takes it
    assert saved.created and saved.path.name == name and saved.note == f"corpus entry: {saved.path}"
    assert load_entry(saved.path).case.mutation == "lm_head_reversed"
    again = save_entry(unsaved, tmp_path / "good")
    assert (again.path, again.created) == (saved.path, False) and "(already there)" in again.note


def test_replay_classifies_and_never_touches_the_file(tmp_path):
    path, _ = write_entry(_entry(), tmp_path)
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    (result,) = replay(load_corpus([path]))
    assert result.status == "still failing" and result.claim_holds
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert sorted(tmp_path.iterdir()) == [path]


def test_classify_tells_fixed_drifted_and_environment_changed_apart(tmp_path):
    outcome = run_case(CASE)
    entry = load_entry(write_entry(_entry(outcome), tmp_path)[0])
    assert classify(entry, outcome) == "still failing"
    moved = entry.data | {"measured": entry.data["measured"] | {"deviation": 1.5}}
    shifted = type(entry)(entry.path, moved, entry.case)
    assert classify(shifted, outcome) == "drifted"
    older = moved | {"found": moved["found"] | {"versions": versions() | {"torch": "2.4.0"}}}
    assert classify(type(entry)(entry.path, older, entry.case), outcome) == "environment changed"
    # MKL and oneDNN dispatch by CPU vendor: found on another vendor's CPU, or (every entry
    # found before the vendor was recorded) on an unnamed one, a moved deviation is the
    # environment's doing, not a drift
    for vendor in ("OtherVendor", None):
        recorded = versions() | {"cpu_vendor": vendor}
        elsewhere = moved | {"found": moved["found"] | {"versions": recorded}}
        assert classify(type(entry)(entry.path, elsewhere, entry.case), outcome) == \
            "environment changed", vendor
    clean = run_case(Case(CASE.config, 1, 2, 0))  # the invariant holds without the mutation
    assert classify(entry, clean) == "fixed"


@pytest.mark.parametrize("edit, field, message", [
    (lambda d: "{not json", None, r"not valid JSON"),
    (lambda d: d | {"schema": 2}, "schema", r"field 'schema' is 2, this code reads 1"),
    (lambda d: {k: v for k, v in d.items() if k != "property"}, "property",
     r"missing field 'property'"),
    (lambda d: d | {"case": d["case"] | {"degrees": {"src": 1, "dst": "2"}}},
     "case.degrees.dst", r"field 'case.degrees.dst' is '2', expected int"),
    (lambda d: d | {"case": d["case"] | {"mutation": "kv_swap"}}, "case.mutation",
     r"field 'case.mutation': unknown mutation 'kv_swap'"),
    (lambda d: d | {"case": d["case"] | {"seeds": {"param": 0, "token": 5}}}, "case.seeds.token",
     r"field 'case.seeds.token' is 5, this code draws tokens from 1000 \+ param = 1000"),
    (lambda d: d | {"case": d["case"] | {"geometry": d["case"]["geometry"] | {"head_dim": 3}}},
     "case.geometry", r"field 'case.geometry': .*even head_dim"),
    (lambda d: d | {"case": d["case"] | {"degrees": {"src": 1, "dst": 3}}},
     "case.degrees.dst", r"field 'case.degrees.dst' is 3, the geometry supports t in \[1, 2\]"),
], ids=["not-json", "schema", "missing-property", "wrong-type", "unknown-mutation",
        "token-seed", "invalid-geometry", "unsupported-degree"])
def test_corrupt_entry_is_an_error_naming_the_file_and_the_field(tmp_path, edit, field, message):
    good, _ = write_entry(_entry(), tmp_path)
    data = edit(json.loads(good.read_text()))
    bad = tmp_path / "bad.json"
    bad.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(CorruptCorpusEntry, match=message) as err:
        load_corpus([good, bad])
    assert str(err.value).startswith(str(bad)) and err.value.field == field


def test_a_copied_corpus_directory_is_read_through_the_environment(tmp_path, monkeypatch):
    for name in COMMITTED[:2]:
        shutil.copy(corpus_dir() / name, tmp_path)
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert corpus_dir() == tmp_path and [e.path.name for e in load_corpus()] == COMMITTED[:2]


def test_an_unreadable_path_is_an_error_naming_it_and_a_directory_means_its_entries(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(CorruptCorpusEntry, match=r"nope.json: cannot be read"):
        load_entry(missing)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CorruptCorpusEntry, match=r"binary.json: not valid JSON"):
        load_entry(binary)
    binary.unlink()
    path, _ = write_entry(_entry(), tmp_path)
    assert [e.path for e in load_corpus([tmp_path])] == [path]

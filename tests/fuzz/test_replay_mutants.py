"""``fuzz.replay`` (issue 30, the mutation pass over ``fuzz/replay.py``): each corpus entry
measured again and classified. The harness's own entries go through ``run_case``, and a user
function's entry is re-run against that function, with a note when its source changed or when
it now declines the case.

``wsb replay`` decides its exit code from these statuses, so replaying the wrong case, the
wrong function, under the wrong threshold, or dropping a note would each report a fixed bug
as still failing, or the other way round. The runs are stood in here: each test checks what
was run, on what, and what the replay says."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import user_functions as uf

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.fuzz import replay as R
from weight_sync_bench.fuzz.case import Case, ConversionCase, Outcome
from weight_sync_bench.fuzz.corpus import Entry, Replayed
from weight_sync_bench.fuzz.user import UserOutcome
from weight_sync_bench.model.config import ModelConfig

C = ModelConfig(name="r", vocab=64, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=4,
                ffn=16, batch=1, seq_len=4)
SOURCE = Path(uf.__file__)
DIGEST = hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def harness_entry(case=None, deviation=2.0):
    case = case or Case(C, 2, 1, 0)
    return Entry(Path("corpus/e.json"), {"property": "invariant",
                                        "measured": {"deviation": deviation},
                                        "found": {"versions": {}}}, case)


def user_entry(case=None, *, role="resharder", function="user_functions:reshard_correct",
               digest=DIGEST, deviation=2.0):
    case = case or Case(C, 2, 1, 0)
    user = {"role": role, "function": function, "source_file": str(SOURCE)}
    if digest is not None:
        user["source_sha256"] = digest
    return Entry(Path("wsb-corpus/u.json"), {"property": "invariant", "user": user,
                                            "measured": {"deviation": deviation},
                                            "found": {"versions": {}}}, case)


@pytest.fixture
def runs(monkeypatch):
    """``run_case`` and ``run_user_case`` stood in: each records what it ran and answers
    the deviation ``answer`` holds (and ``declined`` for a user's case)."""
    state = {"deviation": 0.0, "declined": None, "cases": [], "users": []}

    def run_case(case, *, forward, threshold_rule):
        state["cases"].append((case, forward, threshold_rule))
        return Outcome(case=case, deviation=state["deviation"], threshold=1.0,
                       shards_differ=False)

    def run_user_case(function, case, *, forward, threshold_rule):
        state["users"].append((function, case, forward, threshold_rule))
        return UserOutcome(case=case, deviation=state["deviation"], threshold=1.0,
                           shards_differ=False, function=function, declined=state["declined"],
                           verdict=None)

    monkeypatch.setattr(R, "run_case", run_case)
    monkeypatch.setattr(R, "run_user_case", run_user_case)
    return state


def test_a_harness_entry_is_run_again_and_classified(runs):
    entry = harness_entry()
    runs["deviation"] = 2.0
    [got] = R.replay([entry], forward="fw", threshold_rule="rule")
    assert runs["cases"] == [(entry.case, "fw", "rule")]
    assert isinstance(got, Replayed) and got.entry is entry
    assert got.status == "still failing" and got.note is None
    assert got.outcome.deviation == 2.0
    runs["deviation"] = 0.5  # under the threshold now
    assert [r.status for r in R.replay([entry])] == ["fixed"]
    assert runs["cases"][-1][1:] == (R.inprocess_forward, None)


def test_replay_reads_every_entry_in_order_lazily(runs):
    entries = [harness_entry(Case(C, 2, 1, s)) for s in range(3)]
    results = R.replay(entries)
    assert runs["cases"] == []  # nothing runs before it is asked for
    assert [r.entry for r in results] == entries
    assert [c[0].seed for c in runs["cases"]] == [0, 1, 2]


def test_a_user_entry_needs_a_loader(runs):
    entry = user_entry()
    with pytest.raises(InvalidConfig) as exc:
        list(R.replay([harness_entry(), entry]))
    assert str(exc.value) == (f"{entry.path}: a user function's entry "
                              "(user_functions:reshard_correct): replay needs load=")


def test_a_user_entry_is_run_against_its_function_loaded_by_import_path(runs):
    loaded = []

    def load(spec, role):
        loaded.append((spec, role))
        return uf.reshard_correct

    entry = user_entry()
    runs["deviation"] = 2.0
    [got] = R.replay([entry], load=load, forward="fw", threshold_rule="rule")
    assert loaded == [("user_functions:reshard_correct", "resharder")]
    [(function, case, forward, rule)] = runs["users"]
    assert function.fn is uf.reshard_correct and function.role == "resharder"
    assert function.name == "user_functions:reshard_correct"
    assert (function.src, function.dst) == (None, None)
    assert (case, forward, rule) == (entry.case, "fw", "rule")
    assert got.status == "still failing" and got.note is None and got.entry is entry


def test_a_converters_entry_is_run_between_the_cases_conventions(runs):
    case = ConversionCase(C, "megatron", 2, "vllm", 1, 0)
    entry = user_entry(case, role="converter",
                       function="user_functions:convert_megatron_to_vllm")
    R.replay_entry(entry, load=lambda spec, role: uf.convert_megatron_to_vllm)
    [(function, got_case, forward, rule)] = runs["users"]
    assert (function.src, function.dst, function.role) == ("megatron", "vllm", "converter")
    assert got_case is case and forward is R.inprocess_forward and rule is None


def test_a_changed_source_is_noted_with_both_hashes(runs):
    runs["deviation"] = 2.0
    old = "0123456789abcdef" * 4
    got = R.replay_entry(user_entry(digest=old), load=lambda s, r: uf.reshard_correct)
    assert got.status == "still failing"
    assert got.note == (f"the source of user_functions:reshard_correct ({SOURCE}) changed "
                        f"since the entry was written (sha256 0123456789ab -> "
                        f"{DIGEST[:12]})")
    same = R.replay_entry(user_entry(), load=lambda s, r: uf.reshard_correct)
    assert same.note is None
    unrecorded = R.replay_entry(user_entry(digest=None), load=lambda s, r: uf.reshard_correct)
    assert unrecorded.note is None  # an entry that recorded no hash: nothing to compare
    nowhere = R.replay_entry(user_entry(digest=old), load=lambda s, r: len)
    assert nowhere.note == ("the source of user_functions:reshard_correct (None) changed since "
                            "the entry was written (sha256 0123456789ab -> ?)")


def test_a_function_that_now_declines_the_case_says_so(runs):
    runs["declined"] = "only even vocabularies"
    got = R.replay_entry(user_entry(), load=lambda s, r: uf.reshard_correct)
    assert got.status == "declined"
    assert got.note == ("user_functions:reshard_correct now declines the case (Unsupported: "
                        "only even vocabularies)")
    both = R.replay_entry(user_entry(digest="f" * 64), load=lambda s, r: uf.reshard_correct)
    assert both.status == "declined"
    assert both.note == (
        f"the source of user_functions:reshard_correct ({SOURCE}) changed since the entry was "
        f"written (sha256 ffffffffffff -> {DIGEST[:12]}); user_functions:reshard_correct now "
        "declines the case (Unsupported: only even vocabularies)")


def test_replay_goes_on_after_a_user_entry(runs):
    entries = [user_entry(), harness_entry()]
    got = list(R.replay(entries, load=lambda s, r: uf.reshard_correct))
    assert [r.entry for r in got] == entries
    assert len(runs["users"]) == 1 and len(runs["cases"]) == 1


def test_a_user_entry_keeps_the_name_it_was_saved_under(runs):
    """The import path the user gave (an alias, a re-export) names it, not where it lives."""
    entry = user_entry(function="mine:alias")
    got = R.replay_entry(entry, load=lambda s, r: uf.reshard_correct)
    [(function, *_)] = runs["users"]
    assert function.name == "mine:alias"
    assert got.entry is entry and got.outcome.function is function
    runs["declined"] = "no"
    declined = R.replay_entry(entry, load=lambda s, r: uf.reshard_correct)
    assert declined.entry is entry and declined.outcome.declined == "no"

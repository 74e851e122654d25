"""The ``--json`` records' builders (issue 30, the mutation pass over ``cli/records.py``):
each field of a ``check``, ``counterexample`` and ``replay`` record carries the value its text
says, from a verdict, a fuzzed outcome or a replayed entry whose every field differs from the
others and from its default, so a field read from the wrong attribute, dropped to its
default or mapped the wrong way round (``src``/``dst``, ``own``/``declared``) fails here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from weight_sync_bench.check.verdict import Verdict
from weight_sync_bench.cli.records import (
    KEYS,
    SUMMARY_KEYS,
    counterexample_record,
    keys_of,
    replay_record,
    verdict_record,
)

FULL = Verdict(config="toy", src=2, dst=4, max_abs_error=0.5, threshold=0.25,
               first_mismatch="layers.0.qkv.weight", mismatches=("a", "b"),
               diagnosis=("kv heads swapped", "on rank 1"), phase="1b", mutation="kv_swapped",
               own_forward=True, conventions=("megatron", "vllm"), notes=("n1",), dtype="bf16",
               named_mutation="kv_swapped", near_ties=(3, 40), route_bound=0.125)


def test_a_check_record_is_the_verdict_field_by_field():
    assert verdict_record(FULL, directory="ck") == {
        "config": "toy", "phase": "1b", "conventions": {"src": "megatron", "dst": "vllm"},
        "src": 2, "dst": 4, "dtype": "bf16", "mutation": "kv_swapped",
        "named_mutation": "kv_swapped", "max_abs_error": 0.5, "threshold": 0.25,
        "ratio": 2.0, "forward": "own", "passed": False,
        "first_mismatch": "layers.0.qkv.weight", "mismatches": ["a", "b"],
        "diagnosis": ["kv heads swapped", "on rank 1"], "near_ties": [3, 40],
        "route_bound": 0.125, "notes": ["n1"], "directory": "ck"}
    assert sorted(verdict_record(FULL)) == sorted(KEYS["check"])


def test_a_passing_check_on_the_declared_forward_records_its_nulls():
    v = Verdict(config="small", src=None, dst=1, max_abs_error=0.0, threshold=1e-3,
                first_mismatch=None)
    assert verdict_record(v) == {
        "config": "small", "phase": "1a", "conventions": None, "src": None, "dst": 1,
        "dtype": "fp32", "mutation": None, "named_mutation": None, "max_abs_error": 0.0,
        "threshold": 1e-3, "ratio": 0.0, "forward": "declared", "passed": True,
        "first_mismatch": None, "mismatches": [], "diagnosis": [], "near_ties": None,
        "route_bound": None, "notes": [], "directory": None}


def outcome(case, **kw):
    return SimpleNamespace(case=case, deviation=0.75, threshold=0.5, ratio=1.5, **kw)


class Failed(AssertionError):
    def __init__(self, prop, out):
        super().__init__(f"{prop} fails")
        self.prop, self.outcome = prop, out


class Case:
    def __init__(self, text, **kw):
        self.text = text
        self.src, self.dst, self.mutation, self.phase = 3, 6, "m", "1b"
        self.__dict__.update(kw)

    def __str__(self):
        return self.text


def test_a_conversion_counterexample_names_its_conventions():
    c = Case("toy megatron:3 -> hf:6", src_convention="megatron", dst_convention="hf")
    assert counterexample_record(Failed("convert", outcome(c))) == {
        "property": "convert", "case": "toy megatron:3 -> hf:6",
        "conventions": {"src": "megatron", "dst": "hf"}, "src": 3, "dst": 6, "mutation": "m",
        "named_mutation": None, "deviation": 0.75, "threshold": 0.5, "ratio": 1.5,
        "first_mismatch": None, "diagnosis": None, "error": None, "message": "convert fails"}


def test_a_users_function_counterexample_carries_its_verdict_and_error():
    function = SimpleNamespace(conventions=("vllm", "megatron"))
    out = outcome(Case("toy 3->6"), verdict=FULL, function=function, error="returned None")
    assert counterexample_record(Failed("user", out)) == {
        "property": "user", "case": "toy 3->6",
        "conventions": {"src": "vllm", "dst": "megatron"}, "src": 3, "dst": 6,
        "mutation": "m", "named_mutation": "kv_swapped", "deviation": 0.75, "threshold": 0.5,
        "ratio": 1.5, "first_mismatch": "layers.0.qkv.weight",
        "diagnosis": ["kv heads swapped", "on rank 1"], "error": "returned None",
        "message": "user fails"}
    # a resharder's function speaks no convention
    out = outcome(Case("toy 3->6"), function=SimpleNamespace(conventions=None))
    assert counterexample_record(Failed("user", out))["conventions"] is None
    assert counterexample_record(Failed("inv", outcome(Case("x"))))["conventions"] is None


def test_a_replay_record_is_the_entry_and_its_outcome():
    c = Case("c", src_convention="hf", dst_convention="meta")
    entry = SimpleNamespace(path=Path("corpus/e.json"), prop="convert", case=c,
                            origin="seeded", origin_note="inferred", user="m:f")
    r = SimpleNamespace(entry=entry, outcome=outcome(c), status="fixed", claim_holds=False,
                        note="source changed")
    assert replay_record(r) == {
        "entry": "corpus/e.json", "property": "convert", "mutation": "m", "phase": "1b",
        "conventions": {"src": "hf", "dst": "meta"}, "src": 3, "dst": 6, "deviation": 0.75,
        "threshold": 0.5, "ratio": 1.5, "status": "fixed", "claim_holds": False,
        "origin": "seeded", "origin_note": "inferred", "user": "m:f",
        "note": "source changed"}
    assert sorted(replay_record(r)) == sorted(KEYS["replay"])


def test_a_summarys_keys_are_its_commands_after_command_and_exit_code():
    assert keys_of("summary", "replay") == ("command", "exit_code", *SUMMARY_KEYS["replay"])
    assert keys_of("replay", "fuzz") == KEYS["replay"]
    assert keys_of("check", "verify") == KEYS["check"]

"""What a user of pytest, Hypothesis and torch.distributed expects of the output: ``--json``
(one object per check, stable keys, a summary last; one schema, the README's table, carrying
what the text says), ``-q``, a periodic progress line when
stderr is not a terminal (not one line per event), legends for ``wsb layout``'s ``-`` and
``wsb check``'s ``forward`` column, and the README's gloo example guarded by ``__main__``."""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

import pytest

from tests.documentation import documentation
from weight_sync_bench.check import checker as checker_module
from weight_sync_bench.cli import main
from weight_sync_bench.cli.main import FORWARD_LEGEND, LAYOUT_LEGEND
from weight_sync_bench.cli.output import Output, ProgressLine
from weight_sync_bench.cli.records import KEYS, SUMMARY_KEYS

README = Path(__file__).resolve().parents[2] / "README.md"
CHECK_KEYS = ["kind", "config", "phase", "conventions", "src", "dst", "dtype", "mutation",
              "named_mutation", "max_abs_error", "threshold", "ratio", "forward", "passed",
              "first_mismatch", "mismatches", "diagnosis", "near_ties", "route_bound", "notes",
              "directory"]


def _records(text):
    return [json.loads(line) for line in text.splitlines()]


def test_check_json_is_one_object_per_check_with_stable_keys_then_a_summary(capsys):
    assert main(["check", "--config", "toy", "--json"]) == 0
    out, err = capsys.readouterr()
    *checks, summary = _records(out)  # nothing but JSON on stdout
    assert len(checks) == 4 and all(list(c) == CHECK_KEYS for c in checks)
    assert [(c["src"], c["dst"]) for c in checks] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(c["passed"] and c["forward"] == "declared" for c in checks)
    assert all(c["conventions"] is None and c["dtype"] == "fp32" and c["diagnosis"] == []
               and c["named_mutation"] is None and c["directory"] is None for c in checks)
    # a dense model has no routing to check: neither figure, rather than a zero
    assert all(c["near_ties"] is None and c["route_bound"] is None for c in checks)
    assert summary == {"kind": "summary", "command": "check", "exit_code": 0, "checks": 4,
                       "ran": 4, "passed": 4, "failed": 0, "interrupted": False, "skipped": []}
    assert "check 1/4" in err  # progress still goes to stderr


def _readme_schema() -> dict[str, list[str]]:
    """The README's JSON table: kind (a summary: ``summary COMMAND``) -> its keys."""
    section = documentation().split("## Exit codes and machine-readable output")[1]
    table: dict[str, list[str]] = {}
    for kinds, origin, keys in re.findall(r"^\| (`[a-z_]+`(?: / `[a-z_]+`)?) \| (.*?) \| (.*) \|$",
                                          section, re.M):
        names = [k.strip().strip("`") for k in kinds.split("/")]
        keys = [k.strip() for k in re.sub(r"\([^)]*\)", "", keys).split(",")]
        if names == ["summary"]:
            names = [f"summary {command.strip()}" for command in origin.split(",")]
        for name in names:
            assert name not in table, name
            table[name] = keys
    return table


def test_the_readme_json_table_is_the_schema_every_record_follows():
    schema = {**{kind: list(keys) for kind, keys in KEYS.items()},
              **{f"summary {command}": ["command", "exit_code", *keys]
                 for command, keys in SUMMARY_KEYS.items()}}
    assert _readme_schema() == schema


def test_a_record_without_its_kinds_keys_is_refused_whether_or_not_it_prints():
    for json_flag in (False, True):
        out = Output(argparse.Namespace(json=json_flag, quiet=False, command="check"))
        with pytest.raises(AssertionError, match="bandwidth"):  # a key that is not a check's
            out.record("check", **dict.fromkeys(KEYS["check"]), bandwidth=1.0)
        with pytest.raises(AssertionError, match="notes"):  # one of its keys left out
            out.record("check", **dict.fromkeys(k for k in KEYS["check"] if k != "notes"))
        with pytest.raises(AssertionError, match="skipped"):  # a summary is its command's
            out.summary(0, checks=1, ran=1, passed=1, failed=0, interrupted=False)
    Output(argparse.Namespace(json=False, command="check")).record(
        "check", **dict.fromkeys(KEYS["check"]))  # the twin: exactly its keys


SWAPPED = """
    from weight_sync_bench import TOY_KV4, convert

    def swapped(shards, degree):  # ranks 0 and 1 exchange their qkv_proj
        out = convert(shards, "megatron", f"vllm:{degree}", TOY_KV4)
        name = "model.layers.0.self_attn.qkv_proj.weight"
        out[0][name], out[1][name] = out[1][name], out[0][name]
        return out
"""


def test_a_failed_checks_json_carries_what_its_text_says(tmp_path, monkeypatch, capsys):
    (tmp_path / "wsb_json_swapped.py").write_text(textwrap.dedent(SWAPPED))
    # a note on how this machine differs from the floor's, whether or not it does
    monkeypatch.setattr(checker_module, "environment_notes",
                        lambda *args: ("the floor was measured under another torch (planted)",))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["check", "--config", "toy_kv4", "--from", "megatron:4", "--to", "vllm:2",
            "--dtype", "bf16", "--converter", "wsb_json_swapped:swapped"]
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert main([*argv, "--json"]) == 1
    (record, summary) = _records(capsys.readouterr().out)
    assert record["conventions"] == {"src": "megatron", "dst": "vllm"}
    assert (record["src"], record["dst"], record["dtype"]) == (4, 2, "bf16")
    assert "toy_kv4  megatron:4 -> vllm:2" in text and "bf16 weights" in text
    assert record["first_mismatch"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert len(record["diagnosis"]) == 2  # a line per rank that holds the wrong heads
    for line in record["diagnosis"]:  # each as the text writes it, indented under the verdict
        assert f"\n    {line}\n" in text
    assert record["diagnosis"][0] == (
        "rank 0 model.layers.0.self_attn.qkv_proj.weight holds Q heads 4-7, K heads 2-3, "
        "V heads 2-3; declared Q heads 0-3, K heads 0-1, V heads 0-1")
    assert record["notes"] == ["the floor was measured under another torch (planted)"]
    assert "note: the floor was measured under another torch (planted)" in text
    assert record["named_mutation"] is None and record["passed"] is False
    assert summary["exit_code"] == 1 and summary["failed"] == 1


def test_an_error_under_json_is_a_record_too(capsys):
    assert main(["check", "--config", "toy", "--src", "4", "--json"]) == 2
    (record,) = _records(capsys.readouterr().out)
    assert record["kind"] == "error" and record["exit_code"] == 2
    assert record["type"] == "WsbError" and "n_kv_heads % t == 0" in record["message"]


def test_fuzz_and_mutants_json_name_each_property_and_the_corpus(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert main(["fuzz", "--examples", "2", "--seed", "1", "--mutation", "kv_swapped",
                 "--json"]) == 0
    *tallies, summary = _records(capsys.readouterr().out)
    assert [(t["kind"], t["property"], t["mutation"]) for t in tallies] == [
        ("property", "kill", "kv_swapped")]
    assert summary["exit_code"] == 0 and summary["corpus"] == str(tmp_path)
    assert set(summary) >= {"examples", "failures", "harness_faults", "master_seed",
                            "new_entries", "profile", "elapsed", "stopped"}
    assert main(["mutants", "--examples", "2", "--seed", "1", "--mutation", "lm_head_reversed",
                 "--json"]) == 0
    (mutant, summary) = _records(capsys.readouterr().out)
    assert mutant["kind"] == "mutant" and summary["kind"] == "summary"
    assert mutant["killed"] == mutant["examples"] - mutant["identity"]


def test_train_check_json_and_its_progress(capsys):
    assert main(["train-check", "--config", "small_tied_bias", "--dp", "2", "--tp", "2",
                 "--batch", "packed", "--steps", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    (report, summary) = _records(out)
    assert report["kind"] == "train" and report["mesh"] == "dp=2 tp=2" and report["passed"]
    assert {c["quantity"] for c in report["comparisons"]} >= {"loss"}
    assert summary["exit_code"] == 0 and summary["checks"] == 1
    assert "train-check 1/1: small_tied_bias dp=2 tp=2 packed" in err


def test_train_check_mutations_shows_progress_per_case(capsys):
    assert main(["train-check", "--config", "small_tied_bias", "--dp", "2", "--tp", "2",
                 "--batch", "packed", "--mutations"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^train-check --mutations 1/1: small_tied_bias dp=2 tp=2 packed "
                     r"\(\d+ mutations, phase 1a\)$", err, re.M)
    assert re.search(r"^(\d+) of \1 detected, 0 identity cells skipped$", out, re.M)
    assert "9 of 9 detected, 0 identity cells skipped" in out  # test_train.py's, in the long run


def test_quiet_check_prints_failures_and_the_closing_line_only(capsys):
    assert main(["check", "--config", "toy", "-q"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "4 passed, 0 failed" and err == ""


def test_progress_into_a_log_is_periodic_not_one_line_per_event(capsys):
    now = [0.0]
    line = ProgressLine(clock=lambda: now[0])
    assert not line.live  # pytest's stderr is no terminal
    for i in range(1000):  # 1000 events over 100 s
        line.show(f"event {i}")
        now[0] += 0.1
    line.close()
    shown = capsys.readouterr().err.splitlines()
    assert shown[0] == "event 0" and shown[-1] == "event 999"  # the first and the last
    assert 10 <= len(shown) <= 12  # one every 10 s between them
    silent = ProgressLine(enabled=False)
    silent.show("x")
    silent.close()
    assert capsys.readouterr().err == ""


def test_a_command_prints_its_progress_periodically(capsys):
    assert main(["check", "--config", "toy_kv4"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["check 1/9: toy_kv4 1 -> 1 (inprocess)",  # the first, then (within 10 s)
                   "check 9/9: toy_kv4 4 -> 4 (inprocess)"]  # only the last


def test_layout_and_check_explain_their_cells(capsys):
    assert main(["layout", "--config", "toy"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\s-(\s|$)", out) and out.rstrip().endswith(LAYOUT_LEGEND)
    assert main(["check", "--config", "toy"]) == 0
    out = capsys.readouterr().out
    assert "forward" in out.splitlines()[0] and FORWARD_LEGEND in out


def test_the_readme_gloo_example_has_the_main_guard():
    text = documentation()
    section = text[text.index("## Phase 1b"):]
    section = section[:section.index("\n## ", 4)]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'backend="gloo"' in code
    guarded = code[code.index('if __name__ == "__main__":'):]
    assert "check_reshard(" in guarded  # the call that starts the pool is under the guard
    compile(code, "README gloo example", "exec")


def test_train_check_keeps_freed_memory_only_in_a_process_of_its_own(monkeypatch, capsys):
    import importlib

    from weight_sync_bench import __main__ as entry
    from weight_sync_bench import memory

    cli_main = importlib.import_module("weight_sync_bench.cli.main")  # the module, not main

    kept = []
    monkeypatch.setattr(memory, "keep_freed", lambda: kept.append(True) or True)
    argv = ["train-check", "--config", "small_tied_bias", "--dp", "1", "--tp", "1", "-q"]
    assert main(argv) == 0 and kept == []  # a caller's process: left as it was
    assert main(argv, own_process=True) == 0 and kept == [True]
    forwarded = []
    monkeypatch.setattr(cli_main, "main", lambda a, **kw: forwarded.append((a, kw)) or 0)
    assert entry.main(argv) == 0  # the console script: the process is wsb's
    assert forwarded == [(argv, {"own_process": True})]

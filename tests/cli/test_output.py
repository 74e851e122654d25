"""What a user of pytest, Hypothesis and torch.distributed expects of the output: ``--json``
(one object per check, stable keys, a summary last), ``-q``, a periodic progress line when
stderr is not a terminal (not one line per event), legends for ``wsb layout``'s ``-`` and
``wsb check``'s ``forward`` column, and the README's gloo example guarded by ``__main__``."""

from __future__ import annotations

import json
import re
from pathlib import Path

from weight_sync_bench.cli import main
from weight_sync_bench.cli.main import FORWARD_LEGEND, LAYOUT_LEGEND
from weight_sync_bench.cli.output import ProgressLine

README = Path(__file__).resolve().parents[2] / "README.md"
CHECK_KEYS = ["kind", "config", "phase", "src", "dst", "mutation", "max_abs_error", "threshold",
              "ratio", "forward", "passed", "first_mismatch", "mismatches"]


def _records(text):
    return [json.loads(line) for line in text.splitlines()]


def test_check_json_is_one_object_per_check_with_stable_keys_then_a_summary(capsys):
    assert main(["check", "--config", "toy", "--json"]) == 0
    out, err = capsys.readouterr()
    *checks, summary = _records(out)  # nothing but JSON on stdout
    assert len(checks) == 4 and all(list(c) == CHECK_KEYS for c in checks)
    assert [(c["src"], c["dst"]) for c in checks] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(c["passed"] and c["forward"] == "declared" for c in checks)
    assert summary == {"kind": "summary", "command": "check", "exit_code": 0, "checks": 4,
                       "ran": 4, "passed": 4, "failed": 0, "interrupted": False}
    assert "check 1/4" in err  # progress still goes to stderr


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
    text = README.read_text()
    section = text[text.index("## Phase 1b"):]
    section = section[:section.index("\n## ", 4)]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'backend="gloo"' in code
    guarded = code[code.index('if __name__ == "__main__":'):]
    assert "check_reshard(" in guarded  # the call that starts the pool is under the guard
    compile(code, "README gloo example", "exec")

"""``wsb fuzz``, ``mutants``, ``floor`` and ``replay`` as a user runs them (through
``cli.fuzz.register`` and ``cli.floor.register``, exactly as ``wsb``'s parser wires them in)."""

import argparse
import json

import pytest

from weight_sync_bench.cli.floor import register as register_floor
from weight_sync_bench.cli.fuzz import register
from weight_sync_bench.errors import ToleranceMismatch, WsbError
from weight_sync_bench.fuzz.case import Case, run_case
from weight_sync_bench.fuzz.corpus import corpus_dir, make_entry
from weight_sync_bench.fuzz.domain import DOMAIN


def wsb(*argv):
    parser = argparse.ArgumentParser(prog="wsb")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    register_floor(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


def test_fuzz_prints_progress_to_stderr_and_a_closing_table_to_stdout(capsys, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert wsb("fuzz", "--examples", "4", "--chunk", "2", "--seed", "1",
               "--mutation", "kv_swapped") == 0
    out, err = capsys.readouterr()
    assert "examples/s" in err and "elapsed" in err and "failures" in err
    assert out.splitlines()[0].split() == ["property", "examples", "identity", "failures",
                                           "min", "ratio", "max", "ratio", "new", "corpus",
                                           "entries"]
    assert "kill[kv_swapped]  4" in out and "master seed 1" in out
    assert list(tmp_path.iterdir()) == []  # nothing failed, nothing written


def test_fuzz_time_budget_stops_and_reports(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert wsb("fuzz", "--minutes", "0.001", "--chunk", "1", "--seed", "2") == 0
    out = capsys.readouterr().out
    assert "invariant" in out and "0 failures" in out


def test_mutants_prints_the_kill_matrix(capsys):
    assert wsb("mutants", "--examples", "3", "--seed", "3", "--mutation", "lm_head_reversed",
               "--mutation", "gate_up_swapped") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:5] == ["mutation", "tried", "identity", "killed",
                                               "smallest"]
    assert out.splitlines()[1].startswith("lm_head_reversed") and "x" in out.splitlines()[1]


def test_fuzz_moe_runs_the_moe_properties_and_counts_their_near_ties(capsys, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path / "corpus"))
    summary = tmp_path / "summary.json"
    assert wsb("fuzz", "--moe", "--examples", "1", "--seed", "4", "--summary",
               str(summary)) == 0
    out = capsys.readouterr().out
    assert "moe_convert_kill[router_bias_negated]" in out and "near ties (MoE):" in out
    data = json.loads(summary.read_text())
    assert {p["property"] for p in data["properties"]} == {"moe_convert", "moe_convert_kill"}
    assert len(data["properties"]) == 12 and data["totals"]["failures"] == 0
    assert data["near_ties"]["failed"] == 0 and data["near_ties"]["of_choices"] > 0
    with pytest.raises(WsbError, match="--moe runs every MoE property"):
        wsb("fuzz", "--moe", "--mutation", "w13_halves_swapped")


def test_mutants_reports_an_moe_mutations_smallest_kill_ratio(capsys):
    assert wsb("mutants", "--examples", "2", "--seed", "3", "--mutation",
               "router_bias_negated") == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.startswith("router_bias_negated") and row.split()[4].endswith("x")


def test_find_smallest_writes_the_mutation_at_its_smallest_geometry(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert wsb("fuzz", "--find-smallest", "embedding_reversed") == 0
    (path,) = tmp_path.iterdir()
    entry = json.loads(path.read_text())
    assert entry["case"]["mutation"] == "embedding_reversed" and entry["property"] == "invariant"
    assert entry["case"]["geometry"]["d_model"] == 8 and entry["case"]["degrees"]["dst"] == 2
    assert str(path) in capsys.readouterr().out


def test_replay_prints_a_status_per_entry(capsys, tmp_path):
    """Each entry's status follows from where it was found, on any machine: entries made
    here replay "still failing" (the same deviation, bit for bit, in the environment they
    recorded, CPU vendor included), "environment changed" where one records another vendor's
    CPU and another deviation (MKL and oneDNN sum in another order there), "drifted" where
    the deviation moved in the same environment; a committed entry of a bug since fixed is
    "fixed". (A committed entry found on one vendor's CPU replays "still failing" there and
    may replay "environment changed" on another's: those are not pinned here.)"""
    outcome = run_case(Case(DOMAIN.smallest().replace(n_kv_heads=2, n_heads=2, ffn=4, vocab=16),
                            src=1, dst=2, seed=0, mutation="lm_head_reversed"))
    made = make_entry("invariant", outcome, worst_deviation=outcome.deviation,
                      worst_ratio=outcome.ratio, profile="wsb-test", hypothesis_seed=None,
                      hypothesis_version=None)
    moved = {**made["measured"], "deviation": outcome.deviation * 2}
    entries = {"here.json": made,
               "elsewhere.json": {**made, "measured": moved, "found": {
                   **made["found"], "versions": {**made["found"]["versions"],
                                                 "cpu_vendor": "OtherVendor"}}},
               "drifted.json": {**made, "measured": moved}}
    for name, entry in entries.items():
        (tmp_path / name).write_text(json.dumps(entry))
    fixed = corpus_dir() / "4fef1ab671018ec0.json"  # rope_permute_twice, a bug since fixed
    assert wsb("replay", *(str(tmp_path / n) for n in entries), str(fixed)) == 0
    out = capsys.readouterr().out
    status = {line.split()[0]: line for line in out.splitlines() if ".json " in line}
    assert "still failing" in status["here.json"]
    assert "environment changed" in status["elsewhere.json"]
    assert "drifted" in status["drifted.json"]
    assert "fixed" in status[fixed.name]
    assert ("1 still failing, 1 environment changed, 1 drifted, 1 fixed; the project's claim "
            "holds on 4/4") in out


def test_floor_writes_samples_rules_and_plot(capsys, tmp_path):
    out_path = tmp_path / "floor.json"
    assert wsb("floor", "--random", "3", "--seed", "5", "--out", str(out_path),
               "--kernel-sets", "current") == 0  # every kernel set: test_floor_kernel_sets.py
    artifact = json.loads(out_path.read_text())
    assert artifact["geometries"] == 3 and artifact["environment"]["torch"]
    assert out_path.with_suffix(".png").stat().st_size > 1000
    assert "chosen" in capsys.readouterr().out


def test_unknown_profile_and_a_phase_without_floor_samples_are_errors(tmp_path, monkeypatch):
    with pytest.raises(WsbError, match=r"unknown profile 'ci' \(from --profile\); known: wsb-test"):
        wsb("fuzz", "--examples", "1", "--profile", "ci")
    monkeypatch.setenv("WSB_TOLERANCE_DIR", str(tmp_path))  # no random_floor_1b.json there
    with pytest.raises(ToleranceMismatch, match=r"random_floor_1b.json: no such artifact; "
                                                r"measure it with `wsb floor --random N "
                                                r"--phase 1b`"):
        wsb("fuzz", "--examples", "1", "--phase", "1b")


@pytest.mark.parametrize("argv", [["mutants", "--examples", "0"], ["fuzz", "--examples", "-3"],
                                  ["fuzz", "--minutes", "0"], ["floor", "--random", "0"]])
def test_a_budget_of_nothing_is_refused_rather_than_passed(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        wsb(*argv)
    assert exit_.value.code == 2 and "must be > 0" in capsys.readouterr().err

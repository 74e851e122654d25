"""``wsb train-check`` through ``cli_train.register`` on a parser of its own (the lead wires
it into ``wsb``): every quantity printed with its deviation and threshold, exit codes."""

import argparse

import pytest

from weight_sync_bench.cli.train import register
from weight_sync_bench.errors import InvalidConfig, InvalidMesh
from weight_sync_bench.tolerance.training import QUANTITIES
from weight_sync_bench.training.compare import EXACT


def _run(argv):
    parser = argparse.ArgumentParser(prog="wsb")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_train_check_prints_every_quantity_with_deviation_and_threshold(capsys):
    assert _run(["train-check", "--config", "small_tied_bias", "--dp", "2", "--tp", "2",
                 "--steps", "2", "--batch", "packed"]) == 0
    out = capsys.readouterr().out
    header, *rows = [line.split() for line in out.splitlines()
                     if line.startswith(("config", "small"))]
    assert header[3:6] == ["quantity", "deviation", "threshold"]
    assert [r[4] for r in rows] == [*QUANTITIES, *EXACT]
    assert all(r[-1] == "PASS" for r in rows)
    assert "1 passed, 0 failed (steps=2, seed=0, phase 1a)" in out


# The same run as test_output.py's test_train_check_mutations_shows_progress_per_case, which
# stays in the default run and asserts the same closing line (9 of 9 detected): the long run
@pytest.mark.slow
def test_train_check_mutations_reports_each_ratio(capsys):
    assert _run(["train-check", "--config", "small_tied_bias", "--dp", "2", "--tp", "2",
                 "--batch", "packed", "--mutations"]) == 0
    out = capsys.readouterr().out
    assert "9 of 9 detected, 0 identity cells skipped" in out


def test_train_check_rejects_unknown_configs_and_meshes():
    with pytest.raises(InvalidConfig, match="unknown config 'nope'"):
        _run(["train-check", "--config", "nope"])
    with pytest.raises(InvalidMesh, match=r"dp\(3\) > batch rows\(2\)"):
        _run(["train-check", "--config", "toy", "--dp", "3"])


def test_train_check_over_gloo_reads_the_phase_1b_floor(capsys):
    assert _run(["train-check", "--config", "small", "--tp", "2", "--batch", "packed",
                 "--gloo"]) == 0
    out = capsys.readouterr().out
    assert "dp=1 tp=2" in out and "1 passed, 0 failed (steps=2, seed=0, phase 1b)" in out

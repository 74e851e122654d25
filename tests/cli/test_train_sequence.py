"""``wsb train-check --sp / --cp``: the sequence-sharding meshes, their thresholds from
tolerance/sequence.json, the sequence mutations in the matrix, uneven splits rejected."""

import argparse

import pytest

from weight_sync_bench.cli.train import register
from weight_sync_bench.errors import UnevenSequence


def _run(argv):
    parser = argparse.ArgumentParser(prog="wsb")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_train_check_sp_cp_runs_the_sequence_mesh_asked_for(capsys):
    assert _run(["train-check", "--config", "small_tied_bias", "--dp", "2", "--tp", "2",
                 "--sp", "--cp", "2", "--steps", "1", "--batch", "packed"]) == 0
    out = capsys.readouterr().out
    assert "dp=2 tp=2 sp cp=2" in out and "1 passed, 0 failed" in out


def test_train_check_cp_alone_runs_every_cp_shape_without_sp(capsys):
    assert _run(["train-check", "--config", "small", "--cp", "4", "--dp", "1", "--steps", "1",
                 "--batch", "unpacked"]) == 0
    out = capsys.readouterr().out
    assert "dp=1 tp=1 cp=4" in out and "dp=1 tp=2 cp=4" in out and " sp " not in out


def test_train_check_sequence_mutations_are_all_detected(capsys):
    assert _run(["train-check", "--config", "small_tied_bias", "--dp", "2", "--tp", "2",
                 "--sp", "--cp", "2", "--steps", "1", "--batch", "packed", "--mutations"]) == 0
    out = capsys.readouterr().out
    assert "16 of 16 detected, 0 identity cells skipped" in out  # 9 training + 7 sequence


def test_train_check_rejects_an_uneven_split():
    with pytest.raises(UnevenSequence, match=r"seq_len % cp == 0 \(seq_len=8, cp=3\)"):
        _run(["train-check", "--config", "small", "--cp", "3"])

"""The ranks of one torchrun job started with different command lines: a bad option on one
rank only is refused on that rank (exit 2, its message naming the rank and the option) and
the job ends at once; options that differ across ranks are found as the ranks join, before
any work, and every rank refuses (``MismatchedOptions``, exit 2) naming each option and
every rank's value. ``tests/cli/torchrun_per_rank.py`` gives each rank its own options.
The subprocess timeouts only detect a hang."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from weight_sync_bench.cli.launch import job_options
from weight_sync_bench.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
PER_RANK = Path(__file__).with_name("torchrun_per_rank.py")
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SYNC = ("sync", "--launcher", "torchrun", "--config", "toy_kv4", "--from", "megatron:2",
        "--to", "vllm:2", "--no-forward")


def per_rank(extra: dict[int, list[str]], *argv: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2`` of ``wsb argv``, rank r's command line ending in
    ``extra[r]``."""
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([exe, "--standalone", "--nproc-per-node", "2", str(PER_RANK),
                           json.dumps({str(r): a for r, a in extra.items()}), *argv],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
                          check=False)


def _root_cause(done: subprocess.CompletedProcess[str]) -> str:
    assert "Root Cause (first observed failure):" in done.stderr, done.stdout + done.stderr
    return done.stderr.split("Root Cause (first observed failure):")[1]


# 6 s, a torchrun job of its own: the long run. The default run keeps one torchrun job
# (tests/cli/test_torchrun_check.py's phase 1b check) and, as this test's equivalent, the
# same refusal in process on a rank of a torchrun job (RANK and WORLD_SIZE set), below.
@pytest.mark.slow
def test_a_bad_option_on_one_rank_only_is_refused_there_naming_the_rank_and_the_option():
    done = per_rank({1: ["--seed", "-5"]}, *SYNC)
    assert done.returncode != 0
    assert ("wsb (rank 1 of 2) sync: error: argument --seed: must be an int in 0..2^63-1, "
            "got -5") in done.stderr
    # torchrun's agent names the rank and its exit status, 2: the input's fault; rank 0,
    # waiting for it in rendezvous, is ended by the agent's SIGTERM, not left to hang
    assert re.search(r"rank +: 1 \(local_rank: 1\)\s+exitcode +: 2 ", _root_cause(done))
    assert "wsb (rank 0 of 2)" not in done.stderr and "Traceback" not in done.stdout


def test_a_bad_option_on_a_rank_of_a_torchrun_job_is_refused_naming_the_rank_and_the_option(
        monkeypatch, capsys):
    """The default run's equivalent of the torchrun job above: rank 1's command line, in
    process, with the environment torchrun gives it; exit 2 (the input's fault) before any
    rendezvous, the message naming the rank and the option."""
    from weight_sync_bench.cli.main import main

    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exited:
        main([*SYNC, "--seed", "-5"])
    assert exited.value.code == 2
    assert ("wsb (rank 1 of 2) sync: error: argument --seed: must be an int in 0..2^63-1, "
            "got -5") in capsys.readouterr().err


# 8 s: the long run; by default a differing option is refused under torchrun (above) and
# the comparison of options is checked in process (below)
@pytest.mark.slow
def test_a_seed_that_differs_across_ranks_is_refused_on_every_rank_before_any_work():
    """Without the check, each rank would load its source shards from its own seed: a sync
    of values no rank 0 reference describes."""
    done = per_rank({1: ["--seed", "7"]}, *SYNC)
    assert done.returncode != 0
    for rank in (0, 1):
        assert (f"wsb (rank {rank} of 2) sync: the 2 ranks of this torchrun job were started "
                f"with different options (this is rank {rank};") in done.stderr, done.stderr
    assert done.stderr.count("  --seed: 0 on rank 0, 7 on rank 1\n") == 2
    assert "--config" not in done.stderr.split("different options")[1].split("every rank of")[0]
    assert re.search(r"exitcode +: 2 ", _root_cause(done))
    assert "PASS" not in done.stdout and "FAIL" not in done.stdout  # nothing was synced


@pytest.mark.slow
def test_a_config_that_differs_across_ranks_of_wsb_check_is_named_as_typed():
    """``wsb check --launcher torchrun`` (rank 0 drives, the others serve) agrees the same
    way; ``--from`` is named as typed, not by its destination ``convert_from``."""
    done = per_rank({1: ["--config", "toy", "--from", "megatron:2"]}, "check", "--launcher",
                    "torchrun", "--config", "toy_kv4", "--src", "2", "--dst", "2")
    assert done.returncode != 0
    assert "  --config: toy_kv4 on rank 0, toy on rank 1\n" in done.stderr, done.stderr
    assert "  --from: (not given) on rank 0, megatron:2 on rank 1\n" in done.stderr
    assert re.search(r"exitcode +: 2 ", _root_cause(done))


@pytest.mark.slow
def test_options_only_rank_0_uses_may_differ_and_equal_options_pass():
    """The twin: the same options on both ranks, one rank quiet (only rank 0 prints): the
    sync runs and passes, so the check refuses differences, not every job."""
    done = per_rank({0: ["--seed", "7"], 1: ["--seed", "7", "-q"]}, *SYNC)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "different options" not in done.stderr and "PASS" in done.stdout


def test_the_options_compared_are_spelled_as_typed_and_leave_out_what_rank_0_alone_uses():
    args = build_parser().parse_args(["sync", "--from", "megatron:4", "--seed", "3", "-q",
                                      "--json"])
    options = job_options(args)
    assert options["--from"] == "megatron:4" and options["--to"] == "vllm:2"  # dest src, dst
    assert options["--seed"] == "3" and options["--deadline"] == "(not given)"
    assert not {"--quiet", "--json", "quiet", "json", "func", "command"} & set(options)

"""``wsb check --launcher torchrun``: the phase 1b check on the ranks of a torchrun job
(standalone rendezvous, gloo), rank 0 alone printing; what cannot run is refused naming why;
and (``-m slow``) what the job's watchdog and torchrun's agent say of a rank that raises,
hangs or dies."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weight_sync_bench.cli.main import main
from weight_sync_bench.collectives.gloo.pool import is_alive

ROOT = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).with_name("torchrun_faults.py")
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


RESHARDERS = """
from weight_sync_bench import layout_for, reshard, TOY_KV4

def good(shards, dst):
    return reshard(shards, layout_for(TOY_KV4), dst)

def chunked(shards, dst):  # gate_up cut in plain chunks: gate and up pairs broken
    out = good(shards, dst)
    full = [s["layers.0.gate_up.weight"] for s in good(shards, 1)][0]
    for rank, piece in enumerate(full.chunk(dst)):
        out[rank]["layers.0.gate_up.weight"] = piece.clone()
    return out
"""


def torchrun(*args: str, timeout: float = 240, cwd: Path = ROOT
             ) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([exe, "--standalone", "--nproc-per-node", "2", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
                          check=False)


def test_the_phase_1b_check_runs_under_torchrun_and_rank_0_alone_prints():
    done = torchrun("-m", "weight_sync_bench", "check", "--launcher", "torchrun", "--config",
                    "toy", "--src", "2", "--dst", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"toy +2 -> 2 +1b .* PASS", done.stdout), done.stdout
    assert done.stdout.count("1 passed, 0 failed") == 1  # rank 0 alone prints


@pytest.fixture
def outside_torchrun(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: nccl is accepted")
def test_nccl_without_cuda_is_refused_naming_why_under_either_launcher(capsys, outside_torchrun):
    for launcher in ("pool", "torchrun"):
        assert main(["check", "--launcher", launcher, "--backend", "nccl", "--config", "toy",
                     "--src", "1", "--dst", "1", "-q"]) == 2
        assert "--backend nccl needs CUDA, and torch.cuda.is_available() is False" in \
            capsys.readouterr().err


def test_torchrun_outside_a_torchrun_job_and_inprocess_under_it_are_refused(capsys,
                                                                           outside_torchrun):
    assert main(["check", "--launcher", "torchrun", "--config", "toy", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--launcher torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" \
        in err and "weight_sync_bench check --launcher torchrun" in err
    assert main(["check", "--launcher", "torchrun", "--backend", "inprocess", "-q"]) == 2
    assert "--backend inprocess runs every rank in this process" in capsys.readouterr().err


def test_the_pool_launcher_is_the_default_and_keeps_the_in_process_check(capsys):
    assert main(["check", "--config", "toy", "--src", "1", "--dst", "2", "-q"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["chunked", "good"])
def test_a_users_resharder_under_torchrun_fails_or_passes_with_rank_0_naming_it(fn, tmp_path):
    (tmp_path / "my_resharders.py").write_text(RESHARDERS)
    done = torchrun("-m", "weight_sync_bench", "check", "--launcher", "torchrun", "--config",
                    "toy_kv4", "--src", "2", "--dst", "2", "--resharder", f"my_resharders:{fn}",
                    cwd=tmp_path)
    if fn == "good":  # the twin: the same launch passes a correct resharder
        assert done.returncode == 0, done.stdout + done.stderr
        assert "1 passed, 0 failed" in done.stdout
        return
    assert done.returncode != 0
    assert "FAIL toy_kv4 2 -> 2 (phase 1b)" in done.stdout, done.stdout + done.stderr
    assert "0 passed, 1 failed" in done.stdout
    assert re.search(r"rank +: 0 \(local_rank: 0\)\s+exitcode +: 1 ", done.stderr), done.stderr


@pytest.mark.slow
def test_a_hung_rank_is_named_by_rank_0_with_its_own_stacks():
    done = torchrun(str(FAULTS), "stall", "1", "3")
    assert done.returncode != 0
    assert "RAISED RankTimeout stuck=(1,) rank=1 " in done.stdout, done.stdout + done.stderr
    assert "rank 1 did not report within the deadline of 3 s" in done.stderr
    assert "Timeout (0:00:03)!" in done.stderr and "in _fire" in done.stderr  # its own stack


@pytest.mark.slow
def test_a_raising_rank_is_named_with_its_error_and_breadcrumb():
    done = torchrun(str(FAULTS), "raise", "1", "5")
    assert "RAISED RankFailure stuck=None rank=1" in done.stdout, done.stdout + done.stderr
    assert "rank 1 raised InjectedFault during task phase1b_task at t=2" in done.stderr


@pytest.mark.slow
def test_a_dead_rank_is_named_by_torchrun_s_agent():
    done = torchrun(str(FAULTS), "kill", "1", "30")
    assert done.returncode != 0
    root = done.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank +: 1 \(local_rank: 1\)\s+exitcode +: -9 .*\(SIGKILL\)", root), root


@pytest.mark.slow
def test_without_a_fault_each_rank_gets_its_own_arguments_and_the_check_passes():
    done = torchrun(str(FAULTS), "none", "0", "30")
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout + done.stderr
    assert "ECHO [(0, 1, 'c', 'v0')]" in done.stdout  # rank 1 idle
    assert "ECHO [(0, 2, 'c', 'v0'), (1, 2, 'c', 'v1')]" in done.stdout  # each its own


@pytest.mark.slow
def test_ranks_whose_torchrun_agent_was_killed_exit_saying_so_rather_than_hang():
    """SIGKILL of torchrun's agent, the process that starts the ranks, while rank 1 is stuck
    and rank 0 waits for it: the agent starts its workers in sessions of their own, so they
    outlive it, and nothing would end them. Each rank sees its parent go within half a second,
    says so on its stderr, and exits 70. The waits below only detect a hang. (The twin: under a
    live agent, the stuck rank is named by rank 0, test_a_hung_rank_is_named_by_rank_0...)"""
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["OMP_NUM_THREADS"] = "1"
    agent = subprocess.Popen([exe, "--standalone", "--nproc-per-node", "2", str(FAULTS),
                              "orphan", "1", "300"], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids: list[int] = []
    try:
        ready = agent.stdout.readline()  # rank 0's, through the agent's inherited pipe
        found = re.match(r"READY \[(\d+), (\d+)\]", ready)
        assert found, ready + agent.stderr.read()
        pids = [int(p) for p in found.groups()]
        agent.kill()
        agent.wait(timeout=60)
        out, err = agent.communicate(timeout=120)  # the pipes close once the ranks exit too
    finally:
        agent.kill()
        for pid in pids:  # a failed test leaves no orphan behind
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
    for rank in (0, 1):
        assert f"rank {rank}: its parent, torchrun's agent (pid {agent.pid}), is gone; " \
            "exiting 70" in err, out + err
    assert not any(is_alive(pid) for pid in pids)

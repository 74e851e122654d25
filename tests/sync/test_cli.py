"""``wsb sync``: the plan, bytes against ``B_min``, time against ``T_min``, memory per rank and
the verdict; exit 0 when the checks pass, 1 when they fail, 2 for what this machine or
launcher cannot run; and the same rank side launched by torchrun (gloo, standalone)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.breadth import breadth
from tests.hf_configs import TINY_LLAMA
from weight_sync_bench.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_llama(tmp_path):
    """``--hf-config`` of a one-layer Llama of width 64 (vocabulary 512): for the runs with
    ``--no-forward``, whose steps, exit codes and lines are the same at any width; TOY_KV4's
    19M parameters made each 1.5-2.7 s, this 0.1-0.3 s. The forward needs a committed
    geometry's floor: those runs stay on toy_kv4."""
    path = tmp_path / "tiny_llama" / "config.json"  # a geometry is named by its directory
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_LLAMA))
    return ["--hf-config", str(path), "--layers", "1"]


def test_wsb_sync_prints_the_figures_and_the_verdict_and_exits_0(capsys):
    code = main(["sync", "--config", "toy_kv4", "--from", "megatron:2", "--to", "vllm:1", "-q"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("plan megatron:2 -> vllm:1 for toy_kv4: world 2, ")
    for claim in ("(counted at the transport), B_min 38666240: 1.000x", "T_min ",
                  "GB/s calibrated gloo p2p", "staging peak  RSS extra",
                  "100% coverage, bit-exact", "PASS toy_kv4 megatron:2 -> vllm:1 (phase 2)"):
        assert claim in out, claim


def test_wsb_sync_shows_its_steps_with_an_eta_on_stderr_unless_quiet(capsys, tiny_llama):
    code = main(["sync", *tiny_llama, "--from", "megatron:2", "--to", "vllm:1",
                 "--naive", "--no-forward"])
    err = capsys.readouterr().err
    assert code == 0
    assert ("wsb sync megatron:2 -> vllm:1: starting the rank processes, loading the source "
            "shards: 0/3, ") in err and "ETA ?" in err
    assert "wsb sync megatron:2 -> vllm:1: done: 3/3, " in err and "ETA 0s" in err


def test_wsb_sync_exits_1_when_a_planner_mutation_is_run(capsys, tiny_llama):
    code = main(["sync", *tiny_llama, "--from", "megatron:2", "--to", "vllm:1",
                 "--mutation", "dropped_transfer", "--no-forward", "-q"])
    out = capsys.readouterr().out
    assert code == 1 and "DIFFERENT" in out
    assert "FAIL tiny_llama megatron:2 -> vllm:1 (phase 2, " in out
    assert "mutation dropped_transfer)" in out  # the dropped rows hold zeros: nothing wrote them
    assert ("    rank 0 lm_head.weight holds vocabulary rows 0-255, zeros x256; declared "
            "vocabulary rows 0-511\n") in out


def test_nccl_without_cuda_and_torchrun_outside_torchrun_are_refused_naming_why(capsys,
                                                                              monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert main(["sync", "--backend", "nccl"]) == 2
    assert "--backend nccl needs CUDA, and torch.cuda.is_available() is False" in \
        capsys.readouterr().err
    assert main(["sync", "--launcher", "torchrun"]) == 2
    assert ("--launcher torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not "
            "set") in capsys.readouterr().err


@pytest.mark.parametrize("into", [
    "fresh",
    # nightly: the same job into existing storage (~10 s of the default run's torchrun
    # start-ups). Its rank side is the pool's existing_task, which the default run covers
    # through the pool (tests/sync/test_existing.py: a dropped transfer into stale tensors
    # fails); under torchrun nothing in the output tells the two storages apart but the line
    # asserted below.
    pytest.param("existing", marks=pytest.mark.slow)])
# 11 s: the long run; by default torchrun launches a check (tests/cli/test_torchrun_check.py)
# and the sync runs through the rank pool (the tests above)
@pytest.mark.slow
def test_the_sync_runs_under_torchrun_with_gloo_and_env_rendezvous(into):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "weight_sync_bench", "sync",
         "--launcher", "torchrun", "--config", "toy_kv4", "--from", "megatron:2", "--to",
         "vllm:1", "--into", into, "-q"], capture_output=True, text=True, timeout=240,
        cwd=ROOT, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "B_min 38666240: 1.000x" in done.stdout
    assert "100% coverage, bit-exact" in done.stdout
    assert "PASS toy_kv4 megatron:2 -> vllm:1 (phase 2)" in done.stdout
    assert "launched by torchrun (2 ranks, gloo)" in done.stdout
    assert ("into existing destination storage" in done.stdout) == (into == "existing")
    assert done.stdout.count("plan megatron:2 -> vllm:1") == 1  # rank 0 alone prints


# By default on tiny_llama with --no-forward (0.2 s: the existing storage, B_min and every
# element, as the report prints them); on toy_kv4 with the forward in the long run (2 s). By
# default the forward reading existing storage passes in tests/test_docs_run.py, which runs
# the distributed guide's `wsb sync --config toy_kv4 --from megatron:4 --to vllm:2 --into
# existing` (exit 0, the forward included).
@pytest.mark.parametrize("model", breadth(["tiny_llama", "toy_kv4"], keep={"tiny_llama"}))
def test_wsb_sync_into_existing_storage_passes_the_element_check_and_the_forward(model, capsys,
                                                                                 request):
    """The forward reads the existing tensors the second (``init_params``) reshard wrote
    into (a dropped transfer into them: ``tests/sync/test_existing.py``)."""
    if model == "toy_kv4":  # the forward's verdict closes the report
        args, b_min, verdict = ["--config", "toy_kv4"], 38666240, "(phase 2)"
    else:  # the element check's verdict, naming the executor, is the report's
        args, b_min = [*request.getfixturevalue("tiny_llama"), "--no-forward"], 200704
        verdict = "(phase 2, weight_sync_bench.sync.execute:execute_plan)"
    assert main(["sync", *args, "--from", "megatron:2", "--to", "vllm:1",
                 "--into", "existing", "-q"]) == 0
    out = capsys.readouterr().out
    for claim in ("into existing destination storage, T_min ",
                  f"(counted at the transport), B_min {b_min}: 1.000x",
                  "100% coverage, bit-exact", f"PASS {model} megatron:2 -> vllm:1 {verdict}"):
        assert claim in out, claim


@pytest.mark.parametrize("flag", ["--mutation", "--naive"])
def test_pool_only_options_are_refused_under_torchrun(flag, capsys, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    args = ["sync", "--launcher", "torchrun", flag] + {"--mutation": ["box_overlap"]}.get(flag, [])
    assert main(args) == 2
    assert "run on the rank pool only" in capsys.readouterr().err


def test_a_users_config_json_syncs_with_the_element_check_and_its_forward_is_refused(
        tmp_path, capsys):
    """``--hf-config`` is the geometry the user holds; no phase 1b floor covers it, so the
    forward is refused before any rank starts (exit 2, naming the geometry, why no floor
    covers it, the command that measures one and ``--no-forward``), and the element check, bytes and memory run with
    ``--no-forward``."""
    path = tmp_path / "tiny_llama" / "config.json"  # a geometry is named by its directory
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_LLAMA))
    model = ["--hf-config", str(path), "--layers", "1", "--from", "megatron:2", "--to", "vllm:4"]
    assert main(["sync", *model, "-q"]) == 2
    err = capsys.readouterr().err
    assert "the destination forward of tiny_llama needs a phase 1b floor (tiny_llama: no " \
        "measured floor covers this check (phase 1b" in err
    # the command that measures it, for the user's own config.json
    assert f"Measure it with `wsb floor geometry --hf-config {path} --layers 1 --phase 1b`" in err
    assert "; --no-forward checks every destination" in err
    assert main(["sync", *model, "--no-forward", "-q"]) == 0
    out = capsys.readouterr().out
    for claim in ("plan megatron:2 -> vllm:4 for tiny_llama: world 4", ": 1.000x",
                  "100% coverage, bit-exact", "PASS tiny_llama megatron:2 -> vllm:4 (phase 2"):
        assert claim in out, claim
    assert main(["sync", *model, "--no-forward", "--mutation", "qk_swapped", "-q"]) == 1
    assert "FAIL tiny_llama megatron:2 -> vllm:4 (phase 2, " in capsys.readouterr().out


def test_wsb_sync_checks_a_users_distributed_resharder(capsys, tiny_llama):
    """``--resharder MOD:FN``: the user's fn(ctx, rank, local, plan) instead of the harness's
    executor, judged as check_distributed_reshard judges it: a correct one exits 0, one
    that flips a bit exits 1 naming the tensor, one that raises exits 4 naming itself."""
    base = ["sync", *tiny_llama, "--from", "megatron:2", "--to", "vllm:1",
            "--no-forward", "-q", "--resharder"]
    assert main([*base, "tests.sync.resharders:returns_fresh_tensors"]) == 0
    assert "tests.sync.resharders:returns_fresh_tensors" in capsys.readouterr().out
    assert main([*base, "tests.sync.resharders:flip_one_bit"]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    assert main([*base, "tests.sync.resharders:raises"]) == 4
    assert "your resharder tests.sync.resharders:raises raised" in capsys.readouterr().err
    assert main([*base, "tests.sync.resharders:flip_one_bit", "--mutation",
                 "dropped_transfer"]) == 2

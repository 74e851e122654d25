"""``--launcher pool|torchrun`` (issue 30, the mutation pass over ``cli/launch.py``): what a
subcommand runs under each launcher and backend, what every rank of a torchrun job must agree
on, and what is refused, word for word.

The job is stood in (``TorchrunRanks`` records what it was opened with, serves or closes;
``stand_in`` records what it was handed), so each test checks every argument and the order of
the calls in milliseconds. The real job is ``test_torchrun_check.py``'s."""

from __future__ import annotations

import argparse

import pytest

from weight_sync_bench.cli import launch as L
from weight_sync_bench.collectives.gloo import pool, torchrun
from weight_sync_bench.errors import UnsupportedLauncher


def args(**kw) -> argparse.Namespace:
    base = {"launcher": "pool", "backend": None, "deadline": None, "command": "check",
            "quiet": True, "json": False, "func": print, "option_names": {"src": "--from"},
            "src": 4, "config": None}
    return argparse.Namespace(**{**base, **kw})


def test_the_launcher_option_defaults_to_the_pool():
    parser = argparse.ArgumentParser()
    L.add_launcher_option(parser)
    assert parser.parse_args([]).launcher == "pool"
    assert parser.parse_args(["--launcher", "torchrun"]).launcher == "torchrun"
    with pytest.raises(SystemExit):
        parser.parse_args(["--launcher", "ssh"])
    assert L.LAUNCHERS == ("pool", "torchrun")


def test_option_names_are_each_options_longest_spelling_positionals_left_out():
    parser = argparse.ArgumentParser()
    parser.add_argument("-s", "--from", dest="src")
    parser.add_argument("--to", "--destination", dest="dst")
    parser.add_argument("path")
    assert L.option_names(parser) == {"help": "--help", "src": "--from",
                                      "dst": "--destination"}


def test_job_options_are_every_option_but_the_rank_local_ones_as_typed():
    assert L.job_options(args(launcher="torchrun", deadline=7.5)) == {
        "launcher": "torchrun", "backend": "(not given)", "deadline": "7.5",
        "--from": "4", "config": "(not given)"}
    assert L.RANK_LOCAL == ("quiet", "json", "func", "command", "option_names", "own_process")
    bare = argparse.Namespace(src=2, quiet=False)
    assert L.job_options(bare) == {"src": "2"}  # no names recorded: the destinations


# ---- on the pool ---------------------------------------------------------------------------------

def ran(seen):
    def fn(a):
        seen.append((a.backend, a.deadline))
        return 7
    return fn


def test_on_the_pool_the_backend_defaults_to_the_commands_own():
    seen = []
    assert L.launched(ran(seen))(args()) == 7
    assert L.launched(ran(seen), pool_default="gloo")(args()) == 7
    assert L.launched(ran(seen))(args(backend="gloo", deadline=3.0)) == 7
    assert seen == [("inprocess", None), ("gloo", None), ("gloo", 3.0)]


def test_nccl_on_the_pool_is_refused_after_asking_for_cuda(monkeypatch):
    asked = []
    monkeypatch.setattr(L, "device_for", lambda backend, rank: asked.append((backend, rank)))
    seen = []
    with pytest.raises(UnsupportedLauncher) as e:
        L.launched(ran(seen))(args(backend="nccl"))
    assert str(e.value) == ("--backend nccl needs --launcher torchrun (the rank pool runs gloo "
                            "on CPU)")
    assert asked == [("nccl", 0)] and not seen

    def no_cuda(backend, rank):
        raise UnsupportedLauncher("--backend nccl needs CUDA")
    monkeypatch.setattr(L, "device_for", no_cuda)
    with pytest.raises(UnsupportedLauncher, match="needs CUDA"):
        L.launched(ran(seen))(args(backend="nccl"))


# ---- under torchrun ------------------------------------------------------------------------------

class Ranks:
    """``TorchrunRanks`` stood in: ``rank`` is class-wide, each instance records its life."""

    rank = 0
    log: list

    def __init__(self, backend, *, deadline, command, options):
        self.log.append(("open", backend, deadline, command, options))

    def serve(self):
        self.log.append(("serve",))

    def close(self):
        self.log.append(("close",))


@pytest.fixture
def job(monkeypatch):
    log = []
    Ranks.log, Ranks.rank = log, 0
    monkeypatch.setattr(torchrun, "TorchrunRanks", Ranks)
    monkeypatch.setattr(pool, "stand_in", lambda ranks: log.append(
        ("stand_in", None if ranks is None else type(ranks).__name__)))
    return log


def test_rank_0_runs_the_command_on_the_jobs_ranks_then_lets_them_go(job, capsys):
    seen = []
    a = args(launcher="torchrun", deadline=12.0)
    options = L.job_options(a)
    assert L.launched(ran(seen))(a) == 7
    assert seen == [("gloo", None)]  # the job's deadline is set; the command's is dropped
    assert job == [("open", "gloo", 12.0, "check", options), ("stand_in", "Ranks"),
                   ("stand_in", None), ("close",)]
    assert capsys.readouterr().err == ""


def test_the_jobs_deadline_defaults_to_300_seconds(job):
    L.launched(ran([]))(args(launcher="torchrun", backend="gloo"))
    assert job[0][1:3] == ("gloo", 300.0)


def test_the_other_ranks_serve_and_exit_0_without_running_the_command(job):
    Ranks.rank = 2
    seen = []
    assert L.launched(ran(seen))(args(launcher="torchrun")) == 0
    assert not seen
    assert [e[0] for e in job] == ["open", "stand_in", "serve", "stand_in", "close"]


def test_nccl_under_torchrun_says_its_tensors_stay_on_cpu(job, capsys):
    seen = []
    assert L.launched(ran(seen))(args(launcher="torchrun", backend="nccl")) == 7
    assert job[0][1] == "nccl" and seen == [("gloo", None)]
    assert capsys.readouterr().err == (
        "note: --backend nccl: the job's groups are cpu:gloo,cuda:nccl; the phase 1b check's "
        "tensors stay on CPU (its floor was measured on CPU fp32), so its collectives ran "
        "over gloo\n")


def test_a_failing_command_still_releases_the_job(job):
    def fails(a):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        L.launched(fails)(args(launcher="torchrun"))
    assert job[-2:] == [("stand_in", None), ("close",)]


def test_an_in_process_backend_under_torchrun_is_refused_before_the_job_opens(job):
    with pytest.raises(UnsupportedLauncher) as e:
        L.launched(ran([]))(args(launcher="torchrun", backend="inprocess"))
    assert str(e.value) == ("--backend inprocess runs every rank in this process; under "
                            "--launcher torchrun the ranks are the job's processes: --backend "
                            "gloo (the default) or nccl")
    assert job == []

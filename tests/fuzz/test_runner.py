"""The fuzz runner as a library: progress events, then one report; failures recorded and
written to the corpus, never raised; budgets in examples or minutes."""

import pytest

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import LauncherCrash, RankCrash, WsbError
from weight_sync_bench.fuzz.runner import (
    FuzzReport,
    HarnessFault,
    Progress,
    format_report,
    fuzz,
)
from weight_sync_bench.model.sharded import ShardedModel


def _run(**kwargs):
    events = list(fuzz(master_seed=4, **kwargs))
    *progress, report = events
    assert progress and all(isinstance(p, Progress) for p in progress)
    assert isinstance(report, FuzzReport)
    return progress, report


def test_examples_budget_gives_every_property_that_many_and_counts_monotonically():
    progress, report = _run(examples=6, chunk=4, mutations=["kv_swapped", "lm_head_reversed"])
    assert [t.label for t in report.tallies] == ["invariant", "kill[kv_swapped]",
                                                 "kill[lm_head_reversed]"]
    invariant, *kills = report.tallies
    assert all(t.examples == 6 for t in kills) and not report.failures
    # an invariant example checks every degree pair of its geometry (up to 3 x 3 in the
    # domain), each counted: its budget is met, and passed by at most one round's pairs
    assert 6 <= invariant.examples < 6 + 4 * 9
    counts = [p.examples for p in progress]
    total = sum(t.examples for t in report.tallies)
    assert counts == sorted(counts) and counts[-1] == total
    assert f"{total} examples in" in format_report(report)


def _dropped_lm_head_forward(config, shards, tokens):
    broken = [{n: (x * 0 if n == "lm_head.weight" and r == len(shards) - 1 else x)
               for n, x in p.items()} for r, p in enumerate(shards)]
    return ShardedModel(config, broken, InProcessCollective(len(shards)))(tokens)[0]


def test_a_failing_property_is_recorded_written_and_the_run_goes_on(tmp_path):
    _, report = _run(examples=3, chunk=3, mutations=[], forward=_dropped_lm_head_forward,
                     corpus_path=tmp_path)
    (failure,) = report.failures
    assert failure.prop == "invariant" and failure.outcome.ratio > 1
    (tally,) = report.tallies
    assert tally.failures == 1 and tally.new_entries == list(tmp_path.glob("*.json"))
    assert "1 failures" in format_report(report)


def test_exactly_one_budget_is_required():
    with pytest.raises(WsbError, match="exactly one budget: minutes or examples"):
        list(fuzz(minutes=1, examples=1))


def test_the_replay_profile_runs_the_corpus_once_and_stops():
    _, report = _run(examples=50, chunk=10, profile="wsb-replay", invariant=False,
                     mutations=["contiguous_qkv", "gate_up_swapped"])
    by_label = {t.label: t.examples for t in report.tallies}
    assert by_label["kill[contiguous_qkv]"] >= 1  # its committed corpus entry
    assert by_label["kill[gate_up_swapped]"] == 0  # no entry, nothing generated


def test_the_invariant_and_a_kill_hold_over_gloo_through_the_rank_pool(tmp_path):
    """Phase 1b fuzzing: random geometries through the shared rank pool, each judged by the
    phase-1b rule (tolerance/random_floor_1b.json), never phase 1a's."""
    from weight_sync_bench.check.forwards import gloo_forward
    from weight_sync_bench.collectives.gloo.pool import shared_pool

    _, report = _run(examples=4, chunk=4, phase="1b", forward=gloo_forward(shared_pool(4)),
                     mutations=["o_proj_reversed"], corpus_path=tmp_path)
    assert not report.failures and not list(tmp_path.glob("*.json"))
    # at least the budget (the corpus's explicit examples come on top)
    assert {t.label for t in report.tallies} == {"invariant", "kill[o_proj_reversed]"}
    assert all(t.examples >= 4 for t in report.tallies)


def test_a_harness_fault_says_a_killed_forkserver_ended_the_rank_not_the_rank_itself():
    launcher = LauncherCrash("x", launcher="forkserver", launcher_pid=41,
                             launcher_end="killed by SIGKILL", rank=0)
    assert HarnessFault("invariant", None, launcher).how == (
        "exited: its parent, the forkserver (pid 41), ended (killed by SIGKILL)")
    # the twin: a rank killed on its own is named by its own signal
    crash = RankCrash("x", signal_name="SIGKILL", exit_code=-9, rank=1)
    assert HarnessFault("invariant", None, crash).how == "killed by SIGKILL"

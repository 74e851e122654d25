"""An interrupt ends a fuzz run with the report of what ran wherever it lands: inside a
property's run, at a progress yield, or between a round's steps (its tallying), where the
generator once let it escape and the CLI printed nothing (seen under load, once in a few
full runs, as ``tests/cli/test_interrupts.py`` failing on an empty summary)."""

import pytest

from weight_sync_bench.fuzz import runner
from weight_sync_bench.fuzz.runner import FuzzReport, Progress, fuzz

WORK = [("invariant", None), ("kill", "kv_swapped")]


def _counting_run(prop, mutation, *, max_examples, tally, **_):
    tally.examples += max_examples
    return tally


def _events(tmp_path):
    return fuzz(examples=6, chunk=2, master_seed=1, work=WORK, run=_counting_run,
                threshold_rule=lambda config: 1.0, corpus_path=tmp_path)


@pytest.mark.parametrize("landing", [2, 5])  # the first round's tallying; a later round's
def test_an_interrupt_while_a_round_is_tallied_ends_the_run_with_its_report(
        landing, tmp_path, monkeypatch):
    real, calls = runner._merge, []

    def merge_then_interrupted(into, tally):
        real(into, tally)
        calls.append(tally)
        if len(calls) == landing:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_merge", merge_then_interrupted)
    *progress, report = list(_events(tmp_path))
    assert all(isinstance(p, Progress) for p in progress) and len(progress) == landing - 1
    assert isinstance(report, FuzzReport) and isinstance(report.interrupted, KeyboardInterrupt)
    assert report.stopped == "interrupted (KeyboardInterrupt)"
    assert sum(t.examples for t in report.tallies) == 2 * landing  # what ran, every chunk


def test_the_twin_uninterrupted_runs_its_whole_budget(tmp_path):
    *progress, report = list(_events(tmp_path))
    assert len(progress) == 6 and report.interrupted is None and report.stopped is None
    assert [t.examples for t in report.tallies] == [6, 6]

"""``cli.fuzz._run_fuzz``, the one consumer of the fuzz runner's events for ``wsb fuzz`` and
``wsb mutants``, with the runner, the deadline and the forwards stood in: the phase it asks
for decides the deadline's kind and the forward, the environment's notes are printed, every
progress event is drawn, and the report is what it returns."""

import argparse

import pytest

from weight_sync_bench.cli import fuzz as cli_fuzz
from weight_sync_bench.fuzz import runner
from weight_sync_bench.fuzz.runner import FuzzReport, Progress
from weight_sync_bench.tolerance import sampled


class Out:
    def __init__(self):
        self.notes, self.shown, self.closed = [], [], 0

    def note(self, text):
        self.notes.append(text)

    def progress(self):
        return self

    def show(self, text):
        self.shown.append(text)

    def close(self):
        self.closed += 1


@pytest.mark.parametrize(("phase", "gloo"), [("1a", False), ("1b", True)])
def test_the_phase_decides_the_deadline_and_the_forward_and_the_report_is_returned(
        phase, gloo, monkeypatch):
    seen = {}
    report = FuzzReport([], 0.5, "wsb-test", 3, [])

    def fuzz(**kwargs):
        seen["fuzz"] = kwargs
        yield Progress(2, 0, 1.0, "invariant")
        yield Progress(4, 1, 2.0, "kill[kv_swapped]")
        yield report

    monkeypatch.setattr(runner, "fuzz", fuzz)
    monkeypatch.setattr(cli_fuzz, "apply_deadline",
                        lambda deadline, gloo: seen.setdefault("deadline", (deadline, gloo)))
    monkeypatch.setattr(cli_fuzz, "phase_forward", lambda p: f"forward of {p}")
    monkeypatch.setattr(sampled, "environment_notes", lambda p: [f"note of {p}"])
    args = argparse.Namespace(deadline=7.5, phase=phase, profile="wsb-test", seed=3)
    out = Out()
    assert cli_fuzz._run_fuzz(args, out, examples=9) is report
    assert seen["deadline"] == (7.5, gloo)
    assert seen["fuzz"] == {"phase": phase, "profile": "wsb-test", "master_seed": 3,
                            "forward": f"forward of {phase}", "examples": 9}
    assert out.notes == [f"note of {phase}"] and out.closed == 1
    assert out.shown == [Progress(2, 0, 1.0, "invariant").line(),
                         Progress(4, 1, 2.0, "kill[kv_swapped]").line()]

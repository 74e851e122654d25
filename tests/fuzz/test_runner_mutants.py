"""``fuzz.runner.fuzz``'s own decisions, with the property runs stood in (``run=``): which
argument a refusal names, the budgets it hands each round, the threshold rule and seeds it
passes on, where it refuses an unwritable corpus, which targets it asks for, and when a
budget in minutes ends the run (on a clock of its own). Written against the mutants that
``tests/fuzz/test_runner.py`` and the CLI's fuzz tests let survive."""

import random

import pytest

from weight_sync_bench.errors import InvalidNumber, RankCrash, WsbError
from weight_sync_bench.fuzz import runner
from weight_sync_bench.fuzz.runner import FuzzReport, HarnessFault, fuzz

WORK = [("invariant", None)]


class Runs:
    """A stand-in for ``run_property``: records what each round is handed, counts each
    round's budget as examples run, and may advance a clock or record a fault."""

    def __init__(self, clock=None, step=0.0, fault=False):
        self.calls, self.clock, self.step, self.fault = [], clock, step, fault

    def __call__(self, prop, mutation, *, tally, **kwargs):
        self.calls.append({**kwargs, "tally": (prop, mutation, tally.prop, tally.mutation)})
        tally.examples += kwargs["max_examples"]
        if self.clock is not None:
            self.clock.now += self.step
        if self.fault:
            tally.faults.append(HarnessFault(tally.label, None, RankCrash("down", rank=1)))
        return tally


def _report(tmp_path, run, **kwargs):
    kwargs.setdefault("work", WORK)
    kwargs.setdefault("threshold_rule", "rule")
    *_, report = fuzz(run=run, corpus_path=tmp_path, **kwargs)
    assert isinstance(report, FuzzReport)
    return report


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"minutes": 0}, "minutes must be a finite number > 0, got 0"),
    ({"examples": 0}, "examples must be an int >= 1, got 0"),
    ({"examples": 1, "chunk": 0}, "chunk must be an int >= 1, got 0"),
    ({"examples": 1, "max_faults": 0}, "max_faults must be an int >= 1, got 0"),
    ({"examples": 1, "master_seed": -1}, "master_seed must be an int in 0..2^63-1, got -1"),
])
def test_each_refusal_names_its_argument(kwargs, message, tmp_path):
    run = Runs()
    with pytest.raises(InvalidNumber) as err:
        _report(tmp_path, run, **kwargs)
    assert str(err.value) == message and not run.calls
    with pytest.raises(WsbError) as both:
        _report(tmp_path, run, minutes=1, examples=1)
    assert str(both.value) == "fuzz needs exactly one budget: minutes or examples"


def test_rounds_of_25_examples_by_default_and_three_faults_stop_the_run(tmp_path):
    run = Runs()
    _report(tmp_path, run, examples=30)
    assert [c["max_examples"] for c in run.calls] == [25, 5]
    faulty = Runs(fault=True)
    report = _report(tmp_path, faulty, examples=1000, chunk=1)
    assert len(faulty.calls) == 3 and len(report.faults) == 3
    assert report.stopped == "stopped after 3 harness faults (max_faults=3)"


def test_the_rule_given_is_passed_on_else_the_phases_own(tmp_path, monkeypatch):
    run = Runs()
    _report(tmp_path, run, examples=1, threshold_rule="mine")
    assert run.calls[0]["threshold_rule"] == "mine"
    monkeypatch.setattr(runner, "fuzz_threshold_rule", lambda phase: f"rule of {phase}")
    _report(tmp_path, run, examples=1, phase="1b", threshold_rule=None)
    assert run.calls[1]["threshold_rule"] == "rule of 1b" and run.calls[1]["phase"] == "1b"


def test_the_rounds_seeds_come_from_the_master_seed_else_from_32_fresh_bits(tmp_path,
                                                                             monkeypatch):
    run = Runs()
    report = _report(tmp_path, run, examples=3, chunk=1, master_seed=7)
    expected = random.Random(7)
    assert report.master_seed == 7
    assert [c["seed"] for c in run.calls] == [expected.getrandbits(32) for _ in range(3)]

    class Fresh:
        def getrandbits(self, k):
            return 2 ** k - 1

    monkeypatch.setattr(runner.random, "SystemRandom", Fresh)
    again = Runs()
    report = _report(tmp_path, again, examples=1)
    assert report.master_seed == 2 ** 32 - 1
    assert again.calls[0]["seed"] == random.Random(2 ** 32 - 1).getrandbits(32)


def test_the_corpus_is_refused_before_any_round_and_none_is_not_checked(tmp_path,
                                                                        monkeypatch):
    checked = []
    monkeypatch.setattr(runner, "writable_corpus", checked.append)
    _report(tmp_path, Runs(), examples=1)
    assert checked == [tmp_path]
    monkeypatch.setattr(runner, "_corpus_or_none", lambda: None)
    *_, report = fuzz(run=Runs(), work=WORK, threshold_rule="rule", examples=1)
    assert checked == [tmp_path] and report.corpus is None


@pytest.mark.parametrize(("phase", "conversions"), [("1a", True), ("1b", False)])
def test_conversions_are_fuzzed_in_process_only(phase, conversions, tmp_path, monkeypatch):
    asked = []

    def targets(mutations, invariant, **kwargs):
        asked.append((mutations, invariant, kwargs))
        return WORK

    monkeypatch.setattr(runner, "targets", targets)
    _report(tmp_path, Runs(), examples=1, phase=phase, work=None, mutations=["m"],
            invariant=False)
    assert asked == [(["m"], False, {"conversions": conversions})]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.mark.parametrize(("step", "rounds"), [(60.0, 1), (59.0, 2), (10.0, 6)])
def test_a_budget_in_minutes_ends_the_run_once_that_much_time_has_passed(step, rounds,
                                                                       tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(runner, "time", clock)
    run = Runs(clock, step)  # two targets: the check after each target's round counts too
    report = _report(tmp_path, run, minutes=1, work=[("invariant", None), ("kill", "m")])
    assert len(run.calls) == rounds and report.interrupted is None
    assert report.elapsed == step * rounds  # on the run's clock, from its start
    # each round's tally is its target's, merged into the run's
    targets = [("invariant", None) * 2, ("kill", "m") * 2] * 3
    assert [c["tally"] for c in run.calls] == targets[:rounds]


class _Outcome:
    def __init__(self, key):
        self.case = type("Case", (), {"key": lambda self: key})()

    def describe(self):
        return "a case"


def test_a_counterexample_found_again_is_one_failure_and_the_progress_counts_each(tmp_path):
    class Failing(Runs):
        def __call__(self, prop, mutation, *, tally, **kwargs):
            super().__call__(prop, mutation, tally=tally, **kwargs)
            raise runner.PropertyFailed(prop, _Outcome(len(self.calls) // 3))  # 0, 0, 1

    run = Failing()
    *progress, report = fuzz(run=run, work=WORK, threshold_rule="rule", corpus_path=tmp_path,
                             examples=3, chunk=1)
    assert [f.outcome.case.key() for f in report.failures] == [0, 1]
    assert [(p.failures, p.current) for p in progress] == [(1, "invariant"), (1, "invariant"),
                                                           (2, "invariant")]
    # the corpus is replayed in the first round only
    assert [c["corpus"] for c in run.calls] == [True, False, False]


class Stop(KeyboardInterrupt):
    """An interrupt of a kind of its own (the CLI's SIGTERM is ``Terminated``)."""


def test_an_interrupt_in_a_round_or_at_a_yield_is_named_by_its_kind(tmp_path):
    class Interrupted(Runs):
        def __call__(self, prop, mutation, *, tally, **kwargs):
            super().__call__(prop, mutation, tally=tally, **kwargs)
            raise Stop

    report = _report(tmp_path, Interrupted(), examples=5, chunk=1)
    assert report.stopped == "interrupted (Stop)" and isinstance(report.interrupted, Stop)
    events = fuzz(run=Runs(), work=WORK, threshold_rule="rule", corpus_path=tmp_path,
                  examples=5, chunk=1)
    assert next(events).examples == 1
    report = events.throw(Stop())
    assert report.stopped == "interrupted (Stop)" and report.tallies[0].examples == 1

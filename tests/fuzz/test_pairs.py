"""One invariant example checks every degree pair of its geometry (``case.run_pairs``, issue
33): what does not depend on the pair is made once, every pair is judged on its own, and a
failure, its corpus entry and its shrunk report name the pair that failed."""

import json

import pytest
import torch
from hypothesis import strategies as st

import weight_sync_bench.check.checker as checker_module
from weight_sync_bench.fuzz.case import Case, run_case, run_pairs
from weight_sync_bench.fuzz.domain import DOMAIN
from weight_sync_bench.fuzz.runner import PropertyFailed, run_property
from weight_sync_bench.model.plan import layout_for

# degrees 1, 2 and 4 (four KV heads): nine ordered pairs
CONFIG = DOMAIN.config(n_kv_heads=4, group=1, ffn_per_kv_head=2, vocab_per_kv_head=8,
                       head_dim=2, d_model=8, n_layers=1, batch=1, seq_len=4)
DEGREES = [1, 2, 4]


def test_every_ordered_pair_is_checked_once_the_drawn_pair_first():
    assert layout_for(CONFIG).supported_degrees() == DEGREES
    outcomes = run_pairs(Case(CONFIG, src=4, dst=2, seed=3))
    pairs = [(o.case.src, o.case.dst) for o in outcomes]
    assert pairs[0] == (4, 2) and sorted(pairs) == [(s, d) for s in DEGREES for d in DEGREES]
    assert all(o.case.seed == 3 and o.case.config == CONFIG for o in outcomes)
    assert all(o.holds("invariant") and not o.shards_differ for o in outcomes)


def test_each_pair_is_judged_as_run_case_judges_it_alone():
    """The shared checker changes nothing a pair decides: deviation, threshold and bytes."""
    outcomes = run_pairs(Case(CONFIG, src=1, dst=4, seed=5))
    for outcome in outcomes:
        alone = run_case(outcome.case)
        assert (outcome.deviation, outcome.threshold, outcome.shards_differ) == (
            alone.deviation, alone.threshold, alone.shards_differ)


def test_a_mutation_or_a_conversion_is_its_own_pair_only():
    case = Case(CONFIG, src=1, dst=2, seed=0, mutation="kv_swapped")
    (outcome,) = run_pairs(case)
    assert outcome.case == case and outcome.holds("kill")


def _corrupt_one_pair(monkeypatch, src: int, dst: int) -> None:
    """The reshard under test writes one wrong bit at (src, dst) only, on its last rank."""
    real_tensor, real_reshard = checker_module.reshard_tensor, checker_module.reshard

    def flip(out):
        last = out[-1].clone()
        last.view(-1).view(torch.int32)[0] ^= 1 << 22
        return [*out[:-1], last]

    def reshard_tensor(shards, spec, to):
        out = real_tensor(shards, spec, to)
        if (len(shards), to) == (src, dst) and spec.name == "lm_head.weight":
            return flip(out)
        return out

    def reshard(shards, layout, to):
        out = real_reshard(shards, layout, to)
        if (len(shards), to) == (src, dst):
            out[-1] = {**out[-1], "lm_head.weight": flip([out[-1]["lm_head.weight"]])[0]}
        return out

    monkeypatch.setattr(checker_module, "reshard_tensor", reshard_tensor)
    monkeypatch.setattr(checker_module, "reshard", reshard)


@pytest.mark.parametrize("bug", [(2, 4), None])
def test_a_failure_at_a_pair_the_example_did_not_draw_names_that_pair(bug, monkeypatch,
                                                                      tmp_path):
    """Every example draws the pair (1, 1); the reshard is wrong at 2 -> 4 only. The failure,
    the corpus entry and the report name 2 -> 4 (the twin: no bug, nothing fails)."""
    if bug is not None:
        _corrupt_one_pair(monkeypatch, *bug)
    drawn = st.builds(Case, config=st.just(CONFIG), src=st.just(1), dst=st.just(1),
                      seed=st.integers(0, 3))
    if bug is None:
        tally = run_property("invariant", None, max_examples=3, corpus=False, strategy=drawn,
                             corpus_path=tmp_path)
        assert tally.failures == 0 and tally.examples % len(DEGREES) ** 2 == 0
        assert not list(tmp_path.iterdir())
        return
    with pytest.raises(PropertyFailed) as caught:
        run_property("invariant", None, max_examples=3, corpus=False, strategy=drawn,
                     corpus_path=tmp_path)
    failed = caught.value.outcome
    assert (failed.case.src, failed.case.dst) == bug and failed.shards_differ
    assert ", 2 -> 4, seed " in str(caught.value)
    (entry,) = tmp_path.glob("*.json")
    assert json.loads(entry.read_text())["case"]["degrees"] == {"src": 2, "dst": 4}


def test_the_tally_counts_every_pair_of_every_example():
    """Each example draws 1 -> 1; the worst pair is one it did not draw."""
    drawn: list[Case] = []
    strategy = st.builds(Case, config=st.just(CONFIG), src=st.just(1), dst=st.just(1),
                         seed=st.integers(0, 3)).map(lambda case: drawn.append(case) or case)
    tally = run_property("invariant", None, max_examples=4, corpus=False, strategy=strategy)
    outcomes = [o for case in drawn for o in run_pairs(case)]
    assert drawn and tally.examples == len(outcomes) == len(drawn) * len(DEGREES) ** 2
    worst = max(outcomes, key=lambda o: o.ratio)
    assert (worst.case.src, worst.case.dst) != (1, 1)
    assert tally.failures == 0 and tally.max_ratio == worst.ratio and tally.max_at == worst.case


def test_hypothesis_is_steered_by_the_worst_pair_of_each_example(monkeypatch):
    """One ``target`` per example (Hypothesis refuses a label twice), the largest ratio of its
    pairs: the target phase climbs toward the pair nearest its threshold."""
    import weight_sync_bench.fuzz.runner as runner_module

    targets: list[float] = []
    monkeypatch.setattr(runner_module, "target",
                        lambda value, label: targets.append(value) if label == "ratio" else None)
    drawn: list[Case] = []
    strategy = st.builds(Case, config=st.just(CONFIG), src=st.just(1), dst=st.just(1),
                         seed=st.integers(0, 3)).map(lambda case: drawn.append(case) or case)
    run_property("invariant", None, max_examples=4, corpus=False, strategy=strategy)
    assert targets == [max(o.ratio for o in run_pairs(case)) for case in drawn]


def test_the_forward_the_rule_and_the_phase_reach_every_pair():
    """What the runner passes is what every pair is judged with: the forward (a mutation's
    one pair too), the threshold rule, and without a rule the case's phase's own."""
    from weight_sync_bench.check.forwards import inprocess_forward

    calls: list[int] = []

    def counting(config, shards, tokens, **kwargs):
        calls.append(len(shards))
        return inprocess_forward(config, shards, tokens, **kwargs)

    outcomes = run_pairs(Case(CONFIG, src=1, dst=1, seed=0), forward=counting,
                         threshold_rule=lambda config, reference: 0.25)
    assert sorted(calls) == DEGREES and all(o.threshold == 0.25 for o in outcomes)
    calls.clear()
    (killed,) = run_pairs(Case(CONFIG, src=1, dst=2, seed=0, mutation="kv_swapped"),
                          forward=counting, threshold_rule=lambda config, reference: 0.5)
    assert calls and killed.threshold == 0.5
    phase_1b = Case(CONFIG, src=1, dst=2, seed=0, phase="1b")
    alone = run_case(phase_1b)
    assert alone.threshold != run_case(Case(CONFIG, src=1, dst=2, seed=0)).threshold
    assert {o.threshold for o in run_pairs(phase_1b)} == {alone.threshold}


def test_a_kill_is_steered_toward_its_smallest_ratio_and_its_identity_examples_only_counted(
        monkeypatch):
    """A kill property targets minus its live example's ratio under "-ratio" (Hypothesis
    maximises: toward the weakest detection); an identity example is an event, never a
    target. Every outcome's event names its pair and whether it is an identity."""
    import weight_sync_bench.fuzz.runner as runner_module

    targets: list[tuple[float, str]] = []
    events: list[str] = []
    monkeypatch.setattr(runner_module, "target",
                        lambda value, label: targets.append((value, label)))
    monkeypatch.setattr(runner_module, "event", events.append)
    drawn: list[Case] = []
    strategy = st.builds(Case, config=st.just(CONFIG), src=st.just(2), dst=st.sampled_from([1, 2]),
                         seed=st.integers(0, 3), mutation=st.just("o_proj_reversed")
                         ).map(lambda case: drawn.append(case) or case)
    run_property("kill", "o_proj_reversed", max_examples=6, corpus=False, strategy=strategy)
    assert {c.dst for c in drawn} == {1, 2}  # an identity destination and a live one
    assert events == [f"t=2->{c.dst}" + (" identity" if c.dst == 1 else "") for c in drawn]
    assert targets == [(-run_case(c).ratio, "-ratio") for c in drawn if c.dst == 2]


@pytest.mark.parametrize("bug", [None, (1, 2)])
def test_a_pair_is_judged_as_its_reshard_verdict_judges_it(bug, monkeypatch):
    """``run_case`` builds no ``Verdict`` for a pair whose reshard matches the declared
    split, yet decides what ``reshard_verdict`` decides: deviation, threshold and bytes, on a
    pair that passes and on one whose reshard is wrong (one bit at 1 -> 2: its own forward)."""
    from weight_sync_bench.fuzz.case import make_checker

    if bug is not None:
        _corrupt_one_pair(monkeypatch, *bug)
    case = Case(CONFIG, src=1, dst=2, seed=7)
    checker = make_checker(CONFIG, 7)
    verdict = checker.reshard_verdict(1, 2)
    outcome = run_case(case, make_checker(CONFIG, 7))
    assert (outcome.deviation, outcome.threshold, outcome.shards_differ) == (
        verdict.max_abs_error, verdict.threshold, verdict.first_mismatch is not None)
    assert outcome.shards_differ == (bug is not None)


def _counting_checkers(monkeypatch) -> list[tuple]:
    """Every checker ``run_pairs`` makes, as (geometry, seed, phase)."""
    import weight_sync_bench.fuzz.case as case_module

    made: list[tuple] = []
    real = case_module.make_checker

    def make_checker(config, seed, **kwargs):
        made.append((config, seed, kwargs.get("phase", "1a")))
        return real(config, seed, **kwargs)

    monkeypatch.setattr(case_module, "make_checker", make_checker)
    return made


def test_an_example_drawn_again_in_a_run_reuses_its_checker_and_reshards_every_pair_anew(
        monkeypatch):
    """Hypothesis draws a geometry and seed again with another pair: within the run, that
    example reuses the first one's checker (weights, reference, declared splits and their
    forwards), while every one of its pairs is still resharded and compared."""
    made = _counting_checkers(monkeypatch)
    resharded: list[tuple[int, int]] = []
    real = checker_module.reshard_tensor

    def reshard_tensor(shards, spec, dst):
        if spec.name == "lm_head.weight":
            resharded.append((len(shards), dst))
        return real(shards, spec, dst)

    monkeypatch.setattr(checker_module, "reshard_tensor", reshard_tensor)
    drawn: list[Case] = []
    strategy = st.builds(Case, config=st.just(CONFIG), src=st.sampled_from(DEGREES),
                         dst=st.sampled_from(DEGREES), seed=st.integers(0, 1)
                         ).map(lambda case: drawn.append(case) or case)
    tally = run_property("invariant", None, max_examples=8, corpus=False, strategy=strategy)
    seeds = {case.seed for case in drawn}
    assert len(drawn) > len(seeds)  # some seed was drawn again
    assert sorted(made) == sorted((CONFIG, seed, "1a") for seed in seeds)
    assert tally.examples == len(resharded) == len(drawn) * len(DEGREES) ** 2


def test_nothing_is_kept_from_one_run_to_the_next_nor_outside_a_run(monkeypatch):
    """Each property run makes its own checkers (a test that plants a bug between two runs
    sees it in the second); outside a run every call makes one (the twins of the reuse)."""
    made = _counting_checkers(monkeypatch)
    strategy = st.builds(Case, config=st.just(CONFIG), src=st.just(1), dst=st.just(1),
                         seed=st.just(0))
    for _ in range(2):
        run_property("invariant", None, max_examples=2, corpus=False, strategy=strategy)
    assert made == [(CONFIG, 0, "1a")] * 2
    made.clear()
    run_pairs(Case(CONFIG, src=1, dst=2, seed=0))
    run_pairs(Case(CONFIG, src=2, dst=1, seed=0))
    assert made == [(CONFIG, 0, "1a")] * 2


def test_a_kept_checker_is_found_only_for_the_same_geometry_seed_phase_forward_and_rule():
    from weight_sync_bench.check.forwards import inprocess_forward
    from weight_sync_bench.fuzz.case import KeptCheckers, keeping_checkers, make_checker

    def rule(config, reference):
        return 0.25

    checker = make_checker(CONFIG, 0, threshold_rule=rule)
    case = Case(CONFIG, src=1, dst=1, seed=0)
    with keeping_checkers(KeptCheckers()) as kept:
        kept.keep(case, inprocess_forward, rule, checker)
        assert kept.find(Case(CONFIG, src=4, dst=2, seed=0), inprocess_forward, rule) is checker
        for other in (Case(CONFIG, 1, 1, seed=1), Case(CONFIG, 1, 1, seed=0, phase="1b"),
                      Case(CONFIG.replace(seq_len=5), 1, 1, seed=0)):
            assert kept.find(other, inprocess_forward, rule) is None, other
        assert kept.find(case, lambda *a, **k: None, rule) is None
        assert kept.find(case, inprocess_forward, lambda config, reference: 0.25) is None


class _Held:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def test_kept_checkers_stay_within_their_count_and_bytes_the_oldest_leaving_first():
    from weight_sync_bench.fuzz.case import KeptCheckers

    def case(seed):
        return Case(CONFIG, src=1, dst=1, seed=seed)

    def seeds(kept):
        return [key[1] for key in kept.kept]

    kept = KeptCheckers(budget=100, size=3)
    for seed in range(3):
        kept.keep(case(seed), None, None, _Held(30))
    assert seeds(kept) == [0, 1, 2] and kept.nbytes == 90  # the twin: within both
    kept.find(case(0), None, None)  # used: the most recent now
    kept.keep(case(3), None, None, _Held(5))  # a fourth: the least recently used leaves
    assert seeds(kept) == [2, 0, 3]
    kept.keep(case(4), None, None, _Held(50))  # over the bytes: the oldest leave till within
    assert seeds(kept) == [0, 3, 4] and kept.nbytes == 85
    kept.keep(case(5), None, None, _Held(101))  # alone over the budget: nothing is kept
    assert seeds(kept) == [] and kept.nbytes == 0
    kept.keep(case(6), None, None, _Held(100))  # exactly the budget: kept
    assert seeds(kept) == [6] and kept.nbytes == 100


def test_a_checker_kept_again_replaces_its_entry_as_the_most_recent():
    """Kept again (under another forward, say): one entry, its old bytes gone, and the most
    recently used, so the next one over the count evicts another."""
    from weight_sync_bench.fuzz.case import KeptCheckers

    def case(seed):
        return Case(CONFIG, src=1, dst=1, seed=seed)

    kept = KeptCheckers(budget=100, size=2)
    kept.keep(case(0), None, None, _Held(10))
    kept.keep(case(1), None, None, _Held(10))
    kept.keep(case(0), "another forward", None, _Held(20))
    assert [key[1] for key in kept.kept] == [1, 0] and kept.nbytes == 30
    kept.keep(case(2), None, None, _Held(10))
    assert [key[1] for key in kept.kept] == [0, 2]


def test_keeping_checkers_changes_nothing_a_run_decides(monkeypatch):
    """The same examples, tallied alike, with and without keeping checkers: the invariant
    (every pair, the ratio extremes and where) and a kill property (killed, identity, the
    smallest kill ratio), as the campaign judges them."""
    from contextlib import nullcontext

    import weight_sync_bench.fuzz.runner as runner_module

    strategy = st.builds(Case, config=st.just(CONFIG), src=st.sampled_from(DEGREES),
                         dst=st.sampled_from(DEGREES), seed=st.integers(0, 2))
    killing = st.builds(Case, config=st.just(CONFIG), src=st.sampled_from(DEGREES),
                        dst=st.sampled_from([2, 4]), seed=st.integers(0, 2),
                        mutation=st.just("kv_swapped"))

    def decided():
        out = []
        for prop, mutation, drawn in (("invariant", None, strategy),
                                      ("kill", "kv_swapped", killing)):
            t = run_property(prop, mutation, max_examples=8, corpus=False, strategy=drawn)
            out.append((t.examples, t.identity, t.killed, t.failures, t.min_ratio, t.min_at,
                        t.max_ratio, t.max_at, t.max_passing_ratio, t.min_kill_ratio))
        return out

    kept = decided()
    monkeypatch.setattr(runner_module, "keeping_checkers", nullcontext)
    assert decided() == kept


@pytest.mark.parametrize("mutation", [None, "o_proj_reversed"])
def test_a_case_without_a_checker_runs_its_forwards_over_the_forward_it_is_given(mutation):
    """run_case builds its checker over ``forward`` (phase 1b hands it gloo's): every
    sharded forward of the case goes through it; the twin, a checker given, uses that
    checker's forward instead."""
    from weight_sync_bench.check.forwards import inprocess_forward
    from weight_sync_bench.fuzz.case import make_checker

    calls = []

    def spy(config, shards, tokens, guard=None):
        calls.append(len(shards))
        return inprocess_forward(config, shards, tokens, guard)

    case = Case(CONFIG, src=2, dst=4, seed=0, mutation=mutation)
    run_case(case, forward=spy)
    assert 4 in calls  # the destination's forward ran through it
    calls.clear()
    run_case(case, make_checker(CONFIG, 0), forward=spy)
    assert calls == []


def test_a_case_without_a_checker_is_judged_by_the_threshold_rule_it_is_given():
    """The checker run_case builds takes ``threshold_rule`` (a user's fuzz passes its own);
    the twin, no rule, is the fuzz domain's."""
    judged = run_case(Case(CONFIG, src=2, dst=4, seed=0),
                      threshold_rule=lambda config, reference: 0.125)
    assert judged.threshold == 0.125
    assert run_case(Case(CONFIG, src=2, dst=4, seed=0)).threshold != 0.125

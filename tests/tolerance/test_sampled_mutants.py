"""``tolerance.sampled`` (issue 30, the mutation pass over ``tolerance/sampled.py``): the
threshold a fuzzed geometry is judged by, derived from floor samples on random geometries,
and the validation of that rule on vLLM's replicated-KV forward.

Every fuzzed verdict's threshold comes from here. The three candidate rules, their false
positives, headroom and kill ratios, the held-out check, the choice among them and the
validation's figures are all pure functions of the samples. These tests feed them small
hand-made samples whose every figure is known, and pin each one exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.tolerance import sampled as S
from weight_sync_bench.tolerance.artifacts import SCHEMA, artifact_path
from weight_sync_bench.tolerance.rules import SAFETY, derive_threshold


def sample(d_model, floor, scale, kills=None, *, seed=0, degree=2):
    return {"geometry": {"d_model": d_model, "n_layers": 1}, "seed": seed, "degree": degree,
            "floor": floor, "scale": scale, "kills": kills or {}}


# ---- a rule ---------------------------------------------------------------------------------

def test_a_rule_is_absolute_or_relative_to_the_largest_logit():
    absolute = S.SampledRule("absolute_pow10", "absolute", 1e-5)
    relative = S.SampledRule("relative", "relative", 2.5e-7)
    assert absolute.threshold(40.0) == 1e-5 and relative.threshold(40.0) == 2.5e-7 * 40.0
    reference = torch.tensor([[1.0, -8.0, 3.0]])  # its largest |logit| is negative
    assert absolute(None, reference) == 1e-5 and relative(None, reference) == 2.5e-7 * 8.0
    assert str(absolute) == "absolute_pow10: 1e-05"
    assert str(relative) == "relative: 2.5e-07 x max|reference logit|"
    assert str(S.SampledRule("relative_pow10", "relative", 1.2345e-6)) == (
        "relative_pow10: 1.2e-06 x max|reference logit|")
    assert S.RULES == ("absolute_pow10", "relative_pow10", "relative")


@pytest.mark.parametrize("x, digits, expected", [
    (1.234e-4, 2, 1.3e-4), (1.2e-4, 2, 1.2e-4), (1.201e-4, 2, 1.3e-4), (9.99, 2, 10.0),
    (1.234, 1, 2.0), (0.5, 2, 0.5), (123.0, 2, 130.0), (3.0e-7, 3, 3.0e-7)])
def test_round_up_to_significant_digits(x, digits, expected):
    assert S._round_up(x, digits) == pytest.approx(expected, rel=1e-12)


def test_round_up_keeps_two_digits_by_default():
    assert S._round_up(1.234e-4) == pytest.approx(1.3e-4, rel=1e-12)


def test_round_up_reads_what_lies_past_the_ninth_decimal_as_float_noise():
    """1.2e-4 / 1e-5 is 11.999999999999998 in floats: the scaled value is rounded to nine
    decimals before the ceiling, so float noise never adds a digit; a real excess does."""
    assert S._round_up(1.20000000001e-4) == pytest.approx(1.2e-4, rel=1e-12)  # 1e-10 over
    assert S._round_up(1.2000000001e-4) == pytest.approx(1.3e-4, rel=1e-12)  # 1e-9 over


# ---- the candidates and their figures -------------------------------------------------------

SAMPLES = [sample(8, 1e-7, 2.0, {"m1": 1.0, "m2": 0.5}, seed=0, degree=2),
           sample(16, 4e-7, 10.0, {"m1": 0.2, "m2": 2.0}, seed=1, degree=4),
           sample(8, 0.0, 1.0, {"m1": 3.0}, seed=2, degree=1)]


def test_the_three_candidates_each_have_the_safety_over_the_worst():
    worst_abs, worst_rel = 4e-7, max(1e-7 / 2.0, 4e-7 / 10.0)
    assert S.candidate_rules(SAMPLES) == [
        S.SampledRule("absolute_pow10", "absolute", derive_threshold(worst_abs, SAFETY)),
        S.SampledRule("relative_pow10", "relative", derive_threshold(worst_rel, SAFETY)),
        S.SampledRule("relative", "relative", S._round_up(SAFETY * worst_rel))]
    ten = S.candidate_rules(SAMPLES, safety=10)
    assert [r.value for r in ten] == [derive_threshold(worst_abs, 10),
                                      derive_threshold(worst_rel, 10),
                                      S._round_up(10 * worst_rel)]
    assert S.worst_floors(SAMPLES) == {"worst_floor": 4e-7, "worst_relative_floor": worst_rel}


def test_fit_counts_floors_above_the_threshold_and_the_smallest_headroom():
    rule = S.SampledRule("absolute_pow10", "absolute", 2e-7)
    assert S.fit(rule, SAMPLES) == (1, 2e-7 / 4e-7)
    at = S.SampledRule("absolute_pow10", "absolute", 4e-7)  # a floor at the threshold passes
    assert S.fit(at, SAMPLES) == (0, 1.0)
    relative = S.SampledRule("relative", "relative", 1e-6)
    assert S.fit(relative, SAMPLES) == (0, min(2e-6 / 1e-7, 1e-5 / 4e-7))
    assert S.fit(rule, [sample(8, 0.0, 1.0)]) == (0, math.inf)


def test_a_rules_figures_name_each_mutations_smallest_kill_and_where():
    rule = S.SampledRule("relative", "relative", 1e-2)
    got = S.evaluate_rule(rule, SAMPLES)
    assert got == {"rule": "relative", "kind": "relative", "value": 1e-2, "false_positives": 0,
                   "min_headroom": min(2e-2 / 1e-7, 1e-1 / 4e-7),
                   "min_kill_ratio": 0.2 / 0.1,
                   "kills": {"m1": {"min_ratio": 0.2 / 0.1, "d_model": 16, "degree": 4},
                             "m2": {"min_ratio": 2.0 / 0.1, "d_model": 16, "degree": 4}}}
    tie = [sample(8, 1e-7, 1.0, {"m": 1.0}, degree=2),
           sample(16, 1e-7, 1.0, {"m": 1.0}, degree=4)]
    assert S.evaluate_rule(rule, tie)["kills"]["m"] == {"min_ratio": 100.0, "d_model": 8,
                                                        "degree": 2}  # the first seen
    assert S.evaluate_rule(rule, [sample(8, 1e-7, 1.0)])["min_kill_ratio"] == math.inf


# ---- the choice -----------------------------------------------------------------------------

def spread(n=8):
    """Geometries whose floor grows with the logits' scale: the relative rules fit them with
    far more room to kill than the absolute one."""
    return [sample(8 * (i + 1), 1e-7 * (i + 1), 1.0 * (i + 1), {"m": 0.5 * (i + 1)}, seed=i)
            for i in range(n)]


def test_the_choice_is_the_eligible_candidate_that_kills_by_the_largest_margin():
    samples = spread()
    chosen, figures = S.choose_rule(samples)
    assert [f["rule"] for f in figures] == list(S.RULES)
    assert figures == [S.evaluate_rule(r, samples) for r in S.candidate_rules(samples)]
    ratios = {f["rule"]: f["min_kill_ratio"] for f in figures}
    assert chosen.name == max(ratios, key=ratios.get) == "relative"
    assert chosen == S.candidate_rules(samples)[2]
    assert S.rule_from({"samples": samples}) == chosen


def test_a_candidate_that_fails_its_held_out_half_is_not_chosen(monkeypatch):
    samples = spread()
    real = S.holdout
    monkeypatch.setattr(S, "holdout", lambda s: [
        {**h, "false_positives": 1} if h["rule"] == "relative" else h for h in real(s)])
    assert S.choose_rule(samples)[0].name == "relative_pow10"
    monkeypatch.setattr(S, "holdout", lambda s: [
        {**h, "min_headroom": SAFETY - 1} if h["rule"] != "absolute_pow10" else h
        for h in real(s)])
    assert S.choose_rule(samples)[0].name == "absolute_pow10"
    monkeypatch.setattr(S, "holdout", lambda s: [
        {**h, "min_headroom": float(SAFETY)} for h in real(s)])  # exactly the safety: kept
    assert S.choose_rule(samples)[0].name == "relative"
    monkeypatch.setattr(S, "holdout", lambda s: [])  # too few to split: not applied
    assert S.choose_rule(samples)[0].name == "relative"


def test_without_an_eligible_candidate_the_choice_is_refused(monkeypatch):
    real = S.evaluate_rule
    monkeypatch.setattr(S, "evaluate_rule", lambda rule, samples: {
        **real(rule, samples), "false_positives": 1})
    with pytest.raises(ToleranceMismatch) as exc:
        S.choose_rule(spread())
    assert str(exc.value) == (f"no candidate threshold rule has zero false positives and "
                              f"{SAFETY}x headroom over the samples and on held-out ones")
    monkeypatch.setattr(S, "evaluate_rule", lambda rule, samples: {
        **real(rule, samples), "min_headroom": SAFETY - 0.5})
    with pytest.raises(ToleranceMismatch):
        S.choose_rule(spread())
    monkeypatch.setattr(S, "evaluate_rule", lambda rule, samples: {
        **real(rule, samples), "min_headroom": float(SAFETY)})
    assert S.choose_rule(spread())[0].name == "relative"


def test_the_held_out_check_derives_from_the_even_geometries_and_judges_the_odd():
    samples = spread(4) + [{**spread(4)[1], "degree": 4}]  # geometry 1 again, another degree
    got = S.holdout(samples)
    fit = [samples[0], samples[2]]
    held = [samples[1], samples[3], samples[4]]
    assert got == [{"rule": r.name, "value": r.value, "samples": 3,
                    "false_positives": S.evaluate_rule(r, held)["false_positives"],
                    "min_headroom": S.evaluate_rule(r, held)["min_headroom"]}
                   for r in S.candidate_rules(fit)]
    # the same geometry under another seed is another geometry to hold out
    reseeded = [sample(8, 1e-7, 1.0, seed=0), sample(8, 2e-7, 1.0, seed=1)]
    assert [h["samples"] for h in S.holdout(reseeded)] == [1, 1, 1]
    assert S.holdout([sample(8, 1e-7, 1.0)]) == []  # nothing to hold out
    assert S.holdout([sample(8, 0.0, 1.0, seed=0), sample(16, 1e-7, 1.0, seed=1)]) == []


def test_rederive_replaces_only_the_rule_figures():
    samples = spread()
    artifact = {"samples": samples, "chosen": "absolute_pow10", "rules": [], "holdout": [],
                "environment": {"torch": "x"}, "domain": {"d": 1}}
    got = S.rederive(artifact)
    chosen, figures = S.choose_rule(samples)
    assert got == {**artifact, "chosen": chosen.name, "rules": figures,
                   "holdout": S.holdout(samples)}
    assert artifact["chosen"] == "absolute_pow10"  # pure: the input is left as it was


def test_the_random_floor_artifact_records_its_provenance(monkeypatch):
    monkeypatch.setattr(S, "environment", lambda: {"env": 1})
    samples = spread()
    got = S.random_floor_artifact(samples, phase="1b", domain={"d": 1}, geometries=6,
                                  searched=2, search_examples=50, profile="wsb-nightly",
                                  hypothesis_seed=7)
    chosen, figures = S.choose_rule(samples)
    assert got == {"schema": SCHEMA, "phase": "1b", "safety": SAFETY, "domain": {"d": 1},
                   "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
                   "geometries": 6, "searched": 2, "search_examples": 50,
                   "profile": "wsb-nightly", "hypothesis_seed": 7, "chosen": chosen.name,
                   "rules": figures, "holdout": S.holdout(samples), "samples": samples,
                   "environment": {"env": 1}}


# ---- reading the artifacts ------------------------------------------------------------------

def refusal(call, *args, **kwargs):
    with pytest.raises(ToleranceMismatch) as exc:
        call(*args, **kwargs)
    return str(exc.value)


def test_the_random_floor_is_read_with_its_fields_or_refused_with_its_command(tmp_path):
    missing = tmp_path / "random_floor_1b.json"
    assert refusal(S.load_random_floor, "1b", missing) == (
        f"{missing}: no such artifact; measure it with `wsb floor --random N --phase 1b`")
    missing.write_text('{"schema": 1, "phase": "1b", "domain": {}, "samples": []}')
    assert refusal(S.load_random_floor, "1b", missing) == f"{missing}: missing field 'chosen'"
    assert S.load_random_floor()["phase"] == "1a"  # the committed one by default
    assert S.load_random_floor("1b")["phase"] == "1b"


def test_the_environment_notes_name_the_remedy_that_fits(monkeypatch):
    seen = []
    monkeypatch.setattr(S, "load_random_floor", lambda phase, path: {"phase": phase,
                                                                     "path": path})
    monkeypatch.setattr(S, "check_environment", lambda artifact, what, remedy: seen.append(
        (artifact, what, remedy)) or ("note",))
    monkeypatch.setattr(S, "merges_here", lambda artifact: artifact["phase"] == "1b")
    assert S.environment_notes("1b", Path("p")) == ("note",)
    S.environment_notes()
    assert seen == [
        ({"phase": "1b", "path": Path("p")}, "the phase 1b random-geometry floor",
         "wsb floor --kernel-sets all --phase 1b --write"),
        ({"phase": "1a", "path": None}, "the phase 1a random-geometry floor",
         "wsb floor --random N --phase 1a --write")]


def merged(samples_by_set):
    """A merged artifact: each sample's floor is the worst over its kernel sets."""
    sets = sorted(samples_by_set[0]["by"])
    samples = [{**sample(8 * (i + 1), max(s["by"].values()), s["scale"], {"m": 1.0}, seed=i),
                "by_kernel_set": s["by"]} for i, s in enumerate(samples_by_set)]
    return {"kernel_sets": sets, "samples": samples}


def test_the_kernel_set_table_shows_what_each_would_choose_alone():
    artifact = merged([{"by": {"AVX2": 2e-7, "DEFAULT": 1e-7}, "scale": 2.0},
                       {"by": {"AVX2": 1e-7, "DEFAULT": 3e-7}, "scale": 4.0},
                       {"by": {"AVX2": 1e-7, "DEFAULT": 1e-7}, "scale": 1.0},
                       {"by": {"AVX2": 5e-8, "DEFAULT": 4e-8}, "scale": 3.0}])
    rows = S.kernel_set_figures(artifact)
    alone = {k: [{**s, "floor": s["by_kernel_set"][k]} for s in artifact["samples"]]
             for k in ("AVX2", "DEFAULT")}
    rule = {k: str(S.choose_rule(v)[0]).split(": ", 1)[1] for k, v in alone.items()}
    assert rows == [
        ["kernel set", "worst floor", "worst floor/max|logit|", "alone worst in",
         "rule from it alone"],
        ["AVX2", "2e-07", "1e-07", "2", rule["AVX2"]],  # a tie counts for neither
        ["DEFAULT", "3e-07", "1e-07", "1", rule["DEFAULT"]],
        ["merged", "3e-07", "1e-07", "4", str(S.rule_from(artifact)).split(": ", 1)[1]]]


def test_a_kernel_set_whose_floors_alone_choose_nothing_says_why(monkeypatch):
    artifact = merged([{"by": {"AVX2": 2e-7, "DEFAULT": 1e-7}, "scale": 2.0},
                       {"by": {"AVX2": 1e-7, "DEFAULT": 3e-7}, "scale": 4.0}])
    real = S.choose_rule

    def choose(samples):
        if samples[0]["floor"] == 2e-7 and samples is not artifact["samples"]:
            raise ToleranceMismatch("nothing fits")
        return real(samples)

    monkeypatch.setattr(S, "choose_rule", choose)
    rows = S.kernel_set_figures(artifact)
    assert rows[1][0] == "AVX2" and rows[1][4] == "none (nothing fits)"
    assert rows[2][4] != rows[1][4]
    assert S.kernel_set_figures({"samples": artifact["samples"]})[1][0] == "merged"


# ---- the replicated-KV validation -----------------------------------------------------------

def test_the_validation_lives_beside_the_floor_and_is_measured_by_its_command():
    floor = artifact_path("1a", kind="random_floor")
    assert S.replicated_kv_path() == floor.with_name("random_floor_1a_replicated_kv.json")
    assert S.replicated_kv_path("1b") == floor.with_name("random_floor_1b_replicated_kv.json")
    assert S.replicated_kv_command() == (
        "python -m weight_sync_bench.fuzz.floor replicated-kv --write")
    assert S.replicated_kv_command("1b") == (
        "python -m weight_sync_bench.fuzz.floor replicated-kv --write --phase 1b")


def test_the_validation_records_the_rule_in_forces_figures(monkeypatch):
    monkeypatch.setattr(S, "environment", lambda: {"env": 1})
    floor = {"samples": spread()}
    asked = []
    monkeypatch.setattr(S, "load_random_floor", lambda phase: asked.append(phase) or floor)
    samples = [sample(8, 1e-7, 1.0, {"swap": 2.0}, degree=4),
               sample(16, 3e-7, 2.0, {"swap": 1.0}, degree=8, seed=1)]
    got = S.replicated_kv_artifact(samples, phase="1b", forward="vllm-replicated-kv",
                                   domain={"d": 1}, geometries=2, draw_seed=5, max_degree=8)
    rule = S.rule_from(floor)
    assert asked == ["1b"]
    base = {"schema": SCHEMA, "phase": "1b", "kind": "replicated_kv_validation",
            "forward": "vllm-replicated-kv", "safety": SAFETY, "domain": {"d": 1},
            "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
            "geometries": 2, "draw_seed": 5, "max_degree": 8, "samples": samples,
            "environment": {"env": 1}}
    figures = S.evaluate_rule(rule, samples)
    assert got == {**base, "validated": {
        "rule": {"name": rule.name, "kind": rule.kind, "value": rule.value},
        "samples": 2, "false_positives": figures["false_positives"],
        "min_headroom": figures["min_headroom"], "min_kill_ratio": figures["min_kill_ratio"],
        "kills": figures["kills"], "degrees": [4, 8], "worst_floor": 3e-7,
        "worst_relative_floor": 1.5e-7}}
    assert S.validated(base, rule) == got


def test_the_validation_is_read_with_its_fields_or_refused_with_its_command(tmp_path):
    path = tmp_path / "v.json"
    assert refusal(S.load_replicated_kv, "1b", path) == (
        f"{path}: no such artifact; measure it with `{S.replicated_kv_command('1b')}`")
    path.write_text('{"schema": 1, "phase": "1a", "domain": {}, "samples": [], '
                    '"forward": "f"}')
    assert refusal(S.load_replicated_kv, "1a", path) == f"{path}: missing field 'max_degree'"
    assert S.load_replicated_kv()["kind"] == "replicated_kv_validation"


def test_the_validation_is_read_once_per_version_of_both_files(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(S, "_validation", lambda *a: seen.append(a) or ("f", [2], True))
    path = tmp_path / "v.json"
    path.write_text("{}")
    assert S.validation("1b", path) == ("f", [2], True)
    floor = artifact_path("1b", kind="random_floor")
    assert seen == [("1b", path, path.stat().st_mtime_ns, floor.stat().st_mtime_ns)]
    S.validation()
    assert seen[-1][:2] == ("1a", S.replicated_kv_path("1a"))


@pytest.mark.parametrize("figures, degrees, same, why", [
    ({"false_positives": 0, "min_headroom": 500.0}, [4, 8], True, None),
    ({"false_positives": 0, "min_headroom": float(SAFETY)}, [4, 8], True, None),
    ({"false_positives": 0, "min_headroom": 500.0}, [4, 8], False,
     "it was measured over another fuzz domain than the random-geometry floor's"),
    ({"false_positives": 0, "min_headroom": 500.0}, [4, 8], True, None),
    ({"false_positives": 0, "min_headroom": 500.0}, [2, 4], True,
     "it measured t=2, 4, not t=8"),
    ({"false_positives": 2, "min_headroom": 500.0}, [8], True,
     f"the rule in force has 2 false positives and 500x headroom over its samples (needs 0 "
     f"and {SAFETY}x)"),
    ({"false_positives": 0, "min_headroom": 99.5}, [8], True,
     f"the rule in force has 0 false positives and 99.5x headroom over its samples (needs 0 "
     f"and {SAFETY}x)")])
def test_why_the_validation_does_not_validate_the_rule(monkeypatch, figures, degrees, same,
                                                        why):
    asked = []
    monkeypatch.setattr(S, "validation", lambda phase, path: asked.append((phase, path))
                        or (figures, degrees, same))
    assert S.why_not_validated(8, "1b", Path("v")) == why
    assert asked == [("1b", Path("v"))]


def test_the_committed_validation_validates_the_rule_in_force():
    """The twin: with the committed artifacts, the rule is validated at a degree they measured,
    and not at one they did not."""
    _, degrees, same = S.validation()
    assert same and S.why_not_validated(degrees[-1]) is None
    assert S.why_not_validated(3) == (
        f"it measured t={', '.join(map(str, degrees))}, not t=3")

"""The threshold rule for fuzzed geometries: derived from the committed random-geometry
floor samples by a pure function, with zero false positives and 100x headroom over them,
chosen for the largest smallest kill ratio; TOY and TOY_KV4 keep the seed's rule."""

import math

import pytest
import torch

from weight_sync_bench.check.mutations import KILL_MARGIN, MUTATIONS
from weight_sync_bench.fuzz.domain import DOMAIN, fuzz_init, is_builtin
from weight_sync_bench.fuzz.floor import fuzz_threshold_rule, measure_random
from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.tolerance.artifacts import artifact_path, plot_path
from weight_sync_bench.tolerance.rules import SAFETY, threshold_for
from weight_sync_bench.tolerance.sampled import (
    SampledRule,
    candidate_rules,
    choose_rule,
    evaluate_rule,
    holdout,
    load_random_floor,
    rule_from,
)


@pytest.fixture(scope="module")
def artifact():
    return load_random_floor()


def test_committed_artifact_records_environment_samples_and_its_plot(artifact):
    assert artifact["environment"]["torch"] and artifact["environment"]["python"]
    assert artifact["geometries"] >= 200 and len(artifact["samples"]) > artifact["geometries"]
    assert plot_path().exists() and plot_path().parent == artifact_path(kind="random_floor").parent


def test_chosen_rule_is_rederived_from_the_samples_not_read_from_the_figures(artifact):
    chosen, figures = choose_rule(artifact["samples"])
    assert chosen.name == artifact["chosen"] and rule_from(artifact) == chosen
    assert figures == artifact["rules"]


def test_chosen_rule_has_no_false_positive_and_safety_headroom_over_every_sample(artifact):
    rule = rule_from(artifact)
    for s in artifact["samples"]:
        assert s["floor"] * SAFETY <= rule.threshold(s["scale"]), s
    figures = evaluate_rule(rule, artifact["samples"])
    assert figures["false_positives"] == 0 and figures["min_headroom"] >= SAFETY


def test_chosen_rule_kills_every_mutation_by_the_margin_on_every_sample(artifact):
    figures = evaluate_rule(rule_from(artifact), artifact["samples"])
    assert set(figures["kills"]) == set(MUTATIONS)
    assert figures["min_kill_ratio"] >= KILL_MARGIN, figures["kills"]
    held = {h["rule"]: h for h in artifact["holdout"]}
    eligible = [f for f in artifact["rules"] if f["false_positives"] == 0
                and f["min_headroom"] >= SAFETY and held[f["rule"]]["min_headroom"] >= SAFETY]
    assert all(f["min_kill_ratio"] <= figures["min_kill_ratio"] for f in eligible)


def test_the_committed_rule_keeps_its_safety_factor_on_held_out_geometries(artifact):
    """The chosen candidate, derived from the even-numbered geometries alone, still has zero
    false positives and SAFETY x headroom on the odd ones it never saw."""
    held = {h["rule"]: h for h in holdout(artifact["samples"])}[artifact["chosen"]]
    assert held["samples"] > 200
    assert held["false_positives"] == 0 and held["min_headroom"] >= SAFETY, held


def _geometry_sample(index, floor, scale=1.0, kill=1.0):
    return {"geometry": {"d_model": 8 * (index + 1)}, "seed": 0, "degree": 2, "floor": floor,
            "scale": scale, "kills": {"m": kill}}


def test_holdout_judges_on_the_held_out_geometries_only():
    # fitting half (even order): floors 1e-6; held-out half (odd): floors 5e-6
    samples = [_geometry_sample(i, 1e-6 if i % 2 == 0 else 5e-6) for i in range(6)]
    held = {h["rule"]: h for h in holdout(samples)}
    assert held["relative"]["value"] == pytest.approx(1e-4)  # 100 x the fitting floor
    assert held["relative"]["samples"] == 3
    assert held["relative"]["min_headroom"] == pytest.approx(20.0)  # 1e-4 / 5e-6, not 100


def test_a_candidate_that_does_not_generalise_is_not_chosen():
    # fitting half at logit scale 1, held-out half at scale 0.1, the same floors: the
    # relative rules derived from the fitting half have 10x on the held-out half
    samples = [_geometry_sample(i, 1e-6, scale=1.0 if i % 2 == 0 else 0.1) for i in range(6)]
    held = {h["rule"]: h for h in holdout(samples)}
    assert held["relative"]["min_headroom"] == pytest.approx(10.0)
    chosen, _ = choose_rule(samples)
    assert chosen.name == "absolute_pow10" and held["absolute_pow10"]["min_headroom"] >= SAFETY
    # twin: both halves see both scales, the floor following the scale: a relative rule
    # generalises and, killing the small-scale mutations by more, is chosen
    scales = [1.0 if (i // 2) % 2 == 0 else 0.1 for i in range(8)]
    even = [_geometry_sample(i, 1e-6 * s, scale=s, kill=s) for i, s in enumerate(scales)]
    assert all(h["min_headroom"] >= SAFETY for h in holdout(even) if h["rule"] != "absolute_pow10")
    assert choose_rule(even)[0].kind == "relative"


def _sample(floor, scale, kill):
    return {"geometry": {"d_model": 8}, "seed": 0, "degree": 2, "floor": floor, "scale": scale,
            "kills": {"m": kill}}


def test_choose_rule_prefers_relative_when_the_floor_follows_the_logit_scale():
    samples = [_sample(1e-6, 1.0, 1e-2), _sample(1e-5, 10.0, 1e-1)]
    chosen, _ = choose_rule(samples)
    assert chosen == SampledRule("relative", "relative", 1e-4)


def test_choose_rule_prefers_absolute_when_the_floor_does_not_follow_the_scale():
    # the worst relative floor sits on a tiny scale, so a relative rule is loose on big ones
    samples = [_sample(1e-6, 0.01, 1e-3), _sample(1e-6, 10.0, 1e-3)]
    chosen, figures = choose_rule(samples)
    assert chosen.name == "absolute_pow10" and chosen.value == 1e-4
    assert {f["rule"]: f["min_kill_ratio"] for f in figures}["relative"] < 1


def test_candidates_round_up_and_keep_the_safety_factor():
    rules = {r.name: r for r in candidate_rules([_sample(1.234e-6, 1.0, 1.0)])}
    assert rules["absolute_pow10"].value == 1e-3
    assert rules["relative_pow10"].value == 1e-3
    assert math.isclose(rules["relative"].value, 1.3e-4)


def test_builtin_configs_keep_the_seed_rule_and_init():
    rule = fuzz_threshold_rule()
    for config in (TOY, TOY_KV4):
        assert is_builtin(config) and fuzz_init(config).std == 0.02
        assert rule(config, torch.tensor([100.0])) == threshold_for(config)
    assert not is_builtin(TOY.replace(d_model=128))


def test_measure_random_refuses_a_geometry_outside_the_domain():
    from weight_sync_bench.errors import ToleranceMismatch
    with pytest.raises(ToleranceMismatch, match=r"floor sample 0 lies outside the fuzz domain: "
                                                r"d_model=256 not in 8..128"):
        list(measure_random([(DOMAIN.smallest().replace(d_model=256), 0)]))

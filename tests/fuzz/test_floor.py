"""The threshold rule for fuzzed geometries: derived from the committed random-geometry
floor samples by a pure function, with zero false positives and 100x headroom over them,
chosen for the largest smallest kill ratio; TOY and TOY_KV4 keep the seed's rule."""

import math

import pytest
import torch

from weight_sync_bench.check.mutations import KILL_MARGIN, MUTATIONS
from weight_sync_bench.fuzz.domain import DOMAIN, fuzz_init, is_builtin
from weight_sync_bench.fuzz.floor import (
    ThresholdRule,
    candidate_rules,
    choose_rule,
    evaluate_rule,
    fuzz_threshold_rule,
    load_random_floor,
    measure_random,
    plot_path,
    rule_from,
)
from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.rules import SAFETY, threshold_for


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
    others = [f for f in artifact["rules"] if f["rule"] != artifact["chosen"]]
    assert all(f["min_kill_ratio"] <= figures["min_kill_ratio"] for f in others)


def _sample(floor, scale, kill):
    return {"geometry": {"d_model": 8}, "degree": 2, "floor": floor, "scale": scale,
            "kills": {"m": kill}}


def test_choose_rule_prefers_relative_when_the_floor_follows_the_logit_scale():
    samples = [_sample(1e-6, 1.0, 1e-2), _sample(1e-5, 10.0, 1e-1)]
    chosen, _ = choose_rule(samples)
    assert chosen == ThresholdRule("relative", "relative", 1e-4)


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

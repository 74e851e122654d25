"""``tolerance.sampled_moe`` (issue 30, the mutation pass over ``tolerance/sampled_moe.py``):
the random-geometry rule validated on the Mixture-of-Experts forwards, and the reasons the
validation gives for not covering an MoE geometry's forward.

The fuzz judges an MoE geometry only where these figures say the rule holds: zero false
positives, the safety headroom over every floor and every routing deviation, the forward and
the length measured. These tests feed ``moe_figures`` hand-made samples whose every figure is
known, and pin each figure and each refusal exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.tolerance import sampled_moe as M
from weight_sync_bench.tolerance.artifacts import SCHEMA, artifact_path
from weight_sync_bench.tolerance.rules import SAFETY
from weight_sync_bench.tolerance.sampled import SampledRule, worst_floors

RULE = SampledRule("relative", "relative", 1e-2)  # threshold: 0.01 x scale


def sample(d_model, *, floor=1e-6, scale=1.0, kills=None, seed=0, seq_len=4, degree=2,
           forward="expert-parallel", route=0.0, near=(0, 10), margin=0.5, purpose=None,
           **extra):
    kills = kills or {}
    return {"geometry": {"d_model": d_model, "seq_len": seq_len}, "seed": seed,
            "degree": degree, "forward": forward, "floor": floor, "scale": scale,
            "kills": kills, "kill_at": {k: f"{k}@layer0" for k in kills}, "route": route,
            "near_ties": list(near), "min_margin": margin, "purpose": purpose, **extra}


def test_the_validation_lives_beside_the_floor_and_is_measured_by_its_command():
    floor = artifact_path("1a", kind="random_floor")
    assert M.moe_path() == floor.with_name("random_floor_1a_moe.json")
    assert M.moe_path("1b") == floor.with_name("random_floor_1b_moe.json")
    assert M.moe_command() == "python -m weight_sync_bench.fuzz.floor moe --write"
    assert M.moe_command("1b") == (
        "python -m weight_sync_bench.fuzz.floor moe --write --phase 1b")
    assert M.MOE_KIND == "moe_validation"


def test_each_mutations_smallest_kill_is_where_it_was_seen_and_drawn_apart():
    samples = [
        sample(8, kills={"bias": 0.5, "swap": 1.0}, scale=2.0, degree=2, forward="plain"),
        sample(16, kills={"bias": 0.3}, scale=1.0, degree=4, purpose="bias", seed=1),
        sample(24, kills={"bias": 0.9, "swap": 0.05}, scale=1.0, degree=8, purpose="swap",
               seed=2, forward="vllm-replicated-kv")]
    got = M.moe_figures({"samples": samples}, RULE)
    assert got["kills"] == {
        "bias": {"min_ratio": 0.5 / 0.02, "live": 3, "drawn_min_ratio": 0.3 / 0.01,
                 "drawn_live": 1, "d_model": 8, "world": 2, "forward": "plain",
                 "at": "bias@layer0", "purpose": None},
        "swap": {"min_ratio": 0.05 / 0.01, "live": 2, "drawn_min_ratio": 0.05 / 0.01,
                 "drawn_live": 1, "d_model": 24, "world": 8, "forward": "vllm-replicated-kv",
                 "at": "swap@layer0", "purpose": "swap"}}
    assert got["min_kill_ratio"] == 0.05 / 0.01
    assert got["min_drawn_kill_ratio"] == 0.05 / 0.01
    drawn = M.moe_figures({"samples": samples[:2]}, RULE)
    assert drawn["min_kill_ratio"] == 0.5 / 0.02 and drawn["min_drawn_kill_ratio"] == 0.3 / 0.01
    tie = [sample(8, kills={"m": 0.5}, degree=2),
           sample(16, kills={"m": 0.5}, degree=4, seed=1)]
    assert M.moe_figures({"samples": tie}, RULE)["kills"]["m"]["d_model"] == 8  # the first
    undrawn = M.moe_figures({"samples": [sample(8, kills={"m": 0.5})]}, RULE)
    assert undrawn["kills"]["m"]["drawn_min_ratio"] == math.inf
    assert undrawn["kills"]["m"]["drawn_live"] == 0
    assert undrawn["min_drawn_kill_ratio"] == math.inf
    assert "purpose" in undrawn["kills"]["m"] and undrawn["kills"]["m"]["purpose"] is None
    none = M.moe_figures({"samples": [sample(8)]}, RULE)
    assert none["kills"] == {} and none["min_kill_ratio"] == math.inf
    assert none["min_drawn_kill_ratio"] == math.inf
    drawn_twice = [sample(8, kills={"m": 0.6}, purpose="m"), sample(16, kills={"m": 0.4},
                                                                    purpose="m", seed=1),
                   sample(24, kills={"m": 0.2}, seed=2)]
    m = M.moe_figures({"samples": drawn_twice}, RULE)["kills"]["m"]
    assert (m["live"], m["drawn_live"], m["min_ratio"], m["drawn_min_ratio"]) == (
        3, 2, 0.2 / 0.01, 0.4 / 0.01)


def test_the_floors_routes_and_hidden_mutations_are_counted():
    samples = [
        sample(8, floor=1e-5, scale=2.0, route=1e-5, selection_unchanged=["bias"]),
        sample(8, floor=4e-6, scale=1.0, route=0.0, degree=4, unrouted=["swap", "bias"],
               selection_unchanged=["bias"]),
        sample(16, floor=0.0, scale=1.0, route=2e-6, seed=1, seq_len=32)]
    got = M.moe_figures({"samples": samples}, RULE)
    assert got["samples"] == 3
    assert got["false_positives"] == 0
    assert got["min_headroom"] == min(0.02 / 1e-5, 0.01 / 4e-6)
    assert got["selection_unchanged"] == {"bias": 2} and got["unrouted"] == {"swap": 1,
                                                                             "bias": 1}
    assert got["worst_route"] == 1e-5
    assert got["min_route_headroom"] == min(0.02 / 1e-5, 0.01 / 2e-6)
    assert got["forwards"] == [[2, "expert-parallel"], [4, "expert-parallel"]]
    assert got["seq_lens"] == [4, 32]
    assert {k: got[k] for k in ("worst_floor", "worst_relative_floor")} == worst_floors(samples)
    quiet = M.moe_figures({"samples": [sample(8, route=0.0)]}, RULE)
    assert quiet["worst_route"] == 0.0 and quiet["min_route_headroom"] == math.inf
    over = M.moe_figures({"samples": [sample(8, floor=0.02, scale=1.0)]}, RULE)
    assert over["false_positives"] == 1


def test_near_ties_are_counted_once_per_reference():
    """A reference is one (geometry, seed, length): its forwards share its near ties."""
    samples = [sample(8, near=(2, 10), margin=0.1, degree=2),
               sample(8, near=(2, 10), margin=0.1, degree=4),        # the same reference
               sample(8, near=(0, 10), margin=0.4, seed=1),         # another seed
               sample(8, near=(1, 20), margin=0.05, seq_len=32)]    # another length
    got = M.moe_figures({"samples": samples}, RULE)
    assert got["references"] == 3
    assert got["near_ties"] == {"references": 2, "choices": 3, "of": 40, "min_margin": 0.05}
    forwards = [sample(8, forward="plain", degree=2), sample(8, forward="expert-parallel",
                                                             degree=2)]
    assert M.moe_figures({"samples": forwards}, RULE)["forwards"] == [
        [2, "expert-parallel"], [2, "plain"]]


def test_a_validation_without_samples_is_refused():
    with pytest.raises(ToleranceMismatch) as exc:
        M.moe_figures({"samples": []}, RULE)
    assert str(exc.value) == "an MoE validation without samples validates nothing"


def test_the_validation_records_its_provenance_and_the_rules_figures(monkeypatch):
    monkeypatch.setattr(M, "environment", lambda: {"env": 1})
    samples = [sample(8, kills={"m": 1.0}, route=1e-6)]
    got = M.moe_artifact(samples, phase="1b", domain={"d": 1}, moe_domain={"e": 2},
                         geometries=5, hypothesis_seed=9, max_world=8, rule=RULE,
                         draw="moe_cases() under Hypothesis 6", coverage=3)
    base = {"schema": SCHEMA, "phase": "1b", "kind": "moe_validation", "safety": SAFETY,
            "domain": {"d": 1}, "moe_domain": {"e": 2},
            "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
            "geometries": 5, "coverage": 3, "hypothesis_seed": 9,
            "draw": "moe_cases() under Hypothesis 6", "max_world": 8, "samples": samples,
            "environment": {"env": 1}}
    assert got == {**base, "validated": {"rule": {"name": "relative", "kind": "relative",
                                                  "value": 1e-2},
                                         **M.moe_figures(base, RULE)}}
    assert M.validated_moe(base, RULE) == got
    plain = M.moe_artifact(samples, phase="1a", domain={}, moe_domain={}, geometries=1,
                           hypothesis_seed=None, max_world=4, rule=RULE)
    assert plain["draw"] is None and plain["coverage"] == 0


def test_the_validation_is_read_with_its_fields_or_refused_with_its_command(tmp_path):
    path = tmp_path / "m.json"
    with pytest.raises(ToleranceMismatch) as exc:
        M.load_moe("1b", path)
    assert str(exc.value) == (f"{path}: no such artifact; measure it with "
                              f"`{M.moe_command('1b')}`")
    path.write_text('{"schema": 1, "phase": "1a", "domain": {}, "moe_domain": {}, '
                    '"samples": []}')
    with pytest.raises(ToleranceMismatch) as exc:
        M.load_moe("1a", path)
    assert str(exc.value) == f"{path}: missing field 'max_world'"
    assert M.load_moe()["kind"] == "moe_validation"


def test_the_validation_is_read_once_per_version_of_both_files(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(M, "_moe_validation", lambda *a: seen.append(a) or ("f", "d"))
    path = tmp_path / "m.json"
    path.write_text("{}")
    assert M.moe_validation("1b", path) == ("f", "d")
    floor = artifact_path("1b", kind="random_floor")
    assert seen == [("1b", path, path.stat().st_mtime_ns, floor.stat().st_mtime_ns)]
    M.moe_validation()
    assert seen[-1][:2] == ("1a", M.moe_path("1a"))


GOOD = {"false_positives": 0, "min_headroom": 500.0, "min_route_headroom": 1e4,
        "forwards": [[2, "expert-parallel"], [4, "plain"]], "seq_lens": [4, 8, 32]}
DOMAINS = {"same_domain": True, "moe_domain": {"e": 2}}


@pytest.mark.parametrize("figures, domains, asked, why", [
    (GOOD, DOMAINS, {}, None),
    (GOOD, DOMAINS, {"world": 2, "forward": "expert-parallel", "seq_len": 32}, None),
    ({**GOOD, "min_headroom": float(SAFETY), "min_route_headroom": float(SAFETY)}, DOMAINS, {},
     None),
    (GOOD, {**DOMAINS, "same_domain": False}, {},
     "it was measured over another fuzz domain than the random-geometry floor's"),
    (GOOD, {**DOMAINS, "moe_domain": {"e": 3}}, {},
     "it was measured over another MoE domain than the fuzz draws from"),
    ({**GOOD, "false_positives": 1}, DOMAINS, {},
     f"the rule in force has 1 false positives and 500x headroom over its floors (needs 0 and "
     f"{SAFETY}x)"),
    ({**GOOD, "min_headroom": 99.5}, DOMAINS, {},
     f"the rule in force has 0 false positives and 99.5x headroom over its floors (needs 0 and "
     f"{SAFETY}x)"),
    ({**GOOD, "min_route_headroom": 42.25}, DOMAINS, {},
     f"the rule in force is 42.2x the worst routing deviation of a correct forward (the "
     f"routing check's bound needs {SAFETY}x)"),
    (GOOD, DOMAINS, {"world": 4, "forward": "expert-parallel"},
     "it measured no expert-parallel forward over 4 ranks (it measured 2 ranks "
     "expert-parallel, 4 ranks plain)"),
    (GOOD, DOMAINS, {"world": 4}, None),              # a world alone asks for no forward
    (GOOD, DOMAINS, {"forward": "plain"}, None),      # nor a forward alone
    (GOOD, DOMAINS, {"seq_len": 16},
     "it measured sequences of 4, 8, 32 tokens, not 16")])
def test_why_the_validation_does_not_validate_an_moe_geometry(monkeypatch, figures, domains,
                                                               asked, why):
    calls = []
    monkeypatch.setattr(M, "moe_validation", lambda phase, path: calls.append((phase, path))
                        or (figures, domains))
    assert M.why_moe_not_validated("1b", Path("m"), moe_domain={"e": 2}, **asked) == why
    assert calls == [("1b", Path("m"))]


def test_the_committed_validation_validates_the_rule_for_the_forwards_it_measured():
    """The twin: with the committed artifacts, a measured forward and length are validated,
    one never measured is not."""
    figures, domains = M.moe_validation()
    world, forward = figures["forwards"][0]
    assert M.why_moe_not_validated(moe_domain=domains["moe_domain"], world=world,
                                   forward=forward, seq_len=figures["seq_lens"][0]) is None
    assert M.why_moe_not_validated(moe_domain=domains["moe_domain"], world=64,
                                   forward=forward) is not None

"""Threshold-rule claims that mutation testing found unpinned (mutation/report.md): the
power-of-ten rule above 1, each refusal's exact text, the default phase, an artifact with no
cells, the drift notes for a given running environment, and ``WSB_STRICT_ENV=0``."""

import json
from fractions import Fraction

import pytest

from weight_sync_bench import TOY, ToleranceMismatch
from weight_sync_bench.tolerance.artifacts import runtime
from weight_sync_bench.tolerance.rules import (
    RUNTIME_FIELDS,
    check_environment,
    check_geometry,
    derive_threshold,
    environment_drift,
    load_artifact,
    strict_environment,
)

RUNNING = {"torch": "2.13.0", "numpy": "2.1.0", "python": "3.11.9", "machine": "x86_64",
           "cpu_vendor": "AuthenticAMD", "cpu_capability": "AVX2"}


@pytest.mark.parametrize("worst, threshold", [
    (1.05, 1e3),  # 105: between 10^2 and 11^2, so a rule on 11^k would say 100
    (0.5, 1e2),  # 50
    (0.1, 1e1),  # exactly 10: stays there
    (2.0, 1e3),  # 200
    (123.0, 1e5),  # 12300
])
def test_threshold_rule_holds_for_worst_observations_at_and_above_a_tenth(worst, threshold):
    assert derive_threshold(worst) == threshold


def test_threshold_is_the_smallest_power_of_ten_at_or_above_100x_on_a_sweep_of_magnitudes():
    for k in range(-12, 3):
        for mantissa in (1.0, 1.05, 2.5, 9.99):
            worst = mantissa * 10.0 ** k
            threshold = Fraction(repr(derive_threshold(worst)))  # 1e-05 read as exactly 10^-5
            target = Fraction(repr(worst)) * 100
            assert threshold >= target > threshold / 10, worst
            assert threshold.numerator == 1 or threshold.denominator == 1, worst


@pytest.mark.parametrize("worst, message", [
    (0.0, "worst observation is 0: a floor of exactly zero admits no reordering and cannot "
          "set a threshold"),
    (-1e-6, "worst observation must be finite and >= 0, got -1e-06"),
    (float("nan"), "worst observation must be finite and >= 0, got nan"),
])
def test_a_worst_that_cannot_set_a_threshold_is_refused_with_the_reason(worst, message):
    with pytest.raises(ToleranceMismatch) as raised:
        derive_threshold(worst)
    assert str(raised.value) == message


def test_load_artifact_reads_phase_1a_by_default():
    assert load_artifact() == load_artifact("1a")


def test_a_missing_artifact_names_the_command_that_measures_it(tmp_path):
    path = tmp_path / "phase1b.json"
    with pytest.raises(ToleranceMismatch) as raised:
        load_artifact("1b", path)
    assert str(raised.value) == (f"{path}: no such artifact; measure it with "
                                 "`python -m weight_sync_bench.tolerance --phase 1b`")


def test_an_artifact_with_no_cells_is_refused_not_crashed_on(tmp_path):
    path = tmp_path / "phase1a.json"
    path.write_text(json.dumps({"schema": 1, "phase": "1a", "configs": {}, "cells": [],
                                "worst_abs": 1e-6}))
    with pytest.raises(ToleranceMismatch) as raised:
        load_artifact("1a", path)
    assert str(raised.value) == (f"{path}: field 'worst_abs' records 1e-06, but the worst of "
                                 "its cells is None")


def test_drift_is_measured_against_the_running_environment_it_is_given():
    assert environment_drift(dict(RUNNING), running=RUNNING) == []
    assert environment_drift({**RUNNING, "torch": "2.4.0"}, running=RUNNING) == [
        "torch recorded 2.4.0 running 2.13.0"]


def test_drift_names_every_unrecorded_field_and_the_kernel_sets_in_full():
    assert environment_drift({}, running=RUNNING) == [
        f"{field} not recorded (running {RUNNING[field]})" for field in RUNTIME_FIELDS]
    recorded = {**RUNNING, "kernel_sets": ["DEFAULT", "AVX512"]}
    assert environment_drift(recorded, running=RUNNING) == [
        "kernel set AuthenticAMD/AVX2 is not among the kernel sets the floor was measured "
        "under (AuthenticAMD/DEFAULT, AuthenticAMD/AVX512)"]


def test_drift_compares_the_cpu_vendor_with_the_kernel_set():
    """MKL and oneDNN dispatch by vendor: AVX2 on an Intel CPU is not AVX2 on an AMD one."""
    intel = {**RUNNING, "cpu_vendor": "GenuineIntel"}
    assert environment_drift(intel, running=RUNNING) == [
        "cpu_vendor recorded GenuineIntel running AuthenticAMD"]
    merged = {**intel, "kernel_sets": ["DEFAULT", "AVX2"]}
    assert environment_drift(merged, running=RUNNING) == [
        "kernel set AuthenticAMD/AVX2 is not among the kernel sets the floor was measured "
        "under (GenuineIntel/DEFAULT, GenuineIntel/AVX2): none on this CPU vendor "
        "(AuthenticAMD)"]
    both = {**merged, "kernel_sets": ["GenuineIntel/AVX2", "AuthenticAMD/AVX2"]}
    assert environment_drift(both, running=RUNNING) == []  # the twin: measured on both
    # recorded before the vendor was (every floor committed before 2026-12-02): its cpu_model
    # names it, and its unqualified kernel sets ran there
    older = {k: v for k, v in RUNNING.items() if k != "cpu_vendor"}
    assert environment_drift({**older, "cpu_model": "AMD EPYC", "kernel_sets": ["AVX2"]},
                             running=RUNNING) == []
    assert environment_drift({**older, "cpu_model": "AMD EPYC"}, running=RUNNING) == []
    (note,) = environment_drift({**older, "cpu_model": "Intel(R) Xeon(R) Processor",
                                 "kernel_sets": ["AVX2"]}, running=RUNNING)
    assert note.startswith("kernel set AuthenticAMD/AVX2 is not among")
    assert "GenuineIntel/AVX2" in note
    assert environment_drift({**older, "cpu_model": "Some CPU"}, running=RUNNING) == [
        "cpu_vendor not recorded (running AuthenticAMD)"]


@pytest.mark.parametrize("value, strict", [("", False), ("0", False), ("1", True),
                                           ("yes", True)])
def test_strict_env_is_off_unset_empty_or_zero_and_on_otherwise(monkeypatch, value, strict):
    monkeypatch.setenv("WSB_STRICT_ENV", value)
    assert strict_environment() is strict


def test_strict_env_is_off_when_unset(monkeypatch):
    monkeypatch.delenv("WSB_STRICT_ENV", raising=False)
    assert strict_environment() is False


def test_an_artifact_without_an_environment_is_noted_field_by_field(monkeypatch):
    monkeypatch.delenv("WSB_STRICT_ENV", raising=False)
    notes = check_environment({}, "phase 1a floor")
    assert [n.split(" (running")[0] for n in notes] == [
        f"phase 1a floor measured elsewhere: {field} not recorded" for field in RUNTIME_FIELDS]


def test_a_floor_merged_over_kernel_sets_covers_each_of_them(monkeypatch):
    """A merged artifact lists its kernel sets at the top level (``tolerance.kernels.merge``);
    its environment records the first run's capability only."""
    monkeypatch.delenv("WSB_STRICT_ENV", raising=False)
    here = runtime()
    merged = {"environment": {**here, "cpu_capability": "OTHER"},
              "kernel_sets": ["OTHER", here["cpu_capability"]]}
    assert check_environment(merged, "phase 1a floor") == ()
    merged["kernel_sets"] = ["OTHER"]  # the twin: a set this process does not run is named
    (note,) = check_environment(merged, "phase 1a floor")
    assert note.startswith(f"phase 1a floor measured elsewhere: kernel set "
                           f"{here['cpu_vendor']}/{here['cpu_capability']} is not among the "
                           "kernel sets")


def test_strict_env_refuses_a_foreign_floor_naming_every_difference(monkeypatch):
    monkeypatch.setenv("WSB_STRICT_ENV", "1")
    recorded = {"environment": {"torch": "0.1", "numpy": "0.2"}}
    with pytest.raises(ToleranceMismatch) as raised:
        check_environment(recorded, "phase 1a floor")
    notes = environment_drift(recorded["environment"])
    assert len(notes) == len(RUNTIME_FIELDS)
    assert str(raised.value) == (
        "phase 1a floor: measured in another environment (WSB_STRICT_ENV is set): "
        + "; ".join(notes) + ". Re-measure it here with python -m weight_sync_bench.tolerance")


# -- check_geometry: the whole message, so every part of it is pinned

def _artifact(config, **geometry):
    recorded = {"geometry": {**config.geometry(), **geometry},
                "token_shape": list(config.token_shape)}
    return {"phase": "1a", "configs": {config.name: recorded, "other": recorded}}


def test_an_unrecorded_config_is_refused_with_the_recorded_ones_and_both_remedies():
    artifact = _artifact(TOY)
    del artifact["configs"]["toy"]
    artifact["configs"]["third"] = {}
    with pytest.raises(ToleranceMismatch) as raised:
        check_geometry(artifact, TOY)
    assert str(raised.value) == (
        "phase 1a: no floor recorded for config 'toy' (recorded: other, third); pass "
        "threshold= explicitly, or for a geometry inside the fuzz domain "
        "threshold_rule=floor.fuzz_threshold_rule()")


def test_a_shape_change_is_refused_naming_only_the_fields_that_differ():
    artifact = _artifact(TOY, d_model=512, ffn=1408)
    with pytest.raises(ToleranceMismatch) as raised:
        check_geometry(artifact, TOY)
    assert str(raised.value) == (
        f"toy: running geometry differs from the phase 1a floor's: d_model recorded 512 "
        f"running {TOY.d_model}, ffn recorded 1408 running {TOY.ffn}")  # no token-shape note


@pytest.mark.parametrize("field", ["batch", "seq_len"])
def test_a_token_shape_change_says_why_it_widens_the_floor(field):
    value = getattr(TOY, field)
    artifact = _artifact(TOY, **{field: value * 2})
    with pytest.raises(ToleranceMismatch) as raised:
        check_geometry(artifact, TOY)
    assert str(raised.value) == (
        f"toy: running geometry differs from the phase 1a floor's: {field} recorded "
        f"{value * 2} running {value} (the token shape sets how many logits the max is "
        "taken over: a larger one widens the floor)")


def test_a_numerics_change_is_refused_naming_only_the_fields_that_differ():
    artifact = _artifact(TOY)
    artifact["configs"]["toy"]["numerics"] = {"rope_theta": 5e5, "norm_eps": TOY.norm_eps}
    with pytest.raises(ToleranceMismatch) as raised:
        check_geometry(artifact, TOY)
    assert str(raised.value) == (
        f"toy: running numerics differ from the phase 1a floor's: rope_theta recorded "
        f"500000.0 running {TOY.rope_theta}")
    artifact["configs"]["toy"]["numerics"] = {"rope_theta": 5e5, "norm_eps": 1.0}
    with pytest.raises(ToleranceMismatch) as raised:
        check_geometry(artifact, TOY)
    assert str(raised.value).endswith(f"rope_theta recorded 500000.0 running {TOY.rope_theta}, "
                                      f"norm_eps recorded 1.0 running {TOY.norm_eps}")


@pytest.mark.parametrize("worst, threshold", [(1e4, 1e6), (3.5e6, 1e9), (1e100, 1e102)])
def test_the_threshold_of_a_large_worst_is_found_from_its_exponent_not_counted_up_to(worst,
                                                                                    threshold):
    """A worst far above 1 gets the rule's power of ten from its exponent: a search that
    walked the exponent up to ``target / 10`` and back returns the same value but never
    returns for 1e100 (mutant ``10 * exponent``: killed as a timeout, mutation/report.md)."""
    assert derive_threshold(worst) == threshold

import json

import pytest

from weight_sync_bench import TOY, TOY_KV4, ToleranceMismatch
from weight_sync_bench.check.floor import measure
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance.artifacts import write_artifact
from weight_sync_bench.tolerance.rules import (
    ULP,
    check_geometry,
    derive_threshold,
    load_artifact,
    threshold_for,
    threshold_from,
)


@pytest.mark.parametrize("worst, threshold", [
    (1.669e-6, 1e-3),  # the seed's figure: 100x is 1.669e-4, rounded up to a power of ten
    (1e-5, 1e-3),  # exactly 100x on a power of ten stays there
    (1.0000001e-5, 1e-2),
    (9.5367431640625e-07, 1e-4),  # 8 ULP
    (3e-9, 1e-6),
])
def test_threshold_is_the_smallest_power_of_ten_at_or_above_100x_the_worst(worst, threshold):
    assert derive_threshold(worst) == threshold


@pytest.mark.parametrize("worst", [0.0, float("nan"), float("inf"), -1e-6])
def test_a_worst_that_cannot_set_a_threshold_is_rejected(worst):
    with pytest.raises(ToleranceMismatch):
        derive_threshold(worst)


def test_the_committed_phase1a_artifact_matches_the_running_configs():
    artifact = load_artifact("1a")
    for config in (TOY, TOY_KV4):
        check_geometry(artifact, config)
    assert artifact["repetitions"] == 20
    cells = {(c["config"], c["degree"], c.get("forward", "plain")) for c in artifact["cells"]}
    assert cells == {("toy", 1, "plain"), ("toy", 2, "plain"), ("toy_kv4", 1, "plain"),
                     ("toy_kv4", 2, "plain"), ("toy_kv4", 4, "plain"),
                     # vLLM past n_kv_heads (check.floor.REPLICATED_KV)
                     ("toy", 4, "vllm-replicated-kv"), ("toy", 8, "vllm-replicated-kv"),
                     ("toy_kv4", 8, "vllm-replicated-kv")}
    for field in ("torch", "numpy", "python", "platform", "dtype", "commit"):
        assert field in artifact["environment"]


@pytest.mark.parametrize("phase", ["1a", "1b"])
def test_each_phase_reads_its_own_committed_artifact(phase):
    artifact = load_artifact(phase)
    assert artifact["phase"] == phase and artifact["repetitions"] == 20
    for config in (TOY, TOY_KV4):
        assert threshold_for(config, phase) == threshold_from(artifact)


def test_the_threshold_is_read_from_the_artifact_through_the_pure_rule():
    artifact = load_artifact("1a")
    assert threshold_for(TOY) == threshold_from(artifact) == derive_threshold(artifact["worst_abs"])
    assert artifact["worst_abs"] == max(c["worst_abs"] for c in artifact["cells"])
    # a 1-way split reorders nothing: the floor there is exactly zero
    assert all(c["max_ulp"] == 0 for c in artifact["cells"] if c["degree"] == 1)


@pytest.mark.parametrize("changes, field", [
    ({"seq_len": 32}, "seq_len recorded 16 running 32 \\(the token shape"),  # more draws widen the tail statistic silently
    ({"d_model": 512, "ffn": 704}, "d_model recorded 256 running 512"),  # longer reductions
    ({"rope_theta": 5e5}, "running numerics differ .* rope_theta recorded 10000.0 running"),
])
def test_a_geometry_other_than_the_recorded_one_is_refused(changes, field):
    with pytest.raises(ToleranceMismatch, match=field):
        threshold_for(TOY.replace(**changes))


def test_an_unrecorded_config_is_refused_by_name():
    other = ModelConfig("mine", vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                        head_dim=16, ffn=48)
    with pytest.raises(ToleranceMismatch, match="no floor recorded for config 'mine' .*pass "
                                                "threshold= explicitly"):
        threshold_for(other)


def test_a_small_measurement_records_every_cell_and_a_zero_floor_at_t1(tmp_path):
    tiny = ModelConfig("tiny", vocab=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=16, ffn=96)
    artifact = measure("1a", configs=[tiny], repetitions=2)
    cells = {c["degree"]: c for c in artifact["cells"]}
    assert set(cells) == {1, 2}
    assert cells[1]["worst_abs"] == 0 and cells[2]["worst_abs"] > 0
    assert cells[2]["max_ulp"] == pytest.approx(cells[2]["worst_abs"] / ULP)
    assert cells[2]["median_ulp"] <= cells[2]["mean_ulp"] * 10 <= cells[2]["max_ulp"] * 10
    path = tmp_path / "phase1a.json"
    write_artifact(artifact, path)
    assert load_artifact("1a", path) == json.loads(json.dumps(artifact))
    assert not list(tmp_path.glob(".*tmp"))  # the atomic write left no temp file


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"schema": 1}', "missing field 'phase'"),
    ('{"schema": 99, "phase": "1a", "configs": {}, "cells": [], "worst_abs": 1}', "field 'schema' is 99, this code reads 1"),
    ('{"schema": 1, "phase": "1b", "configs": {}, "cells": [], "worst_abs": 1}', "field 'phase' records '1b', asked for '1a'"),
])
def test_a_malformed_artifact_is_refused_naming_the_file_and_field(tmp_path, content, message):
    path = tmp_path / "phase1a.json"
    path.write_text(content)
    with pytest.raises(ToleranceMismatch, match=message) as info:
        load_artifact("1a", path)
    assert str(path) in str(info.value)

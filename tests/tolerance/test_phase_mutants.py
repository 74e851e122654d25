"""Exact pins on ``tolerance/phase.py``: what a phase floor's cell and artifact record, each
field computed from known deviations and read back (mutation/report.md, issue 30). A
threshold is derived from these figures, so a field recorded from part of the deviations,
or under another name, moves every check judged by the floor. No forward runs here."""

import numpy as np
import pytest
import torch

from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.tolerance import phase
from weight_sync_bench.tolerance.phase import (
    EXPERT_PARALLEL,
    PLAIN_FORWARD,
    REPLICATED_KV,
    artifact,
    cell,
    cell_forward,
    geometry_artifact,
    measured_degrees,
    route_headroom,
)
from weight_sync_bench.tolerance.rules import ULP, geometry_key, geometry_record, numerics

# Two repetitions, pooled: the worst is in the second, the median between the two.
DEVIATIONS = [np.array([1.0, 3.0], dtype=np.float32) * ULP,
              np.array([2.0, 10.0, 4.0], dtype=np.float32) * ULP]


def test_a_cell_records_every_figure_over_all_repetitions_pooled():
    assert cell("toy", 2, DEVIATIONS) == {
        "config": "toy", "degree": 2, "max_ulp": 10.0, "median_ulp": 3.0, "mean_ulp": 4.0,
        "worst_abs": 10.0 * ULP, "elements": 5}


def test_a_cell_of_another_forward_names_it_and_an_moe_cell_records_its_worst_route():
    """The plain forward's cell has no ``forward`` field (as every older artifact); the
    others name theirs. ``worst_route`` is the largest over the repetitions, not the last."""
    replicated = cell("toy_kv4", 8, DEVIATIONS, forward=REPLICATED_KV)
    assert replicated["forward"] == REPLICATED_KV and "worst_route" not in replicated
    assert cell_forward(replicated) == REPLICATED_KV
    plain = cell("toy", 2, DEVIATIONS, forward=PLAIN_FORWARD)
    assert "forward" not in plain and cell_forward(plain) == PLAIN_FORWARD == "plain"
    routed = cell("toy_moe", 2, DEVIATIONS, forward=EXPERT_PARALLEL, route=[0.5, 2.0, 1.0])
    assert routed["forward"] == "expert-parallel" and routed["worst_route"] == 2.0
    assert isinstance(routed["worst_route"], float)


def test_measured_degrees_are_the_sorted_distinct_degrees_of_one_config_and_forward():
    cells = [{"config": "toy", "degree": 4}, {"config": "toy", "degree": 2},
             {"config": "toy", "degree": 4}, {"config": "small", "degree": 8},
             {"config": "toy", "degree": 16, "forward": REPLICATED_KV}]
    measured = {"cells": cells}
    assert measured_degrees(measured, "toy", PLAIN_FORWARD) == [2, 4]
    assert measured_degrees(measured, "toy", REPLICATED_KV) == [16]
    assert measured_degrees(measured, "small", PLAIN_FORWARD) == [8]
    assert measured_degrees({}, "toy", PLAIN_FORWARD) == []


def test_the_route_headroom_is_the_threshold_over_the_worst_route_of_any_cell():
    cells = {"cells": [{"worst_route": 1e-6}, {"degree": 2}, {"worst_route": 4e-6}]}
    assert route_headroom(cells, 1e-3) == pytest.approx(250.0, rel=1e-12)
    assert route_headroom({"cells": [{"degree": 2}]}, 1e-3) is None  # a dense floor
    assert route_headroom({}, 1e-3) is None
    # a routing deviation of exactly 0 is headroom without bound, not a division by zero
    assert route_headroom({"cells": [{"worst_route": 0.0}]}, 1e-3) == 1e-3 / 1e-30


@pytest.fixture
def fixed_environment(monkeypatch):
    monkeypatch.setattr(phase, "environment", lambda: {"torch": "x"})


def test_an_fp32_artifact_records_its_cells_seeds_configs_worst_and_threshold(fixed_environment):
    cells = [cell("toy_kv4", 4, DEVIATIONS[:1]), cell("toy", 2, DEVIATIONS)]  # worst last
    out = artifact("1a", [TOY, TOY_KV4], cells, 3, torch.float32)
    assert out == {
        "schema": 1, "phase": "1a", "unit": "2^-23", "repetitions": 3,
        "seeds": {"param": "0..2", "token": "1000..1002"},
        "rule": "smallest power of ten >= 100 x worst_abs",
        "configs": {c.name: {"geometry": c.geometry(), "token_shape": list(c.token_shape),
                             "numerics": numerics(c)} for c in (TOY, TOY_KV4)},
        "cells": cells, "worst_abs": 10.0 * ULP, "threshold": 1e-3,  # 100 x 10 ULP = 1.2e-4
        "environment": {"torch": "x"}}


def test_an_artifact_of_other_weights_names_their_dtype_and_fp8_what_it_quantized(
        fixed_environment):
    cells = [cell("toy", 2, DEVIATIONS)]
    bf16 = artifact("1b", [TOY], cells, 1, torch.bfloat16)
    assert (bf16["weights_dtype"], bf16["compute_dtype"], bf16["phase"]) == ("bf16", "fp32", "1b")
    assert "quantized_from" not in bf16 and bf16["seeds"] == {"param": "0..0",
                                                               "token": "1000..1000"}
    fp8 = artifact("1a", [TOY], cells, 2, torch.bfloat16, fp8="block")
    assert (fp8["weights_dtype"], fp8["quantized_from"], fp8["compute_dtype"]) == (
        "fp8_block", "bf16", "fp32")
    fp8_from_fp32 = artifact("1a", [TOY], cells, 2, torch.float32, fp8="tensor")
    assert (fp8_from_fp32["weights_dtype"], fp8_from_fp32["quantized_from"]) == (
        "fp8_tensor", "fp32")


def test_a_geometry_floor_is_keyed_by_its_record_and_keeps_a_recorded_dtype():
    measured = {"threshold": 1e-4, "cells": []}
    out = geometry_artifact(measured, TOY, "1b", "bf16")
    assert out == {"threshold": 1e-4, "cells": [], "weights_dtype": "bf16", "kind": "geometry",
                   "key": geometry_key(TOY, "1b", "bf16"),
                   "record": geometry_record(TOY, "1b", "bf16")}
    assert "kind" not in measured  # the measurement handed in is not changed
    kept = geometry_artifact({"weights_dtype": "fp8_block"}, TOY, "1a", "bf16")
    assert kept["weights_dtype"] == "fp8_block"
    assert kept["key"] == geometry_key(TOY, "1a", "bf16") != out["key"]

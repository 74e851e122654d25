"""Exact pins on ``tolerance/training.py``: what a training floor records, what reading it
back refuses, and the thresholds derived from it (mutation/report.md, issue 30). Each
refusal beside its twin, the same artifact whole, which loads. No model trains here."""

import copy
import json

import pytest

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.tolerance import training
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.training import (
    QUANTITIES,
    REGIMES,
    artifact,
    domain_of,
    load,
    measure_command,
    thresholds_from,
    thresholds_within,
)
from weight_sync_bench.training.floor import SMALL

# per regime and quantity a worst deviation; the last quantity's is the largest of plain's
WORST = {regime: {q: {"worst": (i + 1) * 1e-7 * (1000 if regime == "cancelling" else 1),
                      "case": f"small packed seed={i} dp=1 tp=2"}
                  for i, q in enumerate(QUANTITIES)} for regime in REGIMES}
DOMAIN = {"d_model": 32, "n_layers": 2, "tokens": 64}


@pytest.fixture
def measured(monkeypatch):
    monkeypatch.setattr(training, "environment", lambda: {"torch": "x"})
    return artifact("training", "1a", 3, 2, WORST, [{"case": "c"}], DOMAIN)


def test_a_training_floor_records_each_quantitys_worst_and_its_threshold(measured):
    assert measured == {
        "schema": 1, "kind": "training", "phase": "1a", "repetitions": 3, "steps": 2,
        "rule": "per quantity: smallest power of ten >= 100 x worst",
        "deviation": {"loss, input_grad, param_grad, kv_grad":
                      "max |sharded - reference| / max |reference|, per parameter",
                      "params_step1, params_final":
                      "||sharded - reference|| / ||reference - start|| (L2), per parameter"},
        "exact": {"replicas": "byte-identical copies; no threshold",
                  "padding_grad": "gradient of the padded vocab rows: exactly 0"},
        "domain": DOMAIN,
        "regimes": {r: {q: {**w, "threshold": training.derive_threshold(w["worst"])}
                        for q, w in WORST[r].items()} for r in REGIMES},
        "cells": [{"case": "c"}], "environment": {"torch": "x"}}
    assert measured["regimes"]["plain"]["loss"]["threshold"] == 1e-5
    assert measured["regimes"]["cancelling"]["params_final"]["threshold"] == 1e-1
    gloo = artifact("sequence", "1b", 1, 1, WORST, [], DOMAIN, meshes={"dp=1 tp=2": 1})
    assert (gloo["kind"], gloo["phase"], gloo["meshes"]) == ("sequence", "1b", {"dp=1 tp=2": 1})


def test_the_command_that_measures_a_floor_names_its_kind_and_any_phase_but_1a():
    assert measure_command("training", "1a") == (
        "python -m weight_sync_bench.tolerance training --write")
    assert measure_command("sequence", "1b") == (
        "python -m weight_sync_bench.tolerance sequence --phase 1b --write")


def _written(tmp_path, content):
    path = tmp_path / "training.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_whole_floor_loads_and_each_fault_is_refused_naming_the_file(tmp_path, measured):
    assert load(_written(tmp_path, measured)) == measured  # the twin of every refusal below
    missing = tmp_path / "none.json"
    with pytest.raises(ToleranceMismatch) as err:
        load(missing, phase="1b", kind="sequence")
    assert str(err.value) == (f"{missing}: no sequence tolerance; measure it with "
                              "`python -m weight_sync_bench.tolerance sequence --phase 1b "
                              "--write`")
    with pytest.raises(ToleranceMismatch, match=r"training.json: not valid JSON \("):
        load(_written(tmp_path, "{"))
    for field, value in (("schema", 2), ("kind", "sequence")):
        with pytest.raises(ToleranceMismatch) as err:
            load(_written(tmp_path, measured | {field: value}))
        assert str(err.value).endswith("training.json: not a schema-1 training artifact")
    with pytest.raises(ToleranceMismatch) as err:
        load(_written(tmp_path, measured), phase="1b")
    assert str(err.value).endswith("training.json: records phase '1a', asked for '1b': a floor "
                                   "is not reused across phases")
    # a quantity missing from the last regime only, and two from the first
    for regime, gone in (("cancelling", ["params_final"]), ("plain", ["loss", "kv_grad"])):
        broken = copy.deepcopy(measured)
        for q in gone:
            del broken["regimes"][regime][q]
        with pytest.raises(ToleranceMismatch) as err:
            load(_written(tmp_path, broken))
        assert str(err.value).endswith(f"training.json: no {regime} floor recorded for "
                                       + ", ".join(gone))


def test_an_artifact_with_no_regimes_or_without_one_is_refused_not_a_python_error(
        tmp_path, measured):
    without = {k: v for k, v in measured.items() if k != "regimes"}
    with pytest.raises(ToleranceMismatch) as err:
        load(_written(tmp_path, without))
    assert str(err.value).endswith("no plain floor recorded for " + ", ".join(QUANTITIES))
    one = copy.deepcopy(measured)
    del one["regimes"]["cancelling"]
    with pytest.raises(ToleranceMismatch) as err:
        load(_written(tmp_path, one))
    assert str(err.value).endswith("no cancelling floor recorded for " + ", ".join(QUANTITIES))


def test_with_no_path_the_committed_floor_of_the_kind_and_phase_asked_is_read():
    for kind, phase in (("training", "1a"), ("sequence", "1b")):
        committed = json.loads(artifact_path(phase, kind=kind).read_text())
        assert load(phase=phase, kind=kind) == committed
        assert (committed["kind"], committed["phase"]) == (kind, phase)
    assert load() == json.loads(artifact_path("1a", kind="training").read_text())


def test_an_artifact_with_no_cells_measured_no_mesh():
    """Its twin, a cell that names the mesh, is test_gloo_floor_cells.py's."""
    assert training.measured_meshes({}, "small") == []
    assert training.measured_meshes({"cells": [{"regime": "plain"}]}, "small") == []


def test_thresholds_are_derived_per_quantity_from_the_regime_asked(measured):
    plain, cancelling = thresholds_from(measured), thresholds_from(measured, "cancelling")
    assert list(plain) == list(QUANTITIES)
    assert plain["loss"] == 1e-5 and plain["params_final"] == 1e-4  # 8e-7 x 100 -> 1e-4
    assert cancelling["loss"] == 1e-2 and cancelling["params_final"] == 1e-1
    with pytest.raises(ToleranceMismatch) as err:
        thresholds_from(measured, "adversarial")
    assert str(err.value) == "unknown regime 'adversarial'; known: plain, cancelling"


def test_a_config_past_any_edge_of_the_measured_domain_has_no_threshold(measured):
    """At the domain's edge in every field: thresholds (the twin). One past it in any one
    field: refused, naming the field, the value and the bound."""
    assert domain_of(SMALL) == {"d_model": SMALL.d_model, "n_layers": SMALL.n_layers,
                                "tokens": SMALL.batch * SMALL.seq_len}
    edge = copy.deepcopy(measured)
    edge["domain"] = domain_of(SMALL)
    assert thresholds_within(SMALL, edge, "cancelling") == thresholds_from(edge, "cancelling")
    assert thresholds_within(SMALL, edge) == thresholds_from(edge, "plain")  # the default
    for field in ("d_model", "n_layers", "tokens"):
        short = copy.deepcopy(edge)
        short["domain"][field] -= 1
        with pytest.raises(ToleranceMismatch) as err:
            thresholds_within(SMALL, short)
        value = domain_of(SMALL)[field]
        assert str(err.value) == (
            f"small: {field}={value} exceeds the measured training domain ({field} <= "
            f"{value - 1}): its floor was never measured")

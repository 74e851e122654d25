"""What a training floor records, and the threshold of each training quantity derived from it.

``training.floor`` (and ``training.sequence_floor``, over the SP / CP meshes) trains every
case of its domain correctly; this module records what it measured (``artifact``:
``tolerance/training[_1b].json``, ``sequence[_1b].json``), reads it back (``load``) and
derives the thresholds: per quantity and regime, ``derive_threshold`` of the worst deviation
(the smallest power of ten at or above 100x). Cancelling partial sums amplify relative
rounding error by design and get a floor of their own (the ``cancelling`` regime), so they
do not loosen every other check. A config outside the measured domain (wider, deeper, more
tokens) has no threshold: its floor was never measured (``thresholds_within``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance.artifacts import SCHEMA, artifact_path, environment
from weight_sync_bench.tolerance.rules import SAFETY, derive_threshold

# The quantities a training check compares within a measured threshold (``training.compare``
# computes them; replicas, padding gradients and hyperparameters are compared exactly).
QUANTITIES = ("loss", "input_grad", "param_grad", "kv_grad", "exp_avg", "exp_avg_sq",
              "params_step1", "params_final")
DOMAIN_FIELDS = ("d_model", "n_layers", "tokens")  # upper bounds of the measured domain
# "cancelling": row-parallel partial sums that cancel to 1e-3 of themselves (adversarial),
# whose results carry 1e3 times the relative rounding error: a floor of its own.
REGIMES = ("plain", "cancelling")


def domain_of(config: ModelConfig) -> dict[str, int]:
    return {"d_model": config.d_model, "n_layers": config.n_layers,
            "tokens": config.batch * config.seq_len}


def artifact(kind: str, phase: str, repetitions: int, steps: int,
             worst: dict[str, dict[str, dict[str, Any]]], cells: list[dict[str, Any]],
             domain: dict[str, int], meshes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``kind`` floor (``training``, ``sequence``) of ``phase``: per regime and quantity
    the ``worst`` deviation with where it was seen, and its threshold; every case's
    deviations (``cells``); the ``domain`` measured (each field's largest value) and, over
    gloo, the ``meshes`` it covers."""
    return {
        "schema": SCHEMA, "kind": kind, "phase": phase, "repetitions": repetitions,
        "steps": steps, **({"meshes": meshes} if meshes is not None else {}),
        "rule": f"per quantity: smallest power of ten >= {SAFETY} x worst",
        "deviation": {"loss, input_grad, param_grad, kv_grad":
                      "max |sharded - reference| / max |reference|, per parameter",
                      "params_step1, params_final":
                      "||sharded - reference|| / ||reference - start|| (L2), per parameter"},
        "exact": {"replicas": "byte-identical copies; no threshold",
                  "padding_grad": "gradient of the padded vocab rows: exactly 0"},
        "domain": domain,
        "regimes": {regime: {q: {**w, "threshold": derive_threshold(w["worst"])}
                             for q, w in per.items()} for regime, per in worst.items()},
        "cells": cells, "environment": environment(),
    }


def measure_command(kind: str, phase: str) -> str:
    """The command that measures (and commits) the ``kind`` floor of ``phase``."""
    return (f"python -m weight_sync_bench.tolerance {kind}"
            + (f" --phase {phase}" if phase != "1a" else "") + " --write")


def load(path: Path | None = None, phase: str = "1a", kind: str = "training") -> dict[str, Any]:
    """The ``kind`` floor of ``phase``, read back: ``ToleranceMismatch`` naming the file
    where it is missing (with the command that measures it), not JSON, of another schema,
    kind or phase (a floor is not reused across phases), or without a quantity's floor."""
    path = path or artifact_path(phase, kind=kind)
    try:
        measured = json.loads(path.read_text())
    except FileNotFoundError:
        raise ToleranceMismatch(f"{path}: no {kind} tolerance; measure it with "
                                f"`{measure_command(kind, phase)}`") from None
    except json.JSONDecodeError as exc:
        raise ToleranceMismatch(f"{path}: not valid JSON ({exc})") from None
    if measured.get("schema") != SCHEMA or measured.get("kind") != kind:
        raise ToleranceMismatch(f"{path}: not a schema-{SCHEMA} {kind} artifact")
    if measured.get("phase") != phase:
        raise ToleranceMismatch(f"{path}: records phase {measured.get('phase')!r}, asked for "
                                f"{phase!r}: a floor is not reused across phases")
    for regime in REGIMES:
        missing = [q for q in QUANTITIES if q not in measured.get("regimes", {}).get(regime, {})]
        if missing:
            raise ToleranceMismatch(f"{path}: no {regime} floor recorded for {', '.join(missing)}")
    return measured


def thresholds_from(measured: dict[str, Any], regime: str = "plain") -> dict[str, float]:
    """Each quantity's threshold: ``derive_threshold`` of its recorded worst (pure)."""
    if regime not in REGIMES:
        raise ToleranceMismatch(f"unknown regime {regime!r}; known: {', '.join(REGIMES)}")
    return {q: derive_threshold(measured["regimes"][regime][q]["worst"]) for q in QUANTITIES}


def thresholds_within(config: ModelConfig, measured: dict[str, Any], regime: str = "plain"
                      ) -> dict[str, float]:
    """``thresholds_from`` for a config inside the measured domain; ``ToleranceMismatch``
    for one outside it (wider, deeper or more tokens than any case measured)."""
    for field, value in domain_of(config).items():
        if value > measured["domain"][field]:
            raise ToleranceMismatch(
                f"{config.name}: {field}={value} exceeds the measured training domain "
                f"({field} <= {measured['domain'][field]}): its floor was never measured")
    return thresholds_from(measured, regime)


# a cell's case: "<config> <batch or adversary> seed=<s> <mesh>", the mesh as Mesh.__str__
_CELL = re.compile(r"^(?P<config>\S+) .* (?P<mesh>dp=\d+ tp=\d+(?: sp)?(?: cp=\d+)?)$")


def measured_meshes(measured: dict[str, Any], config: str, regime: str = "plain") -> list[str]:
    """The meshes (``str(Mesh)``) ``measured`` measured ``config`` on in ``regime``, in the
    order first seen (pure)."""
    seen: dict[str, None] = {}
    for cell in measured.get("cells", ()):
        found = _CELL.match(str(cell.get("case", "")))
        if found and found["config"] == config and cell.get("regime") == regime:
            seen.setdefault(found["mesh"], None)
    return list(seen)

"""What a phase floor records: its cells, built from measured deviations, and the artifact.

``check.floor`` runs the forwards; this module turns the per-logit deviations they measured
into the artifact ``tolerance.rules`` reads. Per destination cell (config, degree, forward),
over the pooled deviations of every repetition, in units of 2^-23 (``ULP``): ``max_ulp`` (a
tail statistic that grows with tensor size and repetitions), ``median_ulp`` and
``mean_ulp`` (they do not saturate), ``worst_abs`` and the number of ``elements``. The
artifact's threshold is ``derive_threshold`` of its worst cell.

Two forwards have cells: the plain layout's (``PLAIN_FORWARD``: a cell without a
``forward`` field, as every artifact measured before the field existed holds), and vLLM's
at a degree past ``n_kv_heads`` (``REPLICATED_KV``: each KV head replicated over
``t / n_kv_heads`` ranks), whose cells name it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from weight_sync_bench.model.config import ModelConfig, dtype_name
from weight_sync_bench.tolerance.artifacts import SCHEMA, environment
from weight_sync_bench.tolerance.rules import (
    SAFETY,
    TOKEN_SEED_OFFSET,
    ULP,
    derive_threshold,
    geometry_key,
    geometry_record,
    numerics,
)

PLAIN_FORWARD = "plain"  # the plain layout's sharded forward (a cell without a forward field)
REPLICATED_KV = "vllm-replicated-kv"  # vLLM's forward at t > n_kv_heads (HeadReplicated KV)
# An MoE forward whose experts sit whole on expert-parallel ranks (or over data-parallel
# replicas of the dense layers): its partial outputs are summed in another grouping than the
# plain layout's experts split over every rank
EXPERT_PARALLEL = "expert-parallel"


def cell_forward(cell: Mapping[str, Any]) -> str:
    """The forward a floor cell was measured on (``PLAIN_FORWARD`` where it names none)."""
    return str(cell.get("forward", PLAIN_FORWARD))


def measured_degrees(artifact: Mapping[str, Any], name: str, forward: str) -> list[int]:
    """The degrees at which ``artifact`` measured config ``name``'s ``forward``."""
    return sorted({int(c["degree"]) for c in artifact.get("cells", ())
                   if c.get("config") == name and cell_forward(c) == forward})


def cell(name: str, degree: int, deviations: Sequence[np.ndarray],
         forward: str = PLAIN_FORWARD, route: Sequence[float] | None = None) -> dict[str, Any]:
    """One destination cell's figures over its pooled per-logit deviations (one array per
    repetition); a cell of another forward than the plain layout's names it. An MoE model's
    cell also records ``worst_route``, the largest selection-score deviation of the sharded
    forward's own routing over its repetitions (``route``): the routing check keeps the
    reference's choice only within the threshold of a tie, which this figure must stay far
    below (``route_headroom``)."""
    pooled = np.concatenate(deviations).astype(np.float64)
    which = {} if forward == PLAIN_FORWARD else {"forward": forward}
    routed = {} if route is None else {"worst_route": float(max(route))}
    return {"config": name, "degree": degree, **which, "max_ulp": float(pooled.max() / ULP),
            "median_ulp": float(np.median(pooled) / ULP), "mean_ulp": float(pooled.mean() / ULP),
            "worst_abs": float(pooled.max()), "elements": int(pooled.size), **routed}


def route_headroom(artifact: Mapping[str, Any], threshold: float) -> float | None:
    """The threshold over the worst routing deviation any cell records (None where no cell
    records one: a dense floor): how far the routing check's bound, the threshold, sits above
    what a correct sharded forward's own routing moved a selection score by."""
    worst = [float(c["worst_route"]) for c in artifact.get("cells", ()) if "worst_route" in c]
    if not worst:
        return None
    return threshold / max(max(worst), 1e-30)


def artifact(phase: str, configs: Iterable[ModelConfig], cells: list[dict[str, Any]],
             repetitions: int, weights: torch.dtype, fp8: str | None = None) -> dict[str, Any]:
    """The phase floor of ``cells`` measured over ``repetitions`` seeds (model seed ``r``,
    token seed ``TOKEN_SEED_OFFSET + r``) on weights of dtype ``weights`` (``fp8``: those
    weights quantized by ``conventions.fp8`` in that scheme and computed dequantized), with
    the geometry, token shape and numerics of each config (what ``check_geometry``
    compares), its worst observation, the threshold it implies and the environment it ran
    in."""
    worst = max(c["worst_abs"] for c in cells)
    extra = {} if weights == torch.float32 and fp8 is None else {
        "weights_dtype": dtype_name(weights) if fp8 is None else f"fp8_{fp8}",
        **({"quantized_from": dtype_name(weights)} if fp8 is not None else {}),
        "compute_dtype": "fp32"}
    return {
        "schema": SCHEMA, "phase": phase, "unit": "2^-23", "repetitions": repetitions, **extra,
        "seeds": {"param": f"0..{repetitions - 1}",
                  "token": f"{TOKEN_SEED_OFFSET}..{TOKEN_SEED_OFFSET + repetitions - 1}"},
        "rule": f"smallest power of ten >= {SAFETY} x worst_abs",
        "configs": {c.name: {"geometry": c.geometry(), "token_shape": list(c.token_shape),
                             "numerics": numerics(c)} for c in configs},
        "cells": cells, "worst_abs": worst, "threshold": derive_threshold(worst),
        "environment": environment(),
    }


def geometry_artifact(measured: dict[str, Any], config: ModelConfig, phase: str,
                      dtype: str) -> dict[str, Any]:
    """A phase floor of one geometry as its cache holds it (``tolerance.rules.floor_for``
    reads it back): the weights' dtype, ``kind`` ``geometry``, the ``key`` its file is named
    by and the ``record`` the key digests."""
    out = dict(measured)
    out.setdefault("weights_dtype", dtype)
    out["kind"] = "geometry"
    out["key"] = geometry_key(config, phase, dtype)
    out["record"] = geometry_record(config, phase, dtype)
    return out

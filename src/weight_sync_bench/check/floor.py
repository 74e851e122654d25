"""The phase floors: the numerical deviation of correct sharded logits, measured.

``python -m weight_sync_bench.tolerance [--phase 1b]`` writes ``tolerance/phase<P>.json``:
per destination cell (config, t), over ``repetitions`` model and token seeds, the deviation
of the sharded logits from the reference in units of 2^-23. ``tolerance.rules`` derives the
threshold from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import (
    TOY,
    TOY_KV4,
    ModelConfig,
    init_params,
    make_tokens,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.artifacts import (
    PHASES,
    SCHEMA,
    environment,
)
from weight_sync_bench.tolerance.rules import (
    SAFETY,
    TOKEN_SEED_OFFSET,
    ULP,
    derive_threshold,
    numerics,
    threshold_from,
)

REPETITIONS = 20


# (config, degree, param seed, token seed) -> rank 0's sharded logits under the declared split
ShardedRunner = Callable[[ModelConfig, int, int, int], torch.Tensor]


def inprocess_runner(config: ModelConfig, degree: int, param_seed: int, token_seed: int,
                     params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Phase 1a: every rank in this process over ``InProcessCollective``."""
    params = params if params is not None else init_params(config, param_seed)
    shards = split(params, layout_for(config), degree)
    return ShardedModel(config, shards, InProcessCollective(degree))(
        make_tokens(config, token_seed))[0]


def measure(phase: str = "1a", *, configs: Iterable[ModelConfig] = (TOY, TOY_KV4),
            repetitions: int = REPETITIONS, runner: ShardedRunner | None = None,
            ) -> dict[str, Any]:
    """Measure the floor per destination cell and return the artifact (not yet written).

    ``runner`` computes the sharded logits; phase 1a defaults to the in-process forward.
    """
    if phase not in PHASES:
        raise ToleranceMismatch(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    if runner is None:
        if phase != "1a":
            raise ToleranceMismatch(f"phase {phase} needs its own runner (the gloo launcher)")
        runner = inprocess_runner
    configs = list(configs)
    cells: list[dict[str, Any]] = []
    for config in configs:
        degrees = layout_for(config).supported_degrees()
        deviations: dict[int, list[np.ndarray]] = {t: [] for t in degrees}
        for rep in range(repetitions):
            params = init_params(config, rep)
            reference = ReferenceModel(config, params)(make_tokens(config, TOKEN_SEED_OFFSET + rep))
            for t in degrees:
                logits = (inprocess_runner(config, t, rep, TOKEN_SEED_OFFSET + rep, params)
                          if runner is inprocess_runner
                          else runner(config, t, rep, TOKEN_SEED_OFFSET + rep))
                deviations[t].append((logits - reference).abs().flatten().numpy())
        for t in degrees:
            pooled = np.concatenate(deviations[t]).astype(np.float64)
            cells.append({"config": config.name, "degree": t,
                          "max_ulp": float(pooled.max() / ULP),
                          "median_ulp": float(np.median(pooled) / ULP),
                          "mean_ulp": float(pooled.mean() / ULP),
                          "worst_abs": float(pooled.max()),
                          "elements": int(pooled.size)})
    worst = max(cell["worst_abs"] for cell in cells)
    return {
        "schema": SCHEMA, "phase": phase, "unit": "2^-23", "repetitions": repetitions,
        "seeds": {"param": f"0..{repetitions - 1}",
                  "token": f"{TOKEN_SEED_OFFSET}..{TOKEN_SEED_OFFSET + repetitions - 1}"},
        "rule": f"smallest power of ten >= {SAFETY} x worst_abs",
        "configs": {c.name: {"geometry": c.geometry(), "token_shape": list(c.token_shape),
                             "numerics": numerics(c)} for c in configs},
        "cells": cells, "worst_abs": worst, "threshold": derive_threshold(worst),
        "environment": environment(),
    }


def format_table(artifact: dict[str, Any]) -> str:
    rows = [["cell", "max ULP", "median ULP", "mean ULP", "worst abs", "kernel set"]]
    for cell in artifact["cells"]:
        rows.append([f"{cell['config']}, t={cell['degree']}", f"{cell['max_ulp']:.2f}",
                     f"{cell['median_ulp']:.3f}", f"{cell['mean_ulp']:.3f}",
                     f"{cell['worst_abs']:.4g}",
                     cell.get("kernel_set", artifact["environment"].get("cpu_capability", "?"))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"phase {artifact['phase']}: worst {artifact['worst_abs']:.4g}, "
                 f"threshold {threshold_from(artifact):g} ({artifact['rule']})")
    return "\n".join(lines)

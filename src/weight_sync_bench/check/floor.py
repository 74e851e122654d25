"""The phase floors: the numerical deviation of correct sharded logits, measured.

``python -m weight_sync_bench.tolerance [--phase 1b]`` writes ``tolerance/phase<P>.json``:
per destination cell (config, t), over ``repetitions`` model and token seeds, the deviation
of the sharded logits from the reference in units of 2^-23. ``tolerance.rules`` derives the
threshold from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import (
    TOY,
    TOY_KV4,
    ModelConfig,
    dtype_name,
    init_params,
    make_tokens,
    parse_dtype,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.artifacts import (
    PHASES,
    SCHEMA,
    environment,
    write_artifact,
)
from weight_sync_bench.tolerance.rules import (
    SAFETY,
    TOKEN_SEED_OFFSET,
    ULP,
    cached_floor_path,
    derive_threshold,
    geometry_key,
    geometry_record,
    numerics,
    threshold_from,
)

if TYPE_CHECKING:
    from weight_sync_bench.check.checker import Forward

REPETITIONS = 20
# A per-geometry floor (a real width, measured on first use) takes fewer: one repetition of
# Llama-3-8B's width at 2 layers draws 1.5e9 weights and runs five forwards.
GEOMETRY_REPETITIONS = 4


# (config, degree, param seed, token seed) -> rank 0's sharded logits under the declared split
ShardedRunner = Callable[[ModelConfig, int, int, int], torch.Tensor]


def inprocess_runner(config: ModelConfig, degree: int, param_seed: int, token_seed: int,
                     params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Phase 1a: every rank in this process over ``InProcessCollective``."""
    params = params if params is not None else init_params(config, param_seed)
    shards = split(params, layout_for(config), degree)
    return ShardedModel(config, shards, InProcessCollective(degree))(
        make_tokens(config, token_seed))[0]


def computing(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters as the forward computes with them: fp32, upcast exactly from bf16 or fp16
    (the synced values, not the fp32 draws they were rounded from); fp32 ones as they are."""
    return {n: x if x.dtype == torch.float32 else x.float() for n, x in params.items()}


def measure(phase: str = "1a", *, configs: Iterable[ModelConfig] = (TOY, TOY_KV4),
            repetitions: int = REPETITIONS, runner: ShardedRunner | None = None,
            dtype: str = "fp32", forward: Forward | None = None) -> dict[str, Any]:
    """Measure the floor per destination cell and return the artifact (not yet written).

    ``runner`` computes the sharded logits; phase 1a defaults to the in-process forward.
    ``dtype`` (``"bf16"``, ``"fp16"``) measures the floor of weights synced in that dtype:
    drawn as the fp32 floor's, rounded to ``dtype``, and computed in fp32 from the rounded
    values by both the reference and the sharded forward, which then gets the declared
    shards through ``forward`` (a ``check.Forward``; phase 1a defaults to the in-process
    one). The artifact records ``weights_dtype``; an fp32 one is exactly what it always was.
    """
    if phase not in PHASES:
        raise ToleranceMismatch(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    weights = parse_dtype(dtype)
    if weights != torch.float32 and forward is None:
        if phase != "1a":
            raise ToleranceMismatch(f"phase {phase} needs its own forward (the gloo one)")
        forward = inprocess_forward
    if runner is None:
        if phase != "1a" and forward is None:
            raise ToleranceMismatch(f"phase {phase} needs its own runner (the gloo launcher)")
        runner = inprocess_runner
    configs = list(configs)
    cells: list[dict[str, Any]] = []
    for config in configs:
        degrees = layout_for(config).supported_degrees()
        deviations: dict[int, list[np.ndarray]] = {t: [] for t in degrees}
        layout = layout_for(config)
        for rep in range(repetitions):
            params = init_params(config, rep, dtype=weights)
            tokens = make_tokens(config, TOKEN_SEED_OFFSET + rep)
            reference = ReferenceModel(config, computing(params))(tokens)
            for t in degrees:
                if forward is not None:  # the declared shards in the synced dtype, upcast
                    shards = [computing(p) for p in split(params, layout, t)]
                    logits = forward(config, shards, tokens)
                elif runner is inprocess_runner:
                    logits = inprocess_runner(config, t, rep, TOKEN_SEED_OFFSET + rep, params)
                else:
                    logits = runner(config, t, rep, TOKEN_SEED_OFFSET + rep)
                deviations[t].append((logits - reference).abs().flatten().numpy())
                del logits
            del params, reference
        cells += [_cell(config.name, t, deviations[t]) for t in degrees]
    return _artifact(phase, configs, cells, repetitions, weights)


def _cell(name: str, degree: int, deviations: list[np.ndarray]) -> dict[str, Any]:
    """One destination cell's figures over its pooled per-logit deviations."""
    pooled = np.concatenate(deviations).astype(np.float64)
    return {"config": name, "degree": degree, "max_ulp": float(pooled.max() / ULP),
            "median_ulp": float(np.median(pooled) / ULP), "mean_ulp": float(pooled.mean() / ULP),
            "worst_abs": float(pooled.max()), "elements": int(pooled.size)}


def _artifact(phase: str, configs: list[ModelConfig], cells: list[dict[str, Any]],
              repetitions: int, weights: torch.dtype) -> dict[str, Any]:
    worst = max(cell["worst_abs"] for cell in cells)
    extra = {} if weights == torch.float32 else {
        "weights_dtype": dtype_name(weights), "compute_dtype": "fp32"}
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


def measure_geometry(config: ModelConfig, *, phase: str = "1a", dtype: str = "fp32",
                     repetitions: int = GEOMETRY_REPETITIONS,
                     forward: Forward | None = None,
                     progress: Callable[[str], None] | None = None,
                     out: Path | None = None) -> tuple[dict[str, Any], Path]:
    """Measure one geometry's floor, as the committed phase floors are measured (model
    seeds ``0..repetitions-1``, every supported degree, the running kernel set; phase 1a
    streamed, so a real width fits: ``check.stream``, bit for bit the same logits), and cache
    it under ``tolerance_dir()/geometry/`` with its provenance and key
    (``tolerance.rules.floor_for`` reads it back): ``(artifact, path)``. Phase 1b needs
    ``forward`` (``check.forwards.gloo_forward()``). ``progress`` gets a line of text
    after each streamed stage (seed, degree, ``stream.Progress``)."""
    if phase != "1a" and forward is None:
        raise ToleranceMismatch(f"phase {phase} needs its own forward (the gloo one)")
    if phase == "1a":  # streamed: a real width is never held whole (check.stream)
        from weight_sync_bench.check.stream import (
            stream_deviation,  # builds on check.checker
        )

        def report(rep: int, t: int) -> Callable[[Any], None] | None:
            if progress is None:
                return None
            return lambda p: progress(f"seed {rep + 1}/{repetitions}, t={t}: {p}")

        cells = [_cell(config.name, t, [stream_deviation(config, t, seed=rep, dtype=dtype,
                                                         progress=report(rep, t)).numpy()
                                        for rep in range(repetitions)])
                 for t in layout_for(config).supported_degrees()]
        artifact = _artifact(phase, [config], cells, repetitions, parse_dtype(dtype))
    else:
        artifact = measure(phase, configs=[config], repetitions=repetitions, dtype=dtype,
                           forward=forward)
    artifact.setdefault("weights_dtype", dtype)
    artifact["kind"] = "geometry"
    artifact["key"] = geometry_key(config, phase, dtype)
    artifact["record"] = geometry_record(config, phase, dtype)
    path = out or cached_floor_path(config, phase, dtype)
    write_artifact(artifact, path)
    return artifact, path

"""The numerical floor of a correct layout, measured; and the threshold derived from it.

A row-parallel matmul sums partial products across ranks in another order than the dense
matmul, so correct sharded logits differ from the reference in the low bits. The threshold
must admit that reordering and still catch a layout bug, so it is measured, never typed in:

    python -m weight_sync_bench.tolerance            # writes tolerance/phase1a.json

Per destination cell (config, t) over ``repetitions`` model and token seeds it records, in
units of 2^-23: ``max_ulp`` (the max over every logit of every repetition: a tail statistic
that grows with tensor size and repetitions), ``median_ulp`` and ``mean_ulp`` (over the same
pooled per-logit deviations: they do not saturate), and ``worst_abs``. The threshold is a
pure function of the artifact (``derive_threshold``): the smallest power of ten at or above
100x the worst observation. The floor belongs to the geometry and token shape it was
measured on, so reading a threshold for a config checks both against the record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weight_sync_bench.config import TOY, TOY_KV4, ModelConfig, init_params, make_tokens
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.model import ReferenceModel
from weight_sync_bench.reshard import split
from weight_sync_bench.sharded import InProcessCollective, ShardedModel
from weight_sync_bench.shardspec import layout_for

SCHEMA = 1
ULP = 2.0 ** -23  # the unit deviations are recorded in
SAFETY = 100  # the threshold sits at least this many times above the worst observation
REPETITIONS = 20
TOKEN_SEED_OFFSET = 1000  # repetition r uses model seed r and token seed 1000 + r
PHASES = ("1a", "1b")

# (config, degree, param seed, token seed) -> rank 0's sharded logits under the declared split
ShardedRunner = Callable[[ModelConfig, int, int, int], torch.Tensor]


def tolerance_dir() -> Path:
    """Where artifacts live: $WSB_TOLERANCE_DIR, else the repository's ``tolerance/``."""
    env = os.environ.get("WSB_TOLERANCE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "tolerance"


def artifact_path(phase: str) -> Path:
    if phase not in PHASES:
        raise ToleranceMismatch(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    return tolerance_dir() / f"phase{phase}.json"


def derive_threshold(worst_abs: float, safety: int = SAFETY) -> float:
    """The smallest power of ten at or above ``safety`` x the worst observation.

    Exact at the boundaries: computed on the rational the float's shortest repr names
    (``1e-05`` is exactly 1e-5 here), never through a float log10.
    """
    if not math.isfinite(worst_abs) or worst_abs < 0:
        raise ToleranceMismatch(f"worst observation must be finite and >= 0, got {worst_abs!r}")
    target = Fraction(repr(float(worst_abs))) * safety
    if target == 0:
        raise ToleranceMismatch("worst observation is 0: a floor of exactly zero admits no "
                                "reordering and cannot set a threshold")
    exponent = math.floor(math.log10(target))
    while Fraction(10) ** exponent < target:
        exponent += 1
    while Fraction(10) ** (exponent - 1) >= target:
        exponent -= 1
    return float(Fraction(10) ** exponent)


def environment() -> dict[str, Any]:
    """Versions and machine the measurement ran on, and the commit it measured."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10)
        commit = head.stdout.strip() if head.returncode == 0 and head.stdout.strip() else None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "machine": platform.machine(), "dtype": str(torch.get_default_dtype()),
            "torch_threads": torch.get_num_threads(), "commit": commit, "src_dirty": dirty}


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


def write_artifact(artifact: dict[str, Any], path: Path) -> None:
    """Atomically: a crash mid-write never leaves a half-written artifact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(artifact, indent=2) + "\n")
    os.replace(tmp, path)


def read_artifact(path: Path, *, phase: str, fields: Iterable[str], remedy: str,
                  schema: int = SCHEMA) -> dict[str, Any]:
    """A measured artifact read back, or ``ToleranceMismatch`` naming the file and what is
    wrong: missing (with ``remedy``, the command that measures it), not JSON, a field
    missing, another schema, or another phase (a floor is never reused across phases)."""
    try:
        artifact = json.loads(path.read_text())
    except FileNotFoundError:
        raise ToleranceMismatch(f"{path}: no such artifact; measure it with `{remedy}`") from None
    except json.JSONDecodeError as exc:
        raise ToleranceMismatch(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(artifact, dict):
        raise ToleranceMismatch(f"{path}: expected a JSON object, got {type(artifact).__name__}")
    for field in ("schema", "phase", *fields):
        if field not in artifact:
            raise ToleranceMismatch(f"{path}: missing field {field!r}")
    if artifact["schema"] != schema:
        raise ToleranceMismatch(f"{path}: field 'schema' is {artifact['schema']!r}, "
                                f"this code reads {schema}")
    if artifact["phase"] != phase:
        raise ToleranceMismatch(f"{path}: field 'phase' records {artifact['phase']!r}, "
                                f"asked for {phase!r}")
    return artifact


def load_artifact(phase: str = "1a", path: Path | None = None) -> dict[str, Any]:
    return read_artifact(path or artifact_path(phase), phase=phase,
                         fields=("configs", "cells", "worst_abs"),
                         remedy=f"python -m weight_sync_bench.tolerance --phase {phase}")


def check_geometry(artifact: dict[str, Any], config: ModelConfig) -> None:
    """Fail unless the running config's geometry and token shape equal the recorded ones."""
    recorded = artifact["configs"].get(config.name)
    if recorded is None:
        raise ToleranceMismatch(
            f"phase {artifact['phase']}: no floor recorded for config {config.name!r} "
            f"(recorded: {', '.join(artifact['configs'])}); pass threshold= explicitly, or for "
            "a geometry inside the fuzz domain threshold_rule=floor.fuzz_threshold_rule()")
    if (recorded["geometry"] != config.geometry()
            or tuple(recorded["token_shape"]) != config.token_shape):
        diff = {k: (recorded["geometry"].get(k), v) for k, v in config.geometry().items()
                if recorded["geometry"].get(k) != v}
        why = (" (the token shape sets how many logits the max is taken over: a larger one "
               "widens the floor)" if {"batch", "seq_len"} & diff.keys() else "")
        raise ToleranceMismatch(
            f"{config.name}: running geometry differs from the phase {artifact['phase']} "
            "floor's: " + ", ".join(f"{k} recorded {a} running {b}" for k, (a, b) in diff.items())
            + why)
    recorded_numerics = recorded.get("numerics")
    if recorded_numerics is not None and recorded_numerics != numerics(config):
        diff = {k: (recorded_numerics.get(k), v) for k, v in numerics(config).items()
                if recorded_numerics.get(k) != v}
        raise ToleranceMismatch(
            f"{config.name}: running numerics differ from the phase {artifact['phase']} "
            "floor's: " + ", ".join(f"{k} recorded {a} running {b}" for k, (a, b) in diff.items()))


def numerics(config: ModelConfig) -> dict[str, float]:
    """The float fields that move the floor without changing any shape."""
    return {"rope_theta": config.rope_theta, "norm_eps": config.norm_eps}


def threshold_from(artifact: dict[str, Any]) -> float:
    """The threshold an artifact implies: ``derive_threshold`` of its worst observation."""
    return derive_threshold(artifact["worst_abs"])


def threshold_for(config: ModelConfig, phase: str = "1a") -> float:
    """The threshold for a built-in config in a phase, after checking its geometry."""
    artifact = load_artifact(phase)
    check_geometry(artifact, config)
    return threshold_from(artifact)


def format_table(artifact: dict[str, Any]) -> str:
    rows = [["cell", "max ULP", "median ULP", "mean ULP", "worst abs"]]
    for cell in artifact["cells"]:
        rows.append([f"{cell['config']}, t={cell['degree']}", f"{cell['max_ulp']:.2f}",
                     f"{cell['median_ulp']:.3f}", f"{cell['mean_ulp']:.3f}",
                     f"{cell['worst_abs']:.4g}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"phase {artifact['phase']}: worst {artifact['worst_abs']:.4g}, "
                 f"threshold {threshold_from(artifact):g} ({artifact['rule']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weight_sync_bench.tolerance",
                                     description="Measure the floor and write tolerance/phase*.json.")
    parser.add_argument("--phase", choices=PHASES, default="1a")
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    parser.add_argument("--out", type=Path, default=None, help="default: tolerance/phase<P>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runner = None
    if args.phase == "1b":
        from weight_sync_bench.phase1b import phase1b_runner  # the gloo launcher
        runner = phase1b_runner()
    artifact = measure(args.phase, repetitions=args.repetitions, runner=runner)
    path = args.out or artifact_path(args.phase)
    write_artifact(artifact, path)
    print(format_table(artifact))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

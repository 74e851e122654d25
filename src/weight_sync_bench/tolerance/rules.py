"""The numerical floor of a correct layout, measured; and the threshold derived from it.

A row-parallel matmul sums partial products across ranks in another order than the dense
matmul, so correct sharded logits differ from the reference in the low bits. The threshold
must admit that reordering and still catch a layout bug, so it is measured, never typed in:

    wsb floor phase --write     # (python -m weight_sync_bench.tolerance --write) phase1a.json

Per destination cell (config, t) over ``repetitions`` model and token seeds it records, in
units of 2^-23: ``max_ulp`` (the max over every logit of every repetition: a tail statistic
that grows with tensor size and repetitions), ``median_ulp`` and ``mean_ulp`` (over the same
pooled per-logit deviations: they do not saturate), and ``worst_abs``. The threshold is a
pure function of the artifact (``derive_threshold``): the smallest power of ten at or above
100x the worst observation. The floor belongs to the geometry and token shape it was
measured on, so reading a threshold for a config checks both against the record.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.model.config import (
    CONFIGS,
    DEFAULT_INIT,
    HF_CONFIGS,
    ModelConfig,
    hf_config_path,
    shipped_hf_config,
)
from weight_sync_bench.tolerance.artifacts import (
    COMPARED_ALIKE,
    RUNTIME_FIELDS,
    artifact_path,
    geometry_path,
    kernel_set_label,
    kernel_sets_of,
    read_artifact,
    running_kernel_set,
    runtime,
    vendor_of,
)

ULP = 2.0 ** -23  # the unit deviations are recorded in
SAFETY = 100  # the threshold sits at least this many times above the worst observation


TOKEN_SEED_OFFSET = 1000  # repetition r uses model seed r and token seed 1000 + r

# What judges a check's logits: (config, reference logits) -> threshold. The rules derived
# here from a measurement (``tolerance.sampled.SampledRule``, ``threshold_for`` bound to a
# config) and a caller's own function alike.
ThresholdRule = Callable[[ModelConfig, torch.Tensor], float]


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


def load_artifact(phase: str = "1a", path: Path | None = None) -> dict[str, Any]:
    """The phase floor, read back; ``ToleranceMismatch`` unless its recorded worst is the
    worst of its cells (an edited or half-merged artifact is not a measurement)."""
    path = path or artifact_path(phase)
    artifact = read_artifact(path, phase=phase, fields=("configs", "cells", "worst_abs"),
                             remedy=f"python -m weight_sync_bench.tolerance --phase {phase}")
    cells = max((cell["worst_abs"] for cell in artifact["cells"]), default=None)
    if cells != artifact["worst_abs"]:
        raise ToleranceMismatch(f"{path}: field 'worst_abs' records {artifact['worst_abs']!r}, "
                                f"but the worst of its cells is {cells!r}")
    return artifact


def environment_drift(recorded: dict[str, Any], running: dict[str, Any] | None = None
                      ) -> list[str]:
    """How the running process differs from the one a floor was measured in: one line per
    field of ``RUNTIME_FIELDS`` that differs. A floor measured under several kernel sets
    (``kernel_sets``, each on a machine class: ``GenuineIntel/AVX512``; an unqualified name on
    the vendor ``recorded`` names) covers any of them, and no other: the vendor and the
    kernel set are compared together. The commit is provenance, not compared: every later
    commit differs, and the code a floor depends on is pinned by the tests."""
    running = running if running is not None else runtime()
    sets = recorded.get("kernel_sets")
    notes = []
    for field in RUNTIME_FIELDS:
        if sets is not None and field in ("cpu_vendor", "cpu_capability"):
            continue  # compared together, as one of the kernel sets
        if field == "cpu_vendor":  # where not recorded, the vendor its cpu_model names
            value = vendor_of(recorded)
            unrecorded = value is None and running[field] is not None
        else:
            value, unrecorded = recorded.get(field), field not in recorded
        if unrecorded:
            notes.append(f"{field} not recorded (running {running[field]})")
        elif value != running[field]:
            notes.append(f"{field} recorded {value} running {running[field]}")
    if sets is not None:
        here = running_kernel_set(running)
        covered = [kernel_set_label(vendor_of(recorded), k) for k in sets]
        if here not in covered:
            vendors = {k.split("/")[0] for k in covered if "/" in k}
            never = ("" if running.get("cpu_vendor") in vendors or not vendors else
                     f": none on this CPU vendor ({running.get('cpu_vendor')})")
            notes.append(f"kernel set {here} is not among the kernel sets the floor was "
                         f"measured under ({', '.join(covered)}){never}")
    return notes


def vendor_only(artifact: dict[str, Any], notes: list[str],
                running: dict[str, Any] | None = None) -> bool:
    """Whether every drift note of ``artifact`` is the CPU vendor alone: this kernel set was
    measured, on another vendor only (or, unmerged, the vendor is all that differs). Such a
    floor moves by at most 1.6x (every committed floor merged over an AMD EPYC and an Intel
    Xeon: tolerance/*.json's ``machines``), inside the 100x ``SAFETY`` of the rule that
    derives its threshold, so it is noted, not refused: a floor measured on one vendor still
    judges a check on the other (the CI machine's vendor is drawn, not chosen)."""
    running = running if running is not None else runtime()
    sets = kernel_sets_of(artifact) if "kernel_sets" in artifact else None
    for note in notes:
        if note.startswith("cpu_vendor recorded"):
            continue
        if (note.startswith("kernel set ") and sets is not None
                and running["cpu_capability"] in {k.split("/")[-1] for k in sets}):
            continue
        return False
    return True


def strict_environment() -> bool:
    """``WSB_STRICT_ENV=1`` (``--strict-env``): refuse a floor measured elsewhere."""
    return os.environ.get("WSB_STRICT_ENV", "") not in ("", "0")


def artifact_drift(artifact: dict[str, Any]) -> list[str]:
    """``environment_drift`` of a measured artifact: its environment, and the kernel sets
    (with their vendors) it was merged over (``tolerance.kernels``), against this process."""
    recorded = dict(artifact.get("environment", {}))
    if "kernel_sets" in artifact:
        recorded["kernel_sets"] = kernel_sets_of(artifact)
    return environment_drift(recorded)


def merges_here(artifact: dict[str, Any]) -> bool:
    """Whether this process differs from ``artifact``'s environment at most by its CPU vendor
    and kernel set: a measurement here merges into it (``tolerance.kernels``); under other
    versions of torch, numpy or python it is a new measurement."""
    recorded, here = artifact.get("environment", {}), runtime()
    return all(recorded.get(field, here[field]) == here[field] for field in COMPARED_ALIKE)


def check_environment(artifact: dict[str, Any], what: str,
                      remedy: str = "python -m weight_sync_bench.tolerance") -> tuple[str, ...]:
    """The drift notes of ``artifact``'s environment; under ``strict_environment()`` a
    ``ToleranceMismatch`` naming every difference instead, unless the only difference is the
    CPU vendor (``vendor_only``): that stays a note, strict or not."""
    notes = artifact_drift(artifact)
    if notes and strict_environment() and not vendor_only(artifact, notes):
        raise ToleranceMismatch(f"{what}: measured in another environment (WSB_STRICT_ENV is "
                                "set): " + "; ".join(notes) + f". Re-measure it here with {remedy}")
    return tuple(f"{what} measured elsewhere: {n}" for n in notes)


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


# Where a floor applies. A committed phase artifact covers the configs it records, by name,
# geometry, token shape and numerics (``check_geometry``), for the weight dtype it was
# measured on (``weights_dtype``; fp32 where the field is absent: every artifact measured
# before it existed drew fp32 weights). ``random_floor_<phase>.json`` covers the fuzz domain
# it records, under the fuzz's init (``fuzz.floor.fuzz_threshold_rule`` refuses outside it),
# never a check of the default init. A geometry nobody measured gets its own measurement,
# cached under ``tolerance_dir()/geometry/`` (``check.floor.measure_geometry``), or is refused.
# Within a floor that covers the geometry, a conversion also needs a cell of its destination's
# forward at its degree (vLLM's replicated KV heads past n_kv_heads have cells of their own,
# ``"forward": "vllm-replicated-kv"``): ``check.convert.require_cell`` refuses it otherwise.


def weights_dtype(artifact: dict[str, Any]) -> str:
    """The dtype of the weights a floor was measured on (``"fp32"``, ``"bf16"``, ``"fp16"``)."""
    return str(artifact.get("weights_dtype", "fp32"))


def coverage(artifact: dict[str, Any], config: ModelConfig, dtype: str = "fp32") -> str | None:
    """Why ``artifact`` does not cover a check of ``config`` syncing ``dtype`` weights, or
    None when it does: the weights' dtype, then the geometry, token shape and numerics."""
    if weights_dtype(artifact) != dtype:
        return f"measured on {weights_dtype(artifact)} weights, the check syncs {dtype}"
    try:
        check_geometry(artifact, config)
    except ToleranceMismatch as exc:
        return str(exc)
    return None


def geometry_record(config: ModelConfig, phase: str, dtype: str) -> dict[str, Any]:
    """Everything a per-geometry floor depends on besides the code and the machine."""
    return {"phase": phase, "weights_dtype": dtype, "geometry": config.geometry(),
            "token_shape": list(config.token_shape), "numerics": numerics(config),
            "init": {"std": DEFAULT_INIT.std, "norm_spread": DEFAULT_INIT.norm_spread}}


def geometry_key(config: ModelConfig, phase: str = "1a", dtype: str = "fp32") -> str:
    """A digest of ``geometry_record``: the cache file of one geometry's floor is named by it."""
    blob = json.dumps(geometry_record(config, phase, dtype), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cached_floor_path(config: ModelConfig, phase: str = "1a", dtype: str = "fp32", *,
                      committed: bool = False) -> Path:
    """Where ``config``'s per-geometry floor is kept: the user's floor cache
    (``paths.floor_cache_dir``), where a measurement on first use goes; ``committed``: the
    harness's tracked ``tolerance/geometry/``, which ``wsb floor geometry --commit`` writes."""
    return geometry_path(config.name, geometry_key(config, phase, dtype), phase, dtype,
                         committed=committed)


def measure_command(config: ModelConfig, phase: str = "1a", dtype: str = "fp32") -> str:
    """What measures ``config``'s floor: the command line where the geometry is a shipped HF
    config (at any depth and vocabulary) or a built-in one, else the Python call."""
    tail = (f" --phase {phase}" if phase != "1a" else "") + (
        f" --dtype {dtype}" if dtype != "fp32" else "")
    base = "python -m weight_sync_bench.tolerance geometry"
    builtin = CONFIGS.get(config.name)
    if builtin is not None and builtin == config:
        return f"{base} --config {config.name}{tail}"
    if config.name in HF_CONFIGS:
        shipped = shipped_hf_config(config.name, n_layers=config.n_layers, vocab=config.vocab)
        if shipped.replace(batch=config.batch, seq_len=config.seq_len) == config:
            full_vocab = shipped_hf_config(config.name).vocab
            vocab = f" --vocab {config.vocab}" if config.vocab != full_vocab else ""
            shape = (f" --batch {config.batch} --seq-len {config.seq_len}"
                     if config.token_shape != shipped.token_shape else "")
            return (f"{base} --hf-config {hf_config_path(config.name)} --layers "
                    f"{config.n_layers}{vocab}{shape}{tail}")
    return (f"weight_sync_bench.check.floor.measure_geometry(config, phase={phase!r}, "
            f"dtype={dtype!r})")


@dataclass(frozen=True)
class Floor:
    """The measurement a check's threshold comes from: the artifact, where it lives, and
    whether it is a committed floor or a per-geometry one (``"committed"``, ``"geometry"``)."""

    threshold: float
    artifact: dict[str, Any]
    path: Path
    source: str


def floor_for(config: ModelConfig, phase: str = "1a", dtype: str = "fp32") -> Floor:
    """The floor that covers a check of ``config`` syncing ``dtype`` weights: the committed
    phase artifact of that dtype when it records this geometry, else the per-geometry floor
    committed for it or measured into the user's floor cache (``cached_floor_path``). ``FloorNotMeasured`` otherwise, naming why each does not cover it and the
    command that measures it: never a threshold measured on another geometry."""
    reasons = []
    committed = artifact_path(phase, dtype=dtype)
    if committed.is_file():
        artifact = load_artifact(phase, committed)
        why = coverage(artifact, config, dtype)
        if why is None:
            return Floor(threshold_from(artifact), artifact, committed, "committed")
        reasons.append(f"{committed.name}: {why}")
    else:
        reasons.append(f"{committed.name}: not measured")
    # the committed per-geometry floor, then the user's cache: the first measured in this
    # environment, else the first there is (check_environment then notes or refuses it)
    places = list(dict.fromkeys([cached_floor_path(config, phase, dtype, committed=True),
                                 cached_floor_path(config, phase, dtype)]))
    found = [(path, load_geometry_floor(path, config, phase, dtype))
             for path in places if path.is_file()]
    if found:
        path, artifact = next(((p, a) for p, a in found if not artifact_drift(a)), found[0])
        return Floor(threshold_from(artifact), artifact, path, "geometry")
    reasons.append("no per-geometry floor at " + " or ".join(str(p) for p in places))
    command = measure_command(config, phase, dtype)
    why = (f"{config.name}: no measured floor covers this check (phase {phase}, {dtype} "
           f"weights, d_model {config.d_model}, n_layers {config.n_layers}, tokens "
           f"{config.batch}x{config.seq_len}): " + "; ".join(reasons))
    raise FloorNotMeasured(
        f"{why}. Measure it with `{command}`, or pass measure_floor=True to measure it on "
        "first use (cached, so the next check of this geometry reads it)", command=command,
        why=why)


def load_geometry_floor(path: Path, config: ModelConfig, phase: str, dtype: str
                        ) -> dict[str, Any]:
    """A cached per-geometry floor, read back: ``ToleranceMismatch`` unless it records the
    key of this geometry and covers it (an edited or misplaced file is not its measurement)."""
    artifact = load_artifact(phase, path)
    key = geometry_key(config, phase, dtype)
    if artifact.get("key") != key:
        raise ToleranceMismatch(f"{path}: field 'key' records {artifact.get('key')!r}, this "
                                f"geometry's is {key!r}")
    why = coverage(artifact, config, dtype)
    if why is not None:
        raise ToleranceMismatch(f"{path}: {why}")
    return artifact

"""Tolerance artifacts: where each kind lives, reading and writing them with provenance.

One implementation for every kind (phase, training, sequence, random-geometry floor):
written atomically, read back with its schema, phase and fields checked, each carrying the
versions, platform, dtype and commit it was measured on.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.paths import checkout, floor_cache_dir, tolerance_dir

SCHEMA = 1


PHASES = ("1a", "1b")

ARTIFACT_KINDS = ("phase", "training", "sequence", "random_floor")


# model.config.DTYPES' names, then FP8 destinations' (phase floors only): bf16 weights
# quantized by conventions.fp8's reference quantizer in a scheme, computed dequantized
FP8_WEIGHTS = {"fp8_block128": "block128", "fp8_tensor": "tensor"}
WEIGHT_DTYPES = ("fp32", "bf16", "fp16", *FP8_WEIGHTS)


def artifact_path(phase: str = "1a", *, kind: str = "phase", dtype: str = "fp32") -> Path:
    """The committed artifact of one kind and phase, under ``paths.tolerance_dir()``:
    ``phase1a.json``, ``training.json`` / ``training_1b.json``, ``sequence.json`` /
    ``sequence_1b.json``, ``random_floor_1a.json`` (the names the artifacts were committed
    under). A phase floor of bf16 or fp16 weights (``dtype``) is ``phase1a_bf16.json``; of
    FP8 weights, ``phase1a_fp8_block128.json`` / ``phase1a_fp8_tensor.json``."""
    if phase not in PHASES:
        raise ToleranceMismatch(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    if dtype not in WEIGHT_DTYPES:
        raise ToleranceMismatch(f"unknown weight dtype {dtype!r}; known: "
                                + ", ".join(WEIGHT_DTYPES))
    if dtype != "fp32" and kind != "phase":
        raise ToleranceMismatch(f"the {kind} floor is measured on fp32 weights only, "
                                f"asked for {dtype}")
    match kind:
        case "phase":
            name = f"phase{phase}.json" if dtype == "fp32" else f"phase{phase}_{dtype}.json"
        case "training" | "sequence":
            name = f"{kind}.json" if phase == "1a" else f"{kind}_{phase}.json"
        case "random_floor":
            name = f"random_floor_{phase}.json"
        case _:
            raise ToleranceMismatch(f"unknown artifact kind {kind!r}; known: "
                                    + ", ".join(ARTIFACT_KINDS))
    return tolerance_dir() / name


def plot_path(phase: str = "1a") -> Path:
    """The plot drawn beside the random-geometry floor (``random_floor_<phase>.png``)."""
    return artifact_path(phase, kind="random_floor").with_suffix(".png")


def mtime(path: Path) -> int | None:
    """``path``'s modification time in ns (None where there is no file): the version of an
    artifact a cache of what it implies is keyed by."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


GEOMETRY_DIR = "geometry"  # per-geometry floors: committed under tolerance_dir(), a user's
# under paths.floor_cache_dir()


def geometry_path(name: str, key: str, phase: str, dtype: str, *, committed: bool = True
                  ) -> Path:
    """Where the floor measured for one geometry is kept: ``geometry/<name>-<phase>-
    <dtype>-<key>.json`` under ``paths.tolerance_dir()`` (``committed``: the harness's own,
    tracked) or under ``paths.floor_cache_dir()`` (a user's, measured on first use), ``key``
    a digest of everything the floor depends on (``tolerance.rules.geometry_key``)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "config"
    root = tolerance_dir() if committed else floor_cache_dir()
    return root / GEOMETRY_DIR / f"{safe}-{phase}-{dtype}-{key}.json"


# What a floor depends on besides the code: the fields a check compares with the running
# process (``tolerance.rules.environment_drift``). The CPU capability names the kernel set
# torch dispatched to (ATEN_CPU_CAPABILITY): default, AVX2 and AVX-512 kernels sum in
# different orders, so their floors differ. So does the CPU vendor: MKL and oneDNN dispatch
# by vendor, so one kernel set sums in another order on an Intel CPU than on an AMD one.
RUNTIME_FIELDS = ("torch", "numpy", "python", "machine", "cpu_vendor", "cpu_capability")
# The fields every measurement merged into one floor shares: the vendor and the kernel set
# are what merging spans (``tolerance.kernels``), the versions and architecture are not.
COMPARED_ALIKE = tuple(f for f in RUNTIME_FIELDS if f not in ("cpu_vendor", "cpu_capability"))


def _cpuinfo(*keys: str) -> str | None:
    """The first /proc/cpuinfo field named by one of ``keys``, where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, where there is one."""
    return _cpuinfo("model name", "Model", "cpu model") or platform.processor() or None


def cpu_vendor() -> str | None:
    """The CPU's vendor from /proc/cpuinfo (``vendor_id``: ``AuthenticAMD``,
    ``GenuineIntel``), where there is one. MKL and oneDNN pick their kernels by vendor too, so
    one kernel set (``cpu_capability``) sums in another order on another vendor's CPU."""
    return _cpuinfo("vendor_id")


def runtime() -> dict[str, Any]:
    """The running process's versions, machine class and kernel set (cheap: no git)."""
    return {"torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpu_vendor": cpu_vendor(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def environment() -> dict[str, Any]:
    """Versions, machine and kernel set the measurement ran on, and the commit it measured."""
    root = checkout() or Path.cwd()
    try:
        head = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10)
        commit = head.stdout.strip() if head.returncode == 0 and head.stdout.strip() else None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {**runtime(), "platform": platform.platform(), "cpu_model": cpu_model(),
            "dtype": str(torch.get_default_dtype()), "torch_threads": torch.get_num_threads(),
            "commit": commit, "src_dirty": dirty}


# Which kernels a floor was measured under: a kernel set on a machine class, named
# ``<vendor>/<kernel set>`` (``GenuineIntel/AVX512``). A floor merged over several lists them
# in its ``kernel_sets`` field (``tolerance.kernels``); one measured under a single kernel set
# names it through its environment (``cpu_vendor``, ``cpu_capability``). Every artifact
# written before the vendor was recorded (2026-12-02) names its kernel sets unqualified and
# its machine by ``cpu_model`` only: those names are read on the vendor that model names.


def vendor_of(environment: dict[str, Any]) -> str | None:
    """The CPU vendor a measurement's environment records; where it predates the field, the
    vendor its ``cpu_model`` names (``AMD EPYC`` -> ``AuthenticAMD``); else None."""
    if environment.get("cpu_vendor"):
        return str(environment["cpu_vendor"])
    model = str(environment.get("cpu_model") or "")
    for word, vendor in (("AMD", "AuthenticAMD"), ("Intel", "GenuineIntel")):
        if re.search(rf"\b{word}\b", model):
            return vendor
    return None


def kernel_set_label(vendor: str | None, kernel_set: str) -> str:
    """``kernel_set`` named with the vendor it ran on (``GenuineIntel/AVX512``); unqualified
    where the vendor is unknown, or where ``kernel_set`` already names one."""
    return kernel_set if vendor is None or "/" in kernel_set else f"{vendor}/{kernel_set}"


def running_kernel_set(running: dict[str, Any] | None = None) -> str:
    """The kernel set this process runs (``running``: a ``runtime()``), with its vendor."""
    running = running if running is not None else runtime()
    return kernel_set_label(running.get("cpu_vendor"), running["cpu_capability"])


def measured_vendor(artifact: dict[str, Any]) -> str | None:
    """The vendor an artifact's unqualified kernel sets ran on: that of the environment its
    kernel sets were measured in (a random-geometry floor re-measured under them records it
    apart, ``kernel_sets_measured``), else of its own environment."""
    remeasured = artifact.get("kernel_sets_measured", {}).get("environment", {})
    return vendor_of(remeasured) or vendor_of(artifact.get("environment", {}))


def kernel_sets_of(artifact: dict[str, Any]) -> list[str]:
    """The kernel sets, each with its vendor, an artifact was measured under: its
    ``kernel_sets``, else the one its environment records (none where it records none)."""
    vendor = measured_vendor(artifact)
    if "kernel_sets" in artifact:
        return [kernel_set_label(vendor, k) for k in artifact["kernel_sets"]]
    capability = artifact.get("environment", {}).get("cpu_capability")
    return [] if capability is None else [kernel_set_label(vendor, capability)]


def write_artifact(artifact: dict[str, Any], path: Path) -> None:
    """Atomically: a crash mid-write never leaves a half-written artifact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(artifact, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, remedy: str | None = None) -> dict[str, Any]:
    """A JSON object from ``path``, or ``ToleranceMismatch`` naming the file and what is
    wrong: missing (with ``remedy``, the command that measures it, where given), unreadable
    (a directory, no permission), not JSON, or not an object."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        how = f"; measure it with `{remedy}`" if remedy else ""
        raise ToleranceMismatch(f"{path}: no such artifact{how}") from None
    except OSError as exc:  # a directory, no permission: named, never a bare traceback
        raise ToleranceMismatch(f"{path}: cannot read the artifact ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ToleranceMismatch(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ToleranceMismatch(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_artifact(path: Path, *, phase: str, fields: Iterable[str], remedy: str,
                  schema: int = SCHEMA) -> dict[str, Any]:
    """A measured artifact read back (``read_json``, ``remedy`` the command that measures
    it), or ``ToleranceMismatch`` naming the file and what is wrong: a field missing, another
    schema, or another phase (a floor is never reused across phases)."""
    artifact = read_json(path, remedy)
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

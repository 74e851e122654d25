"""Floors measured under every CPU kernel set torch can be made to use here.

The floor depends on which kernels run: torch dispatches its CPU kernels by the capability
it detects (``torch.backends.cpu.get_cpu_capability()``), and the default, AVX2 and AVX-512
kernels sum in different orders. On the machine the committed floors were first measured
on, phase 1a's worst was 9.5e-7 under AVX-512 (threshold 1e-4) and 1.0e-6 under the default
and AVX2 kernels (threshold 1e-3): a threshold from one kernel set jumps by 10x on the next
machine. So each committed floor is measured once per kernel set, each in a process of its
own (``ATEN_CPU_CAPABILITY`` is read when torch is imported), and the artifacts are merged:
every cell keeps its worst over the kernel sets, and the threshold is derived from that.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.tolerance.artifacts import read_json
from weight_sync_bench.tolerance.rules import derive_threshold

# The values ATEN_CPU_CAPABILITY takes on the CPUs this harness runs on (x86-64 and
# aarch64); a value the CPU cannot run makes torch fall back, which ``available`` detects.
CANDIDATES = ("default", "avx2", "avx512", "sve256")


def capability_under(kernel_set: str) -> str:
    """The capability torch reports in a fresh process asked to use ``kernel_set``."""
    run = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu."
                          "get_cpu_capability())"], capture_output=True, text=True,
                         env={**os.environ, "ATEN_CPU_CAPABILITY": kernel_set}, timeout=120)
    return run.stdout.strip()


def available() -> list[str]:
    """The kernel sets this machine runs: each candidate whose fresh process reports it."""
    return [k for k in CANDIDATES if capability_under(k).lower() == k]


def measure_under(kernel_set: str, argv: list[str], out: Path) -> dict[str, Any]:
    """Run ``python -m weight_sync_bench.tolerance *argv --out out`` with
    ``ATEN_CPU_CAPABILITY=kernel_set`` and return the artifact it wrote."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel_set}
    run = subprocess.run([sys.executable, "-m", "weight_sync_bench.tolerance", *argv,
                          "--kernel-sets", "current", "--out", str(out)],
                         capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise ToleranceMismatch(f"measuring under ATEN_CPU_CAPABILITY={kernel_set} failed "
                                f"(exit {run.returncode}):\n{run.stderr[-2000:]}")
    return read_json(out)


def merge(artifacts: list[dict[str, Any]]) -> dict[str, Any]:
    """One artifact from the same measurement under several kernel sets: each cell (phase
    floors) or each quantity's worst (training floors) is the worst over the kernel sets,
    with the kernel set that gave it; ``kernel_sets`` lists them all. Pure."""
    if not artifacts:
        raise ToleranceMismatch("no artifact to merge")
    sets = [a["environment"]["cpu_capability"] for a in artifacts]
    if len(set(sets)) != len(sets):
        raise ToleranceMismatch(f"two measurements under one kernel set: {sets}")
    shape = {k for k in artifacts[0] if k not in ("cells", "environment", "worst_abs",
                                                  "threshold", "regimes")}
    for a in artifacts[1:]:
        differ = [k for k in shape if a.get(k) != artifacts[0].get(k)]
        if differ:
            raise ToleranceMismatch(f"measurements of different things cannot merge: {differ}")
    out = copy.deepcopy(artifacts[0])
    out["kernel_sets"] = sets
    if "regimes" in out:
        _merge_training(out, artifacts, sets)
    else:
        _merge_cells(out, artifacts, sets)
    return out


def _merge_cells(out: dict[str, Any], artifacts: list[dict[str, Any]], sets: list[str]) -> None:
    merged = []
    for i, cell in enumerate(out["cells"]):
        versions = [a["cells"][i] for a in artifacts]
        if any((v["config"], v["degree"]) != (cell["config"], cell["degree"]) for v in versions):
            raise ToleranceMismatch("measurements list their cells in different orders")
        worst = max(range(len(versions)), key=lambda k: versions[k]["worst_abs"])
        merged.append({**versions[worst], "kernel_set": sets[worst],
                       "by_kernel_set": {s: v["worst_abs"] for s, v in zip(sets, versions)}})
    out["cells"] = merged
    out["worst_abs"] = max(c["worst_abs"] for c in merged)
    out["threshold"] = derive_threshold(out["worst_abs"])


def _merge_training(out: dict[str, Any], artifacts: list[dict[str, Any]], sets: list[str]
                    ) -> None:
    for regime, quantities in out["regimes"].items():
        for q in quantities:
            versions = [a["regimes"][regime][q] for a in artifacts]
            worst = max(range(len(versions)), key=lambda k: versions[k]["worst"])
            chosen = {k: v for k, v in versions[worst].items() if k != "threshold"}
            quantities[q] = {**chosen, "kernel_set": sets[worst],
                             "threshold": derive_threshold(chosen["worst"])}
    out["cells"] = [{**cell, "kernel_set": s} for a, s in zip(artifacts, sets)
                    for cell in a["cells"]]

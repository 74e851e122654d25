"""Floors measured under every CPU kernel set torch can be made to use here, on every CPU
vendor they were measured on, merged.

The floor depends on which kernels run: torch dispatches its CPU kernels by the capability
it detects (``torch.backends.cpu.get_cpu_capability()``), and the default, AVX2 and AVX-512
kernels sum in different orders; MKL and oneDNN also dispatch by CPU vendor, so one kernel
set sums in another order on an Intel CPU than on an AMD one. On the AMD machine the
committed floors were first measured on, phase 1a's worst was 9.5e-7 under AVX-512
(threshold 1e-4) and 1.0e-6 under the default and AVX2 kernels (threshold 1e-3): a threshold
from one kernel set jumps by 10x on the next machine. So each committed floor is measured
once per kernel set, each in a process of its own (``ATEN_CPU_CAPABILITY`` is read when
torch is imported, ``measure_under``), and the artifacts are merged: every cell keeps its
worst over the kernel sets (``merge``; a random-geometry floor's samples, ``merge_samples``),
and the threshold is derived from that. Measured again on another vendor's CPU, a floor
keeps the first vendor's figures (``over``): each kernel set is named with its vendor
(``GenuineIntel/AVX512``; ``tolerance.artifacts.kernel_set_label``).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weight_sync_bench.errors import ArtifactProtected, ToleranceMismatch
from weight_sync_bench.tolerance.artifacts import (
    COMPARED_ALIKE,
    kernel_set_label,
    kernel_sets_of,
    measured_vendor,
    read_json,
    running_kernel_set,
    vendor_of,
)
from weight_sync_bench.tolerance.rules import derive_threshold
from weight_sync_bench.tolerance.sampled import SampledRule, rederive, validated
from weight_sync_bench.tolerance.sampled_moe import validated_moe

# The values ATEN_CPU_CAPABILITY takes on the CPUs this harness runs on (x86-64 and
# aarch64), each architecture's from the plainest up. A value the CPU cannot run is not
# always refused: torch 2.13 on an AMD EPYC 7003 (Zen 3, no AVX-512) reports AVX512 when asked
# for it and dies of SIGILL in the first AVX-512 kernel. So a kernel set is available only up
# to the capability torch detects unasked (``torch/csrc/.../cpu/Utils`` reads CPUID through
# cpuinfo), and only where a fresh process asked for it reports it (a fallback, ``available``).
LADDERS = (("default", "avx2", "avx512"), ("default", "sve256"))
CANDIDATES = tuple(dict.fromkeys(k for ladder in LADDERS for k in ladder))


def capability_under(kernel_set: str | None) -> str:
    """The capability torch reports in a fresh process asked to use ``kernel_set`` (None:
    asked for nothing, the most this CPU runs)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if kernel_set is not None:
        env["ATEN_CPU_CAPABILITY"] = kernel_set
    run = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu."
                          "get_cpu_capability())"], capture_output=True, text=True,
                         env=env, timeout=120)
    return run.stdout.strip()


def available() -> list[str]:
    """The kernel sets this machine runs: those of its architecture's ladder up to the
    capability torch detects unasked, each one a fresh process asked for reports."""
    detected = capability_under(None).lower()
    ladder = next((ladder for ladder in LADDERS if detected in ladder), (detected,))
    return [k for k in ladder[:ladder.index(detected) + 1] if capability_under(k).lower() == k]


def measure_under(kernel_set: str, argv: list[str], out: Path,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``python -m weight_sync_bench.tolerance *argv --kernel-sets current --out out``
    (``wsb floor``'s measurement of one kernel set) with ``ATEN_CPU_CAPABILITY=kernel_set``
    and return the artifact it wrote; ``progress`` gets each line it writes to stderr (its
    progress line) as it comes."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel_set}
    tail = ""
    with subprocess.Popen([sys.executable, "-m", "weight_sync_bench.tolerance", *argv,
                           "--kernel-sets", "current", "--out", str(out)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env) as run:
        assert run.stderr is not None
        for line in run.stderr:
            tail = (tail + line)[-2000:]
            if progress is not None and line.strip():
                progress(line.strip())
        code = run.wait()
    if code != 0:
        raise ToleranceMismatch(f"measuring under ATEN_CPU_CAPABILITY={kernel_set} failed "
                                f"(exit {code}):\n{tail}")
    return read_json(out)


def merge(artifacts: list[dict[str, Any]]) -> dict[str, Any]:
    """One artifact from the same measurement under several kernel sets, on one machine
    class or several: each cell (phase floors) or each quantity's worst (training floors) is
    the worst over every kernel set of every input, with the kernel set that gave it.
    ``kernel_sets`` lists them all, each with its vendor (``GenuineIntel/AVX512``): an input
    already merged brings every kernel set it holds, so a floor measured on an AMD CPU and
    the same floor measured on an Intel one merge into a floor that covers both. ``machines``
    keeps the environment each vendor's measurement ran in (provenance: its CPU model,
    commit, date). Refused: two inputs under one kernel set, inputs that measured different
    things, or in different versions of torch, numpy, python or another architecture. Pure."""
    if not artifacts:
        raise ToleranceMismatch("no artifact to merge")
    sets = [kernel_sets_of(a) for a in artifacts]
    for i, named in enumerate(sets):
        if not named:
            raise ToleranceMismatch(f"measurement {i} names no kernel set (no kernel_sets "
                                    "field, no cpu_capability in its environment)")
    flat = [k for named in sets for k in named]
    if len(set(flat)) != len(flat):
        raise ToleranceMismatch(f"two measurements under one kernel set: {flat}")
    shape = sorted({k for a in artifacts for k in a} - {
        "cells", "environment", "worst_abs", "threshold", "regimes", "kernel_sets", "machines"})
    for a in artifacts[1:]:
        differ = [k for k in shape if a.get(k) != artifacts[0].get(k)]
        if differ:
            raise ToleranceMismatch(f"measurements of different things cannot merge: {differ}")
    require_alike([a.get("environment", {}) for a in artifacts])
    out = copy.deepcopy(artifacts[0])
    out["kernel_sets"] = flat
    machines = _machines(artifacts)
    if machines:
        out["machines"] = machines
    if "regimes" in out:
        _merge_training(out, artifacts, sets)
    else:
        _merge_cells(out, artifacts, sets)
    return out


def require_alike(environments: list[dict[str, Any]]) -> None:
    """``ToleranceMismatch`` unless the measurements' environments record one value of each
    ``COMPARED_ALIKE`` field (where they record it): merged, they must be one floor."""
    for field in COMPARED_ALIKE:
        seen = {e[field] for e in environments if field in e}
        if len(seen) > 1:
            raise ToleranceMismatch(f"measurements in different environments cannot merge: "
                                    f"{field} {', '.join(sorted(map(str, seen)))}")


def _machines(artifacts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Vendor -> the environment of the first input measured on it (an input merged before
    brings its own ``machines``)."""
    out: dict[str, dict[str, Any]] = {}
    for a in artifacts:
        vendor = measured_vendor(a)
        for name, env in a.get("machines", {vendor: a.get("environment", {})}).items():
            if name is not None:
                out.setdefault(name, copy.deepcopy(env))
    return out


def _label(a: dict[str, Any], named: list[str], record: dict[str, Any]) -> str:
    """The kernel set, with its vendor, that gave ``record`` (a cell or a quantity) of ``a``:
    the one it names (an input merged before), else the input's only one."""
    return kernel_set_label(measured_vendor(a), record["kernel_set"]) if "kernel_set" in record \
        else named[0]


def _merge_cells(out: dict[str, Any], artifacts: list[dict[str, Any]],
                 sets: list[list[str]]) -> None:
    counts = {len(a["cells"]) for a in artifacts}
    if len(counts) > 1:
        raise ToleranceMismatch(f"measurements list different numbers of cells: "
                                f"{', '.join(str(len(a['cells'])) for a in artifacts)}")
    merged = []
    for i, cell in enumerate(out["cells"]):
        versions = [a["cells"][i] for a in artifacts]
        if any((v["config"], v["degree"]) != (cell["config"], cell["degree"]) for v in versions):
            raise ToleranceMismatch("measurements list their cells in different orders")
        by_set: dict[str, float] = {}
        for a, v, named in zip(artifacts, versions, sets):
            vendor = measured_vendor(a)
            by_set.update({kernel_set_label(vendor, k): w for k, w in v["by_kernel_set"].items()}
                          if "by_kernel_set" in v else {named[0]: v["worst_abs"]})
        worst = max(range(len(versions)), key=lambda k: versions[k]["worst_abs"])
        merged.append({**versions[worst],
                       "kernel_set": _label(artifacts[worst], sets[worst], versions[worst]),
                       "by_kernel_set": by_set})
    out["cells"] = merged
    out["worst_abs"] = max(c["worst_abs"] for c in merged)
    out["threshold"] = derive_threshold(out["worst_abs"])


def _merge_training(out: dict[str, Any], artifacts: list[dict[str, Any]],
                    sets: list[list[str]]) -> None:
    for regime, quantities in out["regimes"].items():
        for q in quantities:
            versions = [a["regimes"][regime][q] for a in artifacts]
            worst = max(range(len(versions)), key=lambda k: versions[k]["worst"])
            chosen = {k: v for k, v in versions[worst].items()
                      if k not in ("kernel_set", "threshold")}
            quantities[q] = {**chosen,
                             "kernel_set": _label(artifacts[worst], sets[worst], versions[worst]),
                             "threshold": derive_threshold(chosen["worst"])}
    out["cells"] = [{**cell, "kernel_set": _label(a, named, cell)}
                    for a, named in zip(artifacts, sets) for cell in a["cells"]]


def vendors(kernel_sets: list[str]) -> list[str]:
    """The vendors named by vendor-qualified kernel sets, in order (unqualified ones: none)."""
    return list(dict.fromkeys(k.split("/", 1)[0] for k in kernel_sets if "/" in k))


def kept_vendors(old: dict[str, Any] | None, vendor: str | None, *, force: bool = False,
                 where: str = "the artifact replaced",
                 measuring: list[str] | None = None) -> list[str]:
    """The machine classes of ``old`` (the artifact a measurement on ``vendor``'s CPU is
    about to replace) that the measurement keeps: every vendor ``old`` measured other than
    ``vendor``; none where ``old`` is None or names no vendor (it predates the field and
    its model), or with ``force``. Where ``measuring`` (the vendor-qualified kernel sets the
    measurement will hold) shares no kernel set with ``old``, nothing is replaced: every
    vendor of ``old`` is kept, ``vendor`` too, and the two merge (a kernel set this CPU has
    that the floor lacks, measured alone and added). ``ArtifactProtected`` where ``old``
    holds ``vendor`` too beside others and the measurement re-measures a kernel set of it:
    their figures could not be told apart from the ones this measurement replaces. Called
    before measuring, so a refusal costs nothing."""
    if old is None or force:
        return []
    held = kernel_sets_of(old)
    had = vendors(held)
    missing = [k for k in measuring or () if k not in held]
    if had and measuring and len(missing) == len(measuring):  # nothing re-measured
        return had
    others = [v for v in had if v != vendor]
    if others and vendor in had:
        add = (f"; it lacks {', '.join(missing)}: --kernel-sets current measures only the "
               "kernel set this CPU runs and merges it in") if missing else ""
        raise ArtifactProtected(
            f"{where} holds measurements on {', '.join(had)}: measured again on {vendor}, its "
            f"{', '.join(others)} figures cannot be told apart from the ones this measurement "
            f"replaces. {_remedy(others)}{add}")
    return others


def over(old: dict[str, Any] | None, new: dict[str, Any], *, force: bool = False,
         where: str = "the artifact replaced") -> dict[str, Any]:
    """What a measurement ``new`` writes over ``old`` (the artifact at its target; None where
    there is none): ``new`` merged with ``old``'s measurements on the machine classes
    ``kept_vendors`` keeps (``merge``: worst over all), so a floor measured on one vendor's
    CPU and then on another's covers both; else ``new`` alone. ``ArtifactProtected`` where
    they cannot merge (``old`` measured something else), unless ``force``."""
    here = vendors(kernel_sets_of(new))
    others = kept_vendors(old, here[0] if here else None, force=force, where=where,
                          measuring=kernel_sets_of(new))
    if not others:
        return new
    try:
        return merge([old, new])  # type: ignore[list-item]
    except ToleranceMismatch as exc:
        raise ArtifactProtected(f"{where} holds measurements on {', '.join(others)} that "
                                f"cannot merge with this one ({exc}). {_remedy(others)}") from None


def _remedy(others: list[str]) -> str:
    return (f"Pass --force to replace them with this measurement alone (then measure again on "
            f"{' and '.join(others)}, where it merges in), or --out PATH to write it elsewhere")


# -- a random-geometry floor's samples (and its replicated-KV validation's): each sample's
# floor re-measured under each kernel set (``fuzz.floor.remeasure_floors``), the worst kept


def merge_kernel_sets(artifact: dict[str, Any], floors: dict[str, list[float]],
                      environment_now: dict[str, Any]) -> dict[str, Any]:
    """``artifact`` with every sample's floor re-measured under each kernel set of
    ``floors`` (kernel set, with its vendor -> one floor per sample,
    ``fuzz.floor.remeasure_floors``): each sample records ``by_kernel_set`` (the kernel
    sets measured before, on any machine class, kept; one measured again replaced), its
    first measured floor (``floor_as_measured``) and, as ``floor``, the worst of them all,
    with the kernel set that gave it; ``kernel_sets`` lists the sets, and the rule is
    re-derived from the merged samples. A floor is never lowered by a re-measurement. Pure."""
    return rederive(merge_samples(artifact, floors, environment_now))


def merge_samples(artifact: dict[str, Any], floors: dict[str, list[float]],
                  environment_now: dict[str, Any]) -> dict[str, Any]:
    """``merge_kernel_sets`` without the figures derived from the samples: what the random
    floor and its replicated-KV validation merge alike. Pure."""
    samples = artifact["samples"]
    for kernel_set, values in floors.items():
        if len(values) != len(samples):
            raise ToleranceMismatch(f"{len(values)} floors re-measured under {kernel_set} for "
                                    f"{len(samples)} samples")
    if not floors:
        raise ToleranceMismatch("no kernel set to merge")
    require_alike([artifact.get("environment", {}), environment_now])
    vendor = measured_vendor(artifact)  # where an older artifact's bare kernel sets ran
    merged = []
    for i, s in enumerate(samples):
        first = s.get("floor_as_measured", s["floor"])
        by_set = {kernel_set_label(vendor, k): v for k, v in s.get("by_kernel_set", {}).items()}
        by_set.update({k: v[i] for k, v in floors.items()})
        worst_set = max(by_set, key=lambda k: by_set[k])
        worst = max(first, by_set[worst_set])
        merged.append({**s, "floor": worst, "floor_as_measured": first, "by_kernel_set": by_set,
                       "kernel_set": worst_set if by_set[worst_set] >= first else "as measured"})
    before = kernel_sets_of(artifact) if "kernel_sets" in artifact else []
    machines = {**artifact.get("machines", {} if vendor is None else {
        vendor: artifact.get("kernel_sets_measured", {}).get("environment", {})})}
    if vendor_of(environment_now) is not None:
        machines[str(vendor_of(environment_now))] = environment_now
    return {**artifact, "samples": merged, "kernel_sets": list(dict.fromkeys([*before, *floors])),
            **({"machines": machines} if machines else {}),
            "kernel_sets_measured": {
                "environment": environment_now,
                "what": "each sample's floor re-measured under each kernel set, each in a "
                        "process of its own (ATEN_CPU_CAPABILITY); the mutation deviations "
                        "are the first measurement's"}}


def merge_replicated_kv(artifact: dict[str, Any], floors: dict[str, list[float]],
                        environment_now: dict[str, Any], rule: SampledRule | None = None
                        ) -> dict[str, Any]:
    """``merge_kernel_sets`` for the validation: every sample's floor the worst of its first
    measurement and each kernel set's; the figures of ``rule`` (the rule in force, where the
    random-geometry floor's has moved; default: the one validated before) derived again.
    Pure."""
    out = merge_samples(artifact, floors, environment_now)
    rule = rule or SampledRule(**artifact["validated"]["rule"])
    return validated(out, rule)


def merge_moe(artifact: dict[str, Any], floors: dict[str, list[float]],
              environment_now: dict[str, Any], rule: SampledRule | None = None
              ) -> dict[str, Any]:
    """``merge_replicated_kv`` for the MoE validation (``tolerance.sampled_moe``): every
    sample's floor the worst of its first measurement and each kernel set's, the figures of
    ``rule`` (default: the one validated before) derived again. The routing deviations, near
    ties and kills are the first measurement's, as a validation's mutation deviations are.
    Pure."""
    out = merge_samples(artifact, floors, environment_now)
    return validated_moe(out, rule or SampledRule(**artifact["validated"]["rule"]))


def sample_floors(artifact: dict[str, Any]) -> dict[str, list[float]]:
    """The floors of one kernel set's re-measurement (``wsb floor random --from PATH
    --kernel-sets current``: ``merge_kernel_sets`` of PATH and the running kernel set): that
    kernel set, with its vendor -> every sample's floor under it."""
    here = running_kernel_set(artifact["kernel_sets_measured"]["environment"])
    return {here: [s["by_kernel_set"][here] for s in artifact["samples"]]}

"""Thresholds for fuzzed geometries, derived from floor samples on random geometries.

The floor moves with the geometry (roughly linear in d_model, and with depth and token
count), so a fuzzed geometry cannot borrow TOY's threshold, and it has no measurement of its
own. ``measure_random`` samples the floor, and the deviation of every mutation, over
geometries drawn from the fuzz domain, plus the worst a targeted search found (Hypothesis's
target phase aimed at floor / max |reference logit|: random draws miss that tail, which the
fuzz's own ``target()`` then finds, at d_model 8 three times their worst); the artifact
(``tolerance/random_floor_<phase>.json``) records them with the environment. Three
candidate rules are derived from the samples, each with at least ``SAFETY`` x headroom
over every observation:

- ``absolute_pow10``: the seed's rule, one threshold for the whole domain;
- ``relative_pow10``: a multiple of max |reference logit|, the multiple rounded up to a
  power of ten;
- ``relative``: the same multiple rounded up to two significant digits only.

``choose_rule`` picks, among the rules with zero false positives over the samples, the one
whose smallest kill ratio (deviation / threshold over every mutation and sample) is largest.
``holdout`` re-derives each candidate from half the geometries and counts its false
positives on the other half: the figure that says the margin generalises.
Everything is a pure function of the artifact, so the choice can be re-derived and tested.
TOY and TOY_KV4 keep the seed's rule and ``tolerance/phase1a.json``.

The samples are the plain layout's forward. A fuzzed conversion to vLLM at t > n_kv_heads
runs another one (each KV head replicated over t / n_kv_heads ranks, ``HeadReplicated``),
so the rule judges it only where ``random_floor_<phase>_replicated_kv.json`` validates it
there (``measure_replicated_kv``: random geometries of the fuzz domain at every such degree,
vLLM's forward of the declared shards, and the conversion mutations live there), with zero
false positives and ``SAFETY`` x headroom under the rule in force, and at the drawn degree
(``require_replicated_kv``, which ``fuzz.case.run_conversion_case`` calls); a missing or
failing validation refuses the case, naming the command that measures it.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weight_sync_bench.check.checker import Checker, Forward
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.fuzz.domain import (
    DOMAIN,
    FuzzDomain,
    IntRange,
    fuzz_params,
    fuzz_tokens,
    is_builtin,
)
from weight_sync_bench.model.config import VARIANT_FIELDS, ModelConfig
from weight_sync_bench.tolerance import kernels
from weight_sync_bench.tolerance.artifacts import (
    SCHEMA,
    artifact_path,
    environment,
    kernel_set_label,
    kernel_sets_of,
    measured_vendor,
    read_artifact,
    read_json,
    runtime,
    vendor_of,
)
from weight_sync_bench.tolerance.rules import (
    SAFETY,
    check_environment,
    derive_threshold,
    floor_for,
    merges_here,
    strict_environment,
    threshold_for,
)

RULES = ("absolute_pow10", "relative_pow10", "relative")


def plot_path(phase: str = "1a") -> Path:
    return artifact_path(phase, kind="random_floor").with_suffix(".png")


@dataclass(frozen=True)
class ThresholdRule:
    """``absolute``: the threshold is ``value``. ``relative``: ``value`` x max |reference logit|."""

    name: str
    kind: str  # "absolute" | "relative"
    value: float

    def threshold(self, scale: float) -> float:
        """The threshold for a reference whose max |logit| is ``scale``."""
        return self.value if self.kind == "absolute" else self.value * scale

    def __call__(self, config: ModelConfig, reference: torch.Tensor) -> float:
        return self.threshold(float(reference.abs().max()))

    def __str__(self) -> str:
        if self.kind == "absolute":
            return f"{self.name}: {self.value:g}"
        return f"{self.name}: {self.value:.2g} x max|reference logit|"


def _round_up(x: float, digits: int = 2) -> float:
    """``x`` rounded up to ``digits`` significant digits (``1.234e-4 -> 1.3e-4``)."""
    exponent = math.floor(math.log10(x)) - digits + 1
    return math.ceil(round(x / 10 ** exponent, 9)) * 10 ** exponent


def candidate_rules(samples: list[dict[str, Any]], safety: int = SAFETY) -> list[ThresholdRule]:
    """The three candidates, each derived from the samples with ``safety`` x headroom."""
    worst_abs = max(s["floor"] for s in samples)
    worst_rel = max(s["floor"] / s["scale"] for s in samples)
    return [ThresholdRule("absolute_pow10", "absolute", derive_threshold(worst_abs, safety)),
            ThresholdRule("relative_pow10", "relative", derive_threshold(worst_rel, safety)),
            ThresholdRule("relative", "relative", _round_up(safety * worst_rel))]


def evaluate_rule(rule: ThresholdRule, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures a rule must deliver over the samples: false positives (floor above the
    threshold), the smallest headroom (threshold / floor), and per mutation the smallest
    kill ratio (deviation / threshold) with where it was seen."""
    false_positives = sum(1 for s in samples if s["floor"] > rule.threshold(s["scale"]))
    headroom = min((rule.threshold(s["scale"]) / s["floor"] for s in samples if s["floor"] > 0),
                   default=math.inf)
    kills: dict[str, dict[str, Any]] = {}
    for s in samples:
        for name, deviation in s["kills"].items():
            ratio = deviation / rule.threshold(s["scale"])
            if name not in kills or ratio < kills[name]["min_ratio"]:
                kills[name] = {"min_ratio": ratio, "d_model": s["geometry"]["d_model"],
                               "degree": s["degree"]}
    smallest = min((k["min_ratio"] for k in kills.values()), default=math.inf)
    return {"rule": rule.name, "kind": rule.kind, "value": rule.value,
            "false_positives": false_positives, "min_headroom": headroom,
            "min_kill_ratio": smallest, "kills": kills}


def choose_rule(samples: list[dict[str, Any]]) -> tuple[ThresholdRule, list[dict[str, Any]]]:
    """The candidate with the largest smallest kill ratio among those that deliver, over the
    samples, zero false positives and ``SAFETY`` x headroom, and that generalise: the same
    candidate derived from half the geometries keeps zero false positives and ``SAFETY`` x
    headroom on the other half (``holdout``; not applied where the samples are too few to
    split). Returns it and every candidate's figures."""
    figures = [(rule, evaluate_rule(rule, samples)) for rule in candidate_rules(samples)]
    held = {h["rule"]: h for h in holdout(samples)}
    eligible = [(rule, f) for rule, f in figures
                if f["false_positives"] == 0 and f["min_headroom"] >= SAFETY
                and (not held or (held[rule.name]["false_positives"] == 0
                                  and held[rule.name]["min_headroom"] >= SAFETY))]
    if not eligible:
        raise ToleranceMismatch("no candidate threshold rule has zero false positives and "
                                f"{SAFETY}x headroom over the samples and on held-out ones")
    chosen = max(eligible, key=lambda rf: rf[1]["min_kill_ratio"])[0]
    return chosen, [f for _, f in figures]


def rederive(artifact: dict[str, Any]) -> dict[str, Any]:
    """``artifact`` with its rule figures (``chosen``, ``rules``, ``holdout``) derived anew from
    its own samples by this code's rule: the samples, their environment and provenance are
    kept as measured. Pure."""
    chosen, figures = choose_rule(artifact["samples"])
    return {**artifact, "chosen": chosen.name, "rules": figures,
            "holdout": holdout(artifact["samples"])}


def holdout(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each candidate derived from the even-numbered geometries alone, judged on the odd
    ones: false positives and smallest headroom on samples the rule never saw."""
    order: dict[tuple[Any, ...], int] = {}
    for s in samples:
        order.setdefault((tuple(sorted(s["geometry"].items())), s["seed"]), len(order))
    parity = [order[(tuple(sorted(s["geometry"].items())), s["seed"])] % 2 for s in samples]
    fit = [s for s, p in zip(samples, parity) if p == 0]
    held = [s for s, p in zip(samples, parity) if p == 1]
    if not held or not any(s["floor"] > 0 for s in fit):
        return []  # too few geometries to hold any out
    out = []
    for rule in candidate_rules(fit):
        f = evaluate_rule(rule, held)
        out.append({"rule": rule.name, "value": rule.value, "samples": len(held),
                    "false_positives": f["false_positives"], "min_headroom": f["min_headroom"]})
    return out


def relative_floor(config: ModelConfig, seed: int, *, forward: Forward = inprocess_forward,
                   phase: str = "1a") -> float:
    """The largest floor / max |reference logit| over the geometry's degrees (0 at t=1 only)."""
    checker = Checker(config, seed=seed, threshold=math.inf, phase=phase, forward=forward,
                      params=fuzz_params(config, seed), tokens=fuzz_tokens(config, seed))
    scale = float(checker.reference.abs().max())
    return max(checker.declared_error(t) / scale for t in checker.layout.supported_degrees())


def sample(config: ModelConfig, seed: int, *, forward: Forward = inprocess_forward,
           phase: str = "1a") -> list[dict[str, Any]]:
    """One geometry's floor at each supported degree, with every non-identity mutation's
    deviation there: one record per degree."""
    checker = Checker(config, seed=seed, threshold=math.inf, phase=phase, forward=forward,
                      params=fuzz_params(config, seed), tokens=fuzz_tokens(config, seed))
    scale = float(checker.reference.abs().max())
    records = []
    for degree in checker.layout.supported_degrees():
        declared = checker.declared(degree)
        kills = {m.name: checker.verdict(m.apply(declared, checker.layout, config),
                                         dst=degree).max_abs_error
                 for m in MUTATIONS.values() if m.identity_reason(config, degree) is None}
        records.append({"geometry": config.geometry(), "seed": seed, "degree": degree,
                        "scale": scale, "floor": checker.declared_error(degree), "kills": kills})
    return records


@dataclass(frozen=True)
class SampleProgress:
    """Yielded after each geometry: how many are done of how many."""

    done: int
    total: int
    config: ModelConfig


def measure_random(cases: Iterable[tuple[ModelConfig, int]], *, phase: str = "1a",
                   forward: Forward = inprocess_forward, domain: FuzzDomain = DOMAIN,
                   searched: Iterable[tuple[ModelConfig, int]] = (),
                   profile: str | None = None, hypothesis_seed: int | None = None,
                   search_examples: int = 0) -> Iterator[SampleProgress | dict[str, Any]]:
    """Sample the floor over random ``(geometry, seed)`` cases and over ``searched`` ones (the
    worst a targeted search found: the tail random draws miss); yields a ``SampleProgress``
    per case, then the artifact (not yet written). Every case must lie inside ``domain``."""
    labelled = [(c, s, "random") for c, s in cases] + [(c, s, "search") for c, s in searched]
    samples: list[dict[str, Any]] = []
    for i, (config, seed, origin) in enumerate(labelled):
        outside = domain.violations(config)
        if outside:
            raise ToleranceMismatch(f"floor sample {i} lies outside the fuzz domain: "
                                    + "; ".join(outside))
        samples.extend(record | {"origin": origin}
                       for record in sample(config, seed, forward=forward, phase=phase))
        yield SampleProgress(i + 1, len(labelled), config)
    cases = [c for c in labelled if c[2] == "random"]
    chosen, figures = choose_rule(samples)
    yield {"schema": SCHEMA, "phase": phase, "safety": SAFETY, "domain": domain.to_json(),
           "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
           "geometries": len(cases), "searched": len(labelled) - len(cases),
           "search_examples": search_examples,
           "profile": profile, "hypothesis_seed": hypothesis_seed,
           "chosen": chosen.name, "rules": figures, "holdout": holdout(samples),
           "samples": samples,
           "environment": environment()}


def remeasure_floors(artifact: dict[str, Any], *, forward: Forward = inprocess_forward
                     ) -> list[float]:
    """Each sample's floor measured again in this process, under the kernels it runs: the
    same geometry, seed, tokens and degree, so only the kernels (``ATEN_CPU_CAPABILITY``)
    can make it differ. The mutation deviations are not re-measured: they are O(1) against
    a floor of O(1e-6), and no kernel set moves them by a figure a kill ratio shows."""
    phase = artifact["phase"]
    floors: list[float] = []
    key, checker = None, None
    for i, s in enumerate(artifact["samples"]):
        here = (tuple(sorted(s["geometry"].items())), s["seed"])
        if here != key:  # a geometry's degrees are adjacent: keep one checker alive
            config = ModelConfig(name=f"floor-sample-{i}", **s["geometry"])
            checker = Checker(config, seed=s["seed"], threshold=math.inf, phase=phase,
                              forward=forward, params=fuzz_params(config, s["seed"]),
                              tokens=fuzz_tokens(config, s["seed"]))
            key = here
        assert checker is not None
        floors.append(checker.declared_error(s["degree"]))
    return floors


def merge_kernel_sets(artifact: dict[str, Any], floors: dict[str, list[float]],
                      environment_now: dict[str, Any]) -> dict[str, Any]:
    """``artifact`` with every sample's floor re-measured under each kernel set of
    ``floors`` (kernel set, with its vendor -> one floor per sample, ``remeasure_floors``):
    each sample records ``by_kernel_set`` (the kernel sets measured before, on any machine
    class, kept; one measured again replaced), its first measured floor
    (``floor_as_measured``) and, as ``floor``, the worst of them all, with the kernel set that
    gave it; ``kernel_sets`` lists the sets, and the rule is re-derived from the merged
    samples. A floor is never lowered by a re-measurement. Pure."""
    return rederive(_merged_samples(artifact, floors, environment_now))


def _merged_samples(artifact: dict[str, Any], floors: dict[str, list[float]],
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
    kernels.require_alike([artifact.get("environment", {}), environment_now])
    vendor = measured_vendor(artifact)  # the unqualified kernel sets of an older artifact ran there
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


def kernel_set_figures(artifact: dict[str, Any]) -> list[list[str]]:
    """Per kernel set of a merged artifact: the worst floor, the worst floor / max|logit|,
    in how many samples it alone gives the largest floor (ties count for none), and the rule
    that kernel set's floors alone would choose. A table's rows, header first."""
    samples = artifact["samples"]
    rows = [["kernel set", "worst floor", "worst floor/max|logit|", "alone worst in",
             "rule from it alone"]]
    for kernel_set in artifact.get("kernel_sets", []):
        alone = [{**s, "floor": s["by_kernel_set"][kernel_set]} for s in samples]
        try:
            rule = str(choose_rule(alone)[0]).split(": ", 1)[1]
        except ToleranceMismatch as exc:
            rule = f"none ({exc})"
        rows.append([kernel_set, f"{max(s['floor'] for s in alone):.3g}",
                     f"{max(s['floor'] / s['scale'] for s in alone):.3g}",
                     str(sum(1 for s in samples if all(
                         s["by_kernel_set"][kernel_set] > v
                         for k, v in s["by_kernel_set"].items() if k != kernel_set))), rule])
    rows.append(["merged", f"{max(s['floor'] for s in samples):.3g}",
                 f"{max(s['floor'] / s['scale'] for s in samples):.3g}", str(len(samples)),
                 str(rule_from(artifact)).split(": ", 1)[1]])
    return rows


def format_kernel_sets(artifact: dict[str, Any]) -> str:
    """``kernel_set_figures`` as an aligned table."""
    return "\n".join(_aligned(kernel_set_figures(artifact)))


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def measure_kernel_sets(path: Path, kernel_sets: Sequence[str] | None = None
                        ) -> dict[str, Any]:
    """The artifact at ``path`` merged with its floors re-measured under every kernel set
    this machine runs (``tolerance.kernels.available``), each in a process of its own."""
    floors = floors_by_kernel_set(lambda out: [str(path), str(out)], kernel_sets)
    return merge_kernel_sets(read_json(path), floors, environment())


def floors_by_kernel_set(args: Callable[[Path], list[str]],
                         kernel_sets: Sequence[str] | None = None) -> dict[str, list[float]]:
    """``python -m weight_sync_bench.fuzz.floor *args(OUT)`` under each kernel set
    (``ATEN_CPU_CAPABILITY``; default every one this machine runs), each a process of its
    own writing ``{"cpu_capability", "floors"}`` to OUT: kernel set -> its floors."""
    import json
    import subprocess
    import sys
    import tempfile

    floors: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as scratch:
        for kernel_set in kernel_sets or kernels.available():
            out = Path(scratch) / f"{kernel_set}.json"
            run = subprocess.run([sys.executable, "-m", "weight_sync_bench.fuzz.floor",
                                  *args(out)], check=False, capture_output=True, text=True,
                                 env={**os.environ, "ATEN_CPU_CAPABILITY": kernel_set})
            if run.returncode != 0:
                raise ToleranceMismatch(f"re-measuring the floors under ATEN_CPU_CAPABILITY="
                                        f"{kernel_set} failed (exit {run.returncode}):\n"
                                        f"{run.stderr[-2000:]}")
            measured = json.loads(out.read_text())
            floors[kernel_set_label(measured.get("cpu_vendor"),
                                    measured["cpu_capability"])] = measured["floors"]
    return floors


def _kernels_here() -> dict[str, Any]:
    """The kernel set this process runs and the vendor it runs on, as a re-measurement's
    output names them for ``floors_by_kernel_set``."""
    here = runtime()
    return {"cpu_capability": here["cpu_capability"], "cpu_vendor": here["cpu_vendor"]}


def _remeasure_main(argv: list[str]) -> int:
    """``python -m weight_sync_bench.fuzz.floor ARTIFACT OUT``: this process's floors of
    ARTIFACT's samples, with the kernel set they ran under, written to OUT (JSON)."""
    import json

    torch.set_num_threads(1)
    source, out = Path(argv[0]), Path(argv[1])
    artifact = read_json(source)
    forward = inprocess_forward
    if artifact["phase"] == "1b":
        from weight_sync_bench.check.forwards import gloo_forward
        forward = gloo_forward()
    floors = remeasure_floors(artifact, forward=forward)
    out.write_text(json.dumps({**_kernels_here(), "floors": floors}))
    return 0


def load_random_floor(phase: str = "1a", path: Path | None = None) -> dict[str, Any]:
    return read_artifact(path or artifact_path(phase, kind="random_floor"), phase=phase, schema=SCHEMA,
                         fields=("domain", "samples", "chosen"),
                         remedy=f"wsb floor --random N --phase {phase}")


def rule_from(artifact: dict[str, Any]) -> ThresholdRule:
    """The rule an artifact implies: re-derived from its samples, not read from its figures."""
    chosen, _ = choose_rule(artifact["samples"])
    return chosen


def fuzz_threshold_rule(phase: str = "1a", path: Path | None = None
                        ) -> Callable[[ModelConfig, torch.Tensor], float]:
    """The threshold for any geometry the fuzz draws: the seed's rule for TOY and TOY_KV4,
    the chosen sampled rule for geometries inside the sampled domain, an error elsewhere."""
    path = path or artifact_path(phase, kind="random_floor")
    rule, domain = _rule_and_domain(phase, path, _mtime(path))
    if strict_environment():  # WSB_STRICT_ENV / --strict-env: a foreign floor is refused
        environment_notes(phase, path)

    def threshold(config: ModelConfig, reference: torch.Tensor) -> float:
        if is_builtin(config):
            return threshold_for(config, phase)
        outside = domain.violations(config)
        if outside:
            raise ToleranceMismatch(
                f"{config.name}: no threshold outside the sampled domain ({path}): "
                + "; ".join(outside))
        return rule(config, reference)

    return threshold


def environment_notes(phase: str = "1a", path: Path | None = None) -> tuple[str, ...]:
    """How the running process differs from the one the random-geometry floor was measured
    in (``tolerance.rules.check_environment``: a floor re-measured under several kernel sets
    covers each); under ``WSB_STRICT_ENV`` a ``ToleranceMismatch`` instead."""
    artifact = load_random_floor(phase, path)
    remedy = (f"wsb floor --kernel-sets all --phase {phase} --write" if merges_here(artifact)
              else f"wsb floor --random N --phase {phase} --write")  # its samples, or new ones
    return check_environment(artifact, f"the phase {phase} random-geometry floor", remedy)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


@functools.lru_cache(maxsize=8)
def _rule_and_domain(phase: str, path: Path, mtime: int | None) -> tuple[ThresholdRule, FuzzDomain]:
    """Read once per version of the file (the key holds its mtime): every fuzzed example
    asks for the rule, and re-deriving it from a thousand samples each time would dominate."""
    artifact = load_random_floor(phase, path)
    return rule_from(artifact), FuzzDomain.from_json(artifact["domain"])


def format_rules(artifact: dict[str, Any]) -> str:
    """A table of the candidate rules' figures, the chosen one marked."""
    rows = [["rule", "threshold", "false positives", "min headroom", "min kill ratio",
             "held-out FP", "held-out headroom", ""]]
    held = {h["rule"]: h for h in artifact.get("holdout", [])}
    for f in artifact["rules"]:
        rule = ThresholdRule(f["rule"], f["kind"], f["value"])
        h = held.get(f["rule"])
        rows.append([f["rule"], str(rule).split(": ", 1)[1], str(f["false_positives"]),
                     f"{f['min_headroom']:.0f}x", f"{f['min_kill_ratio']:.0f}x",
                     f"{h['false_positives']}/{h['samples']}" if h else "-",
                     f"{h['min_headroom']:.0f}x" if h else "-",
                     "chosen" if f["rule"] == artifact["chosen"] else ""])
    lines = _aligned(rows)
    geometries = {tuple(sorted(s["geometry"].items())) for s in artifact["samples"]}
    lines.append(f"{len(artifact['samples'])} floor samples over {len(geometries)} geometries "
                 f"(phase {artifact['phase']})")
    return "\n".join(lines)


def plot(artifact: dict[str, Any], path: Path) -> None:
    """Floor (and floor / max |reference logit|) against d_model, coloured by depth, with the
    chosen rule's threshold; written atomically as a PNG beside the artifact."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [s for s in artifact["samples"] if s["floor"] > 0]
    d = [s["geometry"]["d_model"] for s in samples]
    depth = [s["geometry"]["n_layers"] for s in samples]
    rule = rule_from(artifact)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, values, label in (
            (axes[0], [s["floor"] for s in samples], "floor: max |sharded - reference| logit"),
            (axes[1], [s["floor"] / s["scale"] for s in samples], "floor / max |reference logit|")):
        points = ax.scatter(d, values, c=depth, cmap="viridis", s=14)
        ax.set_xlabel("d_model")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.colorbar(points, ax=axes[1], label="n_layers")
    if rule.kind == "relative":
        axes[1].axhline(rule.value, color="red", label=f"threshold {rule.value:.2g} x max|ref|")
        axes[1].axhline(rule.value / SAFETY, color="red", ls=":", label=f"threshold / {SAFETY}")
        axes[1].legend(loc="lower right", fontsize=8)
    else:
        axes[0].axhline(rule.value, color="red", label=f"threshold {rule.value:g}")
        axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"phase {artifact['phase']} floor over {len(samples)} samples with t > 1; "
                 f"rule {rule}")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")  # concurrent runs never clash
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


# -- the rule validated on vLLM's replicated-KV forward (t > n_kv_heads)

REPLICATION = (2, 4)  # KV-head replication factors t / n_kv_heads the conversion fuzz draws
REPLICATED_GEOMETRIES = 300  # the validation's default sample
REPLICATED_SEED = 20261201  # its default draw seed


def replicated_kv_path(phase: str = "1a") -> Path:
    """``random_floor_<phase>_replicated_kv.json`` beside the random-geometry floor."""
    return artifact_path(phase, kind="random_floor").with_name(
        f"random_floor_{phase}_replicated_kv.json")


def replicated_kv_command(phase: str = "1a") -> str:
    """The command that measures the validation (every kernel set) into the committed file."""
    return ("python -m weight_sync_bench.fuzz.floor replicated-kv --write"
            + (f" --phase {phase}" if phase != "1a" else ""))


def max_replicated_degree(domain: FuzzDomain = DOMAIN) -> int:
    """The largest degree vLLM stores a geometry of ``domain`` at: ``n_heads`` at most."""
    return domain.n_kv_heads.top * domain.group.top


def draw_replicated_geometries(n: int, seed: int, domain: FuzzDomain = DOMAIN
                               ) -> list[tuple[ModelConfig, int]]:
    """``n`` (geometry, model seed) cases of ``domain`` that vLLM stores at some t >
    n_kv_heads, drawn uniformly from ``random.Random(seed)`` as the conversion fuzz draws
    them (``strategies.conventions.conversion_geometries``: the replication factor k first,
    the query group and the ffn per KV head as multiples of k, then the rest, then the
    variants Qwen2 and Llama store: a qkv bias, attention_bias, tied embeddings). The first
    two are the smallest and the largest such geometry."""
    rng = random.Random(seed)

    def members(r: IntRange, multiple: int = 1) -> list[int]:
        return [v for v in range(r.lo, r.top + 1, r.step) if v % multiple == 0]

    def pick(r: IntRange, multiple: int = 1) -> int:
        return rng.choice(members(r, multiple))

    ks = [k for k in REPLICATION if members(domain.group, k) and members(domain.ffn_per_kv_head, k)]
    small = domain.config(n_kv_heads=domain.n_kv_heads.lo, group=members(domain.group, ks[0])[0],
                          head_dim=domain.head_dim.lo, d_model=domain.d_model.lo,
                          ffn_per_kv_head=members(domain.ffn_per_kv_head, ks[0])[0],
                          vocab_per_kv_head=domain.vocab_per_kv_head.lo,
                          n_layers=domain.n_layers.lo, batch=domain.batch.lo,
                          seq_len=domain.seq_len.lo)
    large = domain.config(n_kv_heads=domain.n_kv_heads.top,
                          group=members(domain.group, ks[-1])[-1], head_dim=domain.head_dim.top,
                          d_model=domain.d_model.top,
                          ffn_per_kv_head=members(domain.ffn_per_kv_head, ks[-1])[-1],
                          vocab_per_kv_head=domain.vocab_per_kv_head.top,
                          n_layers=domain.n_layers.top, batch=domain.batch.top,
                          seq_len=domain.seq_len.top)
    drawn = [(small, 0), (large, 0)]
    while len(drawn) < n:
        k = rng.choice(ks)
        config = domain.config(
            n_kv_heads=pick(domain.n_kv_heads), group=pick(domain.group, k),
            head_dim=pick(domain.head_dim), d_model=pick(domain.d_model),
            ffn_per_kv_head=pick(domain.ffn_per_kv_head, k),
            vocab_per_kv_head=pick(domain.vocab_per_kv_head), n_layers=pick(domain.n_layers),
            batch=pick(domain.batch), seq_len=pick(domain.seq_len))
        bias = rng.choice(["none", "qkv", "attention"])
        config = config.replace(qkv_bias=bias != "none", o_bias=bias == "attention",
                                tie_embeddings=rng.random() < 0.5)
        drawn.append((config, rng.randint(domain.seed.lo, domain.seed.top)))
    return drawn[:n]


def sample_replicated_kv(config: ModelConfig, seed: int) -> list[dict[str, Any]]:
    """One geometry's floor at each degree t > n_kv_heads vLLM stores it at: vLLM's forward
    of the declared shards against the reference (as ``fuzz.case.run_conversion_case``
    judges it), with each conversion mutation's deviation there, the mutation applied to the
    harness's conversion from the first source endpoint where it applies and is live (a
    RoPE mutation only where the geometry's tokens reach its ``min_seq_len``). One record
    per degree."""
    from weight_sync_bench.check.floor import REPLICATED_KV, forward_of, replicated_degrees
    from weight_sync_bench.conventions import CONVENTIONS, convert, endpoint
    from weight_sync_bench.conventions.mutations import MUTATIONS as CONVERSION_MUTATIONS
    from weight_sync_bench.conventions.mutations import Conversion
    from weight_sync_bench.fuzz.case import FuzzConversionChecker

    checker = FuzzConversionChecker(config, seed=seed, threshold_rule=lambda c, r: math.inf)
    assert checker.checker.reference is not None
    scale = float(checker.checker.reference.abs().max())
    sources = [endpoint(f"{n}:{t}") for n, c in CONVENTIONS.items()
               for t in c.supported_degrees(config, max_replicated_degree())]
    records = []
    for t in replicated_degrees(config, max_replicated_degree()):
        dst = endpoint(f"vllm:{t}")
        assert forward_of(dst.convention, config, t) == REPLICATED_KV
        kills: dict[str, float] = {}
        for m in CONVERSION_MUTATIONS.values():
            if config.seq_len < m.min_seq_len:
                continue
            for src in sources:
                conversion = Conversion(config, src, dst)
                if m.not_applicable(conversion) is None and m.identity_reason(conversion) is None:
                    out = m.apply(convert(checker.source(src), src, dst, config), conversion)
                    kills[m.name] = checker.error(dst, out)
                    break
        records.append({"geometry": config.geometry(), "seed": seed, "degree": t,
                        "forward": REPLICATED_KV, "scale": scale,
                        "floor": checker.declared_error(dst), "kills": kills})
    return records


def measure_replicated_kv(cases: Iterable[tuple[ModelConfig, int]], *, phase: str = "1a",
                          domain: FuzzDomain = DOMAIN, seed: int | None = None
                          ) -> dict[str, Any]:
    """The validation artifact (not yet written): every case's ``sample_replicated_kv``
    records, the domain, and the figures of the rule in force (``replicated_kv_figures``;
    provenance: a check re-derives them from the samples)."""
    if phase != "1a":
        raise ToleranceMismatch(f"conversions are fuzzed in process (phase 1a), got {phase!r}")
    cases = list(cases)
    samples: list[dict[str, Any]] = []
    for i, (config, model_seed) in enumerate(cases):
        outside = domain.violations(config)
        if outside:
            raise ToleranceMismatch(f"replicated-KV sample {i} lies outside the fuzz domain: "
                                    + "; ".join(outside))
        samples += sample_replicated_kv(config, model_seed)
    if not samples:
        raise ToleranceMismatch("no replicated-KV sample: no case is stored by vLLM past "
                                "n_kv_heads")
    from weight_sync_bench.check.floor import REPLICATED_KV

    artifact = {"schema": SCHEMA, "phase": phase, "kind": "replicated_kv_validation",
                "forward": REPLICATED_KV, "safety": SAFETY, "domain": domain.to_json(),
                "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
                "geometries": len(cases), "draw_seed": seed,
                "max_degree": max_replicated_degree(domain), "samples": samples,
                "environment": environment()}
    rule = rule_from(load_random_floor(phase))
    artifact["validated"] = {"rule": {"name": rule.name, "kind": rule.kind, "value": rule.value},
                             **replicated_kv_figures(artifact, rule)}
    return artifact


def replicated_kv_figures(artifact: dict[str, Any], rule: ThresholdRule) -> dict[str, Any]:
    """What ``rule`` delivers on the validation's samples (pure): false positives, the
    smallest headroom (threshold / floor), the smallest kill ratio per conversion mutation
    with where it was seen, and the degrees covered."""
    samples = artifact["samples"]
    figures = evaluate_rule(rule, samples)
    return {"samples": len(samples), "false_positives": figures["false_positives"],
            "min_headroom": figures["min_headroom"],
            "min_kill_ratio": figures["min_kill_ratio"], "kills": figures["kills"],
            "degrees": sorted({s["degree"] for s in samples}),
            "worst_floor": max(s["floor"] for s in samples),
            "worst_relative_floor": max(s["floor"] / s["scale"] for s in samples)}


def merge_replicated_kv(artifact: dict[str, Any], floors: dict[str, list[float]],
                        environment_now: dict[str, Any], rule: ThresholdRule | None = None
                        ) -> dict[str, Any]:
    """``merge_kernel_sets`` for the validation: every sample's floor the worst of its first
    measurement and each kernel set's; the figures of ``rule`` (the rule in force, where the
    random-geometry floor's has moved; default: the one validated before) derived again.
    Pure."""
    out = _merged_samples(artifact, floors, environment_now)
    rule = rule or ThresholdRule(**artifact["validated"]["rule"])
    out["validated"] = {"rule": {"name": rule.name, "kind": rule.kind, "value": rule.value},
                        **replicated_kv_figures(out, rule)}
    return out


def remeasure_replicated_floors(artifact: dict[str, Any]) -> list[float]:
    """Each validation sample's floor measured again in this process (its kernels)."""
    from weight_sync_bench.conventions import endpoint
    from weight_sync_bench.fuzz.case import FuzzConversionChecker

    floors, key, checker = [], None, None
    for i, s in enumerate(artifact["samples"]):
        here = (tuple(sorted(s["geometry"].items())), s["seed"])
        if here != key:  # a geometry's degrees are adjacent
            config = config_of(s["geometry"], f"replicated-sample-{i}")
            checker = FuzzConversionChecker(config, seed=s["seed"],
                                            threshold_rule=lambda c, r: math.inf)
            key = here
        assert checker is not None
        floors.append(checker.declared_error(endpoint(f"vllm:{s['degree']}")))
    return floors


def config_of(geometry: dict[str, int], name: str) -> ModelConfig:
    """The config a sample's recorded geometry names (``ModelConfig.geometry`` writes a
    variant's bool as 0/1, as a corpus entry does)."""
    fields = {k: bool(v) if k in VARIANT_FIELDS and k != "vocab_multiple" else v
              for k, v in geometry.items()}
    return ModelConfig(name=name, **fields)


def load_replicated_kv(phase: str = "1a", path: Path | None = None) -> dict[str, Any]:
    return read_artifact(path or replicated_kv_path(phase), phase=phase, schema=SCHEMA,
                         fields=("domain", "samples", "forward", "max_degree"),
                         remedy=replicated_kv_command(phase))


def require_replicated_kv(config: ModelConfig, degree: int, phase: str = "1a",
                          path: Path | None = None) -> None:
    """Raise ``FloorNotMeasured`` unless the threshold of a fuzzed conversion to vLLM at
    ``degree`` (> n_kv_heads: the replicated-KV forward) comes from a measurement of that
    forward: for TOY and TOY_KV4 the committed phase floor's cell at ``degree``
    (``check.convert.require_cell``); for a fuzzed geometry the validation artifact, which
    must exist, record the random-geometry floor's domain, reach ``degree``, and show the
    rule in force (re-derived from both artifacts) with zero false positives and
    ``SAFETY`` x headroom over its samples."""
    from weight_sync_bench.check.convert import require_cell
    from weight_sync_bench.conventions import endpoint

    if is_builtin(config):
        require_cell(floor_for(config, phase), config, endpoint(f"vllm:{degree}"))
        return
    path = path or replicated_kv_path(phase)
    command = replicated_kv_command(phase)
    what = (f"{config.name}: the random-geometry rule judges vLLM at t={degree} > n_kv_heads="
            f"{config.n_kv_heads} (the replicated-KV forward) only where {path.name} "
            "validates it")
    try:
        figures, degrees, same_domain = _replicated_figures(phase, path, _mtime(path),
                                                            _mtime(artifact_path(
                                                                phase, kind="random_floor")))
    except ToleranceMismatch as exc:
        raise FloorNotMeasured(f"{what}: {exc}", command=command) from None
    why = None
    if not same_domain:
        why = "it was measured over another fuzz domain than the random-geometry floor's"
    elif degree not in degrees:
        why = f"it measured t={', '.join(map(str, degrees))}, not t={degree}"
    elif figures["false_positives"] or figures["min_headroom"] < SAFETY:
        why = (f"the rule in force has {figures['false_positives']} false positives and "
               f"{figures['min_headroom']:.3g}x headroom over its samples (needs 0 and "
               f"{SAFETY}x)")
    if why is not None:
        raise FloorNotMeasured(f"{what}: {why}. Measure it with `{command}`", command=command)


@functools.lru_cache(maxsize=8)
def _replicated_figures(phase: str, path: Path, mtime: int | None, floor_mtime: int | None
                        ) -> tuple[dict[str, Any], list[int], bool]:
    """The rule in force's figures over the validation, read once per version of both files."""
    artifact = load_replicated_kv(phase, path)
    random_floor = load_random_floor(phase)
    figures = replicated_kv_figures(artifact, rule_from(random_floor))
    return figures, figures["degrees"], artifact["domain"] == random_floor["domain"]


def _replicated_main(argv: list[str]) -> int:
    """``python -m weight_sync_bench.fuzz.floor replicated-kv (--write | --out PATH)
    [--geometries N] [--seed S] [--kernel-sets all|current]``: measure the validation and
    write it (atomically; nothing printed: the CLI layer prints). ``all`` (the default)
    re-measures every sample's floor under each kernel set, a process each."""
    import argparse
    import json
    import tempfile

    from weight_sync_bench.tolerance.artifacts import write_artifact

    parser = argparse.ArgumentParser(prog="python -m weight_sync_bench.fuzz.floor replicated-kv")
    parser.add_argument("--phase", default="1a", choices=["1a"])
    parser.add_argument("--geometries", type=int, default=REPLICATED_GEOMETRIES)
    parser.add_argument("--seed", type=int, default=REPLICATED_SEED)
    parser.add_argument("--kernel-sets", choices=("all", "current"), default="all")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path)
    where.add_argument("--write", action="store_true")
    parser.add_argument("--remeasure", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = args.out or replicated_kv_path(args.phase)
    if args.remeasure is not None:  # one kernel set's floors of an artifact's samples
        floors = remeasure_replicated_floors(read_json(args.remeasure))
        out.write_text(json.dumps({**_kernels_here(), "floors": floors}))
        return 0
    artifact = measure_replicated_kv(draw_replicated_geometries(args.geometries, args.seed),
                                     phase=args.phase, seed=args.seed)
    if args.kernel_sets == "all":
        with tempfile.TemporaryDirectory(prefix="wsb-replicated-") as scratch:
            first = Path(scratch) / "artifact.json"
            first.write_text(json.dumps(artifact))
            floors = floors_by_kernel_set(
                lambda got: ["replicated-kv", "--remeasure", str(first), "--out", str(got)])
        artifact = merge_replicated_kv(artifact, floors, environment())
    write_artifact(artifact, out)
    return 0


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["replicated-kv"]:
        sys.exit(_replicated_main(sys.argv[2:]))
    sys.exit(_remeasure_main(sys.argv[1:]))

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
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weight_sync_bench.check.checker import Checker, Forward
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.fuzz.domain import (
    DOMAIN,
    FuzzDomain,
    fuzz_params,
    fuzz_tokens,
    is_builtin,
)
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance.artifacts import (
    SCHEMA,
    artifact_path,
    environment,
    read_artifact,
    read_json,
)
from weight_sync_bench.tolerance.rules import (
    SAFETY,
    check_environment,
    derive_threshold,
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
    ``floors`` (kernel set -> one floor per sample, ``remeasure_floors``): each sample
    records ``by_kernel_set``, its first measured floor (``floor_as_measured``) and, as
    ``floor``, the worst of them all, with the kernel set that gave it; ``kernel_sets``
    lists the sets, and the rule is re-derived from the merged samples. A floor is never
    lowered by a re-measurement. Pure."""
    samples = artifact["samples"]
    for kernel_set, values in floors.items():
        if len(values) != len(samples):
            raise ToleranceMismatch(f"{len(values)} floors re-measured under {kernel_set} for "
                                    f"{len(samples)} samples")
    if not floors:
        raise ToleranceMismatch("no kernel set to merge")
    merged = []
    for i, s in enumerate(samples):
        first = s.get("floor_as_measured", s["floor"])
        by_set = {k: v[i] for k, v in floors.items()}
        worst_set = max(by_set, key=lambda k: by_set[k])
        worst = max(first, by_set[worst_set])
        merged.append({**s, "floor": worst, "floor_as_measured": first, "by_kernel_set": by_set,
                       "kernel_set": worst_set if by_set[worst_set] >= first else "as measured"})
    out = {**artifact, "samples": merged, "kernel_sets": list(floors),
           "kernel_sets_measured": {
               "environment": environment_now,
               "what": "each sample's floor re-measured under each kernel set, each in a "
                       "process of its own (ATEN_CPU_CAPABILITY); the mutation deviations "
                       "are the first measurement's"}}
    return rederive(out)


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
    import json
    import subprocess
    import sys
    import tempfile

    from weight_sync_bench.tolerance import kernels

    artifact = read_json(path)
    floors: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as scratch:
        for kernel_set in kernel_sets or kernels.available():
            out = Path(scratch) / f"{kernel_set}.json"
            run = subprocess.run([sys.executable, "-m", "weight_sync_bench.fuzz.floor",
                                  str(path), str(out)], check=False, capture_output=True, text=True,
                                 env={**os.environ, "ATEN_CPU_CAPABILITY": kernel_set})
            if run.returncode != 0:
                raise ToleranceMismatch(f"re-measuring the floors under ATEN_CPU_CAPABILITY="
                                        f"{kernel_set} failed (exit {run.returncode}):\n"
                                        f"{run.stderr[-2000:]}")
            measured = json.loads(out.read_text())
            floors[measured["cpu_capability"]] = measured["floors"]
    return merge_kernel_sets(artifact, floors, environment())


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
    out.write_text(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "floors": floors}))
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
    return check_environment(load_random_floor(phase, path),
                             f"the phase {phase} random-geometry floor",
                             remedy=f"wsb floor --random N --phase {phase} --write")


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


if __name__ == "__main__":
    import sys

    sys.exit(_remeasure_main(sys.argv[1:]))

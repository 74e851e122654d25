"""Thresholds for fuzzed geometries, derived from floor samples on random geometries.

The floor moves with the geometry (roughly linear in d_model, and with depth and token
count), so a fuzzed geometry cannot borrow TOY's threshold, and it has no measurement of its
own. ``fuzz.floor`` samples the floor, and the deviation of every mutation, over geometries
drawn from the fuzz domain (plus the worst a targeted search found); this module records
them (``random_floor_artifact``: ``tolerance/random_floor_<phase>.json``) and derives the
rule. Three candidate rules, each with at least ``SAFETY`` x headroom over every
observation:

- ``absolute_pow10``: the seed's rule, one threshold for the whole domain;
- ``relative_pow10``: a multiple of max |reference logit|, the multiple rounded up to a
  power of ten;
- ``relative``: the same multiple rounded up to two significant digits only.

``choose_rule`` picks, among the rules with zero false positives over the samples, the one
whose smallest kill ratio (deviation / threshold over every mutation and sample) is largest.
``holdout`` re-derives each candidate from half the geometries and counts its false
positives on the other half: the figure that says the margin generalises. Everything is a
pure function of the artifact, so the choice can be re-derived and tested. TOY and TOY_KV4
keep the seed's rule and ``tolerance/phase1a.json``.

The samples are the plain layout's forward. A fuzzed conversion to vLLM at t > n_kv_heads
runs another one, so the rule judges it only where ``random_floor_<phase>_replicated_kv.json``
validates it there (``replicated_kv_artifact``; ``validation`` re-derives its figures under
the rule in force, which ``fuzz.floor.require_replicated_kv`` reads).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance.artifacts import (
    SCHEMA,
    artifact_path,
    environment,
    mtime,
    read_artifact,
)
from weight_sync_bench.tolerance.rules import (
    SAFETY,
    check_environment,
    derive_threshold,
    merges_here,
)

RULES = ("absolute_pow10", "relative_pow10", "relative")


@dataclass(frozen=True)
class SampledRule:
    """A rule derived from floor samples, a ``tolerance.rules.ThresholdRule``: ``absolute``,
    the threshold is ``value``; ``relative``, ``value`` x max |reference logit|."""

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


def candidate_rules(samples: list[dict[str, Any]], safety: int = SAFETY) -> list[SampledRule]:
    """The three candidates, each derived from the samples with ``safety`` x headroom."""
    worst_abs = max(s["floor"] for s in samples)
    worst_rel = max(s["floor"] / s["scale"] for s in samples)
    return [SampledRule("absolute_pow10", "absolute", derive_threshold(worst_abs, safety)),
            SampledRule("relative_pow10", "relative", derive_threshold(worst_rel, safety)),
            SampledRule("relative", "relative", _round_up(safety * worst_rel))]


def fit(rule: SampledRule, samples: list[dict[str, Any]]) -> tuple[int, float]:
    """The false positives of ``rule`` over the samples (floor above the threshold) and its
    smallest headroom (threshold / floor)."""
    false_positives = sum(1 for s in samples if s["floor"] > rule.threshold(s["scale"]))
    headroom = min((rule.threshold(s["scale"]) / s["floor"] for s in samples if s["floor"] > 0),
                   default=math.inf)
    return false_positives, headroom


def worst_floors(samples: list[dict[str, Any]]) -> dict[str, float]:
    """The samples' worst floor, absolute and relative to their logits' scale."""
    return {"worst_floor": max(s["floor"] for s in samples),
            "worst_relative_floor": max(s["floor"] / s["scale"] for s in samples)}


def evaluate_rule(rule: SampledRule, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures a rule must deliver over the samples: false positives (floor above the
    threshold), the smallest headroom (threshold / floor), and per mutation the smallest
    kill ratio (deviation / threshold) with where it was seen."""
    false_positives, headroom = fit(rule, samples)
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


def choose_rule(samples: list[dict[str, Any]]) -> tuple[SampledRule, list[dict[str, Any]]]:
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


def random_floor_artifact(samples: list[dict[str, Any]], *, phase: str,
                          domain: dict[str, Any], geometries: int, searched: int,
                          search_examples: int, profile: str | None,
                          hypothesis_seed: int | None) -> dict[str, Any]:
    """The random-geometry floor of ``samples`` (``fuzz.floor.measure_random``'s records:
    ``geometries`` random cases and ``searched`` ones a targeted search found, over the fuzz
    ``domain``), with every candidate rule's figures, the chosen one and the held-out check,
    and the environment it ran in."""
    chosen, figures = choose_rule(samples)
    return {"schema": SCHEMA, "phase": phase, "safety": SAFETY, "domain": domain,
            "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
            "geometries": geometries, "searched": searched,
            "search_examples": search_examples,
            "profile": profile, "hypothesis_seed": hypothesis_seed,
            "chosen": chosen.name, "rules": figures, "holdout": holdout(samples),
            "samples": samples,
            "environment": environment()}


def load_random_floor(phase: str = "1a", path: Path | None = None) -> dict[str, Any]:
    return read_artifact(path or artifact_path(phase, kind="random_floor"), phase=phase,
                         schema=SCHEMA, fields=("domain", "samples", "chosen"),
                         remedy=f"wsb floor --random N --phase {phase}")


def rule_from(artifact: dict[str, Any]) -> SampledRule:
    """The rule an artifact implies: re-derived from its samples, not read from its figures."""
    chosen, _ = choose_rule(artifact["samples"])
    return chosen


def environment_notes(phase: str = "1a", path: Path | None = None) -> tuple[str, ...]:
    """How the running process differs from the one the random-geometry floor was measured
    in (``tolerance.rules.check_environment``: a floor re-measured under several kernel sets
    covers each); under ``WSB_STRICT_ENV`` a ``ToleranceMismatch`` instead."""
    artifact = load_random_floor(phase, path)
    remedy = (f"wsb floor --kernel-sets all --phase {phase} --write" if merges_here(artifact)
              else f"wsb floor --random N --phase {phase} --write")  # its samples, or new ones
    return check_environment(artifact, f"the phase {phase} random-geometry floor", remedy)


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


# -- the rule validated on vLLM's replicated-KV forward (t > n_kv_heads)


def replicated_kv_path(phase: str = "1a") -> Path:
    """``random_floor_<phase>_replicated_kv.json`` beside the random-geometry floor."""
    return artifact_path(phase, kind="random_floor").with_name(
        f"random_floor_{phase}_replicated_kv.json")


def replicated_kv_command(phase: str = "1a") -> str:
    """The command that measures the validation (every kernel set) into the committed file."""
    return ("python -m weight_sync_bench.fuzz.floor replicated-kv --write"
            + (f" --phase {phase}" if phase != "1a" else ""))


def replicated_kv_artifact(samples: list[dict[str, Any]], *, phase: str, forward: str,
                           domain: dict[str, Any], geometries: int, draw_seed: int | None,
                           max_degree: int) -> dict[str, Any]:
    """The validation of ``samples`` (``fuzz.floor.sample_replicated_kv``'s records of
    ``geometries`` cases of the fuzz ``domain`` drawn from ``draw_seed``, on ``forward`` at
    degrees up to ``max_degree``), with the figures of the rule in force, the phase's
    random-geometry floor's (provenance: a check re-derives them, ``validation``)."""
    artifact = {"schema": SCHEMA, "phase": phase, "kind": "replicated_kv_validation",
                "forward": forward, "safety": SAFETY, "domain": domain,
                "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
                "geometries": geometries, "draw_seed": draw_seed,
                "max_degree": max_degree, "samples": samples,
                "environment": environment()}
    return validated(artifact, rule_from(load_random_floor(phase)))


def validated(artifact: dict[str, Any], rule: SampledRule) -> dict[str, Any]:
    """``artifact`` (a validation) with ``rule``'s figures over its samples as ``validated``."""
    return {**artifact, "validated": {"rule": {"name": rule.name, "kind": rule.kind,
                                               "value": rule.value},
                                      **replicated_kv_figures(artifact, rule)}}


def replicated_kv_figures(artifact: dict[str, Any], rule: SampledRule) -> dict[str, Any]:
    """What ``rule`` delivers on the validation's samples (pure): false positives, the
    smallest headroom (threshold / floor), the smallest kill ratio per conversion mutation
    with where it was seen, and the degrees covered."""
    samples = artifact["samples"]
    figures = evaluate_rule(rule, samples)
    return {"samples": len(samples), "false_positives": figures["false_positives"],
            "min_headroom": figures["min_headroom"],
            "min_kill_ratio": figures["min_kill_ratio"], "kills": figures["kills"],
            "degrees": sorted({s["degree"] for s in samples}), **worst_floors(samples)}


def load_replicated_kv(phase: str = "1a", path: Path | None = None) -> dict[str, Any]:
    return read_artifact(path or replicated_kv_path(phase), phase=phase, schema=SCHEMA,
                         fields=("domain", "samples", "forward", "max_degree"),
                         remedy=replicated_kv_command(phase))


def validation(phase: str = "1a", path: Path | None = None
               ) -> tuple[dict[str, Any], list[int], bool]:
    """The figures of the rule in force (the phase's random-geometry floor's, re-derived)
    over the validation at ``path``, the degrees it measured, and whether it was measured
    over the random-geometry floor's domain; read once per version of both files."""
    path = path or replicated_kv_path(phase)
    return _validation(phase, path, mtime(path), mtime(artifact_path(phase, kind="random_floor")))


def why_not_validated(degree: int, phase: str = "1a", path: Path | None = None) -> str | None:
    """Why the validation at ``path`` does not validate the rule in force for a fuzzed
    conversion to vLLM at ``degree`` (None where it does): it must record the
    random-geometry floor's domain, reach ``degree`` and show the rule (re-derived from both
    artifacts) with zero false positives and ``SAFETY`` x headroom over its samples.
    ``ToleranceMismatch`` where either artifact cannot be read."""
    figures, degrees, same_domain = validation(phase, path)
    if not same_domain:
        return "it was measured over another fuzz domain than the random-geometry floor's"
    if degree not in degrees:
        return f"it measured t={', '.join(map(str, degrees))}, not t={degree}"
    if figures["false_positives"] or figures["min_headroom"] < SAFETY:
        return (f"the rule in force has {figures['false_positives']} false positives and "
                f"{figures['min_headroom']:.3g}x headroom over its samples (needs 0 and "
                f"{SAFETY}x)")
    return None


@functools.lru_cache(maxsize=8)
def _validation(phase: str, path: Path, stamp: int | None, floor_stamp: int | None
                ) -> tuple[dict[str, Any], list[int], bool]:
    """The rule in force's figures over the validation, read once per version of both files."""
    artifact = load_replicated_kv(phase, path)
    random_floor = load_random_floor(phase)
    figures = replicated_kv_figures(artifact, rule_from(random_floor))
    return figures, figures["degrees"], artifact["domain"] == random_floor["domain"]

"""The random-geometry rule validated on the Mixture-of-Experts forwards.

The random-geometry floor (``tolerance.sampled``) samples dense geometries on the plain
layout's forward. A fuzzed MoE conversion runs other forwards: experts chosen per token by a
router, split over every rank (plain TP), whole on expert-parallel ranks or over
data-parallel replicas of the dense layers (``EXPERT_PARALLEL``), vLLM's replicated KV heads
past ``n_kv_heads``; and it runs a selection-only mutation (a router's bias) at the length
that mutation states (``ConversionMutation.min_seq_len``, past the dense domain's longest
sequence). So the rule judges an MoE geometry only where ``random_floor_<phase>_moe.json``
validates it there (``moe_artifact``): MoE geometries drawn as the MoE fuzz draws them, at
every forward of their MoE endpoints, each sample recording

- ``floor``: the forward's max |logits - reference| with the reference's choice of experts
  kept on every token (the routing guard at an infinite bound: the continuous part, as
  ``check.convert.measure_threshold`` measures it), the worst over the endpoints of one
  (world, forward); ``scale``, max |reference logit|;
- ``route``: the largest change of a selection score those forwards' own routing made
  against the reference (``model.routing.score_deviation``): the routing check keeps the
  reference's choice only within the threshold of a tie (``model.sharded.RoutingGuard``),
  so a correct forward can flip no other token only while this stays below the threshold;
- ``near_ties``: ``(near-tied, all)`` of the reference's (layer, token) choices within the
  rule's threshold (``bound``) of flipping, and ``min_margin``, the closest any came;
- ``kills``: each MoE conversion mutation's deviation where it is live there, judged as the
  fuzz judges it (the guard at ``bound``), with where (``kill_at``); a mutation the sample's
  tokens hide from the forward is listed instead (``check.routing``: a selection-only one that
  moves no choice the routing check leaves to the forward, in ``selection_unchanged``; one
  that changes only experts no token takes, in ``unrouted``);
- ``purpose``: what the geometry was drawn for (``moe_convert``'s draw: None; a mutation's
  name: ``moe_convert_kill[m]``'s, with what ``m`` needs to be live).

``moe_figures`` re-derives what the rule in force delivers over them (pure), and
``why_moe_not_validated`` says whether that validates it for a geometry's forward:
zero false positives, ``SAFETY`` x headroom over every floor and every routing deviation,
the random-geometry floor's domain and the caller's MoE domain, the forward and the length
measured. ``fuzz.threshold.require_moe`` reads it.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.tolerance.artifacts import (
    SCHEMA,
    artifact_path,
    environment,
    mtime,
    read_artifact,
)
from weight_sync_bench.tolerance.rules import SAFETY
from weight_sync_bench.tolerance.sampled import (
    SampledRule,
    fit,
    load_random_floor,
    rule_from,
    worst_floors,
)

MOE_KIND = "moe_validation"


def moe_path(phase: str = "1a") -> Path:
    """``random_floor_<phase>_moe.json`` beside the random-geometry floor."""
    return artifact_path(phase, kind="random_floor").with_name(f"random_floor_{phase}_moe.json")


def moe_command(phase: str = "1a") -> str:
    """The command that measures the validation (every kernel set) into the committed file."""
    return ("python -m weight_sync_bench.fuzz.floor moe --write"
            + (f" --phase {phase}" if phase != "1a" else ""))


def moe_artifact(samples: list[dict[str, Any]], *, phase: str, domain: dict[str, Any],
                 moe_domain: dict[str, Any], geometries: int, hypothesis_seed: int | None,
                 max_world: int, rule: SampledRule, draw: str | None = None,
                 coverage: int = 0) -> dict[str, Any]:
    """The validation of ``samples`` (``fuzz.floor.sample_moe``'s records of ``geometries``
    MoE geometries of ``domain`` x ``moe_domain`` drawn under ``hypothesis_seed``, at their
    endpoints' forwards up to ``max_world`` ranks, kills and near ties judged under ``rule``;
    ``draw``: the call that drew them, and under which Hypothesis; ``coverage`` geometries
    more, chosen to reach the forwards the draw did not), with ``rule``'s figures
    over them (provenance: a check re-derives them, ``moe_figures``)."""
    artifact = {"schema": SCHEMA, "phase": phase, "kind": MOE_KIND, "safety": SAFETY,
                "domain": domain, "moe_domain": moe_domain,
                "init": "std d_model^-1/2, norm 1 + N(0, 0.1) (domain.fuzz_init)",
                "geometries": geometries, "coverage": coverage,
                "hypothesis_seed": hypothesis_seed, "draw": draw,
                "max_world": max_world, "samples": samples, "environment": environment()}
    return validated_moe(artifact, rule)


def validated_moe(artifact: dict[str, Any], rule: SampledRule) -> dict[str, Any]:
    """``artifact`` (an MoE validation) with ``rule``'s figures over its samples as
    ``validated``."""
    return {**artifact, "validated": {"rule": {"name": rule.name, "kind": rule.kind,
                                               "value": rule.value},
                                      **moe_figures(artifact, rule)}}


def _geometry_key(s: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(s["geometry"].items())), s["seed"]


def moe_figures(artifact: dict[str, Any], rule: SampledRule) -> dict[str, Any]:
    """What ``rule`` delivers on the validation's samples (pure): false positives and the
    smallest headroom (threshold / floor) over the floors; per MoE mutation the smallest
    kill ratio (deviation / threshold) over every sample it was live in, where, and how many,
    and the same over the samples drawn for it (``drawn_min_ratio``, ``drawn_live``: what
    ``moe_convert_kill[m]`` draws), and the smallest of each over every mutation; in how
    many samples the tokens hid each mutation from the forward (``selection_unchanged``,
    ``unrouted``); the worst routing deviation and the smallest
    routing headroom (threshold / route); the near ties the references met (references with
    any, near-tied choices of all, at the bound each was measured at, and the closest
    margin); the (world, forward) pairs and token lengths covered. A reference is one
    (geometry, seed, length): a geometry sampled again at a mutation's length counts twice."""
    samples = artifact["samples"]
    if not samples:
        raise ToleranceMismatch("an MoE validation without samples validates nothing")
    false_positives, headroom = fit(rule, samples)
    kills: dict[str, dict[str, Any]] = {}
    for s in samples:
        for name, deviation in s["kills"].items():
            ratio = deviation / rule.threshold(s["scale"])
            kill = kills.setdefault(name, {"min_ratio": math.inf, "live": 0,
                                           "drawn_min_ratio": math.inf, "drawn_live": 0})
            kill["live"] += 1
            if ratio < kill["min_ratio"]:
                kill.update(min_ratio=ratio, d_model=s["geometry"]["d_model"],
                            world=s["degree"], forward=s["forward"], at=s["kill_at"][name],
                            purpose=s.get("purpose"))
            if s.get("purpose") == name:
                kill["drawn_live"] += 1
                kill["drawn_min_ratio"] = min(kill["drawn_min_ratio"], ratio)
    routes = [s for s in samples if s["route"] > 0]
    per_geometry = {_geometry_key(s): s for s in samples}  # near ties: the reference's, once
    hidden: dict[str, dict[str, int]] = {"selection_unchanged": {}, "unrouted": {}}
    for s in samples:
        for why, counts in hidden.items():
            for name in s.get(why, []):
                counts[name] = counts.get(name, 0) + 1
    return {"samples": len(samples), "references": len(per_geometry),
            "false_positives": false_positives, "min_headroom": headroom,
            "min_kill_ratio": min((k["min_ratio"] for k in kills.values()), default=math.inf),
            "min_drawn_kill_ratio": min((k["drawn_min_ratio"] for k in kills.values()),
                                        default=math.inf),
            "kills": kills, **hidden,
            "worst_route": max((s["route"] for s in samples), default=0.0),
            "min_route_headroom": min((rule.threshold(s["scale"]) / s["route"] for s in routes),
                                      default=math.inf),
            "near_ties": {"references": sum(1 for s in per_geometry.values()
                                            if s["near_ties"][0] > 0),
                          "choices": sum(s["near_ties"][0] for s in per_geometry.values()),
                          "of": sum(s["near_ties"][1] for s in per_geometry.values()),
                          "min_margin": min(s["min_margin"] for s in per_geometry.values())},
            "forwards": [list(f) for f in sorted({(s["degree"], s["forward"]) for s in samples})],
            "seq_lens": sorted({s["geometry"]["seq_len"] for s in samples}),
            **worst_floors(samples)}


def load_moe(phase: str = "1a", path: Path | None = None) -> dict[str, Any]:
    return read_artifact(path or moe_path(phase), phase=phase, schema=SCHEMA,
                         fields=("domain", "moe_domain", "samples", "max_world"),
                         remedy=moe_command(phase))


def moe_validation(phase: str = "1a", path: Path | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The figures of the rule in force (the phase's random-geometry floor's, re-derived)
    over the MoE validation at ``path``, and the domains it was measured over (``domain``,
    ``moe_domain``, ``same_domain``: the random-geometry floor's); read once per version of
    both files."""
    path = path or moe_path(phase)
    return _moe_validation(phase, path, mtime(path),
                           mtime(artifact_path(phase, kind="random_floor")))


@functools.lru_cache(maxsize=8)
def _moe_validation(phase: str, path: Path, stamp: int | None, floor_stamp: int | None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    artifact = load_moe(phase, path)
    random_floor = load_random_floor(phase)
    figures = moe_figures(artifact, rule_from(random_floor))
    return figures, {"domain": artifact["domain"], "moe_domain": artifact["moe_domain"],
                     "same_domain": artifact["domain"] == random_floor["domain"],
                     "max_world": artifact["max_world"]}


def why_moe_not_validated(phase: str = "1a", path: Path | None = None, *,
                          moe_domain: dict[str, Any], world: int | None = None,
                          forward: str | None = None, seq_len: int | None = None) -> str | None:
    """Why the MoE validation at ``path`` does not validate the rule in force for a fuzzed MoE
    geometry (None where it does): it must record the random-geometry floor's domain and
    ``moe_domain`` (the caller's), show the rule (re-derived from both artifacts) with zero
    false positives and ``SAFETY`` x headroom over every floor and every routing deviation,
    and have measured ``forward`` at ``world`` ranks and sequences of ``seq_len`` tokens
    (each where given). ``ToleranceMismatch`` where either artifact cannot be read."""
    figures, domains = moe_validation(phase, path)
    if not domains["same_domain"]:
        return "it was measured over another fuzz domain than the random-geometry floor's"
    if domains["moe_domain"] != moe_domain:
        return "it was measured over another MoE domain than the fuzz draws from"
    if figures["false_positives"] or figures["min_headroom"] < SAFETY:
        return (f"the rule in force has {figures['false_positives']} false positives and "
                f"{figures['min_headroom']:.3g}x headroom over its floors (needs 0 and "
                f"{SAFETY}x)")
    if figures["min_route_headroom"] < SAFETY:
        return (f"the rule in force is {figures['min_route_headroom']:.3g}x the worst routing "
                f"deviation of a correct forward (the routing check's bound needs {SAFETY}x)")
    if world is not None and forward is not None and [world, forward] not in figures["forwards"]:
        measured = ", ".join(f"{w} ranks {f}" for w, f in figures["forwards"])
        return f"it measured no {forward} forward over {world} ranks (it measured {measured})"
    if seq_len is not None and seq_len not in figures["seq_lens"]:
        return (f"it measured sequences of {', '.join(map(str, figures['seq_lens']))} tokens, "
                f"not {seq_len}")
    return None

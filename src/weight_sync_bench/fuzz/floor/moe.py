"""The random-geometry rule validated on the Mixture-of-Experts forwards: its measuring loop.

``measure_moe`` samples MoE geometries of ``DOMAIN`` x ``MOE_DOMAIN`` (drawn as the MoE fuzz
draws them: ``fuzz.runner.draw_moe_cases``) at every forward their MoE endpoints run
(``conventions.moe_endpoints``, up to ``MOE_MAX_WORLD`` ranks: the endpoints the MoE fuzz
converts between), one sample per (world, forward) (``check.floor.forward_of``: the plain
layout's with every expert split over every rank, ``EXPERT_PARALLEL`` with experts whole on
expert-parallel ranks or over data-parallel replicas, vLLM's replicated KV heads), the worst
of its endpoints. ``tolerance.sampled_moe`` records them and derives what the rule in force
delivers there (``random_floor_<phase>_moe.json``); ``fuzz.threshold.require_moe`` lets the
rule judge an MoE geometry only where that validates it.

A geometry whose router has a selection bias is sampled a second time at the length its
selection-only mutations run (``fuzz.threshold.moe_seq_lens``: 32 tokens, past the domain's
16), with only those mutations: the fuzz judges them there. After the drawn geometries,
``coverage_cases`` adds the grid geometries that reach a (world, forward) no draw did
(``coverage_reach``: every pair the MoE fuzz can run), so ``require_moe`` never refuses a
forward the fuzz draws.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from weight_sync_bench.check.checker import Checker
from weight_sync_bench.check.conversion import ConversionChecker
from weight_sync_bench.check.floor import forward_of
from weight_sync_bench.conventions import (
    Endpoint,
    endpoint,
    forward_inputs,
    forward_model,
    materialize,
    moe_endpoints,
    reading_plan,
)
from weight_sync_bench.conventions.mutations import (
    MOE_MUTATIONS,
    ROUTER_BIAS,
    Conversion,
    ConversionMutation,
)
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.fuzz.case import (
    ConversionCase,
    make_checker,
    run_conversion_case,
)
from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN, FuzzDomain, MoeDomain
from weight_sync_bench.fuzz.threshold import moe_seq_lens
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.routing import score_deviation
from weight_sync_bench.model.stepwise import computing
from weight_sync_bench.tolerance.sampled import (
    SampledRule,
    load_random_floor,
    rule_from,
)
from weight_sync_bench.tolerance.sampled_moe import moe_artifact

MOE_GEOMETRIES = 300  # the validation's default sample: 25 per purpose of the draw (of 12)
MOE_SEED = 20261201  # its default Hypothesis seed
MOE_MAX_WORLD = 8  # conventions.moe_endpoints' default: the worlds the MoE fuzz draws


def _unbounded(config: ModelConfig, reference: torch.Tensor) -> float:
    """An infinite threshold: the routing guard keeps the reference's choice on every token."""
    return math.inf


def endpoint_deviation(checker: Checker, where: Endpoint) -> tuple[float, float]:
    """``(floor, route)`` of ``where``'s forward reading its declared shards of ``checker``'s
    weights, on ``checker``'s tokens, under ``checker``'s routing guard: max |logits -
    reference| (every data-parallel replica's logits count) and the largest change of a
    selection score its own routing made (``model.routing.score_deviation``). The logits are
    ``check.floor.convention_logits``' (phase 1a) bit for bit; the model is kept for its
    routings."""
    config, guard = checker.config, checker.guard
    assert guard is not None and checker.tokens is not None
    plan = reading_plan(where.convention, config, where)
    shards = materialize(where.pieces(config), checker.full)
    inputs = [computing(x) for x in forward_inputs(shards, where.convention, config, where)]
    model = forward_model(plan.forward, inputs, guard=guard)
    with torch.no_grad():
        logits = model(checker.tokens)
    tp = plan.forward.tp or len(inputs)
    out = logits[0] if tp == len(inputs) else torch.stack(logits[::tp])
    return checker.deviation(out), score_deviation(model.routings, guard.routings)


def forward_groups(config: ModelConfig, max_world: int = MOE_MAX_WORLD
                   ) -> dict[tuple[int, str], list[Endpoint]]:
    """The MoE endpoints of ``config`` (``moe_endpoints``) by (world, forward)."""
    return {pair: list(group) for pair, group in _forward_groups(config, max_world)}


@functools.lru_cache(maxsize=512)
def _forward_groups(config: ModelConfig, max_world: int
                    ) -> tuple[tuple[tuple[int, str], tuple[Endpoint, ...]], ...]:
    """``forward_groups``, kept: finding which endpoints store a geometry cuts every one of
    them (0.1 s a geometry), and the coverage grid's 112 are walked twice."""
    groups: dict[tuple[int, str], list[Endpoint]] = {}
    for where in moe_endpoints(config, max_world):
        groups.setdefault((where.world, forward_of(where.convention, config, where)),
                          []).append(where)
    return tuple((pair, tuple(group)) for pair, group in groups.items())


def sample_moe(config: ModelConfig, seed: int, *, rule: SampledRule,
               mutations: Sequence[ConversionMutation] = MOE_MUTATIONS,
               max_world: int = MOE_MAX_WORLD, purpose: str | None = None
               ) -> list[dict[str, Any]]:
    """One MoE geometry's samples, one per (world, forward) of its endpoints
    (``forward_groups``): the floor and the routing deviation of the group's worst endpoint
    with the reference's choice kept on every token; the reference's near ties at ``rule``'s
    threshold; each of ``mutations`` judged as the fuzz judges it
    (``fuzz.case.run_conversion_case`` under ``rule``'s threshold) at the first conversion
    into the group where it applies and is not the identity: its deviation, or (a
    selection-only mutation that moves no token's choice here) its name in
    ``selection_unchanged``; one that changes only experts no token takes there, in
    ``unrouted``: ``check.routing``). ``purpose``: what the geometry was drawn for
    (``fuzz.runner.draw_moe_cases``), recorded."""
    free = make_checker(config, seed, threshold_rule=_unbounded)
    scale = float(free.reference.abs().max())
    bound = rule.threshold(scale)

    def judged_rule(c: ModelConfig, reference: torch.Tensor) -> float:
        return rule(c, reference)

    judged = ConversionChecker(make_checker(config, seed, threshold_rule=judged_rule))
    guard = judged.checker.guard
    assert guard is not None
    near = guard.near_ties()
    margin = min(float(r.margin.min()) for r in guard.routings.values())
    groups = forward_groups(config, max_world)
    sources = [e for members in groups.values() for e in members]
    records = []
    for (world, forward), members in groups.items():
        measured = [(endpoint_deviation(free, where), where) for where in members]
        (floor, _), worst = max(measured, key=lambda m: m[0][0])
        kills: dict[str, float] = {}
        kill_at: dict[str, str] = {}
        unchanged: list[str] = []
        unrouted: list[str] = []
        for m in mutations:
            pair = next(((src, dst) for dst in members for src in sources
                         if m.not_applicable(Conversion(config, src, dst)) is None
                         and m.identity_reason(Conversion(config, src, dst)) is None), None)
            if pair is None:
                continue
            src, dst = pair
            case = ConversionCase(config, str(src), src.world, str(dst), dst.world, seed, m.name)
            outcome = run_conversion_case(case, judged, threshold_rule=judged_rule)
            if outcome.unchanged is not None:
                (unchanged if m.changes == ROUTER_BIAS else unrouted).append(m.name)
            else:
                kills[m.name] = outcome.deviation
                kill_at[m.name] = f"{src} -> {dst}"
        records.append({"geometry": config.geometry(), "seed": seed, "purpose": purpose,
                        "degree": world,
                        "forward": forward, "endpoints": [str(e) for e in members],
                        "worst_endpoint": str(worst), "scale": scale, "floor": floor,
                        "route": max(r for (_, r), _ in measured), "bound": bound,
                        "near_ties": list(near), "min_margin": margin, "kills": kills,
                        "kill_at": kill_at, "selection_unchanged": unchanged,
                        "unrouted": unrouted})
    return records


def sample_moe_geometry(config: ModelConfig, seed: int, *, rule: SampledRule,
                        domain: FuzzDomain = DOMAIN, max_world: int = MOE_MAX_WORLD,
                        purpose: str | None = None) -> list[dict[str, Any]]:
    """``sample_moe`` of ``config`` with the mutations whose forward runs its length, and
    again at each length of ``moe_seq_lens`` with the mutations that run it, where one of them
    applies to the geometry and is not the identity (a selection bias, and fewer experts
    chosen than there are)."""
    records = sample_moe(config, seed, rule=rule, max_world=max_world, purpose=purpose,
                         mutations=[m for m in MOE_MUTATIONS if m.min_seq_len <= config.seq_len])
    plain = endpoint("plain:1")
    for length in moe_seq_lens(domain):
        longer = config.replace(seq_len=length)
        those = [m for m in MOE_MUTATIONS if m.min_seq_len == length
                 and m.not_applicable(Conversion(longer, plain, plain)) is None
                 and m.identity_reason(Conversion(longer, plain, plain)) is None]
        if those:
            records += sample_moe(longer, seed, rule=rule, mutations=those, max_world=max_world,
                                  purpose=purpose)
    return records


def coverage_cases(covered: Iterable[tuple[int, str]], domain: FuzzDomain = DOMAIN,
                   moe: MoeDomain = MOE_DOMAIN, max_world: int = MOE_MAX_WORLD
                   ) -> list[tuple[ModelConfig, int, str | None]]:
    """Geometries that reach the (world, forward) pairs of ``coverage_reach`` that
    ``covered`` lacks, the first grid point to reach each (model seed 0, purpose
    ``"coverage"``). Found needed: 300 random draws reached no vLLM replicated-KV forward over
    3 or 6 ranks (n_heads a multiple of 3 or 6 over fewer KV heads, a vocabulary and widths
    that 3 divides), and the fuzz drew one over 6 in its first minute."""
    covered = set(covered)
    out: list[tuple[ModelConfig, int, str | None]] = []
    for config in coverage_grid(domain, moe):
        new = set(forward_groups(config, max_world)) - covered
        if new:
            out.append((config, 0, "coverage"))
            covered |= new
    return out


def coverage_grid(domain: FuzzDomain = DOMAIN, moe: MoeDomain = MOE_DOMAIN
                  ) -> list[ModelConfig]:
    """MoE geometries over every KV-head count, query group and expert count of the domains,
    each other size chosen so that every degree divides it (24 per KV head of ffn and of
    expert width, a vocabulary of 192, d_model 48), so each stores at every endpoint its
    heads and experts allow; those inside ``domain`` x ``moe``."""
    out = []
    for kv in range(domain.n_kv_heads.lo, domain.n_kv_heads.top + 1, domain.n_kv_heads.step):
        for group in range(domain.group.lo, domain.group.top + 1, domain.group.step):
            for e in range(moe.n_experts.lo, moe.n_experts.top + 1, moe.n_experts.step):
                config = domain.config(n_kv_heads=kv, group=group, head_dim=4, d_model=48,
                                       ffn_per_kv_head=24, vocab_per_kv_head=192 // kv,
                                       n_layers=1, batch=1, seq_len=4, name="fuzz_moe")
                config = config.replace(n_experts=e, top_k=1, expert_ffn=kv * 24)
                if moe.contains(config, domain):
                    out.append(config)
    return out


def coverage_reach(domain: FuzzDomain = DOMAIN, moe: MoeDomain = MOE_DOMAIN,
                   max_world: int = MOE_MAX_WORLD) -> set[tuple[int, str]]:
    """Every (world, forward) pair the geometries of ``coverage_grid`` run at their MoE
    endpoints: what the validation must cover."""
    return {pair for config in coverage_grid(domain, moe)
            for pair in forward_groups(config, max_world)}


def measure_moe(cases: Iterable[tuple[ModelConfig, int, str | None]], *, phase: str = "1a",
                domain: FuzzDomain = DOMAIN, moe: MoeDomain = MOE_DOMAIN,
                hypothesis_seed: int | None = None, max_world: int = MOE_MAX_WORLD,
                rule: SampledRule | None = None, draw: str | None = None, cover: bool = True,
                progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """The MoE validation artifact (``tolerance.sampled_moe.moe_artifact``, not yet written):
    every (geometry, model seed, purpose) case's ``sample_moe_geometry`` records under
    ``rule`` (default: the phase's random-geometry rule in force), the domains, and the
    figures of the rule (provenance: a check re-derives them; ``draw`` says how the cases
    were drawn). Every case must lie inside ``domain`` x ``moe``. With ``cover``, the
    geometries of ``coverage_cases`` that reach the (world, forward) pairs the cases did not
    are sampled after them. ``progress(done, total, what)`` after each geometry."""
    if phase != "1a":
        raise ToleranceMismatch(f"conversions are fuzzed in process (phase 1a), got {phase!r}")
    rule = rule or rule_from(load_random_floor(phase))
    drawn = list(cases)
    samples: list[dict[str, Any]] = []

    def sample_all(batch: list[tuple[ModelConfig, int, str | None]], done: int) -> None:
        for i, (config, model_seed, purpose) in enumerate(batch, start=done):
            outside = moe.violations(config, domain)
            if outside:
                raise ToleranceMismatch(f"MoE sample {i} lies outside the fuzz domain: "
                                        + "; ".join(outside))
            samples.extend(sample_moe_geometry(config, model_seed, rule=rule, domain=domain,
                                               max_world=max_world, purpose=purpose))
            if progress is not None:
                progress(i + 1, done + len(batch), f"geometry d_model={config.d_model} "
                                                   f"experts={config.n_experts} "
                                                   f"top_k={config.top_k}")

    sample_all(drawn, 0)
    extra = (coverage_cases({(s["degree"], s["forward"]) for s in samples}, domain, moe,
                            max_world) if cover else [])
    sample_all(extra, len(drawn))
    return moe_artifact(samples, phase=phase, domain=domain.to_json(), moe_domain=moe.to_json(),
                        geometries=len(drawn), coverage=len(extra),
                        hypothesis_seed=hypothesis_seed, max_world=max_world, rule=rule,
                        draw=draw)


def remeasure_moe_floors(artifact: dict[str, Any],
                         progress: Callable[[int, int, str], None] | None = None
                         ) -> list[float]:
    """Each MoE validation sample's floor measured again in this process (its kernels): the
    worst of its endpoints' forwards with the reference's choice kept on every token, as
    ``sample_moe`` measured it. ``progress(done, total, what)`` after each sample."""
    floors: list[float] = []
    key, checker = None, None
    for i, s in enumerate(artifact["samples"]):
        here = (tuple(sorted(s["geometry"].items())), s["seed"])
        if here != key:  # a geometry's samples are adjacent
            config = ModelConfig.from_geometry(s["geometry"], f"moe-sample-{i}")
            checker = make_checker(config, s["seed"], threshold_rule=_unbounded)
            key = here
        assert checker is not None
        floors.append(max(endpoint_deviation(checker, endpoint(e))[0] for e in s["endpoints"]))
        if progress is not None:
            progress(i + 1, len(artifact["samples"]), f"sample {s['degree']} ranks "
                                                      f"{s['forward']}")
    return floors

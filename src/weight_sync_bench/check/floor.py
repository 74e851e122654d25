"""The phase floors' measuring loops: the deviation of correct sharded logits, measured.

``wsb floor phase [--phase 1b]`` (``python -m weight_sync_bench.tolerance``) runs ``measure``
and writes ``tolerance/phase<P>.json``; ``wsb floor geometry`` runs ``measure_geometry``.
Per destination cell (config, t), over ``repetitions`` model and token seeds, the deviation
of the sharded logits from the reference; ``tolerance.phase`` records the cells and the
artifact, ``tolerance.rules`` derives the threshold from it.

Two forwards have cells. The plain layout's (``layout_for``) at every degree it supports,
and vLLM's at every degree past ``n_kv_heads`` it stores, up to ``REPLICATED_MAX_DEGREE``:
there each KV head is replicated over ``t / n_kv_heads`` ranks (``HeadReplicated``), a
layout the plain one cannot store, whose o_proj sums ``t`` partials where the plain floor's
largest degree summed fewer. Such a cell is measured as ``check_convert`` runs that forward
(the declared vLLM shards, read through ``conventions.reading_plan``, ``ShardedModel`` over
the plan's forward layout) and records ``"forward": REPLICATED_KV``; a plain cell has no
``forward`` field (every artifact measured before the field existed holds plain cells only).
A conversion whose destination forward has no cell at its degree is refused
(``check.convert.require_cell``), never judged by a threshold borrowed from the other forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from weight_sync_bench.check.forwards import gloo_logits, inprocess_forward
from weight_sync_bench.check.streaming import Progress, stream_deviation
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.conventions import (
    CONVENTIONS,
    endpoint,
    forward_inputs,
    forward_model,
    materialize,
    moe_endpoints,
    reading_plan,
)
from weight_sync_bench.conventions.fp8 import dequantize_canonical, quantize_canonical
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.layout.placements import HeadReplicated
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import (
    TOY,
    TOY_KV4,
    ModelConfig,
    init_params,
    iter_params,
    make_tokens,
    parse_dtype,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.routing import score_deviation
from weight_sync_bench.model.sharded import RoutingGuard, ShardedModel
from weight_sync_bench.model.stepwise import (
    ReferenceSteps,
    ShardedSteps,
    computing,
    draw,
    stages,
)
from weight_sync_bench.tolerance import phase as record
from weight_sync_bench.tolerance.artifacts import FP8_WEIGHTS, PHASES, write_artifact
from weight_sync_bench.tolerance.phase import (
    EXPERT_PARALLEL,
    PLAIN_FORWARD,
    REPLICATED_KV,
)
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, cached_floor_path

if TYPE_CHECKING:
    from weight_sync_bench.check.forwards import Forward
    from weight_sync_bench.conventions import Convention, Endpoint

REPETITIONS = 20
# A per-geometry floor (a real width, measured on first use) takes fewer: one repetition of
# Llama-3-8B's width at 2 layers draws 1.5e9 weights and runs five forwards.
GEOMETRY_REPETITIONS = 4

# The largest degree whose replicated-KV cells a floor measurement adds: the largest the
# harness checks (issue 13's full-width checks go up to 8; TOY's 8 heads stop there too).
REPLICATED_MAX_DEGREE = 8
# The largest model an expert-parallel floor cell of Megatron's data-parallel replicas is
# measured held whole for (a streamed forward runs one TP group): 200M parameters, 0.8 GB.
HELD_WHOLE = 200_000_000


# (config, degree, param seed, token seed) -> rank 0's sharded logits under the declared split
ShardedRunner = Callable[[ModelConfig, int, int, int], torch.Tensor]


def inprocess_runner(config: ModelConfig, degree: int, param_seed: int, token_seed: int,
                     params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Phase 1a: every rank in this process over ``InProcessCollective``."""
    params = params if params is not None else init_params(config, param_seed)
    shards = split(params, layout_for(config), degree)
    return ShardedModel(config, shards, InProcessCollective(degree))(
        make_tokens(config, token_seed))[0]


def forward_of(convention: Convention | str, config: ModelConfig,
               degree: int | Endpoint) -> str:
    """Which forward a destination runs, as a floor's cells name it: ``REPLICATED_KV`` where
    the convention's forward layout replicates KV heads (``HeadReplicated``: vLLM at
    ``t > n_kv_heads``), ``EXPERT_PARALLEL`` where an MoE model's experts sit whole on EP ranks
    or over data-parallel replicas, else ``PLAIN_FORWARD`` (once each rank's stored rows are
    read in forward order, the plain layout's sharded forward; see ``check.convert``)."""
    conv = CONVENTIONS[convention] if isinstance(convention, str) else convention
    at = conv.at(degree)
    forward = conv.forward_layout(config, at)
    at = at.unstaged() if at.staged else at  # pipeline stages run their unstaged forward
    if any(isinstance(spec.placement, HeadReplicated) for spec in forward.layout):
        # vLLM's forward was measured replicated; Megatron's at t > n_kv_heads is the same
        # forward: once its gathered qkv is read, rank r computes Q heads r*np/t.. with KV
        # head r*ng/t (the group rank // (t/ng)) and o_proj sums the same t partials, in
        # the same ShardedModel over the same placement
        if conv.name not in ("vllm", "megatron"):
            return f"{conv.name}-replicated-kv"
        return REPLICATED_KV
    experts, world = forward.experts, at.world
    if experts is not None and (experts.ep > 1 or experts.expert_tp(world) != world
                                or forward.tp not in (0, world)):
        return EXPERT_PARALLEL  # else every expert split over every rank: the plain forward
    return PLAIN_FORWARD


def replicated_degrees(config: ModelConfig, max_degree: int = REPLICATED_MAX_DEGREE
                       ) -> list[int]:
    """Every degree ``t > n_kv_heads`` up to ``max_degree`` at which vLLM stores ``config``
    (``QKVParallelLinear``'s KV replication: the degrees a replicated-KV cell is measured at)."""
    return [t for t in CONVENTIONS["vllm"].supported_degrees(config, max_degree)
            if t > config.n_kv_heads]


def convention_logits(where: Endpoint, config: ModelConfig,
                      shards: Sequence[Mapping[str, torch.Tensor]], tokens: torch.Tensor,
                      phase: str = "1a", guard: RoutingGuard | None = None) -> torch.Tensor:
    """Rank 0's logits of ``where``'s forward reading its stored ``shards`` (in their synced
    dtype; the forward computes in fp32 from them), as that framework reads them
    (``conventions.reading_plan``): in process (phase 1a) or one process per rank over gloo
    (phase 1b, ``check.forwards.gloo_logits``). What ``ConversionChecker.error`` judges and
    a replicated-KV floor cell measures. Where the endpoint's world holds data-parallel
    replicas of the dense layers (Megatron's experts wider than TP), each replica's first
    rank's logits, stacked ``(replicas, B, T, V)``: every replica's weights are judged.
    ``guard``: an MoE forward's routing guard (``model.sharded.RoutingGuard``)."""
    plan = reading_plan(where.convention, config, where)
    inputs = [computing(x) for x in forward_inputs(shards, where.convention, config, where)]
    if phase == "1a":
        logits = forward_model(plan.forward, inputs, guard=guard)(tokens)
        tp = plan.forward.tp or len(inputs)
        return logits[0] if tp == len(inputs) else torch.stack(logits[::tp])
    return gloo_logits(plan.forward, inputs, tokens, guard=guard)


def replicated_logits(config: ModelConfig, params: Mapping[str, torch.Tensor], degree: int,
                      tokens: torch.Tensor, phase: str = "1a",
                      guard: RoutingGuard | None = None) -> torch.Tensor:
    """``convention_logits`` of vLLM at ``degree`` reading the declared vLLM shards of
    ``params``: a replicated-KV cell's forward (``guard``: an MoE model's routing guard)."""
    target = endpoint(f"vllm:{degree}")
    return convention_logits(target, config, materialize(target.pieces(config), params),
                             tokens, phase, guard=guard)


def stream_replicated_deviation(config: ModelConfig, degree: int, *, seed: int = 0,
                                dtype: torch.dtype | str = torch.float32,
                                progress: Callable[[Progress], None] | None = None,
                                route: list[float] | None = None) -> torch.Tensor:
    """|vLLM's forward at ``degree`` - reference logits|, streamed, flattened: one
    repetition of a replicated-KV cell at a width too large to hold whole
    (``stream_convention_deviation`` of ``vllm:{degree}``), the same logits as
    ``replicated_logits`` bit for bit."""
    return stream_convention_deviation(config, endpoint(f"vllm:{degree}"), seed=seed,
                                       dtype=dtype, progress=progress, route=route)


def stream_convention_deviation(config: ModelConfig, where: Endpoint, *, seed: int = 0,
                                dtype: torch.dtype | str = torch.float32,
                                progress: Callable[[Progress], None] | None = None,
                                route: list[float] | None = None) -> torch.Tensor:
    """|``where``'s forward - reference logits|, streamed, flattened: one repetition of a
    cell of that endpoint's forward at a width too large to hold whole. Per stage
    (``model.stepwise.stages``) the canonical parameters are drawn, the reference steps, the
    stage's declared tensors are cut, read through the reading plan and upcast, and the
    endpoint's forward steps (over one TP group); the same draws and steps as
    ``check.convert.stream_convert``, the same logits as ``convention_logits`` bit for bit.
    An MoE forward takes the reference's choice on every token (the routing guard at an
    infinite bound: the floor of the continuous part), and ``route`` (when given) gets the
    largest selection-score deviation its own choices made (``model.routing.score_deviation``)."""
    pieces = where.pieces(config)
    plan = reading_plan(where.convention, config, where)
    world = where.world
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference = ReferenceSteps(config, tokens)
    guard = RoutingGuard(reference.model.routings, math.inf) if config.n_experts else None
    sharded = ShardedSteps.over(plan.forward.config, InProcessCollective(world), tokens,
                                embedding=plan.forward.embedding, experts=plan.forward.experts,
                                guard=guard)
    draws = iter_params(config, seed, dtype=parse_dtype(dtype))
    started, steps = time.perf_counter(), stages(config)
    with torch.no_grad():
        for k, (label, names) in enumerate(steps):
            full = draw(draws, names)
            size = sum(x.numel() * x.element_size() for x in full.values())
            reference.take(names, full)
            sources = set(names)
            stored = materialize([{n: p for n, p in rank.items() if p.source in sources}
                                  for rank in pieces], full)
            del full
            inputs = [{c: selections[c].apply(stored[rank]) for c in names}
                      for rank, selections in enumerate(plan.ranks)]  # upcast as read
            del stored
            sharded.take(names, inputs)
            if progress is not None:
                progress(Progress(k + 1, len(steps), label, size,
                                  time.perf_counter() - started))
    assert sharded.logits is not None and reference.expected is not None
    if route is not None:
        route.append(score_deviation(sharded.model.routings, reference.model.routings))
    return (sharded.logits - reference.expected).abs().flatten()


def expert_parallel_endpoints(config: ModelConfig, max_degree: int = REPLICATED_MAX_DEGREE
                              ) -> dict[int, list[Endpoint]]:
    """Per world size, the endpoints of vLLM and Megatron whose MoE forward is
    ``EXPERT_PARALLEL`` (experts whole on EP ranks, or over data-parallel replicas): an
    expert-parallel floor cell at a world is the worst of their forwards."""
    out: dict[int, list[Endpoint]] = {}
    for where in moe_endpoints(config, max_world=max_degree):
        if where.name in ("vllm", "megatron") and \
                forward_of(where.convention, config, where) == EXPERT_PARALLEL:
            out.setdefault(where.world, []).append(where)
    return out


def convention_deviation(config: ModelConfig, where: Endpoint, *, seed: int,
                         route: list[float] | None = None) -> torch.Tensor:
    """``stream_convention_deviation`` held whole (``convention_logits``'s forward of the
    declared shards): the endpoints whose world holds data-parallel replicas of the dense
    layers (Megatron's experts wider than TP), which a streamed forward (one TP group)
    cannot run. Every replica's logits count."""
    params = init_params(config, seed)
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference_model = ReferenceModel(config, params)
    reference = reference_model(tokens)
    guard = RoutingGuard(reference_model.routings, math.inf)
    plan = reading_plan(where.convention, config, where)
    inputs = forward_inputs(materialize(where.pieces(config), params), where.convention,
                            config, where)
    model = forward_model(plan.forward, inputs, guard=guard)
    with torch.no_grad():
        logits = model(tokens)
    if route is not None:
        route.append(score_deviation(model.routings, reference_model.routings))
    tp = plan.forward.tp or len(inputs)
    return torch.stack([(x - reference).abs().flatten() for x in logits[::tp]]).flatten()


def measure(phase: str = "1a", *, configs: Iterable[ModelConfig] = (TOY, TOY_KV4),
            repetitions: int = REPETITIONS, runner: ShardedRunner | None = None,
            dtype: str = "fp32", forward: Forward | None = None,
            replicated: bool | None = None,
            max_degree: int = REPLICATED_MAX_DEGREE,
            progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Measure the floor per destination cell and return the artifact (not yet written;
    ``tolerance.phase.artifact``). ``progress(done, total, what)`` after each repetition.

    ``runner`` computes the sharded logits; phase 1a defaults to the in-process forward.
    ``dtype`` (``"bf16"``, ``"fp16"``) measures the floor of weights synced in that dtype:
    drawn as the fp32 floor's, rounded to ``dtype``, and computed in fp32 from the rounded
    values by both the reference and the sharded forward, which then gets the declared
    shards through ``forward`` (a ``check.Forward``; phase 1a defaults to the in-process
    one). The artifact records ``weights_dtype``; an fp32 one is exactly what it always was.
    ``"fp8_block128"`` / ``"fp8_tensor"``: the floor of an FP8 destination's forward, bf16
    weights quantized by ``conventions.fp8``'s reference quantizer in that scheme and both
    forwards computed from the dequantized values (each rank's dequantized tensors are the
    cut of the dequantized model, bit for bit: ``check.fp8``'s comparison).

    ``replicated``: also measure each config's replicated-KV cells (``replicated_degrees``
    up to ``max_degree``, ``"forward": REPLICATED_KV``; the same seeds, tokens and dtype,
    vLLM's forward in this process for phase 1a, over gloo for 1b), listed after its plain
    cells, and for an MoE config its expert-parallel cells (``EXPERT_PARALLEL``: the
    endpoints of ``expert_parallel_endpoints`` whose world is one TP group, each cell the
    worst of them; an MoE forward keeps the reference's routing on every token, a floor
    of the arithmetic as phase 1a's). Default: for the
    committed floors' configs (TOY and TOY_KV4, the default ``configs``: the measurement
    ``python -m weight_sync_bench.tolerance`` writes); a measurement of other ``configs``
    measures their plain cells unless asked.
    """
    if phase not in PHASES:
        raise ToleranceMismatch(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    fp8 = FP8_WEIGHTS.get(dtype)  # bf16 weights through the reference quantizer, dequantized
    weights = torch.bfloat16 if fp8 is not None else parse_dtype(dtype)
    if weights != torch.float32 and forward is None:
        if phase != "1a":
            raise ToleranceMismatch(f"phase {phase} needs its own forward (the gloo one)")
        forward = inprocess_forward
    if runner is None:
        if phase != "1a" and forward is None:
            raise ToleranceMismatch(f"phase {phase} needs its own runner (the gloo launcher)")
        runner = inprocess_runner
    configs = list(configs)
    if replicated is None:
        replicated = configs == [TOY, TOY_KV4]  # the committed floors' configs
    cells: list[dict[str, Any]] = []
    for i, config in enumerate(configs):
        degrees = layout_for(config).supported_degrees()
        deviations: dict[int, list[np.ndarray]] = {t: [] for t in degrees}
        wide = replicated_degrees(config, max_degree) if replicated else []
        copies: dict[int, list[np.ndarray]] = {t: [] for t in wide}
        # an MoE geometry's expert-parallel forwards whose world is one TP group (vLLM's EP,
        # Megatron's at EP == TP: what a forward over gloo can run), with the replicated-KV
        # cells; each cell the worst of its endpoints, as ``measure_geometry``'s in phase 1a
        experts = {t: [w for w in ends if (w.convention.forward_layout(config, w).tp
                                           or w.world) == w.world]
                   for t, ends in expert_parallel_endpoints(config, max_degree).items()
                   } if replicated and config.n_experts else {}
        experts = {t: ends for t, ends in experts.items() if ends}
        spread: dict[int, list[np.ndarray]] = {t: [] for t in experts}
        layout = layout_for(config)
        for rep in range(repetitions):
            params = init_params(config, rep, dtype=weights)
            if fp8 is not None:  # what an FP8 endpoint's forward computes with
                params = dequantize_canonical(config, *quantize_canonical(config, params, fp8),
                                              params, fp8)
            tokens = make_tokens(config, TOKEN_SEED_OFFSET + rep)
            model = ReferenceModel(config, computing(params))
            reference = model(tokens)
            # top-k routing: the reference's choice on every token (a floor of the arithmetic,
            # as phase 1a measures an MoE geometry's), for a forward that takes a guard
            guard = ({"guard": RoutingGuard(model.routings, math.inf)} if config.n_experts
                     else {})
            for t in degrees:
                if forward is not None:  # the declared shards in the synced dtype, upcast
                    shards = [computing(p) for p in split(params, layout, t)]
                    logits = forward(config, shards, tokens, **guard)
                elif runner is inprocess_runner:
                    logits = inprocess_runner(config, t, rep, TOKEN_SEED_OFFSET + rep, params)
                else:
                    logits = runner(config, t, rep, TOKEN_SEED_OFFSET + rep)
                deviations[t].append((logits - reference).abs().flatten().numpy())
                del logits
            for t in wide:  # vLLM's forward past n_kv_heads: each KV head on t / n_kv ranks
                logits = replicated_logits(config, params, t, tokens, phase, **guard)
                copies[t].append((logits - reference).abs().flatten().numpy())
                del logits
            for t, ends in experts.items():
                for where in ends:
                    logits = convention_logits(where, config,
                                               materialize(where.pieces(config), params),
                                               tokens, phase, **guard)
                    spread[t].append((logits - reference).abs().flatten().numpy())
                    del logits
            del params, reference, model
            if progress is not None:
                progress(i * repetitions + rep + 1, len(configs) * repetitions,
                         f"{config.name} seed {rep + 1}/{repetitions}")
        cells += [record.cell(config.name, t, deviations[t]) for t in degrees]
        cells += [record.cell(config.name, t, copies[t], forward=REPLICATED_KV) for t in wide]
        cells += [record.cell(config.name, t, spread[t], forward=EXPERT_PARALLEL)
                  for t in experts]
    return record.artifact(phase, configs, cells, repetitions, weights, fp8)


def measure_geometry(config: ModelConfig, *, phase: str = "1a", dtype: str = "fp32",
                     repetitions: int = GEOMETRY_REPETITIONS,
                     forward: Forward | None = None,
                     progress: Callable[[int, int, str], None] | None = None,
                     out: Path | None = None,
                     max_degree: int = REPLICATED_MAX_DEGREE) -> tuple[dict[str, Any], Path]:
    """Measure one geometry's floor, as the committed phase floors are measured (model
    seeds ``0..repetitions-1``, every supported degree, and vLLM's replicated-KV forward at
    every degree past ``n_kv_heads`` up to ``max_degree``, the running kernel set; an MoE
    geometry's expert-parallel forwards at every world up to ``max_degree`` too, each cell
    the worst of its endpoints (``expert_parallel_endpoints``) and every MoE cell its routing
    deviation (``tolerance.phase.cell``), with the reference's choice kept on every token;
    phase 1a
    streamed, so a real width fits: ``check.stream``, bit for bit the same logits), and cache
    it under ``tolerance_dir()/geometry/`` with its provenance and key
    (``tolerance.rules.floor_for`` reads it back): ``(artifact, path)``. Phase 1b needs
    ``forward`` (``check.forwards.gloo_forward()``). ``progress(done, total, what)`` after
    each streamed stage (phase 1a; what: the seed, degree and stage), or each repetition
    (phase 1b)."""
    if phase != "1a" and forward is None:
        raise ToleranceMismatch(f"phase {phase} needs its own forward (the gloo one)")
    wide = replicated_degrees(config, max_degree)
    if phase == "1a":  # streamed: a real width is never held whole (check.stream)
        moe = config.n_experts > 0
        experts = expert_parallel_endpoints(config, max_degree) if moe else {}
        every = [(t, PLAIN_FORWARD) for t in layout_for(config).supported_degrees()] + [
            (t, REPLICATED_KV) for t in wide] + [(t, EXPERT_PARALLEL) for t in sorted(experts)]

        def report(unit: int, rep: int, t: int, which: str) -> Callable[[Any], None] | None:
            if progress is None:
                return None
            what = "" if which == PLAIN_FORWARD else f" ({which})"
            return lambda p: progress(
                unit * p.stages + p.stage, len(every) * repetitions * p.stages,
                f"seed {rep + 1}/{repetitions}, t={t}{what}, {p.label}")

        def deviations(j: int, t: int, which: str, route: list[float]) -> list[np.ndarray]:
            out = []
            for rep in range(repetitions):
                tell = report(j * repetitions + rep, rep, t, which)
                if which == PLAIN_FORWARD:
                    out.append(stream_deviation(config, t, seed=rep, dtype=dtype, progress=tell,
                                                route=route).numpy())
                elif which == REPLICATED_KV:
                    out.append(stream_replicated_deviation(config, t, seed=rep, dtype=dtype,
                                                           progress=tell, route=route).numpy())
                else:  # every expert-parallel endpoint of that world, its worst
                    for where in experts[t]:
                        tp = where.convention.forward_layout(config, where).tp or where.world
                        if tp == where.world:
                            out.append(stream_convention_deviation(
                                config, where, seed=rep, dtype=dtype, progress=tell,
                                route=route).numpy())
                        elif config.n_params <= HELD_WHOLE:
                            out.append(convention_deviation(config, where, seed=rep,
                                                            route=route).numpy())
            return out

        cells = []
        for j, (t, which) in enumerate(every):
            route: list[float] = []
            found = deviations(j, t, which, route)
            if found:
                cells.append(record.cell(config.name, t, found, forward=which,
                                         route=route if moe else None))
        artifact = record.artifact(phase, [config], cells, repetitions, parse_dtype(dtype))
    else:
        artifact = measure(phase, configs=[config], repetitions=repetitions, dtype=dtype,
                           forward=forward, replicated=True, max_degree=max_degree,
                           progress=progress)
    artifact = record.geometry_artifact(artifact, config, phase, dtype)
    path = out or cached_floor_path(config, phase, dtype)
    write_artifact(artifact, path)
    return artifact, path

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
    reading_plan,
)
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
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.model.stepwise import (
    ReferenceSteps,
    ShardedSteps,
    computing,
    draw,
    stages,
)
from weight_sync_bench.tolerance import phase as record
from weight_sync_bench.tolerance.artifacts import PHASES, write_artifact
from weight_sync_bench.tolerance.phase import EXPERT_PARALLEL, PLAIN_FORWARD, REPLICATED_KV
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, cached_floor_path

if TYPE_CHECKING:
    from weight_sync_bench.check.forwards import Forward
    from weight_sync_bench.conventions import Convention, Endpoint
    from weight_sync_bench.model.sharded import RoutingGuard

REPETITIONS = 20
# A per-geometry floor (a real width, measured on first use) takes fewer: one repetition of
# Llama-3-8B's width at 2 layers draws 1.5e9 weights and runs five forwards.
GEOMETRY_REPETITIONS = 4

# The largest degree whose replicated-KV cells a floor measurement adds: the largest the
# harness checks (issue 13's full-width checks go up to 8; TOY's 8 heads stop there too).
REPLICATED_MAX_DEGREE = 8


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
    forward = conv.forward_layout(config, degree)
    if any(isinstance(spec.placement, HeadReplicated) for spec in forward.layout):
        if conv.name != "vllm":  # only vLLM's forward was measured replicated
            return f"{conv.name}-replicated-kv"
        return REPLICATED_KV
    experts = forward.experts
    if experts is not None and (experts.ep > 1 or experts.etp or forward.tp):
        return EXPERT_PARALLEL
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
                      tokens: torch.Tensor, phase: str = "1a") -> torch.Tensor:
    """``convention_logits`` of vLLM at ``degree`` reading the declared vLLM shards of
    ``params``: a replicated-KV cell's forward."""
    target = endpoint(f"vllm:{degree}")
    return convention_logits(target, config, materialize(target.pieces(config), params),
                             tokens, phase)


def stream_replicated_deviation(config: ModelConfig, degree: int, *, seed: int = 0,
                                dtype: torch.dtype | str = torch.float32,
                                progress: Callable[[Progress], None] | None = None
                                ) -> torch.Tensor:
    """|vLLM's forward at ``degree`` - reference logits|, streamed, flattened: one
    repetition of a replicated-KV cell at a width too large to hold whole. Per stage
    (``check.stream.stages``) the canonical parameters are drawn, the reference steps, the
    stage's declared vLLM tensors are cut, read through the reading plan and upcast, and the
    vLLM forward steps; the same draws and steps as ``check.convert.stream_convert``, so the
    same logits as ``replicated_logits`` bit for bit."""
    target = endpoint(f"vllm:{degree}")
    pieces = target.pieces(config)
    plan = reading_plan(target.convention, config, degree)
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference = ReferenceSteps(config, tokens)
    sharded = ShardedSteps.over(plan.forward.config, InProcessCollective(degree), tokens,
                                embedding=plan.forward.embedding)
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
    return (sharded.logits - reference.expected).abs().flatten()


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

    ``replicated``: also measure each config's replicated-KV cells (``replicated_degrees``
    up to ``max_degree``, ``"forward": REPLICATED_KV``; the same seeds, tokens and dtype,
    vLLM's forward in this process for phase 1a, over gloo for 1b), listed after its plain
    cells. Default: for the
    committed floors' configs (TOY and TOY_KV4, the default ``configs``: the measurement
    ``python -m weight_sync_bench.tolerance`` writes); a measurement of other ``configs``
    measures their plain cells unless asked.
    """
    if phase not in PHASES:
        raise ToleranceMismatch(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    weights = parse_dtype(dtype)
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
        layout = layout_for(config)
        for rep in range(repetitions):
            params = init_params(config, rep, dtype=weights)
            tokens = make_tokens(config, TOKEN_SEED_OFFSET + rep)
            reference = ReferenceModel(config, computing(params))(tokens)
            for t in degrees:
                if forward is not None:  # the declared shards in the synced dtype, upcast
                    shards = [computing(p) for p in split(params, layout, t)]
                    logits = forward(config, shards, tokens)
                elif runner is inprocess_runner:
                    logits = inprocess_runner(config, t, rep, TOKEN_SEED_OFFSET + rep, params)
                else:
                    logits = runner(config, t, rep, TOKEN_SEED_OFFSET + rep)
                deviations[t].append((logits - reference).abs().flatten().numpy())
                del logits
            for t in wide:  # vLLM's forward past n_kv_heads: each KV head on t / n_kv ranks
                logits = replicated_logits(config, params, t, tokens, phase)
                copies[t].append((logits - reference).abs().flatten().numpy())
                del logits
            del params, reference
            if progress is not None:
                progress(i * repetitions + rep + 1, len(configs) * repetitions,
                         f"{config.name} seed {rep + 1}/{repetitions}")
        cells += [record.cell(config.name, t, deviations[t]) for t in degrees]
        cells += [record.cell(config.name, t, copies[t], forward=REPLICATED_KV) for t in wide]
    return record.artifact(phase, configs, cells, repetitions, weights)


def measure_geometry(config: ModelConfig, *, phase: str = "1a", dtype: str = "fp32",
                     repetitions: int = GEOMETRY_REPETITIONS,
                     forward: Forward | None = None,
                     progress: Callable[[int, int, str], None] | None = None,
                     out: Path | None = None,
                     max_degree: int = REPLICATED_MAX_DEGREE) -> tuple[dict[str, Any], Path]:
    """Measure one geometry's floor, as the committed phase floors are measured (model
    seeds ``0..repetitions-1``, every supported degree, and vLLM's replicated-KV forward at
    every degree past ``n_kv_heads`` up to ``max_degree``, the running kernel set; phase 1a
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
        every = [(t, PLAIN_FORWARD) for t in layout_for(config).supported_degrees()] + [
            (t, REPLICATED_KV) for t in wide]

        def report(unit: int, rep: int, t: int, which: str) -> Callable[[Any], None] | None:
            if progress is None:
                return None
            what = "" if which == PLAIN_FORWARD else f" ({which})"
            return lambda p: progress(
                unit * p.stages + p.stage, len(every) * repetitions * p.stages,
                f"seed {rep + 1}/{repetitions}, t={t}{what}, {p.label}")

        deviation = {PLAIN_FORWARD: stream_deviation, REPLICATED_KV: stream_replicated_deviation}
        cells = [record.cell(config.name, t, [deviation[which](
                     config, t, seed=rep, dtype=dtype,
                     progress=report(j * repetitions + rep, rep, t, which)).numpy()
                     for rep in range(repetitions)], forward=which)
                 for j, (t, which) in enumerate(every)]
        artifact = record.artifact(phase, [config], cells, repetitions, parse_dtype(dtype))
    else:
        artifact = measure(phase, configs=[config], repetitions=repetitions, dtype=dtype,
                           forward=forward, replicated=True, max_degree=max_degree,
                           progress=progress)
    artifact = record.geometry_artifact(artifact, config, phase, dtype)
    path = out or cached_floor_path(config, phase, dtype)
    write_artifact(artifact, path)
    return artifact, path

"""The phase floors: the numerical deviation of correct sharded logits, measured.

``python -m weight_sync_bench.tolerance [--phase 1b]`` writes ``tolerance/phase<P>.json``:
per destination cell (config, t), over ``repetitions`` model and token seeds, the deviation
of the sharded logits from the reference in units of 2^-23. ``tolerance.rules`` derives the
threshold from it.

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
    dtype_name,
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
from weight_sync_bench.tolerance.artifacts import (
    PHASES,
    SCHEMA,
    environment,
    write_artifact,
)
from weight_sync_bench.tolerance.rules import (
    SAFETY,
    TOKEN_SEED_OFFSET,
    ULP,
    cached_floor_path,
    derive_threshold,
    geometry_key,
    geometry_record,
    numerics,
    threshold_from,
)

if TYPE_CHECKING:
    from weight_sync_bench.check.forwards import Forward
    from weight_sync_bench.model.sharded import RoutingGuard
    from weight_sync_bench.conventions import Convention, Endpoint

REPETITIONS = 20
# A per-geometry floor (a real width, measured on first use) takes fewer: one repetition of
# Llama-3-8B's width at 2 layers draws 1.5e9 weights and runs five forwards.
GEOMETRY_REPETITIONS = 4

PLAIN_FORWARD = "plain"  # the plain layout's sharded forward (a cell without a forward field)
REPLICATED_KV = "vllm-replicated-kv"  # vLLM's forward at t > n_kv_heads (HeadReplicated KV)
# An MoE forward whose experts sit whole on expert-parallel ranks (or over data-parallel
# replicas of the dense layers): its partial outputs are summed in another grouping than the
# plain layout's experts split over every rank
EXPERT_PARALLEL = "expert-parallel"
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


def cell_forward(cell: Mapping[str, Any]) -> str:
    """The forward a floor cell was measured on (``PLAIN_FORWARD`` where it names none)."""
    return str(cell.get("forward", PLAIN_FORWARD))


def measured_degrees(artifact: Mapping[str, Any], name: str, forward: str) -> list[int]:
    """The degrees at which ``artifact`` measured config ``name``'s ``forward``."""
    return sorted({int(c["degree"]) for c in artifact.get("cells", ())
                   if c.get("config") == name and cell_forward(c) == forward})


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
            max_degree: int = REPLICATED_MAX_DEGREE) -> dict[str, Any]:
    """Measure the floor per destination cell and return the artifact (not yet written).

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
    for config in configs:
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
        cells += [_cell(config.name, t, deviations[t]) for t in degrees]
        cells += [_cell(config.name, t, copies[t], forward=REPLICATED_KV) for t in wide]
    return _artifact(phase, configs, cells, repetitions, weights)


def _cell(name: str, degree: int, deviations: list[np.ndarray],
          forward: str = PLAIN_FORWARD) -> dict[str, Any]:
    """One destination cell's figures over its pooled per-logit deviations; a cell of
    another forward than the plain layout's names it (``forward``)."""
    pooled = np.concatenate(deviations).astype(np.float64)
    which = {} if forward == PLAIN_FORWARD else {"forward": forward}
    return {"config": name, "degree": degree, **which, "max_ulp": float(pooled.max() / ULP),
            "median_ulp": float(np.median(pooled) / ULP), "mean_ulp": float(pooled.mean() / ULP),
            "worst_abs": float(pooled.max()), "elements": int(pooled.size)}


def _artifact(phase: str, configs: list[ModelConfig], cells: list[dict[str, Any]],
              repetitions: int, weights: torch.dtype) -> dict[str, Any]:
    worst = max(cell["worst_abs"] for cell in cells)
    extra = {} if weights == torch.float32 else {
        "weights_dtype": dtype_name(weights), "compute_dtype": "fp32"}
    return {
        "schema": SCHEMA, "phase": phase, "unit": "2^-23", "repetitions": repetitions, **extra,
        "seeds": {"param": f"0..{repetitions - 1}",
                  "token": f"{TOKEN_SEED_OFFSET}..{TOKEN_SEED_OFFSET + repetitions - 1}"},
        "rule": f"smallest power of ten >= {SAFETY} x worst_abs",
        "configs": {c.name: {"geometry": c.geometry(), "token_shape": list(c.token_shape),
                             "numerics": numerics(c)} for c in configs},
        "cells": cells, "worst_abs": worst, "threshold": derive_threshold(worst),
        "environment": environment(),
    }


def format_table(artifact: dict[str, Any]) -> str:
    rows = [["cell", "max ULP", "median ULP", "mean ULP", "worst abs", "kernel set"]]
    for cell in artifact["cells"]:
        which = "" if cell_forward(cell) == PLAIN_FORWARD else f" ({cell_forward(cell)})"
        rows.append([f"{cell['config']}, t={cell['degree']}{which}", f"{cell['max_ulp']:.2f}",
                     f"{cell['median_ulp']:.3f}", f"{cell['mean_ulp']:.3f}",
                     f"{cell['worst_abs']:.4g}",
                     cell.get("kernel_set", artifact["environment"].get("cpu_capability", "?"))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"phase {artifact['phase']}: worst {artifact['worst_abs']:.4g}, "
                 f"threshold {threshold_from(artifact):g} ({artifact['rule']})")
    return "\n".join(lines)


def measure_geometry(config: ModelConfig, *, phase: str = "1a", dtype: str = "fp32",
                     repetitions: int = GEOMETRY_REPETITIONS,
                     forward: Forward | None = None,
                     progress: Callable[[str], None] | None = None,
                     out: Path | None = None,
                     max_degree: int = REPLICATED_MAX_DEGREE) -> tuple[dict[str, Any], Path]:
    """Measure one geometry's floor, as the committed phase floors are measured (model
    seeds ``0..repetitions-1``, every supported degree, and vLLM's replicated-KV forward at
    every degree past ``n_kv_heads`` up to ``max_degree``, the running kernel set; phase 1a
    streamed, so a real width fits: ``check.stream``, bit for bit the same logits), and cache
    it under ``tolerance_dir()/geometry/`` with its provenance and key
    (``tolerance.rules.floor_for`` reads it back): ``(artifact, path)``. Phase 1b needs
    ``forward`` (``check.forwards.gloo_forward()``). ``progress`` gets a line of text
    after each streamed stage (seed, degree, ``stream.Progress``)."""
    if phase != "1a" and forward is None:
        raise ToleranceMismatch(f"phase {phase} needs its own forward (the gloo one)")
    wide = replicated_degrees(config, max_degree)
    if phase == "1a":  # streamed: a real width is never held whole (check.stream)
        def report(rep: int, t: int, what: str = "") -> Callable[[Any], None] | None:
            if progress is None:
                return None
            return lambda p: progress(f"seed {rep + 1}/{repetitions}, t={t}{what}: {p}")

        cells = [_cell(config.name, t, [stream_deviation(config, t, seed=rep, dtype=dtype,
                                                         progress=report(rep, t)).numpy()
                                        for rep in range(repetitions)])
                 for t in layout_for(config).supported_degrees()]
        cells += [_cell(config.name, t, [stream_replicated_deviation(
                      config, t, seed=rep, dtype=dtype,
                      progress=report(rep, t, f" ({REPLICATED_KV})")).numpy()
                      for rep in range(repetitions)], forward=REPLICATED_KV)
                  for t in wide]
        artifact = _artifact(phase, [config], cells, repetitions, parse_dtype(dtype))
    else:
        artifact = measure(phase, configs=[config], repetitions=repetitions, dtype=dtype,
                           forward=forward, replicated=True, max_degree=max_degree)
    artifact.setdefault("weights_dtype", dtype)
    artifact["kind"] = "geometry"
    artifact["key"] = geometry_key(config, phase, dtype)
    artifact["record"] = geometry_record(config, phase, dtype)
    path = out or cached_floor_path(config, phase, dtype)
    write_artifact(artifact, path)
    return artifact, path

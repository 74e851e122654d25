"""Streamed checks: memory bounded by the largest parameter, not by the model.

``stream_check(config, dst, fn=..., src=..., per="layer")`` checks a split to ``dst`` (or a
reshard ``src -> dst``) with ``fn`` called once per stage (or parameter) with that stage's
tensors only: the pass of ``check.streaming`` (the draws, the two forwards stepped one
parameter at a time, the byte comparison as each parameter comes back), judged by the floor
``check_split`` reads (``check.threshold``). The verdict is the whole-model check's bit for
bit: the same draws, the same forward steps in the same order, the same byte comparison.

Phase 1a runs every rank in this process; ``backend="gloo"`` one process per rank (each
rank's RSS high-water mark comes back with ``stream_run``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weight_sync_bench.check.forwards import BACKENDS, gloo_forward
from weight_sync_bench.check.streaming import (
    PER,
    Progress,
    StageFn,
    largest_param_bytes,
    model_bytes,
    run_gloo,
    run_inprocess,
    stage_reshard,
    stage_split,
    stream_deviation,
    stream_task,
    units,
)
from weight_sync_bench.check.threshold import environment_notes, resolve_floor
from weight_sync_bench.check.verdict import Verdict
from weight_sync_bench.collectives.gloo.pool import RankPool
from weight_sync_bench.errors import InvalidNumber, UnsupportedLayout
from weight_sync_bench.model.config import ModelConfig, dtype_name, parse_dtype
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.stepwise import stages

# The streamed pass's names, importable from here as they always were.
__all__ = ["PER", "Progress", "StageFn", "largest_param_bytes", "model_bytes", "stage_reshard",
           "stage_split", "stages", "stream_check", "stream_deviation", "stream_run",
           "stream_task", "units"]


def stream_check(config: ModelConfig, dst: int, *, fn: StageFn | None = None,
                 src: int | None = None, per: str = "layer", seed: int = 0,
                 dtype: torch.dtype | str = torch.float32, threshold: float | None = None,
                 measure_floor: bool = False,
                 progress: Callable[[Progress], None] | None = None,
                 backend: str = "inprocess", pool: RankPool | None = None) -> Verdict:
    """The streamed check of a split to ``dst`` (``src`` None) or of a reshard ``src -> dst``
    from the declared split at ``src``; ``fn`` None checks the declared split or reshard
    itself (the bare cost of a streamed check). See the module docstring; ``progress`` is
    called after each stage (in process only). ``backend="gloo"``: one process per rank
    (``stream_task`` on ``pool``, else the shared pool), judged by the phase 1b floor."""
    return stream_run(config, dst, fn=fn, src=src, per=per, seed=seed, dtype=dtype,
                      threshold=threshold, measure_floor=measure_floor, progress=progress,
                      backend=backend, pool=pool)[0]


def stream_run(config: ModelConfig, dst: int, *, fn: StageFn | None = None,
               src: int | None = None, per: str = "layer", seed: int = 0,
               dtype: torch.dtype | str = torch.float32, threshold: float | None = None,
               measure_floor: bool = False,
               progress: Callable[[Progress], None] | None = None,
               backend: str = "inprocess", pool: RankPool | None = None
               ) -> tuple[Verdict, tuple[tuple[int, int], ...]]:
    """``stream_check``'s verdict and, under gloo, each rank's (RSS when its task began, its
    high-water mark after) in bytes (empty in process): what ``bench/bench_width.py``
    reports per rank."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: a streamed check runs "
                         f"{' or '.join(map(repr, BACKENDS))}")
    InvalidNumber.seed("seed", seed)
    if per not in PER:
        raise ValueError(f"per={per!r}: a streamed check calls fn per "
                         f"{' or per '.join(PER)}")
    weights = parse_dtype(dtype)
    layout = layout_for(config)
    layout.validate(dst)
    if src is not None:
        layout.validate(src)
    name = dtype_name(weights)
    notes: tuple[str, ...] = ()
    phase = "1b" if backend == "gloo" else "1a"
    if threshold is None:  # refused before anything is drawn
        floor = resolve_floor(config, phase, name, measure=measure_floor,
                              **({"forward": gloo_forward(pool)} if phase == "1b" else {}))
        threshold, notes = floor.threshold, environment_notes(floor, config, phase, name)
    if backend == "gloo":
        if config.n_experts:
            raise UnsupportedLayout(f"{config.name}: a streamed MoE check runs in process "
                                    "(phase 1a): the routing guard lives beside the reference "
                                    "on rank 0; check it whole over gloo, or streamed in process")
        run = run_gloo(config, dst, fn, src, per, seed, weights, pool)
    else:
        run = run_inprocess(config, layout, dst, fn, src, per, seed, weights, progress,
                            route_bound=threshold)
    error = float((run.logits - run.expected).abs().max())
    verdict = Verdict(config=config.name, src=src, dst=dst, max_abs_error=error,
                      threshold=threshold, first_mismatch=run.differ[0] if run.differ else None,
                      mismatches=tuple(run.differ), diagnosis=tuple(run.diagnosis),
                      own_forward=bool(run.differ), notes=(*notes, *config.notes), dtype=name,
                      named_mutation=run.named.mutation, named_meaning=run.named.meaning,
                      near_ties=run.near_ties,
                      route_bound=threshold if run.near_ties is not None else None)
    return verdict, run.rank_rss

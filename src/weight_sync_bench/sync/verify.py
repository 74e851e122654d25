"""Verification without gathering, and the rank side of a phase 2 check.

A destination rank recomputes what each of its boxes must hold from (parameter, canonical
index) (``values``: a counter-based generator), and compares its tensors bit for bit:
every element of every destination tensor, since the boxes tile them (padding: zero). No
rank, and not the parent, ever holds a full tensor for this.

Then the forward: the same plan reshards ``init_params``' values (whose floor the phase 1b
threshold was measured on; the generator's are other values), the destination ranks read
them as their framework does (``conventions.reading``) and run ``ShardedModel`` over
``GlooCollective``, and rank 0's logits are compared with the dense reference in the
parent, within ``threshold_for(config, "1b")``.

Rank-resident state: the pool's rank processes live across tasks, so a session loads each
rank's source shards once (``_HELD``) and runs many plans on them (the planner mutations),
each reshard one task of the job's world and each forward one task of the destination's
degree (the pool's prefix group). The functions run under ``torchrun`` as well
(``sync.torchrun``), with the job's own group.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync_bench.check.diagnosis import bit_equal, diagnose_layer, diagnose_rank
from weight_sync_bench.check.user_code import user_frames
from weight_sync_bench.collectives.gloo.collective import GlooCollective
from weight_sync_bench.conventions import reading_plan
from weight_sync_bench.memory import rss
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.sync.boxes import stored_boxes
from weight_sync_bench.sync.execute import (
    CountingP2P,
    Meter,
    ReshardFn,
    SyncContext,
    rss_reset,
)
from weight_sync_bench.sync.planner import ELEMENT_SIZE, Plan
from weight_sync_bench.sync.values import Source, fill, region_of

if TYPE_CHECKING:
    from weight_sync_bench.collectives.gloo.rank import RankContext
    from weight_sync_bench.model.sharded import RoutingGuard
    from weight_sync_bench.sync.layouts import SyncLayout

Params = dict[str, torch.Tensor]
_HELD: dict[str, dict[str, Any]] = {}  # per session key, on each rank process


def generated(layout: SyncLayout, rank: int, seed: Source) -> Params:
    """``rank``'s tensors of ``layout`` holding the generator's values (``expected``)."""
    if rank >= layout.world:
        return {}
    return {name: expected(layout, rank, name, seed) for name in layout.pieces[rank]}


def expected(layout: SyncLayout, rank: int, name: str, seed: Source) -> torch.Tensor:
    """What ``rank``'s stored tensor ``name`` must hold: each box of its selection, the
    canonical region from the generator (zeros in padding), stored as its convention stores
    it (``Piece.stacked``: vLLM's stacked experts member by member). Made from the stored
    tensor's own index map, not from the parts the executor addresses
    (``SyncLayout.members``), so a member written into another's place is seen."""
    piece = layout.pieces[rank][name]
    shape = layout.config.param_shapes()[piece.source]
    out = torch.zeros(piece.flat_shape(shape), dtype=torch.float32)
    for box in stored_boxes(rank, name, piece, shape).boxes:
        if box.source is None:
            continue
        region = [(0, size) for size in shape]
        region[box.dim] = (box.start, box.stop)
        fill(out.narrow(box.dim, box.offset, box.length), seed, box.source, shape, tuple(region))
    return piece.stacked(out)


@dataclass(frozen=True)
class ElementCheck:
    """One destination rank's bit-exact comparison: elements checked of its total, the stored
    tensors that differ (in the layout's order) and the diagnosis of the first of them (one
    line, ``check.diagnosis``'s, made after the timed region)."""

    rank: int
    checked: int
    total: int
    differ: tuple[str, ...]
    lines: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.differ and self.checked == self.total


def check_elements(plan: Plan, rank: int, out: Mapping[str, torch.Tensor], seed: Source
                   ) -> ElementCheck:
    """Compare ``rank``'s destination tensors with what their boxes must hold (``expected``),
    bit for bit
    (``bit_equal``: in slabs, no temporary as large as a tensor), then diagnose the first that
    differs as every check does (``check.diagnosis.diagnose_rank``): its one canonical
    parameter regenerated from the generator, each slice the rank holds matched to it. The
    structure (names, shapes, dtypes) has been validated (``structure_error``)."""
    layout = plan.dst
    if rank >= layout.world:
        return ElementCheck(rank, 0, 0, (), ())
    shapes = layout.config.param_shapes()
    checked = total = 0
    differ: list[str] = []
    for name, piece in layout.pieces[rank].items():
        want = expected(layout, rank, name, seed)
        flat = piece.flat_shape(shapes[piece.source])
        total += want.numel()
        checked += sum(b.length for b in stored_boxes(rank, name, piece, shapes[piece.source])
                       .boxes) * (math.prod(flat) // flat[piece.dim])
        if not bit_equal(out[name].cpu(), want):
            differ.append(name)
    lines: tuple[str, ...] = ()
    if differ:
        piece = layout.pieces[rank][differ[0]]
        shard = out[differ[0]].cpu()
        line = diagnose_layer(Regenerated(seed, shapes), layout.config, differ[0], rank,
                              piece, shard) or diagnose_rank(
            Regenerated(seed, shapes)[piece.source], layout.config, differ[0], rank, piece,
            shard)
        lines = (line,) if line is not None else ()
    return ElementCheck(rank, checked, total, tuple(differ), lines)


class Regenerated(Mapping[str, torch.Tensor]):
    """The canonical parameters, each regenerated from the generator when read (a
    diagnosis's: after the timed region, one at a time)."""

    def __init__(self, seed: Source, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.seed, self.shapes = seed, shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return region_of(self.seed, name, shape, tuple((0, n) for n in shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def first_difference(layout: SyncLayout, checks: Sequence[ElementCheck]
                     ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Every stored tensor that differs on some rank, in the layout's order, and the
    diagnosis of the first of them: the lines of the ranks where it differs (each rank
    diagnosed its own first, which is that one wherever it differs), as ``check_convert``
    diagnoses the same tensors."""
    order = {n: i for i, n in enumerate(dict.fromkeys(n for rank in layout.pieces for n in rank))}
    differ = tuple(sorted({n for e in checks for n in e.differ}, key=order.__getitem__))
    lines = tuple(line for e in checks if e.differ and e.differ[0] == differ[0]
                  for line in e.lines) if differ else ()
    return differ, lines


def structure_error(plan: Plan, rank: int, out: object) -> str | None:
    """Why ``out`` is not ``rank``'s destination tensors (names, shapes, dtypes), or None."""
    want = plan.dst.pieces[rank] if rank < plan.dst.world else {}
    where = f"{plan.dst} rank {rank}"
    if not isinstance(out, Mapping):
        return f"{where}: expected a dict of tensors, got {type(out).__name__}"
    missing = [n for n in want if n not in out]
    extra = sorted(str(n) for n in out if n not in want)
    if missing or extra:
        return (f"{where}: " + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                         + ([f"unexpected {', '.join(extra)}"] if extra else [])))
    shapes = plan.dst.config.param_shapes()
    for name, piece in want.items():
        x = out[name]
        if not isinstance(x, torch.Tensor):
            return f"{where} {name}: expected a Tensor, got {type(x).__name__}"
        shape = piece.local_shape(shapes[piece.source])
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            return (f"{where} {name}: {x.dtype} {list(x.shape)}, declared torch.float32 "
                    f"{list(shape)}")
    return None


# -- the rank side


def load(rank: int, key: str, src: SyncLayout, seed: Source, init: Params | None,
         device: str = "cpu") -> int:
    """Keep ``rank``'s source tensors for session ``key`` on ``device``: the generator's
    values (made here, box by box) and, for the forward, ``init`` (``init_params``' values,
    shipped)."""
    _HELD[key] = {name: {n: x.to(device) for n, x in shards.items()} for name, shards in
                  (("generated", generated(src, rank, seed)), ("init", init or {}))}
    return sum(x.numel() for x in _HELD[key]["generated"].values()) * ELEMENT_SIZE


def run_fn(fn: ReshardFn, ctx: SyncContext, rank: int, local: Mapping[str, torch.Tensor],
           plan: Plan) -> tuple[Any, dict[str, Any]]:
    """``fn(ctx, rank, local, plan)`` timed from a barrier of the whole job, with this rank's
    memory measured: the staging peak it reported (``ctx.meter``) and the kernel's RSS
    high-water mark above what the rank held before, less the destination tensors."""
    dist.barrier(group=ctx.group)
    reset = rss_reset()
    before = rss()
    started = time.perf_counter()
    error = None
    try:
        out = fn(ctx, rank, local, plan)
    except Exception as exc:  # noqa: BLE001 - the user's code: reported, framed, by the parent
        out, error = None, f"{type(exc).__name__}: {exc}\n{user_frames(exc.__traceback__)}"
    seconds = time.perf_counter() - started
    after = rss()
    held = sum(x.numel() * x.element_size() for x in out.values()
               if isinstance(x, torch.Tensor)) if isinstance(out, Mapping) else 0
    rss_extra = (after[1] - before[0] - held) if (reset and before and after) else None
    traffic = ctx.p2p.traffic
    return out, {"rank": rank, "seconds": seconds, "sent": dict(traffic.sent),
                 "received": dict(traffic.received), "messages": traffic.messages,
                 "staging_peak": ctx.meter.peak, "largest_buffer": ctx.meter.largest,
                 "rss_extra": rss_extra, "error": error}


def reshard(rank: int, world: int, group: Any, tracer: Any, *, key: str, plan: Plan,
            fn: ReshardFn, bucket_bytes: int, seed: Source, forward: bool,
            bandwidth: bool, device: str = "cpu", elements: bool = True) -> dict[str, Any]:
    """One plan on this rank: (calibrate), reshard the generator's values with ``fn`` and
    check them (unless ``elements=False``: the forward alone); reshard ``init_params``'
    values too when a forward follows (kept for it). The figures are the first reshard's."""
    held = _HELD.get(key)
    if held is None:
        raise LookupError(f"rank {rank}: no source shards loaded for session {key!r} (the rank "
                          "processes restarted since the session loaded them)")

    def context() -> SyncContext:
        return SyncContext(rank, world, group, CountingP2P(group, rank, tracer), Meter(),
                           bucket_bytes, device)

    record: dict[str, Any] = {"bandwidth": None}
    if bandwidth:
        from weight_sync_bench.sync.execute import calibrate
        record["bandwidth"] = calibrate(context())
    record["elements"] = None
    if elements:
        out, figures = run_fn(fn, context(), rank, held["generated"], plan)
        record.update(figures)
        if figures["error"] is None:
            record["structure"] = structure_error(plan, rank, out)
        if figures["error"] is None and record["structure"] is None:
            record["elements"] = check_elements(plan, rank, out, seed)
        del out
        if figures["error"] is not None or record["structure"] is not None:
            return record
    if forward:
        out, again = run_fn(fn, context(), rank, held["init"], plan)
        if not elements:
            record.update(again)
        record["forward_error"] = again["error"] or structure_error(plan, rank, out)
        held["out"] = out
    return record


def forward(rank: int, ctx: RankContext, *, key: str, plan: Plan, tokens: torch.Tensor,
            guard: RoutingGuard | None = None) -> torch.Tensor | None:
    """The destination forward on destination ranks ``0..degree-1``: the kept shards read
    as the destination framework reads them, ``ShardedModel`` over ``GlooCollective`` with
    the experts where the destination's forward layout places them (vLLM's EP: each rank's
    own experts whole). ``guard``: an MoE model's routing guard (the reference's choices
    where near-tied, ``model.sharded.RoutingGuard``), as every MoE check routes."""
    dst = plan.dst
    assert dst.convention is not None
    out = _HELD[key].pop("out")
    reading = reading_plan(dst.convention, dst.config, dst.at or dst.degree)
    inputs = {name: sel.apply(out) for name, sel in reading.ranks[rank].items()}
    model = ShardedModel(reading.forward.config, [inputs], GlooCollective(ctx),
                         embedding=reading.forward.embedding, experts=reading.forward.experts,
                         guard=guard)
    with torch.no_grad():
        (logits,) = model(tokens)
    return logits if rank == 0 else None


# -- tasks for the rank pool (module-level: picklable by reference)


def load_task(ctx: RankContext, *, key: str, src: SyncLayout, seed: Source,
              init: Params | None) -> int:
    ctx.tracer.mark("sync: load")
    return load(ctx.rank, key, src, seed, init)


def reshard_task(ctx: RankContext, **kwargs: Any) -> dict[str, Any]:
    ctx.tracer.mark("sync: reshard")
    return reshard(ctx.rank, ctx.degree, ctx.group, ctx.tracer, **kwargs)


def forward_task(ctx: RankContext, *, key: str, plan: Plan, tokens: torch.Tensor,
                 guard: RoutingGuard | None = None) -> torch.Tensor | None:
    ctx.tracer.mark("sync: forward")
    return forward(ctx.rank, ctx, key=key, plan=plan, tokens=tokens, guard=guard)


def drop_task(ctx: RankContext, *, key: str) -> None:
    _HELD.pop(key, None)

"""The streamed pass: memory bounded by the largest parameter, not by the model.

Parameters are drawn one at a time from the seed's generator in the forward's order
(``model.config.iter_params``), so each is made when the forward reaches it and dropped
after. The reference and the sharded forward advance one parameter at a time
(``model.stepwise``: ``ReferenceSteps`` and ``ShardedSteps``), and the pass takes the model in
units (``units``): a stage (the embedding, each layer, the final norm and head) with
``per="layer"``, one parameter with ``per="parameter"``. Per unit:

1. draw its full parameters; the reference takes their steps (fp32, from the synced
   values: each upcast only while its step reads it);
2. the user's shards: ``fn`` is called with the unit's parameters only, with the
   whole-model signature, ``fn(full, degree)`` for a split and ``fn(shards, dst)`` for a
   reshard (the declared split at ``src``, cut from the full tensor, which is then dropped):
   the dicts hold just that stage's (or parameter's) names, and are the harness's own
   tensors (an ``fn`` that writes into them is refused: they are what its output is
   compared with);
3. each parameter's bytes compared as soon as ``fn`` returns it, rank by rank against views
   of its declared slice (of the full tensor, or of the source shards for a reshard), the
   first that differs diagnosed while its full tensor is here; then its full tensor (or
   source shards) dropped;
4. the sharded forward takes the unit's steps on the user's shards (each upcast only while
   read), and everything is dropped; the freed heap is handed back (``memory.trim``: glibc
   keeps freed chunks under its mmap threshold, up to 32 MiB, which is a rank's shard at
   full width, resident otherwise).

The peak with ``per="parameter"`` is one parameter's: its full tensor (or source shards)
and the user's shards, 2x its bytes; or, while a forward reads it, the tensor and its fp32
upcast, 3x its bytes in bf16 or fp16 (1x in fp32, where nothing is upcast); plus
activations, never a layer's or the model's. ``per="layer"`` holds a stage: its full tensors
and the user's shards, 2x a layer, plus one parameter's upcast. A declared slice is
compared range by range against views, and the byte comparison works in slabs of a few MiB
(``diagnosis.bit_equal``). With tied embeddings the embedding (and its shards) stay, in
the synced dtype, until the head. The pass is the whole-model check's bit for bit: the
same draws, the same forward steps in the same order, the same byte comparison.

Phase 1a runs every rank in this process (``run_inprocess``). ``run_gloo`` runs one process
per rank (``stream_task``): rank 0 does steps 1-3 (the draws, the reference, ``fn`` and the
byte comparison) and ``GlooTransport`` scatters each stage's shards, so every other rank
holds only its own shards of one stage at a time and rank 0 what the in-process pass holds;
each rank's RSS high-water mark comes back with the run. ``progress`` is not called under
gloo (the stages run in the rank processes). The verdict, and the floor that judges it,
are ``check.stream``'s.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check.diagnosis import bit_equal, diagnose_plain
from weight_sync_bench.check.naming import (
    NONE,
    Named,
    Naming,
    layout_naming,
    observe_redrawn,
)
from weight_sync_bench.check.user_code import call_user
from weight_sync_bench.collectives.gloo.collective import GlooCollective
from weight_sync_bench.collectives.gloo.pool import RankPool, shared_pool
from weight_sync_bench.collectives.gloo.transport import GlooTransport, ParamSink
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.layout.reshard import (
    gather_tensor,
    reshard_pieces,
    reshard_tensor,
    split_tensor,
)
from weight_sync_bench.layout.table import LayoutTable, ShardSpec
from weight_sync_bench.memory import Peak, trim
from weight_sync_bench.model.config import (
    ModelConfig,
    dtype_name,
    iter_params,
    make_tokens,
    parse_dtype,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.routing import score_deviation
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.model.stepwise import ReferenceSteps, ShardedSteps, draw, stages
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

if TYPE_CHECKING:
    from weight_sync_bench.collectives.gloo.rank import RankContext

PER = ("layer", "parameter")
Params = dict[str, torch.Tensor]
# (a stage's full parameters, degree) -> per rank, that stage's shards; or
# (per rank, a stage's shards at src, dst) -> per rank, its shards at dst
StageFn = Callable[..., list[dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Progress:
    """After each stage: ``stage`` of ``stages`` done, its label (``"layers.3"``), the bytes
    of its full parameters, the seconds since the check began."""

    stage: int
    stages: int
    label: str
    bytes: int
    elapsed: float

    def __str__(self) -> str:
        return (f"stage {self.stage}/{self.stages} {self.label} ({self.bytes / 2**20:,.0f} MiB), "
                f"{self.elapsed:.1f} s")


def largest_param_bytes(config: ModelConfig, dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of the model's largest parameter in ``dtype``: what the streamed peak scales by."""
    size = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    return max(_numel(s) for s in config.param_shapes().values()) * size


def model_bytes(config: ModelConfig, dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of the whole model in ``dtype``: what a whole-model check holds at least once."""
    return config.n_params * torch.empty((), dtype=parse_dtype(dtype)).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def stage_split(layout: LayoutTable) -> StageFn:
    """The declared split written per parameter, the shape of a streamed ``fn``: works on a
    dict of any subset of ``layout``'s names (one parameter, one layer, or all)."""
    def fn(full: Params, degree: int) -> list[Params]:
        out: list[Params] = [{} for _ in range(degree)]
        for name, x in full.items():
            for rank, shard in enumerate(split_tensor(x, layout[name], degree)):
                out[rank][name] = shard
        return out
    return fn


def stage_reshard(layout: LayoutTable) -> StageFn:
    """The declared reshard written per parameter (``reshard_tensor``), for any subset."""
    def fn(shards: list[Params], dst: int) -> list[Params]:
        out: list[Params] = [{} for _ in range(dst)]
        for name in shards[0]:
            for rank, shard in enumerate(reshard_tensor([s[name] for s in shards],
                                                        layout[name], dst)):
                out[rank][name] = shard
        return out
    return fn


def stream_deviation(config: ModelConfig, dst: int, *, seed: int = 0,
                     dtype: torch.dtype | str = torch.float32,
                     progress: Callable[[Progress], None] | None = None,
                     route: list[float] | None = None) -> torch.Tensor:
    """|sharded - reference logits| of the declared split at ``dst``, streamed, flattened: one
    repetition of a phase floor measurement at a width too large to hold whole. An MoE
    forward takes the reference's choice on every token (the floor of the continuous part);
    ``route`` (when given) gets the largest selection-score deviation its own choices made."""
    layout = layout_for(config)
    layout.validate(dst)
    run = run_inprocess(config, layout, dst, None, None, "layer", seed, parse_dtype(dtype),
                        progress)
    if route is not None:
        route.append(run.route_deviation)
    return (run.logits - run.expected).abs().flatten()


@dataclass
class Found:
    """What the byte comparison finds as the pass goes: the parameters that differ (draw
    order), the first one's diagnosis, and the catalogue's candidates (``check.naming``)
    narrowed on every parameter from the first that differs on; ``before``: the parameters
    compared equal before it, on which ``observe_redrawn`` narrows them after the pass."""

    naming: Naming
    differ: list[str] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    before: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, config: ModelConfig, layout: LayoutTable, dst: int,
           weights: torch.dtype) -> Found:
        return cls(layout_naming(config, layout, dst, weights))

    def compared(self, name: str, same: bool) -> bool:
        """Record that ``name``'s shards are the declared ones (``same``) or not; True where
        the caller is to narrow the candidates on them (``naming.observe``): from the first
        difference on, while any is left."""
        if not same:
            self.differ.append(name)
        if not self.differ:
            self.before.append(name)
        return bool(self.differ) and not self.naming.done

    def named(self, config: ModelConfig, layout: LayoutTable, dst: int, seed: int,
              weights: torch.dtype) -> Named:
        """The mutations the shards are exactly, once the pass is over: the candidates left,
        narrowed on the parameters before the first difference too (``observe_redrawn``)."""
        if not self.differ:
            return NONE
        observe_redrawn(self.naming, self.before, config, layout, dst, seed, weights)
        return self.naming.named()


@dataclass
class StreamRun:
    """What a streamed pass found: the parameters that differ (draw order), the first one's
    diagnosis, the mutations the shards are exactly, the two forwards' logits."""

    differ: list[str]
    diagnosis: list[str]
    named: Named
    logits: torch.Tensor  # rank 0's sharded logits
    expected: torch.Tensor  # the reference's
    # per rank under gloo: (RSS when its task began, its high-water mark after), bytes
    rank_rss: tuple[tuple[int, int], ...] = ()
    near_ties: tuple[int, int] | None = None  # an MoE model's (``RoutingGuard.near_ties``)
    route_deviation: float = 0.0  # an MoE model's (``model.routing.score_deviation``)


def units(names: list[str], per: str) -> list[list[str]]:
    """A stage's parameters as the check takes them: all at once (``per="layer"``) or one at
    a time (``per="parameter"``), in draw order. Each unit is drawn, stepped by the reference,
    handed to ``fn``, compared and stepped by the sharded forward before the next is drawn."""
    return [names] if per == "layer" else [[n] for n in names]


def drawn_units(config: ModelConfig, seed: int, weights: torch.dtype, per: str,
                reference: ReferenceSteps, progress: Callable[[Progress], None] | None
                ) -> Iterator[tuple[list[str], Params]]:
    """Step 1 of the pass: each unit (``units``) in draw order, its full parameters drawn in
    ``weights`` and taken by ``reference``: ``(unit, full)``. The caller empties ``full`` as
    it goes (the next unit is drawn when it asks for it); ``progress`` after each stage."""
    draws = iter_params(config, seed, dtype=weights)
    started, plan = time.perf_counter(), stages(config)
    for k, (label, names) in enumerate(plan):
        size = 0
        for unit in units(names, per):
            full = draw(draws, unit)
            size += sum(x.numel() * x.element_size() for x in full.values())
            reference.take(unit, full)
            yield unit, full
            del full
        if progress is not None:
            progress(Progress(k + 1, len(plan), label, size, time.perf_counter() - started))


def run_inprocess(config: ModelConfig, layout: LayoutTable, dst: int, fn: StageFn | None,
                  src: int | None, per: str, seed: int, weights: torch.dtype,
                  progress: Callable[[Progress], None] | None, *,
                  route_bound: float = math.inf) -> StreamRun:
    """The streamed forwards and byte comparison (the module docstring's steps 1-4); an MoE
    model's routing guard at ``route_bound`` (``check.checker``)."""
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference = ReferenceSteps(config, tokens)
    guard = RoutingGuard(reference.model.routings, route_bound) if config.n_experts else None
    sharded = ShardedSteps.over(config, InProcessCollective(dst), tokens, guard=guard)
    found = Found.of(config, layout, dst, weights)
    with torch.no_grad():
        for unit, full in drawn_units(config, seed, weights, per, reference, progress):
            out = _stage_shards(fn, config, layout, full, unit, dst, src, weights,
                                found)  # drops each full tensor once compared
            del full
            sharded.take(unit, out)
            del out
        named = found.named(config, layout, dst, seed, weights)
    assert sharded.logits is not None and reference.expected is not None
    return StreamRun(found.differ, found.diagnosis, named, sharded.logits, reference.expected,
                     near_ties=None if guard is None else guard.near_ties(),
                     route_deviation=score_deviation(sharded.model.routings,
                                                     reference.model.routings))


def run_gloo(config: ModelConfig, dst: int, fn: StageFn | None, src: int | None, per: str,
             seed: int, weights: torch.dtype, pool: RankPool | None) -> StreamRun:
    """The streamed check with one process per rank (phase 1b): ``stream_task`` on ranks
    0..dst-1 of ``pool`` (else the process's shared pool)."""
    if fn is not None:
        try:
            pickle.dumps(fn)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"a streamed check over gloo runs fn {fn!r} on rank 0, so it must "
                            f"be picklable by reference (a module-level function): {exc}"
                            ) from exc
    kwargs = {"config": config, "fn": fn, "src": src, "per": per, "seed": seed,
              "dtype": dtype_name(weights)}
    outcomes = (pool or shared_pool(max(4, dst))).run(stream_task, dst, kwargs=kwargs)
    first = outcomes[0]
    return StreamRun(first["differ"], first["diagnosis"], first["named"], first["logits"],
                     first["expected"], tuple(o["rss"] for o in outcomes))


def stream_task(ctx: RankContext, *, config: ModelConfig, fn: StageFn | None,
                src: int | None, per: str, seed: int, dtype: str) -> dict[str, object]:
    """The rank side of a streamed check over gloo. Rank 0 does what ``run_inprocess`` does in
    one process (draws each stage, steps the reference, calls ``fn`` and compares its bytes),
    then ``GlooTransport`` scatters the stage's shards, and every rank steps the sharded
    forward over ``GlooCollective`` on its own shards of that stage only and drops them. A
    refusal on rank 0 (``fn`` raising, a wrong shape) is broadcast before any shard moves,
    so every rank stops at the same stage and the caller gets rank 0's error. Each rank
    reports its RSS when the task began and its high-water mark since (``memory.Peak``)."""
    peak = Peak()
    weights = parse_dtype(dtype)
    layout, dst = layout_for(config), ctx.degree
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    sharded = ShardedSteps.over(config, GlooCollective(ctx), tokens)
    reference = ReferenceSteps(config, tokens) if ctx.rank == 0 else None
    draws = iter_params(config, seed, dtype=weights) if ctx.rank == 0 else None
    found = Found.of(config, layout, dst, weights)
    with torch.no_grad():
        for _, names in stages(config):
            for unit in units(names, per):
                sink = ParamSink()
                transport = GlooTransport(ctx, LayoutTable(tuple(layout[n] for n in unit)),
                                          dtype=weights)
                if reference is not None and draws is not None:
                    full = draw(draws, unit)
                    reference.take(unit, full)
                    transport.sync(lambda full=full, unit=unit: _stage_shards(
                        fn, config, layout, full, unit, dst, src, weights, found),
                        sink)  # called now, inside sync: a refusal is broadcast
                    del full
                else:
                    transport.sync(None, sink)
                local = [dict(sink)]
                del sink
                # the transport marked its own phase: a hang from here on is the forward's
                ctx.tracer.mark("forward")
                sharded.take(unit, local)
        named = found.named(config, layout, dst, seed, weights) if ctx.rank == 0 else NONE
    rss = (peak.began, peak.high())
    if ctx.rank != 0:
        return {"rss": rss}
    return {"differ": found.differ, "diagnosis": found.diagnosis, "named": named,
            "logits": sharded.logits,
            "expected": reference.expected if reference is not None else None, "rss": rss}


def declared_shard(mine: torch.Tensor, full: torch.Tensor, spec: ShardSpec, degree: int,
              rank: int) -> bool:
    """Whether ``mine`` is rank ``rank``'s declared shard of ``full``, byte for byte
    (``shard_of``'s), compared range by range against views of ``full``: a fused tensor's
    slice (``[Q_r | K_r | V_r]``, ``[gate_r | up_r]``) is never copied whole to compare it."""
    dim, ranges = spec.ranges(degree, rank)
    if mine.dim() <= dim or mine.shape[dim] != sum(b - a for a, b in ranges):
        return False  # not the declared shape (a validated fn cannot get here)
    at = 0
    for start, stop in ranges:
        if not bit_equal(mine.narrow(dim, at, stop - start), full.narrow(dim, start, stop - start)):
            return False
        at += stop - start
    return True


def _stage_shards(fn: StageFn | None, config: ModelConfig, layout: LayoutTable, full: Params,
                  group: list[str], dst: int, src: int | None, weights: torch.dtype,
                  found: Found) -> list[Params]:
    """Per rank, the shards at ``dst`` of ``group`` (a stage's parameters, or one of them):
    the declared ones when ``fn`` is None, else what ``fn`` returns for them, checked as
    shards. Each parameter's bytes are compared as soon as ``fn`` returns (``found``: the first
    that differs diagnosed, the catalogue narrowed from it on), and its full tensor (and
    source shards) dropped from ``full`` then."""
    given: Params | list[Params]
    if src is None:
        given = {n: full[n] for n in group}
    else:  # the source shards; the full tensor is not needed past its split
        given = [{} for _ in range(src)]
        for n in group:
            for rank, shard in enumerate(split_tensor(full.pop(n), layout[n], src)):
                given[rank][n] = shard
    if fn is None:  # the declared split, or the declared reshard of the src shards
        moved = {n: split_tensor(full[n], layout[n], dst) if src is None
                 else reshard_tensor([g[n] for g in given], layout[n], dst)  # type: ignore[index]
                 for n in group}
        result = [{n: moved[n][rank] for n in group} for rank in range(dst)]
        del moved
    else:
        sub = LayoutTable(tuple(layout[n] for n in group))
        what = "splitting" if src is None else f"resharding {src} -> {dst}"
        role = "splitter" if src is None else "resharder"
        # fn gets the harness's tensors, not copies, compared with its output next: one that
        # writes into them fails in ``call`` (ModifiedInput), before any comparison
        result = call_user(fn, (given, dst), role=role, config=config,
                           during=f"while {what} {config.name} ({', '.join(group)})",
                           layout=sub, degree=dst, dtypes=weights)
    for n in group:
        mine = [r[n] for r in result]
        spec = layout[n]
        if src is None:  # each rank range by range against views of the full tensor
            same = all(declared_shard(m, full[n], spec, dst, rank) for rank, m in enumerate(mine))
        else:  # against views of the source shards that hold its declared slice
            held = [g[n] for g in given]  # type: ignore[index]
            dim = spec.ranges(dst, 0)[0]
            same = all(bit_equal(m.narrow(dim, at, piece.shape[dim]), piece)
                       for rank, m in enumerate(mine)
                       for at, piece in reshard_pieces(held, spec, dst, rank))
        if found.compared(n, same):  # the declared shards, for the catalogue's candidates
            declared = (split_tensor(full[n], spec, dst) if src is None
                        else reshard_tensor(held, spec, dst))
            found.naming.observe(n, declared, mine, differs=not same)
            del declared
        if not same and len(found.differ) == 1:
            whole = full[n] if src is None else gather_tensor(held, spec)
            found.diagnosis.extend(diagnose_plain(whole, config, spec, mine))
        if src is None:
            del full[n]
        else:
            del held
            for g in given:  # type: ignore[union-attr]
                del g[n]
    del given
    trim()  # the source shards (and fn's own temporaries) are dropped
    return [dict(r) for r in result]  # the forward empties them as it reads each

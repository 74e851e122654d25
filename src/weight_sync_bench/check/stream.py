"""Streamed checks: memory bounded by the largest parameter, not by the model.

Parameters are drawn one at a time from the seed's generator in the forward's order
(``model.config.iter_params``), so each is made when the forward reaches it and dropped
after. The reference and the sharded forward advance one parameter at a time
(``ReferenceModel.begin / step / finish``, the same steps for ``ShardedModel``: each step
reads one parameter), and the check takes the model in units (``units``): a stage (the
embedding, each layer, the final norm and head) with ``per="layer"``, one parameter with
``per="parameter"``. Per unit:

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
(``diagnosis._bit_equal``). With tied embeddings the embedding (and its shards) stay, in
the synced dtype, until the head. The verdict is the whole-model check's bit for bit: the
same draws, the same forward steps in the same order, the same byte comparison.

Phase 1a runs every rank in this process. ``backend="gloo"`` runs one process per rank
(``stream_task``): rank 0 does steps 1-3 (the draws, the reference, ``fn`` and the byte
comparison) and ``GlooTransport`` scatters each stage's shards, so every other rank holds
only its own shards of one stage at a time and rank 0 what the in-process check holds; each
rank's RSS high-water mark comes back with the verdict (``stream_run``). ``progress`` is not
called under gloo (the stages run in the rank processes).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check.checker import Verdict, environment_notes, resolve_floor
from weight_sync_bench.check.diagnosis import _bit_equal, diagnose
from weight_sync_bench.check.floor import computing
from weight_sync_bench.check.forwards import BACKENDS, gloo_forward
from weight_sync_bench.check.user_code import call_user, describe
from weight_sync_bench.collectives.gloo.collective import GlooCollective
from weight_sync_bench.collectives.gloo.pool import RankPool, shared_pool
from weight_sync_bench.collectives.gloo.transport import GlooTransport, ParamSink
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import InvalidNumber, UserCodeError
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
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

if TYPE_CHECKING:
    from weight_sync_bench.collectives.gloo.rank import RankContext
    from weight_sync_bench.conventions.reading import ReadingPlan

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


def stages(config: ModelConfig) -> list[tuple[str, list[str]]]:
    """The forward's stages and the parameters each reads, in the order they are drawn:
    ``embedding``, ``layers.0`` ... ``layers.{n-1}``, ``head`` (the final norm, and lm_head
    unless tied: the tied head reads the embedding, kept from the first stage)."""
    names = list(config.param_shapes())
    out: list[tuple[str, list[str]]] = [("embedding", ["tok_embeddings.weight"])]
    for i in range(config.n_layers):
        out.append((f"layers.{i}", [n for n in names if n.startswith(f"layers.{i}.")]))
    out.append(("head", [n for n in ("norm.weight", "lm_head.weight") if n in names]))
    assert [n for _, group in out for n in group] == names, "stages must follow the draw order"
    return out


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
        run = _run_gloo(config, dst, fn, src, per, seed, weights, pool)
    else:
        run = _run(config, layout, dst, fn, src, per, seed, weights, progress)
    error = float((run.logits - run.expected).abs().max())
    verdict = Verdict(config=config.name, src=src, dst=dst, max_abs_error=error,
                      threshold=threshold, first_mismatch=run.differ[0] if run.differ else None,
                      mismatches=tuple(run.differ), diagnosis=tuple(run.diagnosis),
                      own_forward=bool(run.differ), notes=notes, dtype=name)
    return verdict, run.rank_rss


def stream_deviation(config: ModelConfig, dst: int, *, seed: int = 0,
                     dtype: torch.dtype | str = torch.float32,
                     progress: Callable[[Progress], None] | None = None) -> torch.Tensor:
    """|sharded - reference logits| of the declared split at ``dst``, streamed, flattened: one
    repetition of a phase floor measurement at a width too large to hold whole."""
    layout = layout_for(config)
    layout.validate(dst)
    run = _run(config, layout, dst, None, None, "layer", seed, parse_dtype(dtype), progress)
    return (run.logits - run.expected).abs().flatten()


@dataclass
class _Run:
    differ: list[str]
    diagnosis: list[str]
    logits: torch.Tensor  # rank 0's sharded logits
    expected: torch.Tensor  # the reference's
    # per rank under gloo: (RSS when its task began, its high-water mark after), bytes
    rank_rss: tuple[tuple[int, int], ...] = ()


def units(names: list[str], per: str) -> list[list[str]]:
    """A stage's parameters as the check takes them: all at once (``per="layer"``) or one at
    a time (``per="parameter"``), in draw order. Each unit is drawn, stepped by the reference,
    handed to ``fn``, compared and stepped by the sharded forward before the next is drawn."""
    return [names] if per == "layer" else [[n] for n in names]


class _Reference:
    """The reference forward, taking parameters in draw order (a stage's, or one at a time):
    each is upcast to fp32 only while its step reads it. A tied head reads the embedding,
    kept (in the synced dtype) from the first stage."""

    def __init__(self, config: ModelConfig, tokens: torch.Tensor) -> None:
        self.config, self.tokens = config, tokens
        self.model = ReferenceModel(config, {})
        self.last = config.head_params[-1]
        self.tied: torch.Tensor | None = None
        self.expected: torch.Tensor | None = None

    def take(self, names: list[str], full: Params) -> None:
        """The steps that read ``names`` (the next parameters in draw order) from ``full``."""
        for n in names:
            given = {n: full[n]}
            if n == "norm.weight" and self.tied is not None:
                given["tok_embeddings.weight"] = self.tied
            self.model.params = computing(given)
            if n == "tok_embeddings.weight":
                self.state = self.model.begin(self.tokens)
                if self.config.tie_embeddings:
                    self.tied = full[n]
            else:
                self.model.step(self.state, n)
            self.model.params = {}
            del given
        if self.last in names:
            self.expected = self.model.finish(self.state)


class _Sharded:
    """The sharded forward (``model``: over ``InProcessCollective``, every rank's shards
    here; over ``GlooCollective``, this rank's), taking its local ranks' shards in draw order
    (a stage's, or one parameter's), each upcast only while its step reads it; a tied head
    reads the embedding shards kept from the first stage. A conversion's forward is the
    destination's (``reading_plan``'s config and embedding)."""

    def __init__(self, model: ShardedModel, tokens: torch.Tensor) -> None:
        self.config, self.tokens, self.model = model.config, tokens, model
        self.local = len(model.shards)
        self.last = self.config.head_params[-1]
        self.tied: list[torch.Tensor] | None = None
        self.logits: torch.Tensor | None = None

    @classmethod
    def over(cls, config: ModelConfig, collective: InProcessCollective | GlooCollective,
             tokens: torch.Tensor) -> _Sharded:
        return cls(ShardedModel(config, [{} for _ in collective.ranks], collective), tokens)

    @classmethod
    def reading(cls, plan: ReadingPlan, degree: int, tokens: torch.Tensor) -> _Sharded:
        """A destination convention's forward in process (``reading_plan``'s config and
        embedding placement): what a streamed conversion steps."""
        return cls(ShardedModel(plan.forward.config, [{} for _ in range(degree)],
                                InProcessCollective(degree), embedding=plan.forward.embedding),
                   tokens)

    def take(self, names: list[str], shards: list[Params]) -> None:
        """The steps that read ``names`` from ``shards`` (per local rank), which are emptied
        as each is read: a parameter's shards in the synced dtype are dropped once upcast."""
        for n in names:
            given = [o.pop(n) for o in shards]
            self.model.shards = [computing({n: x}) for x in given]
            if n == "norm.weight" and self.tied is not None:
                for s, table in zip(self.model.shards, self.tied):
                    s["tok_embeddings.weight"] = computing({n: table})[n]
            if n == "tok_embeddings.weight":
                self.state = self.model.begin(self.tokens)
                if self.config.tie_embeddings:
                    self.tied = given
            else:
                self.model.step(self.state, n)
            self.model.shards = [{} for _ in range(self.local)]
            del given
        if self.last in names:
            self.logits = self.model.finish(self.state)[0]
        trim()  # the unit's shards are dropped: glibc would keep those under 32 MiB resident


def _run(config: ModelConfig, layout: LayoutTable, dst: int, fn: StageFn | None,
         src: int | None, per: str, seed: int, weights: torch.dtype,
         progress: Callable[[Progress], None] | None) -> _Run:
    """The streamed forwards and byte comparison (the module docstring's steps 1-4)."""
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference = _Reference(config, tokens)
    sharded = _Sharded.over(config, InProcessCollective(dst), tokens)
    draws = iter_params(config, seed, dtype=weights)
    differ: list[str] = []
    diagnosis: list[str] = []
    started, plan = time.perf_counter(), stages(config)
    with torch.no_grad():
        for k, (label, names) in enumerate(plan):
            size = 0
            for unit in units(names, per):
                full = _draw(draws, unit)
                size += sum(x.numel() * x.element_size() for x in full.values())
                reference.take(unit, full)
                out = _stage_shards(fn, config, layout, full, unit, dst, src, weights,
                                    differ, diagnosis)  # drops each full tensor once compared
                del full
                sharded.take(unit, out)
                del out
            if progress is not None:
                progress(Progress(k + 1, len(plan), label, size,
                                  time.perf_counter() - started))
    assert sharded.logits is not None and reference.expected is not None
    return _Run(differ, diagnosis, sharded.logits, reference.expected)


def _run_gloo(config: ModelConfig, dst: int, fn: StageFn | None, src: int | None, per: str,
              seed: int, weights: torch.dtype, pool: RankPool | None) -> _Run:
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
    return _Run(first["differ"], first["diagnosis"], first["logits"], first["expected"],
                tuple(o["rss"] for o in outcomes))


def stream_task(ctx: RankContext, *, config: ModelConfig, fn: StageFn | None,
                src: int | None, per: str, seed: int, dtype: str) -> dict[str, object]:
    """The rank side of a streamed check over gloo. Rank 0 does what ``_run`` does in one
    process (draws each stage, steps the reference, calls ``fn`` and compares its bytes),
    then ``GlooTransport`` scatters the stage's shards, and every rank steps the sharded
    forward over ``GlooCollective`` on its own shards of that stage only and drops them. A
    refusal on rank 0 (``fn`` raising, a wrong shape) is broadcast before any shard moves,
    so every rank stops at the same stage and the caller gets rank 0's error. Each rank
    reports its RSS when the task began and its high-water mark since (``memory.Peak``)."""
    peak = Peak()
    weights = parse_dtype(dtype)
    layout, dst = layout_for(config), ctx.degree
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    sharded = _Sharded.over(config, GlooCollective(ctx), tokens)
    reference = _Reference(config, tokens) if ctx.rank == 0 else None
    draws = iter_params(config, seed, dtype=weights) if ctx.rank == 0 else None
    differ: list[str] = []
    diagnosis: list[str] = []
    with torch.no_grad():
        for label, names in stages(config):
            ctx.tracer.mark(f"stream {label}")
            for unit in units(names, per):
                sink = ParamSink()
                transport = GlooTransport(ctx, LayoutTable(tuple(layout[n] for n in unit)),
                                          dtype=weights)
                if reference is not None and draws is not None:
                    full = _draw(draws, unit)
                    reference.take(unit, full)
                    transport.sync(lambda full=full, unit=unit: _stage_shards(
                        fn, config, layout, full, unit, dst, src, weights, differ,
                        diagnosis), sink)  # called now, inside sync: a refusal is broadcast
                    del full
                else:
                    transport.sync(None, sink)
                local = [dict(sink)]
                del sink
                sharded.take(unit, local)
    rss = (peak.began, peak.high())
    if ctx.rank != 0:
        return {"rss": rss}
    return {"differ": differ, "diagnosis": diagnosis, "logits": sharded.logits,
            "expected": reference.expected if reference is not None else None, "rss": rss}


def _draw(draws: Iterator[tuple[str, torch.Tensor]], names: list[str]) -> Params:
    full = {}
    for want in names:
        got, x = next(draws)
        assert got == want, f"drawn {got}, the stage reads {want}"
        full[got] = x
    return full


def _declared(mine: torch.Tensor, full: torch.Tensor, spec: ShardSpec, degree: int,
              rank: int) -> bool:
    """Whether ``mine`` is rank ``rank``'s declared shard of ``full``, byte for byte
    (``shard_of``'s), compared range by range against views of ``full``: a fused tensor's
    slice (``[Q_r | K_r | V_r]``, ``[gate_r | up_r]``) is never copied whole to compare it."""
    dim, ranges = spec.ranges(degree, rank)
    if mine.dim() <= dim or mine.shape[dim] != sum(b - a for a, b in ranges):
        return False  # not the declared shape (a validated fn cannot get here)
    at = 0
    for start, stop in ranges:
        if not _bit_equal(mine.narrow(dim, at, stop - start), full.narrow(dim, start, stop - start)):
            return False
        at += stop - start
    return True


def _stage_shards(fn: StageFn | None, config: ModelConfig, layout: LayoutTable, full: Params,
                  group: list[str], dst: int, src: int | None, weights: torch.dtype,
                  differ: list[str], diagnosis: list[str]) -> list[Params]:
    """Per rank, the shards at ``dst`` of ``group`` (a stage's parameters, or one of them):
    the declared ones when ``fn`` is None, else what ``fn`` returns for them, checked as
    shards. Each parameter's bytes are compared as soon as ``fn`` returns (``differ``; the
    first that differs diagnosed into ``diagnosis``), and its full tensor (and source shards)
    dropped from ``full`` then."""
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
        inputs = list(given.values()) if isinstance(given, dict) else [
            x for g in given for x in g.values()]
        versions = [x._version for x in inputs]  # fn gets the harness's tensors, not copies
        result = call_user(fn, (given, dst), role=role, config=config,
                           during=f"while {what} {config.name} ({', '.join(group)})",
                           layout=sub, degree=dst, dtypes=weights)
        changed = [x._version for x in inputs] != versions
        del inputs  # it holds the full tensors (or source shards) too
        if changed:  # they are compared with the output next: refuse
            raise UserCodeError(f"your {role} `{describe(fn)}` wrote into the tensors it "
                                f"was given ({', '.join(group)}) while {what} "
                                f"{config.name}: a streamed check hands fn its own "
                                "tensors, not copies; return new ones", role=role,
                                function=describe(fn))
    for n in group:
        mine = [r[n] for r in result]
        spec = layout[n]
        if src is None:  # each rank range by range against views of the full tensor
            same = all(_declared(m, full[n], spec, dst, rank) for rank, m in enumerate(mine))
        else:  # against views of the source shards that hold its declared slice
            held = [g[n] for g in given]  # type: ignore[index]
            dim = spec.ranges(dst, 0)[0]
            same = all(_bit_equal(m.narrow(dim, at, piece.shape[dim]), piece)
                       for rank, m in enumerate(mine)
                       for at, piece in reshard_pieces(held, spec, dst, rank))
        if not same:
            differ.append(n)
            if len(differ) == 1:
                whole = full[n] if src is None else gather_tensor(held, spec)
                diagnosis.extend(diagnose(whole, spec, mine))
        if src is None:
            del full[n]
        else:
            del held
            for g in given:  # type: ignore[union-attr]
                del g[n]
    del given
    trim()  # the source shards (and fn's own temporaries) are dropped
    return [dict(r) for r in result]  # the forward empties them as it reads each

"""Phase 2, parent side: ``check_distributed_reshard`` and the session it runs in.

``SyncSession(config, src, dst)`` plans ``src -> dst`` (both covers validated first), loads
every rank's source shards onto the rank pool once (the generator's values, made on the
rank; ``init_params``' values, cut here, where the reference is computed anyway), then
``run(fn)`` reshards with ``fn`` on every rank and returns a ``SyncResult``: the element
check of every destination rank, the destination forward against the reference, and the
figures counted at the transport, beside ``B_min``, the naive gather-then-scatter bytes and
``T_min`` (from a bandwidth calibrated in the same task, when asked).

``run(fn, into="existing")`` reshards into destination tensors that already exist on the
ranks (allocated once per session, filled before every run, outside the timed region, with
stale values that differ from the right ones in every element), as an inference engine's
loaded weights exist when a sync arrives; ``fn`` gets them as ``ctx.destination``.
``into="fresh"`` (the default, what ``wsb sync`` runs unless told otherwise) leaves the
allocation to ``fn``, inside the timed region. ``calibrate_pattern()`` measures the
bandwidth of the plan's own wire pattern at its own concurrency.

The resharder's signature (``ReshardFn``)::

    fn(ctx: SyncContext, rank: int, local_shards: dict[str, Tensor], plan: Plan)
        -> dict[str, Tensor]   # rank's destination tensors ({} past the destination's world)

run on every rank of a job of ``max(src.world, dst.world)`` ranks; ``ctx.p2p`` is the
counting transport, ``ctx.group`` the job's gloo group, ``plan.dst.pieces[rank]`` what the
rank must return (the harness's ``execute_plan`` is one such ``fn``).
"""

from __future__ import annotations

import itertools
import os
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from weight_sync_bench.check.checker import Verdict
from weight_sync_bench.check.conversion import require_cell
from weight_sync_bench.check.threshold import environment_notes
from weight_sync_bench.check.weights import held_weights, weights_threshold
from weight_sync_bench.collectives.gloo.pool import RankPool, shared_pool
from weight_sync_bench.conventions import materialize
from weight_sync_bench.errors import (
    FloorNotMeasured,
    InvalidShards,
    InvalidUserShards,
    UserCodeError,
)
from weight_sync_bench.model.config import ModelConfig, init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.model.stepwise import computing
from weight_sync_bench.sync.execute import (
    DEFAULT_BUCKET,
    CountingP2P,
    Meter,
    ReshardFn,
    SyncContext,
    calibrate_pattern,
    execute_plan,
)
from weight_sync_bench.sync.layouts import SyncLayout, sync_layout
from weight_sync_bench.sync.minimum import minimum_bytes, naive_bytes, time_bound
from weight_sync_bench.sync.planner import ELEMENT_SIZE, Plan, plan_for
from weight_sync_bench.sync.values import Source, WeightValues
from weight_sync_bench.sync.verify import (
    ElementCheck,
    drop_task,
    first_difference,
    forward_task,
    generated,
    load_task,
    reshard_task,
)
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, floor_for

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from weight_sync_bench.collectives.gloo.rank import RankContext

PHASE = "2"
INTO = ("fresh", "existing")  # where a run's destination tensors live: SyncSession.run's into
_sessions = itertools.count()
Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures of one reshard, counted at its transport and by its meter."""

    rank: int
    sent: int
    received: int
    messages: int
    seconds: float
    staging_peak: int  # bytes of staging alive at once (the resharder's own report)
    largest_buffer: int
    rss_extra: int | None  # the kernel's high-water mark above the inputs, less the outputs


@dataclass(frozen=True)
class SyncResult:
    """What one reshard did and whether it is right. ``verdict`` is None when no forward
    ran (an element check only: ``forward=False``, or a destination with no TP forward)."""

    plan: Plan
    fn: str
    b_min: int
    naive: int
    ranks: tuple[RankFigures, ...]
    elements: tuple[ElementCheck, ...]
    bandwidth: float | None
    largest_param: int
    verdict: Verdict | None = None
    notes: tuple[str, ...] = field(default=())
    into: str = "fresh"  # the destination storage: INTO
    writes: tuple[str, ...] = ()  # the harness executor's plan: Plan.writes (empty: once each)

    @property
    def bytes_moved(self) -> int:
        return sum(r.sent for r in self.ranks)

    @property
    def ratio(self) -> float:
        """Bytes counted at the transport over ``B_min`` (1.0 when both are zero)."""
        return self.bytes_moved / self.b_min if self.b_min else float(self.bytes_moved == 0)

    @property
    def seconds(self) -> float:
        return max(r.seconds for r in self.ranks)

    @property
    def t_min(self) -> float | None:
        """``T_min`` at the bandwidth calibrated between one pair (``calibrate=True``)."""
        return self.bound(self.bandwidth) if self.bandwidth else None

    def bound(self, bandwidth: float) -> float:
        """``max over ranks of max(sent, received) / bandwidth``: ``T_min`` at another
        calibrated bandwidth (``SyncSession.calibrate_pattern``'s)."""
        return time_bound([r.sent for r in self.ranks], [r.received for r in self.ranks],
                          bandwidth)

    @property
    def sent_balance(self) -> float | None:
        """max / mean of the bytes sent, over the ranks that send anything."""
        senders = [r.sent for r in self.ranks if r.sent]
        return max(senders) / statistics.mean(senders) if senders else None

    @property
    def elements_passed(self) -> bool:
        """Every destination rank's element check passed (False when none ran)."""
        return bool(self.elements) and all(e.passed for e in self.elements)

    @property
    def coverage(self) -> float:
        total = sum(e.total for e in self.elements)
        return sum(e.checked for e in self.elements) / total if total else 1.0

    @property
    def passed(self) -> bool:
        """The element check (where it ran) and the forward (where it ran) passed, and at
        least one of them ran."""
        checked = self.elements_passed if self.elements else self.verdict is not None
        return checked and not self.writes and (self.verdict is None or self.verdict.passed)

    def summary(self) -> str:
        p = self.plan
        mutation = f", mutation {p.mutation}" if p.mutation else ""
        head = (f"{'PASS' if self.passed else 'FAIL'} {p.src.config.name} {p.src} -> {p.dst} "
                f"(phase {PHASE}, {self.fn}{mutation})")
        lines = [head]
        lines.append(f"  bytes between ranks {self.bytes_moved} (counted at the transport), "
                     f"B_min {self.b_min}: {self.ratio:.3f}x; naive gather-then-scatter "
                     f"{self.naive} ({self.naive / self.b_min if self.b_min else 0:.2f}x B_min)")
        storage = (", into existing destination storage" if self.into == "existing" else "")
        if self.t_min:
            lines.append(f"  time {self.seconds * 1e3:.1f} ms{storage}, T_min "
                         f"{self.t_min * 1e3:.1f} ms ({self.seconds / self.t_min:.2f}x) at "
                         f"{self.bandwidth / 1e9:.2f} GB/s calibrated gloo p2p")
        else:
            lines.append(f"  time {self.seconds * 1e3:.1f} ms{storage}")
        balance = self.sent_balance
        lines.append(f"  plan built in {p.build_seconds * 1e3:.2f} ms; bytes sent max/mean "
                     f"{balance:.3f}" if balance else
                     f"  plan built in {p.build_seconds * 1e3:.2f} ms; nothing to send")
        lines.append(f"  largest full parameter {self.largest_param} bytes")
        lines.append("  rank  sent      received  messages  staging peak  RSS extra")
        for r in self.ranks:
            extra = "-" if r.rss_extra is None else str(r.rss_extra)
            lines.append(f"  {r.rank:<4}  {r.sent:<8}  {r.received:<8}  {r.messages:<8}  "
                         f"{r.staging_peak:<12}  {extra}")
        checked = sum(e.checked for e in self.elements)
        if self.elements:
            lines.append(f"  element check: {checked} elements on {len(self.elements)} "
                         f"destination ranks, {self.coverage:.0%} coverage, "
                         + ("bit-exact" if self.elements_passed else "DIFFERENT"))
        else:
            lines.append("  element check: not run (the forward alone)")
        lines += [f"    {line}" for line in first_difference(p.dst, self.elements)[1]]
        if self.writes:
            lines.append(f"  coverage: the plan writes {self.writes[0]}")
            lines += [f"    {line}" for line in self.writes[1:]]
        if self.verdict is not None:
            lines += ["  " + line for line in str(self.verdict).splitlines()]
        shown = self.verdict.notes if self.verdict is not None else ()
        lines += [f"  note: {n}" for n in self.notes if n not in shown]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


class SyncSession:
    """A source and a destination layout of one (config, seed), loaded on a rank pool once
    for many ``run``s (``fn``s, plans, mutated plans). Use as a context manager."""

    def __init__(self, config: ModelConfig, src: str | SyncLayout, dst: str | SyncLayout, *,
                 seed: int = 0, dp: int = 1, pool: RankPool | None = None,
                 forward: bool = True, threshold: float | None = None,
                 weights: str | Path | None = None) -> None:
        self.config = config
        # the values moved: the generator's of ``seed``, or the user's weights (``weights``,
        # a checkpoint directory each rank reads its own regions from, in float32)
        self.seed: Source = seed if weights is None else WeightValues(str(weights), config)
        self.src = src if isinstance(src, SyncLayout) else sync_layout(config, src, dp=dp)
        self.dst = dst if isinstance(dst, SyncLayout) else sync_layout(config, dst)
        # the whole model in this process only for the forward's reference (and the
        # threshold measured on it); the element check reads regions on the ranks
        held = (computing(held_weights(weights, config))
                if weights is not None and forward and self.dst.runs_forward else None)
        self.plan = plan_for(self.src, self.dst)  # validates both covers before anything moves
        self.world = self.plan.world
        self.forward = forward and self.dst.runs_forward
        self.notes: tuple[str, ...] = ()
        if forward and not self.forward:
            self.notes = (no_forward(self.dst),)
        self.threshold = threshold
        self.reference: torch.Tensor | None = None
        self.guard: RoutingGuard | None = None
        self.tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
        init = None
        if self.forward and self.threshold is None and held is not None:
            # never a floor of the seed's weights: measured on these, over gloo as the
            # destination forward runs (its declared shards' forward, token seeds 1000-1003)
            self.threshold, note = weights_threshold(config, [self.dst.at], held, None, "1b")
            self.notes += (note,)
        elif self.forward and self.threshold is None:
            # FloorNotMeasured where no phase 1b floor covers the geometry; where one does
            # but has no cell of the destination's forward at its degree (vLLM's expert-
            # parallel forward), the elements are checked and a note says why no forward ran
            floor = floor_for(config, "1b")  # committed, or measured for this geometry
            try:
                require_cell(floor, config, self.dst.at)
            except FloorNotMeasured as exc:
                self.forward = False
                self.notes += (f"no forward: {exc}",)
            else:
                self.threshold = floor.threshold
                self.notes += environment_notes(floor, config, "1b", "fp32")
        if self.forward:
            full = held if held is not None else init_params(config, seed)
            model = ReferenceModel(config, full)
            with torch.no_grad():
                self.reference = model(self.tokens)
            if config.n_experts:  # top-k routing: the reference's choice where near-tied
                self.guard = RoutingGuard(model.routings, self.threshold)
            init = materialize(list(self.src.pieces), full)
            del full, held
        self.pool = pool or shared_pool(self.world)
        if self.pool.size < self.world:
            raise ValueError(f"SyncSession: the pool has {self.pool.size} ranks, the job needs "
                             f"{self.world} ({self.plan.label})")
        self.key = f"{os.getpid()}-{next(_sessions)}"
        self.pool.run(load_task, self.world, kwargs={"key": self.key, "src": self.src,
                                                     "seed": self.seed},
                      rank_kwargs=[{"init": init[r] if init and r < len(init) else None}
                                   for r in range(self.world)])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.pool.running:
            self.pool.run(drop_task, self.world, kwargs={"key": self.key})
            if self._existing:
                self.pool.run(drop_existing_task, self.world, kwargs={"key": self.key})

    _existing = False  # whether a run has allocated existing destination storage on the ranks

    def run(self, fn: ReshardFn = execute_plan, plan: Plan | None = None, *,
            bucket_bytes: int = DEFAULT_BUCKET, calibrate: bool = False,
            forward: bool | None = None, elements: bool = True,
            into: str = "fresh") -> SyncResult:
        """Reshard with ``fn`` (the harness's executor by default) on ``plan`` (the session's,
        or a mutated one), check every destination element (unless ``elements=False``: the
        forward alone, its figures those of the ``init_params`` reshard) and, unless
        ``forward=False``, run the destination forward against the reference.

        ``into`` (``INTO``): ``"fresh"``, the default: ``fn`` allocates the destination
        tensors inside the timed region (``ctx.destination`` is None). ``"existing"``: every
        destination rank's tensors already exist, as an inference engine's loaded weights
        do when a sync arrives: allocated once per session and, before every run (outside
        the timed region), filled with stale values that differ from what the sync must
        write in every element's lowest bit (``stale_values``: the previous step's weights,
        as near as they can be without being right; zero padding is stale too). ``fn`` gets
        them as ``ctx.destination`` and writes into them in place; what it returns instead
        is copied into them, timed, as an engine copies a loaded tensor into its parameter.
        So an element the sync does not write fails the bit-exact check.

        The plan's cut into messages (``Plan.messages(bucket_bytes)``) and each rank's local
        copy runs (``Plan.local_runs``), cached on the plan (``Plan.prepare``), are made here,
        once per plan and bucket, and reach the ranks with the plan, as a
        cached plan is reused sync after sync: the ranks' timed region does not recompute
        it (Python, on every rank, of the order of T_min for the larger plans:
        ``bench/bench_sync.py``'s staging table runs with it and without)."""
        if into not in INTO:
            raise ValueError(f"SyncSession.run: into={into!r}, expected one of {INTO}")
        if not elements and not (self.forward if forward is None else forward):
            raise ValueError("SyncSession.run: elements=False needs the forward")
        plan = plan or self.plan
        run_forward = self.forward if forward is None else (forward and self.forward)
        name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        plan.prepare(bucket_bytes)  # the plan's cut and runs, cached on it: the ranks get them
        writes = plan.writes() if fn is execute_plan else ()  # the plan the executor runs
        if into == "existing":
            self.pool.run(existing_task, self.world, kwargs={"key": self.key, "plan": plan,
                                                             "seed": self.seed})
            self._existing = True
            fn = InPlace(fn, self.key)
        records = self.pool.run(reshard_task, self.world, kwargs={
            "key": self.key, "plan": plan, "fn": fn, "bucket_bytes": bucket_bytes,
            "seed": self.seed, "forward": run_forward, "bandwidth": calibrate,
            "elements": elements})
        raise_user_errors(records, name, plan)
        verdict = None
        if run_forward:
            logits = self.pool.run(forward_task, self.dst.degree, kwargs={
                "key": self.key, "plan": plan, "tokens": self.tokens, "guard": self.guard})[0]
            assert self.reference is not None and self.threshold is not None
            verdict = judge(plan, logits, self.reference, self.threshold, records, self.notes)
        return replace(collect(plan, name, records, verdict, self.notes, into=into),
                       writes=writes)

    def calibrate_pattern(self, plan: Plan | None = None, *, bucket_bytes: int = DEFAULT_BUCKET,
                          repeats: int = 3) -> PatternBandwidth:
        """The bandwidth of ``plan``'s own wire pattern at its own concurrency
        (``execute.calibrate_pattern``: every rank at once, the executor's shift steps,
        messages and exchanges, warm buffers), beside ``run(calibrate=True)``'s one pair."""
        plan = plan or self.plan
        plan.prepare(bucket_bytes)
        records = self.pool.run(pattern_task, self.world, kwargs={
            "plan": plan, "bucket_bytes": bucket_bytes, "repeats": repeats})
        return PatternBandwidth(records[0]["bandwidth"], records[0]["seconds"],
                                tuple(r["sent"] for r in records),
                                tuple(r["received"] for r in records),
                                tuple(r["messages"] for r in records))


@dataclass(frozen=True)
class PatternBandwidth:
    """``SyncSession.calibrate_pattern``'s figures: the bandwidth (bytes per second: the
    busiest rank's max(sent, received) over ``seconds``), the best replay's slowest rank's
    ``seconds``, and each rank's bytes and sends per replay, counted at its transport."""

    bandwidth: float
    seconds: float
    sent: tuple[int, ...]
    received: tuple[int, ...]
    messages: tuple[int, ...]


def collect(plan: Plan, name: str, records: Sequence[dict[str, Any]], verdict: Verdict | None,
            notes: tuple[str, ...], *, into: str = "fresh") -> SyncResult:
    """A ``SyncResult`` from every rank's record (``verify.reshard``), rank order. Into
    existing storage, the destination tensors were resident before the reshard began, so
    the RSS growth ``run_fn`` reports (which subtracts them as if allocated during it) gets
    them back."""
    shapes = plan.src.config.param_shapes()
    held = [_stored_bytes(plan, r["rank"]) if into == "existing" else 0 for r in records]
    ranks = tuple(RankFigures(r["rank"], sum(r["sent"].values()), sum(r["received"].values()),
                              r["messages"], r["seconds"], r["staging_peak"],
                              r["largest_buffer"],
                              None if r["rss_extra"] is None else r["rss_extra"] + extra)
                  for r, extra in zip(records, held, strict=True))
    elements = tuple(r["elements"] for r in records
                     if r["rank"] < plan.dst.world and r["elements"] is not None)
    return SyncResult(plan, name, minimum_bytes(plan.src, plan.dst), naive_bytes(plan.src, plan.dst),
                      ranks, elements, records[0]["bandwidth"],
                      4 * max(torch.Size(s).numel() for s in shapes.values()), verdict, notes,
                      into)


def _stored_bytes(plan: Plan, rank: int) -> int:
    if rank >= plan.dst.world:
        return 0
    shapes = plan.dst.config.param_shapes()
    return ELEMENT_SIZE * sum(torch.Size(p.local_shape(shapes[p.source])).numel()
                              for p in plan.dst.pieces[rank].values())


# -- existing destination storage, on the ranks (module-level: picklable by reference)

_EXISTING: dict[str, dict[str, Any]] = {}  # per session key: "layout", "storage", "stale"


def no_forward(dst: SyncLayout) -> str:
    """The note of a sync whose destination runs no forward (``SyncLayout.runs_forward``)."""
    return (f"no forward: {dst} is not a TP inference layout (FSDP, pipeline stages or experts "
            "over more ranks than TP): its elements are checked")


def stale_values(plan: Plan, rank: int, seed: Source) -> Params:
    """What ``rank``'s existing destination tensors hold before a run into them: the values
    the sync must write (``verify.generated``: the generator's, zero padding) with the
    lowest bit of every element flipped, so that every element differs from its expected
    bits, by as little as a float can."""
    out = generated(plan.dst, rank, seed)
    for x in out.values():
        x.view(torch.int32).bitwise_xor_(1)
    return out


def existing_task(ctx: RankContext, *, key: str, plan: Plan, seed: Source) -> int:
    """Allocate this rank's destination tensors for session ``key`` once (again if the
    destination layout changed) and fill them with ``stale_values``; their bytes."""
    ctx.tracer.mark("sync: existing storage")
    held = _EXISTING.get(key)
    if held is None or held["layout"] != plan.dst.key:
        stale = stale_values(plan, ctx.rank, seed)
        held = {"layout": plan.dst.key, "stale": stale,
                "storage": {n: torch.empty_like(x) for n, x in stale.items()}}
        _EXISTING[key] = held
    for name, x in held["storage"].items():
        x.copy_(held["stale"][name])
    return sum(x.numel() * x.element_size() for x in held["storage"].values())


def drop_existing_task(ctx: RankContext, *, key: str) -> None:
    _EXISTING.pop(key, None)


@dataclass(frozen=True)
class InPlace:
    """``fn`` run into session ``key``'s existing destination tensors: they are
    ``ctx.destination``, and the result is always them (a tensor ``fn`` returns in their
    stead is copied into them; a result of another structure is returned as it is, for
    ``verify.structure_error`` to name)."""

    fn: ReshardFn
    key: str

    def __call__(self, ctx: SyncContext, rank: int, local: Mapping[str, torch.Tensor],
                 plan: Plan) -> Any:
        held = _EXISTING.get(self.key)
        if held is None:
            raise LookupError(f"rank {rank}: no existing destination storage for session "
                              f"{self.key!r} (the rank processes restarted since it was made)")
        storage = held["storage"]
        ctx.destination = storage
        out = self.fn(ctx, rank, local, plan)
        if not isinstance(out, dict) or set(out) != set(storage) or any(
                not isinstance(out[n], torch.Tensor) or out[n].shape != x.shape
                or out[n].dtype != x.dtype for n, x in storage.items()):
            return out
        # Every tensor returned in a storage tensor's stead is read before any is written: one
        # may be another storage tensor (two returned under each other's names) or a view of
        # its own (a transpose), and copying into it first would overwrite what is still to
        # be read, or refuse (torch will not copy between overlapping memory).
        held = {x.untyped_storage().data_ptr() for x in storage.values()}
        moved = {}
        for name, x in storage.items():
            y = out[name]
            if not (y.data_ptr() == x.data_ptr() and y.stride() == x.stride()):
                moved[name] = y.clone() if y.untyped_storage().data_ptr() in held else y
        for name, y in moved.items():
            storage[name].copy_(y)
        return dict(storage)


def pattern_task(ctx: RankContext, *, plan: Plan, bucket_bytes: int, repeats: int
                 ) -> dict[str, Any]:
    ctx.tracer.mark("sync: calibrate pattern")
    sync = SyncContext(ctx.rank, ctx.degree, ctx.group, CountingP2P(ctx.group, ctx.rank,
                                                                    ctx.tracer), Meter(),
                       bucket_bytes)
    return calibrate_pattern(sync, plan, repeats)


def judge(plan: Plan, logits: torch.Tensor, reference: torch.Tensor, threshold: float,
          records: Sequence[dict[str, Any]], notes: tuple[str, ...]) -> Verdict:
    """The verdict: the destination forward's max |logits - reference| within ``threshold``
    and every destination element bit-exact (the first tensor that differs, diagnosed)."""
    src, dst = plan.src, plan.dst
    error = float((logits - reference).abs().max())
    checked = [r["elements"] for r in records
               if r["rank"] < dst.world and r["elements"] is not None]
    differ, diagnosis = first_difference(dst, checked)
    return Verdict(config=src.config.name, src=src.degree, dst=dst.degree,
                   max_abs_error=error, threshold=threshold,
                   first_mismatch=differ[0] if differ else None, mismatches=differ,
                   diagnosis=diagnosis,
                   phase=PHASE, mutation=plan.mutation, own_forward=True,
                   conventions=(_named(src), _named(dst)), notes=notes)


def _named(side: SyncLayout) -> str:
    """How a verdict names a side: its whole endpoint, else its convention's name."""
    return str(side.endpoint) if side.endpoint is not None else side.label.split(":")[0]


def raise_user_errors(records: Sequence[dict[str, Any]], name: str, plan: Plan) -> None:
    for r in records:
        if r["error"] is not None:
            raise UserCodeError(f"your resharder {name} raised on rank {r['rank']} during "
                                f"{plan.label}: {r['error']}", role="resharder", function=name,
                                user_traceback=r["error"])
        problem = r.get("structure") or r.get("forward_error")
        if problem is not None:
            raise InvalidUserShards(f"your resharder {name} returned what is not the "
                                    f"destination's tensors: {problem}", role="resharder",
                                    function=name)


def run_distributed_reshard(fn: ReshardFn, config: ModelConfig, src: str, dst: str, *,
                            seed: int = 0, dp: int = 1, pool: RankPool | None = None,
                            bucket_bytes: int = DEFAULT_BUCKET, forward: bool = True,
                            threshold: float | None = None, calibrate: bool = False,
                            into: str = "fresh", weights: str | Path | None = None
                            ) -> SyncResult:
    """One session, one run: ``SyncSession(...).run(fn, into=into)`` (``weights``: a
    checkpoint directory whose weights are moved instead of the seed's values)."""
    with SyncSession(config, src, dst, seed=seed, dp=dp, pool=pool, forward=forward,
                     threshold=threshold, weights=weights) as session:
        return session.run(fn, bucket_bytes=bucket_bytes, calibrate=calibrate, into=into)


def check_distributed_reshard(fn: ReshardFn, config: ModelConfig, src: str, dst: str, *,
                              seed: int = 0, dp: int = 1, pool: RankPool | None = None,
                              threshold: float | None = None,
                              weights: str | Path | None = None) -> Verdict:
    """The verdict on a distributed resharder ``fn(ctx, rank, local_shards, plan) -> dst
    local shards`` from ``src`` (``"megatron:4"``, ``"fsdp:4"``, ``dp`` replicas) to ``dst``
    (``"vllm:2"``): every destination element bit-exact (``first_mismatch`` names the first
    tensor that differs) and the destination forward within the phase 1b threshold.
    ``weights``: a checkpoint directory (HF or Megatron, ``read_weights``): its weights are
    what moves, in float32, each rank reading its own regions; the threshold is measured
    on them over gloo, never a floor of the seed's."""
    result = run_distributed_reshard(fn, config, src, dst, seed=seed, dp=dp, pool=pool,
                                     threshold=threshold, weights=weights)
    if result.verdict is None:
        raise InvalidShards(f"{dst}: no forward to judge a verdict by (not a TP inference "
                            "layout); use run_distributed_reshard for the element check")
    return result.verdict

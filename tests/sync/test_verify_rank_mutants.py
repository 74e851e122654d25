"""Phase 2's rank side read exactly, in process (issue 30's mutation testing of
``sync/verify.py``): ``load``, ``run_fn``, ``reshard``, ``forward`` and the pool's tasks,
called for each rank directly, as a rank process calls them, with stand-ins for what a
rank has: a recording tracer, a group that is a token (``dist.barrier`` and
``execute.calibrate`` replaced by recorders), ``rss`` / ``rss_reset`` / the clock scripted,
and, for the forward, a collective over threads (one per rank, the ``Collective``
protocol's all-reduce / all-gather / reduce-scatter) in place of ``GlooCollective``.

Pinned: what a rank keeps per session (the generator's source shards, made on the rank,
and the ``init_params`` shards shipped, on ``device``) and the bytes it reports; the record
``reshard`` returns (the first reshard's figures, the structure error or the element check,
the forward's error, the bandwidth), when it stops early (the user's code raised, or
returned other tensors than the destination's: nothing after it runs), which source
tensors each reshard gets and which context; ``run_fn``'s figures, RSS arithmetic
(``VmHWM`` after less ``VmRSS`` before less the returned tensors' bytes, None without the
kernel's counters) and the user's error as ``raise_user_errors`` reports it; the forward's
logits on rank 0 alone, equal to the convention's own in-process forward
(``conventions.reading.forward_model``: the embedding and the experts as the destination's
forward layout places them, the routing guard followed) and within float32 rounding of the
dense ``ReferenceModel``. ``test_verify.py`` runs the same over gloo ranks."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tests.sync.conftest import MOE_FEW, forced_guard, tiny
from weight_sync_bench.collectives.gloo.rank import RankContext
from weight_sync_bench.conventions import reading_plan
from weight_sync_bench.conventions.maps import materialize
from weight_sync_bench.conventions.reading import forward_model
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.sync import execute, plan_for, sync_layout, verify
from weight_sync_bench.sync.execute import CountingP2P, Meter, SyncContext
from weight_sync_bench.sync.planner import ELEMENT_SIZE
from weight_sync_bench.sync.verify import (
    _HELD,
    ElementCheck,
    drop_task,
    forward,
    forward_task,
    generated,
    load,
    load_task,
    reshard,
    reshard_task,
    run_fn,
    structure_error,
)

SEED = 7
GROUP = object()  # the job's process group: a token, passed through
QKV = "model.layers.0.self_attn.qkv_proj.weight"  # vLLM's fused qkv


class Tracer:
    """A rank's tracer: the phases it was told it is in (what a watchdog's report names)."""

    def __init__(self) -> None:
        self.marks: list[str] = []

    def mark(self, phase: str) -> None:
        self.marks.append(phase)


@pytest.fixture
def barriers(monkeypatch):
    """Every ``dist.barrier`` call's group."""
    seen: list[object] = []
    monkeypatch.setattr(verify.dist, "barrier", lambda group=None: seen.append(group))
    return seen


@pytest.fixture
def held():
    """``_HELD`` is per rank process; here one process plays every rank: keys are cleared."""
    before = set(_HELD)
    yield _HELD
    for key in set(_HELD) - before:
        del _HELD[key]


@pytest.fixture(scope="module")
def sync():
    """megatron:2 -> vllm:2 of a tiny model, its ``init_params`` and each side's shards."""
    config = tiny(2)
    plan = plan_for(sync_layout(config, "megatron:2"), sync_layout(config, "vllm:2"))
    full = init_params(config, SEED)
    return SimpleNamespace(config=config, plan=plan, full=full,
                           init=materialize(list(plan.src.pieces), full),
                           init_dst=materialize(list(plan.dst.pieces), full))


class Resharder:
    """A correct resharder without a wire: what each rank must return, made from the whole
    (the generator's destination tensors for the generator's sources, ``init_params``' for
    theirs), so that what ``reshard`` does with it is all that is tested. Records each
    call's arguments; ``faults`` replaces a call's result by kind ("generated" / "init")."""

    def __init__(self, sync, key: str, **faults) -> None:
        self.sync, self.key, self.faults = sync, key, faults
        self.calls: list[tuple] = []
        self.results: list[object] = []

    def __call__(self, ctx, rank, local, plan):
        self.calls.append((ctx, rank, local, plan))
        source = _HELD[self.key]
        kind = ("generated" if local is source["generated"] else
                "init" if local is source["init"] else "other")
        assert kind != "other", "reshard handed the resharder other tensors than it keeps"
        ctx.meter.hold({"generated": 100, "init": 200}[kind])  # which run the figures are
        out = ({n: x.clone() for n, x in generated(plan.dst, rank, SEED).items()}
               if kind == "generated" else
               {n: x.clone() for n, x in self.sync.init_dst[rank].items()}
               if rank < plan.dst.world else {})
        fault = self.faults.get(kind)
        if fault is not None:
            out = fault(out)
        self.results.append(out)
        return out


def _raise(out):
    raise ValueError("rank cannot reshard")


def _drop(out):
    return {n: x for n, x in out.items() if n != QKV}


# -- load, load_task, drop_task


def test_load_keeps_the_generators_source_shards_and_the_shipped_init_per_session(sync, held):
    src = sync.plan.src
    nbytes = load(1, "s", src, SEED, sync.init[1])
    want = generated(src, 1, SEED)
    got = held["s"]
    assert set(got) == {"generated", "init"} and list(got["generated"]) == list(want)
    assert all(torch.equal(got["generated"][n], x) for n, x in want.items())
    assert all(torch.equal(got["init"][n], x) for n, x in sync.init[1].items())
    assert list(got["init"]) == list(sync.init[1])
    # the bytes of the generator's shards, an int (what the session reports as held)
    assert type(nbytes) is int and nbytes == ELEMENT_SIZE * sum(x.numel() for x in want.values())
    assert not torch.equal(got["generated"][next(iter(want))],
                           generated(src, 0, SEED)[next(iter(want))])  # rank 1's, not 0's
    # no init (no forward): an empty dict; a device: every tensor kept there
    load(0, "t", src, SEED, None, device="meta")
    assert held["t"]["init"] == {}
    assert {x.device.type for x in held["t"]["generated"].values()} == {"meta"}


def test_load_task_marks_the_phase_and_loads_the_ranks_own_shards(sync, held):
    tracer = Tracer()
    ctx = RankContext(rank=1, degree=2, group=GROUP, tracer=tracer)
    nbytes = load_task(ctx, key="s", src=sync.plan.src, seed=SEED, init=sync.init[1])
    assert tracer.marks == ["sync: load"]
    want = generated(sync.plan.src, 1, SEED)
    assert all(torch.equal(held["s"]["generated"][n], x) for n, x in want.items())
    assert list(held["s"]["init"]) == list(sync.init[1])
    assert nbytes == ELEMENT_SIZE * sum(x.numel() for x in want.values())


def test_drop_task_forgets_that_session_only_and_a_second_drop_is_harmless(sync, held):
    ctx = RankContext(rank=0, degree=2, group=GROUP, tracer=Tracer())
    load(0, "a", sync.plan.src, SEED, None)
    load(0, "b", sync.plan.src, SEED, None)
    assert drop_task(ctx, key="a") is None
    assert "a" not in held and "b" in held
    drop_task(ctx, key="a")  # the session closes again (a pool restarted under it)
    assert "b" in held


# -- run_fn


def _scripted(monkeypatch, *, reset, rss):
    """``rss_reset`` returns ``reset``; ``rss`` returns each of ``rss`` in turn (before,
    after); the clock reads 100.0 then 102.5."""
    monkeypatch.setattr(verify, "rss_reset", lambda: reset)
    monkeypatch.setattr(verify, "rss", iter(rss).__next__)
    monkeypatch.setattr(verify, "time", SimpleNamespace(perf_counter=iter([100.0, 102.5])
                                                         .__next__))


def _context(rank=1):
    return SyncContext(rank, 2, GROUP, CountingP2P(GROUP, rank, None), Meter())


def test_run_fn_times_from_a_barrier_and_reports_the_figures_the_resharder_made(
        monkeypatch, barriers):
    _scripted(monkeypatch, reset=True, rss=[(1000, 5000), (3000, 9000)])
    ctx, local, plan = _context(), {"x": torch.zeros(2)}, object()
    returned = {"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.float64), "note": "x"}
    calls = []

    def fn(*args):
        calls.append(args)
        ctx.p2p.traffic.sent[0] += 96
        ctx.p2p.traffic.received[0] += 64
        ctx.p2p.traffic.messages += 3
        ctx.meter.hold(1000)
        ctx.meter.hold(3000)  # peak 4000, largest 3000
        return returned

    out, figures = run_fn(fn, ctx, 1, local, plan)
    assert out is returned and barriers == [GROUP]
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], (ctx, 1, local, plan)))
    # rss_extra: VmHWM after (9000) - VmRSS before (1000) - the returned tensors' bytes
    # (10 float32 + 3 float64 = 64; not the string)
    assert figures == {"rank": 1, "seconds": 2.5, "sent": {0: 96}, "received": {0: 64},
                       "messages": 3, "staging_peak": 4000, "largest_buffer": 3000,
                       "rss_extra": 9000 - 1000 - 64, "error": None}
    assert type(figures["sent"]) is dict and figures["sent"] is not ctx.p2p.traffic.sent


def test_run_fn_counts_nothing_returned_for_what_is_not_a_dict(monkeypatch, barriers):
    _scripted(monkeypatch, reset=True, rss=[(1000, 5000), (3000, 9000)])
    returned = [torch.zeros(10)]
    out, figures = run_fn(lambda *a: returned, _context(), 1, {}, None)
    assert out is returned and figures["rss_extra"] == 9000 - 1000


@pytest.mark.parametrize("reset, rss", [
    (False, [(1000, 5000), (3000, 9000)]),  # the high-water mark could not be reset
    (True, [None, (3000, 9000)]),  # no /proc/self/status
    (True, [(1000, 5000), None]),
])
def test_run_fn_reports_no_rss_growth_without_the_kernels_counters(monkeypatch, barriers,
                                                                   reset, rss):
    _scripted(monkeypatch, reset=reset, rss=rss)
    _, figures = run_fn(lambda *a: {}, _context(), 1, {}, None)
    assert figures["rss_extra"] is None and figures["error"] is None


def raising(ctx, rank, local, plan):
    raise ValueError(f"rank {rank} cannot reshard")


def test_run_fn_reports_the_users_exception_with_the_users_frames(monkeypatch, barriers):
    _scripted(monkeypatch, reset=True, rss=[(1000, 5000), (3000, 9000)])
    out, figures = run_fn(raising, _context(), 1, {}, None)
    assert out is None and figures["rss_extra"] == 8000
    head, frames = figures["error"].split("\n", 1)
    assert head == "ValueError: rank 1 cannot reshard"
    assert 'test_verify_rank_mutants.py", line' in frames and "in raising" in frames
    assert "weight_sync_bench" not in frames


# -- reshard, reshard_task


def _reshard(sync, rank, fn, key="s", **kw):
    args = {"plan": sync.plan, "bucket_bytes": 1234, "seed": SEED, "forward": True,
            "bandwidth": False} | kw
    return reshard(rank, 2, GROUP, "tracer", key=key, fn=fn, **args)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_correct_reshard_is_checked_and_its_init_output_kept_for_the_forward(
        sync, held, barriers, rank):
    load(rank, "s", sync.plan.src, SEED, sync.init[rank])
    fn = Resharder(sync, "s")
    record = _reshard(sync, rank, fn)
    n = sum(x.numel() for x in generated(sync.plan.dst, rank, SEED).values())
    assert record["elements"] == ElementCheck(rank, n, n, (), ())
    assert record["structure"] is None and record["forward_error"] is None
    assert record["bandwidth"] is None and record["error"] is None and record["rank"] == rank
    assert record["staging_peak"] == 100  # the figures are the first reshard's
    assert len(fn.calls) == 2 and held["s"]["out"] is fn.results[1]
    assert [c[2] for c in fn.calls] == [held["s"]["generated"], held["s"]["init"]]
    assert all(c[3] is sync.plan and c[1] == rank for c in fn.calls)
    for ctx, *_ in fn.calls:  # a fresh context per reshard, the rank's own
        assert (ctx.rank, ctx.world, ctx.group, ctx.bucket_bytes, ctx.device) == \
            (rank, 2, GROUP, 1234, "cpu")
        assert (ctx.p2p.group, ctx.p2p.rank, ctx.p2p.tracer) == (GROUP, rank, "tracer")
        assert type(ctx.meter) is Meter and ctx.destination is None
    assert fn.calls[0][0] is not fn.calls[1][0]
    assert barriers == [GROUP, GROUP]


def test_a_flipped_bit_is_the_element_checks_verdict(sync, held, barriers):
    def flip(out):
        out[QKV].view(torch.int32).view(-1)[0] ^= 1
        return out

    load(1, "s", sync.plan.src, SEED, sync.init[1])
    record = _reshard(sync, 1, Resharder(sync, "s", generated=flip), forward=False)
    assert record["elements"].differ == (QKV,) and not record["elements"].passed
    assert "forward_error" not in record and "out" not in held["s"]


def test_the_users_exception_ends_the_reshard_with_no_check_and_no_forward(sync, held,
                                                                           barriers):
    load(0, "s", sync.plan.src, SEED, sync.init[0])
    fn = Resharder(sync, "s", generated=_raise)
    record = _reshard(sync, 0, fn)
    assert record["error"].startswith("ValueError: rank cannot reshard\n")
    assert record["elements"] is None and "structure" not in record
    assert "forward_error" not in record and len(fn.calls) == 1 and "out" not in held["s"]


def test_other_tensors_than_the_destinations_end_the_reshard_with_the_structure_error(
        sync, held, barriers):
    load(1, "s", sync.plan.src, SEED, sync.init[1])
    fn = Resharder(sync, "s", generated=_drop)
    record = _reshard(sync, 1, fn)
    assert record["structure"] == f"vllm:2 rank 1: missing {QKV}"
    assert record["structure"] == structure_error(sync.plan, 1, fn.results[0])
    assert record["elements"] is None and record["error"] is None
    assert "forward_error" not in record and len(fn.calls) == 1 and "out" not in held["s"]


@pytest.mark.parametrize("fault, error", [
    (_drop, f"vllm:2 rank 1: missing {QKV}"),
    (_raise, "ValueError: rank cannot reshard\n"),
], ids=["structure", "raised"])
def test_the_init_reshards_fault_is_the_forward_error(sync, held, barriers, fault, error):
    load(1, "s", sync.plan.src, SEED, sync.init[1])
    record = _reshard(sync, 1, Resharder(sync, "s", init=fault))
    assert record["forward_error"].startswith(error)
    assert record["elements"].passed and record["error"] is None


def test_elements_false_runs_the_forward_reshard_alone_with_its_figures(sync, held, barriers):
    load(0, "s", sync.plan.src, SEED, sync.init[0])
    fn = Resharder(sync, "s")
    record = _reshard(sync, 0, fn, elements=False)
    assert [c[2] for c in fn.calls] == [held["s"]["init"]]
    assert record["elements"] is None and "structure" not in record
    assert record["staging_peak"] == 200 and record["rank"] == 0  # the init reshard's
    assert record["forward_error"] is None and held["s"]["out"] is fn.results[0]


def test_a_rank_past_the_destination_returns_nothing_and_checks_nothing(held, barriers):
    config = tiny(2)
    plan = plan_for(sync_layout(config, "megatron:4"), sync_layout(config, "vllm:2"))
    init = materialize(list(plan.src.pieces), init_params(config, SEED))
    sync = SimpleNamespace(init_dst=[{}, {}, {}, {}])
    load(3, "s", plan.src, SEED, init[3])
    record = reshard(3, 4, GROUP, None, key="s", plan=plan, fn=Resharder(sync, "s"),
                     bucket_bytes=1, seed=SEED, forward=True, bandwidth=False)
    assert record["elements"] == ElementCheck(3, 0, 0, (), ())
    assert record["structure"] is None and record["forward_error"] is None


def test_bandwidth_is_calibrated_on_the_ranks_own_context(sync, held, barriers, monkeypatch):
    seen = []
    monkeypatch.setattr(execute, "calibrate", lambda ctx: seen.append(ctx) or 1.5e9)
    load(1, "s", sync.plan.src, SEED, None)
    record = _reshard(sync, 1, Resharder(sync, "s"), forward=False, bandwidth=True)
    assert record["bandwidth"] == 1.5e9 and record["elements"].passed
    (ctx,) = seen
    assert (ctx.rank, ctx.world, ctx.group, ctx.bucket_bytes) == (1, 2, GROUP, 1234)


def test_the_device_reaches_the_resharders_context(sync, held, barriers):
    """Under torchrun over NCCL (``sync.torchrun``) the ranks' tensors live on
    ``cuda:LOCAL_RANK``: the resharder is told so (nothing here allocates on it)."""
    load(1, "s", sync.plan.src, SEED, None)
    fn = Resharder(sync, "s")
    _reshard(sync, 1, fn, forward=False, device="cuda:1")
    ((ctx, *_),) = fn.calls
    assert ctx.device == "cuda:1"


def test_a_session_the_rank_never_loaded_is_named(sync, held):
    with pytest.raises(LookupError) as err:
        _reshard(sync, 1, Resharder(sync, "gone"), key="gone")
    assert str(err.value) == ("rank 1: no source shards loaded for session 'gone' (the rank "
                              "processes restarted since the session loaded them)")


def test_reshard_task_marks_the_phase_and_passes_the_ranks_group(sync, held, barriers):
    load(1, "s", sync.plan.src, SEED, None)
    tracer, fn = Tracer(), Resharder(sync, "s")
    ctx = RankContext(rank=1, degree=2, group=GROUP, tracer=tracer)
    record = reshard_task(ctx, key="s", plan=sync.plan, fn=fn, bucket_bytes=64, seed=SEED,
                          forward=False, bandwidth=False)
    assert tracer.marks == ["sync: reshard"] and record["elements"].passed
    ((rctx, rank, _, _),) = fn.calls
    assert (rank, rctx.rank, rctx.world, rctx.group, rctx.p2p.tracer) == (1, 1, 2, GROUP, tracer)


# -- forward, forward_task


class Threads:
    """The ``Collective`` of one rank among ``degree`` threads (sum and concatenation in
    rank order, as ``InProcessCollective``): what ``GlooCollective`` is over processes."""

    def __init__(self, degree: int) -> None:
        self.degree, self.slots = degree, [None] * degree
        self.barrier = threading.Barrier(degree, timeout=60)

    def rank(self, ctx):
        assert isinstance(ctx, RankContext) and ctx.degree == self.degree
        return _RankOf(self, ctx.rank)


class _RankOf:
    def __init__(self, threads: Threads, rank: int) -> None:
        self.threads, self.rank = threads, rank

    @property
    def degree(self) -> int:
        return self.threads.degree

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def _all(self, xs):
        (x,) = xs
        t = self.threads
        t.slots[self.rank] = x
        t.barrier.wait()
        every = list(t.slots)
        t.barrier.wait()
        return every

    def all_reduce(self, xs, *, tag):
        every = self._all(xs)
        total = every[0]
        for x in every[1:]:
            total = total + x
        return [total]

    def all_gather(self, xs, dim, *, tag):
        return [torch.cat(self._all(xs), dim=dim)]

    def reduce_scatter(self, xs, dim, *, tag):
        return [self.all_reduce(xs, tag=tag)[0].chunk(self.degree, dim=dim)[self.rank]]


def _forward_on_threads(monkeypatch, config, spec, *, guard=None, task=True):
    """Every destination rank's ``forward`` (``forward_task``) on a thread, each with the
    init shards its reshard kept; each rank's result and tracer, and the in-process forward
    of the same shards (``forward_model``) with the reference."""
    dst = sync_layout(config, spec)
    plan = plan_for(dst, dst)
    full = init_params(config, SEED)
    shards = materialize(list(dst.pieces), full)
    tokens = make_tokens(config, SEED)
    threads = Threads(dst.degree)
    monkeypatch.setattr(verify, "GlooCollective", threads.rank)
    results, tracers, errors = [None] * dst.degree, [Tracer() for _ in range(dst.degree)], []
    for rank in range(dst.degree):  # one process each, in truth: a key each here
        _HELD[f"f{rank}"] = {"out": shards[rank], "generated": {}}

    def run(rank):
        try:
            ctx = RankContext(rank=rank, degree=dst.degree, group=GROUP, tracer=tracers[rank])
            call = forward_task if task else (lambda c, **kw: forward(rank, c, **kw))
            results[rank] = call(ctx, key=f"f{rank}", plan=plan, tokens=tokens, guard=guard)
        except BaseException as exc:  # noqa: BLE001 - reported below, the barrier broken
            errors.append(exc)
            threads.barrier.abort()

    workers = [threading.Thread(target=run, args=(r,)) for r in range(dst.degree)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        kept = [_HELD[f"f{r}"] for r in range(dst.degree)]
    finally:
        for rank in range(dst.degree):
            _HELD.pop(f"f{rank}", None)
    if errors:
        raise errors[0]
    reading = reading_plan(dst.convention, config, dst.at)
    inputs = [{n: s.apply(shards[r]) for n, s in reading.ranks[r].items()}
              for r in range(dst.degree)]
    with torch.no_grad():
        own = forward_model(reading.forward, inputs, guard=guard)(tokens)[0]
        reference = ReferenceModel(config, full)(tokens)
    return results, tracers, kept, own, reference


@pytest.mark.parametrize("config, spec", [
    (tiny(2), "vllm:2"),
    (tiny(2), "meta:2"),  # Meta's embedding split on the hidden dimension: Shard(1)
    (MOE_FEW, "vllm:tp=2,ep=2"),  # vLLM's EP: each rank's own experts whole
], ids=["vllm:2", "meta:2", "vllm-ep"])
def test_the_forward_reads_the_kept_shards_as_the_destination_does_logits_on_rank_0(
        monkeypatch, config, spec):
    results, tracers, kept, own, reference = _forward_on_threads(monkeypatch, config, spec)
    logits, other = results
    assert other is None and logits is not None
    assert torch.equal(logits, own)  # the convention's own forward, bit for bit
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    assert [t.marks for t in tracers] == [["sync: forward"]] * 2
    assert kept == [{"generated": {}}] * 2  # the kept output is handed over, not kept twice


def test_the_forward_follows_the_routing_guard_it_is_given(monkeypatch):
    guard = forced_guard(MOE_FEW)
    for task in (True, False):
        (logits, _), _, _, own, reference = _forward_on_threads(
            monkeypatch, MOE_FEW, "vllm:tp=2,ep=2", guard=guard, task=task)
        assert torch.equal(logits, own)
        assert (logits - reference).abs().max() > 1e-3  # the forced routing moved them

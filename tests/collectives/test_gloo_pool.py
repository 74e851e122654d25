"""GlooCollective, the rank pool, its watchdog, and each fault with its bound.

Fault tests run a tiny geometry on their own two-rank pools, with short watchdog deadlines
where the watchdog is what should fire and long ones where it must not be (a crash or an
exception is reported long before the deadline, so a pass shows they were not hangs).
After each fault the old rank processes are gone (checked by pid) and the same pool object
serves a correct check again.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from weight_sync_bench.check.forwards import run_phase1b
from weight_sync_bench.collectives.gloo.breadcrumbs import Breadcrumb, Fault, Tracer
from weight_sync_bench.collectives.gloo.collective import GlooCollective
from weight_sync_bench.collectives.gloo.pool import RankPool, is_alive, shared_pool
from weight_sync_bench.collectives.gloo.rank import RankContext
from weight_sync_bench.collectives.gloo.transport import GlooTransport, ParamSink
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.collectives.protocol import Collective
from weight_sync_bench.errors import (
    RankCrash,
    RankFailure,
    RankTimeout,
    WrongShardShape,
)
from weight_sync_bench.fuzz.floor import fuzz_threshold_rule
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import TOY, init_params, make_tokens
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.sharded import ShardedModel

# Small enough that a check costs milliseconds; every placement still splits at t=2.
TINY = TOY.replace(name="tiny", vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, ffn=48)


def _within_phase1b_floor(result) -> bool:
    """TINY lies inside the fuzz domain: the measured phase-1b rule for such geometries."""
    threshold = fuzz_threshold_rule("1b")(TINY, result.reference)
    return (result.logits - result.reference).abs().max().item() <= threshold


def _assert_healthy_again(pool: RankPool, old_pids: tuple[int, ...]) -> None:
    """The old ranks are gone, and the same pool restarts and passes a correct check."""
    assert old_pids and not any(is_alive(pid) for pid in old_pids), old_pids
    starts = pool.starts
    result = run_phase1b(TINY, 2, param_seed=1, token_seed=2, pool=pool, reference=True)
    assert pool.starts == starts + 1
    assert set(pool.pids).isdisjoint(old_pids)
    assert _within_phase1b_floor(result)


@pytest.fixture(scope="module")
def pool():
    """One two-rank pool for the fault tests: each fault kills its ranks, and the restart
    that proves the pool recovers is the pool the next fault test starts from."""
    with RankPool(2, deadline=20.0, pg_timeout=60.0, rendezvous_deadline=3.0) as p:
        yield p
    assert not p.running


# -- GlooCollective


def test_gloo_collective_holds_one_rank_and_speaks_the_collective_protocol():
    coll = GlooCollective(RankContext(rank=1, degree=2, group=None, tracer=Tracer(1)))
    assert isinstance(coll, Collective)
    assert (coll.degree, coll.ranks) == (2, (1,))
    with pytest.raises(ValueError, match="holds rank 1 only, got 2 tensors"):
        coll.all_reduce([torch.zeros(1), torch.zeros(1)], tag="x")


def grads_task(ctx, *, config, param_seed, token_seed, loss_seed):
    """On each rank: shards through GlooTransport, forward and backward over GlooCollective
    of this rank's loss ``sum(logits * w)``; returns the gradient of every local shard."""
    layout = layout_for(config)
    sink = ParamSink()
    GlooTransport(ctx, layout).sync(
        (lambda: split(init_params(config, param_seed), layout, ctx.degree)) if ctx.rank == 0 else None,
        sink)
    shards = {name: x.requires_grad_() for name, x in sink.items()}
    ctx.tracer.mark("forward")
    (logits,) = ShardedModel(config, [shards], GlooCollective(ctx))(make_tokens(config, token_seed))
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(loss_seed))
    ctx.tracer.mark("backward")
    (logits * weights).sum().backward()
    return {name: x.grad for name, x in shards.items()}


def _in_process_grads(config, degree, *, param_seed, token_seed, loss_seed, rank_losses):
    shards = split(init_params(config, param_seed), layout_for(config), degree)
    for params in shards:
        for x in params.values():
            x.requires_grad_()
    outs = ShardedModel(config, shards, InProcessCollective(degree))(make_tokens(config, token_seed))
    weights = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(loss_seed))
    sum((outs[r] * weights).sum() for r in rank_losses).backward()
    return [{name: x.grad for name, x in params.items()} for params in shards]


def _worst_grad_gap(a, b):
    assert len(a) == len(b) and all(ra.keys() == rb.keys() for ra, rb in zip(a, b, strict=True))
    return max((ra[n] - rb[n]).abs().max().item() / rb[n].abs().max().item()
               for ra, rb in zip(a, b, strict=True) for n in ra)


def test_gloo_backward_matches_the_in_process_backward():
    """All-reduce's backward is an all-reduce and all-gather's a reduce-scatter: every rank
    backpropagating its own loss gives each shard the gradient of the sum of the ranks'
    losses, as InProcessCollective does (whose ranks share one output tensor)."""
    seeds = {"param_seed": 3, "token_seed": 4, "loss_seed": 5}
    over_gloo = shared_pool(4).run(grads_task, 2, kwargs={"config": TINY, **seeds})
    in_process = _in_process_grads(TINY, 2, rank_losses=(0, 1), **seeds)
    assert _worst_grad_gap(over_gloo, in_process) < 1e-5
    # Not vacuous: the gradient of one rank's loss alone is half of it, far outside 1e-5.
    one_rank = _in_process_grads(TINY, 2, rank_losses=(0,), **seeds)
    assert _worst_grad_gap(over_gloo, one_rank) > 0.1


# -- breadcrumbs


def test_breadcrumbs_order_a_rank_behind_its_peers():
    behind = Breadcrumb("forward", seq=2, op="all_reduce", tag="tok_embeddings.weight")
    waiting = Breadcrumb("forward", seq=3, op="all_reduce", tag="layers.0.o_proj.weight",
                         state="inside")
    assert behind.progress < waiting.progress
    assert str(behind) == "forward: after collective #2 all_reduce(tok_embeddings.weight), before #3"
    assert str(waiting) == ("forward: inside collective #3 all_reduce(layers.0.o_proj.weight), "
                            "waiting for peers")
    assert Breadcrumb("start").progress < Breadcrumb("rendezvous").progress < behind.progress


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"action": "explode", "rank": 0}, "action='explode' is not one of"),
    ({"action": "stall", "rank": 0, "phase": "rendezvous"}, "does not fire in phase='rendezvous'"),
    ({"action": "wrong_shape", "rank": 1}, "wrong_shape fires in the transport"),
    ({"action": "raise", "rank": 0, "index": 0}, "index >= 1"),
])
def test_faults_that_cannot_fire_are_rejected(kwargs, why):
    with pytest.raises(ValueError, match=why):
        Fault(**kwargs)


# -- the pool


def rank_info(ctx):
    return {"pid": os.getpid(), "threads": torch.get_num_threads(),
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "rank": ctx.rank,
            "degree": ctx.degree, "group_size": torch.distributed.get_world_size(ctx.group)}


def test_every_rank_runs_one_torch_thread_over_loopback_in_a_prefix_group():
    pool = shared_pool(4)
    for degree in (1, 2, 4):
        infos = pool.run(rank_info, degree)
        assert [i["rank"] for i in infos] == list(range(degree))
        assert all(i["threads"] == 1 and i["ifname"] == "lo" for i in infos)
        assert all(i["group_size"] == degree for i in infos)
        assert [i["pid"] for i in infos] == list(pool.pids[:degree])


def test_watchdog_deadline_must_be_well_below_the_process_group_timeout():
    with pytest.raises(ValueError, match="at most half of the process-group timeout"):
        RankPool(2, deadline=40.0, pg_timeout=60.0)
    with pytest.raises(ValueError, match="degree must be in 1..2"):
        RankPool(2).run(rank_info, 3)  # rejected before any rank starts


def test_two_pools_started_at_once_do_not_collide():
    """Private FileStore directories and gloo's port-0 sockets: concurrent launches (as
    pytest-xdist workers make) rendezvous independently."""
    def one_check(seed):
        with RankPool(2, deadline=30.0) as p:
            result = run_phase1b(TINY, 2, param_seed=seed, token_seed=seed, pool=p,
                                 reference=True)
            return p.pids, result

    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        (pids_a, a), (pids_b, b) = threads.map(one_check, (7, 8))
    assert set(pids_a).isdisjoint(pids_b)
    for result in (a, b):
        assert _within_phase1b_floor(result)
    assert not torch.equal(a.logits, b.logits)  # two different checks, not one seen twice
    assert not any(is_alive(p) for p in pids_a + pids_b)


def assert_orphans_exit(directory: str, *pids: str) -> None:
    """The pool of an owner killed by SIGKILL (its ``directory``; its two ranks' and its
    forkserver's ``pids``): every process exits on its own (within a second when idle; the
    wait is a hang detector, 30x that, so a loaded machine cannot fail it). The directory is
    removed here: a SIGKILLed owner cannot remove its pool's files."""
    shutil.rmtree(directory)
    assert len(pids) == 3
    give_up = time.monotonic() + 30.0
    while any(is_alive(int(p)) for p in pids) and time.monotonic() < give_up:
        time.sleep(0.1)
    assert not any(is_alive(int(p)) for p in pids)


# 3 s, an interpreter of its own: the long run. The default run checks the same, a pool's
# owner SIGKILLed and its forkserver and ranks exiting on their own, at the end of
# test_pool_faults.py's test_a_killed_forkserver_is_named_not_blamed_on_rank_0_as_exit_code_255
# (in the process that test starts anyway)
@pytest.mark.slow
def test_ranks_of_a_parent_killed_without_cleanup_exit_on_their_own():
    """SIGKILL leaves no finalizer to run: the forkserver sees its owner gone and exits,
    and each rank, finding itself orphaned, exits on its own (within a second when idle; the
    wait below is a hang detector, 30x that, so a loaded machine cannot fail it)."""
    script = ("import os, signal, multiprocessing.forkserver as fs\n"
              "from weight_sync_bench.collectives.gloo.pool import RankPool\n"
              "pool = RankPool(2)\npool.start()\n"
              "print(pool.directory, *pool.pids, fs._forkserver._forkserver_pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert_orphans_exit(*out.stdout.split())


# -- faults, each with its bound


def test_rank_that_never_arrives_at_rendezvous_is_named():
    with RankPool(2, deadline=20.0, pg_timeout=60.0, rendezvous_deadline=1.5) as pool:
        start = time.monotonic()
        with pytest.raises(RankTimeout) as caught:
            pool.start(fault=Fault("skip_rendezvous", rank=1, phase="rendezvous"))
        assert caught.value.stuck == (1,)
        message = str(caught.value)
        assert "rank 1 never arrived, 1.5 s after the first rank did" in message
        assert "rank 0 (pid" in message and "waiting in init_process_group" in message
        assert "in rank_main" in caught.value.stacks[1]  # where the missing rank is
        assert time.monotonic() - start < pool.start_deadline  # the rendezvous deadline fired
        _assert_healthy_again(pool, caught.value.pids)


def test_rank_stalled_before_a_collective_is_named_with_its_breadcrumb_and_stacks(pool):
    pool.start()
    old = pool.pids
    deadline = 1.5
    start = time.monotonic()
    with pytest.raises(RankTimeout) as caught:
        run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool, deadline=deadline,
                    fault=Fault("stall", rank=1, phase="forward", index=2))
    elapsed = time.monotonic() - start
    error = caught.value
    # a stalled rank that runs answers the stack request: a RankTimeout, never RankStopped
    # (the default run's twin of test_pool_faults.py's rank stopped inside a collective)
    assert type(error) is RankTimeout and error.stuck == (1,) and error.rank == 1
    message = str(error)
    assert ("stuck (behind the others):\n  rank 1 (pid %d): forward: after collective #%d "
            "all_reduce(tok_embeddings.weight)" % (old[1], len(layout_for(TINY)) + 2)) in message
    assert ("waiting for them:\n  rank 0 (pid %d): forward: inside collective #%d "
            "all_reduce(layers.0.o_proj.weight), waiting for peers"
            % (old[0], len(layout_for(TINY)) + 3)) in message
    assert "in _fire" in error.stacks[1]  # the stalled rank's own stack
    assert "in all_reduce" in error.stacks[0]  # the waiting rank's stack, inside gloo
    # the deadline fired, not the process group's timeout (60 s): about deadline + 0.5 s when
    # idle; the upper bound is a hang detector, ten times the measured overshoot and more
    assert deadline <= elapsed < deadline + 20.0
    _assert_healthy_again(pool, old)


def test_rank_that_raises_reaches_the_caller_with_its_traceback_before_any_deadline(pool):
    pool.start()
    old = pool.pids
    with pytest.raises(RankFailure) as caught:
        run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool,
                    fault=Fault("raise", rank=1, phase="forward", index=1))
    received = time.time()
    error = caught.value
    assert type(error) is RankFailure and error.rank == 1
    assert "rank 1 raised InjectedFault" in str(error)
    assert "in forward" in error.remote_traceback  # the rank's own frames, ShardedModel's
    assert "InjectedFault: injected fault: raise at rank 1, forward collective 1" in error.remote_traceback
    # the watchdog deadline (20 s) did not fire: a report takes ~0.1 s when idle; 10 s is two
    # orders above that and half the deadline, so only a report that waited for it fails
    assert received - error.raised_at < 10.0
    _assert_healthy_again(pool, old)


def test_rank_killed_by_a_signal_is_reported_as_a_crash_with_the_signal_name(pool):
    pool.start()
    old = pool.pids
    start = time.monotonic()
    with pytest.raises(RankCrash) as caught:
        run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool,
                    fault=Fault("kill", rank=1, phase="forward", index=3))
    error = caught.value
    assert (error.rank, error.signal_name, error.exit_code) == (1, "SIGKILL", -9)
    assert "rank 1 crashed during task phase1b_task at t=2: killed by SIGKILL" in str(error)
    # the forkserver lives: the rank is blamed, no launcher named (the default run's twin of
    # test_pool_faults.py's killed forkserver, LauncherCrash)
    assert type(error) is RankCrash and getattr(error, "launcher_pid", None) is None
    assert "forkserver process" not in str(error)
    assert "rank 1 breadcrumb: forward: after collective #" in str(error)
    # a crash, not a hang: ~1 s when idle, the deadline 20 s; 10 s tells the two apart
    assert time.monotonic() - start < 10.0
    _assert_healthy_again(pool, old)


def test_wrong_shaped_shard_is_refused_by_name_before_any_scatter(pool):
    """Rank 0 checks every outgoing shard, then every rank learns the verdict from one
    broadcast: all stop at the same point, so the error is the typed original and the
    process group is still sound (the pool keeps its ranks)."""
    pool.start()
    pids = pool.pids
    name = layout_for(TINY).names[2]
    with pytest.raises(WrongShardShape) as caught:
        run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool,
                    fault=Fault("wrong_shape", rank=1, phase="transport", index=3))
    error = caught.value
    expected = layout_for(TINY)[name].local_shape(2)
    assert (error.rank, error.name, error.expected) == (1, name, expected)
    assert error.actual == (expected[0] - 1, *expected[1:])
    assert f"rank 1 {name}: shape [{expected[0] - 1}, " in str(error)
    assert "after collective #1 broadcast(transport go/no-go)" in "".join(error.__notes__)
    assert pool.pids == pids  # the ranks agreed, nothing to restart
    result = run_phase1b(TINY, 2, param_seed=0, token_seed=0, pool=pool, reference=True)
    assert _within_phase1b_floor(result)

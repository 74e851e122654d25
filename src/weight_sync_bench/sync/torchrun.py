"""Phase 2 under ``torchrun``: the same rank side, launched by the tool every user has.

    torchrun --standalone --nproc-per-node 4 -m weight_sync_bench sync --launcher torchrun \\
        --config toy_kv4 --from megatron:4 --to vllm:2

Every process joins the job as ``collectives.gloo.torchrun.TorchrunRanks`` (torchrun's
environment, ``env://`` rendezvous, the prefix groups; the same pieces ``wsb check
--launcher torchrun`` runs on), plans the sync itself (the planner is deterministic: every
rank plans the same plan, none is shipped) and runs ``verify.reshard`` and
``verify.forward``, the functions the rank pool runs. Unlike the check, whose rank 0 drives
the others as the pool's parent does, the sync is one program every rank runs alike. Rank 0
plays the part the pool's parent plays for the forward check: it builds ``init_params`` and
the dense reference and sends every rank its source shards before the timed reshard (the
element check and the reshard itself never touch a full tensor), then gathers every rank's
record and judges. It returns the ``SyncResult`` on rank 0, None elsewhere.

Backends: ``gloo`` (CPU) everywhere; ``nccl`` only where CUDA is available (the job's groups
``cpu:gloo,cuda:nccl``, each rank's tensors on ``cuda:LOCAL_RANK``; the element check and the
byte figures, no forward: the floors were measured on CPU fp32 and must be re-measured on a
GPU). Refused otherwise, with the reason.

What torchrun's agent gives when a rank dies or hangs, and what it does not:

- a rank that exits or is killed: the agent sees the exit (it polls its workers every
  ``--monitor-interval`` seconds), terminates the other workers and fails with a
  ``ChildFailedError`` naming the global rank, local rank, exit code or signal of the
  first failure (a structured traceback only where the worker's entry point is wrapped in
  ``torch.distributed.elastic.multiprocessing.errors.record``; ``wsb`` instead prints each
  rank's typed error on that rank's stderr, which torchrun passes through);
- a rank that is alive but stuck: the agent sees nothing (it has no worker heartbeat), so
  the peers wait in their collective until the process-group timeout (``--deadline``
  here) and then fail; the agent names *those* ranks, the waiting ones, not the stuck one.
  Each failing rank's error carries its breadcrumb (phase, collective number, op, tag), so
  the stuck rank is the one whose breadcrumb is behind. (The check's rank-0-driven tasks
  do better: a ``monitored_barrier`` names the stuck rank, and each rank dumps its stacks
  past the deadline; see ``collectives.gloo.torchrun``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync_bench.check.conversion import require_cell
from weight_sync_bench.check.threshold import environment_notes
from weight_sync_bench.collectives.gloo.rank import RankContext
from weight_sync_bench.collectives.gloo.torchrun import (
    TORCHRUN_BACKENDS,
    TorchrunRanks,
    device_for,
    torchrun_env,
)
from weight_sync_bench.conventions import materialize
from weight_sync_bench.errors import FloorNotMeasured, UnsupportedLauncher
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.sync.execute import (
    DEFAULT_BUCKET,
    CountingP2P,
    ReshardFn,
    execute_plan,
)
from weight_sync_bench.sync.layouts import sync_layout
from weight_sync_bench.sync.planner import plan_for
from weight_sync_bench.sync.session import (
    INTO,
    InPlace,
    SyncResult,
    collect,
    existing_task,
    judge,
    no_forward,
    raise_user_errors,
)
from weight_sync_bench.sync.verify import forward, load, reshard
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, floor_for

if TYPE_CHECKING:
    from collections.abc import Mapping

    from weight_sync_bench.collectives.gloo.breadcrumbs import Tracer
    from weight_sync_bench.model.config import ModelConfig
    from weight_sync_bench.sync.layouts import SyncLayout

__all__ = ["TORCHRUN_BACKENDS", "device_for", "run_torchrun", "torchrun_env"]


def run_torchrun(config: ModelConfig, src_text: str, dst_text: str, *, dp: int = 1,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET, forward_check: bool = True,
                 backend: str = "gloo", calibrate: bool = True, deadline: float = 300.0,
                 into: str = "fresh", options: Mapping[str, str] | None = None
                 ) -> SyncResult | None:
    """This process's part of the sync (module docstring): the result on rank 0. ``into``
    as ``SyncSession.run``'s: ``"existing"`` receives into destination tensors each rank
    allocates and fills with stale values before the timed reshard (``existing_task``, the
    rank pool's own), on CPU only. ``options``: what this rank was started with, compared
    across the ranks as they join (``TorchrunRanks.agree``), before any rank plans: ranks
    that plan different syncs would otherwise fail far from the cause, or not at all."""
    if into not in INTO:
        raise ValueError(f"run_torchrun: into={into!r}, expected one of {INTO}")
    rank, world, local_rank = torchrun_env("sync")
    device = device_for(backend, local_rank)
    if into == "existing" and device != "cpu":
        raise UnsupportedLauncher(f"--into existing runs on CPU (gloo): its stale destination "
                                  f"tensors are not made on {device}")
    # the job, its groups; the ranks agree on their options before anything else
    ranks = TorchrunRanks(backend, deadline=deadline, command="sync", options=options)
    try:
        src, dst = sync_layout(config, src_text, dp=dp), sync_layout(config, dst_text)
        plan = plan_for(src, dst)
        plan.prepare(bucket_bytes)  # the cut and runs, cached on the plan: made here, not timed
        if world != plan.world:
            raise UnsupportedLauncher(f"{plan.label} runs on {plan.world} ranks; torchrun "
                                      f"started {world} (--nproc-per-node {plan.world})")
        notes: tuple[str, ...] = ()
        run_forward = forward_check and dst.runs_forward  # as SyncSession decides it
        if forward_check and not run_forward:
            notes += (no_forward(dst),)
        if run_forward and device != "cpu":
            run_forward = False
            notes += ((f"no forward over {backend}: the phase 1b floor was measured on CPU "
                      "fp32"),)
        floor = floor_for(config, "1b") if run_forward else None  # all ranks alike
        if floor is not None:
            try:  # as SyncSession: no cell of the destination's forward, no forward
                require_cell(floor, config, dst.at)
            except FloorNotMeasured as exc:
                run_forward, floor = False, None
                notes += (f"no forward: {exc}",)
        threshold = floor.threshold if floor is not None else None
        group, tracer = ranks.groups[world], ranks.tracer
        tracer.mark("sync: load")
        reference = init = None
        tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
        guard = None
        if run_forward:
            assert threshold is not None
            reference, init, guard = _init_shards(rank, world, group, tracer, src, seed, tokens,
                                                  threshold)
        load(rank, "torchrun", src, seed, init, device)
        fn: ReshardFn = execute_plan
        if into == "existing":  # allocated and made stale outside the timed region
            existing_task(RankContext(rank, world, group, tracer), key="torchrun", plan=plan,
                          seed=seed)
            fn = InPlace(execute_plan, "torchrun")
        tracer.mark("sync: reshard")
        record = reshard(rank, world, group, tracer, key="torchrun", plan=plan,
                         fn=fn, bucket_bytes=bucket_bytes, seed=seed,
                         forward=run_forward, bandwidth=calibrate and world > 1, device=device)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, record, group=group)
        records: list[dict[str, Any]] = gathered
        logits = None
        if run_forward:
            tracer.mark("sync: forward")
            if rank < dst.degree:
                logits = forward(rank, RankContext(rank, dst.degree, ranks.groups[dst.degree],
                                                   tracer),
                                 key="torchrun", plan=plan, tokens=tokens, guard=guard)
        if rank != 0:
            return None
        name = f"{execute_plan.__module__}:{execute_plan.__qualname__}"
        raise_user_errors(records, name, plan)
        verdict = None
        if run_forward:
            assert logits is not None and reference is not None and threshold is not None
            assert floor is not None
            notes += environment_notes(floor, config, "1b", "fp32")
            verdict = judge(plan, logits, reference, threshold, records, notes)
        return collect(plan, name, records, verdict,
                       notes + (f"launched by torchrun ({world} ranks, {backend})",), into=into)
    finally:
        ranks.leave()  # every rank runs this function alike: none serves


def _init_shards(rank: int, world: int, group: Any, tracer: Tracer, src: SyncLayout, seed: int,
                 tokens: torch.Tensor, threshold: float
                 ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], RoutingGuard | None]:
    """Rank 0 builds ``init_params`` and the reference and sends each source rank its
    shards (a transport of its own, not counted in the sync's figures); an MoE model's
    routing guard (the reference's routings, bound ``threshold``) is broadcast to every
    rank, as ``SyncSession`` hands it to the forward's ranks."""
    config = src.config
    shapes = config.param_shapes()
    p2p = CountingP2P(group, rank, tracer)
    reference, guard = None, None
    if rank == 0:
        full = init_params(config, seed)
        model = ReferenceModel(config, full)
        with torch.no_grad():
            reference = model(tokens)
        if config.n_experts:
            guard = RoutingGuard(model.routings, threshold)
        shards = materialize(list(src.pieces), full)
        del full
        sends = [(r, x.contiguous()) for r in range(1, src.world) for x in shards[r].values()]
        p2p.exchange(sends, [], tag="init shards")
        mine = shards[0]
    elif rank >= src.world:
        mine = {}
    else:
        mine = {name: torch.empty(piece.local_shape(shapes[piece.source]))
                for name, piece in src.pieces[rank].items()}
        p2p.exchange([], [(0, x) for x in mine.values()], tag="init shards")
    if config.n_experts:  # the job's own processes: rank 0's routings, pickled among them
        held = [guard]
        dist.broadcast_object_list(held, src=0, group=group)
        guard = held[0]
    return reference, mine, guard

"""Phase 2: reshard between two distributed layouts with no full tensor anywhere.

- ``layouts``: a side of a sync (a convention at a degree, over DP replicas; FSDP ``Shard(0)``);
- ``boxes``: every rank-local tensor as boxes of the canonical tensor, validated before
  anything moves;
- ``planner``: the sweep that intersects two covers into transfers (``Plan``, cached);
- ``minimum``: ``B_min``, the naive bytes and ``T_min``, computed without the planner;
- ``values``: parameter values as a function of (seed, parameter, index);
- ``execute``: the rank side (``execute_plan``, the naive ``gather_scatter``, the counting
  transport, memory);
- ``verify``: the element check without a gather, the destination forward, the pool tasks;
- ``session``: ``check_distributed_reshard`` and ``SyncSession``;
- ``mutations``: the planner's bugs; ``torchrun``: the same rank side under torchrun.
"""

from __future__ import annotations

from weight_sync_bench.sync.execute import (
    DEFAULT_BUCKET,
    CountingP2P,
    ReshardFn,
    SyncContext,
    execute_plan,
    gather_scatter,
)
from weight_sync_bench.sync.layouts import SyncLayout, sync_layout
from weight_sync_bench.sync.minimum import minimum_bytes, naive_bytes, time_bound
from weight_sync_bench.sync.planner import Plan, Transfer, plan_for
from weight_sync_bench.sync.session import (
    SyncResult,
    SyncSession,
    check_distributed_reshard,
    run_distributed_reshard,
)

__all__ = ["DEFAULT_BUCKET", "CountingP2P", "Plan", "ReshardFn", "SyncContext", "SyncLayout",
           "SyncResult", "SyncSession", "Transfer", "check_distributed_reshard",
           "execute_plan", "gather_scatter", "minimum_bytes", "naive_bytes", "plan_for",
           "run_distributed_reshard", "sync_layout", "time_bound"]

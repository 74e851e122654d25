"""Phase 2 figures, side by side in one run: bytes counted at the transport against B_min and
the naive gather-then-scatter, wall time against T_min, bytes sent max/mean, plan time,
memory per rank.

One row per layout pair (TOY-sized geometries, world sizes up to 8): TP a -> b, vLLM's KV
replication over 1, 2 and 8 KV heads, FSDP ``Shard(0)`` -> TP, DP x TP -> TP, fused
tensors, Megatron -> vLLM and -> Meta. Each row: ``reps`` interleaved rounds of the
harness's executor and the naive ``gather_scatter`` (both checked element by element), the
gloo point-to-point bandwidth calibrated in the same task, medians. The forward runs once per
row where a phase 1b floor exists (TOY, TOY_KV4). Prints; asserts nothing.

    python bench/bench_sync.py [reps]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from weight_sync_bench.collectives.gloo.pool import RankPool
from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.sync import SyncSession, execute_plan, gather_scatter

KV1, KV8 = TOY.replace(name="toy_kv1", n_kv_heads=1), TOY.replace(name="toy_kv8", n_kv_heads=8)
ROWS = (
    [(TOY_KV4, f"plain:{a}", f"plain:{b}", 1) for a in (1, 2, 4) for b in (1, 2, 4) if a != b]
    + [(KV8, "plain:8", "plain:2", 1), (KV8, "plain:2", "plain:8", 1)]
    + [(KV1, "megatron:1", "vllm:4", 1), (TOY, "megatron:2", "vllm:4", 1),
       (TOY, "vllm:8", "megatron:2", 1), (KV8, "megatron:8", "vllm:4", 1)]
    + [(TOY_KV4, "fsdp:4", "vllm:2", 1), (TOY_KV4, "fsdp:8", "megatron:4", 1)]
    + [(TOY_KV4, "megatron:2", "vllm:4", 2), (TOY_KV4, "megatron:4", "vllm:2", 2)]
    + [(TOY_KV4, "megatron:4", "vllm:2", 1), (TOY_KV4, "megatron:2", "meta:2", 1)]
)
FORWARD = (TOY, TOY_KV4)  # the geometries with a measured phase 1b floor


def row(pool: RankPool, config, src: str, dst: str, dp: int, reps: int) -> dict:
    forward = config in FORWARD
    with SyncSession(config, src, dst, dp=dp, pool=pool, forward=forward) as session:
        first = session.run(execute_plan, calibrate=True)  # with the forward, once
        ours, naive = [first], []
        for _ in range(reps):  # interleaved rounds
            naive.append(session.run(gather_scatter, calibrate=True, forward=False))
            ours.append(session.run(execute_plan, calibrate=True, forward=False))
    assert all(r.bytes_moved == first.bytes_moved for r in ours)
    return {"label": f"{config.name} {first.plan.src} -> {first.plan.dst}", "first": first,
            "ours": ours, "naive": naive}


def main(reps: int = 3) -> int:
    torch.set_num_threads(1)
    started = time.perf_counter()
    pool = RankPool(8)
    try:
        rows = [row(pool, *case, reps) for case in ROWS]
    finally:
        pool.close()
    print(f"phase 2 resharding, {reps} interleaved rounds per row (medians), one torch thread "
          f"per rank, 8 rank processes on {os.cpu_count()} cores")
    head = (f"{'layout pair':<36} {'B_min MB':>9} {'moved/B_min':>11} {'naive/B_min':>11} "
            f"{'T ms':>7} {'T_min ms':>8} {'T/T_min':>7} {'naive ms':>8} {'sent max/mean':>13} "
            f"{'plan ms':>7} {'staging MB':>10} {'RSS+ MB':>7} {'naive RSS+':>10} "
            f"{'checks':>12}")
    print(head)
    for r in rows:
        first, ours, naive = r["first"], r["ours"], r["naive"]
        t = statistics.median(x.seconds for x in ours)
        t_min = statistics.median(x.t_min or 0.0 for x in ours)
        t_naive = statistics.median(x.seconds for x in naive)
        staging = max(x.staging_peak for x in first.ranks) / 1e6
        rss = max((x.rss_extra or 0) for o in ours for x in o.ranks) / 1e6
        naive_rss = max((x.rss_extra or 0) for o in naive for x in o.ranks) / 1e6
        balance = first.sent_balance
        checks = ("elements " + ("ok" if all(o.elements_passed for o in ours + naive) else "FAIL")
                  + ("" if first.verdict is None else
                     f", fwd {first.verdict.ratio:.2g}x" if first.verdict.passed else ", fwd FAIL"))
        ratio = first.bytes_moved / first.b_min if first.b_min else float("nan")
        print(f"{r['label']:<36} {first.b_min / 1e6:>9.2f} {ratio:>11.3f} "
              f"{first.naive / first.b_min if first.b_min else float('nan'):>11.2f} "
              f"{t * 1e3:>7.1f} {t_min * 1e3:>8.1f} {t / t_min if t_min else float('nan'):>7.2f} "
              f"{t_naive * 1e3:>8.1f} {balance if balance else float('nan'):>13.3f} "
              f"{first.plan.build_seconds * 1e3:>7.2f} {staging:>10.2f} {rss:>7.1f} "
              f"{naive_rss:>10.1f} {checks:>12}")
    bandwidths = [o.bandwidth for r in rows for o in r["ours"] if o.bandwidth]
    largest = max(r["first"].largest_param for r in rows) / 1e6
    print(f"calibrated gloo p2p bandwidth: median {statistics.median(bandwidths) / 1e9:.2f} GB/s "
          f"(min {min(bandwidths) / 1e9:.2f}, max {max(bandwidths) / 1e9:.2f}); largest full "
          f"parameter {largest:.1f} MB; staging bound 2 x bucket = 8.4 MB")
    print("moved: counted at each rank's CountingP2P; T: the slowest rank from a common barrier; "
          "T_min = max over ranks of max(sent, received) / bandwidth; RSS+: the kernel's "
          "high-water mark above the inputs, less the outputs, worst rank")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:])))

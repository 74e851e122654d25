"""The MoE kill matrix with its ratios: for each geometry and MoE conversion mutation, over
every ordered pair of MoE endpoints (``conventions.moe_endpoints``), how many conversions
it was live on (one per mutation key), how many it was killed on at >= 10x, its smallest
ratio (deviation / threshold) and where, how many it was declared the identity on, and how
many a selection-only bias left every choice unchanged on (the bytes fail those). The same
rows ``tests/check/test_moe_kill.py`` asserts; this prints them.

    .venv/bin/python bench/moe_kill_matrix.py                 # TOY_MOE, TOY_MOE_DS, Qwen3 reduced
    .venv/bin/python bench/moe_kill_matrix.py --geometry every_moe --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from collections import defaultdict

import torch

from weight_sync_bench.check.convert import conversion_checker, measure_threshold
from weight_sync_bench.check.kill_matrix import kill_matrix
from weight_sync_bench.conventions import moe_endpoints
from weight_sync_bench.conventions.mutations import MOE_MUTATIONS
from weight_sync_bench.model.config import TOY, TOY_MOE, TOY_MOE_DS, shipped_hf_config

# tests/check/test_moe_kill.py's EVERY: every MoE mutation live
EVERY = TOY.replace(name="every_moe", vocab=256, d_model=64, n_heads=4, n_kv_heads=2,
                    head_dim=16, ffn=96, n_layers=2, seq_len=32, qk_norm=True, n_experts=6,
                    top_k=2, expert_ffn=64, router="sigmoid", router_bias=True,
                    norm_topk=True, n_groups=2, topk_groups=1, shared_ffn=32,
                    shared_gate=True)


def geometries():
    return {"toy_moe": TOY_MOE, "toy_moe_ds": TOY_MOE_DS, "every_moe": EVERY,
            "qwen3_30b_a3b": shipped_hf_config("qwen3_30b_a3b", shrink=16, n_layers=1,
                                               vocab=512)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", action="append", choices=sorted(geometries()),
                        help="default: toy_moe, toy_moe_ds, qwen3_30b_a3b")
    parser.add_argument("--json", help="write the per-mutation figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.geometry or ["toy_moe", "toy_moe_ds", "qwen3_30b_a3b"]
    report = {}
    for name in names:
        config = geometries()[name]
        eps = moe_endpoints(config)
        start, cpu = time.perf_counter(), time.process_time()
        checker = (conversion_checker(config) if name.startswith("toy")
                   else conversion_checker(config, threshold=measure_threshold(config, eps)))
        print(f"{name}: {len(eps)} endpoints, threshold {checker.checker.threshold:g}",
              flush=True)
        rows = defaultdict(list)
        for row in kill_matrix(checker, eps, MOE_MUTATIONS):
            rows[row.mutation].append(row)
        print(f"{'mutation':28} {'live':>5} {'killed':>6} {'min ratio':>10} {'identity':>8} "
              f"{'unchanged':>9}  smallest at")
        figures = {}
        for m in MOE_MUTATIONS:
            mine = rows[m.name]
            live = [r for r in mine if r.outcome in ("killed", "survived", "unchanged")]
            killed = [r for r in live if r.outcome == "killed"]
            judged = [r for r in live if r.outcome != "unchanged"]
            worst = min(judged, key=lambda r: r.ratio, default=None)
            figures[m.name] = {
                "live": len(live), "killed": len(killed),
                "survived": sum(r.outcome == "survived" for r in live),
                "unchanged": sum(r.outcome == "unchanged" for r in live),
                "identity": sum(r.outcome == "identity" for r in mine),
                "min_ratio": worst.ratio if worst else None,
                "min_at": str(worst.conversion) if worst else None}
            f = figures[m.name]
            ratio = f"{f['min_ratio']:.3g}x" if f["min_ratio"] is not None else "-"
            print(f"{m.name:28} {f['live']:>5} {f['killed']:>6} {ratio:>10} {f['identity']:>8} "
                  f"{f['unchanged']:>9}  {f['min_at'] or '-'}", flush=True)
        wall, used = time.perf_counter() - start, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"{name}: {wall:.0f} s wall, {used:.0f} s CPU, peak RSS {peak:.2f} GiB\n")
        report[name] = {"threshold": checker.checker.threshold, "endpoints": len(eps),
                        "mutations": figures, "wall_s": wall, "cpu_s": used}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    survived = sum(f["survived"] for g in report.values() for f in g["mutations"].values())
    return 1 if survived or any(math.isnan(g["threshold"]) for g in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of one training-equivalence check against the bare reference training it contains.

    python bench/bench_training.py [--rounds N] [--steps K]

"bare" is what any such check must do at least once: the dense reference's forward,
backward and AdamW step on the full batch (``train_reference``), from parameters already
drawn. "check" is ``TrainingCase.check``: the same reference, plus the sharded model on
the DP x TP mesh (split, one copy per DP replica, forward, vocab-parallel loss, backward,
TP and DP gradient reductions, AdamW on every shard, gathers) and the comparisons. The
"sharded" column is ``train_sharded`` alone. Rounds are interleaved (bare, sharded, check,
bare, ...) so machine noise hits all alike; medians shown.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from weight_sync_bench.model.config import TOY, TOY_KV4
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.floor import SMALL_VARIANTS, thresholds_for
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.step import TrainingCase


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [["case", "steps", "bare ref f+b+step", "sharded", "check", "check / bare"]]
    for config, mesh in ((TOY, Mesh(2, 2)), (TOY_KV4, Mesh(2, 4)), (SMALL_VARIANTS[1], Mesh(2, 2))):
        case = TrainingCase(config, mesh, seed=0, steps=args.steps,
                            spec=default_spec(config, packed=True))
        thresholds = thresholds_for(config)
        times: dict[str, list[float]] = {"bare": [], "sharded": [], "check": []}
        for _ in range(args.rounds):
            times["bare"].append(timed(case.reference))
            times["sharded"].append(timed(case.sharded))
            times["check"].append(timed(lambda: case.check(thresholds)))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append([f"{config.name} {mesh} packed", str(args.steps), f"{med['bare'] * 1e3:.0f} ms",
                     f"{med['sharded'] * 1e3:.0f} ms", f"{med['check'] * 1e3:.0f} ms",
                     f"{med['check'] / med['bare']:.2f}x"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\nmedians of {args.rounds} interleaved rounds, one torch thread")


if __name__ == "__main__":
    main()

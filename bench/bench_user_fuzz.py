"""Throughput of fuzzing a user's function against the harness's own invariant property.

    python bench/bench_user_fuzz.py [--examples N] [--seed S]

The properties run through Hypothesis under the same profile (``wsb-generate``: generation
only, no shrinking), the same number of examples and the same Hypothesis seed, after a
warm-up:

- ``harness invariant``: ``run_property("invariant")``, the harness's own reshard, over the
  user property's strategy (``user_cases("resharder")``: the very same cases), and over its
  own ``cases()`` for reference;
- ``user: the harness's reshard``: the user-function property with the harness's own
  ``reshard`` passed as the user's resharder: the same work per case plus everything the user
  path adds (the signature check, cloning the source shards, validating what came back, the
  declined and shipped-geometry bookkeeping);
- ``user: a hand-written resharder``: ``tests/fuzz/user_functions.reshard_correct`` (gathers
  the full model and cuts it again in plain torch), the user's own function's cost included;
- ``user: a hand-written splitter``: ``split_correct``.

Each row gives examples/s and the ratio to the first row. The cost the user path adds
around the function is row 3 against row 1 (the same cases, the same reshard); rows 4-5 add
the functions themselves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, settings
from weight_sync_bench.fuzz.strategies.user import user_cases

from weight_sync_bench.fuzz.runner import Tally, run_property
from weight_sync_bench.fuzz.user import UserFunction, UserStats, case_runner
from weight_sync_bench.layout.reshard import reshard
from weight_sync_bench.model.plan import layout_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fuzz"))
import user_functions

GENERATE = settings(phases=(Phase.generate,), database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def harness_reshard(shards, dst, *, config):
    return reshard(shards, layout_for(config), dst)


def timed_harness(examples: int, seed: int, strategy=None) -> tuple[int, float]:
    start = time.perf_counter()
    tally = run_property("invariant", profile="wsb-generate", max_examples=examples, seed=seed,
                         corpus=False, strategy=strategy)
    return tally.examples, time.perf_counter() - start


def timed_user(fn, role: str, examples: int, seed: int) -> tuple[int, float]:
    function = UserFunction(fn, role)
    stats = UserStats()
    start = time.perf_counter()
    run_property("invariant", function.label, profile="wsb-generate", max_examples=examples,
                 seed=seed, corpus=False, tally=Tally("invariant", function.label),
                 strategy=user_cases(role), case_runner=case_runner(function, stats))
    assert stats.first_failure_at is None, f"{function.label} failed"
    return stats.examples, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    torch.set_num_threads(1)
    timed_harness(20, args.seed)  # warm up: imports, the threshold rule's artifact, allocators
    timed_user(harness_reshard, "resharder", 20, args.seed)
    rows = [("harness invariant, the same cases", *timed_harness(
                args.examples, args.seed, strategy=user_cases("resharder"))),
            ("harness invariant, its own cases()", *timed_harness(args.examples, args.seed)),
            ("user: the harness's reshard as the user's", *timed_user(
                harness_reshard, "resharder", args.examples, args.seed)),
            ("user: a hand-written resharder", *timed_user(
                user_functions.reshard_correct, "resharder", args.examples, args.seed)),
            ("user: a hand-written splitter", *timed_user(
                user_functions.split_correct, "splitter", args.examples, args.seed))]
    base = rows[0][1] / rows[0][2]
    print(f"{'property':44} {'examples':>8} {'seconds':>8} {'examples/s':>11} {'vs row 1':>11}")
    for name, n, seconds in rows:
        rate = n / seconds
        print(f"{name:44} {n:8d} {seconds:8.2f} {rate:11.1f} {rate / base:10.2f}x")
    print(f"same profile (wsb-generate), {args.examples} examples each, Hypothesis seed "
          f"{args.seed}; one torch thread")


if __name__ == "__main__":
    main()

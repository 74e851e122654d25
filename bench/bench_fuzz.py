"""Throughput of the fuzzed invariant against the bare forward cost of the same examples.

    python bench/bench_fuzz.py [--examples N] [--toy-examples N] [--no-suite]

"property" runs the invariant property through Hypothesis (generation, the threshold rule,
reshard, byte comparison, diagnosis-free verdict): examples per second. "bare" then replays
the very cases the property ran, doing only what any check of them must: build the weights
and tokens from the seed, one reference forward, the declared split at dst and one sharded
forward. Overhead = property time / bare time, for TOY (the floor's token shape) and for
geometries drawn from the fuzz domain, side by side in one run. Last, the wall time of the
default test run (``pytest -n auto``, what ``make test`` runs) under the default profile.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from hypothesis import strategies as st
from weight_sync_bench.fuzz.strategies import cases

from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.fuzz.case import Case
from weight_sync_bench.fuzz.domain import fuzz_params, fuzz_tokens
from weight_sync_bench.fuzz.runner import Tally, run_property
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import TOY
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel


class Recording(Tally):
    """A tally that also keeps every case the property ran."""

    def __init__(self) -> None:
        super().__init__("invariant", None)
        self.cases: list[Case] = []

    def add(self, outcome) -> None:  # type: ignore[no-untyped-def]
        super().add(outcome)
        self.cases.append(outcome.case)


def toy_cases() -> st.SearchStrategy[Case]:
    degrees = layout_for(TOY).supported_degrees()
    return st.builds(Case, config=st.just(TOY), src=st.sampled_from(degrees),
                     dst=st.sampled_from(degrees), seed=st.integers(0, 2**16 - 1))


def bare(case: Case) -> None:
    params = fuzz_params(case.config, case.seed)
    tokens = fuzz_tokens(case.config, case.seed)
    ReferenceModel(case.config, params)(tokens)
    inprocess_forward(case.config, split(params, layout_for(case.config), case.dst), tokens)


def measure(label: str, strategy: st.SearchStrategy[Case], examples: int) -> list[str]:
    tally = Recording()
    start = time.perf_counter()
    run_property("invariant", None, profile="wsb-test", max_examples=examples, corpus=False,
                 strategy=strategy, tally=tally)
    prop = time.perf_counter() - start
    start = time.perf_counter()
    for case in tally.cases:
        bare(case)
    base = time.perf_counter() - start
    n = len(tally.cases)
    return [label, str(n), f"{n / prop:.1f}", f"{n / base:.1f}", f"{prop / base:.2f}x",
            f"{tally.max_ratio:.3g}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=300, help="fuzz-domain examples")
    parser.add_argument("--toy-examples", type=int, default=12, help="TOY examples")
    parser.add_argument("--no-suite", action="store_true", help="skip timing the test run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_property("invariant", None, profile="wsb-test", max_examples=5, corpus=False)  # warm-up
    rows = [["geometries", "examples", "property ex/s", "bare ex/s", "overhead", "max ratio"],
            measure("TOY (19.2M params)", toy_cases(), args.toy_examples),
            measure("fuzz domain", cases(), args.examples)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if not args.no_suite:
        env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.pop("WSB_PROFILE", None)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "-n", "auto", "-q"], env=env,
                              cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True)
        tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        print(f"\ndefault test run (pytest -n auto, profile wsb-test): "
              f"{time.perf_counter() - start:.1f}s wall, exit {done.returncode}: {tail}")


if __name__ == "__main__":
    main()

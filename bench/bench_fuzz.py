"""Throughput of the fuzzed invariant against the bare forward cost of the same examples.

    python bench/bench_fuzz.py [--examples N] [--toy-examples N] [--rounds N] [--no-suite]
                               [--cprofile N]

"property" runs the invariant property through Hypothesis (generation, the threshold rule,
reshard, byte comparison, diagnosis-free verdict): checked cases per second. An example
checks every degree pair of its drawn geometry (``case.run_pairs``), each pair a case.
"bare" then replays the very cases the property ran, doing only what any check of them
must: per geometry and seed, build the weights and tokens from the seed and run one
reference forward; per destination degree, the declared split and one sharded forward. Every
timed part starts with ``init_params``'s kept draws forgotten, so each draws its weights
(otherwise the bare replay, run after the property, cloned the property's draws: a tenth of
the bare work in the fuzz domain charged to the property alone).
Overhead = property time / bare time, for TOY (the floor's token shape), for geometries
drawn from the fuzz domain, and for the same draws checking their drawn pair only (the
design before 2026-12-03, so the two throughputs stand side by side in one run), with the
property's two halves apart: Hypothesis alone and the runner alone (``measure``). ``--rounds``
rounds are interleaved (each row once per round, the rows in turn), so that a change in the
machine's speed hits every row alike; the table shows each figure's median over the rounds,
and a line per round gives the fuzz domain's overhead in CPU time. Last, the wall time of the
default test run (``pytest -n auto``, what ``make test`` runs) under the default profile.

Then where the time goes: the property once more and the bare replay once more, with the
phases wrapped (``phases.py``: exclusive time of each function, this thread's CPU time),
each as a ratio to the bare replay's time, property and bare side by side. What no wrapper
covers of the property is Hypothesis's own work: generation, the target phase's
bookkeeping, shrinking, the database. Last, the floor no change to the harness's checking
can go below, beside the property: the bare work, the code under test (the reshard), reading
once every byte the byte comparisons compare (``read_floor``), and Hypothesis's own work.
``--cprofile N`` adds cProfile's N hottest functions (by own time) of the fuzz-domain property
run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hypothesis import strategies as st
from weight_sync_bench.fuzz.strategies import cases

import weight_sync_bench.check.checker as checker_module
import weight_sync_bench.fuzz.case as case_module
import weight_sync_bench.fuzz.runner as runner_module
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.fuzz.case import Case, Outcome, keeping_checkers, run_case, run_pairs
from weight_sync_bench.fuzz.domain import fuzz_params, fuzz_tokens
from weight_sync_bench.fuzz.floor import fuzz_threshold_rule
from weight_sync_bench.fuzz.runner import Tally, run_property
from weight_sync_bench.layout.reshard import reshard, split
from weight_sync_bench.layout.table import LayoutTable
from weight_sync_bench.model import plan as plan_module
from weight_sync_bench.model.config import TOY, clear_kept_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phases import Phases, hottest, side_by_side, table


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


def bare(cases: list[Case]) -> None:
    """What any check of ``cases`` must do: per (geometry, seed), the weights, the tokens and
    the reference forward once; per destination degree of it, the declared split and the
    sharded forward once (a forward does not depend on where the shards came from)."""
    dsts: dict[tuple, list[int]] = {}
    for case in cases:
        at = dsts.setdefault((case.config, case.seed), [])
        if case.dst not in at:
            at.append(case.dst)
    for (config, seed), degrees in dsts.items():
        params = fuzz_params(config, seed)
        tokens = fuzz_tokens(config, seed)
        ReferenceModel(config, params)(tokens)
        for dst in degrees:
            inprocess_forward(config, split(params, layout_for(config), dst), tokens)


def one_pair(case: Case, **kwargs: object) -> list[Outcome]:
    """The design before 2026-12-03, for comparison: an example checks its drawn pair only."""
    return [run_case(case, **kwargs)]


def measure(strategy: st.SearchStrategy[Case], examples: int,
            runner: Callable[..., list[Outcome]] = run_pairs) -> dict[str, float]:
    """The property, its bare replay, and the property's two halves apart: Hypothesis alone
    (the same run with each case's outcome replayed from a dict: derandomized, it draws the
    same examples) and ``runner`` (``run_pairs``) alone over the same examples, keeping checkers
    across them as ``run_property`` does. Each timed in wall time and in
    this process's CPU time: on a loaded machine the wall ratios carry the other processes'
    share of the cores (one thread here, so CPU time is this run's own work)."""
    tally, outcomes = Recording(), {}
    rule = fuzz_threshold_rule("1a")

    def recorded(case: Case, **kwargs: object) -> object:
        outcomes[case] = runner(case, **kwargs)
        return outcomes[case]

    def timed(work: Callable[[], object]) -> tuple[float, float]:
        clear_kept_params()  # each part draws its weights: none finds the last part's kept
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        return time.perf_counter() - wall, time.process_time() - cpu

    prop = timed(lambda: run_property(
        "invariant", None, profile="wsb-test", max_examples=examples, corpus=False,
        strategy=strategy, tally=tally, case_runner=recorded, threshold_rule=rule))
    base = timed(lambda: bare(tally.cases))
    engine = timed(lambda: run_property(
        "invariant", None, profile="wsb-test", max_examples=examples, corpus=False,
        strategy=strategy, case_runner=lambda case, **_: outcomes[case], threshold_rule=rule))

    def runner_alone() -> None:
        with keeping_checkers():  # as run_property runs it
            for case in outcomes:
                runner(case, threshold_rule=rule)

    alone = timed(runner_alone)
    figures = {"examples": len(outcomes), "pairs": len(tally.cases),
               "max_ratio": tally.max_ratio}
    for name, (wall, cpu) in {"prop": prop, "base": base, "engine": engine,
                              "alone": alone}.items():
        figures[f"{name}_wall"], figures[f"{name}_cpu"] = wall, cpu
    return figures


def row(label: str, rounds: list[dict[str, float]]) -> list[str]:
    """One table row: the median over ``rounds`` of each figure, each ratio taken within
    its round (against that round's bare replay) before the median."""
    def median(figure: Callable[[dict[str, float]], float]) -> float:
        return statistics.median(figure(r) for r in rounds)

    def ratio(part: str, clock: str) -> float:
        return median(lambda r: r[f"{part}_{clock}"] / r[f"base_{clock}"])

    first = rounds[0]
    return [label, f"{first['examples']:.0f} ({first['pairs']:.0f} pairs)",
            f"{median(lambda r: r['pairs'] / r['prop_wall']):.1f}",
            f"{median(lambda r: r['pairs'] / r['base_wall']):.1f}",
            *(f"{ratio(part, 'wall'):.2f}x / {ratio(part, 'cpu'):.2f}x"
              for part in ("prop", "engine", "alone")),
            f"{median(lambda r: (r['engine_cpu'] + r['alone_cpu']) / r['base_cpu']):.2f}x",
            f"{first['max_ratio']:.3g}"]


RESHARD = "reshard (the code under test)"


def wrapped(phases: Phases) -> Phases:
    """The phases of the property and of the bare replay (the same functions, where both
    run them), each in its own bucket."""
    c, k, r = case_module, checker_module, runner_module
    phases.wrap(c, "run_case", "run_pairs' and run_case's own lines")
    phases.wrap(c, "make_checker", "checker set-up")
    phases.wrap(checker_module.Checker, "__post_init__", "checker set-up")
    for module in (c, sys.modules[__name__]):
        phases.wrap(module, "fuzz_params", "drawing parameters from the seed")
        phases.wrap(module, "fuzz_tokens", "drawing tokens from the seed")
    phases.wrap(ReferenceModel, "__call__", "reference forward")
    phases.wrap(ShardedModel, "__call__", "sharded forward")
    phases.wrap(sys.modules[__name__], "inprocess_forward", "sharded forward")
    phases.wrap(k, "inprocess_forward", "sharded forward")
    for module in (k, sys.modules[__name__]):
        phases.wrap(module, "split", "declared split (src and dst)")
    phases.wrap(c, "reshard", RESHARD)
    phases.wrap(k, "reshard", RESHARD)
    phases.wrap(k, "reshard_tensor", RESHARD)
    phases.wrap(k, "validate_shards", "shard validation")
    phases.wrap(k, "mismatching", "byte comparison")
    phases.wrap(k, "bit_equal", "byte comparison")
    phases.wrap(k, "computing", "upcast to the computing dtype")
    phases.wrap(k.Checker, "verdict", "verdict construction")
    phases.wrap(k.Checker, "reshard_verdict", "verdict construction")
    phases.wrap(k.Checker, "reshard_matches", "the streamed comparison's own lines")
    phases.wrap(case_module.KeptCheckers, "find", "keeping checkers across examples")
    phases.wrap(case_module.KeptCheckers, "keep", "keeping checkers across examples")
    phases.wrap(k.Checker, "deviation", "logit comparison")
    phases.wrap(Tally, "add", "tally")
    phases.wrap(r, "event", "Hypothesis event() and target() calls")
    phases.wrap(r, "target", "Hypothesis event() and target() calls")
    for module in (plan_module, k, sys.modules[__name__]):
        phases.wrap(module, "layout_for", "building the layout table")
    phases.wrap(LayoutTable, "supported_degrees", "strategy: probing supported degrees")
    return phases


def read_floor(cases: list[Case], rule: object) -> float:
    """CPU seconds to read once every byte the property's byte comparisons read: each pair's
    resharded shards and the declared split at its destination, one ``aminmax`` over each
    tensor's bytes (the fastest single pass torch has here), the reshards themselves
    untimed. No byte comparison can cost less."""
    by: dict[tuple, list[Case]] = {}
    for case in cases:
        by.setdefault((case.config, case.seed, case.phase), []).append(case)
    spent = 0.0
    for (config, seed, phase), pairs in by.items():
        checker = case_module.make_checker(config, seed, phase=phase,
                                           threshold_rule=rule)  # type: ignore[arg-type]
        for case in pairs:
            out = reshard(checker.declared(case.src), checker.layout, case.dst)
            tensors = [t.reshape(-1).view(torch.uint8)
                       for shards in (out, checker.declared(case.dst))
                       for params in shards for t in params.values() if t.numel()]
            start = time.thread_time()
            for t in tensors:
                torch.aminmax(t)
            spent += time.thread_time() - start
    return spent


def breakdown(label: str, strategy: st.SearchStrategy[Case], examples: int
              ) -> tuple[list[tuple[str, float, float, dict[str, float]]], float]:
    """The property and its bare replay, each once more with the phases wrapped, and the
    read floor of the property's byte comparisons, as a ratio to the bare replay."""
    rule = fuzz_threshold_rule("1a")
    clear_kept_params()  # as in measure: each side draws its weights
    with wrapped(Phases(time.thread_time)).active() as prop:
        runner = prop.wrap_fn(run_pairs, "run_pairs' and run_case's own lines")
        timed_rule = prop.wrap_fn(rule, "threshold rule")
        tally = Recording()
        start = time.thread_time()
        run_property("invariant", None, profile="wsb-test", max_examples=examples,
                     corpus=False, strategy=strategy, tally=tally, case_runner=runner,
                     threshold_rule=timed_rule)
        prop_total = time.thread_time() - start
    clear_kept_params()
    with wrapped(Phases(time.thread_time)).active() as base:
        start = time.thread_time()
        bare(tally.cases)
        base_total = time.thread_time() - start
    return ([(f"{label}: property", base_total, prop_total, dict(prop.spent)),
             (f"{label}: bare", base_total, base_total, dict(base.spent))],
            read_floor(tally.cases, rule) / base_total)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=300, help="fuzz-domain examples")
    parser.add_argument("--toy-examples", type=int, default=12, help="TOY examples")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--no-suite", action="store_true", help="skip timing the test run")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print cProfile's N hottest functions of the fuzz-domain run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_property("invariant", None, profile="wsb-test", max_examples=5, corpus=False)  # warm-up
    kinds = {"TOY (19.2M params)": (toy_cases(), args.toy_examples, run_pairs),
             "fuzz domain": (cases(), args.examples, run_pairs),
             "fuzz domain, one pair an example": (cases(), args.examples, one_pair)}
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label in kinds}
    for _ in range(args.rounds):  # interleaved: each row once per round
        for label, (strategy, examples, runner) in kinds.items():
            rounds[label].append(measure(strategy, examples, runner))
    rows = [row(label, done) for label, done in rounds.items()]
    print(table([["geometries", "examples", "property pairs/s", "bare pairs/s",
                  "overhead wall / CPU", "Hypothesis alone wall / CPU",
                  "runner alone wall / CPU", "the two halves, CPU", "max ratio"], *rows]))
    print(f"(medians of {args.rounds} interleaved rounds; x the bare replay of the same cases, "
          "in wall time / in this process's CPU time; 'the two halves': Hypothesis alone + the "
          "runner alone, in CPU time, against the overhead's CPU figure: what the interaction of "
          "the two leaves)")
    print("fuzz domain, overhead in CPU time, round by round: " + ", ".join(
        f"{r['prop_cpu'] / r['base_cpu']:.2f}x" for r in rounds["fuzz domain"]))
    toy, toy_read = breakdown("TOY", toy_cases(), args.toy_examples)
    domain, domain_read = breakdown("fuzz domain", cases(), args.examples)
    columns = toy + domain
    print("\nwhere the time goes (exclusive CPU time, x the bare replay of the same examples; "
          "outside every wrapper: Hypothesis's own work, the replay loop, and the wrappers' own "
          "microsecond a call, so read 'Hypothesis alone' above for the engine's clean share):")
    print(side_by_side(columns, other="Hypothesis engine (outside every wrapped call)"))
    floors = [["geometries", "bare", "+ the reshard under test", "+ reading the compared "
               "bytes once", "+ Hypothesis alone", "= the floor", "the property"]]
    for label, (prop, _), read, kind in (("TOY", toy, toy_read, "TOY (19.2M params)"),
                                         ("fuzz domain", domain, domain_read, "fuzz domain")):
        _, base, total, spent = prop
        resharding = spent.get(RESHARD, 0.0) / base
        engine = statistics.median(r["engine_cpu"] / r["base_cpu"] for r in rounds[kind])
        floors.append([label, "1.00x", f"{resharding:.2f}x", f"{read:.2f}x", f"{engine:.2f}x",
                       f"{1 + resharding + read + engine:.2f}x", f"{total / base:.2f}x"])
    print("\nwhat no change to the harness's checking removes (CPU time, x the bare replay): "
          "the bare work, the code under test (the reshard bucket above), reading once every "
          "byte the comparisons compare, and Hypothesis's own work (its median round alone, "
          "from the first table); against the property as wrapped above:")
    print(table(floors))
    if args.cprofile:
        print("\ncProfile, the fuzz-domain property, hottest by own time:\n"
              + hottest(lambda: run_property("invariant", None, profile="wsb-test",
                                             max_examples=args.examples, corpus=False),
                        args.cprofile))
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

"""``wsb fuzz``, ``wsb mutants``, ``wsb floor``, ``wsb replay``: the fuzz layer's commands.

    wsb fuzz [--minutes M | --examples N] [--phase 1a|1b] [--profile P] [--mutation NAME ...]
    wsb mutants [--examples N] [--profile P]
    wsb floor --random N [--search M --keep K] [--seed S]
    wsb replay [PATH ...]

``register(subparsers)`` adds them to ``wsb``'s parser; each handler returns the exit status
(0 all held, 1 something failed) and is the only place here that prints. Progress goes to
stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from weight_sync_bench.check.checker import Forward
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.errors import WsbError
from weight_sync_bench.tolerance.artifacts import PHASES, artifact_path, write_artifact


def _forward(phase: str) -> Forward:
    """Phase 1a: every rank in this process. Phase 1b: the gloo rank pool (its threshold needs
    its own floor samples: ``wsb floor --random N --phase 1b``)."""
    if phase == "1a":
        return inprocess_forward
    from weight_sync_bench.check.forwards import gloo_forward
    return gloo_forward()


class _ProgressLine:
    """One progress line on stderr, rewritten in place on a terminal."""

    def __init__(self) -> None:
        self.live = sys.stderr.isatty()
        self.width = 0

    def show(self, text: str) -> None:
        if self.live:
            print("\r" + text.ljust(self.width), end="", file=sys.stderr, flush=True)
            self.width = len(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.live and self.width:
            print(file=sys.stderr)


def _run_fuzz(args: argparse.Namespace, **kwargs: object):  # -> FuzzReport
    from weight_sync_bench.fuzz.runner import FuzzReport, Progress, fuzz

    line = _ProgressLine()
    report = None
    for item in fuzz(phase=args.phase, profile=args.profile, master_seed=args.seed,
                     forward=_forward(args.phase), **kwargs):  # type: ignore[arg-type]
        if isinstance(item, Progress):
            line.show(item.line())
        elif isinstance(item, FuzzReport):
            report = item
    line.close()
    assert report is not None
    return report


def _positive(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a number > 0 (a budget of 0 examples would "pass" having tried none)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def cmd_fuzz(args: argparse.Namespace) -> int:
    from weight_sync_bench.fuzz.runner import find_smallest, format_report

    if args.find_smallest:
        for name in args.find_smallest:
            failure = find_smallest(name, profile=args.profile, phase=args.phase,
                                    forward=_forward(args.phase))
            print(f"{name}: {failure}")
        return 0

    budget = ({"examples": args.examples} if args.examples is not None
              else {"minutes": args.minutes if args.minutes is not None else 1.0})
    report = _run_fuzz(args, mutations=args.mutation, invariant=not args.mutation,
                       chunk=args.chunk, **budget)
    print(format_report(report))
    for failure in report.failures:
        print(f"\nFAIL {failure}")
    return 1 if report.failures else 0


def cmd_mutants(args: argparse.Namespace) -> int:
    from weight_sync_bench.fuzz.runner import format_report

    report = _run_fuzz(args, examples=args.examples, invariant=False, chunk=args.chunk,
                       mutations=args.mutation)
    print(format_report(report, matrix=True))
    survivors = [t.mutation for t in report.tallies if t.killed < t.examples - t.identity]
    for failure in report.failures:
        print(f"\nFAIL {failure}")
    if survivors:
        print(f"\nnot killed everywhere by 10x: {', '.join(map(str, survivors))}")
    return 1 if survivors or report.failures else 0


def cmd_floor(args: argparse.Namespace) -> int:
    from weight_sync_bench.fuzz.floor import (
        SampleProgress,
        format_rules,
        measure_random,
        plot,
        plot_path,
    )
    from weight_sync_bench.fuzz.runner import draw_floor_cases, search_worst_floors

    if args.random < 2:
        raise WsbError(f"--random needs at least 2 geometries, got {args.random}")
    forward = _forward(args.phase)
    cases, seed = draw_floor_cases(args.random, seed=args.seed)
    line = _ProgressLine()
    searched = []
    if args.search:
        line.show(f"searching {args.search} examples for the worst floor / max|logit| ...")
        searched = search_worst_floors(args.search, keep=args.keep, seed=seed, phase=args.phase,
                                       forward=forward)
    artifact = None
    for item in measure_random(cases, searched=searched, phase=args.phase, forward=forward,
                               profile="wsb-generate", hypothesis_seed=seed,
                               search_examples=args.search):
        if isinstance(item, SampleProgress):
            line.show(f"floor sample {item.done}/{item.total}: d_model={item.config.d_model} "
                      f"layers={item.config.n_layers} kv_heads={item.config.n_kv_heads}")
        else:
            artifact = item
    line.close()
    assert artifact is not None
    path = args.out or artifact_path(args.phase, kind="random_floor")
    write_artifact(artifact, path)
    png = path.with_suffix(".png") if args.out else plot_path(args.phase)
    plot(artifact, png)
    print(format_rules(artifact))
    print(f"wrote {path} and {png}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from weight_sync_bench.fuzz.corpus import format_replay, load_corpus, replay

    entries = load_corpus([Path(p) for p in args.paths] if args.paths else None)
    if not entries:
        print("no corpus entries to replay")
        return 0
    phases = {e.case.phase for e in entries}
    if len(phases) > 1:
        raise WsbError(f"replay one phase at a time: these entries mix phases {sorted(phases)}")
    results = list(replay(entries, forward=_forward(phases.pop())))
    print(format_replay(results))
    statuses = [r.status for r in results]
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f"; the project's claim holds on {sum(r.claim_holds for r in results)}/{len(results)}")
    return 0 if all(r.claim_holds for r in results) else 1


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``fuzz``, ``mutants``, ``floor`` and ``replay`` to ``wsb``."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--phase", choices=PHASES, default="1a")
        p.add_argument("--profile", default=None,
                       help="wsb-test, wsb-nightly, wsb-replay, wsb-generate (default: "
                            "$WSB_PROFILE, else wsb-test)")
        p.add_argument("--seed", type=int, default=None, help="master seed (default: random)")
        p.add_argument("--chunk", type=_positive(int), default=25, help="examples per round")
        p.add_argument("--mutation", action="append", choices=list(MUTATIONS), default=None,
                       help="only this mutation (repeatable)")

    fuzz = subparsers.add_parser("fuzz", help="fuzz every property; failures land in corpus/")
    budget = fuzz.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=_positive(float), default=None,
                        help="time budget (default 1)")
    budget.add_argument("--examples", type=_positive(int), default=None,
                        help="examples per property")
    budget.add_argument("--find-smallest", action="append", choices=list(MUTATIONS),
                        metavar="MUTATION", help="shrink the invariant's failure under this "
                        "mutation to its smallest geometry and write it to corpus/")
    common(fuzz)
    fuzz.set_defaults(func=cmd_fuzz)

    mutants = subparsers.add_parser("mutants", help="the mutation kill matrix")
    mutants.add_argument("--examples", type=_positive(int), default=40,
                         help="examples per mutation")
    common(mutants)
    mutants.set_defaults(func=cmd_mutants)

    floor = subparsers.add_parser("floor", help="floor samples on random geometries")
    floor.add_argument("--random", type=_positive(int), required=True, metavar="N",
                       help="number of geometries to sample")
    floor.add_argument("--search", type=int, default=0, metavar="M",
                       help="also search M examples (Hypothesis target phase) for the largest "
                            "floor / max|logit|, and sample the worst --keep of them")
    floor.add_argument("--keep", type=int, default=20)
    floor.add_argument("--phase", choices=PHASES, default="1a")
    floor.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    floor.add_argument("--out", type=Path, default=None,
                       help="default: tolerance/random_floor_<phase>.json (and .png)")
    floor.set_defaults(func=cmd_floor)

    replay = subparsers.add_parser("replay", help="re-measure and classify corpus entries")
    replay.add_argument("paths", nargs="*", help="entries (default: every file in corpus/)")
    replay.set_defaults(func=cmd_replay)

"""``python -m weight_sync_bench.tolerance``: measure a numerical floor and write its artifact.

Three kinds, each beside the code it measures: ``phase`` (the logits floor of phase 1a or 1b,
``check.floor``; the default, so ``python -m weight_sync_bench.tolerance --phase 1b`` reads as
it always did), ``training`` (``training.floor``) and ``sequence`` (``training.sequence_floor``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.tolerance import kernels
from weight_sync_bench.tolerance.artifacts import PHASES, artifact_path, write_artifact
from weight_sync_bench.training import floor as training_floor
from weight_sync_bench.training import sequence_floor

KINDS = ("phase", "training", "sequence")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m weight_sync_bench.tolerance",
        description="Measure a numerical floor and write its artifact under tolerance/: "
                    "phase (tolerance/phase<P>.json), training (training[_1b].json) or "
                    "sequence (sequence[_1b].json).")
    parser.add_argument("kind", nargs="?", choices=KINDS, default="phase")
    parser.add_argument("--phase", choices=PHASES, default="1a")
    parser.add_argument("--repetitions", type=int, default=None,
                        help=f"default: {phase_floor.REPETITIONS} (phase), "
                             f"{training_floor.REPETITIONS} (training, sequence)")
    parser.add_argument("--steps", type=int, default=training_floor.STEPS,
                        help="optimizer steps (training, sequence)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: the committed artifact's path under tolerance/")
    parser.add_argument("--kernel-sets", choices=("all", "current"), default="all",
                        help="all (default): measure once per CPU kernel set torch can use "
                             "here (ATEN_CPU_CAPABILITY), each in a process of its own, and "
                             "keep the worst; current: only the kernels this process runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.kernel_sets == "all":
        artifact = _across_kernel_sets(args)
        table = (phase_floor.format_table(artifact) if args.kind == "phase"
                 else training_floor.format_table(artifact))
        summary = f"kernel sets {', '.join(artifact['kernel_sets'])}; "
    elif args.kind == "phase":
        runner = None
        if args.phase == "1b":
            from weight_sync_bench.check.forwards import (
                phase1b_runner,  # the gloo launcher
            )
            runner = phase1b_runner()
        artifact = phase_floor.measure(args.phase, runner=runner,
                                       repetitions=args.repetitions or phase_floor.REPETITIONS)
        table, summary = phase_floor.format_table(artifact), ""
    else:
        measure = training_floor.measure if args.kind == "training" else sequence_floor.measure_sequence
        artifact = measure(args.repetitions or training_floor.REPETITIONS, args.steps,
                           args.phase)
        table = training_floor.format_table(artifact)
        summary = f"{len(artifact['cells'])} cells; "
    path = args.out or artifact_path(args.phase, kind=args.kind)
    write_artifact(artifact, path)
    print(table)
    print(f"{summary}wrote {path}")
    return 0


def _across_kernel_sets(args: argparse.Namespace) -> dict:
    """The same measurement under every available kernel set, merged (``tolerance.kernels``)."""
    argv = [args.kind, "--phase", args.phase, "--steps", str(args.steps)]
    if args.repetitions is not None:
        argv += ["--repetitions", str(args.repetitions)]
    measured = []
    with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as scratch:
        for kernel_set in kernels.available():
            print(f"measuring under ATEN_CPU_CAPABILITY={kernel_set} ...", flush=True)
            measured.append(kernels.measure_under(kernel_set, argv,
                                                  Path(scratch) / f"{kernel_set}.json"))
    return kernels.merge(measured)

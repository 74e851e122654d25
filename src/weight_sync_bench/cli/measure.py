"""``python -m weight_sync_bench.tolerance``: measure a numerical floor and write its artifact.

Four kinds, each beside the code it measures: ``phase`` (the logits floor of phase 1a or 1b,
``check.floor``; the default, so ``python -m weight_sync_bench.tolerance --phase 1b`` reads as
it always did; ``--dtype bf16`` measures the floor of bf16 weights, ``phase1a_bf16.json``),
``training`` (``training.floor``), ``sequence`` (``training.sequence_floor``) and
``geometry``: one geometry's floor (``--hf-config PATH --layers N``, or ``--config NAME``),
cached under ``tolerance/geometry/`` where checks of that geometry read it
(``tolerance.rules.floor_for``); a geometry already measured is not measured again
without ``--force``.

A measurement never silently replaces a committed artifact: it is written to ``--out PATH``,
or replaces the committed file only with ``--write``; a smaller sample (fewer repetitions)
than the file it replaces is refused without ``--force``; the old and new figures are
printed side by side. The exit status follows ``wsb``'s contract (``output.EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.cli.output import (
    EXIT_OK,
    ProgressLine,
    count,
    guard_target,
    refuse_smaller,
    side_by_side,
)
from weight_sync_bench.errors import FloorNotMeasured, InvalidConfig
from weight_sync_bench.model.config import CONFIGS, DTYPES, ModelConfig, config_by_name
from weight_sync_bench.tolerance import kernels
from weight_sync_bench.tolerance.artifacts import (
    PHASES,
    artifact_path,
    cpu_vendor,
    read_json,
    write_artifact,
)
from weight_sync_bench.tolerance.rules import (
    artifact_drift,
    cached_floor_path,
    derive_threshold,
    floor_for,
)
from weight_sync_bench.training import floor as training_floor
from weight_sync_bench.training import sequence_floor

KINDS = ("phase", "training", "sequence", "geometry")


def figures(kind: str, artifact: dict[str, Any]) -> list[tuple[str, str]]:
    """The numbers a reader compares between two measurements of one kind: the sample
    (repetitions, steps, cells) and the thresholds it implies, re-derived from the record."""
    rows = [("repetitions", str(artifact.get("repetitions", "?")))]
    try:
        if kind == "phase":
            rows += [("cells", str(len(artifact["cells"]))),
                     ("worst |error|", f"{artifact['worst_abs']:.4g}"),
                     ("threshold", f"{derive_threshold(artifact['worst_abs']):g}")]
        else:
            rows += [("steps", str(artifact.get("steps", "?"))),
                     ("cells", str(len(artifact["cells"])))]
            for regime in artifact["regimes"]:
                thresholds = training_floor.thresholds_from(artifact, regime)
                rows += [(f"{regime} {q}", f"{t:g}") for q, t in thresholds.items()]
    except (KeyError, TypeError, ValueError) as exc:
        rows.append(("unreadable", f"{type(exc).__name__}: {exc}"))
    return rows


def _compare(kind: str, old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, str]]:
    before, after = dict(figures(kind, old)), dict(figures(kind, new))
    return [(name, before.get(name, "-"), after.get(name, "-"))
            for name in dict.fromkeys([*after, *before])]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m weight_sync_bench.tolerance",
        description="Measure a numerical floor: phase (tolerance/phase<P>.json), training "
                    "(training[_1b].json) or sequence (sequence[_1b].json). Writes --out "
                    "PATH, or with --write replaces the committed artifact.")
    parser.add_argument("kind", nargs="?", choices=KINDS, default="phase")
    parser.add_argument("--phase", choices=PHASES, default="1a")
    parser.add_argument("--repetitions", type=count, default=None,
                        help=f"default: {phase_floor.REPETITIONS} (phase), "
                             f"{training_floor.REPETITIONS} (training, sequence)")
    parser.add_argument("--steps", type=count, default=training_floor.STEPS,
                        help="optimizer steps (training, sequence)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="the synced weights' dtype (phase, geometry): bf16 and fp16 "
                             "weights are compared bit-exactly and computed in fp32")
    what = parser.add_argument_group("geometry", "the geometry whose floor is measured")
    what.add_argument("--hf-config", type=Path, default=None, metavar="PATH",
                      help="a Hugging Face config.json (geometry)")
    what.add_argument("--config", default=None, choices=list(CONFIGS),
                      help="a built-in config (geometry)")
    what.add_argument("--layers", type=count, default=None,
                      help="override the HF config's num_hidden_layers (geometry)")
    what.add_argument("--vocab", type=count, default=None,
                      help="override the HF config's vocab_size (geometry)")
    what.add_argument("--batch", type=count, default=None, help="token batch (geometry)")
    what.add_argument("--seq-len", type=count, default=None, help="token length (geometry)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, help="write the artifact here")
    where.add_argument("--write", action="store_true",
                       help="replace the committed artifact under tolerance/")
    parser.add_argument("--force", action="store_true",
                        help="replace even a measurement of more repetitions than this one")
    parser.add_argument("--kernel-sets", choices=("all", "current"), default="all",
                        help="all (default): measure once per CPU kernel set torch can use "
                             "here (ATEN_CPU_CAPABILITY), each in a process of its own, and "
                             "keep the worst (tolerance.kernels); current: only the kernels "
                             "this process runs")
    return parser


def geometry_config(args: argparse.Namespace) -> ModelConfig:
    """The geometry ``--hf-config PATH`` (with ``--layers``, ``--vocab``) or ``--config
    NAME`` names, with ``--batch`` and ``--seq-len`` applied."""
    if (args.hf_config is None) == (args.config is None):
        raise InvalidConfig("geometry: pass exactly one of --hf-config PATH and --config NAME")
    if args.config is not None:
        if args.layers is not None or args.vocab is not None:
            raise InvalidConfig("geometry: --layers and --vocab apply to --hf-config only")
        config = config_by_name(args.config)
    else:
        config = ModelConfig.from_hf_config(args.hf_config, n_layers=args.layers,
                                            vocab=args.vocab)
    shape = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len)) if v}
    return config.replace(**shape) if shape else config


def measure_one_geometry(args: argparse.Namespace) -> int:
    """``geometry``: measure (or find already measured) one geometry's floor."""
    config = geometry_config(args)
    if not args.force:
        try:
            floor = floor_for(config, args.phase, args.dtype)
        except FloorNotMeasured:
            pass
        else:  # the per-geometry cache, or a committed floor that records this geometry
            elsewhere = artifact_drift(floor.artifact)
            if not elsewhere or floor.source != "geometry":
                print(f"{config.name}: already measured ({floor.path}), threshold "
                      f"{floor.threshold:g}; --force measures it again")
                return EXIT_OK
            # measured on another machine class or kernel set: measured here, merged in
            print(f"{config.name}: measured elsewhere ({floor.path}: {'; '.join(elsewhere)}); "
                  "measuring it here", flush=True)
    path = args.out or cached_floor_path(config, args.phase, args.dtype)
    old = read_json(path) if path.is_file() else None
    kept = kernels.kept_vendors(old, cpu_vendor(), force=args.force, where=str(path))
    # merged into another machine class's measurement: the same sample as it
    repetitions = args.repetitions or (old["repetitions"] if kept and old else
                                       phase_floor.GEOMETRY_REPETITIONS)
    if args.kernel_sets == "all":
        return _geometry_across_kernel_sets(args, config, repetitions, path, old)
    forward = None
    if args.phase == "1b":
        from weight_sync_bench.check.forwards import gloo_forward  # the gloo launcher
        forward = gloo_forward()
    print(f"measuring {config.name} (d_model {config.d_model}, {config.n_layers} layers, "
          f"{config.n_params:,} parameters, {args.dtype}) over {repetitions} seeds ...",
          flush=True)
    line = ProgressLine()  # rewritten in place on a terminal, sparse in a log
    try:
        artifact, path = phase_floor.measure_geometry(config, phase=args.phase,
                                                      dtype=args.dtype, repetitions=repetitions,
                                                      forward=forward, progress=line.show,
                                                      out=args.out)
    finally:
        line.close()
    merged = kernels.over(old, artifact, force=args.force, where=str(path))
    if merged is not artifact:  # the other machine classes it kept
        artifact = merged
        write_artifact(artifact, path)
    print(phase_floor.format_table(artifact))
    print(f"wrote {path}")
    return EXIT_OK


def _geometry_across_kernel_sets(args: argparse.Namespace, config: ModelConfig,
                                 repetitions: int, path: Path, old: dict[str, Any] | None
                                 ) -> int:
    """One geometry's floor under every available kernel set (``kernels.measure_under``, a
    process each), merged (``tolerance.kernels.merge``: each cell keeps its worst), with the
    other machine classes of ``old`` (the floor at ``path``) kept (``kernels.over``), and
    written to ``path`` (``--out``, or where ``floor_for`` reads it)."""
    argv = ["geometry", "--phase", args.phase, "--dtype", args.dtype,
            "--repetitions", str(repetitions), "--force"]
    for flag, value in (("--hf-config", args.hf_config), ("--config", args.config),
                        ("--layers", args.layers), ("--vocab", args.vocab),
                        ("--batch", args.batch), ("--seq-len", args.seq_len)):
        if value is not None:
            argv += [flag, str(value)]
    measured = []
    with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as scratch:
        for kernel_set in kernels.available():
            print(f"measuring {config.name} under ATEN_CPU_CAPABILITY={kernel_set} ...",
                  flush=True)
            measured.append(kernels.measure_under(kernel_set, argv,
                                                  Path(scratch) / f"{kernel_set}.json"))
    artifact = kernels.over(old, kernels.merge(measured), force=args.force, where=str(path))
    write_artifact(artifact, path)
    print(phase_floor.format_table(artifact))
    print(f"kernel sets {', '.join(artifact['kernel_sets'])}; wrote {path}")
    return EXIT_OK


def measure(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    if args.kind == "geometry":
        return measure_one_geometry(args)
    if args.dtype != "fp32" and args.kind != "phase":
        raise InvalidConfig(f"--dtype {args.dtype}: the {args.kind} floor is measured on fp32 "
                            "weights only")
    repetitions = args.repetitions or (phase_floor.REPETITIONS if args.kind == "phase"
                                       else training_floor.REPETITIONS)
    path = args.out or artifact_path(args.phase, kind=args.kind, dtype=args.dtype)
    old = guard_target(path, named=args.out is not None, write=args.write,
                       command=f"measuring the {args.kind} floor")
    if old is not None and isinstance(old.get("repetitions"), int):
        refuse_smaller(path, old=old["repetitions"], new=repetitions, what="repetitions",
                       force=args.force)
    kernels.kept_vendors(old, cpu_vendor(), force=args.force, where=str(path))
    if args.kernel_sets == "all":
        artifact = _across_kernel_sets(args, repetitions)
        table = (phase_floor.format_table(artifact) if args.kind == "phase"
                 else training_floor.format_table(artifact))
        summary = f"kernel sets {', '.join(artifact['kernel_sets'])}; "
    elif args.kind == "phase":
        runner, forward = None, None
        if args.phase == "1b":
            from weight_sync_bench.check.forwards import (  # the gloo launcher
                gloo_forward,
                phase1b_runner,
            )
            runner = phase1b_runner()
            forward = gloo_forward() if args.dtype != "fp32" else None
        artifact = phase_floor.measure(args.phase, runner=runner, repetitions=repetitions,
                                       dtype=args.dtype, forward=forward)
        table, summary = phase_floor.format_table(artifact), ""
    else:
        measure_kind = (training_floor.measure if args.kind == "training"
                        else sequence_floor.measure_sequence)
        artifact = measure_kind(repetitions, args.steps, args.phase)
        table = training_floor.format_table(artifact)
        summary = f"{len(artifact['cells'])} cells; "
    merged = kernels.over(old, artifact, force=args.force, where=str(path))
    if merged is not artifact:  # the machine classes it kept from the replaced artifact
        artifact = merged
        table = (phase_floor.format_table(artifact) if args.kind == "phase"
                 else training_floor.format_table(artifact))
        summary = f"kernel sets {', '.join(artifact['kernel_sets'])}; "
    write_artifact(artifact, path)
    print(table)
    if old is not None:
        print("\n" + side_by_side(_compare(args.kind, old, artifact), f"replaced ({path.name})",
                                  "new"))
    print(f"{summary}wrote {path}")
    return EXIT_OK


def _across_kernel_sets(args: argparse.Namespace, repetitions: int) -> dict[str, Any]:
    """The same measurement under every available kernel set, merged (``tolerance.kernels``)."""
    argv = [args.kind, "--phase", args.phase, "--steps", str(args.steps),
            "--repetitions", str(repetitions), "--dtype", args.dtype]
    measured = []
    with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as scratch:
        for kernel_set in kernels.available():
            print(f"measuring under ATEN_CPU_CAPABILITY={kernel_set} ...", flush=True)
            measured.append(kernels.measure_under(kernel_set, argv,
                                                  Path(scratch) / f"{kernel_set}.json"))
    return kernels.merge(measured)


def main(argv: list[str] | None = None) -> int:
    from weight_sync_bench.cli.main import run  # the exit-code contract, applied once

    args = build_parser().parse_args(argv)
    return run(measure, args, "python -m weight_sync_bench.tolerance")

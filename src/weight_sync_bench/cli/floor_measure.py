"""``wsb floor phase | training | sequence | geometry``: one measurement under every CPU
kernel set, a process each, merged (``tolerance.kernels.merge``), kept beside the other CPU
vendors' figures of the artifact it is written over (``tolerance.kernels.over``)."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.cli import floor_report as report
from weight_sync_bench.cli.checkpoint import guard
from weight_sync_bench.cli.output import (
    EXIT_OK,
    ProgressLine,
    Ticker,
    duration,
    guard_target,
    refuse_smaller,
    side_by_side,
)
from weight_sync_bench.errors import FloorNotMeasured, InvalidConfig
from weight_sync_bench.model.config import ModelConfig, config_by_name, hf_config_file
from weight_sync_bench.tolerance import kernels
from weight_sync_bench.tolerance.artifacts import (
    artifact_path,
    cpu_vendor,
    kernel_set_label,
    read_json,
    running_kernel_set,
    write_artifact,
)
from weight_sync_bench.tolerance.rules import artifact_drift, cached_floor_path, floor_for
from weight_sync_bench.training import floor as training_floor


def each_kernel_set(argv: list[str], scratch: Path, line: ProgressLine,
                    sets: list[str] | None = None) -> list[dict[str, Any]]:
    """``wsb floor *argv`` measured under every kernel set this machine runs (``sets``, where
    the caller already asked ``kernels.available``: a fresh process each), a process each
    (``kernels.measure_under``), its progress line relayed behind the kernel set, with the
    time the sets before it took: their artifacts, in order."""
    sets = sets if sets is not None else kernels.available()
    measured, took = [], []
    for k, kernel_set in enumerate(sets, start=1):
        started = time.monotonic()
        after = (f" (then {len(sets) - k} more at ~{duration(sum(took) / len(took))} each)"
                 if took and k < len(sets) else "")
        prefix = f"kernel set {k}/{len(sets)} {kernel_set}"

        def relay(text: str, prefix: str = prefix, after: str = after) -> None:
            line.show(f"{prefix}: {text}{after}")
        relay("starting")
        measured.append(kernels.measure_under(kernel_set, argv, scratch / f"{kernel_set}.json",
                                              progress=relay))
        took.append(time.monotonic() - started)
    return measured

def measuring(sets: list[str] | None) -> list[str]:
    """The kernel sets, with this CPU's vendor, a measurement will hold: ``sets`` (what
    ``--kernel-sets all`` measures, ``kernels.available()``), or, None, the one this process
    runs (``--kernel-sets current``)."""
    if sets is None:
        return [running_kernel_set()]
    return [kernel_set_label(cpu_vendor(), k.upper()) for k in sets]


def ticker(line: ProgressLine) -> Callable[[int, int, str], None] | None:
    return Ticker(line) if line.enabled else None


# -- phase, training, sequence


def measure_kind(args: argparse.Namespace, line: ProgressLine) -> int:
    if args.dtype != "fp32" and args.kind != "phase":
        raise InvalidConfig(f"--dtype {args.dtype}: the {args.kind} floor is measured on fp32 "
                            "weights only")
    if args.dtype.startswith("fp8") and args.phase != "1a":
        raise InvalidConfig(f"--dtype {args.dtype}: an FP8 destination is checked in process, "
                            "phase 1a only")
    repetitions = args.repetitions or (phase_floor.REPETITIONS if args.kind == "phase"
                                       else training_floor.REPETITIONS)
    path = args.out or artifact_path(args.phase, kind=args.kind, dtype=args.dtype)
    old = guard_target(path, named=args.out is not None, write=args.write,
                       command=f"measuring the {args.kind} floor")
    if old is not None and isinstance(old.get("repetitions"), int):
        refuse_smaller(path, old=old["repetitions"], new=repetitions, what="repetitions",
                       force=args.force)
    sets = kernels.available() if args.kernel_sets == "all" else None
    kernels.kept_vendors(old, cpu_vendor(), force=args.force, where=str(path),
                         measuring=measuring(sets))
    if sets is not None:
        argv = [args.kind, "--phase", args.phase, "--steps", str(args.steps),
                "--repetitions", str(repetitions), "--dtype", args.dtype]
        with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as scratch:
            artifact = kernels.merge(each_kernel_set(argv, Path(scratch), line, sets))
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
                                       dtype=args.dtype, forward=forward,
                                       progress=ticker(line))
    else:
        from weight_sync_bench.training.sequence_floor import measure_sequence

        measure = training_floor.measure if args.kind == "training" else measure_sequence
        artifact = measure(repetitions, args.steps, args.phase, progress=ticker(line))
    artifact = kernels.over(old, artifact, force=args.force, where=str(path))
    write_artifact(artifact, path)
    line.close()
    print(report.phase_table(artifact) if args.kind == "phase"
          else report.training_table(artifact))
    if old is not None:
        print("\n" + side_by_side(report.compared(args.kind, old, artifact),
                                  f"replaced ({path.name})", "new"))
    print(_wrote(artifact, path))
    return EXIT_OK

def _wrote(artifact: dict[str, Any], path: Path) -> str:
    sets = artifact.get("kernel_sets")
    what = (f"kernel sets {', '.join(sets)}; " if sets else
            f"{len(artifact['cells'])} cells; " if "regimes" in artifact else "")
    return f"{what}wrote {path}"


# -- geometry


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
        config = ModelConfig.from_hf_config(hf_config_file(args.hf_config), n_layers=args.layers,
                                            vocab=args.vocab)
    shape = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len)) if v}
    return config.replace(**shape) if shape else config

def measure_geometry(args: argparse.Namespace, line: ProgressLine) -> int:
    """``geometry``: measure (or find already measured) one geometry's floor: measured here
    where no floor covers it, or where the one that does was measured on another machine
    class or kernel set (merged in); ``--force`` measures it again anyway."""
    if args.dtype.startswith("fp8"):
        raise InvalidConfig(f"--dtype {args.dtype}: an FP8 destination's floor is measured for "
                            "the committed configs (wsb floor phase --dtype ...); another "
                            "geometry's is measured by each check on its dequantized weights")
    config = geometry_config(args)
    guard(args, config, unit="layer" if args.phase == "1a" else "model")  # 1a: streamed
    # a user's floor cache by default; --write: the harness's committed tolerance/geometry/
    path = args.out or cached_floor_path(config, args.phase, args.dtype, committed=args.write)
    try:
        floor = None if args.force else floor_for(config, args.phase, args.dtype)
    except FloorNotMeasured:
        floor = None
    # the per-geometry floors, or a committed floor that records this geometry; with
    # --write, one measured only into a user's cache is measured again for the checkout
    if floor is not None and not (args.write and floor.source == "geometry"
                                  and floor.path != path):
        elsewhere = artifact_drift(floor.artifact)
        if not elsewhere or floor.source != "geometry":
            print(f"{config.name}: already measured ({floor.path}), threshold "
                  f"{floor.threshold:g}; --force measures it again")
            return EXIT_OK
        # measured on another machine class or kernel set: measured here, merged in
        print(f"{config.name}: measured elsewhere ({floor.path}: {'; '.join(elsewhere)}); "
              "measuring it here", flush=True)
    old = read_json(path) if path.is_file() else None
    sets = kernels.available() if args.kernel_sets == "all" else None
    kept = kernels.kept_vendors(old, cpu_vendor(), force=args.force, where=str(path),
                                measuring=measuring(sets))
    # merged into another machine class's measurement: the same sample as it
    repetitions = args.repetitions or (old["repetitions"] if kept and old else
                                       phase_floor.GEOMETRY_REPETITIONS)
    print(f"measuring {config.name} (d_model {config.d_model}, {config.n_layers} layers, "
          f"{config.n_params:,} parameters, {args.dtype}) over {repetitions} seeds ...",
          flush=True)
    if sets is not None:
        argv = ["geometry", "--phase", args.phase, "--dtype", args.dtype,
                "--repetitions", str(repetitions), "--force"]
        for flag, value in (("--hf-config", args.hf_config), ("--config", args.config),
                            ("--layers", args.layers), ("--vocab", args.vocab),
                            ("--batch", args.batch), ("--seq-len", args.seq_len),
                            ("--max-gib", args.max_gib), ("--max-gflop", args.max_gflop)):
            if value is not None:
                argv += [flag, str(value)]
        with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as scratch:
            artifact = kernels.merge(each_kernel_set(argv, Path(scratch), line, sets))
    else:
        forward = None
        if args.phase == "1b":
            from weight_sync_bench.check.forwards import gloo_forward  # the gloo launcher
            forward = gloo_forward()
        artifact, _ = phase_floor.measure_geometry(
            config, phase=args.phase, dtype=args.dtype, repetitions=repetitions,
            forward=forward, progress=ticker(line), out=path)
    artifact = kernels.over(old, artifact, force=args.force, where=str(path))
    write_artifact(artifact, path)
    line.close()
    print(report.phase_table(artifact))
    print(_wrote(artifact, path))
    return EXIT_OK

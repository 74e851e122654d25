"""``wsb floor random | replicated-kv | moe``: floor samples on random geometries of the fuzz
domain (``fuzz.floor``), drawn anew or the samples of an artifact measured again; under every
CPU kernel set, a process each re-measuring every sample (``--from PATH --kernel-sets
current``), merged into the artifact beside the kernel sets and CPU vendors it holds
(``tolerance.kernels.merge_kernel_sets``; a validation's, ``merge_replicated_kv`` and
``merge_moe``)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weight_sync_bench.check.forwards import phase_forward
from weight_sync_bench.cli import floor_report as report
from weight_sync_bench.cli.floor_measure import each_kernel_set, ticker
from weight_sync_bench.cli.output import (
    EXIT_OK,
    ProgressLine,
    Ticker,
    apply_deadline,
    guard_target,
    refuse_smaller,
    side_by_side,
)
from weight_sync_bench.errors import ArtifactProtected, WsbError
from weight_sync_bench.tolerance import kernels
from weight_sync_bench.tolerance.artifacts import (
    artifact_path,
    cpu_vendor,
    environment,
    plot_path,
    read_json,
    running_kernel_set,
    write_artifact,
)
from weight_sync_bench.tolerance.sampled import (
    load_random_floor,
    load_replicated_kv,
    replicated_kv_path,
    rule_from,
)
from weight_sync_bench.tolerance.sampled_moe import load_moe, moe_path

# -- random: floor samples on random geometries


def measure_random(args: argparse.Namespace, line: ProgressLine) -> int:
    """``random``: new samples (``--random N``), or the samples of an artifact measured again
    (``--from PATH``, default the committed one, under every kernel set unless ``current``):
    the samples re-measured per kernel set keep every other kernel set's figures, on any CPU
    vendor, and the rule is derived again."""
    if args.random is None:
        return _random_again(args, line)
    if args.source is not None:
        raise WsbError("--from re-measures an existing artifact's samples: it takes "
                       "--kernel-sets all, not --random")
    if args.random < 2:
        raise WsbError(f"--random needs at least 2 geometries, got {args.random}")
    if args.search and args.keep > args.search:
        raise WsbError(f"--keep {args.keep} > --search {args.search}: cannot keep more of the "
                       "searched examples than were tried")
    from weight_sync_bench.fuzz.floor import SampleProgress
    from weight_sync_bench.fuzz.floor import measure_random as sample
    from weight_sync_bench.fuzz.runner import draw_floor_cases, search_worst_floors

    path = args.out or artifact_path(args.phase, kind="random_floor")
    old = guard_target(path, named=args.out is not None, write=args.write,
                       command="this measurement")
    kept = args.keep if args.search else 0
    if old is not None:
        refuse_smaller(path, old=int(old.get("geometries", 0)) + int(old.get("searched", 0)),
                       new=args.random + kept, what="geometries (random + searched)",
                       force=args.force)
    _new_draw_over(old, path, "random", force=args.force)
    apply_deadline(args.deadline, args.phase == "1b")
    forward = phase_forward(args.phase)
    cases, hypothesis_seed = draw_floor_cases(args.random, seed=args.seed)
    searched = []
    artifact = None
    if args.search:
        line.show(f"searching {args.search} examples for the worst floor / max|logit| ...")
        searched = search_worst_floors(args.search, keep=args.keep, seed=hypothesis_seed,
                                       phase=args.phase, forward=forward)
    tick = Ticker(line)
    for item in sample(cases, searched=searched, phase=args.phase, forward=forward,
                       profile="wsb-generate", hypothesis_seed=hypothesis_seed,
                       search_examples=args.search or 0):
        if isinstance(item, SampleProgress):
            tick(item.done, item.total, f"floor sample d_model={item.config.d_model} "
                 f"layers={item.config.n_layers} kv_heads={item.config.n_kv_heads}")
        else:
            artifact = item
    assert artifact is not None
    if args.kernel_sets == "all":
        with tempfile.TemporaryDirectory(prefix="wsb-floor-") as scratch:
            fresh = Path(scratch) / "fresh.json"
            write_artifact(artifact, fresh)
            artifact = _samples_per_kernel_set("random", fresh, args.phase, Path(scratch), line)
    return _write_samples("random", artifact, path, old, line,
                          png=path.with_suffix(".png") if args.out else plot_path(args.phase))

def _random_again(args: argparse.Namespace, line: ProgressLine) -> int:
    """``random --from PATH``: an artifact's samples measured again, under every kernel set
    (each a process running ``random --from PATH --kernel-sets current``), or under the
    running one only where ``--from`` names the artifact."""
    if args.kernel_sets != "all" and args.source is None:
        raise WsbError("wsb floor: pass --random N to measure new samples, or --kernel-sets "
                       "all to re-measure an artifact's samples under every kernel set")
    for flag, value in (("--search", args.search), ("--seed", args.seed)):
        if value is not None:
            raise WsbError(f"{flag} applies to --random N, not to a re-measurement")
    source = args.source or artifact_path(args.phase, kind="random_floor")
    load_random_floor(args.phase, source)  # a typed error for a missing or foreign file
    path = args.out or artifact_path(args.phase, kind="random_floor")
    old = guard_target(path, named=args.out is not None, write=args.write,
                       command="re-measuring the floors")
    apply_deadline(args.deadline, args.phase == "1b")
    if args.kernel_sets == "current":
        return _samples_here("random", source, args.phase, path, line)
    with tempfile.TemporaryDirectory(prefix="wsb-floor-") as scratch:
        artifact = _samples_per_kernel_set("random", source, args.phase, Path(scratch), line)
    return _write_samples("random", artifact, path, old, line,
                          png=path.with_suffix(".png") if args.out else plot_path(args.phase))

def _samples_here(kind: str, source: Path, phase: str, path: Path, line: ProgressLine) -> int:
    """The samples of the artifact at ``source`` (a random-geometry floor, or a ``kind``
    ``replicated-kv`` or ``moe`` validation) measured again under the kernel set this process
    runs and merged into it: one kernel set's part of ``_samples_per_kernel_set``."""
    from weight_sync_bench.fuzz.floor import (
        remeasure_floors,
        remeasure_moe_floors,
        remeasure_replicated_floors,
    )

    measured = read_json(source)
    if kind == "random":
        floors = remeasure_floors(measured, forward=phase_forward(phase), progress=ticker(line))
        merge = kernels.merge_kernel_sets
    elif kind == "moe":
        floors = remeasure_moe_floors(measured, progress=ticker(line))
        merge = kernels.merge_moe
    else:
        floors = remeasure_replicated_floors(measured, progress=ticker(line))
        merge = kernels.merge_replicated_kv
    here = environment()
    write_artifact(merge(measured, {running_kernel_set(here): floors}, here), path)
    line.close()
    print(f"kernel set {running_kernel_set(here)}; wrote {path}")
    return EXIT_OK

def _samples_per_kernel_set(kind: str, source: Path, phase: str, scratch: Path,
                            line: ProgressLine) -> dict[str, Any]:
    """The samples of the artifact at ``source`` measured again under every kernel set (a
    process each: ``wsb floor <kind> --from source --kernel-sets current``), merged into it
    (``kernels.merge_kernel_sets``; a validation's figures under the rule in force,
    ``kernels.merge_replicated_kv`` and ``kernels.merge_moe``)."""
    floors: dict[str, list[float]] = {}
    for measured in each_kernel_set([kind, "--phase", phase, "--from", str(source)], scratch,
                                    line):
        floors.update(kernels.sample_floors(measured))
    if kind == "random":
        return kernels.merge_kernel_sets(read_json(source), floors, environment())
    merge = kernels.merge_moe if kind == "moe" else kernels.merge_replicated_kv
    return merge(read_json(source), floors, environment(), rule_from(load_random_floor(phase)))

def _write_samples(kind: str, artifact: dict[str, Any], path: Path,
                   old: dict[str, Any] | None, line: ProgressLine, *,
                   png: Path | None = None) -> int:
    write_artifact(artifact, path)
    if png is not None:
        report.plot(artifact, png)
    line.close()
    if kind == "random":
        print(report.rules_table(artifact))
    elif kind == "moe":
        print(report.moe_table(artifact))
    else:
        print(report.validation_table(artifact))
    if "kernel_sets" in artifact:
        print("\n" + report.kernel_sets_table(artifact))
    if old is not None:
        print("\n" + side_by_side(report.compared(kind, old, artifact),
                                  f"replaced ({path.name})", "new"))
    print(f"wrote {path}" + (f" and {png}" if png is not None else ""))
    return EXIT_OK

def _new_draw_over(old: dict[str, Any] | None, path: Path, kind: str, *, force: bool) -> None:
    """Refuse, before anything is drawn, new samples written over an artifact that holds
    other CPU vendors' figures (a new draw cannot keep them: they are of other samples),
    unless ``--force``; its samples measured here keep them (``--from``)."""
    others = kernels.kept_vendors(old, cpu_vendor(), force=force, where=str(path))
    if others:
        raise ArtifactProtected(
            f"{path} holds measurements on {', '.join(others)}, which new samples would drop: "
            f"measure its samples here with `wsb floor {kind} --from {path} --kernel-sets all` "
            "(they keep the other vendors' figures), or pass --force to replace them")


# -- replicated-kv: the rule validated on vLLM's replicated-KV forward


def measure_replicated(args: argparse.Namespace, line: ProgressLine) -> int:
    """``replicated-kv``: the validation drawn anew (``--geometries N --seed S``), or the
    samples of one measured again (``--from PATH``), under every kernel set."""
    from weight_sync_bench.fuzz.floor import (
        draw_replicated_geometries,
        measure_replicated_kv,
    )

    return _measure_validation(
        "replicated-kv", args, line, path=args.out or replicated_kv_path(args.phase),
        load=load_replicated_kv, what="the replicated-KV validation",
        measure=lambda: measure_replicated_kv(
            draw_replicated_geometries(args.geometries, args.seed), phase=args.phase,
            seed=args.seed, progress=ticker(line)))


# -- moe: the rule validated on the Mixture-of-Experts forwards


def measure_moe(args: argparse.Namespace, line: ProgressLine) -> int:
    """``moe``: the validation drawn anew (``--geometries N --seed S``: MoE geometries drawn
    as the MoE fuzz draws them, ``fuzz.runner.draw_moe_cases``), or the samples of one
    measured again (``--from PATH``), under every kernel set."""
    import hypothesis

    from weight_sync_bench.fuzz.floor import measure_moe as sample
    from weight_sync_bench.fuzz.runner import draw_moe_cases

    draw = (f"fuzz.runner.draw_moe_cases({args.geometries}, seed={args.seed}) under "
            f"Hypothesis {hypothesis.__version__}")
    return _measure_validation(
        "moe", args, line, path=args.out or moe_path(args.phase), load=load_moe,
        what="the MoE validation",
        measure=lambda: sample(draw_moe_cases(args.geometries, seed=args.seed),
                               phase=args.phase, hypothesis_seed=args.seed, draw=draw,
                               progress=ticker(line)))


def _measure_validation(kind: str, args: argparse.Namespace, line: ProgressLine, *,
                        path: Path, load: Callable[[str, Path], dict[str, Any]], what: str,
                        measure: Callable[[], dict[str, Any]]) -> int:
    """A validation of the random-geometry rule on another forward (``kind``
    ``replicated-kv`` or ``moe``): ``measure()`` drawn anew, or the samples of ``--from PATH``
    measured again, under every kernel set (or the running one), written to ``path``."""
    old = guard_target(path, named=args.out is not None, write=args.write,
                       command=f"measuring {what}")
    if args.source is not None:
        load(args.phase, args.source)  # a typed error for a missing file
        if args.kernel_sets == "current":
            return _samples_here(kind, args.source, args.phase, path, line)
        with tempfile.TemporaryDirectory(prefix=f"wsb-{kind}-") as scratch:
            artifact = _samples_per_kernel_set(kind, args.source, args.phase, Path(scratch),
                                               line)
        return _write_samples(kind, artifact, path, old, line)
    _new_draw_over(old, path, kind, force=args.force)
    artifact = measure()
    if args.kernel_sets == "all":
        with tempfile.TemporaryDirectory(prefix=f"wsb-{kind}-") as scratch:
            first = Path(scratch) / "artifact.json"
            write_artifact(artifact, first)
            artifact = _samples_per_kernel_set(kind, first, args.phase, Path(scratch), line)
    return _write_samples(kind, artifact, path, old, line)

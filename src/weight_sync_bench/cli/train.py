"""``wsb train-check``: training equivalence on the command line. Prints; computes nothing.

    wsb train-check [--config NAME|all] [--dp D --tp T] [--steps K] [--batch unpacked|packed|both]
    wsb train-check --gloo [--config NAME] [--dp D --tp T] [--sp] [--cp C] ...  # one process per rank
    wsb train-check --mutations [--gloo] [--config NAME] ...  # the training-mutation matrix
    wsb train-check [--sp] [--cp C] ...                 # sequence / context parallel meshes

Each compared quantity is printed with its deviation, its threshold (from
tolerance/training.json, or tolerance/sequence.json for SP / CP meshes) and the ratio.
With ``--sp`` or ``--cp`` the meshes are the sequence-sharding ones (``--sp``: SP on;
``--cp C``: C context chunks), and ``--mutations`` adds the sequence mutations. ``--gloo``
trains every mesh one process per rank (``dp * cp * tp`` ranks; by default dp = 1 and at
most ``GLOO_RANKS`` ranks, any size that ``--dp`` or ``--cp`` asks for) against the phase 1b
floors (tolerance/training_1b.json, sequence_1b.json); a (config, mesh) those floors have no
cell for is refused before any rank starts (``training.floor.require_mesh``: exit 2, naming
the mesh and the command that measures it), never judged by another mesh's threshold.
Exit status (``output.EXIT_CODES``): 0 when every check passes (with ``--mutations``: when
every mutation that is not the identity is detected), 1 otherwise; every count, degree and
seed is validated (``--dp 0`` is an error, never a run at 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from weight_sync_bench import memory
from weight_sync_bench.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Output,
    add_deadline_option,
    add_output_options,
    apply_deadline,
    count,
    seed,
)
from weight_sync_bench.errors import InvalidConfig, InvalidMesh, WsbError
from weight_sync_bench.model.config import CONFIGS, ModelConfig
from weight_sync_bench.tolerance.rules import check_environment
from weight_sync_bench.tolerance.training import load
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.compare import Trace, TrainingReport
from weight_sync_bench.training.floor import (
    SMALL_VARIANTS,
    TOY_VARIANTS,
    meshes,
    thresholds_for,
    thresholds_on,
)
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import (
    ALL_TRAINING_MUTATIONS,
    TRAINING_MUTATIONS,
    MatrixRow,
    mutation_matrix,
)
from weight_sync_bench.training.sequence_floor import load_sequence, sequence_meshes
from weight_sync_bench.training.sequence_floor import (
    thresholds_for as sequence_thresholds,
)
from weight_sync_bench.training.step import Params, TrainingCase

TRAIN_CONFIGS: dict[str, ModelConfig] = {
    **CONFIGS, TOY_VARIANTS.name: TOY_VARIANTS, **{c.name: c for c in SMALL_VARIANTS}}


def _configs(name: str) -> list[ModelConfig]:
    if name == "all":
        return list(TRAIN_CONFIGS.values())
    if name not in TRAIN_CONFIGS:
        raise InvalidConfig(f"unknown config {name!r}; known: {', '.join(TRAIN_CONFIGS)}, all")
    return [TRAIN_CONFIGS[name]]


def _weights(args: argparse.Namespace) -> tuple[ModelConfig, Params]:
    """``--weights DIR``: the geometry (an HF directory's config.json, else --config) and
    the parameters, in fp32 (AdamW trains fp32 parameters; bf16 values convert exactly)."""
    from weight_sync_bench.check.weights import held_weights
    from weight_sync_bench.cli.checkpoint import weights_geometry
    from weight_sync_bench.model.stepwise import computing

    if _sequence(args):
        raise WsbError("--weights trains DP x TP meshes; --sp / --cp on your weights is not "
                       "built (their floor domain is measured on its own)")
    if args.config == "all":
        raise WsbError("--weights holds one model: give its --config NAME, not all")
    given = _configs(args.config)[0] if args.config is not None else None
    config = weights_geometry(args.weights, given, "--config NAME")
    return config, computing(held_weights(args.weights, config))


def _cases(args: argparse.Namespace, weights: tuple[ModelConfig, Params] | None = None
           ) -> list[TrainingCase]:
    cases = []
    packings = {"unpacked": [False], "packed": [True], "both": [False, True]}[args.batch]
    configs = [weights[0]] if weights is not None else _configs(args.config or "toy")
    for config in configs:
        for packed in packings:
            spec = default_spec(config, packed=packed)
            if _sequence(args):
                shapes = [m for m in sequence_meshes(config, spec.rows, spec.seq_len)
                          if m.sp == args.sp and args.cp in (None, m.cp)]
            else:
                shapes = meshes(config, spec.rows)
            shapes = [m for m in shapes if args.dp in (None, m.dp) and args.tp in (None, m.tp)
                      and not (args.gloo and not _over_gloo(args, m))]
            if not shapes and (args.dp is not None or args.tp is not None or _sequence(args)):
                # validated (and rejected) below
                shapes = [Mesh(1 if args.dp is None else args.dp, 1 if args.tp is None else args.tp,
                               args.sp, 1 if args.cp is None else args.cp)]
            cases += [TrainingCase(config, m, args.seed, args.steps, spec,
                                   weights[1] if weights is not None else None)
                      for m in shapes]
    return cases


GLOO_RANKS = 4  # --gloo's default meshes: at most this many rank processes (2 cores here)


def _ranks(mesh: Mesh) -> int:
    return mesh.dp * mesh.cp * mesh.tp


def _over_gloo(args: argparse.Namespace, mesh: Mesh) -> bool:
    """--gloo's default meshes: dp = 1 unless --dp is given, and at most GLOO_RANKS ranks
    unless --dp or --cp asks for more."""
    if args.dp is None and mesh.dp != 1:
        return False
    return _ranks(mesh) <= GLOO_RANKS or args.dp is not None or args.cp is not None


def _sequence(args: argparse.Namespace) -> bool:
    return bool(args.sp or args.cp is not None)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_reports(reports: Sequence[TrainingReport]) -> str:
    rows = [["config", "mesh", "batch", "quantity", "deviation", "threshold", "ratio", "worst at",
             "result"]]
    for report in reports:
        for c in report.comparisons:
            rows.append([report.config, str(report.mesh), "packed" if report.packed else "unpacked",
                         c.quantity, f"{c.deviation:.3g}",
                         "exact" if c.threshold == 0.0 else f"{c.threshold:g}",
                         f"{c.ratio:.3g}x", c.where or "-", "PASS" if c.passed else "FAIL"])
    return _table(rows)


def format_matrix(rows: Sequence[MatrixRow]) -> str:
    out = [["mutation", "case", "detected", "ratio", "by quantity", "exact", "identity"]]
    for row in rows:
        if row.report is None:
            out.append([row.mutation, row.case, "-", "-", "-", "-", row.identity or ""])
        else:
            worst = row.report.worst_toleranced
            exact = ", ".join(f"{c.quantity}={c.deviation:.3g}" for c in row.report.exact_failures)
            out.append([row.mutation, row.case, "yes" if row.detected else "NO",
                        f"{worst.ratio:.3g}x", worst.quantity, exact or "-", ""])
    return _table(out)


def _report_record(report: TrainingReport, phase: str) -> dict[str, object]:
    return {"config": report.config, "mesh": str(report.mesh), "packed": report.packed,
            "phase": phase, "passed": report.passed,
            "comparisons": [{"quantity": c.quantity, "deviation": c.deviation,
                             "threshold": c.threshold, "ratio": c.ratio, "where": c.where or None,
                             "passed": c.passed} for c in report.comparisons]}


def _row_record(row: MatrixRow) -> dict[str, object]:
    worst = row.report.worst_toleranced if row.report is not None else None
    return {"mutation": row.mutation, "case": row.case, "identity": row.identity,
            "detected": row.detected, "ratio": worst.ratio if worst else None,
            "quantity": worst.quantity if worst else None}


def _label(case: TrainingCase) -> str:
    return f"{case.config.name} {case.mesh}{' packed' if case.spec.packed else ''}"


def cmd_train_check(args: argparse.Namespace) -> int:
    out = Output(args)
    phase = "1b" if args.gloo else "1a"
    apply_deadline(args.deadline, args.gloo)
    if getattr(args, "own_process", False):  # the checks reuse the memory they free
        memory.keep_freed()
    artifact = load(phase=phase)
    sequence_artifact = load_sequence(phase=phase) if _sequence(args) else None
    for what, read in (("training", artifact), ("sequence", sequence_artifact)):
        if read is not None:  # --strict-env: a foreign floor is refused here instead
            remedy = (f"python -m weight_sync_bench.tolerance {what} --phase {phase} "
                      "--write")
            for note in check_environment(read, f"the phase {phase} {what} floor", remedy):
                out.note(note)

    weights = _weights(args) if args.weights is not None else None
    measured: dict[tuple[bool, str], dict[str, float]] = {}

    def lookup(case: TrainingCase) -> dict[str, float]:
        if weights is not None:  # never a floor of other weights: measured on these, on
            # other batches (the check's seed + 1 and + 2), on the checked mesh and the
            # config's widest (a mesh that reorders no sum, dp = tp = 1, measures a floor
            # of exactly zero, which sets no threshold)
            assert case.spec is not None
            key = (case.spec.packed, str(case.mesh))
            if key not in measured:
                shapes = [m for m in meshes(case.config, case.spec.rows)
                          if not args.gloo or _over_gloo(args, m)]
                shapes = list(dict.fromkeys([case.mesh, *shapes[-1:]]))
                train = _gloo_trainer([case]) if args.gloo else None
                measured[key] = thresholds_on(case.config, weights[1], shapes, case.spec,
                                              args.steps, (args.seed + 1, args.seed + 2),
                                              phase, train=train)
            return measured[key]
        if case.mesh.sp or case.mesh.cp > 1:  # the SP / CP floor, measured on its own
            return sequence_thresholds(case.config, case.mesh, artifact=sequence_artifact)
        return thresholds_for(case.config, artifact=artifact, mesh=case.mesh)

    cases = _cases(args, weights)
    if weights is not None:
        out.note(f"your weights ({args.weights}, {weights[0].name}): each mesh's thresholds "
                 f"measured on them (the correct sharded training on that mesh and the widest, at "
                 f"batch seeds {args.seed + 1} and {args.seed + 2}, 100x the worst of each "
                 "quantity)")
    if not cases:
        raise InvalidMesh(f"no training case matches --config {args.config or 'toy'} with these "
                          "options")
    # every case's thresholds before anything trains: over gloo a (config, mesh) the phase
    # 1b floors have no cell for is refused here (FloorNotMeasured, exit 2), no rank started
    limits = {id(case): lookup(case) for case in cases}

    def thresholds(case: TrainingCase) -> dict[str, float]:
        return limits[id(case)]
    line = out.progress()
    if args.mutations:
        rows = []
        mutations = ALL_TRAINING_MUTATIONS if _sequence(args) else TRAINING_MUTATIONS
        matrix = _gloo_matrix(cases) if args.gloo else mutation_matrix
        try:
            for i, case in enumerate(cases):
                line.show(f"train-check --mutations {i + 1}/{len(cases)}: {_label(case)} "
                          f"({len(mutations)} mutations, phase {phase})")
                new = matrix([case], thresholds(case), mutations)
                for row in new:
                    out.record("train_mutation", **_row_record(row))
                rows += new
        finally:
            line.close()
        missed = [r for r in rows if r.detected is False]
        ran = [r for r in rows if r.report is not None]
        if not out.quiet:
            out.text(format_matrix(rows))
        elif missed:
            out.text(format_matrix(missed))
        out.text(f"\n{len(ran) - len(missed)} of {len(ran)} detected, "
                 f"{len(rows) - len(ran)} identity cells skipped")
        code = EXIT_FAILED if missed else (EXIT_OK if ran else EXIT_USAGE)
        out.summary(code, cells=len(rows), ran=len(ran), missed=len(missed), checks=None,
                    passed=None, failed=None, phase=phase, steps=args.steps, seed=args.seed)
        return code
    train = _gloo_trainer(cases) if args.gloo else (lambda case: None)
    reports = []
    try:
        for i, case in enumerate(cases):
            line.show(f"train-check {i + 1}/{len(cases)}: {_label(case)} (phase {phase})")
            reports.append(case.check(thresholds(case), trained=train(case)))
            out.record("train", **_report_record(reports[-1], phase))
    finally:
        line.close()
    failed = [r for r in reports if not r.passed]
    shown = reports if not out.quiet else failed
    if shown:
        out.text(format_reports(shown))
    out.text(f"\n{len(reports) - len(failed)} passed, {len(failed)} failed "
             f"(steps={args.steps}, seed={args.seed}, phase {phase})")
    code = EXIT_FAILED if failed else EXIT_OK
    out.summary(code, checks=len(reports), passed=len(reports) - len(failed), failed=len(failed),
                phase=phase, steps=args.steps, seed=args.seed, cells=None, ran=None, missed=None)
    return code


def _gloo_trainer(cases: list[TrainingCase]) -> Callable[[TrainingCase], Trace]:
    from weight_sync_bench.collectives.gloo.pool import (
        shared_pool,  # the gloo launcher, only when asked
    )
    from weight_sync_bench.training.gloo import train_gloo
    pool = shared_pool(max([GLOO_RANKS, *(_ranks(case.mesh) for case in cases)]))  # --deadline: set
    return lambda case: train_gloo(case, pool)


def _gloo_matrix(cases: list[TrainingCase]) -> Callable[..., list[MatrixRow]]:
    from weight_sync_bench.collectives.gloo.pool import shared_pool
    from weight_sync_bench.training.gloo import gloo_mutation_matrix
    pool = shared_pool(max([GLOO_RANKS, *(_ranks(case.mesh) for case in cases)]))
    return lambda cs, thresholds, mutations: gloo_mutation_matrix(cs, thresholds, pool,
                                                                  mutations)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``train-check`` to ``wsb``."""
    p = subparsers.add_parser("train-check", help="training equivalence: loss, gradients and "
                              "AdamW steps of the DP x TP model against the dense one")
    p.add_argument("--config", default=None, help=f"{', '.join(TRAIN_CONFIGS)} or all "
                   "(default toy)")
    p.add_argument("--weights", type=Path, default=None, metavar="DIR",
                   help="train these weights instead of the seed's: a Hugging Face checkpoint "
                        "directory (its config.json states the geometry) or a Megatron "
                        "checkpoint (with --config); the thresholds are measured on them")
    p.add_argument("--dp", type=count, default=None, help="data-parallel size (default: 1, 2, "
                   "4 up to the batch rows)")
    p.add_argument("--tp", type=count, default=None, help="tensor-parallel degree (default: "
                   "every supported)")
    p.add_argument("--steps", type=count, default=2, help="AdamW steps (default 2)")
    p.add_argument("--seed", type=seed, default=0, help="parameter and batch seed (0..2^63-1)")
    p.add_argument("--batch", choices=["unpacked", "packed", "both"], default="both")
    p.add_argument("--gloo", action="store_true",
                   help="train the mesh over gloo, one process per rank (dp x cp x tp ranks; "
                   f"by default dp = 1 and at most {GLOO_RANKS} ranks; thresholds from "
                   "tolerance/training_1b.json and sequence_1b.json)")
    p.add_argument("--sp", action="store_true",
                   help="sequence parallelism: the residual stream sharded along the sequence "
                   "over each TP group (thresholds from tolerance/sequence.json)")
    p.add_argument("--cp", type=count, default=None,
                   help="context-parallel degree: the sequence split into CP chunks (default "
                   "with --sp: 1, 2 and 4 where the sequence splits evenly)")
    p.add_argument("--mutations", action="store_true",
                   help="run the training-mutation matrix instead of the correct check")
    add_output_options(p)
    add_deadline_option(p)
    p.set_defaults(func=cmd_train_check)

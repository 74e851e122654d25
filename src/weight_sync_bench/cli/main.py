"""``wsb``: the command line. The only module that prints.

    wsb check [--config toy|toy_kv4|all] [--src S --dst D] [--seed N] [--backend inprocess|gloo]
    wsb check --resharder module:function [--config ...] [--src S --dst D]
    wsb check --splitter module:function [--config ...] [--dst D]
    torchrun --nproc-per-node N -m weight_sync_bench check --launcher torchrun [...] [--backend gloo|nccl]
    wsb check --converter module:function --from megatron:4 --to vllm:2 [--config ...]
    wsb check ... --hf-config PATH --layers N [--vocab V]   (a real geometry, reduced)
    wsb check ... [--dtype fp32|bf16|fp16] [--stream layer|parameter] [--measure-floor]
    wsb layout --config NAME [--convention NAME] [--degree T]
    wsb emit --convention hf|meta:T|megatron:T|vllm:T --config NAME DIR
    wsb verify --convention vllm:2 [--config NAME] DIR   (default: the geometry DIR states)
    wsb --version

Every subcommand takes ``-q``; check, verify, fuzz, mutants, replay, train-check and sync take
``--json`` (one schema: ``records``); gloo runs take ``--deadline SECONDS``. One exit-code
contract for all of them (``output.EXIT_CODES``), applied here once: a subcommand returns 0,
1 or 2 for what its checks found, and ``exit_code`` maps whatever it raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.check.checker import (
    Verdict,
    check_reshard,
    check_split,
    checker_for,
    degree_pairs,
    format_verdicts,
    sweep,
)
from weight_sync_bench.check.convert import check_convert
from weight_sync_bench.check.floor import measure_geometry
from weight_sync_bench.check.forwards import BACKENDS
from weight_sync_bench.check.stream import PER, stream_check
from weight_sync_bench.check.user_code import deadline, load_function
from weight_sync_bench.check.weights import held_weights
from weight_sync_bench.cli.checkpoint import (
    add_model_options,
    floor_command,
    guard,
    hf_model,
    model_of,
    phase_of,
    weights_geometry,
)
from weight_sync_bench.cli.checkpoint import register as register_checkpoint
from weight_sync_bench.cli.floor import register as register_floor
from weight_sync_bench.cli.fuzz import register as register_fuzz
from weight_sync_bench.cli.launch import add_launcher_option, launched, option_names
from weight_sync_bench.cli.output import (
    ENVIRONMENT,
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_HARNESS,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_USER_CODE,
    Output,
    ProgressLine,
    Ticker,
    add_deadline_option,
    add_limit_options,
    add_output_options,
    apply_deadline,
    count,
    interrupt_code,
    pending_interrupt,
    positive,
    seed,
    signals_raise,
)
from weight_sync_bench.cli.records import verdict_record
from weight_sync_bench.cli.state import register as register_state
from weight_sync_bench.cli.sync import register as register_sync
from weight_sync_bench.cli.train import register as register_train
from weight_sync_bench.collectives.gloo.torchrun import TORCHRUN_BACKENDS
from weight_sync_bench.conventions import convention_by_name, endpoint, render
from weight_sync_bench.conventions.fp8 import require_stored
from weight_sync_bench.conventions.table import render_ranks
from weight_sync_bench.errors import (
    FloorNotMeasured,
    GeometryTooLarge,
    InvalidShards,
    MissingArtifacts,
    PeerAborted,
    RankFailure,
    UnsupportedLayout,
    UserCodeError,
    WsbError,
)
from weight_sync_bench.model.config import CONFIGS, DTYPES, ModelConfig, config_by_name
from weight_sync_bench.model.footprint import GIB, Limits, footprint
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.rules import floor_for
from weight_sync_bench.version import version

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint

FORWARD_LEGEND = ("forward: declared = the shards equal the declared split byte for byte, so "
                  "the declared split's sharded forward was reused; own = they differ, and ran "
                  "a forward (and a diagnosis) of their own")
# every placement's short name, as layout.placements writes it (tests/cli/test_help.py checks
# that each one the placements can print is explained here)
PLACEMENT_LEGEND = ("placements: R replicated (every rank holds the whole tensor); S(d) "
                    "rank r holds the r-th of t equal chunks along dim d; HP(h,kv,d) the "
                    "fused q|k|v rows split per head (rank r: its q heads, then the k and v "
                    "heads they read; h query heads, kv KV heads, head_dim d); HR(h,kv,d) "
                    "the same with KV heads replicated where t > kv (vLLM); FP(a,b) fused "
                    "first|second rows (gate|up) split pairwise, rank r the r-th chunk of "
                    "each; EX(n,ep=..,etp=..) n experts stacked, whole on EP ranks, each "
                    "split over its expert-TP ranks; P@tpN placement P over a TP group of N "
                    "ranks, repeated on every data-parallel replica")
CONVENTION_LEGEND = ("cells: [local shape] the placement the framework's forward reads the "
                     "source parameter with; -: the convention cannot store the config at that "
                     "degree (`wsb layout --convention NAME --degree T` names the rule)\n"
                     + PLACEMENT_LEGEND)
RANKS_LEGEND = ("ranks: pp the pipeline stage and layers the global layers of each of its chunks "
                "(stored under local indices from 0; model{v}. per chunk where vpp > 1), where "
                "the endpoint has stages; tp / dp the attention TP rank and data-parallel "
                "replica; ep / etp / edp "
                "the experts' expert-parallel, expert-TP and expert-data-parallel ranks; experts "
                "the global ids held, in local order; rows: the expert-TP chunk of each "
                "expert's gate and up rows (its down columns alike)")
LAYOUT_LEGEND = (PLACEMENT_LEGEND + "\n-: the placement cannot split this parameter evenly at "
                 "that degree (UnsupportedLayout; `wsb check --src T` says which rule)")


def exit_code(exc: BaseException) -> int:
    """The exit status for an exception a subcommand raised (``output.EXIT_CODES``)."""
    if isinstance(exc, KeyboardInterrupt):
        return interrupt_code(exc)
    if isinstance(exc, (UserCodeError, InvalidShards)):
        return EXIT_USER_CODE  # only the user's functions hand the CLI shards
    if isinstance(exc, (RankFailure, PeerAborted, MissingArtifacts)):
        return EXIT_HARNESS
    if isinstance(exc, WsbError):
        return EXIT_USAGE  # ToleranceMismatch included: the artifact does not cover the input
    return EXIT_HARNESS  # not a typed error: a bug of the harness


def run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace, prog: str) -> int:
    """``func(args)`` under the exit-code contract: SIGTERM ends it like Ctrl-C (the ranks
    and temporary directories go with the interpreter's exit handlers), and an exception
    becomes one line on stderr (a traceback only for a bug of the harness) and its code."""
    out = Output(args)
    with signals_raise(), deadline(None):  # a --deadline is this command's, not the process's
        try:
            return func(args)
        except BrokenPipeError:  # `wsb ... | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the contract maps all
            code = exit_code(exc)
            if isinstance(exc, KeyboardInterrupt):
                message = f"interrupted ({'SIGTERM' if code != 130 else 'SIGINT'})"
            elif isinstance(exc, WsbError):
                message = str(exc) + "".join(f"\n{note}" for note in getattr(exc, "__notes__", ()))
            else:
                message = ("internal error, a bug of the harness (exit 3):\n"
                           + "".join(traceback.format_exception(exc)).rstrip())
            print(f"{prog}: {message}", file=sys.stderr, flush=True)
            out.record("error", command=out.command, exit_code=code, type=type(exc).__name__,
                       message=message)
            return code


# -- wsb check


def _models(args: argparse.Namespace) -> list[ModelConfig]:
    """The geometries to check: the ``--hf-config`` one, or ``--config`` (``all``: each),
    each within ``--max-gib`` / ``--max-gflop`` (``guard``: held whole, or streamed per
    ``--stream``'s unit) before anything of it is built."""
    hf = hf_model(args)
    name = args.config or args.config_default
    configs = [hf] if hf is not None else (
        list(CONFIGS.values()) if name == "all" else [config_by_name(name)])
    for config in configs:
        _within_budget(args, config)
        guard(args, config, unit=args.stream or "model",
              hint="" if args.stream else "; --stream parameter holds one parameter at a time")
    return configs


# The share of this machine's memory a check may hold whole before it streams (the harness's
# own checks) or asks for --stream (your function's): --memory-budget sets it in GiB.
MEMORY_SHARE = 0.5


def memory_budget(args: argparse.Namespace) -> int:
    """The bytes a check may hold whole: ``--memory-budget`` GiB, else ``MEMORY_SHARE`` of
    this machine's memory (``model.footprint.Limits``' default)."""
    if getattr(args, "memory_budget", None) is not None:
        return int(args.memory_budget * GIB)
    return int(Limits().max_bytes * MEMORY_SHARE)


def _within_budget(args: argparse.Namespace, config: ModelConfig) -> None:
    """Where ``config`` held whole would exceed the memory budget and no ``--stream`` was
    given: the harness's own check streams per layer (``args.stream``; ``args.auto_stream``
    the note that says why), a check of your function is refused (``GeometryTooLarge``,
    exit 2) naming ``--stream`` and the estimate: it was written for whole models."""
    if args.stream is not None:
        return
    whole, budget = footprint(config, "model"), memory_budget(args)
    if whole.bytes <= budget:
        return
    why = (f"{config.name} held whole would need about {whole.bytes / GIB:.3g} GiB, over the "
           f"memory budget of {budget / GIB:.3g} GiB (--memory-budget; default half of this "
           "machine's memory)")
    fn = args.resharder or args.splitter or args.converter
    if fn is not None:
        raise GeometryTooLarge(f"{why}: pass --stream layer (your function is then called once "
                               "per layer, with a dict of that layer's tensors) or --stream "
                               "parameter, or raise --memory-budget", estimate=whole.bytes)
    args.stream = "layer"
    layer = footprint(config, "layer")
    args.auto_stream = (f"streamed per layer: {why}; per layer about {layer.bytes / GIB:.3g} "
                        "GiB")


def _pairs(args: argparse.Namespace, degrees: list[int]) -> list[tuple[int, int]]:
    srcs = [args.src] if args.src is not None else degrees
    dsts = [args.dst] if args.dst is not None else degrees
    return [(s, d) for s in srcs for d in dsts]


# A check to run: called with the progress callback of a streamed check (None: none shown),
# and, for a user's function, keywords that override the check's own (``FIRST_CALL``).
Job = Callable[..., Verdict]
# A user function's check run once before its geometry's floor is measured, judged by
# nothing (its verdict is dropped): in this process, with no floor to read or measure.
FIRST_CALL: dict[str, Any] = {"threshold": math.inf, "backend": "inprocess",
                              "measure_floor": False}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords every check of a user's function takes from the command line."""
    return {"seed": args.seed, "backend": args.backend, "dtype": args.dtype,
            "measure_floor": args.measure_floor, "stream": args.stream}


def ensure_floor(args: argparse.Namespace, config: ModelConfig, line: ProgressLine,
                 first: tuple[str, Job] | None = None) -> None:
    """Before anything of ``config`` is drawn: the floor its checks will read exists
    (``floor_for``: a committed floor that records the geometry, else the per-geometry one
    cached under ``tolerance_dir()/geometry/``). Every check of a geometry (split, reshard,
    the invariant, a conversion) reads its threshold from that one place. With none:
    ``--measure-floor`` measures it now (phase 1a here, with a progress line; phase 1b by
    the checker, over the gloo forward) and caches it with its provenance, so the next run
    reads it; without, ``FloorNotMeasured`` naming the command (exit 2). ``first``: the
    geometry's first check of a user's function, run once before the measurement
    (``FIRST_CALL``), so that what the function raises or returns wrong shows in seconds,
    not after minutes of measuring."""
    phase = phase_of(args)
    try:
        floor_for(config, phase, args.dtype)
        return
    except FloorNotMeasured as exc:
        if not args.measure_floor:
            if args.hf_config is None:
                raise
            command = floor_command(args, config)
            how = ("rerun this check with --measure-floor (it measures the floor once and "
                   "caches it)" if exc.command == command else
                   f"`{command}` (once; the checks then read the cached floor), or rerun "
                   "this check with --measure-floor")
            raise FloorNotMeasured(f"{exc}.\nFrom the command line: {how}",
                                   command=command) from None
    if first is not None:
        label, job = first
        line.show(f"calling your function once ({label}) before measuring the floor of "
                  f"{config.name} ...")
        job(None, **FIRST_CALL)
    if phase == "1a":
        line.show(f"measuring the floor of {config.name} (once; cached) ...")
        measure_geometry(config, phase=phase, dtype=args.dtype,
                         progress=Ticker(line) if line.live else None)


def _plan(args: argparse.Namespace, line: ProgressLine | None = None
          ) -> tuple[list[tuple[str, Job]], list[str]]:
    """Every check to run, as (label, job), and the configs skipped (``--config all``)."""
    line = line if line is not None else ProgressLine(enabled=False)
    every = args.hf_config is None and (args.config or args.config_default) == "all"
    role = next((r for r in ("converter", "splitter", "resharder") if getattr(args, r)), None)
    fn = load_function(getattr(args, role), role) if role else None
    if args.weights is not None and role is None:
        raise WsbError("--weights is your function's input: give --converter, --splitter or "
                       "--resharder")
    if args.weights is not None and role in ("splitter", "resharder"):
        return _weights_plan(args, fn, role), []
    if args.converter:
        return _convert_plan(args, fn, every, line)
    if args.convert_from is not None or args.convert_to is not None:
        raise WsbError("--from and --to are a converter's conventions: give --converter "
                       "MODULE:FUNCTION (--src and --dst are the degrees of the harness's own)")
    jobs: list[tuple[str, Job]] = []
    skipped: list[str] = []
    for config in _models(args):
        name = config.name
        layout = layout_for(config)
        try:
            for degree in (args.src, args.dst):
                if degree is not None:
                    layout.validate(degree)
        except UnsupportedLayout as exc:
            if not every:
                raise WsbError(f"{name}: {exc}") from None
            skipped.append(f"skipped {name}: {exc}")  # --config all: check where it applies
            continue
        degrees = layout.supported_degrees()
        common = _options(args)
        if fn is not None:
            theirs: list[tuple[str, Job]] = (
                [(f"{name} split -> {dst}", lambda progress, c=config, d=dst, **over:
                  check_split(fn, c, d, progress=progress, **{**common, **over}))
                 for dst in ([args.dst] if args.dst is not None else degrees)]
                if args.splitter else
                [(f"{name} {src} -> {dst}", lambda progress, c=config, s=src, d=dst, **over:
                  check_reshard(fn, c, s, d, progress=progress, **{**common, **over}))
                 for src, dst in _pairs(args, degrees)])
            # the one floor every check of this geometry reads; the function called first
            ensure_floor(args, config, line, first=theirs[0])
            jobs += theirs
            continue
        ensure_floor(args, config, line)  # the one floor every check of this geometry reads
        if args.stream is not None:  # the invariant streamed: the declared split at src,
            pairs = _pairs(args, degrees) if (args.src or args.dst) else degree_pairs(layout)
            jobs += [(f"{name} {s} -> {d}",  # resharded per parameter, each pair a pass
                      lambda progress, c=config, s=s, d=d: stream_check(
                          c, d, src=s, per=args.stream, seed=args.seed, dtype=args.dtype,
                          measure_floor=args.measure_floor, progress=progress,
                          backend=args.backend))
                     for s, d in pairs]
        else:
            pairs = _pairs(args, degrees) if (args.src or args.dst) else degree_pairs(layout)
            shared: dict[str, Any] = {}  # one checker (one reference forward) per config

            def one(c=config, pair=(0, 0), shared=shared) -> Verdict:
                if "checker" not in shared:
                    shared["checker"] = checker_for(c, seed=args.seed, backend=args.backend,
                                                    dtype=args.dtype,
                                                    measure_floor=args.measure_floor)
                (verdict,) = sweep(c, pairs=[pair], seed=args.seed, checker=shared["checker"])
                return verdict

            jobs += [(f"{name} {s} -> {d}", lambda progress, p=(s, d), one=one: one(pair=p))
                     for s, d in pairs]
    return jobs, skipped


def _convert_plan(args: argparse.Namespace, fn: Callable[..., Any], every: bool,
                  line: ProgressLine) -> tuple[list[tuple[str, Job]], list[str]]:
    """``check_convert(fn, config, --from, --to)`` for each geometry that both conventions
    can store (``--config all``: the others are skipped, naming the rule)."""
    if args.src is not None or args.dst is not None:
        raise WsbError("--src and --dst are degrees of the harness's own convention; a "
                       "converter's are in --from NAME:T and --to NAME:T")
    if args.convert_from is None or args.convert_to is None:
        raise WsbError("--converter needs --from NAME:T and --to NAME:T (e.g. --from "
                       "megatron:4 --to vllm:2; a bare hf means degree 1)")
    src, dst = endpoint(args.convert_from), endpoint(args.convert_to)
    if args.weights is not None:
        return [_weights_job(args, fn, src, dst)], []
    jobs: list[tuple[str, Job]] = []
    skipped: list[str] = []
    for config in _models(args):
        try:
            src.pieces(config)
            require_stored(config, dst)  # an FP8 one's block rules too, before the converter
        except UnsupportedLayout as exc:
            if not every:
                raise
            skipped.append(f"skipped {config.name}: {exc}")
            continue
        common = _options(args)
        if dst.quantized:  # its threshold is measured on its dequantized weights, per check
            if args.stream is not None or args.backend != "inprocess" or args.measure_floor:
                raise WsbError(f"{dst}: an FP8 destination is checked whole, in process, with "
                               "a threshold measured on its dequantized weights: drop "
                               "--stream, --backend and --measure-floor")
            jobs.append((f"{config.name} {src} -> {dst}", lambda progress, c=config, **over:
                         check_convert(fn, c, str(src), str(dst), seed=args.seed,
                                       dtype=args.dtype, **over)))
            continue
        job = (f"{config.name} {src} -> {dst}", lambda progress, c=config, **over: check_convert(
            fn, c, str(src), str(dst), progress=progress, **{**common, **over}))
        # The geometry's phase floor, as for a split (``check.convert``'s docstring says why
        # it covers a conversion's forward): never a threshold measured for this run alone;
        # the converter called once before it is measured.
        ensure_floor(args, config, line, first=job)
        jobs.append(job)
    return jobs, skipped


def _weights_config(args: argparse.Namespace) -> ModelConfig:
    """``--weights DIR``'s geometry: what an HF directory's config.json states, else
    --config / --hf-config (checked against the directory when it is read)."""
    if args.dtype != "fp32" or args.stream is not None or args.measure_floor:
        raise WsbError("--weights checks your weights whole, in their own dtype, with a "
                       "threshold measured on them: drop --dtype, --stream and --measure-floor")
    given = model_of(args) if args.config is not None or args.hf_config is not None else None
    return weights_geometry(args.weights, given, "--hf-config PATH or --config NAME")


def _weights_plan(args: argparse.Namespace, fn: Callable[..., Any], role: str
                  ) -> list[tuple[str, Job]]:
    """``--splitter`` / ``--resharder`` with ``--weights DIR``: the function checked on the
    directory's weights (``check_split`` / ``check_reshard(..., weights=DIR)``), at --dst
    (and --src), else every supported degree (pair); read once, shared by every check."""
    config = _weights_config(args)
    layout = layout_for(config)
    for degree in (args.src, args.dst):
        if degree is not None:
            layout.validate(degree)
    held: dict[str, Any] = {}

    def weights() -> Any:
        if "w" not in held:
            held["w"] = held_weights(args.weights, config)
        return held["w"]

    degrees = layout.supported_degrees()
    on = f" on {args.weights}"
    if role == "splitter":
        return [(f"{config.name} split -> {dst}{on}", lambda progress, d=dst, **over:
                 check_split(fn, config, d, backend=args.backend, weights=weights(), **over))
                for dst in ([args.dst] if args.dst is not None else degrees)]
    return [(f"{config.name} {src} -> {dst}{on}", lambda progress, s=src, d=dst, **over:
             check_reshard(fn, config, s, d, backend=args.backend, weights=weights(), **over))
            for src, dst in _pairs(args, degrees)]


def _weights_job(args: argparse.Namespace, fn: Callable[..., Any], src: Endpoint,
                 dst: Endpoint) -> tuple[str, Job]:
    """``--converter`` with ``--weights DIR``: the converter checked on the directory's
    weights (``check_convert(..., weights=DIR)``): the geometry the directory states (or
    --config / --hf-config, checked against it), the weights' own dtype, a threshold
    measured on them."""
    config = _weights_config(args)
    src.pieces(config)
    dst.unquantized().pieces(config)
    return (f"{config.name} {src} -> {dst} on {args.weights}",
            lambda progress, **over: check_convert(
                fn, config, str(src), str(dst), seed=args.seed, backend=args.backend,
                weights=args.weights, **over))


def cmd_check(args: argparse.Namespace) -> int:
    out = Output(args)
    if args.splitter and args.src is not None:
        raise WsbError("--src has no meaning with --splitter (a split starts from the full "
                       "model); give --dst")
    if args.stream is not None and args.backend == "gloo" and args.converter:
        raise WsbError(f"--stream {args.stream} streams a conversion in this process only "
                       "(phase 1a): a streamed --converter check over --backend gloo is not "
                       "built; drop one of them")
    apply_deadline(args.deadline, args.backend == "gloo")
    line = out.progress()
    try:
        jobs, skipped = _plan(args, line)
    finally:
        line.close()
    if getattr(args, "auto_stream", None):
        out.note(args.auto_stream)
    if not jobs:
        raise WsbError("no config supports the requested degrees:\n  " + "\n  ".join(skipped))
    verdicts: list[Verdict] = []
    line = out.progress()
    interrupted: KeyboardInterrupt | None = None
    try:
        for i, (label, job) in enumerate(jobs):
            head = f"check {i + 1}/{len(jobs)}: {label} ({args.backend})"
            line.show(head)
            # a streamed check's stages (layer k of n, bytes, elapsed) on a terminal only
            verdicts.append(job((lambda p, head=head: line.show(f"{head}: {p}"))
                                if line.live and args.stream else None))
            out.record("check", **verdict_record(verdicts[-1]))
            if pending_interrupt() is not None:  # signalled, but its raise was swallowed
                raise pending_interrupt()
    except KeyboardInterrupt as exc:
        interrupted = exc
    finally:
        line.close()
    failed = [v for v in verdicts if not v.passed]
    if verdicts and not out.quiet:
        out.text(format_verdicts(verdicts))
        out.text(FORWARD_LEGEND)
    for note in skipped:
        out.text(note)
    for verdict in failed:
        out.text()
        out.text(str(verdict))
    tally = f"{len(verdicts) - len(failed)} passed, {len(failed)} failed"
    if interrupted is not None:
        code = interrupt_code(interrupted)
        out.text(f"\ninterrupted after {len(verdicts)} of {len(jobs)} checks: {tally}; not run: "
                 + ", ".join(label for label, _ in jobs[len(verdicts):]))
        out.summary(code, checks=len(jobs), ran=len(verdicts), passed=len(verdicts) - len(failed),
                    failed=len(failed), interrupted=True, skipped=skipped)
        return code
    out.text(f"\n{tally}")
    code = EXIT_FAILED if failed else EXIT_OK
    out.summary(code, checks=len(jobs), ran=len(verdicts), passed=len(verdicts) - len(failed),
                failed=len(failed), interrupted=False, skipped=skipped)
    return code


def cmd_layout(args: argparse.Namespace) -> int:
    config = model_of(args, need_layers=False)
    if args.convention is not None:
        where = endpoint(args.convention)  # NAME, or NAME:T as --degree T
        conv = convention_by_name(where.name)
        if "=" in args.convention or config.n_experts:  # an endpoint of its own: its ranks too
            if args.degree:
                where = dataclasses.replace(where, degree=args.degree)
            print(render(config, conv, [where]))
            print()
            print(render_ranks(config, where))
            print(CONVENTION_LEGEND)
            print(RANKS_LEGEND)
            return 0
        degree = args.degree or (where.degree if ":" in args.convention else None)
        if degree is not None:
            conv.pieces(config, degree)  # an unsupported degree: the rule, named
        print(render(config, conv, [degree] if degree is not None else None))
        print(f"\nsupported degrees (1..8): "
              f"{', '.join(map(str, conv.supported_degrees(config, 8))) or 'none'}")
        print(CONVENTION_LEGEND)
        return 0
    layout = layout_for(config)
    supported = layout.supported_degrees()
    degrees = [args.degree] if args.degree else sorted(set(supported) | {1, 2, 4, 8})
    print(layout.render(degrees))
    print(f"\nsupported degrees: {', '.join(map(str, supported))}")
    print(LAYOUT_LEGEND)
    return 0


DESCRIPTION = ("weight-sync-bench: proves code that moves transformer weights between parallel\n"
               "layouts and frameworks right, by running the sharded model against the dense\n"
               "one. Data movement is compared bit for bit, computation within a threshold\n"
               "derived from a measured floor.\n\n"
               "A subcommand's options: wsb SUBCOMMAND --help. The guides: the README and docs/.")


def build_parser(prog: str = "wsb") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION,
        epilog=f"{EXIT_CODES}\n\n{ENVIRONMENT}\n\n'wsb' is the venv's console script: "
               ".venv/bin/wsb after `make`, or `python -m weight_sync_bench`.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="check the declared layout, or your own splitter, "
                           "resharder or converter",
                           epilog=FORWARD_LEGEND)
    add_model_options(check, default="all", allow_all=True)
    check.add_argument("--src", type=int, default=None, help="source degree (default: every supported)")
    check.add_argument("--dst", type=int, default=None, help="destination degree (default: every supported)")
    check.add_argument("--seed", type=seed, default=0, help="parameter seed (0..2^63-1)")
    check.add_argument("--backend", choices=list(dict.fromkeys((*BACKENDS, *TORCHRUN_BACKENDS))),
                       default=None,
                       help="inprocess: every rank in this process (phase 1a, the default); "
                            "gloo: one process per rank over gloo (phase 1b, the default under "
                            "--launcher torchrun); nccl: torchrun only, where CUDA is available")
    add_launcher_option(check)
    own = check.add_mutually_exclusive_group()
    own.add_argument("--resharder", metavar="MODULE:FUNCTION",
                     help="check fn(shards_at_src, dst) -> shards_at_dst against the declared layout")
    own.add_argument("--splitter", metavar="MODULE:FUNCTION",
                     help="check fn(full_params, degree) -> shards against the declared layout")
    own.add_argument("--converter", metavar="MODULE:FUNCTION",
                     help="check fn(shards, degree) from --from's convention to --to's "
                          "(check_convert)")
    check.add_argument("--from", dest="convert_from", metavar="NAME:T", default=None,
                       help="with --converter: the source convention (plain, megatron, vllm, "
                            "hf, meta) and degree, e.g. megatron:4")
    check.add_argument("--to", dest="convert_to", metavar="NAME:T", default=None,
                       help="with --converter: the destination, e.g. vllm:2 (hf: degree 1)")
    check.add_argument("--weights", type=Path, default=None, metavar="DIR",
                       help="with --converter, --splitter or --resharder: check it on these "
                            "weights instead of the seed's, in their dtype, the threshold "
                            "measured on them: a Hugging "
                            "Face checkpoint directory (its config.json states the geometry), "
                            "or a Megatron checkpoint, torch_dist or legacy torch (with "
                            "--hf-config or --config)")
    check.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                       help="the synced weights' dtype: shards compared bit for bit in it, "
                            "the forwards computed in fp32 from those values, judged by that "
                            "dtype's measured floor")
    check.add_argument("--stream", choices=list(PER), default=None,
                       help="stream the check (phase 1a): memory bounded by the largest "
                            "parameter, your function called once per layer (or parameter) "
                            "with a dict of just those tensors; for real widths")
    check.add_argument("--measure-floor", action="store_true",
                       help="a geometry no measured floor covers (an --hf-config one): "
                            "measure its floor now and keep it in your floor cache "
                            "(WSB_FLOOR_CACHE, else $XDG_CACHE_HOME/weight-sync-bench; the "
                            "next check reads it), rather than refuse")
    add_limit_options(check)
    check.add_argument("--memory-budget", type=positive, default=None, metavar="GIB",
                       help="the most a check holds whole: past it the harness's own check "
                            "streams per layer, and a check of your function asks for "
                            "--stream (default: half of this machine's memory)")
    add_output_options(check)
    add_deadline_option(check)
    check.set_defaults(func=launched(cmd_check), option_names=option_names(check))

    layout = sub.add_parser("layout", help="print the declared layout table", epilog=LAYOUT_LEGEND)
    add_model_options(layout, default="toy")
    layout.add_argument("--convention", metavar="NAME", default=None,
                        help="a framework's storage convention (plain, megatron, vllm, hf, "
                             "meta): its stored names, local shapes and the placements its "
                             "forward reads")
    layout.add_argument("--degree", type=count, default=None, metavar="T",
                        help="one degree only (default: 1, 2, 4, 8 and every supported)")
    add_output_options(layout, json_records=False)
    layout.set_defaults(func=cmd_layout)

    register_train(sub)
    register_sync(sub)
    register_fuzz(sub)
    register_floor(sub)
    register_checkpoint(sub)
    register_state(sub)
    return parser


def program() -> str:
    """``wsb``, or ``wsb (rank R of W)`` in a process torchrun started (``RANK`` and
    ``WORLD_SIZE`` set): every rank's errors, argparse's included, reach one terminal, and
    each says which rank it is."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return f"wsb (rank {rank} of {world})" if rank and world else "wsb"


# Built once a process (30 ms: every subcommand's options); parsing never changes a parser
_parser = functools.lru_cache(maxsize=4)(build_parser)


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run one command. ``own_process``: this process is the command's alone (the ``wsb``
    console script, ``python -m weight_sync_bench``), so a command may tune it for itself
    (``wsb train-check`` keeps freed memory, ``memory.keep_freed``); a caller that runs
    commands in its own process (a test) leaves it False and its process as it was."""
    torch.set_num_threads(1)
    prog = program()
    args = _parser(prog).parse_args(argv)
    args.own_process = own_process
    if not getattr(args, "strict_env", False):
        return run(args.func, args, f"{prog} {args.command}")
    # --strict-env: through the environment, so rank processes and torchrun jobs inherit it;
    # put back afterwards, for a caller (a test) that runs several commands in one process
    before = os.environ.get("WSB_STRICT_ENV")
    os.environ["WSB_STRICT_ENV"] = "1"
    try:
        return run(args.func, args, f"{prog} {args.command}")
    finally:
        if before is None:
            os.environ.pop("WSB_STRICT_ENV", None)
        else:
            os.environ["WSB_STRICT_ENV"] = before


if __name__ == "__main__":
    sys.exit(main())

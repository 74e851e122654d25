"""``wsb sync``: phase 2 on the command line. Prints; computes nothing.

    wsb sync --config toy_kv4 --from megatron:4 --to vllm:2 [--dp D] [--seed N]
             [--bucket BYTES] [--no-forward] [--naive] [--transfers] [--mutation NAME]
             [--into fresh|existing]
    wsb sync --hf-config PATH|NAME --layers N [--vocab V] --no-forward --from ... --to ...
    torchrun --standalone --nproc-per-node N -m weight_sync_bench sync --launcher torchrun \\
             --config toy_kv4 --from megatron:4 --to vllm:2 [--backend gloo|nccl]

Prints the plan summary, the bytes counted at the transport against ``B_min`` (and the
naive gather-then-scatter's), the time against ``T_min`` from a gloo bandwidth calibrated in
the same run, the staging peak and the RSS high-water growth of every rank, the element
check and the verdict. ``--dp D``: the source replicated over D data-parallel groups.
``--into existing``: received into destination tensors that exist before the timed region
(``SyncSession.run(into="existing")``; under torchrun as well, on CPU). ``--hf-config``:
the geometry of a Hugging Face ``config.json`` (or a shipped one), ``--layers`` deep; its
element check, bytes, time and memory need no floor, its forward does (TOY and TOY_KV4
only), so it runs with ``--no-forward`` and is refused without it (exit 2). ``--weights
DIR``: the user's weights move instead of the seed's values (``SyncSession(weights=)``),
the forward's threshold measured on them. ``--resharder MOD:FN``: the user's distributed
resharder instead of the harness's executor (``check_distributed_reshard``'s check).
Exit status (``output.EXIT_CODES``): 0 when the element check and the forward pass, 1 when
either fails; under torchrun only rank 0 prints and judges.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weight_sync_bench.cli.checkpoint import (
    add_model_options,
    guard,
    model_of,
    weights_geometry,
)
from weight_sync_bench.cli.launch import job_options, option_names
from weight_sync_bench.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    Output,
    Ticker,
    add_deadline_option,
    add_limit_options,
    add_output_options,
    apply_deadline,
    count,
    seed,
)
from weight_sync_bench.collectives.gloo.pool import check_ranks
from weight_sync_bench.errors import (
    FloorNotMeasured,
    UnsupportedLauncher,
)
from weight_sync_bench.sync.execute import DEFAULT_BUCKET, execute_plan, gather_scatter
from weight_sync_bench.sync.layouts import sync_layout
from weight_sync_bench.sync.mutations import PLAN_MUTATIONS
from weight_sync_bench.sync.planner import plan_for
from weight_sync_bench.sync.session import INTO, SyncSession
from weight_sync_bench.sync.torchrun import TORCHRUN_BACKENDS, device_for, run_torchrun
from weight_sync_bench.tolerance.rules import floor_for

if TYPE_CHECKING:
    from weight_sync_bench.sync.session import SyncResult


def _record(result: SyncResult) -> dict[str, Any]:
    v = result.verdict
    return {"plan": result.plan.label, "fn": result.fn, "bytes_moved": result.bytes_moved,
            "b_min": result.b_min, "ratio": result.ratio, "naive_bytes": result.naive,
            "seconds": result.seconds, "t_min": result.t_min, "bandwidth": result.bandwidth,
            "sent_max_over_mean": result.sent_balance,
            "plan_seconds": result.plan.build_seconds,
            "ranks": [vars(r) for r in result.ranks], "elements_passed": result.elements_passed,
            "coverage": result.coverage, "into": result.into,
            "max_abs_error": v.max_abs_error if v else None,
            "threshold": v.threshold if v else None, "passed": result.passed}


def cmd_sync(args: argparse.Namespace) -> int:
    out = Output(args)
    given = model_of(args) if args.weights is None or args.config is not None or \
        args.hf_config is not None else None
    config = given if args.weights is None else weights_geometry(
        args.weights, given, "--config NAME or --hf-config PATH")
    guard(args, config)
    fn = None
    if args.resharder is not None:  # the user's distributed resharder, as the Python API
        # takes it (check_distributed_reshard): fn(ctx, rank, local_shards, plan)
        if args.launcher == "torchrun" or args.mutation or args.naive:
            raise UnsupportedLauncher("--resharder runs on the rank pool (--launcher pool), "
                                      "without --mutation or --naive (they change the "
                                      "harness's own executor)")
        from weight_sync_bench.check.user_code import load_function

        fn = load_function(args.resharder, "resharder")
    if args.weights is not None and args.launcher == "torchrun":
        raise UnsupportedLauncher("--weights runs on the rank pool (--launcher pool); under "
                                  "torchrun the values are the seed's")
    if not args.no_forward and args.weights is None:  # on --weights: measured on them
        try:
            floor_for(config, "1b")
        except FloorNotMeasured as exc:  # before any rank starts
            command = exc.command
            if args.hf_config:  # the user's config.json: the command that measures it
                command = " ".join(
                    ["wsb floor geometry --hf-config", str(args.hf_config)]
                    + [f"{flag} {value}" for flag, value in (("--layers", args.layers),
                                                             ("--vocab", args.vocab)) if value]
                    + ["--phase 1b"])
            raise FloorNotMeasured(
                f"the destination forward of {config.name} needs a phase 1b floor "
                f"({exc.why}). Measure it with `{command}`; "
                "--no-forward checks every destination element bit for bit, the bytes, the "
                "time and each rank's memory without one", command=command) from None
    results = []
    if args.launcher == "torchrun":
        if args.mutation or args.naive:
            raise UnsupportedLauncher("--mutation and --naive run on the rank pool only "
                                      "(--launcher pool)")
        result = run_torchrun(config, args.src, args.dst, dp=args.dp, seed=args.seed,
                              bucket_bytes=args.bucket, forward_check=not args.no_forward,
                              backend=args.backend, deadline=args.deadline or 300.0,
                              into=args.into, options=job_options(args))
        if result is None:
            return EXIT_OK  # a rank other than 0: rank 0 prints and judges
        results.append(result)
    else:
        if args.backend != "gloo":
            device_for(args.backend, 0)  # refused without CUDA, naming why
            raise UnsupportedLauncher(f"--backend {args.backend} needs --launcher torchrun "
                                      "(the rank pool runs gloo on CPU)")
        apply_deadline(args.deadline, True)
        # what the pool refuses (more ranks than it starts here), before any progress shows
        check_ranks(plan_for(sync_layout(config, args.src, dp=args.dp),
                             sync_layout(config, args.dst)).world)
        line = out.progress()  # stderr: what runs, the steps done, elapsed and an ETA
        steps = 2 + bool(args.naive)
        tick = Ticker(line, "wsb sync ")
        try:
            tick(0, steps, f"{args.src} -> {args.dst}: starting the rank processes, loading "
                           "the source shards")
            with SyncSession(config, args.src, args.dst, seed=args.seed, dp=args.dp,
                             forward=not args.no_forward, weights=args.weights) as session:
                plan = PLAN_MUTATIONS[args.mutation](session.plan) if args.mutation else None
                tick(1, steps, f"{session.plan.label}: resharding, checking every element"
                               + (", the destination forward" if session.forward else ""))
                results.append(session.run(fn or execute_plan, plan=plan,
                                           bucket_bytes=args.bucket, calibrate=True,
                                           into=args.into))
                if args.naive:
                    tick(2, steps, f"{session.plan.label}: the naive gather-then-scatter")
                    results.append(session.run(gather_scatter, bucket_bytes=args.bucket,
                                               calibrate=True, forward=False, into=args.into))
                tick(steps, steps, f"{session.plan.label}: done")
        finally:
            line.close()
    plan = results[0].plan
    out.text(str(plan))
    if args.transfers:
        out.text(plan.describe(limit=None))
    for result in results:
        out.text()
        out.text(str(result))
        out.record("sync", **_record(result))
    passed = results[0].passed
    code = EXIT_OK if passed else EXIT_FAILED
    out.summary(code, passed=passed)
    return code


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``sync`` to ``wsb``."""
    p = subparsers.add_parser("sync", help="reshard between two distributed layouts, no full "
                              "tensor anywhere: bytes against B_min, time against T_min, "
                              "memory per rank, element check and forward")
    add_model_options(p, default="toy_kv4")
    p.add_argument("--from", dest="src", default="megatron:4",
                   help="source layout: CONVENTION:DEGREE (plain, megatron, vllm, hf, meta), "
                        "a whole endpoint (megatron:tp=2,pp=2,vpp=2,ep=2) or fsdp:D (default "
                        "megatron:4)")
    p.add_argument("--to", dest="dst", default="vllm:2", help="destination layout (default vllm:2)")
    p.add_argument("--dp", type=count, default=1,
                   help="data-parallel replicas of the source (global rank dp_rank * degree + "
                        "tp_rank; default 1)")
    p.add_argument("--seed", type=seed, default=0, help="parameter seed (0..2^63-1)")
    p.add_argument("--weights", type=Path, default=None, metavar="DIR",
                   help="move these weights instead of the seed's values (in float32; each "
                        "rank reads its own regions): a Hugging Face checkpoint directory, "
                        "whose config.json states the geometry, or a Megatron checkpoint "
                        "(with --config / --hf-config); the forward's threshold is measured "
                        "on them")
    p.add_argument("--bucket", type=count, default=DEFAULT_BUCKET, metavar="BYTES",
                   help=f"largest message; staging is at most twice this (default "
                        f"{DEFAULT_BUCKET})")
    p.add_argument("--no-forward", action="store_true",
                   help="the element check only (no destination forward)")
    p.add_argument("--naive", action="store_true",
                   help="also run gather-then-scatter through rank 0, checked the same way")
    p.add_argument("--transfers", action="store_true", help="list every transfer of the plan")
    p.add_argument("--resharder", default=None, metavar="MODULE:FUNCTION",
                   help="check your distributed resharder fn(ctx, rank, local_shards, plan) -> "
                        "this rank's destination tensors instead of the harness's executor "
                        "(check_distributed_reshard): every element, the bytes, the time and "
                        "the memory of your code")
    p.add_argument("--mutation", choices=list(PLAN_MUTATIONS), default=None,
                   help="run a planner mutation instead of the plan (pool only): the checks "
                        "must fail it")
    p.add_argument("--into", choices=list(INTO), default="fresh",
                   help="destination storage: fresh (allocated by the sync, timed; the "
                        "default) or existing (the consumer's tensors, allocated and filled "
                        "with stale values before the timed region; the pool, or torchrun "
                        "on CPU)")
    p.add_argument("--launcher", choices=["pool", "torchrun"], default="pool",
                   help="pool: the harness's rank processes; torchrun: this process is one "
                        "rank of a torchrun job (env:// rendezvous)")
    p.add_argument("--backend", choices=list(TORCHRUN_BACKENDS), default="gloo",
                   help="nccl: torchrun only, and only where CUDA is available")
    add_limit_options(p, what="a geometry")
    add_output_options(p)
    add_deadline_option(p)
    p.set_defaults(func=cmd_sync, option_names=option_names(p))

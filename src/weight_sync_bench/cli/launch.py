"""``--launcher pool|torchrun`` for a subcommand whose gloo runs go through the shared pool
(``wsb check``): under torchrun this process is one rank of the job. Prints nothing itself.

    torchrun --standalone --nproc-per-node 4 -m weight_sync_bench check --launcher torchrun \\
        --config toy --src 4 --dst 2 [--backend gloo|nccl] [--deadline SECONDS]

Rank 0 runs the subcommand as on the pool, the job's ranks standing in for the shared pool
(``collectives.gloo.torchrun``), and alone prints and judges; the other ranks serve its
tasks and exit 0 (or 3 with their own typed error on their stderr, which torchrun passes
through). ``--backend`` is then the job's: gloo (the default), or nccl where CUDA is
available (refused otherwise, naming why). The phase 1b check's tensors stay on CPU under
either (its floor was measured on CPU fp32), so its collectives go over gloo; with nccl the
job's groups are ``cpu:gloo,cuda:nccl``, and a note says so.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from weight_sync_bench.cli.output import EXIT_OK
from weight_sync_bench.collectives.gloo.torchrun import TORCHRUN_BACKENDS, device_for
from weight_sync_bench.errors import UnsupportedLauncher

LAUNCHERS = ("pool", "torchrun")
# What only rank 0 uses (it alone prints), so the ranks of a job may differ in it; the names
# the CLI itself sets, not options
RANK_LOCAL = ("quiet", "json", "func", "command", "option_names", "own_process")
NCCL_NOTE = ("--backend nccl: the job's groups are cpu:gloo,cuda:nccl; the phase 1b check's "
             "tensors stay on CPU (its floor was measured on CPU fp32), so its collectives "
             "ran over gloo")


def add_launcher_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launcher", choices=LAUNCHERS, default="pool",
                        help="pool: the harness's rank processes; torchrun: this process is "
                             "one rank of a torchrun job (env:// rendezvous; rank 0 prints)")


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's destination -> its longest spelling (``src`` -> ``--from``), for naming
    what the ranks of a job disagree on as the user typed it. Call once every option is added.
    (argparse keeps its actions in ``_actions``, its one list of them; there is no public one.)"""
    return {a.dest: max(a.option_strings, key=len) for a in parser._actions  # noqa: SLF001
            if a.option_strings}


def job_options(args: argparse.Namespace) -> dict[str, str]:
    """What every rank of a torchrun job must agree on (``TorchrunRanks.agree``): each option
    the subcommand parsed, spelled as on the command line (``args.option_names``, set by
    ``option_names``), its value as text; not ``RANK_LOCAL``."""
    names = getattr(args, "option_names", {})
    return {names.get(dest, dest): "(not given)" if value is None else str(value)
            for dest, value in vars(args).items()
            if dest not in RANK_LOCAL}


def launched(fn: Callable[[argparse.Namespace], int], *, pool_default: str = "inprocess"
             ) -> Callable[[argparse.Namespace], int]:
    """``fn`` under ``args.launcher``. ``args.backend`` None means ``pool_default`` on the
    pool and gloo under torchrun; nccl needs torchrun and CUDA."""

    def run(args: argparse.Namespace) -> int:
        backend = args.backend
        if args.launcher != "torchrun":
            if backend == "nccl":
                device_for("nccl", 0)  # refused without CUDA, naming why
                raise UnsupportedLauncher("--backend nccl needs --launcher torchrun (the rank "
                                          "pool runs gloo on CPU)")
            args.backend = backend or pool_default
            return fn(args)
        if backend is not None and backend not in TORCHRUN_BACKENDS:
            raise UnsupportedLauncher(f"--backend {backend} runs every rank in this process; "
                                      "under --launcher torchrun the ranks are the job's "
                                      "processes: --backend gloo (the default) or nccl")
        from weight_sync_bench.collectives.gloo.pool import stand_in
        from weight_sync_bench.collectives.gloo.torchrun import TorchrunRanks

        ranks = TorchrunRanks(backend or "gloo", deadline=args.deadline or 300.0,
                              command=args.command, options=job_options(args))
        stand_in(ranks)
        try:
            if ranks.rank != 0:
                ranks.serve()
                return EXIT_OK
            args.backend, args.deadline = "gloo", None  # the job's deadline is set
            if backend == "nccl":
                print(f"note: {NCCL_NOTE}", file=sys.stderr, flush=True)
            return fn(args)
        finally:
            stand_in(None)
            ranks.close()

    return run

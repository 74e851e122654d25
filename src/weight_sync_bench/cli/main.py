"""``wsb``: the command line. The only module that prints.

    wsb check [--config toy|toy_kv4|all] [--src S --dst D] [--seed N] [--backend inprocess|gloo]
    wsb check --resharder module:function [--config ...] [--src S --dst D]
    wsb check --splitter module:function [--config ...] [--dst D]
    wsb layout --config NAME

Exit status: 0 when every check passes, 1 when one fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weight_sync_bench.check.checker import (
    BACKENDS,
    Verdict,
    check_reshard,
    check_split,
    degree_pairs,
    format_verdicts,
    sweep,
)
from weight_sync_bench.cli.fuzz import register as register_fuzz
from weight_sync_bench.cli.train import register as register_train
from weight_sync_bench.errors import UnsupportedLayout, WsbError
from weight_sync_bench.model.config import CONFIGS, config_by_name
from weight_sync_bench.model.plan import layout_for


def _load_function(spec: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise WsbError(f"expected module:function, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's module beside them, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WsbError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise WsbError(f"{spec}: {module_name} has no callable {attr!r}")
    return fn


def _configs(name: str) -> list[str]:
    return list(CONFIGS) if name == "all" else [config_by_name(name).name]


def _pairs(args: argparse.Namespace, degrees: list[int]) -> list[tuple[int, int]]:
    srcs = [args.src] if args.src is not None else degrees
    dsts = [args.dst] if args.dst is not None else degrees
    return [(s, d) for s in srcs for d in dsts]


def cmd_check(args: argparse.Namespace) -> int:
    if args.splitter and args.src is not None:
        raise WsbError("--src has no meaning with --splitter (a split starts from the full "
                       "model); give --dst")
    verdicts: list[Verdict] = []
    skipped: list[str] = []
    for name in _configs(args.config):
        config = config_by_name(name)
        layout = layout_for(config)
        try:
            for degree in (args.src, args.dst):
                if degree is not None:
                    layout.validate(degree)
        except UnsupportedLayout as exc:
            if args.config != "all":
                raise WsbError(f"{name}: {exc}") from None
            skipped.append(f"skipped {name}: {exc}")  # --config all: check where it applies
            continue
        degrees = layout.supported_degrees()
        if args.splitter:
            fn = _load_function(args.splitter)
            for dst in ([args.dst] if args.dst is not None else degrees):
                verdicts.append(check_split(fn, config, dst, seed=args.seed, backend=args.backend))
        elif args.resharder:
            fn = _load_function(args.resharder)
            for src, dst in _pairs(args, degrees):
                verdicts.append(check_reshard(fn, config, src, dst, seed=args.seed,
                                              backend=args.backend))
        else:
            pairs = _pairs(args, degrees) if (args.src or args.dst) else degree_pairs(layout)
            verdicts.extend(sweep(config, pairs=pairs, seed=args.seed, backend=args.backend))
    if not verdicts:
        raise WsbError("no config supports the requested degrees:\n  " + "\n  ".join(skipped))
    print(format_verdicts(verdicts))
    for line in skipped:
        print(line)
    failed = [v for v in verdicts if not v.passed]
    for verdict in failed:
        print()
        print(verdict)
    print(f"\n{len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def cmd_layout(args: argparse.Namespace) -> int:
    layout = layout_for(config_by_name(args.config))
    degrees = sorted(set(layout.supported_degrees()) | {1, 2, 4, 8})
    print(layout.render(degrees))
    print(f"\nsupported degrees: {', '.join(map(str, layout.supported_degrees()))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsb", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="check the invariant (or your own split/reshard function)")
    check.add_argument("--config", default="all", choices=[*CONFIGS, "all"])
    check.add_argument("--src", type=int, default=None, help="source degree (default: every supported)")
    check.add_argument("--dst", type=int, default=None, help="destination degree (default: every supported)")
    check.add_argument("--seed", type=int, default=0, help="model seed (tokens use 1000 + seed)")
    check.add_argument("--backend", choices=BACKENDS, default="inprocess",
                       help="inprocess: every rank in this process (phase 1a); gloo: one process "
                            "per rank over gloo on 127.0.0.1 (phase 1b)")
    own = check.add_mutually_exclusive_group()
    own.add_argument("--resharder", metavar="MODULE:FUNCTION",
                     help="check fn(shards_at_src, dst) -> shards_at_dst against the declared layout")
    own.add_argument("--splitter", metavar="MODULE:FUNCTION",
                     help="check fn(full_params, degree) -> shards against the declared layout")
    check.set_defaults(func=cmd_check)

    layout = sub.add_parser("layout", help="print the declared layout table")
    layout.add_argument("--config", default="toy", choices=list(CONFIGS))
    layout.set_defaults(func=cmd_layout)

    register_train(sub)
    register_fuzz(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    torch.set_num_threads(1)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except WsbError as exc:
        print(f"wsb {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

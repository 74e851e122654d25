"""``wsb floor <kind>``: measure a numerical floor and write its artifact.

    wsb floor phase [--phase 1a|1b] [--dtype fp32|bf16|fp16|fp8_...] [--repetitions R]
    wsb floor geometry (--hf-config PATH --layers N [--vocab V] | --config NAME) [--dtype D]
    wsb floor training | sequence [--phase 1a|1b] [--repetitions R] [--steps K]
    wsb floor random --random N [--search M --keep K] [--seed S] [--phase P]
    wsb floor random --from PATH                 # an artifact's samples, every kernel set
    wsb floor replicated-kv [--geometries N] [--seed S] | --from PATH
    wsb floor moe [--geometries N] [--seed S] | --from PATH
      ... [--kernel-sets all|current] (--out PATH | --write) [--force]

Each kind's measuring loop stays beside what it measures (``check.floor``,
``training.floor``, ``training.sequence_floor``, ``fuzz.floor``); ``tolerance`` records
the measurement, merges it over kernel sets and machine classes and derives the threshold.
This module is the command's parser; ``cli.floor_measure`` runs phase, training, sequence
and geometry, ``cli.floor_samples`` random, replicated-kv and moe, ``cli.floor_report`` prints.
Every measurement runs under each CPU kernel set this machine can use (``--kernel-sets
all``, the default: one process per ``ATEN_CPU_CAPABILITY``, ``tolerance.kernels``), with a
progress line and an ETA on stderr; written over an artifact measured on another vendor's
CPU, it keeps that vendor's figures (``tolerance.kernels.over``). A measurement never
silently replaces a committed artifact: it is written to ``--out PATH``, or replaces the
committed file only with ``--write``; a smaller sample than the file it replaces is refused
without ``--force``; the old and new figures are printed side by side.

Without a kind, ``wsb floor`` is ``wsb floor random`` (``wsb floor --random N``, ``wsb floor
--kernel-sets all --from PATH``, as it always read); ``python -m weight_sync_bench.tolerance
[kind] ...`` is ``wsb floor`` with ``phase`` the default kind, and ``python -m
weight_sync_bench.fuzz.floor replicated-kv ...`` is ``wsb floor replicated-kv ...`` (and
``moe``, ``wsb floor moe``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.cli import floor_measure, floor_samples
from weight_sync_bench.cli.output import (
    ProgressLine,
    add_deadline_option,
    add_limit_options,
    add_output_options,
    count,
    seed,
)
from weight_sync_bench.model.config import CONFIGS, DTYPES, MOE_CONFIGS
from weight_sync_bench.tolerance.artifacts import FP8_WEIGHTS, PHASES
from weight_sync_bench.training import floor as training_floor

KINDS = ("phase", "random", "geometry", "replicated-kv", "moe", "training", "sequence")


def as_floor_argv(argv: list[str], default_kind: str = "phase") -> list[str]:
    """``python -m weight_sync_bench.tolerance ARGV`` as ``wsb`` arguments: ``floor``, then
    the kind ARGV names, or ``default_kind`` where it names none (``--phase 1b`` alone: the
    phase floor, as that command always read)."""
    if argv and (argv[0] in KINDS or argv[0] in ("-h", "--help")):
        return ["floor", *argv]
    return ["floor", default_kind, *argv]


# -- the options of each kind


def _where(parser: argparse.ArgumentParser, force: str) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None,
                       help="write the artifact here (a merge with what is there, as --write)")
    where.add_argument("--write", action="store_true",
                       help="replace the committed artifact under tolerance/ (geometry: "
                            "into the checkout's tolerance/geometry/; without it a geometry's "
                            "floor goes to your floor cache, WSB_FLOOR_CACHE, else "
                            "$XDG_CACHE_HOME/weight-sync-bench)")
    parser.add_argument("--force", action="store_true", help=force)
    parser.add_argument("--kernel-sets", choices=("all", "current"), default="all",
                        help="all (default): measure once per CPU kernel set torch can use "
                             "here (ATEN_CPU_CAPABILITY), each in a process of its own, and "
                             "keep the worst (tolerance.kernels); current: only the kernels "
                             "this process runs")
    add_output_options(parser, json_records=False)


def _measure_options() -> argparse.ArgumentParser:
    """phase, geometry, training and sequence (``python -m weight_sync_bench.tolerance``)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--phase", choices=PHASES, default="1a")
    parser.add_argument("--repetitions", type=count, default=None,
                        help=f"default: {phase_floor.REPETITIONS} (phase), "
                             f"{phase_floor.GEOMETRY_REPETITIONS} (geometry), "
                             f"{training_floor.REPETITIONS} (training, sequence)")
    parser.add_argument("--steps", type=count, default=training_floor.STEPS,
                        help="optimizer steps (training, sequence)")
    parser.add_argument("--dtype", choices=[*DTYPES, *FP8_WEIGHTS], default="fp32",
                        help="the synced weights' dtype (phase, geometry): bf16 and fp16 "
                             "weights are compared bit-exactly and computed in fp32; "
                             "fp8_block128 / fp8_tensor (phase 1a): an FP8 destination's, bf16 "
                             "weights quantized by the reference quantizer, computed "
                             "dequantized")
    what = parser.add_argument_group("geometry", "the geometry whose floor is measured")
    what.add_argument("--hf-config", type=Path, default=None, metavar="PATH",
                      help="a Hugging Face config.json (geometry)")
    what.add_argument("--config", default=None, choices=[*CONFIGS, *MOE_CONFIGS],
                      help="a built-in config (geometry)")
    what.add_argument("--layers", type=count, default=None,
                      help="override the HF config's num_hidden_layers (geometry)")
    what.add_argument("--vocab", type=count, default=None,
                      help="override the HF config's vocab_size (geometry)")
    what.add_argument("--batch", type=count, default=None, help="token batch (geometry)")
    what.add_argument("--seq-len", type=count, default=None, help="token length (geometry)")
    add_limit_options(what, what="a geometry (geometry; phase 1a streamed per layer)")
    _where(parser, "replace even a measurement of more repetitions than this one, or one "
                   "that holds other CPU vendors' figures beside this one's; a geometry "
                   "already measured here is measured again")
    return parser


def _random_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--random", type=count, default=None, metavar="N",
                        help="number of geometries to sample (>= 2)")
    parser.add_argument("--from", dest="source", type=Path, default=None, metavar="PATH",
                        help="re-measure the samples of PATH (default: the committed "
                             "artifact) instead of drawing new ones")
    parser.add_argument("--search", type=count, default=None, metavar="M",
                        help="also search M examples (Hypothesis target phase) for the largest "
                             "floor / max|logit|, and sample the worst --keep of them")
    parser.add_argument("--keep", type=count, default=20, metavar="K")
    parser.add_argument("--phase", choices=PHASES, default="1a")
    parser.add_argument("--seed", type=seed, default=None, help="Hypothesis seed (default: random)")
    _where(parser, "replace even a measurement of more geometries than this one")
    add_deadline_option(parser)
    return parser


def _replicated_options() -> argparse.ArgumentParser:
    from weight_sync_bench.fuzz.floor import REPLICATED_GEOMETRIES, REPLICATED_SEED

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--phase", default="1a", choices=["1a"])
    parser.add_argument("--geometries", type=count, default=REPLICATED_GEOMETRIES)
    parser.add_argument("--seed", type=seed, default=REPLICATED_SEED, help="the draw's seed")
    parser.add_argument("--from", dest="source", type=Path, default=None, metavar="PATH",
                        help="re-measure the samples of the validation at PATH instead of "
                             "drawing new ones")
    _where(parser, "replace a validation that holds other CPU vendors' figures")
    return parser


def _moe_options() -> argparse.ArgumentParser:
    from weight_sync_bench.fuzz.floor import MOE_GEOMETRIES, MOE_SEED

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--phase", default="1a", choices=["1a"])
    parser.add_argument("--geometries", type=count, default=MOE_GEOMETRIES,
                        help=f"MoE geometries to draw (default {MOE_GEOMETRIES})")
    parser.add_argument("--seed", type=seed, default=MOE_SEED,
                        help=f"the draw's Hypothesis seed (default {MOE_SEED})")
    parser.add_argument("--from", dest="source", type=Path, default=None, metavar="PATH",
                        help="re-measure the samples of the validation at PATH instead of "
                             "drawing new ones")
    _where(parser, "replace a validation that holds other CPU vendors' figures")
    return parser


class _Kinds(argparse._SubParsersAction):  # type: ignore[type-arg]
    """The KIND subcommands, refusing an option given before the KIND: bare ``wsb floor``'s
    options (the random floor's) are parsed first, and the kind's own default of the same
    option then replaced them without a word (``wsb floor --out x.json geometry ...`` wrote
    to the floor cache, ``wsb floor --phase 1b moe`` measured 1a). An option given at its
    default changes nothing either way and passes."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Sequence[str], option_string: str | None = None) -> None:
        given = [max(a.option_strings, key=len) for a in parser._actions  # noqa: SLF001
                 if a.option_strings and a.default is not argparse.SUPPRESS
                 and getattr(namespace, a.dest, a.default) != a.default]
        if given:
            parser.error(f"{', '.join(given)} given before the KIND {values[0]}: a kind's "
                         f"options go after it (wsb floor {values[0]} --help lists them)")
        super().__call__(parser, namespace, values, option_string)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``floor`` and its kinds to ``wsb``."""
    floor = subparsers.add_parser(
        "floor", parents=[_random_options()], help="measure a numerical floor",
        description="Measure a numerical floor and write its artifact: under every CPU kernel "
                    "set, merged, beside other CPU vendors' figures (--out PATH, or --write "
                    "to replace the committed one).",
        epilog="Without a KIND: the random-geometry floor (wsb floor random). python -m "
               "weight_sync_bench.tolerance [KIND] is wsb floor, phase by default.")
    kinds = floor.add_subparsers(dest="kind", metavar="KIND", action=_Kinds)
    for kind, parent, text in (
            ("phase", _measure_options, "the logits floor of TOY and TOY_KV4 "
                                        "(tolerance/phase<P>[_<dtype>].json)"),
            ("random", _random_options, "floor samples on random geometries and the fuzz's "
                                        "rule (tolerance/random_floor_<P>.json)"),
            ("geometry", _measure_options, "one geometry's floor (tolerance/geometry/)"),
            ("replicated-kv", _replicated_options, "the random-geometry rule validated on "
                                                   "vLLM's replicated-KV forward"),
            ("moe", _moe_options, "the random-geometry rule validated on the Mixture-of-Experts "
                                  "forwards (tolerance/random_floor_<P>_moe.json)"),
            ("training", _measure_options, "the training floors (training[_1b].json)"),
            ("sequence", _measure_options, "the SP / CP training floors (sequence[_1b].json)")):
        kinds.add_parser(kind, parents=[parent()], help=text, description=text)
    floor.set_defaults(func=cmd_floor, kind=None)


def cmd_floor(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    line = ProgressLine(enabled=not getattr(args, "quiet", False))
    try:
        match args.kind:
            case None | "random":
                return floor_samples.measure_random(args, line)
            case "replicated-kv":
                return floor_samples.measure_replicated(args, line)
            case "moe":
                return floor_samples.measure_moe(args, line)
            case "geometry":
                return floor_measure.measure_geometry(args, line)
            case _:
                return floor_measure.measure_kind(args, line)
    finally:
        line.close()

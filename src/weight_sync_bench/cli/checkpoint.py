"""``wsb emit`` and ``wsb verify``: checkpoints on disk, for converters that are command-line
tools; and the model options every command that takes a geometry shares.

    wsb emit --convention hf|meta:T|megatron:T|vllm:T (--config NAME | --hf-config PATH
             --layers N [--vocab V]) [--seed S] [--max-shard-size BYTES] DIR
    wsb verify --convention vllm:2 [--config NAME | --hf-config PATH --layers N [--vocab V]]
               [--from hf] [--seed S] [--backend inprocess|gloo] [--json] DIR

``emit`` writes the synthetic model of seed S as that framework stores it
(``conventions.checkpoint``); run your converter on it; ``verify`` reads what it wrote and
gives ``check_convert``'s verdict (exit 0 pass, 1 a counterexample, 2 a file missing,
truncated or mis-named, named in the message).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from weight_sync_bench.check.convert import verify_checkpoint
from weight_sync_bench.check.forwards import BACKENDS
from weight_sync_bench.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    Output,
    add_deadline_option,
    add_limit_options,
    add_output_options,
    apply_deadline,
    count,
    limits_of,
    seed,
)
from weight_sync_bench.cli.records import verdict_record
from weight_sync_bench.conventions import CONVENTIONS, endpoint, shards_for
from weight_sync_bench.conventions.checkpoint import (
    HF_CONFIG,
    META_PARAMS,
    checkpoint_geometry,
    is_megatron_checkpoint,
    layout_of,
    write_checkpoint,
)
from weight_sync_bench.errors import FloorNotMeasured, WsbError
from weight_sync_bench.model.config import (
    CONFIGS,
    HF_NAMES,
    MOE_CONFIGS,
    SHIPPED_HF_CONFIGS,
    ModelConfig,
    config_by_name,
    hf_config_file,
)
from weight_sync_bench.model.footprint import require_fits

MODEL_HELP = ("--hf-config PATH reads a Hugging Face config.json (or names a shipped one: "
              + ", ".join(SHIPPED_HF_CONFIGS) + "); --layers and --vocab reduce it so that it fits "
              "(a real vocabulary and hidden size make tables of gigabytes)")


# -- the model options: --config NAME | --hf-config PATH --layers N [--vocab V]


def add_model_options(parser: argparse.ArgumentParser, *, default: str | None = "toy",
                      allow_all: bool = False, default_help: str | None = None) -> None:
    """``--config NAME`` or ``--hf-config PATH`` with ``--layers N`` and ``--vocab V``.
    ``--config`` defaults to ``default`` (``all`` allowed where ``allow_all``; None: the
    command finds the geometry itself, as ``default_help`` says)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--config", default=None,
                       choices=[*CONFIGS, *MOE_CONFIGS, *(["all"] if allow_all else [])],
                       help=f"a committed geometry (default {default_help or default})")
    which.add_argument("--hf-config", metavar="PATH", default=None,
                       help="a Hugging Face config.json, or the name of a shipped one ("
                            + ", ".join(SHIPPED_HF_CONFIGS) + "); needs --layers")
    parser.add_argument("--layers", type=count, default=None, metavar="N",
                        help="with --hf-config: the number of layers to build")
    parser.add_argument("--vocab", type=count, default=None, metavar="V",
                        help="with --hf-config: a reduced vocabulary")
    parser.set_defaults(config_default=default)


def hf_model(args: argparse.Namespace, *, need_layers: bool = True) -> ModelConfig | None:
    """The ``--hf-config`` geometry (None without it). ``--layers`` is required where the
    command builds the parameters (``need_layers``); ``--layers``/``--vocab`` without
    ``--hf-config`` are refused (a committed config has its floor measured as it is)."""
    if args.hf_config is None:
        if args.layers is not None or args.vocab is not None:
            raise WsbError("--layers and --vocab reduce an --hf-config geometry; a committed "
                           "--config is checked as it is")
        return None
    if need_layers and args.layers is None:
        raise WsbError(f"--hf-config {args.hf_config} needs --layers N: the file's full depth "
                       "would build every layer of the real model")
    return ModelConfig.from_hf_config(_hf_path(args), n_layers=args.layers, vocab=args.vocab)


def _hf_path(args: argparse.Namespace) -> Path:
    """``--hf-config``'s file (``model.config.hf_config_file``)."""
    return hf_config_file(args.hf_config)


def model_of(args: argparse.Namespace, *, need_layers: bool = True) -> ModelConfig:
    """The one geometry of a command that checks one (not ``all``)."""
    return hf_model(args, need_layers=need_layers) or config_by_name(
        args.config or args.config_default)


def weights_geometry(directory: Path, given: ModelConfig | None, options: str) -> ModelConfig:
    """The geometry of a ``--weights DIR`` check: ``given`` (what the model options named,
    checked against the directory when it is read), else what an HF directory's
    ``config.json`` states. A Megatron checkpoint's ``args`` state sizes, not the whole
    model (vocabulary, norms, rope): without ``given`` it is refused naming ``options``."""
    if given is not None:
        return given
    if is_megatron_checkpoint(directory):
        raise WsbError(f"{directory}: a Megatron checkpoint's args state sizes, not the whole "
                       f"model (vocabulary, norms, rope): give {options} (as Megatron-Bridge's "
                       "export takes its Hugging Face config); the args are checked against it")
    return checkpoint_geometry(directory, endpoint("hf"))


def guard(args: argparse.Namespace, config: ModelConfig, *, unit: str = "model",
          hint: str = "") -> None:
    """The geometry guard of every command that builds ``config``, before anything of it is
    allocated: ``model.footprint.require_fits`` under ``--max-gib`` / ``--max-gflop``
    (``GeometryTooLarge``, exit 2). ``unit``: how the command holds the model (whole, or
    streamed per ``"layer"`` or ``"parameter"``). A geometry from ``--hf-config`` is named
    in the file's words (``hidden_size``) or the flag's (``--layers``, ``--vocab``)."""
    names: dict[str, str] = {}
    if getattr(args, "hf_config", None) is not None:
        names = {**HF_NAMES, "n_layers": "--layers" if args.layers else "num_hidden_layers",
                 "vocab": "--vocab" if args.vocab else "vocab_size"}
    for key, flag in (("batch", "--batch"), ("seq_len", "--seq-len")):
        if getattr(args, key, None):
            names[key] = flag
    require_fits(config, limits_of(args), unit=unit, names=names, hint=hint)


def phase_of(args: argparse.Namespace) -> str:
    """The phase whose floor judges a check: 1b over gloo, else 1a."""
    return "1b" if args.backend == "gloo" else "1a"


def floor_command(args: argparse.Namespace, config: ModelConfig) -> str:
    """The command that measures an ``--hf-config`` geometry's floor, as the user named it."""
    phase = phase_of(args)
    return (f"python -m weight_sync_bench.tolerance geometry --hf-config {_hf_path(args)} "
            f"--layers {config.n_layers}" + (f" --vocab {args.vocab}" if args.vocab else "")
            + (f" --phase {phase}" if phase != "1a" else "")
            + (f" --dtype {args.dtype}" if args.dtype != "fp32" else ""))


# -- wsb emit


def cmd_emit(args: argparse.Namespace) -> int:
    out = Output(args)
    config = model_of(args)
    guard(args, config)
    where = endpoint(args.convention)
    if where.quantized:  # the seed's weights through the reference quantizer
        from weight_sync_bench.conventions.fp8 import fp8_shards
        from weight_sync_bench.model.config import init_params

        shards = fp8_shards(config, where, init_params(config, args.seed))
    else:
        shards = shards_for(config, where, seed=args.seed)
    files = write_checkpoint(args.directory, shards, where, config,
                             max_shard_size=args.max_shard_size)
    if not out.quiet:
        for path in files:
            out.text(f"{path.stat().st_size:>12,}  {path}")
    total = sum(p.stat().st_size for p in files)
    out.text(f"wrote {len(files)} files ({total:,} bytes): {config.name} seed {args.seed} as "
             f"{where} in {args.directory}")
    return EXIT_OK


# -- wsb verify


def cmd_verify(args: argparse.Namespace) -> int:
    out = Output(args)
    apply_deadline(args.deadline, args.backend == "gloo")
    where = endpoint(args.convention)
    if args.config is None and args.hf_config is None and args.layers is None \
            and args.vocab is None:  # the geometry the directory states
        config = checkpoint_geometry(args.directory, where, roots=args.allow_root)
        stated = META_PARAMS if layout_of(where) == "meta" else HF_CONFIG
        if not out.quiet:
            out.text(f"geometry: {config.name} (d_model {config.d_model}, {config.n_layers} "
                     f"layers), as {args.directory / stated} states it; --config or "
                     "--hf-config checks the directory against another")
    else:
        config = model_of(args)
    guard(args, config)
    source = endpoint(args.src) if args.src is not None else where
    try:
        verdict = verify_checkpoint(args.directory, config, str(where), src=str(source),
                                    seed=args.seed, backend=args.backend,
                                    measure_floor=args.measure_floor,
                                    roots=args.allow_root)
    except FloorNotMeasured as exc:
        if args.hf_config is None:
            raise
        args.dtype = "fp32"  # what floor_command reads; the checkpoint's own dtype is checked
        raise FloorNotMeasured(f"{exc}.\nFrom the command line: `{floor_command(args, config)}` "
                               "(once), or rerun this verify with --measure-floor",
                               command=floor_command(args, config)) from None
    out.record("check", **verdict_record(verdict, directory=str(args.directory)))
    out.text(str(verdict))
    code = EXIT_OK if verdict.passed else EXIT_FAILED
    out.text(f"\n{int(verdict.passed)} passed, {int(not verdict.passed)} failed")
    out.summary(code, checks=1, ran=1, passed=int(verdict.passed),
                failed=int(not verdict.passed), interrupted=False, skipped=[])
    return code


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``emit`` and ``verify`` to ``wsb``."""
    known = ", ".join(CONVENTIONS)
    emit = subparsers.add_parser(
        "emit", help="write the synthetic model as a framework stores it (for a converter "
                     "that is a command-line tool)", epilog=MODEL_HELP)
    emit.add_argument("--convention", required=True, metavar="NAME[:T]",
                      help=f"{known}; hf: config.json + model-0000N-of-0000M.safetensors + "
                           "model.safetensors.index.json; meta:T: params.json + "
                           "consolidated.NN.pth per rank; megatron:T, vllm:T, plain:T: "
                           "config.json + model-rank-{rank}-part-0.safetensors per rank "
                           "(vLLM's sharded-state pattern)")
    add_model_options(emit)
    emit.add_argument("--seed", type=seed, default=0, help="parameter seed (0..2^63-1)")
    emit.add_argument("--max-shard-size", type=count, default=None, metavar="BYTES",
                      help="hf only: the largest safetensors file (default a quarter of the "
                           "model, so it is cut into files as a real checkpoint is; at or "
                           "above the model's size one model.safetensors, no index)")
    emit.add_argument("directory", metavar="DIR", type=Path,
                      help="a new or empty directory")
    add_limit_options(emit, what="a geometry")
    add_output_options(emit, json_records=False)
    emit.set_defaults(func=cmd_emit)

    verify = subparsers.add_parser(
        "verify", help="check a converted checkpoint on disk: bytes against the declared "
                       "shards, then the destination's forward", epilog=MODEL_HELP)
    verify.add_argument("--convention", required=True, metavar="NAME[:T]",
                        help=f"what DIR holds ({known}), files as `wsb emit` writes them")
    add_model_options(verify, default=None,
                      default_help="the geometry DIR's config.json or params.json states")
    verify.add_argument("--from", dest="src", default=None, metavar="NAME[:T]",
                        help="the convention the converter read (names the route in the "
                             "verdict only)")
    verify.add_argument("--seed", type=seed, default=0,
                        help="the seed `wsb emit` wrote the source with (default 0)")
    verify.add_argument("--backend", choices=BACKENDS, default="inprocess",
                        help="where the destination forward runs (gloo: one process per rank)")
    verify.add_argument("--measure-floor", action="store_true",
                        help="a geometry no floor covers (an --hf-config one): measure its floor "
                             "now and keep it in your floor cache (WSB_FLOOR_CACHE, else "
                             "$XDG_CACHE_HOME/weight-sync-bench), then verify (as "
                             "`wsb check --measure-floor`); without, such a geometry is refused "
                             "naming the command")
    verify.add_argument("--allow-root", action="append", type=Path, default=[], metavar="ROOT",
                        help="a directory the checkpoint's symlinks may lead into besides DIR "
                             "(and, for a Hugging Face cache snapshot, its repository's blobs/); "
                             "repeatable. Without it, a file that resolves outside DIR, an "
                             "index entry naming ../ or an absolute path, and a FIFO or device "
                             "are refused before they are opened (exit 2)")
    verify.add_argument("directory", metavar="DIR", type=Path,
                        help="the checkpoint directory (its config.json or params.json states "
                             "the geometry unless --config or --hf-config says otherwise)")
    add_limit_options(verify, what="a geometry")
    add_output_options(verify)
    add_deadline_option(verify)
    verify.set_defaults(func=cmd_verify)

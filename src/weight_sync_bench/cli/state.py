"""``wsb verify-state``: what an engine holds after a sync, tensor by tensor.

    wsb verify-state --endpoint vllm:tp=4 (--weights DIR | --seed S) [--previous DIR |
                     --previous-seed S] [--sentinel V] [--dtype bf16] [--rank R ...]
                     [--config NAME | --hf-config PATH --layers N] STATE_DIR

STATE_DIR holds each engine rank's tensors as it dumped them after the sync
(``model-rank-{rank}-part-{part}.safetensors``: vLLM's sharded-state pattern); the weights
the trainer synced are an HF checkpoint directory (``--weights``, read with the file checks
of ``wsb verify``), a Megatron checkpoint (``--weights``: ``torch_dist``, or the legacy
``torch`` format at the degrees its ``args`` state, or ``--weights-from megatron:tp=2,pp=2``)
or the synthetic model of a seed (``--seed``, what ``wsb emit`` writes).
Each rank gets ``check.state.verify_state``'s report: every tensor equal, stale, never
written, misplaced (whose), wrong (the diagnosis), missing or unexpected, and its coverage
per layer and expert. Exit 0 when every tensor of every rank checked is equal, 1 when one
is not, 2 for a file or input that cannot be read (named).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

import torch

from weight_sync_bench.check.state import verify_ranks
from weight_sync_bench.cli.checkpoint import add_model_options, guard, model_of
from weight_sync_bench.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    Output,
    add_limit_options,
    add_output_options,
    rank,
    seed,
)
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import (
    checkpoint_geometry,
    is_megatron_checkpoint,
    read_rank_dumps,
    read_weights,
)
from weight_sync_bench.errors import WsbError
from weight_sync_bench.model.config import DTYPES, ModelConfig, init_params, parse_dtype

HF = "hf"


def _weights(args: argparse.Namespace, config: ModelConfig, directory: Path | None, seed_value: int | None
             ) -> Mapping[str, torch.Tensor]:
    """The canonical parameters of a checkpoint directory (``read_weights``: an HF one read
    lazily, checked as ``wsb verify`` checks one; a Megatron one), or of the synthetic model
    of a seed."""
    if directory is None:
        assert seed_value is not None
        return init_params(config, seed_value)
    saved = endpoint(args.weights_from) if args.weights_from is not None else None
    return read_weights(directory, config, where=saved, roots=args.allow_root)


def cmd_verify_state(args: argparse.Namespace) -> int:
    out = Output(args)
    where = endpoint(args.endpoint)
    if args.config is None and args.hf_config is None and args.layers is None \
            and args.vocab is None:  # the geometry the weights (else the dumps) state
        # a Megatron checkpoint's args state sizes, not the model (no vocabulary, norm or
        # rope): the engine's config.json beside its dumps does (checked against the args)
        hf_side = args.weights is not None and not is_megatron_checkpoint(args.weights)
        stated = args.weights if hf_side else args.state
        config = checkpoint_geometry(stated, endpoint(HF) if hf_side else where,
                                     roots=args.allow_root)
        if not out.quiet:
            out.text(f"geometry: {config.name} (d_model {config.d_model}, {config.n_layers} "
                     f"layers), as {stated / 'config.json'} states it")
    else:
        config = model_of(args)
    guard(args, config)
    world = where.world
    ranks = list(dict.fromkeys(args.rank)) if args.rank else list(range(world))
    bad = [r for r in ranks if r >= world]
    if bad:
        raise WsbError(f"--rank {bad[0]}: {where} has ranks 0..{world - 1}")
    weights = _weights(args, config, args.weights, args.seed)
    previous = (None if args.previous is None and args.previous_seed is None
                else _weights(args, config, args.previous, args.previous_seed))
    dtype = parse_dtype(args.dtype) if args.dtype is not None else None
    dumps = read_rank_dumps(args.state, where, roots=args.allow_root, ranks=ranks)
    failed = 0
    for report in verify_ranks(dumps, where, weights, config=config, ranks=ranks,
                               previous=previous, sentinel=args.sentinel, dtype=dtype):
        rank = report.rank
        failed += not report.passed
        out.record("state", endpoint=str(where), rank=rank, passed=report.passed,
                   counts=report.counts(), coverage=report.coverage(),
                   outcomes=[{"name": o.name, "outcome": o.outcome, "detail": o.detail}
                             for o in report.outcomes if o.outcome != "equal"])
        out.text(report.summary())
    code = EXIT_FAILED if failed else EXIT_OK
    out.text(f"\n{len(ranks) - failed} passed, {failed} failed")
    out.summary(code, checks=len(ranks), ran=len(ranks), passed=len(ranks) - failed,
                failed=failed, interrupted=False, skipped=[])
    return code


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``verify-state`` to ``wsb``."""
    state = subparsers.add_parser(
        "verify-state", help="check what each engine rank holds after a sync against the "
                             "trainer's weights, tensor by tensor (equal, stale, never "
                             "written, misplaced, wrong, missing, unexpected)")
    state.add_argument("--endpoint", required=True, metavar="ENDPOINT",
                       help="the engine's layout (vllm:tp=4, vllm:tp=2,ep=2, megatron:2)")
    source = state.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", type=Path, default=None, metavar="DIR",
                        help="the synced weights: a Hugging Face checkpoint directory, or "
                             "Megatron checkpoint (torch_dist, or legacy torch)")
    source.add_argument("--seed", type=seed, default=None,
                        help="the synced weights: the synthetic model `wsb emit --seed` writes")
    state.add_argument("--weights-from", default=None, metavar="ENDPOINT",
                       help="the layout a legacy Megatron --weights (and --previous) checkpoint "
                            "was saved at (megatron:tp=2,pp=2,ep=2), where its args do not say "
                            "it; by default, what they say")
    before = state.add_mutually_exclusive_group()
    before.add_argument("--previous", type=Path, default=None, metavar="DIR",
                        help="the weights before the sync (an HF directory): a tensor "
                             "holding their bytes is named stale")
    before.add_argument("--previous-seed", type=seed, default=None, metavar="S",
                        help="the weights before the sync, as a synthetic model's seed")
    state.add_argument("--sentinel", type=float, default=None, metavar="V",
                       help="the value every engine tensor was filled with before the sync: "
                            "a tensor still holding it is named never written")
    state.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="the engine's dtype (default the weights'): the declared tensors "
                            "are cast by torch's .to(), round to nearest even")
    state.add_argument("--rank", type=rank, action="append", default=None,
                       metavar="R", help="check this rank only (repeatable; default every rank)")
    add_model_options(state, default=None,
                      default_help="the geometry --weights' config.json (else STATE_DIR's) "
                                   "states")
    state.add_argument("--allow-root", action="append", type=Path, default=[], metavar="ROOT",
                       help="a directory the files' symlinks may lead into besides their own "
                            "(repeatable); anything else resolving outside is refused")
    state.add_argument("state", metavar="STATE_DIR", type=Path,
                       help="the engine's rank dumps: model-rank-{rank}-part-{part}.safetensors")
    add_limit_options(state, what="a geometry")
    add_output_options(state)
    state.set_defaults(func=cmd_verify_state)

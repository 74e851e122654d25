"""``verify_checkpoint``: ``check_convert``'s verdict on a checkpoint a converter wrote to disk."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from weight_sync_bench.check.conversion import conversion_checker
from weight_sync_bench.check.shards import validate_convention_shards
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import read_checkpoint
from weight_sync_bench.errors import CheckpointError, InvalidNumber, WrongShardShape
from weight_sync_bench.model.config import init_params

if TYPE_CHECKING:
    from weight_sync_bench.check.verdict import Verdict
    from weight_sync_bench.model.config import ModelConfig


def verify_checkpoint(directory: str | Path, config: ModelConfig, dst: str, *,
                      src: str | None = None, seed: int = 0, backend: str = "inprocess",
                      threshold: float | None = None, measure_floor: bool = False,
                      roots: Sequence[str | Path] = ()) -> Verdict:
    """``check_convert``'s verdict on a checkpoint a converter wrote to ``directory`` in
    ``dst``'s files (``conventions.checkpoint``: per-rank safetensors for ``vllm:2``, an HF
    directory for ``hf``, consolidated files for ``meta:2``), against the synthetic model
    of ``seed`` (what ``wsb emit`` wrote). ``src`` names the source in the verdict only
    (default ``dst``); with the converter's source it is the verdict ``check_convert``
    gives the same tensors. A file missing, truncated, mis-named or holding a tensor of the
    wrong name, shape or dtype raises ``CheckpointError`` naming the file. The threshold is
    ``check_convert``'s (``floor_for``; ``measure_floor`` measures and caches an unmeasured
    geometry's floor, else ``FloorNotMeasured`` names the command). Files are opened only
    inside ``directory`` (or its Hugging Face cache ``blobs/``, or one of ``roots``), as
    ``read_checkpoint`` says."""
    InvalidNumber.seed("seed", seed)
    target = endpoint(dst)
    source = endpoint(src) if src is not None else target
    target.unquantized().pieces(config)
    checkpoint = read_checkpoint(directory, target, config, roots=roots)
    if target.quantized:  # FP8: weights and scales against the reference quantizer's
        from weight_sync_bench.check.fp8 import check_fp8_convert
        from weight_sync_bench.conventions.fp8 import FP8, is_scale

        dtype = next(x.dtype for n, x in checkpoint.shards[0].items()  # the unquantized ones'
                     if x.dtype != FP8 and not is_scale(n))
        written = checkpoint.shards
        return check_fp8_convert(lambda shards, degree: written, config,
                                 source.unquantized(), target,
                                 init_params(config, seed, dtype=dtype), threshold=threshold,
                                 seed=seed)
    checker = conversion_checker(config, seed=seed, backend=backend, threshold=threshold,
                                 measure_floor=measure_floor)
    try:
        validate_convention_shards(checkpoint.shards, target, config,
                                   {n: x.dtype for n, x in checker.checker.full.items()})
    except WrongShardShape as exc:  # names and shapes were read checked: a dtype
        path = checkpoint.file_of(exc.rank or 0, exc.name or "")
        raise CheckpointError(f"{path}: {exc}", path=str(path)) from None
    return checker.verdict(checkpoint.shards, src=source, dst=target)

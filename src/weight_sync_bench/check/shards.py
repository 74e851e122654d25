"""What a convention's shards must be before their bytes are compared.

``validate_convention_shards``: a list of ``degree`` dicts holding exactly the convention's
stored names, each a CPU tensor of its declared shape and its canonical parameter's dtype;
``InvalidShards`` (``WrongShardShape`` for a shape or dtype) otherwise, naming the endpoint,
the rank, the stored name, the expected and the actual value; ``Uncovered`` where declared
tensors are never written, told by the layers they belong to (``coverage``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.staging import describe_rank
from weight_sync_bench.errors import InvalidShards, Uncovered, WrongShardShape

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.conventions.maps import Piece, Pieces
    from weight_sync_bench.model.config import ModelConfig


def validate_convention_shards(shards: object, where: Endpoint, config: ModelConfig,
                               dtypes: Mapping[str, torch.dtype], *,
                               pieces: Pieces | None = None) -> None:
    """Raise unless ``shards`` is a list of ``where.world`` dicts holding exactly the
    convention's stored names (str keys) with their declared shapes and the canonical
    parameters' dtypes. ``InvalidShards`` (``WrongShardShape`` for a shape or dtype) names
    the endpoint, the rank, the stored name, the expected and the actual value. ``pieces``:
    only these stored tensors (one stage of a streamed check), else all of them."""
    degree, shapes = where.world, config.param_shapes()
    pieces = pieces if pieces is not None else where.pieces(config)
    if not isinstance(shards, Sequence) or isinstance(shards, (str, bytes)):
        raise InvalidShards(f"{where}: expected a list of {degree} rank dicts, got "
                            f"{type(shards).__name__}")
    if len(shards) != degree:
        raise InvalidShards(f"{where}: expected {degree} rank dicts, got {len(shards)}")
    for rank, (params, expected) in enumerate(zip(shards, pieces)):
        if not isinstance(params, Mapping):
            raise InvalidShards(f"{where} rank {rank}: expected a dict of tensors, got "
                                f"{type(params).__name__}")
        for key in params:
            if not isinstance(key, str):
                raise InvalidShards(f"{where} rank {rank}: key {key!r} is a "
                                    f"{type(key).__name__}, expected a str parameter name")
        missing = [n for n in expected if n not in params]
        extra = sorted(set(params) - set(expected))
        if missing or extra:
            parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unexpected {', '.join(extra)}"] if extra else [])
            tied = (" (tied embeddings: the output layer reads the embedding table, not a "
                    "stored copy)" if config.tie_embeddings and extra and not where.staged
                    else "")
            message = f"{where} rank {rank}: {'; '.join(parts)}{tied}"
            if missing:
                told = coverage(where, config, rank, expected, missing)
                raise Uncovered(f"{message}. {told}" if told else message,
                                missing={rank: missing})
            raise InvalidShards(message)
        for name, piece in expected.items():
            x = params[name]
            if not isinstance(x, torch.Tensor):
                raise InvalidShards(f"{where} rank {rank} {name}: expected a Tensor, got "
                                    f"{type(x).__name__}")
            want, actual = piece.local_shape(shapes[piece.source]), tuple(x.shape)
            if actual != want:
                raise WrongShardShape(f"{where} rank {rank} {name}: shape {list(actual)}, "
                                      f"declared {list(want)}", rank=rank, name=name,
                                      expected=want, actual=actual)
            if x.device.type != "cpu":
                raise InvalidShards(f"{where} rank {rank} {name}: on the {x.device.type} "
                                    "device: the check compares values, so return CPU tensors")
            if x.dtype != dtypes[piece.source]:
                raise WrongShardShape(f"{where} rank {rank} {name}: dtype {x.dtype}, declared "
                                      f"{dtypes[piece.source]}", rank=rank, name=name,
                                      expected_dtype=dtypes[piece.source], actual_dtype=x.dtype)


def coverage(where: Endpoint, config: ModelConfig, rank: int, expected: Mapping[str, Piece],
             missing: list[str]) -> str:
    """``coverage: never written on rank 2: layers 1, 3 (18 tensors) ...``: the declared
    tensors a rank lacks, told by the canonical layers they belong to, and where the rank
    sits in the pipeline; empty where the names alone say it all (no layer, no stages)."""
    layers = sorted({int(expected[n].source.split(".")[1]) for n in missing
                     if expected[n].source.startswith("layers.")})
    if not layers and not where.staged:
        return ""
    rest = [n for n in missing if not expected[n].source.startswith("layers.")]
    told = ([f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}"]
            if layers else []) + rest
    out = (f"coverage: never written on rank {rank}: {', '.join(told)} ({len(missing)} "
           f"declared tensor{'s' if len(missing) > 1 else ''})")
    if where.staged:
        out += f"; {describe_rank(config, where, rank)}"
    return out

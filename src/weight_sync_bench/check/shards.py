"""What a convention's shards must be before their bytes are compared.

``validate_convention_shards``: a list of ``degree`` dicts holding exactly the convention's
stored names, each a CPU tensor of its declared shape and its canonical parameter's dtype;
``InvalidShards`` (``WrongShardShape`` for a shape or dtype) otherwise, naming the endpoint,
the rank, the stored name, the expected and the actual value; ``Uncovered`` where declared
tensors are never written, told by the layers they belong to (``coverage``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.staging import describe_rank
from weight_sync_bench.errors import InvalidShards, Uncovered, WrongShardShape

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.conventions.maps import Piece, Pieces
    from weight_sync_bench.model.config import ModelConfig


# What a rank must hold under each stored name: its shape and dtype.
Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def validate_shards(shards: object, where: Endpoint | str, expected: Sequence[Expected], *,
                    mismatch: Callable[[int, list[str], list[str], str], InvalidShards]
                    | None = None) -> list[Mapping[str, torch.Tensor]]:
    """``shards`` as a list of one dict per entry of ``expected``, each holding exactly its
    names (str keys), each a CPU tensor of its shape and dtype; else ``InvalidShards``
    (``WrongShardShape`` for a shape or dtype) naming the endpoint, the rank, the stored
    name, the expected and the actual value. ``mismatch(rank, missing, extra, message)``
    makes the error for names missing or unexpected (default: ``InvalidShards(message)``).
    The one structural check of every convention's shards, quantized ones included."""
    degree = len(expected)
    if not isinstance(shards, Sequence) or isinstance(shards, (str, bytes)):
        raise InvalidShards(f"{where}: expected a list of {degree} rank dicts, got "
                            f"{type(shards).__name__}")
    if len(shards) != degree:
        raise InvalidShards(f"{where}: expected {degree} rank dicts, got {len(shards)}")
    for rank, (params, want) in enumerate(zip(shards, expected)):
        if not isinstance(params, Mapping):
            raise InvalidShards(f"{where} rank {rank}: expected a dict of tensors, got "
                                f"{type(params).__name__}")
        for key in params:
            if not isinstance(key, str):
                raise InvalidShards(f"{where} rank {rank}: key {key!r} is a "
                                    f"{type(key).__name__}, expected a str parameter name")
        missing = [n for n in want if n not in params]
        extra = sorted(set(params) - set(want))
        if missing or extra:
            parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unexpected {', '.join(extra)}"] if extra else [])
            message = f"{where} rank {rank}: {'; '.join(parts)}"
            raise (mismatch(rank, missing, extra, message) if mismatch is not None
                   else InvalidShards(message))
        for name, (shape, dtype) in want.items():
            x = params[name]
            if not isinstance(x, torch.Tensor):
                raise InvalidShards(f"{where} rank {rank} {name}: expected a Tensor, got "
                                    f"{type(x).__name__}")
            if tuple(x.shape) != shape:
                raise WrongShardShape(f"{where} rank {rank} {name}: shape {list(x.shape)}, "
                                      f"declared {list(shape)}", rank=rank, name=name,
                                      expected=shape, actual=tuple(x.shape))
            if x.device.type != "cpu":
                raise InvalidShards(f"{where} rank {rank} {name}: on the {x.device.type} "
                                    "device: the check compares values, so return CPU tensors")
            if x.dtype != dtype:
                raise WrongShardShape(f"{where} rank {rank} {name}: dtype {x.dtype}, declared "
                                      f"{dtype}", rank=rank, name=name, expected_dtype=dtype,
                                      actual_dtype=x.dtype)
    return list(shards)


def validate_convention_shards(shards: object, where: Endpoint, config: ModelConfig,
                               dtypes: Mapping[str, torch.dtype], *,
                               pieces: Pieces | None = None) -> None:
    """Raise unless ``shards`` is a list of ``where.world`` dicts holding exactly the
    convention's stored names (str keys) with their declared shapes and the canonical
    parameters' dtypes (``validate_shards``). Declared tensors never written are
    ``Uncovered``, told by the layers they belong to (``coverage``). ``pieces``: only these
    stored tensors (one stage of a streamed check), else all of them."""
    shapes = config.param_shapes()
    pieces = pieces if pieces is not None else where.pieces(config)
    expected = [{name: (piece.local_shape(shapes[piece.source]), dtypes[piece.source])
                 for name, piece in rank.items()} for rank in pieces]

    def mismatch(rank: int, missing: list[str], extra: list[str],
                 message: str) -> InvalidShards:
        if config.tie_embeddings and extra and not where.staged:
            message += (" (tied embeddings: the output layer reads the embedding table, not "
                        "a stored copy)")
        if not missing:
            return InvalidShards(message)
        told = coverage(where, config, rank, pieces[rank], missing)
        return Uncovered(f"{message}. {told}" if told else message, missing={rank: missing})

    validate_shards(shards, where, expected, mismatch=mismatch)


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

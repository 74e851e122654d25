"""Layout bugs injected into rank-local shards, to prove the check detects them.

Every mutation takes the declared shards at degree t and returns a new list of shard dicts
of exactly the same names, shapes and dtypes: a shape error would be caught by torch, not by
the invariant, and would pass even if ``ShardedModel`` computed nothing. Each declares where
it is the identity (``identity_reason``), so a test never demands detection of a no-op.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.reshard import gather_tensor
from weight_sync_bench.shardspec import Replicate

if TYPE_CHECKING:
    from weight_sync_bench.config import ModelConfig
    from weight_sync_bench.shardspec import LayoutTable, ShardSpec

Params = dict[str, torch.Tensor]
# (rank-local tensors of one parameter, its spec, the model config) -> new rank-local tensors
TensorBug = Callable[[list[torch.Tensor], "ShardSpec", "ModelConfig"], list[torch.Tensor]]
# (config, degree) -> why the mutation changes nothing there, or None where it does
IdentityRule = Callable[["ModelConfig", int], str | None]


@dataclass(frozen=True)
class Mutation:
    """A named, shape-preserving layout bug over every parameter whose name matches ``target``."""

    name: str
    description: str
    target: str  # regex, matched against the full parameter name
    bug: TensorBug
    identity: IdentityRule

    def identity_reason(self, config: ModelConfig, degree: int) -> str | None:
        """Why this mutation is the identity at (config, degree), or None if it is not."""
        return self.identity(config, degree)

    def targets(self, layout: LayoutTable) -> list[str]:
        return [name for name in layout.names if re.fullmatch(self.target, name)]

    def apply(self, shards: list[Params], layout: LayoutTable, config: ModelConfig) -> list[Params]:
        """A mutated copy of ``shards`` (the input is left untouched)."""
        out = [dict(params) for params in shards]
        for name in self.targets(layout):
            new = self.bug([params[name] for params in shards], layout[name], config)
            for rank, tensor in enumerate(new):
                before = shards[rank][name]
                assert tensor.shape == before.shape and tensor.dtype == before.dtype, (
                    f"mutation {self.name} changed {name} on rank {rank}: "
                    f"{list(before.shape)} -> {list(tensor.shape)}")
                out[rank][name] = tensor
        return out


def _at_t1(config: ModelConfig, degree: int) -> str | None:
    return "t=1: a single rank holds the whole tensor" if degree == 1 else None


def _contiguous_slice(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                      ) -> list[torch.Tensor]:
    """Rank r takes the r-th contiguous block of the fused tensor, as ``chunk(t, dim=0)``."""
    full = gather_tensor(shards, spec)
    return [c.clone() for c in full.chunk(len(shards), dim=0)]


def _reversed_ranks(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                    ) -> list[torch.Tensor]:
    """Right dim, wrong assignment: rank r gets rank (t-1-r)'s slice."""
    return [s.clone() for s in reversed(shards)]


def _rotated_replica(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                     ) -> list[torch.Tensor]:
    """Rank r's copy of a replicated vector rolled by r x (size / t)."""
    assert isinstance(spec.placement, Replicate)
    t, size = len(shards), spec.shape[0]
    return [torch.roll(s, r * (size // t), dims=0) for r, s in enumerate(shards)]


SEED_MUTATIONS: tuple[Mutation, ...] = (
    Mutation("contiguous_qkv", "fused qkv sliced contiguously on dim 0 instead of per head",
             r"layers\.\d+\.qkv\.weight", _contiguous_slice, _at_t1),
    Mutation("o_proj_reversed", "o_proj sharded on dim 1, rank-to-slice assignment reversed",
             r"layers\.\d+\.o_proj\.weight", _reversed_ranks, _at_t1),
    Mutation("down_reversed", "down sharded on dim 1, rank-to-slice assignment reversed",
             r"layers\.\d+\.down\.weight", _reversed_ranks, _at_t1),
    Mutation("norm_rotated", "each rank's replicated norm weight rotated by rank x shard width",
             r"(layers\.\d+\.(attn|ffn)_norm|norm)\.weight", _rotated_replica, _at_t1),
)

MUTATIONS: dict[str, Mutation] = {m.name: m for m in SEED_MUTATIONS}


def mutation_by_name(name: str) -> Mutation:
    try:
        return MUTATIONS[name]
    except KeyError:
        raise KeyError(f"unknown mutation {name!r}; known: {', '.join(MUTATIONS)}") from None

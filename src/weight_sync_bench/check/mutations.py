"""Layout bugs injected into rank-local shards, to prove the check detects them.

The four seed injections come first; the rest are the real bug classes of
../shared/REFERENCES.md ("Real bugs"): K and V swapped, gate and up swapped, a fused tensor
read in the other storage convention (interleaved per query group vs plain concatenation),
a head boundary off by one head, vocabulary shards in reversed rank order, one rank's
replica differing slightly, a shard dropped (zeros) or duplicated (every rank gets rank 0's).

Every mutation takes the declared shards at degree t and returns a new list of shard dicts
of exactly the same names, shapes and dtypes: a shape error would be caught by torch, not by
the invariant, and would pass even if ``ShardedModel`` computed nothing. Each declares where
it is the identity (``identity_reason``), so a test never demands detection of a no-op.

``DTYPE_MUTATIONS`` (not in ``MUTATIONS``, whose kill matrix demands a logits deviation) are
the bugs of a cast on the way: a shard silently sent through bf16 or fp16 and back. Same
dtype, different bytes, and logits that may stay inside the tolerance: only the byte check
catches them, which is what their tests show.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.megatron import (
    grouped_qkv_order as interleaved_qkv_order,
)
from weight_sync_bench.errors import UnknownMutation
from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.layout.reshard import gather_tensor, split_tensor

if TYPE_CHECKING:
    from weight_sync_bench.layout.table import LayoutTable, ShardSpec
    from weight_sync_bench.model.config import ModelConfig


Params = dict[str, torch.Tensor]
# The kill matrix's claim: a mutation, wherever it is not the identity, deviates by at least
# this many times the threshold (which itself sits >= 100x above the floor).
KILL_MARGIN = 10
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
    # Where detection is weaker than the others, and why (empty when it is not): the kill
    # property still demands the same margin; the note says what makes it the tight one.
    note: str = ""

    # (synced dtype) -> why the mutation is the identity for weights of that dtype, or None
    dtype_identity: Callable[[torch.dtype], str | None] = lambda dtype: None

    def identity_reason(self, config: ModelConfig, degree: int,
                        dtype: torch.dtype = torch.float32) -> str | None:
        """Why this mutation is the identity at (config, degree) for ``dtype`` weights, or
        None if it is not."""
        return self.identity(config, degree) or self.dtype_identity(dtype)

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


def _never(config: ModelConfig, degree: int) -> str | None:
    return None


def _single_kv_group(config: ModelConfig, degree: int) -> str | None:
    return ("n_kv_heads=1: one query group, so the interleaved and plain orders coincide"
            if config.n_kv_heads == 1 else None)


def _qkv_parts(x: torch.Tensor, config: ModelConfig, degree: int) -> list[torch.Tensor]:
    """A rank-local ``[Q_r | K_r | V_r]`` shard, split into its three row blocks."""
    q, kv = config.q_rows // degree, config.kv_rows // degree
    return list(x.split([q, kv, kv], dim=0))


def _kv_swapped(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                ) -> list[torch.Tensor]:
    """Each rank's K and V blocks exchanged: ``[Q_r | V_r | K_r]``."""
    out = []
    for s in shards:
        q, k, v = _qkv_parts(s, config, len(shards))
        out.append(torch.cat([q, v, k], dim=0))
    return out


def _halves_swapped(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                    ) -> list[torch.Tensor]:
    """Each rank's gate and up halves exchanged: ``[up_r | gate_r]``."""
    return [torch.cat(list(reversed(s.chunk(2, dim=0))), dim=0) for s in shards]


def _resplit(shards: list[torch.Tensor], spec: ShardSpec, order: torch.Tensor
             ) -> list[torch.Tensor]:
    """Gather, reorder the rows of the full tensor by ``order``, split again."""
    return split_tensor(gather_tensor(shards, spec)[order], spec, len(shards))


def _qkv_interleaved_read_as_plain(shards: list[torch.Tensor], spec: ShardSpec,
                                   config: ModelConfig) -> list[torch.Tensor]:
    """The checkpoint stores qkv interleaved per query group; the loader splits it as if it
    were the plain ``[Q | K | V]``."""
    order = interleaved_qkv_order(config.n_heads, config.n_kv_heads, config.head_dim)
    return _resplit(shards, spec, order)


def _qkv_plain_read_as_interleaved(shards: list[torch.Tensor], spec: ShardSpec,
                                   config: ModelConfig) -> list[torch.Tensor]:
    """The checkpoint stores the plain ``[Q | K | V]``; the loader de-interleaves it as if
    it were interleaved per query group."""
    order = interleaved_qkv_order(config.n_heads, config.n_kv_heads, config.head_dim)
    return _resplit(shards, spec, torch.argsort(order))


def _gate_up_interleaved_read_as_plain(shards: list[torch.Tensor], spec: ShardSpec,
                                       config: ModelConfig) -> list[torch.Tensor]:
    """The checkpoint stores gate_up row-interleaved ``[g0, u0, g1, u1, ...]``; the loader
    splits it as if it were ``[gate | up]``."""
    ffn = config.ffn
    order = torch.stack([torch.arange(ffn), ffn + torch.arange(ffn)], dim=1).flatten()
    return _resplit(shards, spec, order)


def _q_boundary_shifted(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                        ) -> list[torch.Tensor]:
    """Rank r's query heads start one head late: heads ``[r*h/t + 1, (r+1)*h/t + 1)``,
    the last rank wrapping round to head 0."""
    t = len(shards)
    if t == 1:
        return [s.clone() for s in shards]
    full = gather_tensor(shards, spec)
    q = full[:config.q_rows].roll(-config.head_dim, dims=0)
    return split_tensor(torch.cat([q, full[config.q_rows:]], dim=0), spec, t)


REPLICA_SCALE = 1.05  # how far one rank's replica drifts: a few percent, like a stale copy


def _last_replica_scaled(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                         ) -> list[torch.Tensor]:
    """The last rank's copy of a replicated parameter scaled by ``REPLICA_SCALE``; the other
    copies untouched (no-op at t=1, where there is no other copy to differ from)."""
    if len(shards) == 1:
        return [s.clone() for s in shards]
    return [s.clone() for s in shards[:-1]] + [shards[-1] * REPLICA_SCALE]


def _last_shard_zeroed(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                       ) -> list[torch.Tensor]:
    """The last rank's shard never loaded: zeros where its slice should be."""
    return [s.clone() for s in shards[:-1]] + [torch.zeros_like(shards[-1])]


def _rank0_duplicated(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
                      ) -> list[torch.Tensor]:
    """Every rank loaded rank 0's shard."""
    return [shards[0].clone() for _ in shards]


_QKV, _GATE_UP = r"layers\.\d+\.qkv\.weight", r"layers\.\d+\.gate_up\.weight"

BUG_CLASS_MUTATIONS: tuple[Mutation, ...] = (
    Mutation("kv_swapped", "K and V blocks exchanged inside every rank's fused qkv shard",
             _QKV, _kv_swapped, _never),
    Mutation("gate_up_swapped", "gate and up halves exchanged inside every rank's gate_up shard",
             _GATE_UP, _halves_swapped, _never,
             note="silu(g) * u and silu(u) * g agree to second order in small pre-activations: "
                  "seen only because domain.fuzz_init keeps SiLU in its nonlinear range"),
    Mutation("qkv_interleaved_read_as_plain",
             "qkv stored interleaved per query group, split as plain [Q | K | V]",
             _QKV, _qkv_interleaved_read_as_plain, _single_kv_group),
    Mutation("qkv_plain_read_as_interleaved",
             "qkv stored as plain [Q | K | V], de-interleaved as if per query group",
             _QKV, _qkv_plain_read_as_interleaved, _single_kv_group),
    Mutation("gate_up_interleaved_read_as_plain",
             "gate_up stored row-interleaved [g0, u0, g1, u1, ...], split as [gate | up]",
             _GATE_UP, _gate_up_interleaved_read_as_plain,
             lambda config, degree: "ffn=1: one row each" if config.ffn == 1 else None),
    Mutation("q_head_boundary_shifted", "rank boundaries of the query heads off by one head",
             _QKV, _q_boundary_shifted,
             lambda config, degree: "t=1: no boundary between ranks" if degree == 1 else None),
    Mutation("embedding_reversed", "tok_embeddings vocab shards in reversed rank order",
             r"tok_embeddings\.weight", _reversed_ranks, _at_t1),
    Mutation("lm_head_reversed", "lm_head vocab shards in reversed rank order",
             r"lm_head\.weight", _reversed_ranks, _at_t1),
    Mutation("replica_scaled",
             f"the last rank's copy of every replicated norm weight scaled by {REPLICA_SCALE}",
             r"(layers\.\d+\.(attn|ffn)_norm|norm)\.weight", _last_replica_scaled,
             lambda config, degree: "t=1: one replica, nothing to differ from" if degree == 1
             else None,
             note="the tightest of the matrix (see `wsb mutants`): a few percent on one "
                  "rank's copy moves only that rank's share of each layer"),
    Mutation("down_shard_dropped",
             "the last rank's down shard left as zeros (a silent partial load)",
             r"layers\.\d+\.down\.weight", _last_shard_zeroed, _never),
    Mutation("qkv_rank0_duplicated", "every rank loaded rank 0's qkv shard",
             _QKV, _rank0_duplicated, _at_t1),
)

MUTATIONS: dict[str, Mutation] = {m.name: m for m in SEED_MUTATIONS + BUG_CLASS_MUTATIONS}


def _round_trip(via: torch.dtype) -> TensorBug:
    """Every shard cast to ``via`` and back to its own dtype (round to nearest even each way,
    as ``Tensor.to``): a wire or staging buffer of the wrong dtype."""
    def bug(shards: list[torch.Tensor], spec: ShardSpec, config: ModelConfig
            ) -> list[torch.Tensor]:
        return [s.to(via).to(s.dtype) for s in shards]
    return bug


def _exact_for(via: torch.dtype, name: str) -> Callable[[torch.dtype], str | None]:
    """The identity rule of a round trip through ``via``: exact for weights already ``via``;
    bf16 weights through fp16 is not declared either way (exact inside fp16's normal range,
    lossy only for values below 2^-17 or above 65504, which a small draw may not hold)."""
    def rule(dtype: torch.dtype) -> str | None:
        if dtype == via:
            return f"{name} weights are already {name}: the round trip is exact"
        if dtype == torch.bfloat16 and via == torch.float16:
            return ("bf16 -> fp16 -> bf16 changes only values below 2^-17 or above 65504: "
                    "not declared a bug for bf16 weights")
        return None
    return rule


# Real cases: a sync that stages weights in a bf16 (or fp16) buffer for the wire and copies
# them back into fp32 parameters. Loaders check the size, not the dtype, and ``copy_`` casts:
# vLLM's ``model_loader.weight_utils.default_weight_loader`` asserts
# ``param.size() == loaded_weight.size()`` then ``param.data.copy_(loaded_weight)``, so a
# weight that went through bf16 on the way arrives rounded and nothing complains.
DTYPE_MUTATIONS: tuple[Mutation, ...] = (
    Mutation("bf16_round_trip", "every shard sent through bf16 and back (fp32 -> bf16 -> fp32)",
             r".*", _round_trip(torch.bfloat16), _never,
             dtype_identity=_exact_for(torch.bfloat16, "bf16"),
             note="same dtype, bytes rounded to 8 significant bits: caught by the byte check, "
                  "the logits can stay inside the tolerance"),
    Mutation("fp16_round_trip", "every shard sent through fp16 and back", r".*",
             _round_trip(torch.float16), _never,
             dtype_identity=_exact_for(torch.float16, "fp16"),
             note="11 significant bits, and values below 6.1e-5 flushed toward fp16's "
                  "subnormals: caught by the byte check"),
)

DTYPE_MUTATIONS_BY_NAME: dict[str, Mutation] = {m.name: m for m in DTYPE_MUTATIONS}


def mutation_by_name(name: str) -> Mutation:
    """One of ``MUTATIONS`` or ``DTYPE_MUTATIONS``, by name."""
    found = MUTATIONS.get(name) or DTYPE_MUTATIONS_BY_NAME.get(name)
    if found is None:
        raise UnknownMutation(f"unknown mutation {name!r}; known: "
                              f"{', '.join([*MUTATIONS, *DTYPE_MUTATIONS_BY_NAME])}")
    return found

"""The model's tensor-parallel plan: which placement each parameter of the toy model has.

Kept beside the model, as torchtitan keeps its plan beside its model: the placements are
generic (``layout``), the choice of one per parameter is this model's.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from weight_sync_bench.layout.placements import (
    Experts,
    FusedPaired,
    HeadPartitioned,
    Placement,
    Replicate,
    Shard,
)
from weight_sync_bench.layout.table import LayoutTable

if TYPE_CHECKING:

    from weight_sync_bench.model.config import ModelConfig


@functools.lru_cache(maxsize=512)  # a frozen config -> a frozen table: shared, never changed
def layout_for(config: ModelConfig) -> LayoutTable:
    """The declared Megatron-style TP layout of the toy model.

    Column-parallel fused qkv and gate_up, row-parallel o_proj and down (split on the input
    dim, partial sums all-reduced), vocab-parallel embedding and lm_head, replicated norms.
    Only the parameters ``config.param_shapes()`` has are laid out (no lm_head when tied,
    biases only with ``config.bias``); the vocab tables have ``config.padded_vocab`` rows.

    An MoE layer: the router (and its selection bias) and Qwen3's q/k norms replicated; every
    expert on every rank, each split as a dense MLP is (``Experts`` with ``ep=1``: expert-TP
    over the whole degree, vLLM's layout without expert parallelism); the shared expert split
    as a dense MLP, its gate replicated. Expert parallelism is a convention's layout
    (``conventions``), read by the forward through ``experts_placement``.
    """
    placements: dict[str, Placement] = {
        "tok_embeddings.weight": Shard(0), "norm.weight": Replicate(), "lm_head.weight": Shard(0)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        placements[p + "attn_norm.weight"] = Replicate()
        placements[p + "qkv.weight"] = HeadPartitioned(config.n_heads, config.n_kv_heads,
                                                       config.head_dim)
        # Biases (config.bias): the qkv bias follows its rows; a row-parallel bias is
        # replicated and added once, after the partial sums meet.
        placements[p + "qkv.bias"] = placements[p + "qkv.weight"]
        placements[p + "o_proj.bias"] = Replicate()
        placements[p + "down.bias"] = Replicate()
        placements[p + "o_proj.weight"] = Shard(1)
        placements[p + "ffn_norm.weight"] = Replicate()
        placements[p + "gate_up.weight"] = FusedPaired(config.ffn, config.ffn)
        placements[p + "down.weight"] = Shard(1)
        for name in ("q_norm.weight", "k_norm.weight", "router.weight", "router.bias",
                     "shared_gate.weight"):
            placements[p + name] = Replicate()
        placements[p + "experts.gate_up.weight"] = experts_placement(config)
        placements[p + "experts.down.weight"] = experts_placement(config, down=True)
        placements[p + "shared.gate_up.weight"] = FusedPaired(config.shared_ffn,
                                                              config.shared_ffn)
        placements[p + "shared.down.weight"] = Shard(1)
    return LayoutTable.from_mapping(config.param_shapes(), placements)


def experts_placement(config: ModelConfig, *, down: bool = False, ep: int = 1, etp: int = 0,
                      order: str = "contiguous") -> Experts:
    """The placement of an MoE layer's ``experts.gate_up.weight`` (each expert's ``[gate |
    up]`` rows, paired as ``FusedPaired``) or, ``down``, its ``experts.down.weight`` (each
    expert's columns, as ``Shard(1)``), over ``ep`` expert-parallel and ``etp`` expert-TP
    ranks (``etp`` 0: the rest of the degree)."""
    f = config.expert_ffn
    return Experts(config.n_experts, (f,) if down else (f, f), dim=1 if down else 0, ep=ep,
                   etp=etp, order=order)

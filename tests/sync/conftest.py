"""Shared by the phase 2 tests: tiny geometries (the byte and element checks are exact, so
any size proves them; only the forward needs TOY / TOY_KV4, whose phase 1b floor is
measured) and one rank pool per test process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from weight_sync_bench.collectives.gloo.pool import shared_pool
from weight_sync_bench.conventions.maps import Piece
from weight_sync_bench.model.config import ModelConfig

# 8 query heads, n_kv KV heads; vocab 256: vLLM pads nothing (a multiple of 64), Megatron
# pads to 128 t (512 rows at t = 4), so padding boxes are in the matrix.
BASE = ModelConfig(name="tiny", vocab=256, d_model=32, n_layers=1, n_heads=8, n_kv_heads=2,
                   head_dim=8, ffn=64)


def tiny(n_kv: int = 2, **changes: object) -> ModelConfig:
    return BASE.replace(name=f"tiny_kv{n_kv}", n_kv_heads=n_kv, **changes)


# The smallest MoE the checks' tests route: 4 tokens, top-2 of 8 experts, 2 MoE layers.
MOE_FEW = ModelConfig(name="moe_few", vocab=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=4, ffn=16, n_experts=8, top_k=2, expert_ffn=8, batch=1,
                      seq_len=4)


def forced_guard(config: ModelConfig, experts: tuple[int, ...] = (0, 1)):
    """A routing guard that keeps every choice (bound infinite) and holds other choices than
    a reference's: every token of every MoE layer on ``experts``. A forward given it follows
    it, so its logits move: what shows that a guard reached a forward."""
    from weight_sync_bench.model.routing import Routing
    from weight_sync_bench.model.sharded import RoutingGuard

    n = config.batch * config.seq_len
    forced = Routing(experts=torch.tensor([list(experts)] * n),
                     scores=torch.zeros(n, config.n_experts), margin=torch.zeros(n))
    return RoutingGuard({layer: forced for layer in range(config.dense_layers,
                                                          config.n_layers)}, float("inf"))


def with_piece(layout, rank: int, name: str, idx, dim: int | None = None):
    """A copy of ``layout`` whose ``rank`` stores ``name`` as canonical indices ``idx``
    (along ``dim``, by default the declared one): a broken cover, for the validation."""
    pieces = [dict(p) for p in layout.pieces]
    old = pieces[rank][name]
    pieces[rank][name] = Piece(old.source, old.dim if dim is None else dim,
                               torch.as_tensor(idx, dtype=torch.int64))
    return replace(layout, pieces=tuple(pieces))


@pytest.fixture(scope="session")
def pool():
    """The process's shared rank pool of 4 (world sizes here stay at or below 4)."""
    return shared_pool(4)

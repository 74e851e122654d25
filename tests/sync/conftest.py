"""Shared by the phase 2 tests: tiny geometries (the byte and element checks are exact, so
any size proves them; only the forward needs TOY / TOY_KV4, whose phase 1b floor is
measured) and one rank pool per test process."""

from __future__ import annotations

import pytest

from weight_sync_bench.collectives.gloo.pool import shared_pool
from weight_sync_bench.model.config import ModelConfig

# 8 query heads, n_kv KV heads; vocab 256: vLLM pads nothing (a multiple of 64), Megatron
# pads to 128 t (512 rows at t = 4), so padding boxes are in the matrix.
BASE = ModelConfig(name="tiny", vocab=256, d_model=32, n_layers=1, n_heads=8, n_kv_heads=2,
                   head_dim=8, ffn=64)


def tiny(n_kv: int = 2, **changes: object) -> ModelConfig:
    return BASE.replace(name=f"tiny_kv{n_kv}", n_kv_heads=n_kv, **changes)


@pytest.fixture(scope="session")
def pool():
    """The process's shared rank pool of 4 (world sizes here stay at or below 4)."""
    return shared_pool(4)

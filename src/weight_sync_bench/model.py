"""The dense reference model, and the math it shares with the sharded forward.

The blocks here (norm, RoPE, attention over a given number of heads, SwiGLU) take whatever
head counts and widths they are handed, so the sharded forward calls them on its local
slice and the reference on the whole. What differs between the two is only where the
partial sums meet, which is exactly what a layout bug breaks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from collections.abc import Mapping

    from weight_sync_bench.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``(T, head_dim / 2)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (first half, second half) pairs; x is ``(B, T, H, D)``."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, D/2) each
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, D/2)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
              rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Causal GQA attention over ``[Q | K | V]`` features for the heads given.

    qkv is ``(B, T, (n_heads + 2 * n_kv_heads) * head_dim)``; returns ``(B, T, n_heads * head_dim)``.
    Query head h reads KV head ``h // (n_heads / n_kv_heads)``.
    """
    b, t, _ = qkv.shape
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.view(b, t, n_heads, head_dim), *rope)  # (B, T, H, D)
    k = apply_rope(k.view(b, t, n_kv_heads, head_dim), *rope)  # (B, T, Hkv, D)
    v = v.view(b, t, n_kv_heads, head_dim)  # (B, T, Hkv, D)
    group = n_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=2)  # (B, T, H, D)
    v = v.repeat_interleave(group, dim=2)  # (B, T, H, D)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True)  # (B, H, T, D)
    return out.transpose(1, 2).reshape(b, t, n_heads * head_dim)  # (B, T, H*D)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over ``[gate | up]`` features: ``(B, T, 2F) -> (B, T, F)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class ReferenceModel:
    """The unsharded model: ``ReferenceModel(config, full_params)(tokens) -> logits``."""

    def __init__(self, config: ModelConfig, params: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.params = params

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``(B, T)`` int64 -> logits ``(B, T, vocab)`` fp32."""
        c, p = self.config, self.params
        rope = rope_tables(tokens.shape[1], c.head_dim, c.rope_theta)
        h = F.embedding(tokens, p["tok_embeddings.weight"])  # (B, T, d)
        for i in range(c.n_layers):
            pre = f"layers.{i}."
            x = rms_norm(h, p[pre + "attn_norm.weight"], c.norm_eps)
            a = attention(x @ p[pre + "qkv.weight"].T, c.n_heads, c.n_kv_heads, c.head_dim, rope)
            h = h + a @ p[pre + "o_proj.weight"].T
            x = rms_norm(h, p[pre + "ffn_norm.weight"], c.norm_eps)
            h = h + swiglu(x @ p[pre + "gate_up.weight"].T) @ p[pre + "down.weight"].T
        return rms_norm(h, p["norm.weight"], c.norm_eps) @ p["lm_head.weight"].T  # (B, T, V)

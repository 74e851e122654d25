"""The dense reference model, and the math it shares with the sharded forward.

The blocks here (norm, RoPE, attention over a given number of heads, SwiGLU) take whatever
head counts and widths they are handed, so the sharded forward calls them on its local
slice and the reference on the whole. What differs between the two is only where the
partial sums meet, which is exactly what a layout bug breaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from weight_sync_bench.model.routing import Routing, by_expert, gate_weights, route

if TYPE_CHECKING:
    from collections.abc import Mapping

    from weight_sync_bench.model.config import ModelConfig


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


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed sequences, ``(B, 1, T, T)`` bool.

    ``segments`` ``(B, T)`` gives each position's document id; ``-1`` marks padding.
    Query q sees key k iff ``k <= q`` and both lie in the same document (not padding), so a
    padding query sees no key at all: see ``attention`` for the neutral rule applied there.
    """
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()  # (T, T)
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    real = (segments >= 0)[:, :, None]  # (B, T, 1)
    return (same & real & causal)[:, None]  # (B, 1, T, T)


def context_mask(segments: torch.Tensor | None, start: int, stop: int, seq_len: int
                 ) -> torch.Tensor:
    """The rows ``start:stop`` of the dense mask, ``(B or 1, 1, stop - start, seq_len)`` bool:
    what the queries of one context-parallel chunk may see among all ``seq_len`` keys.

    Positions are GLOBAL: query ``start + i`` sees key ``k`` iff ``k <= start + i`` (and,
    packed, both lie in the same document, not padding), exactly the dense
    ``document_mask(segments)[:, :, start:stop]`` (plain causal when ``segments`` is None).
    """
    q = torch.arange(start, stop)[:, None]  # (Tq, 1) global query positions
    causal = torch.arange(seq_len)[None, :] <= q  # (Tq, T)
    if segments is None:
        return causal[None, None]  # (1, 1, Tq, T)
    rows = segments[:, start:stop]  # (B, Tq)
    same = rows[:, :, None] == segments[:, None, :]  # (B, Tq, T)
    real = (rows >= 0)[:, :, None]  # (B, Tq, 1)
    return (same & real & causal)[:, None]  # (B, 1, Tq, T)


# Qwen3's q and k norms: one RMSNorm weight of head_dim each, applied per head, and its eps.
QKNorms = tuple[torch.Tensor, torch.Tensor, float]


def split_heads(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                rope: tuple[torch.Tensor, torch.Tensor], norms: QKNorms | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[Q | K | V]`` features ``(B, T, (H + 2 Hkv) D)`` -> q ``(B, T, H, D)``, k and v
    ``(B, T, Hkv, D)``, q and k rotated by ``rope`` (the tables of these T positions); with
    ``norms`` each q and k head RMS-normed first (Qwen3: ``q_norm`` / ``k_norm`` before RoPE,
    transformers' ``Qwen3Attention.forward``)."""
    b, t, _ = qkv.shape
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q, k = q.view(b, t, n_heads, head_dim), k.view(b, t, n_kv_heads, head_dim)
    if norms is not None:
        q_norm, k_norm, eps = norms
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q = apply_rope(q, *rope)  # (B, T, H, D)
    k = apply_rope(k, *rope)  # (B, T, Hkv, D)
    v = v.view(b, t, n_kv_heads, head_dim)  # (B, T, Hkv, D)
    return q, k, v


def attention(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
              rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None = None,
              norms: QKNorms | None = None) -> torch.Tensor:
    """Causal GQA attention over ``[Q | K | V]`` features for the heads given.

    qkv is ``(B, T, (n_heads + 2 * n_kv_heads) * head_dim)``; returns ``(B, T, n_heads * head_dim)``.
    Query head h reads KV head ``h // (n_heads / n_kv_heads)``. Without ``mask`` attention is
    plainly causal. With a ``(B, 1, T, T)`` bool mask (``document_mask``), a query row that
    sees no key at all follows an explicit neutral rule instead of a 0/0 softmax: its output
    is exactly zero, so it contributes nothing forward and receives no gradient.
    """
    return attend(*split_heads(qkv, n_heads, n_kv_heads, head_dim, rope, norms), mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           *, q_offset: int = 0) -> torch.Tensor:
    """Attention of q ``(B, Tq, H, D)`` over k, v ``(B, Tk, Hkv, D)``: ``(B, Tq, H * D)``.

    ``mask`` None is plain causal (Tq == Tk). A bool mask ``(B, 1, Tq, Tk)`` says what each
    query sees; a row that sees nothing follows the neutral rule (output exactly zero, no
    gradient): it attends to its own position ``q_offset + i`` only to keep the softmax
    defined, then is zeroed. Query ``i`` sits at key position ``q_offset + i``.
    """
    b, tq, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # (B, Tk, H, D)
    v = v.repeat_interleave(group, dim=2)  # (B, Tk, H, D)
    if mask is None:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)  # (B, H, T, D)
    else:
        sees_any = mask.any(dim=-1, keepdim=True)  # (B, 1, Tq, 1)
        # A row with no visible key attends to itself (a defined softmax), then is zeroed.
        eye = (torch.arange(k.shape[1])[None, :]
               == torch.arange(q_offset, q_offset + tq)[:, None])  # (Tq, Tk)
        safe = mask | (~sees_any & eye)  # (B, 1, Tq, Tk)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=safe)  # (B, H, Tq, D)
        out = out.masked_fill(~sees_any, 0.0)
    return out.transpose(1, 2).reshape(b, tq, n_heads * head_dim)  # (B, Tq, H*D)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over ``[gate | up]`` features: ``(B, T, 2F) -> (B, T, F)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_hidden(x: torch.Tensor, gate_up: torch.Tensor,
                  routed: list[tuple[torch.Tensor, torch.Tensor]], experts: list[int]
                  ) -> list[torch.Tensor | None]:
    """The first half of the experts' FFN, the step that reads ``experts.gate_up``: for each
    expert ``experts[j]`` (a global id) its SwiGLU features over the tokens routed to it
    (``routed[expert]``: tokens, weights) from the j-th ``[gate | up]`` block of ``gate_up``
    rows, ``(n_e, F_local)`` (None where no token chose it). Blocks may be any width: a
    sharded rank holds its chunk of each expert's intermediate. Once computed, the weight
    need not be held until ``down`` arrives (a streamed check holds one at a time)."""
    if not experts:
        return []
    rows = gate_up.shape[0] // len(experts)
    return [swiglu(x[routed[e][0]] @ gate_up[j * rows:(j + 1) * rows].T)
            if routed[e][0].numel() else None for j, e in enumerate(experts)]


def expert_output(hidden: list[torch.Tensor | None], down: torch.Tensor,
                  routed: list[tuple[torch.Tensor, torch.Tensor]], experts: list[int],
                  out: torch.Tensor) -> torch.Tensor:
    """The second half, the step that reads ``experts.down``: add each expert's output into
    ``out`` ``(N, d)``, its ``hidden`` features through the j-th block of ``down`` columns,
    times each token's weight (transformers' ``Qwen3MoeSparseMoeBlock``: the expert's output
    times ``routing_weights``, ``index_add_`` into the output; partial sums on a rank that
    holds a chunk of each expert's intermediate)."""
    if not experts:
        return out
    cols = down.shape[1] // len(experts)
    for j, e in enumerate(experts):
        h = hidden[j]
        if h is None:
            continue
        tokens, weights = routed[e]
        out.index_add_(0, tokens, (h @ down[:, j * cols:(j + 1) * cols].T) * weights[:, None])
    return out


class ReferenceModel:
    """The unsharded model: ``ReferenceModel(config, full_params)(tokens) -> logits``.

    After each call ``embedding_output`` holds the embedding lookup ``(B, T, d)``, the point
    input gradients are compared at (``retain_grad`` it before backward).
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.params = params
        self.embedding_output: torch.Tensor | None = None
        self.routings: dict[int, Routing] = {}  # per MoE layer, set by each forward

    def __call__(self, tokens: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """tokens ``(B, T)`` int64 -> logits ``(B, T, vocab)`` fp32. ``segments`` ``(B, T)``
        packs documents (see ``document_mask``); None is plain causal attention."""
        state = self.begin(tokens, segments)
        for i in range(self.config.n_layers):
            self.block(state, i)
        return self.end(state)

    # The forward as steps, each reading only its own parameters from ``self.params``
    # (``begin``: the embedding; ``step(state, name)``: one parameter after it, in the order
    # ``param_shapes`` draws them; ``finish``: the logits), so a streamed check can hand it one
    # stage's, or one parameter's, tensors at a time. ``block`` and ``end`` are those steps.

    def begin(self, tokens: torch.Tensor, segments: torch.Tensor | None = None
              ) -> ReferenceState:
        c = self.config
        rope = rope_tables(tokens.shape[1], c.head_dim, c.rope_theta)
        mask = document_mask(segments) if segments is not None else None
        h = F.embedding(tokens, self.params["tok_embeddings.weight"])  # (B, T, d)
        self.embedding_output = h
        return ReferenceState(h, rope, mask)

    def block(self, state: ReferenceState, i: int) -> None:
        for suffix in self.config.suffixes_of(i):
            self.step(state, f"layers.{i}.{suffix}")

    def end(self, state: ReferenceState) -> torch.Tensor:
        for name in self.config.head_params:
            self.step(state, name)
        return self.finish(state)

    def step(self, state: ReferenceState, name: str) -> None:
        """The forward's step that reads parameter ``name`` (any but the embedding): the
        layer's ops between it and the next parameter, the residual added where a sublayer's
        last parameter (its weight, or its bias) has been read."""
        c, p = self.config, self.params
        pre, what = step_of(name)
        match what:
            case "attn_norm.weight" | "ffn_norm.weight":
                state.x = rms_norm(state.h, p[name], c.norm_eps)
            case "qkv.weight":
                state.y, state.x = state.x @ p[name].T, None  # [Q | K | V] features
            case "qkv.bias":
                state.y = state.y + p[name]
            case "q_norm.weight" | "k_norm.weight":
                state.norms.append(p[name])
            case "o_proj.weight":
                a = attention(state.y, c.n_heads, c.n_kv_heads, c.head_dim, state.rope,
                              state.mask, qk_norms(state, c.norm_eps))
                state.y = a @ p[name].T
                if not c.has_o_bias:
                    state.h = state.h + state.y
            case "gate_up.weight":
                state.y, state.x = swiglu(state.x @ p[name].T), None
            case "down.weight":
                state.y = state.y @ p[name].T
                if not c.has_down_bias:
                    state.h = state.h + state.y
            case "o_proj.bias" | "down.bias":
                state.h = state.h + (state.y + p[name])
            case "router.weight":
                state.logits = state.x.flatten(0, 1) @ p[name].T  # (N, E)
                if not c.router_bias:
                    self._route(state, int(pre.split(".")[1]), None)
            case "router.bias":
                self._route(state, int(pre.split(".")[1]), p[name])
            case "experts.gate_up.weight":
                state.hidden = expert_hidden(state.x.flatten(0, 1), p[name], state.routed,
                                             list(range(c.n_experts)))
            case "experts.down.weight":
                x = state.x.flatten(0, 1)  # (N, d)
                y = expert_output(state.hidden, p[name], state.routed, list(range(c.n_experts)),
                                  torch.zeros_like(x))
                state.y, state.hidden = y.view_as(state.x), []
                if not c.shared_ffn:
                    state.h, state.x = state.h + state.y, None
            case "shared.gate_up.weight":
                state.shared = swiglu(state.x @ p[name].T)
            case "shared.down.weight":
                state.shared = state.shared @ p[name].T
                if not c.shared_gate:
                    state.h, state.x = state.h + (state.y + state.shared), None
            case "shared_gate.weight":
                state.shared = torch.sigmoid(state.x @ p[name].T) * state.shared
                state.h, state.x = state.h + (state.y + state.shared), None
            case "norm.weight":
                state.x = rms_norm(state.h, p[name], c.norm_eps)
                if c.tie_embeddings:
                    state.y = state.x @ p["tok_embeddings.weight"].T  # (B, T, Vp)
            case "lm_head.weight":
                state.y, state.x = state.x @ p[name].T, None  # (B, T, Vp)
            case _:
                raise KeyError(f"{c.name}: no forward step reads {name!r}")

    def _route(self, state: ReferenceState, layer: int, bias: torch.Tensor | None) -> None:
        """Layer ``layer``'s routing from the router logits (and selection bias)."""
        routing = route(state.logits, self.config, bias)
        self.routings[layer] = routing
        state.routed = by_expert(routing.experts,
                                 gate_weights(state.logits, routing.experts, self.config),
                                 self.config.n_experts)
        state.logits = None

    def finish(self, state: ReferenceState) -> torch.Tensor:
        """The logits ``(B, T, vocab)`` once the head's step has run."""
        c, logits = self.config, state.y
        assert logits is not None, "finish: the head's step has not run"
        return logits[..., :c.vocab] if c.padded_vocab != c.vocab else logits  # (B, T, V)


@dataclass
class ReferenceState:
    """The reference forward between steps: the residual stream ``(B, T, d)``, the RoPE
    tables and the mask; ``x`` the normed input a projection reads next, ``y`` the last
    step's output (a projection's features, a sublayer's output before its bias and the
    residual, the logits)."""

    h: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    # Qwen3's q and k norm weights of the layer being read (reset at its attention)
    norms: list[torch.Tensor] = field(default_factory=list)
    # an MoE layer between its steps: router logits, each expert's tokens and weights, the
    # experts' SwiGLU features until their down columns arrive, the shared expert's output
    logits: torch.Tensor | None = None
    routed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    hidden: list[torch.Tensor | None] = field(default_factory=list)
    shared: torch.Tensor | None = None


class _HoldsNorms(Protocol):
    norms: list[torch.Tensor]


def qk_norms(state: _HoldsNorms, eps: float) -> QKNorms | None:
    """The layer's q and k norms as ``split_heads`` takes them (None without), consumed: a
    state's ``norms`` collects them at their steps and its attention step takes them."""
    if not state.norms:
        return None
    q_norm, k_norm = state.norms
    state.norms = []
    return q_norm, k_norm, eps


def step_of(name: str) -> tuple[str, str]:
    """A parameter name as the forward's steps read it: ``(layer prefix, what)``, e.g.
    ``("layers.3.", "qkv.weight")``; ``("", name)`` outside the layers."""
    if name.startswith("layers."):
        i, what = name[len("layers."):].split(".", 1)
        return f"layers.{i}.", what
    return "", name


def add_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias

"""The tensor-parallel forward, written once over a small collective protocol.

Activations are ``list[Tensor]`` indexed by local rank: ``InProcessCollective`` holds every
rank of the group in one process (lists of length t), a process-group collective holds one
rank (lists of length 1). ``ShardedModel.forward`` never asks which it has.

Megatron-style layout: column-parallel qkv and gate_up (each rank computes its own heads
and neurons), row-parallel o_proj and down (partial sums, all-reduced), vocab-parallel
embedding (masked lookup, all-reduced) and lm_head (local vocab slice, all-gathered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from weight_sync_bench.model import (add_bias, attention, document_mask, rms_norm, rope_tables,
                                     swiglu)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from weight_sync_bench.config import ModelConfig

Tensors = list[torch.Tensor]


@runtime_checkable
class Collective(Protocol):
    """What the sharded forward needs from a process group.

    ``ranks`` are the group ranks whose activations this object holds, in list order.
    ``tag`` names the parameter or layer a collective serves, for breadcrumbs and reports.
    Both operations are differentiable in the autograd sense where the implementation
    allows it: the in-process one is, being plain tensor arithmetic.
    """

    @property
    def degree(self) -> int: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        """Sum over the group; every rank gets the sum."""
        ...

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        """Concatenate along ``dim`` in rank order; every rank gets the result."""
        ...


class InProcessCollective:
    """Every rank of a degree-t group in this process: reduce by sum, gather by cat.

    Sums in rank order. Each rank's output is the same tensor object, so autograd sends
    the sum of every rank's gradient back to each input: all-reduce's own backward.
    """

    def __init__(self, degree: int) -> None:
        if degree < 1:
            raise ValueError(f"InProcessCollective needs degree >= 1, got {degree}")
        self._degree = degree
        self.calls: list[tuple[str, str]] = []  # (op, tag), in order: what the forward asked for

    @property
    def degree(self) -> int:
        return self._degree

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self._degree))

    def _check(self, xs: Tensors, op: str, tag: str) -> None:
        if len(xs) != self._degree:
            raise ValueError(f"{op} {tag}: got {len(xs)} tensors for {self._degree} ranks")
        shapes = {tuple(x.shape) for x in xs}
        if op == "all_reduce" and len(shapes) > 1:
            raise ValueError(f"{op} {tag}: ranks disagree on shape: "
                             + ", ".join(f"rank {r} {list(x.shape)}" for r, x in enumerate(xs)))
        self.calls.append((op, tag))

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        self._check(xs, "all_reduce", tag)
        total = xs[0]
        for x in xs[1:]:
            total = total + x
        return [total] * self._degree

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        self._check(xs, "all_gather", tag)
        out = torch.cat(xs, dim=dim) if self._degree > 1 else xs[0]
        return [out] * self._degree


class ShardedModel:
    """The model over rank-local shards: ``ShardedModel(config, shards, collective)(tokens)``.

    ``shards[i]`` holds the parameters of group rank ``collective.ranks[i]`` under the
    declared layout (``layout_for(config)``); returns one full-vocab logits tensor per local
    rank. Local head counts and widths come from the config and the degree; the bytes come
    from the shards, so a wrong shard computes wrong numbers rather than failing on shape.
    """

    def __init__(self, config: ModelConfig, shards: Sequence[Mapping[str, torch.Tensor]],
                 collective: Collective) -> None:
        if len(shards) != len(collective.ranks):
            raise ValueError(f"ShardedModel: {len(shards)} shard dicts for local ranks "
                             f"{list(collective.ranks)}")
        self.config = config
        self.shards = list(shards)
        self.collective = collective
        self.embedding_output: Tensors | None = None  # per local rank, set by each forward

    def __call__(self, tokens: torch.Tensor, segments: torch.Tensor | None = None, *,
                 gather_logits: bool = True) -> Tensors:
        return self.forward(tokens, segments, gather_logits=gather_logits)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor | None = None, *,
                gather_logits: bool = True) -> Tensors:
        """tokens ``(B, T)`` -> per local rank, logits ``(B, T, vocab)``.

        ``segments`` packs documents as in ``ReferenceModel``. With ``gather_logits=False``
        each rank keeps its own vocab slice ``(B, T, padded_vocab / t)``, padding columns
        included, for a vocab-parallel loss (``weight_sync_bench.loss``).
        """
        c, coll, shards = self.config, self.collective, self.shards
        t = coll.degree
        heads, kv_heads = c.n_heads // t, c.n_kv_heads // t
        rope = rope_tables(tokens.shape[1], c.head_dim, c.rope_theta)
        mask = document_mask(segments) if segments is not None else None

        h = coll.all_reduce([_vocab_parallel_embed(tokens, p["tok_embeddings.weight"], r)
                             for p, r in zip(shards, coll.ranks)], tag="tok_embeddings.weight")
        self.embedding_output = h
        for i in range(c.n_layers):
            pre = f"layers.{i}."
            partial = []
            for hr, p in zip(h, shards):
                x = rms_norm(hr, p[pre + "attn_norm.weight"], c.norm_eps)
                qkv = x @ p[pre + "qkv.weight"].T
                if c.bias:
                    qkv = qkv + p[pre + "qkv.bias"]
                a = attention(qkv, heads, kv_heads, c.head_dim, rope, mask)
                partial.append(a @ p[pre + "o_proj.weight"].T)  # (B, T, d), a partial sum
            h = [hr + o for hr, o in zip(h, self.reduce_row_parallel(partial, pre + "o_proj"))]
            partial = []
            for hr, p in zip(h, shards):
                x = rms_norm(hr, p[pre + "ffn_norm.weight"], c.norm_eps)
                partial.append(swiglu(x @ p[pre + "gate_up.weight"].T) @ p[pre + "down.weight"].T)
            h = [hr + o for hr, o in zip(h, self.reduce_row_parallel(partial, pre + "down"))]
        local_logits = [rms_norm(hr, p["norm.weight"], c.norm_eps) @ p[c.head_name].T
                        for hr, p in zip(h, shards)]  # (B, T, Vp/t)
        if not gather_logits:
            return local_logits
        logits = coll.all_gather(local_logits, dim=-1, tag=c.head_name)  # (B, T, Vp)
        return [x[..., :c.vocab] for x in logits] if c.padded_vocab != c.vocab else logits

    def reduce_row_parallel(self, partial: Tensors, layer: str) -> Tensors:
        """Sum a row-parallel layer's partial outputs over the group, then add its bias
        (``layer + ".bias"``, replicated) once: after the sum, never once per rank."""
        reduced = self.collective.all_reduce(partial, tag=layer + ".weight")
        return [add_bias(o, p.get(layer + ".bias")) for o, p in zip(reduced, self.shards)]


def _vocab_parallel_embed(tokens: torch.Tensor, table: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows of this rank's vocab slice; zeros for tokens another rank owns. ``(B, T, d)``."""
    rows = table.shape[0]
    local = tokens - rank * rows
    owned = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, rows - 1), table)  # (B, T, d)
    return out.masked_fill(~owned.unsqueeze(-1), 0.0)

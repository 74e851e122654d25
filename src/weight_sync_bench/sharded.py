"""The tensor-, sequence- and context-parallel forward, written once over a small protocol.

Activations are ``list[Tensor]`` indexed by local rank: ``InProcessCollective`` holds every
rank of the group in one process (lists of length t), a process-group collective holds one
rank (lists of length 1). ``ShardedModel.forward`` never asks which it has.

Megatron-style layout: column-parallel qkv and gate_up (each rank computes its own heads
and neurons), row-parallel o_proj and down (partial sums, all-reduced), vocab-parallel
embedding (masked lookup, all-reduced) and lm_head (local vocab slice, all-gathered).

Sequence parallelism (``sequence_parallel=True``, Megatron-SP): outside the TP regions the
residual stream is sharded along the sequence over the TP group, ``(B, T / t, d)`` on TP
rank r holding positions ``[r T/t, (r+1) T/t)``. RMSNorm runs on those sequence-local
shards; each column-parallel region (qkv, gate_up, lm_head) is entered through an
all-gather along the sequence, each row-parallel one (o_proj, down) and the embedding are
left through a reduce-scatter along the sequence instead of an all-reduce. Backward, each
is the other's adjoint. A replicated norm weight on TP rank r then sees only rank r's
positions: its gradient is a partial sum over the sequence shards, reduced once over the
TP group (``training.reduce_replicated``), as the replicated weights already are.

Context parallelism (``context=`` a second collective, the CP group of degree c): the
sequence is split into c contiguous chunks, CP rank j holding positions
``[j T/c, (j+1) T/c)`` everywhere (and SP shards that chunk further over TP). RoPE and the
causal and document masks use GLOBAL positions (``model.context_mask``); each layer
all-gathers the rotated K and V over the CP group, so every query sees exactly the keys
the dense mask permits, remote ones included. The all-masked rows of packed padding keep
``model.attend``'s neutral rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from weight_sync_bench.errors import UnevenSequence
from weight_sync_bench.model import (
    add_bias,
    attend,
    attention,
    context_mask,
    document_mask,
    rms_norm,
    rope_tables,
    split_heads,
    swiglu,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from weight_sync_bench.config import ModelConfig

Tensors = list[torch.Tensor]


@runtime_checkable
class Collective(Protocol):
    """What the sharded forward needs from a process group.

    ``ranks`` are the group ranks whose activations this object holds, in list order.
    ``tag`` names the parameter or layer a collective serves, for breadcrumbs and reports.
    Every operation is differentiable in the autograd sense, its backward the forward's
    adjoint (all-reduce: all-reduce; all-gather: reduce-scatter; reduce-scatter:
    all-gather): the in-process one is, being plain tensor arithmetic.
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

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        """Sum over the group, then rank r keeps chunk r of the sum along ``dim`` (follows
        ``torch.chunk(degree, dim)``; ``dim`` must divide evenly)."""
        ...


class InProcessCollective:
    """Every rank of a degree-t group in this process: reduce by sum, gather by cat.

    Sums in rank order. Each rank's all-reduce output is the same tensor object, so autograd
    sends the sum of every rank's gradient back to each input: all-reduce's own backward.
    ``calls`` records what the forward asked for; ``backward_calls`` the adjoint collective
    each one's backward amounts to (recorded by an autograd hook when its gradient arrives,
    as a process-group implementation would run it): the counts a test asserts.
    """

    def __init__(self, degree: int) -> None:
        if degree < 1:
            raise ValueError(f"InProcessCollective needs degree >= 1, got {degree}")
        self._degree = degree
        self.calls: list[tuple[str, str]] = []  # (op, tag), in order: what the forward asked for
        self.backward_calls: list[tuple[str, str]] = []  # (adjoint op, tag), in backward order

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
        if op in ("all_reduce", "reduce_scatter") and len(shapes) > 1:
            raise ValueError(f"{op} {tag}: ranks disagree on shape: "
                             + ", ".join(f"rank {r} {list(x.shape)}" for r, x in enumerate(xs)))
        self.calls.append((op, tag))

    def _on_backward(self, x: torch.Tensor, adjoint: str, tag: str) -> None:
        if x.requires_grad:
            x.register_hook(lambda grad: self.backward_calls.append((adjoint, tag)))

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        self._check(xs, "all_reduce", tag)
        total = _sum_in_rank_order(xs)
        self._on_backward(total, "all_reduce", tag)
        return [total] * self._degree

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        self._check(xs, "all_gather", tag)
        out = torch.cat(xs, dim=dim) if self._degree > 1 else xs[0]
        self._on_backward(out, "reduce_scatter", tag)
        return [out] * self._degree

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        """The sum, chunked: rank r's output is a view of chunk r, so its gradient lands in
        that chunk of the sum's gradient and flows to every input (all-gather's backward)."""
        self._check(xs, "reduce_scatter", tag)
        if xs[0].shape[dim] % self._degree:
            raise ValueError(f"reduce_scatter {tag}: dim {dim} of size {xs[0].shape[dim]} does "
                             f"not split evenly over degree {self._degree}")
        total = _sum_in_rank_order(xs)
        self._on_backward(total, "all_gather", tag)
        return list(total.chunk(self._degree, dim=dim))


def _sum_in_rank_order(xs: Tensors) -> torch.Tensor:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


class InProcessGroups:
    """Several same-sized groups of one mesh axis side by side over one flat list of ranks.

    ``groups[g]`` lists the flat list positions of group g's ranks, in group-rank order;
    every position lies in exactly one group. ``ranks[i]`` is position i's rank within its
    group, so the forward reads each activation's group rank as it does for one group. Each
    collective runs group by group (one ``InProcessCollective`` per group), and ``calls``
    records it once per group with the positions it spans: (op, tag, span).
    """

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        self.groups = tuple(tuple(g) for g in groups)
        sizes = {len(g) for g in self.groups}
        flat = sorted(i for g in self.groups for i in g)
        if len(sizes) != 1 or flat != list(range(len(flat))):
            raise ValueError(f"InProcessGroups: groups {self.groups} must be same-sized and "
                             "cover positions 0..n-1 once each")
        self._degree = sizes.pop()
        self._members = [InProcessCollective(self._degree) for _ in self.groups]
        rank_of = dict(pair for g in self.groups for pair in zip(g, range(len(g))))
        self._ranks = tuple(rank_of[i] for i in range(len(flat)))
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []

    @property
    def degree(self) -> int:
        return self._degree

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def backward_calls(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(op, tag, g) for g, m in zip(self.groups, self._members)
                for op, tag in m.backward_calls]

    def _each(self, xs: Tensors, op: str, tag: str, run: Callable[[InProcessCollective, Tensors],
                                                                  Tensors]) -> Tensors:
        if len(xs) != len(self._ranks):
            raise ValueError(f"{op} {tag}: got {len(xs)} tensors for {len(self._ranks)} "
                             "positions")
        out: list[torch.Tensor | None] = [None] * len(xs)
        for group, member in zip(self.groups, self._members):
            self.calls.append((op, tag, group))
            for i, y in zip(group, run(member, [xs[i] for i in group])):
                out[i] = y
        return out  # type: ignore[return-value]

    def all_reduce(self, xs: Tensors, *, tag: str) -> Tensors:
        return self._each(xs, "all_reduce", tag, lambda m, ys: m.all_reduce(ys, tag=tag))

    def all_gather(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        return self._each(xs, "all_gather", tag, lambda m, ys: m.all_gather(ys, dim, tag=tag))

    def reduce_scatter(self, xs: Tensors, dim: int, *, tag: str) -> Tensors:
        return self._each(xs, "reduce_scatter", tag,
                          lambda m, ys: m.reduce_scatter(ys, dim, tag=tag))


class ShardedModel:
    """The model over rank-local shards: ``ShardedModel(config, shards, collective)(tokens)``.

    ``shards[i]`` holds the parameters of TP rank ``collective.ranks[i]`` under the declared
    layout (``layout_for(config)``); returns one logits tensor per local rank. Local head
    counts and widths come from the config and the degree; the bytes come from the shards,
    so a wrong shard computes wrong numbers rather than failing on shape.

    ``sequence_parallel`` shards the residual stream along the sequence over the TP group;
    ``context`` is the CP group (``context.ranks[i]``: local activation i's CP rank), or
    None for no context parallelism. See the module docstring for both layouts.
    """

    def __init__(self, config: ModelConfig, shards: Sequence[Mapping[str, torch.Tensor]],
                 collective: Collective, *, sequence_parallel: bool = False,
                 context: Collective | None = None) -> None:
        if len(shards) != len(collective.ranks):
            raise ValueError(f"ShardedModel: {len(shards)} shard dicts for local ranks "
                             f"{list(collective.ranks)}")
        if context is not None and len(context.ranks) != len(collective.ranks):
            raise ValueError(f"ShardedModel: CP ranks {list(context.ranks)} do not pair with "
                             f"TP ranks {list(collective.ranks)}")
        self.config = config
        self.shards = list(shards)
        self.collective = collective
        self.sequence_parallel = sequence_parallel
        self.context = context
        self.embedding_output: Tensors | None = None  # per local rank, set by each forward
        # per local rank: the global positions [start, stop) its embedding output holds
        self.embedding_positions: list[tuple[int, int]] | None = None

    def __call__(self, tokens: torch.Tensor, segments: torch.Tensor | None = None, *,
                 gather_logits: bool = True) -> Tensors:
        return self.forward(tokens, segments, gather_logits=gather_logits)

    def chunks(self, seq_len: int) -> list[tuple[int, int]]:
        """Per local rank, the global positions ``[start, stop)`` of its context chunk (the
        whole sequence without CP). UnevenSequence where the split would be uneven."""
        cp = self.context.degree if self.context else 1
        check_sequence_split(self.config.name, seq_len, cp, self.collective.degree,
                             self.sequence_parallel)
        width = seq_len // cp
        if self.context is None:
            return [(0, seq_len)] * len(self.collective.ranks)
        return [(j * width, (j + 1) * width) for j in self.context.ranks]

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor | None = None, *,
                gather_logits: bool = True) -> Tensors:
        """tokens ``(B, T)`` (the whole sequence) -> per local rank, logits
        ``(B, Tc, vocab)`` of its context chunk (``Tc = T`` without CP).

        ``segments`` packs documents as in ``ReferenceModel``. With ``gather_logits=False``
        each rank keeps its own vocab slice ``(B, Tc, padded_vocab / t)``, padding columns
        included, for a vocab-parallel loss (``weight_sync_bench.loss``).
        """
        c, coll, shards = self.config, self.collective, self.shards
        t = coll.degree
        heads, kv_heads = c.n_heads // t, c.n_kv_heads // t
        seq_len = tokens.shape[1]
        chunks = self.chunks(seq_len)
        rope = rope_tables(seq_len, c.head_dim, c.rope_theta)
        if self.context is None:
            ropes = [rope] * len(chunks)
            mask = document_mask(segments) if segments is not None else None
            masks = [mask] * len(chunks)
        else:  # global positions: the chunk's rows of the tables and of the dense mask
            ropes = [(rope[0][a:b], rope[1][a:b]) for a, b in chunks]
            masks = [self.chunk_mask(segments, a, b, seq_len) for a, b in chunks]

        h = self.leave_region([_vocab_parallel_embed(tokens[:, a:b], p["tok_embeddings.weight"], r)
                               for p, r, (a, b) in zip(shards, coll.ranks, chunks)],
                              "tok_embeddings.weight")  # (B, Tc, d), or (B, Tc / t, d) with SP
        self.embedding_output = h
        self.embedding_positions = self.residual_positions(chunks)
        for i in range(c.n_layers):
            pre = f"layers.{i}."
            x = self.enter_region([rms_norm(hr, p[pre + "attn_norm.weight"], c.norm_eps)
                                   for hr, p in zip(h, shards)], pre + "qkv.weight")  # (B, Tc, d)
            qkv = [xr @ p[pre + "qkv.weight"].T for xr, p in zip(x, shards)]
            if c.bias:
                qkv = [q + p[pre + "qkv.bias"] for q, p in zip(qkv, shards)]
            a = self.attend(qkv, heads, kv_heads, ropes, masks, chunks, pre + "attention")
            partial = [ar @ p[pre + "o_proj.weight"].T for ar, p in zip(a, shards)]  # partial sums
            h = [hr + o for hr, o in zip(h, self.reduce_row_parallel(partial, pre + "o_proj"))]
            x = self.enter_region([rms_norm(hr, p[pre + "ffn_norm.weight"], c.norm_eps)
                                   for hr, p in zip(h, shards)], pre + "gate_up.weight")
            partial = [swiglu(xr @ p[pre + "gate_up.weight"].T) @ p[pre + "down.weight"].T
                       for xr, p in zip(x, shards)]
            h = [hr + o for hr, o in zip(h, self.reduce_row_parallel(partial, pre + "down"))]
        x = self.enter_region([rms_norm(hr, p["norm.weight"], c.norm_eps)
                               for hr, p in zip(h, shards)], c.head_name)
        local_logits = [xr @ p[c.head_name].T for xr, p in zip(x, shards)]  # (B, Tc, Vp/t)
        if not gather_logits:
            return local_logits
        logits = coll.all_gather(local_logits, dim=-1, tag=c.head_name)  # (B, Tc, Vp)
        return [x[..., :c.vocab] for x in logits] if c.padded_vocab != c.vocab else logits

    def residual_positions(self, chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Per local rank, the global positions its residual stream holds: its chunk, or
        with SP the TP rank's slice of it."""
        if not self.sequence_parallel:
            return chunks
        t = self.collective.degree
        out = []
        for (a, b), r in zip(chunks, self.collective.ranks):
            w = (b - a) // t
            out.append((a + r * w, a + (r + 1) * w))
        return out

    def enter_region(self, xs: Tensors, tag: str) -> Tensors:
        """Into a column-parallel region: with SP, all-gather the sequence shards
        (``(B, Tc / t, d) -> (B, Tc, d)``); without, every rank already holds it all."""
        if not self.sequence_parallel:
            return xs
        return self.collective.all_gather(xs, dim=1, tag=tag)

    def leave_region(self, partial: Tensors, tag: str) -> Tensors:
        """Out of a row-parallel region (or the vocab-parallel embedding): partial sums
        summed over the group, all-reduced, or with SP reduce-scattered along the sequence."""
        if not self.sequence_parallel:
            return self.collective.all_reduce(partial, tag=tag)
        return self.collective.reduce_scatter(partial, dim=1, tag=tag)

    def reduce_row_parallel(self, partial: Tensors, layer: str) -> Tensors:
        """Sum a row-parallel layer's partial outputs over the group, then add its bias
        (``layer + ".bias"``, replicated) once: after the sum, never once per rank."""
        reduced = self.leave_region(partial, layer + ".weight")
        return [add_bias(o, p.get(layer + ".bias")) for o, p in zip(reduced, self.shards)]

    @staticmethod
    def chunk_mask(segments: torch.Tensor | None, start: int, stop: int, seq_len: int
                   ) -> torch.Tensor:
        """What the queries at global positions ``[start, stop)`` may see of all keys."""
        return context_mask(segments, start, stop, seq_len)

    def gather_context(self, kv: Tensors, tag: str) -> Tensors:
        """Every CP rank's rotated K and V, in global order: ``(B, Tc, ...) -> (B, T, ...)``."""
        assert self.context is not None
        return self.context.all_gather(kv, dim=1, tag=tag)

    def attend(self, qkv: Tensors, heads: int, kv_heads: int,
               ropes: list[tuple[torch.Tensor, torch.Tensor]], masks: list[torch.Tensor | None],
               chunks: list[tuple[int, int]], tag: str) -> Tensors:
        """Each rank's attention output ``(B, Tc, heads * D)``. With CP the local K and V
        (rotated at their global positions) are gathered over the CP group first."""
        hd = self.config.head_dim
        if self.context is None:
            return [attention(x, heads, kv_heads, hd, rope, mask)
                    for x, rope, mask in zip(qkv, ropes, masks)]
        split = [split_heads(x, heads, kv_heads, hd, rope) for x, rope in zip(qkv, ropes)]
        kv = self.gather_context([torch.cat([k, v], dim=-1) for _, k, v in split],
                                 tag)  # (B, T, Hkv, 2D) each
        return [attend(q, *kvr.chunk(2, dim=-1), mask, q_offset=a)
                for (q, _, _), kvr, mask, (a, _) in zip(split, kv, masks, chunks)]


def check_sequence_split(name: str, seq_len: int, cp: int, t: int, sequence_parallel: bool
                         ) -> None:
    """UnevenSequence unless the sequence splits evenly: into ``cp`` context chunks, and
    each chunk into ``t`` sequence shards under SP. Uneven splits are rejected, not padded."""
    if seq_len % cp:
        raise UnevenSequence(f"{name}: context parallelism needs seq_len % cp == 0 "
                             f"(seq_len={seq_len}, cp={cp})")
    if sequence_parallel and (seq_len // cp) % t:
        raise UnevenSequence(f"{name}: sequence parallelism needs (seq_len / cp) % t == 0 "
                             f"(seq_len={seq_len}, cp={cp}, t={t})")


def _vocab_parallel_embed(tokens: torch.Tensor, table: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows of this rank's vocab slice; zeros for tokens another rank owns. ``(B, T, d)``."""
    rows = table.shape[0]
    local = tokens - rank * rows
    owned = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, rows - 1), table)  # (B, T, d)
    return out.masked_fill(~owned.unsqueeze(-1), 0.0)

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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from weight_sync_bench.collectives.protocol import Collective, Tensors
from weight_sync_bench.errors import UnevenSequence, UnsupportedLayout
from weight_sync_bench.layout.placements import Experts, Placement, Shard, local_kv_heads
from weight_sync_bench.model.reference import (
    add_bias,
    attend,
    attention,
    context_mask,
    document_mask,
    expert_hidden,
    expert_output,
    qk_norms,
    rms_norm,
    rope_tables,
    split_heads,
    step_of,
    swiglu,
)
from weight_sync_bench.model.routing import Routing, by_expert, gate_weights, route

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from weight_sync_bench.model.config import ModelConfig


# The embedding's placement when none is given: vocab-parallel, as ``layout_for`` declares it.
EMBEDDING: Placement = Shard(0)


@dataclass(frozen=True)
class RoutingGuard:
    """The reference's routing where it must be kept. ``routings``: the reference's own, per
    MoE layer (``ReferenceModel.routings``, read when a layer routes, so a streamed check's
    reference may step just ahead of the sharded one); ``bound``: the largest change of a
    selection score a correct sharded forward may make (the routing threshold). A token whose
    reference choice is within the bound of flipping (``Routing.margin <= bound``) takes the
    reference's choice; a sharded rank routes every other token itself."""

    routings: Mapping[int, Routing]
    bound: float

    def near(self, layer: int) -> torch.Tensor:
        """``(N,)`` bool: the tokens near-tied in the reference at ``layer``."""
        return self.routings[layer].margin <= self.bound

    def near_ties(self) -> tuple[int, int]:
        """``(near-tied, all)`` (layer, token) choices of the reference's routings."""
        return (sum(int(self.near(i).sum()) for i in self.routings),
                sum(r.margin.numel() for r in self.routings.values()))

    def choice(self, layer: int, own: torch.Tensor, tokens: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The experts a rank computes: its own choice, the reference's where near-tied;
        ``tokens``: which of the reference's (flat ``B * T``) tokens ``own`` holds, in order
        (a context-parallel chunk's), all of them when None."""
        near, experts = self.near(layer), self.routings[layer].experts
        if tokens is not None:
            near, experts = near[tokens], experts[tokens]
        return torch.where(near[:, None], experts, own) if bool(near.any()) else own


class ShardedModel:
    """The model over rank-local shards: ``ShardedModel(config, shards, collective)(tokens)``.

    ``shards[i]`` holds the parameters of TP rank ``collective.ranks[i]`` under the declared
    layout (``layout_for(config)``); returns one logits tensor per local rank. Local head
    counts and widths come from the config and the degree; the bytes come from the shards,
    so a wrong shard computes wrong numbers rather than failing on shape.

    ``sequence_parallel`` shards the residual stream along the sequence over the TP group;
    ``context`` is the CP group (``context.ranks[i]``: local activation i's CP rank), or
    None for no context parallelism. See the module docstring for both layouts.
    ``embedding`` is the placement of ``tok_embeddings.weight`` (``Shard(0)``, vocab-parallel,
    or ``Shard(1)``, split on the hidden dimension: see ``embed``). The fused qkv may hold
    replicated KV heads (``HeadReplicated``): each rank attends with
    ``local_kv_heads(n_kv_heads, t)`` of them.
    """

    def __init__(self, config: ModelConfig, shards: Sequence[Mapping[str, torch.Tensor]],
                 collective: Collective, *, sequence_parallel: bool = False,
                 context: Collective | None = None, embedding: Placement = EMBEDDING,
                 experts: Experts | None = None, experts_group: Collective | None = None,
                 guard: RoutingGuard | None = None) -> None:
        if len(shards) != len(collective.ranks):
            raise ValueError(f"ShardedModel: {len(shards)} shard dicts for local ranks "
                             f"{list(collective.ranks)}")
        if context is not None and len(context.ranks) != len(collective.ranks):
            raise ValueError(f"ShardedModel: CP ranks {list(context.ranks)} do not pair with "
                             f"TP ranks {list(collective.ranks)}")
        if experts_group is not None and len(experts_group.ranks) != len(collective.ranks):
            raise ValueError(f"ShardedModel: expert-group ranks {list(experts_group.ranks)} do "
                             f"not pair with TP ranks {list(collective.ranks)}")
        if experts_group is not None and sequence_parallel:
            raise UnsupportedLayout(f"{config.name}: an expert group wider than the TP group "
                                    "runs without sequence parallelism")
        self.config = config
        self.shards = list(shards)
        self.collective = collective
        self.sequence_parallel = sequence_parallel
        self.context = context
        self.embedding = embedding
        # the experts' placement over the expert group (``layout_for``'s: every expert on
        # every rank) and the group their partial outputs are summed over (the TP group)
        self.experts = experts
        self.experts_group = experts_group
        self.guard = guard
        self.routings: dict[int, list[Routing]] = {}  # per MoE layer, each rank's own choice
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
        state = self.begin(tokens, segments)
        for i in range(self.config.n_layers):
            self.block(state, i)
        return self.end(state, gather_logits=gather_logits)

    # The forward as steps, each reading only its own parameters from ``self.shards``
    # (``begin``: the embedding; ``step(state, name)``: one parameter after it, in the order
    # ``param_shapes`` draws them; ``finish``: the logits), so a streamed check can hand it one
    # stage's, or one parameter's, shards at a time. ``block`` and ``end`` are those steps.

    def begin(self, tokens: torch.Tensor, segments: torch.Tensor | None = None) -> ShardedState:
        c, t = self.config, self.collective.degree
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
        h = self.embed([tokens[:, a:b] for a, b in chunks])  # (B, Tc, d), (B, Tc / t, d) with SP
        self.embedding_output = h
        self.embedding_positions = self.residual_positions(chunks)
        # which of the reference's flat (B * T) tokens an MoE layer routes on each rank: its
        # context chunk's (the whole sequence without CP: all of them)
        batch = torch.arange(tokens.shape[0])[:, None] * seq_len  # (B, 1)
        flat = [None if self.context is None else (batch + torch.arange(a, b)[None]).flatten()
                for a, b in chunks]
        return ShardedState(h, ropes, masks, chunks, c.n_heads // t,
                            local_kv_heads(c.n_kv_heads, t), flat_tokens=flat)

    def block(self, state: ShardedState, i: int) -> None:
        for suffix in self.config.suffixes_of(i):
            self.step(state, f"layers.{i}.{suffix}")

    def end(self, state: ShardedState, *, gather_logits: bool = True) -> Tensors:
        for name in self.config.head_params:
            self.step(state, name)
        return self.finish(state, gather_logits=gather_logits)

    def step(self, state: ShardedState, name: str) -> None:
        """The forward's step that reads parameter ``name`` (any but the embedding), on
        every local rank: ``ReferenceModel.step``'s ops over the shards, with the collectives
        where the layout needs them. A row-parallel layer's partial sums are reduced (and its
        bias added, ``reduce_row_parallel``) at its last parameter, the residual then."""
        c, shards = self.config, self.shards
        pre, what = step_of(name)
        match what:
            case "attn_norm.weight" | "ffn_norm.weight":
                state.x = self.enter_region(
                    [rms_norm(hr, p[name], c.norm_eps) for hr, p in zip(state.h, shards)],
                    pre + ("qkv.weight" if what == "attn_norm.weight" else "gate_up.weight"))
            case "qkv.weight":
                state.y = [xr @ p[name].T for xr, p in zip(state.x, shards)]
                state.x = None
            case "qkv.bias":
                state.y = [q + p[name] for q, p in zip(state.y, shards)]
            case "q_norm.weight" | "k_norm.weight":
                state.norms.append([p[name] for p in shards])
            case "o_proj.weight":
                a = self.attend(state.y, state.heads, state.kv_heads, state.ropes, state.masks,
                                state.chunks, pre + "attention", qk_norms(state, c.norm_eps))
                state.y = [ar @ p[name].T for ar, p in zip(a, shards)]  # partial sums
                if not c.has_o_bias:
                    self._residual(state, pre + "o_proj")
            case "gate_up.weight":
                state.y = [swiglu(xr @ p[name].T) for xr, p in zip(state.x, shards)]
                state.x = None
            case "down.weight":
                state.y = [yr @ p[name].T for yr, p in zip(state.y, shards)]  # partial sums
                if not c.has_down_bias:
                    self._residual(state, pre + "down")
            case "o_proj.bias" | "down.bias":
                self._residual(state, name[:-len(".bias")])
            case "router.weight":
                state.logits = [xr.flatten(0, 1) @ p[name].T for xr, p in zip(state.x, shards)]
                if not c.router_bias:
                    self._route(state, int(pre.split(".")[1]), None)
            case "router.bias":
                self._route(state, int(pre.split(".")[1]), [p[name] for p in shards])
            case "experts.gate_up.weight":
                state.hidden = [expert_hidden(xr.flatten(0, 1), p[name], routed, mine)
                                for xr, p, routed, mine in zip(state.x, shards, state.routed,
                                                               self._held_experts())]
            case "experts.down.weight":
                state.y = [expert_output(h, p[name], routed, mine,
                                         torch.zeros_like(xr.flatten(0, 1))).view_as(xr)
                           for xr, h, p, routed, mine in zip(state.x, state.hidden, shards,
                                                             state.routed, self._held_experts())]
                state.hidden = []
                if not c.shared_ffn:
                    self._combine(state, pre + "experts")
            case "shared.gate_up.weight":
                state.shared = [swiglu(xr @ p[name].T) for xr, p in zip(state.x, shards)]
            case "shared.down.weight":
                state.shared = [s @ p[name].T for s, p in zip(state.shared, shards)]  # partial
                if not c.shared_gate:
                    self._combine(state, pre + "experts")
            case "shared_gate.weight":
                state.shared = [torch.sigmoid(xr @ p[name].T) * s  # a per-token scalar
                                for xr, s, p in zip(state.x, state.shared, shards)]
                self._combine(state, pre + "experts")
            case "norm.weight":
                state.x = self.enter_region([rms_norm(hr, p[name], c.norm_eps)
                                             for hr, p in zip(state.h, shards)], c.head_name)
                if c.tie_embeddings:
                    self._logits(state, c.head_name)
            case "lm_head.weight":
                self._logits(state, name)
            case _:
                raise KeyError(f"{c.name}: no forward step reads {name!r}")

    def _route(self, state: ShardedState, layer: int, bias: list[torch.Tensor] | None) -> None:
        """Each rank's routing of every token with its own router (and selection bias), kept
        in ``routings``; the experts it computes (the guard's where near-tied), their weights
        from its own logits, and the tokens it serves (its ``edp`` share)."""
        c = self.config
        placement = self.experts or _plain_experts(c)
        group = self.experts_group or self.collective
        edp = placement.replicas(group.degree)
        own, state.routed = [], []
        for i, (logits, w) in enumerate(zip(state.logits, group.ranks)):
            routing = route(logits, c, None if bias is None else bias[i])
            own.append(routing)
            chosen = (routing.experts if self.guard is None
                      else self.guard.choice(layer, routing.experts, state.flat_tokens[i]))
            weights = gate_weights(logits, chosen, c)
            if edp > 1:  # token n is served by the replica with edp_rank == n % edp
                served = (torch.arange(chosen.shape[0]) % edp
                          != placement.coordinates(group.degree, w)[2])
                weights = weights.masked_fill(served[:, None], 0.0)
                chosen = chosen.masked_fill(served[:, None], -1)
            state.routed.append(by_expert(chosen, weights, c.n_experts))
        self.routings[layer] = own
        state.logits = None

    def _held_experts(self) -> list[list[int]]:
        """Per local rank, the global ids of the experts it holds, in its local order."""
        placement = self.experts or _plain_experts(self.config)
        group = self.experts_group or self.collective
        return [placement.experts_of(placement.coordinates(group.degree, w)[1])
                for w in group.ranks]

    def _combine(self, state: ShardedState, layer: str) -> None:
        """An MoE layer's partial outputs (routed experts, plus the shared expert's) summed
        into the residual stream: over the TP group as a row-parallel layer's, or, with a wider
        expert group, the routed part over it and the shared part over the TP group."""
        routed, shared = state.y, state.shared
        if self.experts_group is None:
            total = routed if shared is None else [a + b for a, b in zip(routed, shared)]
            out = self.leave_region(total, layer)
        else:
            out = self.experts_group.all_reduce(routed, tag=layer)
            if shared is not None:
                out = [a + b for a, b in zip(out, self.collective.all_reduce(shared, tag=layer))]
        state.h = [hr + o for hr, o in zip(state.h, out)]
        state.x = state.y = state.shared = None

    def _residual(self, state: ShardedState, layer: str) -> None:
        """The row-parallel ``layer``'s partial sums reduced, its bias added, into the
        residual stream."""
        state.h = [hr + o for hr, o in zip(state.h, self.reduce_row_parallel(state.y, layer))]

    def _logits(self, state: ShardedState, head: str) -> None:
        state.y = [xr @ p[head].T for xr, p in zip(state.x, self.shards)]  # (B, Tc, Vp/t)
        state.x = None

    def finish(self, state: ShardedState, *, gather_logits: bool = True) -> Tensors:
        """Per local rank, the logits once the head's step has run: gathered over the
        vocabulary ``(B, Tc, vocab)``, or with ``gather_logits=False`` the rank's own slice
        ``(B, Tc, padded_vocab / t)``."""
        c, local_logits = self.config, state.y
        assert local_logits is not None, "finish: the head's step has not run"
        if not gather_logits:
            return local_logits
        logits = self.collective.all_gather(local_logits, dim=-1, tag=c.head_name)  # (B, Tc, Vp)
        return [x[..., :c.vocab] for x in logits] if c.padded_vocab != c.vocab else logits

    def embed(self, tokens: list[torch.Tensor]) -> Tensors:
        """Each rank's residual stream from its tokens ``(B, Tc)``, by the embedding's placement:

        - ``Shard(0)`` (vocab-parallel, Megatron / vLLM / Llama 3): a masked lookup in the
          rank's vocab slice, then summed over the group (``leave_region``);
        - ``Shard(1)`` (Llama 2's fairscale ``ParallelEmbedding``, the Meta convention): a
          lookup of every token in the rank's ``d / t`` columns, then an all-gather of the
          hidden dimension; with SP each rank then keeps its own sequence shard.
        """
        coll, name = self.collective, "tok_embeddings.weight"
        tables = [p[name] for p in self.shards]
        match self.embedding:
            case Shard(dim=0):
                return self.leave_region([_vocab_parallel_embed(x, table, r) for x, table, r
                                          in zip(tokens, tables, coll.ranks)], name)
            case Shard(dim=1):
                h = coll.all_gather([F.embedding(x, table) for x, table in zip(tokens, tables)],
                                    dim=-1, tag=name)  # (B, Tc, d/t) each -> (B, Tc, d)
                if not self.sequence_parallel:
                    return h
                w = h[0].shape[1] // coll.degree
                return [x[:, r * w:(r + 1) * w] for x, r in zip(h, coll.ranks)]  # (B, Tc/t, d)
            case _:
                raise UnsupportedLayout(f"{name}: the forward reads an embedding split on the "
                                        f"vocabulary (S(0)) or the hidden dimension (S(1)), "
                                        f"not {self.embedding}")

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
               chunks: list[tuple[int, int]], tag: str, norms: tuple | None = None) -> Tensors:
        """Each rank's attention output ``(B, Tc, heads * D)``. With CP the local K and V
        (rotated at their global positions) are gathered over the CP group first. ``norms``:
        Qwen3's q and k norms, per rank (``(q_norms, k_norms, eps)``)."""
        hd = self.config.head_dim
        each = ([None] * len(qkv) if norms is None
                else [(q, k, norms[2]) for q, k in zip(norms[0], norms[1])])
        if self.context is None:
            return [attention(x, heads, kv_heads, hd, rope, mask, n)
                    for x, rope, mask, n in zip(qkv, ropes, masks, each)]
        split = [split_heads(x, heads, kv_heads, hd, rope, n)
                 for x, rope, n in zip(qkv, ropes, each)]
        kv = self.gather_context([torch.cat([k, v], dim=-1) for _, k, v in split],
                                 tag)  # (B, T, Hkv, 2D) each
        return [attend(q, *kvr.chunk(2, dim=-1), mask, q_offset=a)
                for (q, _, _), kvr, mask, (a, _) in zip(split, kv, masks, chunks)]


@dataclass
class ShardedState:
    """The sharded forward between steps, per local rank: the residual stream, the RoPE
    tables and masks of its chunk, the chunk, and the local head counts."""

    h: Tensors
    ropes: list[tuple[torch.Tensor, torch.Tensor]]
    masks: list[torch.Tensor | None]
    chunks: list[tuple[int, int]]
    heads: int
    kv_heads: int
    flat_tokens: list[torch.Tensor | None] = field(default_factory=list)  # see ``begin``
    x: Tensors | None = None  # the normed inputs a projection reads next
    y: Tensors | None = None  # the last step's outputs (features, partial sums, logits)
    # Qwen3's q and k norm weights of the layer being read, per rank (reset at its attention)
    norms: list[Tensors] = field(default_factory=list)
    # an MoE layer between its steps, per rank: router logits, each expert's tokens and
    # weights, the experts' features until their columns arrive, the shared expert's partials
    logits: Tensors | None = None
    routed: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    hidden: list[list[torch.Tensor | None]] = field(default_factory=list)
    shared: Tensors | None = None


def _plain_experts(config: ModelConfig) -> Experts:
    """``layout_for``'s experts: every expert on every rank (no expert parallelism)."""
    return Experts(config.n_experts, (config.expert_ffn, config.expert_ffn))


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

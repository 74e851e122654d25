"""Conversion bugs modelled on public ones, injected into a correct converter's output.

Each ``ConversionMutation`` takes the destination shards a correct converter produced (for
one ``Conversion``: config, source and destination endpoints) and returns what a converter
or loader with that bug would have produced: the same names, shapes and dtypes (a shape
error would be caught by torch, not by the check), different bytes. Each says

- ``applies``: why the bug cannot occur in this conversion (a RoPE permute is only between
  Meta and another convention), or None;
- ``identity``: why it changes nothing here (at t=1, with one KV head, ...), or None;
- ``depends_on``: what of the source its result depends on, so a matrix checks each
  distinct mutated shard set once: ``"destination"`` (nothing beyond the destination:
  a correct converter's output does not depend on the source, and where the bug needs a
  particular source, ``applies`` says so) or ``"source degree"`` (the source's shard
  boundaries, e.g. rank shards concatenated);
- ``changes``: the canonical parameters whose stored tensors it may change (a regex), so a
  check naming a bug (``check.naming``) applies only the mutations that could have made
  the tensor that differs.

The bugs are written with the convention index maps: the canonical tensors are gathered
back from the destination shards, changed as the bug changes them, and cut again (or the
maps themselves are changed), so each mutation is exact data movement.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from weight_sync_bench.conventions.maps import (
    Piece,
    chunk,
    expert_cols,
    expert_rows,
    gate_rows,
    gather_canonical,
    k_heads,
    materialize,
    rows,
    up_rows,
    v_heads,
)
from weight_sync_bench.conventions.megatron import grouped_qkv_order
from weight_sync_bench.conventions.meta import permute_index
from weight_sync_bench.errors import UnknownMutation

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.model.config import ModelConfig


Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Conversion:
    """One conversion a mutation is applied to."""

    config: ModelConfig
    src: Endpoint
    dst: Endpoint

    def __str__(self) -> str:
        return f"{self.config.name} {self.src} -> {self.dst}"


Bug = Callable[[list[Params], Conversion], list[Params]]
Rule = Callable[[Conversion], str | None]
DependsOn = Literal["destination", "source degree"]


@dataclass(frozen=True)
class ConversionMutation:
    """A named, shape-preserving conversion bug; ``models`` names the public bug."""

    name: str
    description: str
    models: str
    bug: Bug
    applies: Rule
    identity: Rule
    # The canonical parameters (a regex over their names) whose stored tensors it may
    # change; every other stored tensor it leaves as it was.
    changes: str
    depends_on: DependsOn = "destination"
    # The fewest tokens per sequence at which the forward sees the bug with the kill margin:
    # a RoPE pairing error is exact at relative distance 0 and grows with it. The conversion
    # fuzz found rope_permute_missing/twice at 7x and 0.0002x with 4 tokens (corpus
    # a417f71d13ea11eb, 8426db6c58fd97b9, 4fef1ab671018ec0), at 465x and more with 8, and
    # >= 198x over 60 random geometries each with 16 (the fixed matrix's length too), so a
    # fuzzed check of these runs at least 16 tokens (fuzz.case.run_conversion_case). A
    # selection-only bug (a router bias) shows only where some token's choice flips: at 4
    # tokens over 2 experts a zeroed bias flipped none in 10 of 245 fuzzed examples, so the
    # fuzz draws 4 experts or more for it and runs 32 tokens a sequence.
    min_seq_len: int = 1

    def not_applicable(self, conversion: Conversion) -> str | None:
        """Why the bug cannot occur in ``conversion``, or None where it can."""
        return self.applies(conversion)

    def identity_reason(self, conversion: Conversion) -> str | None:
        """Why the bug changes no byte of ``conversion``'s output, or None where it does."""
        return self.identity(conversion)

    def key(self, conversion: Conversion) -> tuple[str, ...]:
        """Conversions with equal keys get byte-identical mutated shards."""
        src = (str(conversion.src),) if self.depends_on == "source degree" else ()
        return (self.name, conversion.config.name, str(conversion.dst), *src)

    def apply(self, shards: list[Params], conversion: Conversion) -> list[Params]:
        """A mutated copy of ``shards`` (the input is left untouched)."""
        out = self.bug([dict(params) for params in shards], conversion)
        for rank, (before, after) in enumerate(zip(shards, out)):
            assert list(before) == list(after), (self.name, rank)
            for name, x in before.items():
                y = after[name]
                assert y.shape == x.shape and y.dtype == x.dtype, (
                    f"mutation {self.name} changed {name} on rank {rank}: "
                    f"{list(x.shape)} -> {list(y.shape)}")
        return out


# ---------------------------------------------------------------- building blocks

def _layers(config: ModelConfig, *suffixes: str) -> list[str]:
    return [f"layers.{i}.{s}" for i in range(config.n_layers) for s in suffixes
            if f"layers.{i}.{s}" in config.param_shapes()]


def _recut(shards: list[Params], conversion: Conversion, sources: list[str],
           change: Callable[[Params], Params]) -> list[Params]:
    """Gather ``sources`` back from the destination shards, ``change`` them (returning the
    canonical tensors it replaces), and cut every stored tensor of a replaced source again."""
    config, pieces = conversion.config, conversion.dst.pieces(conversion.config)
    canonical = gather_canonical(shards, pieces, config.param_shapes(), sources)
    changed = change(canonical)
    canonical.update(changed)
    names = list(dict.fromkeys(n for rank in pieces for n, p in rank.items()
                               if p.source in changed))  # every stage's
    for rank, new in enumerate(materialize(pieces, canonical, names)):
        shards[rank].update(new)
    return shards


def _remap(shards: list[Params], conversion: Conversion,
           remap: Callable[[int, str, Piece], Piece | None]) -> list[Params]:
    """Cut the stored tensors ``remap(rank, name, piece)`` returns a new piece for with that
    piece instead (a loader that reads the wrong rows), from the canonical tensors gathered
    back from the destination shards."""
    config, pieces = conversion.config, conversion.dst.pieces(conversion.config)
    wrong = [{name: new for name, piece in rank_pieces.items()
              if (new := remap(rank, name, piece)) is not None}
             for rank, rank_pieces in enumerate(pieces)]
    sources = sorted({p.source for rank in wrong for p in rank.values()})
    canonical = gather_canonical(shards, pieces, config.param_shapes(), sources)
    for rank, new in enumerate(materialize(wrong, canonical)):
        shards[rank].update(new)
    return shards


def _rows_of(canonical: Params, names: list[str], order: torch.Tensor) -> Params:
    return {name: canonical[name][order] for name in names}


def _qkv_reordered(config: ModelConfig, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A full qkv row order: Q rows by ``q`` (indices into the Q block), K rows by ``k``."""
    return torch.cat([q, config.q_rows + k, rows(config.q_rows + config.kv_rows, config.qkv_rows)])


def _never(conversion: Conversion) -> str | None:
    return None


def _dst_t1(conversion: Conversion) -> str | None:
    return "t=1: a single rank holds every tensor" if conversion.dst.degree == 1 else None


def _src_t1(conversion: Conversion) -> str | None:
    return ("source t=1: one rank's shard is the whole tensor" if conversion.src.degree == 1
            else None)


def _one_kv_group(conversion: Conversion) -> str | None:
    return ("n_kv_heads=1: one KV group, the grouped and plain qkv orders coincide"
            if conversion.config.n_kv_heads == 1 else None)


# ---------------------------------------------------------------- the bugs

_FUSED = re.compile(r"layers\.\d+\.(qkv\.weight|qkv\.bias|gate_up\.weight)")


def _tp_rank_zero(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Every rank's fused column-parallel tensors (qkv, gate_up, or Meta's wq/wk/wv/w1/w3)
    are rank 0's (on a pipeline stage, its first rank's)."""
    # keyed by the global tensor too: a staged Megatron endpoint names each stage's layers
    # from 0, so stage 1's "decoder.layers.0" is global layer n_layers / pp, whose first rank
    # is its own stage's
    first: dict[tuple[str, str], int] = {}
    for rank, pieces in enumerate(conversion.dst.pieces(conversion.config)):
        for name, piece in pieces.items():
            if _FUSED.fullmatch(piece.source):
                holder = first.setdefault((name, piece.source), rank)
                shards[rank][name] = shards[holder][name].clone()
    return shards


def _kv_replica_modulo(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Rank r's replicated K and V are KV head ``r % n_kv_heads``, not ``r * n_kv_heads // t``."""
    config, t = conversion.config, conversion.dst.degree
    q_local = config.q_rows // t

    def remap(rank: int, name: str, piece: Piece) -> Piece | None:
        if t <= config.n_kv_heads or not re.fullmatch(r"layers\.\d+\.qkv\.(weight|bias)",
                                                      piece.source):
            return None  # no replica to choose
        g = [rank % config.n_kv_heads]
        return Piece(piece.source, 0, torch.cat([piece.idx[:q_local], k_heads(config, g),
                                                 v_heads(config, g)]))
    return _remap(shards, conversion, remap)


def _grouped(config: ModelConfig) -> torch.Tensor:
    return grouped_qkv_order(config.n_heads, config.n_kv_heads, config.head_dim)


def _grouped_read_as_plain(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The converter reads Megatron's full ``linear_qkv`` (grouped per KV group) as if it
    were the plain ``[Q | K | V]``: the canonical qkv it writes is ``grouped[rows]``."""
    names = _layers(conversion.config, "qkv.weight", "qkv.bias")
    order = _grouped(conversion.config)
    return _recut(shards, conversion, names, lambda c: _rows_of(c, names, order))


def _plain_read_as_grouped(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The converter writes the plain ``[Q | K | V]`` into Megatron's ``linear_qkv`` without
    grouping it; Megatron's forward reads it as grouped per KV group."""
    names = _layers(conversion.config, "qkv.weight", "qkv.bias")
    order = torch.argsort(_grouped(conversion.config))
    return _recut(shards, conversion, names, lambda c: _rows_of(c, names, order))


def _fc1_rank_concat(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The converter concatenates Megatron's rank-local ``[gate_r | up_r]`` fc1 shards and
    splits the result in halves as ``[gate | up]``: ``[g0 u0 g1 u1 ...]`` read as gate, up."""
    config, t = conversion.config, conversion.src.degree
    order = torch.cat([torch.cat([chunk(gate_rows(config), t, r), chunk(up_rows(config), t, r)])
                       for r in range(t)])
    names = _layers(config, "gate_up.weight")
    return _recut(shards, conversion, names, lambda c: _rows_of(c, names, order))


def _meta_dst(conversion: Conversion) -> bool:
    return conversion.dst.name == "meta"


def _one_side_meta(conversion: Conversion) -> str | None:
    if (conversion.src.name == "meta") == (conversion.dst.name == "meta"):
        return ("no RoPE permute between these conventions (neither or both store Meta's "
                "interleaved-pair order)")
    return None


def _rope_bug(q_order: Callable[[ModelConfig, bool], torch.Tensor],
              k_order: Callable[[ModelConfig, bool], torch.Tensor]) -> Bug:
    """A RoPE permute bug as the canonical q and k row orders the destination ends up with;
    each order is a function of the config and of whether the destination is Meta's."""
    def bug(shards: list[Params], conversion: Conversion) -> list[Params]:
        config, to_meta = conversion.config, _meta_dst(conversion)
        order = _qkv_reordered(config, q_order(config, to_meta), k_order(config, to_meta))
        names = _layers(config, "qkv.weight")
        return _recut(shards, conversion, names, lambda c: _rows_of(c, names, order))
    return bug


def _p(config: ModelConfig, kv: bool) -> torch.Tensor:
    """HF's Meta -> HF permute of the Q (or K) block, as rows: ``permute(x) == x[p]``."""
    return permute_index(config.kv_rows if kv else config.q_rows,
                         config.n_kv_heads if kv else config.n_heads)


def _p_inv(config: ModelConfig, kv: bool) -> torch.Tensor:
    return torch.argsort(_p(config, kv))


# Permute missing. Converting to Meta, the rows should be un-permuted and are stored in HF
# order: the destination holds canonical' = permute(c). From Meta, the permute is skipped:
# canonical' = the Meta rows = unpermute(c).
def _missing(config: ModelConfig, kv: bool, to_meta: bool) -> torch.Tensor:
    return _p(config, kv) if to_meta else _p_inv(config, kv)


# Permute applied twice: one more permute (from Meta) or un-permute (to Meta) than needed.
def _twice(config: ModelConfig, kv: bool, to_meta: bool) -> torch.Tensor:
    return _p_inv(config, kv) if to_meta else _p(config, kv)


def _k_with_n_heads(config: ModelConfig, to_meta: bool) -> torch.Tensor:
    """k permuted with ``n_heads`` instead of ``n_kv_heads``: from Meta the k rows written are
    ``permute(unpermute_nkv(c_k), n_heads)``; to Meta, ``unpermute(c_k, n_heads)`` is stored,
    i.e. canonical' = ``permute_nkv(unpermute_nh(c_k))``."""
    right = permute_index(config.kv_rows, config.n_kv_heads)
    wrong = permute_index(config.kv_rows, config.n_heads)
    if to_meta:  # canonical'[j] = stored[right[j]] = c[argsort(wrong)[right[j]]]
        return torch.argsort(wrong)[right]
    return torch.argsort(right)[wrong]  # permute_nh(c[argsort(right)])


def _head_dim_2(conversion: Conversion) -> str | None:
    return ("head_dim=2: a head is one pair, both RoPE orders coincide"
            if conversion.config.head_dim == 2 else None)


def _k_view_valid(conversion: Conversion) -> str | None:
    c = conversion.config
    if (reason := _one_side_meta(conversion)) is not None:
        return reason
    if c.kv_rows % (2 * c.n_heads):
        return (f"the wrong view raises in the converter (n_kv_heads * head_dim = {c.kv_rows} "
                f"rows do not split into {c.n_heads} heads of pairs): loud, not silent")
    return None


def _qkv_bias_chunked(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Rank r's fused qkv bias is the r-th contiguous chunk of the full ``[Q | K | V]`` bias
    (a generic column-parallel narrow) instead of following its rows' heads."""
    t = conversion.dst.degree

    def remap(rank: int, name: str, piece: Piece) -> Piece | None:
        if not piece.source.endswith("qkv.bias"):
            return None
        width, tp_rank = piece.idx.numel(), rank % t  # TP fastest; stages and replicas
        return Piece(piece.source, 0, rows(tp_rank * width, (tp_rank + 1) * width))
    return _remap(shards, conversion, remap)


def _fused_qkv_bias(conversion: Conversion) -> str | None:
    if not conversion.config.has_qkv_bias:
        return "the config has no qkv bias"
    if conversion.dst.name not in ("plain", "megatron", "vllm"):
        return f"{conversion.dst.name} stores q, k and v biases apart: nothing fused to cut"
    c, dst = conversion.config, conversion.dst
    if dst.name == "vllm" and dst.degree > c.n_kv_heads:
        # Rank r holds n_heads/t Q heads plus a whole replicated K and V head, more than a
        # 1/t cut of the full bias: a generic narrow gives the wrong shape, which a loader
        # refuses (loud, not silent). Found by the conversion fuzz (test_convention_fuzz).
        return (f"vllm at t={dst.degree} > n_kv_heads={c.n_kv_heads}: the local bias holds "
                "replicated K and V heads, wider than a 1/t cut (a wrong shape: loud)")
    return None


def _bias_order_kept(conversion: Conversion) -> str | None:
    c, dst = conversion.config, conversion.dst
    if dst.degree == 1 and (dst.name != "megatron" or c.n_kv_heads == 1):
        return "t=1: the whole bias in [Q | K | V] order is what this convention stores"
    return None


def _embedding_split_on_vocab(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Meta's ``tok_embeddings`` (split on the hidden dimension) cut on the vocabulary
    instead: rank r's ``V/t`` rows copied flat into its ``[V, d/t]`` buffer."""
    config, t = conversion.config, conversion.dst.degree
    name = "tok_embeddings.weight"
    full = gather_canonical(shards, conversion.dst.pieces(config), config.param_shapes(),
                            [name])[name]
    for rank, params in enumerate(shards):
        params[name] = full.chunk(t, dim=0)[rank].reshape(params[name].shape).clone()
    return shards


def _embedding_joined_on_vocab(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Meta's ``tok_embeddings`` shards (``[V, d/t]``, split on the hidden dimension) joined
    on the vocabulary, as for Llama 3, and viewed as ``[V, d]``."""
    t = conversion.src.degree

    def change(c: Params) -> Params:
        table = c["tok_embeddings.weight"]
        joined = torch.cat(list(table.chunk(t, dim=1)), dim=0)  # (t V, d / t)
        return {"tok_embeddings.weight": joined.reshape(table.shape)}
    return _recut(shards, conversion, ["tok_embeddings.weight"], change)


def _stale_output(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The output layer written as a copy of the embedding table (the model treated as tied)."""
    return _recut(shards, conversion, ["tok_embeddings.weight", "lm_head.weight"],
                  lambda c: {"lm_head.weight": c["tok_embeddings.weight"].clone()})


def _untied(conversion: Conversion) -> str | None:
    return ("tied embeddings: the destination stores one table, no output copy to go stale"
            if conversion.config.tie_embeddings else None)


def _only(name: str, side: str = "dst") -> Rule:
    def rule(conversion: Conversion) -> str | None:
        ep = conversion.dst if side == "dst" else conversion.src
        return None if ep.name == name else f"the {side} is not {name}"
    return rule


def _both(*rules: Rule) -> Rule:
    def rule(conversion: Conversion) -> str | None:
        return next((r for rule in rules if (r := rule(conversion)) is not None), None)
    return rule


def _not(name: str, side: str) -> Rule:
    def rule(conversion: Conversion) -> str | None:
        ep = conversion.dst if side == "dst" else conversion.src
        return f"the {side} is {name} too: no order changes" if ep.name == name else None
    return rule


_QKV = r"layers\.\d+\.qkv\.(weight|bias)"
_QKV_WEIGHT = r"layers\.\d+\.qkv\.weight"


def _no_replication(conversion: Conversion) -> str | None:
    c, t = conversion.config, conversion.dst.degree
    if t <= c.n_kv_heads:
        return f"t={t} <= n_kv_heads={c.n_kv_heads}: no KV head is replicated"
    if c.n_kv_heads == 1:
        return "n_kv_heads=1: every replica is head 0 either way"
    return None


# ---------------------------------------------------------------- MoE bugs

def _moe(conversion: Conversion) -> str | None:
    return None if conversion.config.n_experts else "the config has no experts"


def _stale(shape: tuple[int, ...], name: str) -> torch.Tensor:
    """What a destination tensor holds where nothing was written: a previous model's values,
    drawn independently of every parameter (a fixed generator per name), as ``init_params``
    draws weights."""
    gen = torch.Generator().manual_seed(int.from_bytes(name.encode()[-8:].rjust(8, b"\0"),
                                                       "little") % (2 ** 63))
    return torch.randn(shape, generator=gen).mul_(0.02)


def _per_expert(config: ModelConfig, change: Callable[[torch.Tensor, int], torch.Tensor],
                down: bool) -> Callable[[Params], Params]:
    """A canonical change applied to each expert's ``[gate | up]`` rows (or down columns):
    ``change(block, expert)`` returns the block's replacement."""
    f = config.expert_ffn

    def run(canonical: Params) -> Params:
        out = {}
        for name in _layers(config, "experts.down.weight" if down else "experts.gate_up.weight"):
            x = canonical[name].clone()
            for e in range(config.n_experts):
                block = (x.narrow(1, e * f, f) if down else x.narrow(0, e * 2 * f, 2 * f))
                block.copy_(change(block.clone(), e))
            out[name] = x
        return out
    return run


def _w13_swapped(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Each expert's gate and up exchanged: ``[w1; w3]`` written where the engine reads
    ``[w3; w1]`` (or the reverse)."""
    config, f = conversion.config, conversion.config.expert_ffn
    names = _layers(config, "experts.gate_up.weight")
    return _recut(shards, conversion, names, _per_expert(
        config, lambda block, e: torch.cat([block[f:], block[:f]]), down=False))


def _local_expert_ids(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Each EP rank's local expert j filled from global expert j, not from its own
    ``experts_of(ep_rank)[j]``: every rank gets EP rank 0's experts."""
    config, dst = conversion.config, conversion.dst
    placement = dst.convention.forward_layout(config, dst).experts
    assert placement is not None
    world = dst.world

    def remap(rank: int, name: str, piece: Piece) -> Piece | None:
        if not piece.source.endswith(("experts.gate_up.weight", "experts.down.weight")):
            return None
        _, ep_rank, _ = placement.coordinates(world, rank)
        mine = placement.experts_of(ep_rank)
        # each stored row (gate_up) or column (down) of expert e moved to the same place in
        # expert j, e's local index: whatever the stored tensor holds of its experts (all of
        # them fused, one as weight{j}, an expert-TP chunk, [w3; w1]) keeps its shape
        block = config.expert_ffn * (1 if piece.source.endswith("down.weight") else 2)
        expert = piece.idx // block
        local = torch.full((config.n_experts,), -1, dtype=piece.idx.dtype)
        local[torch.tensor(mine, dtype=torch.long)] = torch.arange(len(mine), dtype=local.dtype)
        assert bool((local[expert] >= 0).all()), (name, rank)  # a rank holds only its own
        return Piece(piece.source, piece.dim, piece.idx - (expert - local[expert]) * block,
                     piece.stack, piece.keep)
    return _remap(shards, conversion, remap)


def _ep(conversion: Conversion) -> str | None:
    if conversion.dst.ep == 1:
        return "ep=1: every rank holds every expert, local ids are global"
    return None


def _ep_remainder_to_last(shards: list[Params], conversion: Conversion) -> list[Params]:
    """vLLM's expert map as its docstring describes it: the remainder of E % ep to the LAST
    ranks. The engine's buffers follow the code (the first ranks); each rank's slot k gets the
    k-th expert the docstring assigns it, and slots it assigns none keep a stale copy."""
    config, dst = conversion.config, conversion.dst
    placement = dst.convention.forward_layout(config, dst).experts
    assert placement is not None
    e, p = config.n_experts, placement.ep
    base, rem = divmod(e, p)

    def docstring(ep_rank: int) -> list[int]:
        extra = ep_rank >= p - rem  # the last rem ranks get one more
        start = ep_rank * base + max(0, ep_rank - (p - rem))
        return list(range(start, start + base + (1 if extra else 0)))

    pieces = dst.pieces(config)
    names = [n for n, pc in pieces[0].items()
             if pc.source.endswith(("experts.gate_up.weight", "experts.down.weight"))]
    canonical = gather_canonical(shards, pieces, config.param_shapes(),
                                 sorted({pieces[0][n].source for n in names}))
    for rank, params in enumerate(shards):
        _, ep_rank, _ = placement.coordinates(dst.world, rank)
        sent = docstring(ep_rank)
        for name in names:
            piece = pieces[rank][name]
            down = piece.source.endswith("down.weight")
            x = piece.flat(params[name]).clone()  # slot k is the k-th block along the dim
            width = x.shape[piece.dim] // max(1, len(placement.experts_of(ep_rank)))
            for k in range(x.shape[piece.dim] // max(1, width)):
                block = x.narrow(piece.dim, k * width, width)
                if k < len(sent):
                    idx = (expert_cols(config, [sent[k]]) if down
                           else expert_rows(config, [sent[k]]))
                    block.copy_(canonical[piece.source].index_select(piece.dim, idx))
                else:
                    block.copy_(_stale(tuple(block.shape), f"{rank}.{name}.{k}"))
            params[name] = piece.stacked(x)
    return shards


def _uneven_linear(conversion: Conversion) -> str | None:
    dst = conversion.dst
    if dst.name != "vllm" or dst.ep == 1 or dst.option("placement") != "linear":
        return "only vLLM's linear expert map with EP has a remainder rule"
    return None


def _even_experts(conversion: Conversion) -> str | None:
    if conversion.config.n_experts % conversion.dst.ep == 0:
        return "n_experts % ep == 0: no remainder to give to the first or the last ranks"
    return None


def _router_bias(value: Callable[[torch.Tensor], torch.Tensor]) -> Bug:
    def bug(shards: list[Params], conversion: Conversion) -> list[Params]:
        names = _layers(conversion.config, "router.bias")
        return _recut(shards, conversion, names,
                      lambda c: {n: value(c[n]) for n in names})
    return bug


def _has_router_bias(conversion: Conversion) -> str | None:
    return None if conversion.config.router_bias else "the router has no selection bias"


def _all_chosen(conversion: Conversion) -> str | None:
    c = conversion.config
    if c.top_k == c.n_experts:
        return f"top_k == n_experts = {c.n_experts}: every token takes every expert, whatever it scores"
    return None


def _bucket_not_sent(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The last quarter of the experts (a bucket, rounded up) never sent: their rows and
    columns keep a stale copy on every rank that holds them."""
    config = conversion.config
    e, f = config.n_experts, config.expert_ffn
    lost = range(e - -(-e // 4), e)
    names = _layers(config, "experts.gate_up.weight", "experts.down.weight")

    def run(canonical: Params) -> Params:
        out = {}
        for name in names:
            down = name.endswith("down.weight")
            x = canonical[name].clone()
            for expert in lost:
                block = x.narrow(1, expert * f, f) if down else x.narrow(0, expert * 2 * f, 2 * f)
                block.copy_(_stale(tuple(block.shape), f"bucket.{name}.{expert}"))
            out[name] = x
        return out
    return _recut(shards, conversion, names, run)


def _fc1_etp_concat(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Megatron's expert-TP fc1 shards ``[g_r | u_r]`` concatenated (``[g0 u0 g1 u1]``) and
    read as ``[gate | up]``, without slime's regroup to ``[g0 g1 | u0 u1]``."""
    config, f = conversion.config, conversion.config.expert_ffn
    etp = conversion.src.etp or conversion.src.degree
    order = torch.cat([torch.cat([chunk(rows(0, f), etp, r), chunk(rows(f, 2 * f), etp, r)])
                       for r in range(etp)])
    names = _layers(config, "experts.gate_up.weight")
    return _recut(shards, conversion, names,
                  _per_expert(config, lambda block, e: block[order], down=False))


def _fc2_wrong_dim(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Megatron's expert-TP fc2 shards ``[d, F/etp]`` concatenated on dim 0 (the partition
    dim TEGroupedLinear reports under explicit expert communication) and viewed as ``[d, F]``:
    what slime forces back with "bug in megatron's grouped moe"."""
    config = conversion.config
    etp = conversion.src.etp or conversion.src.degree
    names = _layers(config, "experts.down.weight")

    def wrong(block: torch.Tensor, e: int) -> torch.Tensor:
        return torch.cat(list(block.chunk(etp, dim=1)), dim=0).reshape(block.shape)
    return _recut(shards, conversion, names, _per_expert(config, wrong, down=True))


def _megatron_etp(conversion: Conversion) -> str | None:
    if conversion.src.name != "megatron":
        return "the source is not megatron: no expert-TP shards to gather"
    return None


def _etp_1(conversion: Conversion) -> str | None:
    src = conversion.src
    etp = src.etp or src.degree
    return "etp=1: one expert-TP shard is the whole expert" if etp == 1 else None


def _down_transposed(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Each expert's down matrix transposed once more than it should be (``[d, F]`` read as
    ``[F, d]``): shape-preserving only where the expert is square, d_model == expert_ffn."""
    config = conversion.config
    names = _layers(config, "experts.down.weight")
    return _recut(shards, conversion, names,
                  _per_expert(config, lambda block, e: block.T.contiguous(), down=True))


def _square_expert(conversion: Conversion) -> str | None:
    c = conversion.config
    if (reason := _moe(conversion)) is not None:
        return reason
    if c.expert_ffn != c.d_model:
        return (f"expert_ffn={c.expert_ffn} != d_model={c.d_model}: a transposed expert has "
                "another shape (loud)")
    return None


def _shared_gate_dropped(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The shared expert's gate never written: left at zeros, so ``sigmoid(0) = 0.5`` halves
    the shared expert for every token."""
    names = _layers(conversion.config, "shared_gate.weight")
    return _recut(shards, conversion, names, lambda c: {n: torch.zeros_like(c[n]) for n in names})


def _has_shared_gate(conversion: Conversion) -> str | None:
    return None if conversion.config.shared_gate else "the config has no shared-expert gate"


def _qk_norm_shifted(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Layer i's q_norm and k_norm taken from layer i + 1 (the last from the first)."""
    config = conversion.config
    names = _layers(config, "q_norm.weight", "k_norm.weight")
    n = config.n_layers

    def change(c: Params) -> Params:
        return {f"layers.{i}.{what}": c[f"layers.{(i + 1) % n}.{what}"].clone()
                for i in range(n) for what in ("q_norm.weight", "k_norm.weight")}
    return _recut(shards, conversion, names, change)


def _has_qk_norm(conversion: Conversion) -> str | None:
    return None if conversion.config.qk_norm else "the config has no q/k norms"


def _one_layer(conversion: Conversion) -> str | None:
    return "one layer: its norms are its own" if conversion.config.n_layers == 1 else None


def _no_dense_mlp(conversion: Conversion) -> str | None:
    return None if conversion.config.has_dense_mlp else "every layer is MoE: no dense fc1"


# ---------------------------------------------------------------- pipeline stages

def _staged(conversion: Conversion) -> str | None:
    return (None if conversion.dst.staged and conversion.dst.pp > 1
            else "the destination has no pipeline stages (pp=1)")


def _interleaved(conversion: Conversion) -> str | None:
    return _staged(conversion) or (None if conversion.dst.vpp > 1 else
                                   "vpp=1: one chunk per stage, nothing interleaves")


def _chunks(conversion: Conversion) -> tuple[tuple[range, ...], ...]:
    return conversion.dst.pipeline.chunks(conversion.config.n_layers)


def _layer_remap(shards: list[Params], conversion: Conversion,
                 layer_for: Callable[[int], int]) -> list[Params]:
    """Every stored layer tensor cut from layer ``layer_for(l)`` instead of its own layer l
    (where the two layers' parameters have the same shape: a dense prefix stays put)."""
    shapes = conversion.config.param_shapes()

    def remap(rank: int, name: str, piece: Piece) -> Piece | None:
        parts = piece.source.split(".")
        if parts[0] != "layers":
            return None
        other = ".".join(["layers", str(layer_for(int(parts[1]))), *parts[2:]])
        if other == piece.source or shapes.get(other) != shapes[piece.source]:
            return None
        return Piece(other, piece.dim, piece.idx, piece.stack, piece.keep)
    return _remap(shards, conversion, remap)


def _local_as_global(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Each chunk's local layer j filled from global layer j (the stage offset never added)."""
    start = {layer: layers.start for stage in _chunks(conversion) for layers in stage
             for layer in layers}
    return _layer_remap(shards, conversion, lambda layer: layer - start[layer])


def _offsets_zero(conversion: Conversion) -> str | None:
    return ("every chunk that holds layers starts at global layer 0" if all(
        layers.start == 0 for stage in _chunks(conversion) for layers in stage if len(layers))
        else None)


def _contiguous(conversion: Conversion) -> dict[int, int]:
    """Global layer -> the layer a rank's chunks would hold if its layers were contiguous
    (rank p's block after the ranks before it, its chunks in order within the block)."""
    out, at = {}, 0
    for stage in _chunks(conversion):
        for layers in stage:
            for layer in layers:
                out[layer] = at
                at += 1
    return out


def _chunks_contiguous(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Virtual stages read as if each rank's chunks were contiguous, not interleaved."""
    contiguous = _contiguous(conversion)
    return _layer_remap(shards, conversion, lambda layer: contiguous[layer])


def _contiguous_same(conversion: Conversion) -> str | None:
    return ("the interleaved and contiguous assignments coincide" if all(
        k == v for k, v in _contiguous(conversion).items()) else None)


def _even_count(conversion: Conversion) -> int:
    return conversion.config.n_layers // conversion.dst.pp


def _last_stage_extra(conversion: Conversion) -> list[int]:
    held = [layer for layers in _chunks(conversion)[-1] for layer in layers]
    return held[_even_count(conversion):]


def _last_stage_dropped(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The last stage's layers past ``num_layers // pp`` never written: a stale copy."""
    lost = {f"layers.{layer}." for layer in _last_stage_extra(conversion)}
    for rank, pieces in enumerate(conversion.dst.pieces(conversion.config)):
        for name, piece in pieces.items():
            if any(piece.source.startswith(prefix) for prefix in lost):
                x = shards[rank][name]
                shards[rank][name] = _stale(tuple(x.shape), f"pp.{name}.{rank}").to(x.dtype)
    return shards


def _last_stage_even(conversion: Conversion) -> str | None:
    return (f"the last stage holds at most num_layers // pp = {_even_count(conversion)} "
            "layers: none past it" if not _last_stage_extra(conversion) else None)


def _ends_swapped(shards: list[Params], conversion: Conversion) -> list[Params]:
    """The first stage's embedding and the last stage's output layer exchanged."""
    swap = {"tok_embeddings.weight": "lm_head.weight", "lm_head.weight": "tok_embeddings.weight"}

    def remap(rank: int, name: str, piece: Piece) -> Piece | None:
        other = swap.get(piece.source)
        return Piece(other, piece.dim, piece.idx, piece.stack, piece.keep) if other else None
    return _remap(shards, conversion, remap)


def _padding_per_rank(shards: list[Params], conversion: Conversion) -> list[Params]:
    """Megatron's padded vocab-parallel tables cut from the unpadded vocabulary: rank r's
    rows ``[r * ceil(V / t), ...)`` of the real vocabulary, zeros after them, where the
    padding belongs after the whole vocabulary."""
    config, t = conversion.config, conversion.dst.degree
    share = -(-config.vocab // t)

    def remap(rank: int, name: str, piece: Piece) -> Piece | None:
        if piece.source not in ("tok_embeddings.weight", "lm_head.weight"):
            return None
        r = rank % t  # the TP rank: fastest in Megatron's rank order
        real = rows(min(r * share, config.vocab), min((r + 1) * share, config.vocab))
        pad = torch.full((piece.idx.numel() - real.numel(),), -1, dtype=torch.int64)
        return Piece(piece.source, piece.dim, torch.cat([real, pad]), piece.stack, piece.keep)
    return _remap(shards, conversion, remap)


def _megatron_padded(conversion: Conversion) -> str | None:
    dst = conversion.dst
    if dst.name != "megatron" or dst.option("vocab") != "padded":
        return "the destination is not Megatron with its vocabulary padded"
    return None


def _padding_moves_nothing(conversion: Conversion) -> str | None:
    dst, config = conversion.dst, conversion.config
    if dst.degree == 1:
        return "t=1: one rank holds the whole table, its padding after the vocabulary"
    share = -(-config.vocab // dst.degree)
    padded = config.replace(vocab_multiple=128 * dst.degree).padded_vocab // dst.degree
    return ("every rank's share of the vocabulary is its padded share: nothing moves"
            if share == padded else None)


PIPELINE_MUTATIONS: tuple[ConversionMutation, ...] = (
    ConversionMutation(
        "pp_local_layer_as_global", "each stage's local layer j filled from global layer j",
        "huggingface/transformers PR #24381: HF -> Megatron with PP used the local layer index, "
        "so stage 2 received layers 0 and 1 again (NVIDIA-NeMo/RL PR #3259 the other way)",
        _local_as_global, _staged, _offsets_zero, r"layers\.\d+\..*"),
    ConversionMutation(
        "pp_chunks_contiguous", "a rank's virtual-stage chunks filled as if contiguous, not "
        "interleaved", "NVIDIA/Megatron-LM #1584 / PR #1583: a wrong offset with virtual "
        "stages", _chunks_contiguous, _interleaved, _contiguous_same, r"layers\.\d+\..*"),
    ConversionMutation(
        "pp_last_stage_layers_dropped", "the last stage's layers past num_layers // pp never "
        "written: a stale copy", "NVIDIA/Megatron-LM #1304: 30 layers on PP4 silently became "
        "28 (a floor division of the layers per stage)", _last_stage_dropped, _staged,
        _last_stage_even, r"layers\.\d+\..*"),
    ConversionMutation(
        "pp_embedding_output_swapped", "the first stage's embedding and the last stage's "
        "output layer exchanged", "pre_process / post_process read the wrong way round "
        "(issue 25: a stage's embedding/output assignment)", _ends_swapped,
        _both(_staged, _untied), _never, r"(tok_embeddings|lm_head)\.weight"),
    ConversionMutation(
        "vocab_padding_per_rank", "Megatron's padded tables cut from the unpadded vocabulary, "
        "each rank's padding after its own share", "padding on one side only: verl and mbridge "
        "build Megatron unpadded where Megatron's training arguments pad to 128 x TP (issue 25)",
        _padding_per_rank, _megatron_padded, _padding_moves_nothing,
        r"(tok_embeddings|lm_head)\.weight"),
)


_GATE_UP = r"layers\.\d+\.experts\.gate_up\.weight"
_DOWN = r"layers\.\d+\.experts\.down\.weight"
_EXPERTS = r"layers\.\d+\.experts\.(gate_up|down)\.weight"
ROUTER_BIAS = r"layers\.\d+\.router\.bias"

MOE_MUTATIONS: tuple[ConversionMutation, ...] = (
    ConversionMutation(
        "w13_halves_swapped", "each expert's gate (w1) and up (w3) exchanged in w13",
        "vLLM #42821: a second load_weights writes [w1; w3] into the FlashInfer CUTLASS "
        "buffer process_weights_after_loading turned into [w3; w1]",
        _w13_swapped, _moe, _never, _GATE_UP),
    ConversionMutation(
        "local_expert_id_as_global", "each EP rank's local expert j filled from global expert j",
        "THUDM/slime PR #1799: the local j of linear_fc1.weight{j} indexed the global fused "
        "gate_up_proj under EP", _local_expert_ids, _moe, _ep, _EXPERTS),
    ConversionMutation(
        "ep_remainder_to_last", "vLLM's E % ep extra experts placed on the last ranks, not the "
        "first", "vLLM determine_expert_map: its docstring says the remainder goes to the last "
        "rank, its code gives it to the first", _ep_remainder_to_last, _uneven_linear,
        _even_experts, _EXPERTS),
    ConversionMutation(
        "router_bias_not_synced", "the router's selection bias left at its initial zeros",
        "NVIDIA-NeMo/Megatron-Bridge PR #4657: expert_bias <-> e_score_correction_bias mapped "
        "for MTP layers only (Kimi-K2 converted with the bias at zero)",
        _router_bias(torch.zeros_like), _has_router_bias, _all_chosen, ROUTER_BIAS,
        min_seq_len=32),
    ConversionMutation(
        "router_bias_negated", "the router's selection bias written with the wrong sign",
        "a selection-only bug: only which experts are chosen changes (issue 32, the routing "
        "check)", _router_bias(torch.neg), _has_router_bias, _all_chosen, ROUTER_BIAS,
        min_seq_len=32),
    ConversionMutation(
        "expert_bucket_not_sent", "the last quarter of the experts never sent: a stale copy",
        "NovaSky-AI/SkyRL PR #1471: grouped expert export tasks split across buckets, fused "
        "expert tensors never yielded", _bucket_not_sent, _moe, _never, _EXPERTS),
    ConversionMutation(
        "fc1_etp_rank_concat", "Megatron's expert-TP fc1 shards [g0 u0 g1 u1] read as "
        "[gate | up]", "slime update_weight/common.py all_gather_param regroups fc1 "
        "[g0,u0,g1,u1] -> [g0,g1 | u0,u1]; a gather without it", _fc1_etp_concat,
        _both(_moe, _megatron_etp), _etp_1, _GATE_UP, "source degree"),
    ConversionMutation(
        "fc2_split_on_wrong_dim", "Megatron's expert-TP fc2 shards joined on dim 0, viewed as "
        "[d, F]", "slime all_gather_param: 'bug in megatron's grouped moe' (TEGroupedLinear "
        "reports partition_dim 0 for fc2)", _fc2_wrong_dim, _both(_moe, _megatron_etp), _etp_1,
        _DOWN, "source degree"),
    ConversionMutation(
        "expert_transposed_twice", "each expert's down matrix transposed once too often",
        "ms-swift PR #9828 (UNCONFIRMED); Megatron-Bridge PR #3162 (gpt-oss down_proj "
        "double-transposed): only a square expert keeps its shape", _down_transposed,
        _square_expert, _never, _DOWN),
    ConversionMutation(
        "shared_gate_dropped", "the shared expert's sigmoid gate never written (zeros)",
        "Qwen2-MoE shared_expert_gate missing from a mapping (Megatron-Bridge qwen35_bridge "
        "maps it with a ReplicatedMapping)", _shared_gate_dropped, _has_shared_gate, _never,
        r"layers\.\d+\.shared_gate\.weight"),
    ConversionMutation(
        "qk_norm_from_next_layer", "Qwen3's q_norm / k_norm of layer i taken from layer i + 1",
        "a per-layer name mapped with the wrong layer index (transformers PR #24381's class)",
        _qk_norm_shifted, _has_qk_norm, _one_layer, r"layers\.\d+\.[qk]_norm\.weight"),
)


CONVERSION_MUTATIONS: tuple[ConversionMutation, ...] = (
    ConversionMutation(
        "tp_rank_defaults_to_0", "every rank loads rank 0's shard of the fused qkv and gate_up",
        "vllm-gguf-plugin #103 (fix #106): kwargs.get('tp_rank', 0) in load_qkv_weight and "
        "load_merged_column_weight", _tp_rank_zero, _never, _dst_t1, _FUSED.pattern),
    ConversionMutation(
        "kv_replica_modulo", "replicated KV head r % n_kv_heads instead of r * n_kv_heads // t",
        "KV-head replication offsets at t > n_kv_heads (sglang PRs #19086, #20967; "
        "modelexpress PR #650)", _kv_replica_modulo, _only("vllm"), _no_replication, _QKV),
    ConversionMutation(
        "megatron_qkv_read_as_plain", "Megatron's grouped linear_qkv read as plain [Q | K | V]",
        "fused qkv stored grouped but split as plain (NeMo Automodel PR #1324, "
        "tt-forge-models PRs #798/#855)", _grouped_read_as_plain,
        _both(_only("megatron", "src"), _not("megatron", "dst")), _one_kv_group, _QKV),
    ConversionMutation(
        "plain_qkv_read_as_megatron", "a plain [Q | K | V] written into linear_qkv ungrouped",
        "the reverse of megatron_qkv_read_as_plain (same sources; vllm PR #36242's midpoint "
        "split of an interleaved GQA weight)", _plain_read_as_grouped,
        _both(_only("megatron"), _not("megatron", "src")), _one_kv_group, _QKV),
    ConversionMutation(
        "megatron_fc1_rank_concat",
        "Megatron's rank-local [gate_r | up_r] fc1 shards concatenated and read as [gate | up]",
        "SwiGLU [W; V] swizzle across TP shards (Megatron-LM #2769, PR #5714; Megatron-Bridge "
        "PR #5376)", _fc1_rank_concat, _only("megatron", "src"), _both(_src_t1, _no_dense_mlp),
        r"layers\.\d+\.gate_up\.weight", "source degree"),
    ConversionMutation(
        "rope_permute_missing", "Meta <-> HF RoPE permute of q and k not applied",
        "llama2.c PR #286, torchtitan PR #1441 (exact at distance 0, wrong as it grows)",
        _rope_bug(lambda c, m: _missing(c, False, m), lambda c, m: _missing(c, True, m)),
        _one_side_meta, _head_dim_2, _QKV_WEIGHT, min_seq_len=16),
    ConversionMutation(
        "rope_permute_twice", "Meta <-> HF RoPE permute of q and k applied twice",
        "double conversion of already-converted q/k (same class as llama2.c PR #286)",
        _rope_bug(lambda c, m: _twice(c, False, m), lambda c, m: _twice(c, True, m)),
        _one_side_meta, _head_dim_2, _QKV_WEIGHT, min_seq_len=16),
    ConversionMutation(
        "rope_k_permuted_with_n_heads", "k permuted with n_heads instead of n_kv_heads",
        "transformers PR #31788 / issue #31766, llama.cpp PR #3364, flash-attention PR #546",
        _rope_bug(lambda c, m: rows(0, c.q_rows), _k_with_n_heads),
        _k_view_valid,
        lambda cv: ("n_heads == n_kv_heads: the two permutes coincide"
                    if cv.config.n_heads == cv.config.n_kv_heads else None),
        _QKV_WEIGHT, min_seq_len=16),
    ConversionMutation(
        "qkv_bias_not_split", "the fused qkv bias cut contiguously, not with its rows' heads",
        "Qwen2-style qkv bias moved apart from its weight (Megatron-Bridge merge_qkv_biases "
        "exists for it; conventions.md section 1.7)", _qkv_bias_chunked, _fused_qkv_bias,
        _bias_order_kept, r"layers\.\d+\.qkv\.bias"),
    ConversionMutation(
        "embedding_split_on_vocab",
        "Meta tok_embeddings cut on the vocabulary where Llama 2 splits the hidden dimension",
        "ParallelEmbedding (dim 1) vs VocabParallelEmbedding (dim 0): convert_llama_weights_"
        "to_hf's concat_dim by llama_version", _embedding_split_on_vocab, _only("meta"), _dst_t1,
        r"tok_embeddings\.weight"),
    ConversionMutation(
        "embedding_joined_on_vocab",
        "Meta tok_embeddings shards joined on the vocabulary where they split the hidden one",
        "convert_llama_weights_to_hf with a Llama 3 concat_dim on a Llama 2 checkpoint",
        _embedding_joined_on_vocab, _only("meta", "src"), _src_t1, r"tok_embeddings\.weight",
        "source degree"),
    ConversionMutation(
        "output_stale_copy", "the output layer left as a copy of the embedding table",
        "tied/untied output handling: slime #345, NeMo-RL #227", _stale_output, _untied, _never,
        r"lm_head\.weight"),
    *MOE_MUTATIONS,
    *PIPELINE_MUTATIONS,
)

MUTATIONS: dict[str, ConversionMutation] = {m.name: m for m in CONVERSION_MUTATIONS}
# The dense models' bugs between unstaged endpoints (every MoE one needs experts: it applies
# to no dense conversion; every pipeline one needs stages).
DENSE_MUTATIONS: tuple[ConversionMutation, ...] = tuple(
    m for m in CONVERSION_MUTATIONS if m not in MOE_MUTATIONS and m not in PIPELINE_MUTATIONS)


def mutation_by_name(name: str) -> ConversionMutation:
    try:
        return MUTATIONS[name]
    except KeyError:
        raise UnknownMutation(f"unknown conversion mutation {name!r}; known: "
                              f"{', '.join(MUTATIONS)}") from None

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
    # fuzzed check of these runs at least 16 tokens (fuzz.case.run_conversion_case).
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
    names = [n for n, p in pieces[0].items() if p.source in changed]
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
    are rank 0's."""
    for name, piece in conversion.dst.pieces(conversion.config)[0].items():
        if _FUSED.fullmatch(piece.source):
            for params in shards:
                params[name] = shards[0][name].clone()
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
    def remap(rank: int, name: str, piece: Piece) -> Piece | None:
        if not piece.source.endswith("qkv.bias"):
            return None
        width = piece.idx.numel()
        return Piece(piece.source, 0, rows(rank * width, (rank + 1) * width))
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
        "PR #5376)", _fc1_rank_concat, _only("megatron", "src"), _src_t1,
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
)

MUTATIONS: dict[str, ConversionMutation] = {m.name: m for m in CONVERSION_MUTATIONS}


def mutation_by_name(name: str) -> ConversionMutation:
    try:
        return MUTATIONS[name]
    except KeyError:
        raise UnknownMutation(f"unknown conversion mutation {name!r}; known: "
                              f"{', '.join(MUTATIONS)}") from None

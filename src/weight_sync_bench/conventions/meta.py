"""``meta``: the original Llama checkpoints (``consolidated.NN.pth``, one per model-parallel rank).

Followed (research notes conventions.md section 4): names from ``meta-llama/llama``
``llama/model.py`` (``Transformer``, ``TransformerBlock``, ``Attention``, ``FeedForward``:
``w2(silu(w1(x)) * w3(x))``, so w1 is gate, w3 up, w2 down); model parallelism from
``fairscale/nn/model_parallel/layers.py``: ``ColumnParallelLinear`` (wq, wk, wv, w1, w3,
output: row chunk r), ``RowParallelLinear`` (wo, w2: column chunk r) and, in Llama 1/2,
``ParallelEmbedding`` for ``tok_embeddings``, split on the hidden dimension (column chunk r;
its forward looks every token up locally, then all-gathers the hidden dimension). Llama 3
(``meta-llama/llama3`` model.py) uses ``VocabParallelEmbedding`` instead (dim 0); this
convention is the Llama 2 one, whose embedding the forward must read differently.

The q and k rows are in Meta's interleaved-pair RoPE order (``view_as_complex`` over
``(..., hd/2, 2)``): HF's ``convert_llama_weights_to_hf.py::permute`` maps them to the
canonical rotate-half order, ``permute(w, n, dim1, dim2) = w.view(n, dim1 // n // 2, 2,
dim2).transpose(1, 2).reshape(dim1, dim2)`` (k with ``n_kv_heads``), so the Meta rows are
the inverse permutation of the canonical ones: per head, Meta row 2j is HF row j and Meta
row 2j+1 is HF row hd/2 + j. Meta has no KV replication (``n_local_kv_heads = n_kv_heads //
model_parallel_size``), no biases, never ties the output and does not pad the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.convention import (
    Convention,
    ForwardLayout,
    need,
    need_unpadded,
    relaid,
    renamed,
)
from weight_sync_bench.conventions.maps import (
    Pieces,
    chunk,
    gate_rows,
    k_heads,
    q_heads,
    up_rows,
    v_heads,
)
from weight_sync_bench.layout.placements import Shard
from weight_sync_bench.model.plan import layout_for

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.model.config import ModelConfig

NAME = "meta"


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's Meta -> HF row permutation (``convert_llama_weights_to_hf.py::permute``), on the
    first dim of ``w`` (``(dim1, ...)``; 1-D works too)."""
    dim1 = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, -1).transpose(1, 2).reshape(dim1, *rest)


def permute_index(rows: int, n_heads: int) -> torch.Tensor:
    """``p`` with ``permute(w, n_heads) == w[p]`` for ``rows``-row tensors: HF row i is Meta
    row ``p[i]``. ``argsort(p)`` is the inverse (HF -> Meta): Meta row m is HF row
    ``argsort(p)[m]``."""
    return permute(torch.arange(rows, dtype=torch.int64), n_heads)


def meta_q_rows(config: ModelConfig) -> torch.Tensor:
    """Canonical qkv rows of ``wq``, in Meta order."""
    return q_heads(config, range(config.n_heads))[
        torch.argsort(permute_index(config.q_rows, config.n_heads))]


def meta_k_rows(config: ModelConfig) -> torch.Tensor:
    """Canonical qkv rows of ``wk``, in Meta order (permuted with ``n_kv_heads``)."""
    return k_heads(config, range(config.n_kv_heads))[
        torch.argsort(permute_index(config.kv_rows, config.n_kv_heads))]


# canonical name -> Meta's (layer i as {i}); wq/wk/wv and w1/w3 are cut from the fused ones.
NAMES = {
    "tok_embeddings.weight": "tok_embeddings.weight",
    "layers.{i}.attn_norm.weight": "layers.{i}.attention_norm.weight",
    "layers.{i}.o_proj.weight": "layers.{i}.attention.wo.weight",
    "layers.{i}.ffn_norm.weight": "layers.{i}.ffn_norm.weight",
    "layers.{i}.down.weight": "layers.{i}.feed_forward.w2.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def _reads(config: ModelConfig, at: Endpoint) -> ForwardLayout:
    # The forward reads q and k back in rotate-half order (the harness's RoPE) and the
    # embedding as ParallelEmbedding does: a local lookup, then an all-gather of d.
    return ForwardLayout(config, relaid(layout_for(config), {"tok_embeddings.weight": Shard(1)}))


def _build(config: ModelConfig, at: Endpoint) -> Pieces:
    t = at.degree
    need(not config.n_experts and not config.qk_norm, NAME, "layers.0.attention.wq.weight", t,
         "a dense Llama 2 block (Meta's Llama 2 checkpoints have no experts and no q/k norms)",
         f"n_experts={config.n_experts}, qk_norm={config.qk_norm}")
    need_unpadded(NAME, "tok_embeddings.weight", config, t)
    need(not config.tie_embeddings, NAME, "output.weight", t,
         "tie_embeddings == False (Meta Llama checkpoints store output separately)",
         "tie_embeddings=True")
    need(not (config.has_qkv_bias or config.has_o_bias or config.has_down_bias), NAME,
         "layers.0.attention.wq.weight", t, "no biases (Meta Llama linears are bias-free)",
         f"bias={config.bias}, qkv_bias={config.qkv_bias}, o_bias={config.o_bias}")
    need(config.n_heads % t == 0, NAME, "layers.0.attention.wq.weight", t, "n_heads % t == 0",
         f"n_heads={config.n_heads}")
    need(config.n_kv_heads % t == 0, NAME, "layers.0.attention.wk.weight", t,
         "n_kv_heads % t == 0 (n_local_kv_heads = n_kv_heads // t: no KV replication)",
         f"n_kv_heads={config.n_kv_heads}")
    need(config.ffn % t == 0, NAME, "layers.0.feed_forward.w1.weight", t, "ffn % t == 0",
         f"ffn={config.ffn}")
    need(config.d_model % t == 0, NAME, "tok_embeddings.weight", t,
         "d_model % t == 0 (ParallelEmbedding splits the hidden dimension)",
         f"d_model={config.d_model}")
    need(config.vocab % t == 0, NAME, "output.weight", t,
         "vocab % t == 0 (ColumnParallelLinear over the unpadded vocabulary)",
         f"vocab={config.vocab}")
    wq, wk = meta_q_rows(config), meta_k_rows(config)
    wv = v_heads(config, range(config.n_kv_heads))
    gate, up = gate_rows(config), up_rows(config)
    return renamed(config, t, _reads(config, at).layout, NAMES, {
        "layers.{i}.qkv.weight": [("layers.{i}.attention.wq.weight", lambda r: chunk(wq, t, r)),
                                  ("layers.{i}.attention.wk.weight", lambda r: chunk(wk, t, r)),
                                  ("layers.{i}.attention.wv.weight", lambda r: chunk(wv, t, r))],
        "layers.{i}.gate_up.weight": [("layers.{i}.feed_forward.w1.weight",
                                       lambda r: chunk(gate, t, r)),
                                      ("layers.{i}.feed_forward.w3.weight",
                                       lambda r: chunk(up, t, r))]})


META = Convention(NAME, "original Llama 2 checkpoints: wq/wk in interleaved-pair RoPE order, "
                  "tok_embeddings split on the hidden dimension", _build, _reads)

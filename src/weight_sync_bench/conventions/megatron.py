"""``megatron``: Megatron-Core's GPT model with the Transformer Engine layer spec (PP=1).

Followed (NVIDIA/Megatron-LM @ d98e8a64; research notes conventions.md section 1):

- names: ``megatron/core/models/gpt/gpt_layer_specs.py::get_gpt_layer_with_transformer_engine_submodules``
  (the input norm fused into ``linear_qkv`` as ``layer_norm_weight``, the pre-MLP norm into
  ``linear_fc1``), as Megatron-Bridge ``models/llama/llama_bridge.py::mapping_registry`` maps them;
- ``linear_qkv`` rows interleaved per KV group, ``[q heads of group g, k_g, v_g]`` for each g:
  ``megatron/core/transformer/attention.py::SelfAttention.get_query_key_value_tensors`` (the
  view ``(sq, b, ng, (np/ng + 2) * hn)`` then split ``[np/ng * hn, hn, hn]``), and Bridge
  ``param_mapping.py::merge_qkv_weights`` / ``merge_qkv_biases``;
- TP: ``tensor_parallel/layers.py::ColumnParallelLinear`` keeps contiguous row chunk r
  (``linear_qkv``, ``linear_fc1``, ``output_layer``), ``RowParallelLinear`` column chunk r
  (``linear_proj``, ``linear_fc2``), ``VocabParallelEmbedding`` vocab rows
  ``[r*Vp/t, (r+1)*Vp/t)``;
- ``linear_fc1`` local ``[gate_r | up_r]``: ``megatron/core/transformer/mlp.py::MLP.forward``
  (``glu``: ``torch.chunk(x, 2, dim=-1)``) and ``apply_swiglu_sharded_factory``; Bridge
  ``GatedMLPMapping.hf_to_megatron``;
- vocabulary padded to a multiple of ``make_vocab_size_divisible_by * t`` (default 128),
  zero rows at the end: ``megatron/training/vocab_utils.py::calculate_padded_vocab_size``;
- tied: ``output_layer`` is built with ``skip_weight_param_allocation`` and reads
  ``embedding.word_embeddings.weight`` (``gpt_model.py``, ``language_module.py``): no
  ``output_layer.weight`` is stored.

Biases: Megatron Llama/Qwen2 set ``add_bias_linear=False``. ``qkv_bias`` maps to
``add_qkv_bias`` (``linear_qkv.bias``, interleaved and split as the weight; Qwen2 bridge).
An o_proj or down bias (``o_bias``, ``bias``) would need ``add_bias_linear``, which biases
``linear_fc1`` too, and the harness block has no gate_up bias: rejected, not approximated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.convention import (
    Convention,
    ForwardLayout,
    need,
    need_unpadded,
    renamed,
)
from weight_sync_bench.conventions.maps import Pieces, chunk, rows
from weight_sync_bench.model.plan import layout_for

if TYPE_CHECKING:
    from weight_sync_bench.model.config import ModelConfig

NAME = "megatron"
# --make-vocab-size-divisible-by's default (megatron/training/arguments.py)
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def grouped_qkv_order(n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Canonical ``[Q | K | V]`` rows in Megatron-Core's order: for each KV group g, its
    ``n_heads / n_kv_heads`` Q heads, then K_g, then V_g (``q1 q2 k1 v1 | q3 q4 k2 v2 |
    ...``). ``canonical[order]`` is the full ``linear_qkv``; ``linear_qkv[argsort(order)]``
    the canonical one. (``check.mutations`` reads plain layouts with it too.)"""
    group, q_rows, kv_rows = n_heads // n_kv_heads, n_heads * head_dim, n_kv_heads * head_dim
    parts: list[torch.Tensor] = []
    for g in range(n_kv_heads):
        parts.append(rows(g * group * head_dim, (g + 1) * group * head_dim))
        parts.append(rows(q_rows + g * head_dim, q_rows + (g + 1) * head_dim))
        parts.append(rows(q_rows + kv_rows + g * head_dim, q_rows + kv_rows + (g + 1) * head_dim))
    return torch.cat(parts)


def padded_vocab(vocab: int, degree: int) -> int:
    """``calculate_padded_vocab_size``: ``ceil(vocab / (128 t)) * 128 t``."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * degree
    return -(-vocab // multiple) * multiple


# canonical name -> Megatron's (layer i as {i}); the qkv is cut in its grouped order instead.
NAMES = {
    "tok_embeddings.weight": "embedding.word_embeddings.weight",
    "layers.{i}.attn_norm.weight": "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
    "layers.{i}.qkv.weight": "decoder.layers.{i}.self_attention.linear_qkv.weight",
    "layers.{i}.o_proj.weight": "decoder.layers.{i}.self_attention.linear_proj.weight",
    "layers.{i}.ffn_norm.weight": "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
    "layers.{i}.gate_up.weight": "decoder.layers.{i}.mlp.linear_fc1.weight",  # [gate_r | up_r]
    "layers.{i}.down.weight": "decoder.layers.{i}.mlp.linear_fc2.weight",
    "norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def _reads(config: ModelConfig, degree: int) -> ForwardLayout:
    # The forward de-interleaves linear_qkv on each rank (get_query_key_value_tensors) and
    # reads the vocab tables with their padding: the harness forward of the padded config.
    forward = config.replace(vocab_multiple=MAKE_VOCAB_SIZE_DIVISIBLE_BY * degree)
    return ForwardLayout(forward, layout_for(forward))


def _build(config: ModelConfig, t: int) -> Pieces:
    qkv0 = "decoder.layers.0.self_attention.linear_qkv.weight"
    need_unpadded(NAME, "embedding.word_embeddings.weight", config, t)
    need(config.n_heads % t == 0, NAME, qkv0, t, "n_heads % t == 0", f"n_heads={config.n_heads}")
    # The rule before commit f7dfb99795 (Dec 2025, "Support TP greater than num_kv_heads"):
    # num_query_groups % t == 0. Newer Megatron-Core also accepts t % n_kv_heads == 0 by
    # keeping raw 1/t row slices of the interleaved tensor and all-gathering qkv activations
    # in the forward; a rank's raw slice then holds no whole head (e.g. [q3 k0 v0]), so its
    # local tensor is not what any rank's attention reads. Rejected, naming the rule.
    need(config.n_kv_heads % t == 0, NAME, qkv0, t,
         "n_kv_heads % t == 0 (TP > num_query_groups is rejected, as by Megatron-Core before "
         "f7dfb99795)", f"n_kv_heads={config.n_kv_heads}")
    need(config.ffn % t == 0, NAME, "decoder.layers.0.mlp.linear_fc1.weight", t,
         "ffn % t == 0", f"ffn={config.ffn}")
    need(not config.has_o_bias, NAME, "decoder.layers.0.self_attention.linear_proj.bias", t,
         "no o_proj bias (a linear_proj bias comes only with add_bias_linear, which also "
         "biases linear_fc1, absent from the harness block)",
         f"o_bias={config.o_bias}, bias={config.bias}")
    need(not config.has_down_bias, NAME, "decoder.layers.0.mlp.linear_fc2.bias", t,
         "no down bias (a linear_fc2 bias comes only with add_bias_linear, which also biases "
         "linear_fc1, absent from the harness block)", f"bias={config.bias}")
    order = grouped_qkv_order(config.n_heads, config.n_kv_heads, config.head_dim)
    grouped = [(NAMES["layers.{i}.qkv.weight"], lambda r: chunk(order, t, r))]
    # contiguous row chunk r of the grouped tensor: whole groups (n_kv_heads % t == 0)
    return renamed(config, t, _reads(config, t).layout, NAMES, {
        "layers.{i}.qkv.weight": grouped,
        "layers.{i}.qkv.bias": [("decoder.layers.{i}.self_attention.linear_qkv.bias",
                                 lambda r: chunk(order, t, r))]})


MEGATRON = Convention(NAME, "Megatron-Core GPT, TE spec: linear_qkv interleaved per KV group, "
                      "linear_fc1 [gate_r | up_r], vocab padded to 128 t", _build, _reads)

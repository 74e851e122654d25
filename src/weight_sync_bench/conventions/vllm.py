"""``vllm``: vLLM's Llama (``LlamaForCausalLM``) as its parameters stand after weight loading.

Followed (research notes conventions.md section 2):

- names and modules: ``vllm/model_executor/models/llama.py`` (``LlamaAttention``: ``qkv_proj``
  a ``QKVParallelLinear``, ``o_proj`` a ``RowParallelLinear``; ``LlamaMLP``: ``gate_up_proj``
  a ``MergedColumnParallelLinear``, ``down_proj`` a ``RowParallelLinear``);
- local ``qkv_proj`` ``[q_local | k_local | v_local]`` and KV-head replication:
  ``vllm/model_executor/layers/linear.py::QKVParallelLinear.__init__`` (``num_kv_heads = 1``,
  ``num_kv_head_replicas = t / n_kv`` when ``t >= n_kv``) and ``weight_loader``
  (``shard_rank = tp_rank // num_kv_head_replicas`` for k and v): rank r holds KV head
  ``r * n_kv // t`` (the ``HeadReplicated`` placement); the bias is loaded alike;
- local ``gate_up_proj`` ``[gate_r | up_r]``: ``MergedColumnParallelLinear.weight_loader``;
- ``o_proj``/``down_proj`` column chunk r, bias full on every rank (``RowParallelLinear``:
  ``bias_ = None if tp_rank > 0``, so only rank 0 adds it; the harness forward adds the one
  replicated bias once, after the all-reduce: the same sum, one rounding order apart);
- vocabulary: ``vocab_parallel_embedding.py::pad_vocab_size`` pads to a multiple of
  ``DEFAULT_VOCAB_PADDING_SIZE = 64`` (independent of t), then ``divide(padded, t)`` asserts
  an even split; rows past the vocabulary are zero-filled by ``weight_loader``;
- tied: ``lm_head`` ties to ``model.embed_tokens`` and ``load_weights`` skips
  ``lm_head.weight``: only ``model.embed_tokens.weight`` is stored.

Biases: ``LlamaAttention`` biases ``qkv_proj`` and ``o_proj`` (``attention_bias``), Qwen2
``qkv_proj`` only; ``LlamaMLP``'s ``mlp_bias`` biases gate_up and down together, so a down
bias without a gate_up bias (the harness's ``bias=True``) is rejected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.conventions.convention import (
    Convention,
    ForwardLayout,
    need,
    need_unpadded,
    relaid,
    renamed,
)
from weight_sync_bench.conventions.maps import Pieces
from weight_sync_bench.layout.placements import HeadReplicated
from weight_sync_bench.model.plan import layout_for

if TYPE_CHECKING:
    from weight_sync_bench.model.config import ModelConfig

NAME = "vllm"
DEFAULT_VOCAB_PADDING_SIZE = 64  # vocab_parallel_embedding.py


def padded_vocab(vocab: int) -> int:
    """``pad_vocab_size(vocab, 64)``: the vocabulary rounded up to a multiple of 64."""
    return -(-vocab // DEFAULT_VOCAB_PADDING_SIZE) * DEFAULT_VOCAB_PADDING_SIZE


# canonical name -> vLLM's (layer i as {i}); every tensor is cut as the forward reads it.
NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "layers.{i}.qkv.bias": "model.layers.{i}.self_attn.qkv_proj.bias",
    "layers.{i}.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.o_proj.bias": "model.layers.{i}.self_attn.o_proj.bias",  # full on every rank
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.gate_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
    "layers.{i}.down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _reads(config: ModelConfig, degree: int) -> ForwardLayout:
    forward = config.replace(vocab_multiple=DEFAULT_VOCAB_PADDING_SIZE)
    layout = layout_for(forward)
    if degree > config.n_kv_heads:
        replicated = HeadReplicated(config.n_heads, config.n_kv_heads, config.head_dim)
        layout = relaid(layout, {f"layers.{i}.qkv.{kind}": replicated
                                 for i in range(config.n_layers) for kind in ("weight", "bias")})
    return ForwardLayout(forward, layout)


def _build(config: ModelConfig, t: int) -> Pieces:
    qkv0 = "model.layers.0.self_attn.qkv_proj.weight"
    need_unpadded(NAME, "model.embed_tokens.weight", config, t)
    need(config.n_heads % t == 0, NAME, qkv0, t, "n_heads % t == 0", f"n_heads={config.n_heads}")
    if t > config.n_kv_heads:
        need(t % config.n_kv_heads == 0, NAME, qkv0, t,
             "t % n_kv_heads == 0 when t > n_kv_heads", f"n_kv_heads={config.n_kv_heads}")
    else:
        need(config.n_kv_heads % t == 0, NAME, qkv0, t,
             "n_kv_heads % t == 0 when t <= n_kv_heads", f"n_kv_heads={config.n_kv_heads}")
    need(config.ffn % t == 0, NAME, "model.layers.0.mlp.gate_up_proj.weight", t,
         "ffn % t == 0", f"ffn={config.ffn}")
    vp = padded_vocab(config.vocab)
    need(vp % t == 0, NAME, "model.embed_tokens.weight", t,
         "padded vocab % t == 0 (the vocabulary padded to a multiple of 64)",
         f"vocab={config.vocab}, padded vocab={vp}")
    need(not config.has_down_bias, NAME, "model.layers.0.mlp.down_proj.bias", t,
         "no down bias without a gate_up bias (LlamaMLP's mlp_bias biases gate_up_proj and "
         "down_proj together)", f"bias={config.bias}")
    return renamed(config, t, _reads(config, t).layout, NAMES)


VLLM = Convention(NAME, "vLLM Llama after loading: qkv_proj [q_r | k_r | v_r] with KV heads "
                  "replicated past n_kv_heads ranks, gate_up_proj [gate_r | up_r], vocab "
                  "padded to 64", _build, _reads)

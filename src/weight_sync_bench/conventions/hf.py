"""``hf``: a Hugging Face transformers checkpoint of Llama, Mistral or Qwen2 (unsharded).

Followed (transformers 4.57.1; research notes conventions.md section 3):
``models/llama/modeling_llama.py`` (``LlamaAttention``: separate ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, biased by ``attention_bias``; ``LlamaMLP``: ``gate_proj``,
``up_proj``, ``down_proj``; RoPE ``rotate_half``, the canonical order),
``models/qwen2/modeling_qwen2.py::Qwen2Attention`` (q, k, v biases, none on o_proj),
``LlamaForCausalLM._tied_weights_keys = ["lm_head.weight"]`` with ``save_pretrained``
dropping the tied copy (no ``lm_head.weight`` when ``tie_word_embeddings``). No vocabulary
padding: the tables have ``vocab_size`` rows. A checkpoint is one model: degree 1 only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.conventions.convention import (
    Convention,
    ForwardLayout,
    need,
    need_unpadded,
    renamed,
)
from weight_sync_bench.conventions.maps import (
    Pieces,
    gate_rows,
    k_heads,
    q_heads,
    up_rows,
    v_heads,
)
from weight_sync_bench.model.plan import layout_for

if TYPE_CHECKING:
    from weight_sync_bench.model.config import ModelConfig

NAME = "hf"


# canonical name -> HF's (layer i as {i}); the fused qkv and gate_up are stored apart.
NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.o_proj.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _reads(config: ModelConfig, degree: int) -> ForwardLayout:
    return ForwardLayout(config, layout_for(config))


def _build(config: ModelConfig, t: int) -> Pieces:
    need(t == 1, NAME, "model.embed_tokens.weight", t,
         "t == 1 (a Hugging Face checkpoint is unsharded)", "")
    need_unpadded(NAME, "model.embed_tokens.weight", config, t)
    need(not config.has_down_bias, NAME, "model.layers.0.mlp.down_proj.bias", t,
         "no down bias without gate/up biases (LlamaMLP's mlp_bias biases all three)",
         f"bias={config.bias}")
    heads, kv = range(config.n_heads), range(config.n_kv_heads)
    qkv = {kind: [(f"model.layers.{{i}}.self_attn.q_proj.{kind}", lambda r: q_heads(config, heads)),
                  (f"model.layers.{{i}}.self_attn.k_proj.{kind}", lambda r: k_heads(config, kv)),
                  (f"model.layers.{{i}}.self_attn.v_proj.{kind}", lambda r: v_heads(config, kv))]
           for kind in ("weight", "bias")}
    return renamed(config, t, layout_for(config), NAMES, {
        "layers.{i}.qkv.weight": qkv["weight"], "layers.{i}.qkv.bias": qkv["bias"],
        "layers.{i}.gate_up.weight": [("model.layers.{i}.mlp.gate_proj.weight",
                                       lambda r: gate_rows(config)),
                                      ("model.layers.{i}.mlp.up_proj.weight",
                                       lambda r: up_rows(config))]})


HF = Convention(NAME, "Hugging Face Llama / Mistral / Qwen2, unsharded: separate q/k/v/o and "
                "gate/up/down, no vocab padding", _build, _reads)

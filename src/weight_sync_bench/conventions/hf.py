"""``hf``: a Hugging Face transformers checkpoint of Llama, Mistral or Qwen2 (unsharded).

Followed (transformers 4.57.1; research notes conventions.md section 3):
``models/llama/modeling_llama.py`` (``LlamaAttention``: separate ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, biased by ``attention_bias``; ``LlamaMLP``: ``gate_proj``,
``up_proj``, ``down_proj``; RoPE ``rotate_half``, the canonical order),
``models/qwen2/modeling_qwen2.py::Qwen2Attention`` (q, k, v biases, none on o_proj),
``LlamaForCausalLM._tied_weights_keys = ["lm_head.weight"]`` with ``save_pretrained``
dropping the tied copy (no ``lm_head.weight`` when ``tie_word_embeddings``). No vocabulary
padding: the tables have ``vocab_size`` rows. A checkpoint is one model: degree 1 only.

Mixture-of-Experts (transformers 4.57.6 ``modeling_qwen3_moe.py``, ``modeling_qwen2_moe.py``,
``modeling_mixtral.py``, ``modeling_deepseek_v3.py``; 5.24.0 for the fused variant): the router
``mlp.gate.weight`` ``[E, d]``, DeepSeek-V3's selection bias ``mlp.gate.e_score_correction_bias``
(a buffer); one module per expert (the default, ``experts=per_expert``, what Hub checkpoints
store and what v5 saves back, ``save_original_format``): ``mlp.experts.{e}.gate_proj.weight``,
``up_proj.weight`` ``[F, d]``, ``down_proj.weight`` ``[d, F]`` (Mixtral: ``block_sparse_moe.gate``
and ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down)); transformers v5's
fused experts (``experts=fused``: ``Qwen3MoeExperts`` and its siblings,
``conversion_mapping.py``'s ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``):
``mlp.experts.gate_up_proj`` ``[E, 2F, d]`` (gate first) and ``mlp.experts.down_proj``
``[E, d, F]``, no ``.weight`` suffix, Mixtral's block renamed ``mlp``. Qwen2-MoE's shared expert
``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``
``[1, d]``; DeepSeek's ``mlp.shared_experts.*`` (no gate); Qwen3's ``self_attn.q_norm.weight``
/ ``k_norm.weight`` ``[head_dim]``. ``MixtralAttention`` has no biases: a Mixtral with
attention biases is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.conventions.convention import (
    Convention,
    ForwardLayout,
    need,
    need_unbiased_mixtral,
    need_unpadded,
    renamed,
)
from weight_sync_bench.conventions.maps import (
    Pieces,
    expert_cols,
    expert_rows,
    gate_rows,
    k_heads,
    q_heads,
    rows,
    up_rows,
    v_heads,
)
from weight_sync_bench.model.plan import layout_for

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
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
    "layers.{i}.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# fp8=block128: an HF FP8 checkpoint's tensors (q_proj.weight e4m3fn beside its
# weight_scale_inv; DeepSeek-V3 README_WEIGHTS.md); fp8=tensor: beside its weight_scale [1]
# (slime quantizer_fp8.py::_quantize_param); conventions.fp8
OPTIONS = {"experts": ("per_expert", "fused"), "fp8": ("none", "block128", "tensor")}


def _reads(config: ModelConfig, at: Endpoint) -> ForwardLayout:
    return ForwardLayout(config, layout_for(config))


def _moe(config: ModelConfig, fused: bool) -> tuple[dict[str, str], dict]:
    """An MoE layer's names and cuts: per expert (v4) or fused (v5)."""
    block = "block_sparse_moe" if config.moe_style == "mixtral" and not fused else "mlp"
    shared = "shared_expert" if config.shared_gate else "shared_experts"
    names = {"layers.{i}.router.weight": f"model.layers.{{i}}.{block}.gate.weight",
             "layers.{i}.router.bias": f"model.layers.{{i}}.{block}.gate.e_score_correction_bias",
             "layers.{i}.shared.down.weight": f"model.layers.{{i}}.mlp.{shared}.down_proj.weight",
             "layers.{i}.shared_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight"}
    fs, e = config.shared_ffn, config.n_experts
    cuts: dict = {"layers.{i}.shared.gate_up.weight": [
        (f"model.layers.{{i}}.mlp.{shared}.gate_proj.weight", lambda r: rows(0, fs)),
        (f"model.layers.{{i}}.mlp.{shared}.up_proj.weight", lambda r: rows(fs, 2 * fs))]}
    if fused:
        cuts["layers.{i}.experts.gate_up.weight"] = [(
            "model.layers.{i}.mlp.experts.gate_up_proj",
            lambda r: (0, expert_rows(config, range(e)), e, True))]
        cuts["layers.{i}.experts.down.weight"] = [(
            "model.layers.{i}.mlp.experts.down_proj",
            lambda r: (1, expert_cols(config, range(e)), e, True))]
        return names, cuts
    w = {"gate": "w1", "up": "w3", "down": "w2"} if config.moe_style == "mixtral" else {
        "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    expert = f"model.layers.{{{{i}}}}.{block}.experts.{{e}}.{{w}}.weight"
    cuts["layers.{i}.experts.gate_up.weight"] = [
        (expert.format(e=x, w=w[half]), lambda r, x=x, half=half: expert_rows(config, [x],
                                                                              halves=(half,)))
        for x in range(e) for half in ("gate", "up")]
    cuts["layers.{i}.experts.down.weight"] = [
        (expert.format(e=x, w=w["down"]), lambda r, x=x: (1, expert_cols(config, [x])))
        for x in range(e)]
    return names, cuts


def _build(config: ModelConfig, at: Endpoint) -> Pieces:
    t = at.degree
    need(t == 1, NAME, "model.embed_tokens.weight", t,
         "t == 1 (a Hugging Face checkpoint is unsharded)", "")
    need_unpadded(NAME, "model.embed_tokens.weight", config, t)
    need(not config.has_down_bias, NAME, "model.layers.0.mlp.down_proj.bias", t,
         "no down bias without gate/up biases (LlamaMLP's mlp_bias biases all three)",
         f"bias={config.bias}")
    need_unbiased_mixtral(NAME, "model.layers.0.self_attn.q_proj.bias", config, t)
    need(at.ep == 1 and not at.etp, NAME, "model.layers.0.mlp.experts", t,
         "ep == 1 (a Hugging Face checkpoint holds every expert)", f"ep={at.ep}, etp={at.etp}")
    moe_names, moe_cuts = _moe(config, at.option("experts") == "fused") if config.n_experts else (
        {}, {})
    heads, kv = range(config.n_heads), range(config.n_kv_heads)
    qkv = {kind: [(f"model.layers.{{i}}.self_attn.q_proj.{kind}", lambda r: q_heads(config, heads)),
                  (f"model.layers.{{i}}.self_attn.k_proj.{kind}", lambda r: k_heads(config, kv)),
                  (f"model.layers.{{i}}.self_attn.v_proj.{kind}", lambda r: v_heads(config, kv))]
           for kind in ("weight", "bias")}
    return renamed(config, t, layout_for(config), {**NAMES, **moe_names}, {
        **moe_cuts,
        "layers.{i}.qkv.weight": qkv["weight"], "layers.{i}.qkv.bias": qkv["bias"],
        "layers.{i}.gate_up.weight": [("model.layers.{i}.mlp.gate_proj.weight",
                                       lambda r: gate_rows(config)),
                                      ("model.layers.{i}.mlp.up_proj.weight",
                                       lambda r: up_rows(config))]})


HF = Convention(NAME, "Hugging Face Llama / Mistral / Qwen2 / Qwen-MoE / Mixtral, unsharded: "
                "separate q/k/v/o and gate/up/down, experts one module each (or v5's fused "
                "gate_up_proj / down_proj), no vocab padding", _build, _reads, OPTIONS)

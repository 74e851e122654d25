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

Mixture-of-Experts (vLLM 0.33.0: ``models/qwen3_moe.py``, ``qwen2_moe.py``, ``mixtral.py``,
``deepseek_v2.py``; ``layers/fused_moe/``):

- experts (``routed_experts.py::RoutedExperts``, under ``mlp.experts.routed_experts.`` since
  vLLM PR #41184; ``mlp.experts.`` before): ``w13_weight`` ``[E_local, 2F/t', d]``, each
  expert's ``[gate_r | up_r]`` (``_load_w13``: w1 narrowed at the MoE TP rank into the first
  half, w3 into the second), ``w2_weight`` ``[E_local, d, F/t']`` (``_load_w2``: narrowed
  on dim 1); an expert not on the rank is skipped silently;
- EP (``FusedMoEParallelConfig.make``): without it the experts are split over every rank
  (``t' = tp``, ``ep = 1``); with it (``enable_expert_parallel``) ``ep = tp`` (times dp) and
  the experts' TP is 1: ``vllm:tp=4,ep=4`` only. Which experts an EP rank holds:
  ``expert_map_manager.py::determine_expert_map``, ``placement=linear`` (the default; the
  remainder of ``E % ep`` to the FIRST ranks, though its docstring says the last) or
  ``placement=round_robin`` (used by vLLM only with grouped top-k, ``n_group > 1``: it falls
  back to linear otherwise, so the harness refuses it there);
- ``kernel=flashinfer_cutlass``: the layout the engine holds after
  ``process_weights_after_loading`` on FlashInfer CUTLASS
  (``oracle/unquantized.py::convert_to_unquantized_kernel_format``: ``swap_w13_to_w31``), each
  expert's halves ``[w3; w1]`` (up, then gate): what vLLM #42821's second ``load_weights``
  wrote ``[w1; w3]`` into;
- the router ``mlp.gate.weight`` (``GateLinear``, a ``ReplicatedLinear``) and DeepSeek's
  ``mlp.gate.e_score_correction_bias``; Qwen2-MoE's shared expert
  ``mlp.shared_expert.{gate_up_proj,down_proj}`` (split like the dense MLP) and its gate
  ``mlp.shared_expert_gate.weight``, DeepSeek's ``mlp.shared_experts.*`` (no gate); Mixtral
  keeps HF's ``block_sparse_moe`` for the router and experts; Qwen3's
  ``self_attn.q_norm.weight`` / ``k_norm.weight``; Qwen3-MoE refuses ``tp > num_experts``.

Biases: ``LlamaAttention`` biases ``qkv_proj`` and ``o_proj`` (``attention_bias``), Qwen2
``qkv_proj`` only; ``LlamaMLP``'s ``mlp_bias`` biases gate_up and down together, so a down
bias without a gate_up bias (the harness's ``bias=True``) is rejected. Qwen3's and
Qwen3-MoE's ``o_proj`` has no bias (HF's has one with ``attention_bias``), Mixtral's attention
none: both rejected. Not rejected, though vLLM has no class for it: a Qwen-style MoE without
q/k norms and without q/k/v biases (``Qwen2MoeAttention`` biases ``qkv_proj`` always).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.conventions.convention import (
    Convention,
    ForwardLayout,
    need,
    need_unbiased_mixtral,
    need_unpadded,
    relaid,
    renamed,
)
from weight_sync_bench.conventions.maps import Pieces, expert_cols, expert_rows
from weight_sync_bench.layout.placements import Experts, HeadReplicated
from weight_sync_bench.model.plan import experts_placement, layout_for

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
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
    "layers.{i}.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# fp8=block128: the linear weights block-FP8 with their weight_scale_inv; fp8=tensor: with
# one weight_scale per part (conventions.fp8)
OPTIONS = {"placement": ("linear", "round_robin"), "kernel": ("none", "flashinfer_cutlass"),
           "fp8": ("none", "block128", "tensor")}


def moe_names(config: ModelConfig) -> dict[str, str]:
    """An MoE layer's names after loading: the block is ``mlp`` (Mixtral's
    ``block_sparse_moe``), the shared expert Qwen2-MoE's ``shared_expert`` with its gate or
    DeepSeek's ``shared_experts``."""
    block = "block_sparse_moe" if config.moe_style == "mixtral" else "mlp"
    shared = "shared_expert" if config.shared_gate else "shared_experts"
    return {
        "layers.{i}.router.weight": f"model.layers.{{i}}.{block}.gate.weight",
        "layers.{i}.router.bias": f"model.layers.{{i}}.{block}.gate.e_score_correction_bias",
        "layers.{i}.shared.gate_up.weight": f"model.layers.{{i}}.mlp.{shared}.gate_up_proj.weight",
        "layers.{i}.shared.down.weight": f"model.layers.{{i}}.mlp.{shared}.down_proj.weight",
        "layers.{i}.shared_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
        "experts": f"model.layers.{{i}}.{block}.experts.routed_experts",
    }


def _experts(config: ModelConfig, at: Endpoint, *, down: bool = False) -> Experts:
    if at.ep > 1:  # EP: whole experts, the experts' TP 1
        return experts_placement(config, down=down, ep=at.ep, etp=1, order=at.option("placement"))
    return experts_placement(config, down=down)


def _reads(config: ModelConfig, at: Endpoint) -> ForwardLayout:
    degree = at.degree
    forward = config.replace(vocab_multiple=DEFAULT_VOCAB_PADDING_SIZE)
    layout = layout_for(forward)
    if degree > config.n_kv_heads:
        replicated = HeadReplicated(config.n_heads, config.n_kv_heads, config.head_dim)
        layout = relaid(layout, {f"layers.{i}.qkv.{kind}": replicated
                                 for i in range(config.n_layers) for kind in ("weight", "bias")})
    if config.n_experts:
        layout = relaid(layout, {s.name: _experts(config, at, down=s.name.endswith("down.weight"))
                                 for s in layout if isinstance(s.placement, Experts)})
    return ForwardLayout(forward, layout)


def _expert_cuts(config: ModelConfig, at: Endpoint) -> dict:
    """Each rank's ``w13_weight`` (its experts' ``[gate_r | up_r]`` rows, or FlashInfer's
    ``[up_r | gate_r]``, stacked per expert) and ``w2_weight`` (their columns, stacked)."""
    t, e, f = at.degree, config.n_experts, config.expert_ffn
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    need(t <= e, NAME, w13, t, "t <= n_experts (Qwen3MoeSparseMoeBlock refuses tp_size > "
         "num_experts)", f"n_experts={e}")
    need(at.ep in (1, t), NAME, w13, t, "ep == 1 or ep == t (FusedMoEParallelConfig: expert "
         "parallelism spans the whole TP x DP group)", f"ep={at.ep}")
    need(not at.etp or at.etp == (1 if at.ep > 1 else t), NAME, w13, t,
         "no expert-TP degree of its own (the experts' TP is t without EP, 1 with it)",
         f"etp={at.etp}, ep={at.ep}")
    need(at.ep > 1 or f % t == 0, NAME, w13, t,
         "expert_ffn % t == 0 (intermediate_size_per_partition)", f"expert_ffn={f}")
    need(config.shared_ffn % t == 0, NAME, "model.layers.0.mlp.shared_expert.gate_up_proj.weight",
         t, "shared_ffn % t == 0", f"shared_ffn={config.shared_ffn}")
    need(at.option("placement") == "linear" or (at.ep > 1 and config.n_groups > 1), NAME, w13, t,
         "placement=round_robin only with expert parallelism and grouped top-k (n_groups > 1): "
         "determine_expert_placement_strategy falls back to linear otherwise",
         f"ep={at.ep}, n_groups={config.n_groups}")
    placement = _experts(config, at)
    etp = placement.expert_tp(t)
    halves = ("up", "gate") if at.option("kernel") == "flashinfer_cutlass" else ("gate", "up")
    prefix = moe_names(config)["experts"]

    def w13_of(r: int) -> tuple:
        etp_rank, ep_rank, _ = placement.coordinates(t, r)
        mine = placement.experts_of(ep_rank)
        return 0, expert_rows(config, mine, etp=etp, etp_rank=etp_rank, halves=halves), len(mine), True

    def w2_of(r: int) -> tuple:
        etp_rank, ep_rank, _ = placement.coordinates(t, r)
        mine = placement.experts_of(ep_rank)
        return 1, expert_cols(config, mine, etp=etp, etp_rank=etp_rank), len(mine), True

    return {"layers.{i}.experts.gate_up.weight": [(prefix + ".w13_weight", w13_of)],
            "layers.{i}.experts.down.weight": [(prefix + ".w2_weight", w2_of)]}


def _build(config: ModelConfig, at: Endpoint) -> Pieces:
    t = at.degree
    qkv0 = "model.layers.0.self_attn.qkv_proj.weight"
    need_unpadded(NAME, "model.embed_tokens.weight", config, t)
    need(config.n_heads % t == 0, NAME, qkv0, t, "n_heads % t == 0", f"n_heads={config.n_heads}")
    if t > config.n_kv_heads:
        need(t % config.n_kv_heads == 0, NAME, qkv0, t,
             "t % n_kv_heads == 0 when t > n_kv_heads", f"n_kv_heads={config.n_kv_heads}")
    else:
        need(config.n_kv_heads % t == 0, NAME, qkv0, t,
             "n_kv_heads % t == 0 when t <= n_kv_heads", f"n_kv_heads={config.n_kv_heads}")
    need(not config.has_dense_mlp or config.ffn % t == 0, NAME,
         "model.layers.0.mlp.gate_up_proj.weight", t, "ffn % t == 0", f"ffn={config.ffn}")
    vp = padded_vocab(config.vocab)
    need(vp % t == 0, NAME, "model.embed_tokens.weight", t,
         "padded vocab % t == 0 (the vocabulary padded to a multiple of 64)",
         f"vocab={config.vocab}, padded vocab={vp}")
    need(not config.has_down_bias, NAME, "model.layers.0.mlp.down_proj.bias", t,
         "no down bias without a gate_up bias (LlamaMLP's mlp_bias biases gate_up_proj and "
         "down_proj together)", f"bias={config.bias}")
    # Qwen3Attention and Qwen3MoeAttention (the q/k norms) build o_proj with bias=False, where
    # HF's biases it by attention_bias (vLLM models/qwen3.py @ 002456df, qwen3_moe.py @
    # 2e0831b0)
    need(not (config.qk_norm and config.has_o_bias), NAME, "model.layers.0.self_attn.o_proj.bias",
         t, "no o_proj bias beside q/k norms (Qwen3Attention's o_proj has bias=False)",
         f"o_bias={config.o_bias}, bias={config.bias}")
    need_unbiased_mixtral(NAME, "model.layers.0.self_attn.qkv_proj.bias", config, t)
    if not config.n_experts:
        return renamed(config, t, _reads(config, at).layout, NAMES)
    names = {**NAMES, **{k: v for k, v in moe_names(config).items() if k != "experts"}}
    return renamed(config, t, _reads(config, at).layout, names, _expert_cuts(config, at))


VLLM = Convention(NAME, "vLLM after loading: qkv_proj [q_r | k_r | v_r] with KV heads "
                  "replicated past n_kv_heads ranks, gate_up_proj [gate_r | up_r], vocab "
                  "padded to 64; experts w13 [E_local, 2F/t, d] [w1; w3], w2 [E_local, d, F/t]",
                  _build, _reads, OPTIONS)

"""``megatron``: Megatron-Core's GPT model with the Transformer Engine layer spec; its pipeline
stages (``megatron:tp=2,pp=2,vpp=2``) are ``stages``'s.

Followed (NVIDIA/Megatron-LM @ d98e8a64; research notes conventions.md section 1):

- names: ``megatron/core/models/gpt/gpt_layer_specs.py::get_gpt_layer_with_transformer_engine_submodules``
  (the input norm fused into ``linear_qkv`` as ``layer_norm_weight``, the pre-MLP norm into
  ``linear_fc1``), as Megatron-Bridge ``models/llama/llama_bridge.py::mapping_registry`` maps them;
- ``linear_qkv`` rows interleaved per KV group, ``[q heads of group g, k_g, v_g]`` for each g:
  ``megatron/core/transformer/attention.py::SelfAttention.get_query_key_value_tensors`` (the
  view ``(sq, b, ng, (np/ng + 2) * hn)`` then split ``[np/ng * hn, hn, hn]``), and Bridge
  ``param_mapping.py::merge_qkv_weights`` / ``merge_qkv_biases``;
- TP greater than the KV heads (``t % n_kv_heads == 0``, Megatron-LM PR #2565): raw row
  chunks of the grouped ``linear_qkv``, the forward gathering ``mixed_qkv`` (see ``_build``);
- TP: ``tensor_parallel/layers.py::ColumnParallelLinear`` keeps contiguous row chunk r
  (``linear_qkv``, ``linear_fc1``, ``output_layer``), ``RowParallelLinear`` column chunk r
  (``linear_proj``, ``linear_fc2``), ``VocabParallelEmbedding`` vocab rows
  ``[r*Vp/t, (r+1)*Vp/t)``;
- ``linear_fc1`` local ``[gate_r | up_r]``: ``megatron/core/transformer/mlp.py::MLP.forward``
  (``glu``: ``torch.chunk(x, 2, dim=-1)``) and ``apply_swiglu_sharded_factory``; Bridge
  ``GatedMLPMapping.hf_to_megatron``;
- vocabulary padded to a multiple of ``make_vocab_size_divisible_by * t`` (default 128),
  zero rows at the end: ``megatron/training/vocab_utils.py::calculate_padded_vocab_size``;
  option ``vocab=unpadded``: the Hugging Face vocabulary as it is, as verl and mbridge build
  the model (``GPTModel(vocab_size=hf_config.vocab_size)``, never through
  ``calculate_padded_vocab_size``), where ``VocabParallelEmbedding`` needs ``vocab % t == 0``
  (``tensor_parallel/utils.py::VocabUtility.vocab_range_from_global_vocab_size``: ``divide``);
- tied: ``output_layer`` is built with ``skip_weight_param_allocation`` and reads
  ``embedding.word_embeddings.weight`` (``gpt_model.py``, ``language_module.py``): no
  ``output_layer.weight`` is stored.

Mixture-of-Experts (Megatron-LM d98e8a64, core 0.20.0; Megatron-Bridge 067f987d,
``models/qwen/qwen3_moe_bridge.py::Qwen3MoEBridge``):

- experts: ``transformer/moe/experts.py::TEGroupedMLP``, one parameter per local expert j,
  ``mlp.experts.linear_fc1.weight{j}`` ``[2F/etp, d]`` (``[gate_r | up_r]``, the dense fc1's
  ``glu`` chunk) and ``mlp.experts.linear_fc2.weight{j}`` ``[d, F/etp]`` (split on its input
  dim), j LOCAL: global expert ``ep_rank * E/ep + j`` (``moe_layer.py::BaseMoELayer``:
  ``local_expert_indices``, ``num_moe_experts % ep_size == 0`` asserted); option
  ``experts=sequential``: ``SequentialMLP``'s ``mlp.experts.local_experts.{j}.linear_fc1.weight``;
- expert-TP ``etp`` is its own group (``pg_collection.expt_tp``), defaulting to TP
  (``megatron/training/arguments.py``: ``expert_tensor_parallel_size = tensor_model_parallel_size``
  when unset); ranks follow ``parallel_state.initialize_model_parallel``'s generators (order
  "tp-cp-ep-dp-pp", TP fastest): a world of ``lcm(tp, ep * etp)`` ranks, rank g attention TP
  rank ``g % tp`` (its data-parallel replica ``g // tp``), expert-TP rank ``g % etp``, EP rank
  ``(g // etp) % ep``. ``megatron:tp=2,ep=4`` is 8 ranks (etp 2: ranks 2k, 2k+1 hold EP rank k);
  ``megatron:tp=2,ep=4,etp=1`` is ``lcm(2, 4) = 4`` (EP rank ``g % 4``, expert-DP 1);
- router ``mlp.router.weight`` ``[E, d]`` replicated, DeepSeek's selection bias
  ``mlp.router.expert_bias`` a persistent fp32 **buffer** (``router.py::TopKRouter``): not a
  parameter, still in the state dict, so it must be moved;
- the pre-MLP norm of an MoE layer is its own ``pre_mlp_layernorm.weight`` (the experts are
  not TE layer-norm linears); shared experts ``mlp.shared_experts.linear_fc1.weight`` /
  ``linear_fc2.weight`` split over the attention TP group (``moe/shared_experts.py``:
  ``SharedExpertMLP(MLP)``, ``tp_group=pg_collection.tp``), their Qwen2-MoE gate
  ``mlp.shared_experts.gate_weight`` ``[1, d]`` replicated;
- Qwen3's q/k norms ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` ``[head_dim]``.

Megatron scores a group by its top ``topk / group_topk`` experts (``group_limited_topk``)
where HF and vLLM sum the top two: equal for DeepSeek-V3 (8 / 4); the harness's forward is
one model of the routing math (``model.routing``), whichever framework stores it.

Biases: Megatron Llama/Qwen2 set ``add_bias_linear=False``. ``qkv_bias`` maps to
``add_qkv_bias`` (``linear_qkv.bias``, interleaved and split as the weight; Qwen2 bridge).
An o_proj or down bias (``o_bias``, ``bias``) would need ``add_bias_linear``, which biases
``linear_fc1`` too, and the harness block has no gate_up bias: rejected, not approximated.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.conventions.convention import (
    Convention,
    ForwardLayout,
    need,
    need_unpadded,
    relaid,
    renamed,
    replicated,
)
from weight_sync_bench.conventions.maps import Pieces, chunk, expert_cols, expert_rows, rows
from weight_sync_bench.conventions.staging import staged
from weight_sync_bench.layout.placements import Experts, HeadReplicated, index_runs
from weight_sync_bench.model.plan import experts_placement, layout_for

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
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


def qkv_stored_rows(config: ModelConfig, t: int, tp_rank: int) -> list[tuple[int, int]]:
    """The canonical ``[Q | K | V]`` rows TP rank ``tp_rank`` stores of ``linear_qkv`` at TP
    ``t``, as sorted ``(start, stop)`` runs: contiguous chunk ``tp_rank`` of the grouped
    order (whole groups at ``t <= n_kv_heads``, a raw slice beyond)."""
    return index_runs(sorted(chunk(grouped_qkv_order(config.n_heads, config.n_kv_heads,
                                                     config.head_dim), t, tp_rank).tolist()))


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
    "layers.{i}.q_norm.weight": "decoder.layers.{i}.self_attention.q_layernorm.weight",
    "layers.{i}.k_norm.weight": "decoder.layers.{i}.self_attention.k_layernorm.weight",
    "moe:layers.{i}.ffn_norm.weight": "decoder.layers.{i}.pre_mlp_layernorm.weight",
    "layers.{i}.router.weight": "decoder.layers.{i}.mlp.router.weight",
    "layers.{i}.router.bias": "decoder.layers.{i}.mlp.router.expert_bias",  # a buffer
    "layers.{i}.shared.gate_up.weight": "decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight",
    "layers.{i}.shared.down.weight": "decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight",
    "layers.{i}.shared_gate.weight": "decoder.layers.{i}.mlp.shared_experts.gate_weight",
}
# TEGroupedMLP (the default) or SequentialMLP; the vocabulary padded by Megatron's training
# arguments (the default) or not at all (verl, mbridge)
# the embedding and/or the loss counted as a layer of the pipeline split (stages.Pipeline)
OPTIONS = {"experts": ("grouped", "sequential"), "vocab": ("padded", "unpadded"),
           "pp_account": ("none", "embedding", "loss", "both")}


def expert_tp(at: Endpoint) -> int:
    """The expert-TP degree: ``etp``, else TP (``expert_tensor_parallel_size`` unset)."""
    return at.etp or at.degree


def vocab_multiple(at: Endpoint) -> int:
    """What the vocab-parallel tables' rows are padded to a multiple of at ``at``."""
    return MAKE_VOCAB_SIZE_DIVISIBLE_BY * at.degree if at.option("vocab") == "padded" else 1


def _world(at: Endpoint) -> int:
    """``lcm(tp, ep * etp)`` ranks per pipeline stage (``parallel_state``'s order puts the
    pipeline rank slowest), times ``pp``."""
    stage = math.lcm(at.degree, at.ep * expert_tp(at)) if at.ep > 1 or at.etp else at.degree
    return stage * at.pp


def _experts(config: ModelConfig, at: Endpoint, *, down: bool = False) -> Experts:
    return experts_placement(config, down=down, ep=at.ep, etp=expert_tp(at))


def _reads(config: ModelConfig, at: Endpoint) -> ForwardLayout:
    # The forward de-interleaves linear_qkv on each rank (get_query_key_value_tensors) and
    # reads the vocab tables with their padding: the harness forward of the padded config.
    degree = at.degree
    forward = config.replace(vocab_multiple=vocab_multiple(at))
    layout = layout_for(forward)
    if config.n_experts:
        layout = relaid(layout, {s.name: _experts(config, at, down=s.name.endswith("down.weight"))
                                 for s in layout if isinstance(s.placement, Experts)})
    gathered: frozenset[str] = frozenset()
    if degree > config.n_kv_heads:  # mixed_qkv all-gathered, then each rank's heads read
        qkv = [f"layers.{i}.qkv.{kind}" for i in range(config.n_layers)
               for kind in ("weight", "bias")]
        layout = relaid(layout, dict.fromkeys(qkv, HeadReplicated(
            config.n_heads, config.n_kv_heads, config.head_dim)))
        gathered = frozenset(qkv) & set(config.param_shapes())
    if _world(at) > degree:  # the dense layers on each data-parallel replica of the TP group
        layout = replicated(layout, degree)
    return ForwardLayout(forward, layout, tp=degree, gathered=gathered)


def _build(config: ModelConfig, at: Endpoint) -> Pieces:
    if at.staged:  # each stage's ranks hold their layers of the unstaged endpoint's tensors
        return staged(config, at).pieces
    t = at.degree
    qkv0 = "decoder.layers.0.self_attention.linear_qkv.weight"
    need_unpadded(NAME, "embedding.word_embeddings.weight", config, t)
    need(at.option("vocab") == "padded" or config.vocab % t == 0, NAME,
         "embedding.word_embeddings.weight", t, "vocab % t == 0 with vocab=unpadded "
         "(VocabParallelEmbedding divides the vocabulary evenly over TP)", f"vocab={config.vocab}")
    need(config.n_heads % t == 0, NAME, qkv0, t, "n_heads % t == 0", f"n_heads={config.n_heads}")
    # num_query_groups % t == 0, or, since commit f7dfb99795 (Megatron-LM PR #2565, Dec 2025,
    # "Support TP greater than num_kv_heads"), t % num_query_groups == 0: each rank keeps a raw
    # 1/t row slice of the interleaved tensor (ColumnParallelLinear: the rows divide by t),
    # which holds no whole group ([q3 k0 v0]...), and the forward all-gathers mixed_qkv over
    # TP and takes group rank // (t / ng), then its own t-th of that group's Q heads
    # (attention.py::get_query_key_value_tensors): vLLM's replicated-KV heads per rank.
    need(config.n_kv_heads % t == 0 or t % config.n_kv_heads == 0, NAME, qkv0, t,
         "n_kv_heads % t == 0, or t % n_kv_heads == 0 (TP > num_query_groups: Megatron-Core "
         "since f7dfb99795)", f"n_kv_heads={config.n_kv_heads}")
    need(config.qkv_rows % t == 0, NAME, qkv0, t, "the qkv rows divisible by t "
         "(ColumnParallelLinear)", f"rows={config.qkv_rows}")
    need(not config.has_dense_mlp or config.ffn % t == 0, NAME,
         "decoder.layers.0.mlp.linear_fc1.weight", t, "ffn % t == 0", f"ffn={config.ffn}")
    need(not config.has_o_bias, NAME, "decoder.layers.0.self_attention.linear_proj.bias", t,
         "no o_proj bias (a linear_proj bias comes only with add_bias_linear, which also "
         "biases linear_fc1, absent from the harness block)",
         f"o_bias={config.o_bias}, bias={config.bias}")
    need(not config.has_down_bias, NAME, "decoder.layers.0.mlp.linear_fc2.bias", t,
         "no down bias (a linear_fc2 bias comes only with add_bias_linear, which also biases "
         "linear_fc1, absent from the harness block)", f"bias={config.bias}")
    cuts = {}
    if config.n_experts:
        cuts = _expert_cuts(config, at)
    order = grouped_qkv_order(config.n_heads, config.n_kv_heads, config.head_dim)
    grouped = [(NAMES["layers.{i}.qkv.weight"], lambda r: chunk(order, t, r % t))]
    # contiguous row chunk r of the grouped tensor: whole groups (n_kv_heads % t == 0); rank r
    # of a world wider than TP holds TP rank r % t's (its data-parallel replica's)
    return renamed(config, _world(at), _reads(config, at).layout, NAMES, {
        "layers.{i}.qkv.weight": grouped,
        "layers.{i}.qkv.bias": [("decoder.layers.{i}.self_attention.linear_qkv.bias",
                                 lambda r: chunk(order, t, r % t))], **cuts})


def _expert_cuts(config: ModelConfig, at: Endpoint) -> dict:
    """Each rank's experts under their LOCAL index j (global ``ep_rank * E/ep + j``), fc1
    ``[gate_r | up_r]`` rows and fc2 columns of its expert-TP chunk."""
    t, etp, e = at.degree, expert_tp(at), config.n_experts
    need(e % at.ep == 0, NAME, "decoder.layers.0.mlp.experts.linear_fc1.weight0", t,
         "n_experts % ep == 0 (BaseMoELayer: num_moe_experts % ep_size)",
         f"n_experts={e}, ep={at.ep}")
    need(config.expert_ffn % etp == 0, NAME, "decoder.layers.0.mlp.experts.linear_fc1.weight0", t,
         "expert_ffn % etp == 0 (moe_ffn_hidden_size over the expert-TP group)",
         f"expert_ffn={config.expert_ffn}, etp={etp}")
    need(config.shared_ffn % t == 0, NAME, "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
         t, "shared_ffn % t == 0 (shared experts split over the attention TP group)",
         f"shared_ffn={config.shared_ffn}")
    placement = _experts(config, at)
    world = _world(at)

    def mine(rank: int) -> tuple[list[int], int]:
        etp_rank, ep_rank, _ = placement.coordinates(world, rank)
        return placement.experts_of(ep_rank), etp_rank

    def fc1(j: int):
        return lambda r: expert_rows(config, [mine(r)[0][j]], etp=etp, etp_rank=mine(r)[1])

    def fc2(j: int):
        return lambda r: (1, expert_cols(config, [mine(r)[0][j]], etp=etp, etp_rank=mine(r)[1]))

    local = e // at.ep
    if at.option("experts") == "sequential":
        fc1_name = "decoder.layers.{{i}}.mlp.experts.local_experts.{j}.linear_fc1.weight"
        fc2_name = "decoder.layers.{{i}}.mlp.experts.local_experts.{j}.linear_fc2.weight"
    else:
        fc1_name = "decoder.layers.{{i}}.mlp.experts.linear_fc1.weight{j}"
        fc2_name = "decoder.layers.{{i}}.mlp.experts.linear_fc2.weight{j}"
    return {"layers.{i}.experts.gate_up.weight": [(fc1_name.format(j=j), fc1(j))
                                                  for j in range(local)],
            "layers.{i}.experts.down.weight": [(fc2_name.format(j=j), fc2(j))
                                               for j in range(local)]}


MEGATRON = Convention(NAME, "Megatron-Core GPT, TE spec: linear_qkv interleaved per KV group, "
                      "linear_fc1 [gate_r | up_r], vocab padded to 128 t; experts TEGroupedMLP "
                      "weight{j} with local j; pipeline stages with local layer indices",
                      _build, _reads, OPTIONS, _world, stages=True)

"""Model geometry, and parameters and tokens made deterministically from a seed.

The toy model is a Llama-shaped decoder (RMSNorm, GQA attention with RoPE, SwiGLU, untied
embeddings, no biases) that exists only to hold one instance of every layout the harness
checks: a vocab-parallel embedding and lm_head, a fused per-head qkv, a fused paired
gate_up, two row-parallel projections and replicated norms.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.hf_file import read_hf_config


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of the toy model, plus the token shape the tolerance floor is measured on.

    The floor is a maximum over ``batch * seq_len * vocab`` logits, so the token shape is
    part of the geometry: changing it silently widens the floor (see ``tolerance``).
    """

    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    batch: int = 2
    seq_len: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Variants that expose training bugs; each defaults to off, so TOY and TOY_KV4 (and their
    # recorded geometry) are unchanged. See VARIANT_FIELDS.
    vocab_multiple: int = 1  # pad the vocab-parallel tables to a multiple of this
    tie_embeddings: bool = False  # lm_head reads tok_embeddings.weight
    bias: bool = False  # a qkv bias and row-parallel o_proj and down biases
    # The bias variant split by where it sits (``bias=True`` means all three): HF Qwen2 has
    # q/k/v biases only (``qkv_bias``), HF Llama ``attention_bias`` q/k/v and o_proj biases.
    qkv_bias: bool = False
    o_bias: bool = False
    # Qwen3's per-head RMSNorm of q and k before RoPE (``q_norm`` / ``k_norm``, one weight of
    # head_dim shared by every head), MoE or not.
    qk_norm: bool = False
    # Mixture-of-Experts (``n_experts`` > 0; every field below defaults to off, a dense model).
    # Layers ``dense_layers..n_layers-1`` replace the SwiGLU MLP by: a router ``[E, d]``,
    # ``top_k`` of ``n_experts`` SwiGLU experts of width ``expert_ffn`` chosen per token, and
    # optionally a shared expert of width ``shared_ffn`` that every token goes through (Qwen2-MoE
    # gates it by ``sigmoid(x @ shared_gate)``, DeepSeek does not). See ``model.routing``.
    n_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    router: str = "softmax"  # "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3)
    norm_topk: bool = False  # renormalise the chosen experts' weights to sum to one
    router_bias: bool = False  # a selection-only score bias (DeepSeek-V3 e_score_correction_bias)
    n_groups: int = 1  # group-limited routing: experts in n_groups groups, topk_groups chosen
    topk_groups: int = 1
    shared_ffn: int = 0
    shared_gate: bool = False
    dense_layers: int = 0  # first_k_dense_replace: the first layers keep the dense MLP
    # Which family's names the checkpoints use (names only, never the math): "qwen" (Qwen2-MoE,
    # Qwen3-MoE, DeepSeek: mlp.gate, mlp.experts.{e}.gate_proj) or "mixtral"
    # (block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 / w3 / w2).
    moe_style: str = "qwen"
    # What ``from_hf_config`` read and the block does not model, where ignoring it cannot
    # change a verdict (a sliding window longer than a check's tokens): said in every verdict.
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn", "batch", "seq_len", "vocab_multiple", "n_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfig(f"{self.name}: {name} must be a positive int, got {value!r}")
        for name in ("n_experts", "top_k", "expert_ffn", "shared_ffn", "dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidConfig(f"{self.name}: {name} must be a non-negative int, "
                                    f"got {value!r}")
        for name in ("tie_embeddings", "bias", "qkv_bias", "o_bias", "qk_norm", "norm_topk",
                     "router_bias", "shared_gate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfig(f"{self.name}: {name} must be a bool, "
                                    f"got {getattr(self, name)!r}")
        self._check_moe()
        if self.n_heads % self.n_kv_heads:
            raise InvalidConfig(
                f"{self.name}: GQA needs n_heads % n_kv_heads == 0 "
                f"(n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads})")
        if self.head_dim % 2:
            raise InvalidConfig(f"{self.name}: RoPE needs an even head_dim (head_dim={self.head_dim})")

    def _check_moe(self) -> None:
        """The MoE fields: all at their defaults for a dense model, else consistent."""
        if not self.n_experts:
            odd = [f"{f}={getattr(self, f)!r}" for f in MOE_FIELDS
                   if f != "n_experts" and getattr(self, f) != _MOE_DEFAULTS[f]]
            if odd:
                raise InvalidConfig(f"{self.name}: {', '.join(odd)} without experts "
                                    "(n_experts=0): MoE fields need n_experts >= 1")
            return
        e, k = self.n_experts, self.top_k
        rules = [
            (1 <= k <= e, f"1 <= top_k <= n_experts (top_k={k}, n_experts={e})"),
            (self.expert_ffn >= 1, f"expert_ffn >= 1 (expert_ffn={self.expert_ffn})"),
            (self.router in ROUTERS, f"router in {ROUTERS} (router={self.router!r})"),
            (self.moe_style in MOE_STYLES, f"moe_style in {MOE_STYLES} "
                                           f"(moe_style={self.moe_style!r})"),
            (not self.router_bias or self.router == "sigmoid",
             "router_bias only with router='sigmoid' (DeepSeek-V3's e_score_correction_bias)"),
            (e % self.n_groups == 0, f"n_experts % n_groups == 0 (n_experts={e}, "
                                     f"n_groups={self.n_groups})"),
            (self.topk_groups <= self.n_groups, f"topk_groups <= n_groups (topk_groups="
                                                f"{self.topk_groups}, n_groups={self.n_groups})"),
            (self.n_groups == 1 or e // self.n_groups >= 2,
             f"at least 2 experts per group (a group scores by its top 2: n_experts={e}, "
             f"n_groups={self.n_groups})"),
            (k <= self.topk_groups * (e // self.n_groups),
             f"top_k <= topk_groups * n_experts / n_groups (top_k={k}, topk_groups="
             f"{self.topk_groups}, n_experts={e}, n_groups={self.n_groups})"),
            (not self.shared_gate or self.shared_ffn >= 1,
             "shared_gate needs a shared expert (shared_ffn >= 1)"),
            (self.dense_layers <= self.n_layers, f"dense_layers <= n_layers (dense_layers="
                                                 f"{self.dense_layers}, n_layers={self.n_layers})"),
        ]
        for ok, rule in rules:
            if not ok:
                raise InvalidConfig(f"{self.name}: MoE needs {rule}")

    @property
    def moe(self) -> bool:
        """Whether any layer is a Mixture-of-Experts layer."""
        return self.n_experts > 0 and self.dense_layers < self.n_layers

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer keeps the dense SwiGLU MLP of width ``ffn``."""
        return not self.n_experts or self.dense_layers > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i >= self.dense_layers

    @property
    def q_rows(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_rows + 2 * self.kv_rows

    @property
    def has_qkv_bias(self) -> bool:
        """A bias on the fused qkv rows (``bias`` or ``qkv_bias``)."""
        return self.bias or self.qkv_bias

    @property
    def has_o_bias(self) -> bool:
        """A row-parallel o_proj bias (``bias`` or ``o_bias``)."""
        return self.bias or self.o_bias

    @property
    def has_down_bias(self) -> bool:
        """A row-parallel down bias (``bias`` only: the block has no gate_up bias)."""
        return self.bias

    @property
    def token_shape(self) -> tuple[int, int]:
        return (self.batch, self.seq_len)

    @property
    def padded_vocab(self) -> int:
        """Rows of the vocab-parallel tables: vocab rounded up to ``vocab_multiple``. Rows
        ``vocab..padded_vocab-1`` are padding, never a token and never a valid class."""
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    @property
    def layer_suffixes(self) -> tuple[str, ...]:
        """A dense layer's parameters (``layers.{i}.`` + each), in the order its forward reads
        them: each of ``ReferenceModel.step`` and ``ShardedModel.step`` consumes one. An MoE
        layer's are ``suffixes_of(i)``."""
        return self.suffixes_of(0) if not self.is_moe_layer(0) else self._suffixes(False)

    def suffixes_of(self, i: int) -> tuple[str, ...]:
        """Layer ``i``'s parameters, in the order its forward reads them."""
        return self._suffixes(self.is_moe_layer(i))

    def _suffixes(self, moe: bool) -> tuple[str, ...]:
        attention = ("attn_norm.weight", "qkv.weight",
                     *(("qkv.bias",) if self.has_qkv_bias else ()),
                     *(("q_norm.weight", "k_norm.weight") if self.qk_norm else ()),
                     "o_proj.weight", *(("o_proj.bias",) if self.has_o_bias else ()),
                     "ffn_norm.weight")
        if not moe:
            return (*attention, "gate_up.weight", "down.weight",
                    *(("down.bias",) if self.has_down_bias else ()))
        return (*attention, "router.weight", *(("router.bias",) if self.router_bias else ()),
                "experts.gate_up.weight", "experts.down.weight",
                *(("shared.gate_up.weight", "shared.down.weight") if self.shared_ffn else ()),
                *(("shared_gate.weight",) if self.shared_gate else ()))

    @property
    def head_params(self) -> tuple[str, ...]:
        """The parameters after the last layer, in the order the forward reads them: the final
        norm and, unless tied (the head then reads the embedding), ``lm_head.weight``."""
        return ("norm.weight",) if self.tie_embeddings else ("norm.weight", "lm_head.weight")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's full shape, in the order the forward consumes them."""
        d, e, f, fs = self.d_model, self.n_experts, self.expert_ffn, self.shared_ffn
        local = {"attn_norm.weight": (d,), "qkv.weight": (self.qkv_rows, d),
                 "qkv.bias": (self.qkv_rows,), "q_norm.weight": (self.head_dim,),
                 "k_norm.weight": (self.head_dim,), "o_proj.weight": (d, self.q_rows),
                 "o_proj.bias": (d,), "ffn_norm.weight": (d,), "gate_up.weight": (2 * self.ffn, d),
                 "down.weight": (d, self.ffn), "down.bias": (d,),
                 # The experts side by side: expert x's [gate_x | up_x] rows are rows
                 # [2Fx, 2F(x+1)) of experts.gate_up, its down columns [Fx, F(x+1)) of
                 # experts.down: one dense-like MLP over E*F features, each token using its own.
                 "router.weight": (e, d), "router.bias": (e,),
                 "experts.gate_up.weight": (e * 2 * f, d), "experts.down.weight": (d, e * f),
                 "shared.gate_up.weight": (2 * fs, d), "shared.down.weight": (d, fs),
                 "shared_gate.weight": (1, d)}
        head = {"norm.weight": (d,), "lm_head.weight": (self.padded_vocab, d)}
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.padded_vocab, d)}
        for i in range(self.n_layers):
            for suffix in self.suffixes_of(i):
                shapes[f"layers.{i}.{suffix}"] = local[suffix]
        for name in self.head_params:
            shapes[name] = head[name]
        return shapes

    @property
    def head_name(self) -> str:
        """The parameter the output projection reads (the embedding table when tied)."""
        return "tok_embeddings.weight" if self.tie_embeddings else "lm_head.weight"

    @property
    def n_params(self) -> int:
        total = 0
        for shape in self.param_shapes().values():
            n = 1
            for size in shape:
                n *= size
            total += n
        return total

    def geometry(self) -> dict[str, int]:
        """The fields the floor depends on, as recorded in tolerance artifacts.

        A variant field appears only where it differs from its default (bools as 0/1), so a
        config without variants records exactly the geometry it always did.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "name" and f.name not in VARIANT_FIELDS + MOE_FIELDS
               and isinstance(getattr(self, f.name), int)}
        for f in dataclasses.fields(self):
            if f.name in VARIANT_FIELDS and getattr(self, f.name) != f.default:
                out[f.name] = int(getattr(self, f.name))
        if self.n_experts:  # every MoE field, so a recorded MoE geometry reads on its own
            for name in MOE_FIELDS:
                value = getattr(self, name)
                out[name] = value if isinstance(value, str) else int(value)
        return out

    @classmethod
    def from_geometry(cls, geometry: Mapping[str, Any], name: str) -> ModelConfig:
        """The config a recorded ``geometry()`` names (the inverse: bools written as 0/1)."""
        fields = {k: bool(v) if k in BOOL_FIELDS else v for k, v in geometry.items()}
        return cls(name=name, **fields)

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, source: str | Path | Mapping[str, Any], *,
                       n_layers: int | None = None, vocab: int | None = None,
                       name: str | None = None) -> ModelConfig:
        """The geometry of a Hugging Face ``config.json`` (a path, or the parsed dict), in the
        harness's Llama-style block (RMSNorm, RoPE rotate-half, GQA, SwiGLU).

        Reads ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (default: the
        heads), ``head_dim`` (default ``hidden_size // num_attention_heads``, as
        ``LlamaAttention``), ``intermediate_size``, ``num_hidden_layers``, ``vocab_size``,
        ``rope_theta``, ``rms_norm_eps``, ``tie_word_embeddings``, ``attention_bias`` (HF
        Llama/Mistral: q, k, v *and* o_proj biases) and ``architectures`` (``Qwen2ForCausalLM``:
        q, k, v biases only, ``Qwen2Attention``). ``n_layers`` and ``vocab`` override the file
        (a reduced copy of a real geometry); ``name`` defaults to the file's stem.

        Every field read is checked first, and an ``InvalidConfig`` names the field and the
        value: missing (where there is no default), of the wrong type (a bool, a float such
        as 4.5 or a string where a size is read), a size outside ``1..MAX_HF_SIZE``, a float
        that is not finite and > 0, heads that do not group (``num_attention_heads %
        num_key_value_heads``), an odd ``head_dim``, more experts per token than experts.
        A path is read by ``model.hf_file.read_hf_config`` (a regular file of at most 16 MiB,
        UTF-8 JSON holding an object). What the block cannot model is rejected with
        ``InvalidConfig`` naming the field:
        ``mlp_bias`` (gate/up/down biases; the block has no gate_up bias), an activation other
        than SiLU, ``rope_scaling``. A sliding window is not modelled either; it changes
        nothing while ``seq_len`` stays below it (every window in the shipped configs does).
        """
        if isinstance(source, Mapping):
            data, label = dict(source), name or "hf"
        else:
            path = Path(source)
            data = read_hf_config(path)
            label = name or (path.absolute().parent.name if path.name == "config.json"
                             else path.stem)
        if not isinstance(data, dict):
            raise InvalidConfig(f"{label}: an HF config is a JSON object, got {type(data).__name__}")

        def field(key: str, kind: type | tuple[type, ...], default: object = _REQUIRED, *,
                  minimum: int = 1) -> Any:
            """``data[key]`` checked: of ``kind`` (a bool is no number), a size in
            ``minimum..MAX_HF_SIZE``, a float finite and > 0; ``default`` where absent."""
            value = data.get(key)
            if value is None:
                if default is _REQUIRED:
                    raise InvalidConfig(f"{label}: HF config has no {key!r}")
                return default
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise InvalidConfig(f"{label}: HF config field {key!r} is {value!r}, expected "
                                    f"{getattr(kind, '__name__', kind)}")
            if kind is int and not minimum <= value <= MAX_HF_SIZE:
                raise InvalidConfig(f"{label}: HF config field {key!r} is {value!r}, expected "
                                    f"an int in {minimum}..{MAX_HF_SIZE} (2^31-1)")
            if kind == (int, float) and not (math.isfinite(value) and value > 0):
                raise InvalidConfig(f"{label}: HF config field {key!r} is {value!r}, expected "
                                    "a finite number > 0")
            return value

        hidden = field("hidden_size", int)
        heads = field("num_attention_heads", int)
        if field("mlp_bias", bool, False):
            raise InvalidConfig(f"{label}: HF config field 'mlp_bias' is true: the harness block "
                                "has no gate_up bias, so gate/up/down biases are not modelled")
        act = field("hidden_act", str, "silu")
        if act != "silu":
            raise InvalidConfig(f"{label}: HF config field 'hidden_act' is {act!r}: the harness "
                                "block is SwiGLU (silu)")
        if data.get("rope_scaling") is not None:
            raise InvalidConfig(f"{label}: HF config field 'rope_scaling' is "
                                f"{data['rope_scaling']!r}: only plain RoPE is modelled")
        kv_heads = field("num_key_value_heads", int, heads)
        if heads % kv_heads:
            raise InvalidConfig(f"{label}: HF config fields 'num_attention_heads' and "
                                "'num_key_value_heads': GQA needs num_attention_heads % "
                                f"num_key_value_heads == 0 (num_attention_heads={heads}, "
                                f"num_key_value_heads={kv_heads})")
        head_dim = field("head_dim", int, None)
        if head_dim is None:
            if hidden % heads:
                raise InvalidConfig(f"{label}: HF config has no 'head_dim' and hidden_size % "
                                    f"num_attention_heads != 0 (hidden_size={hidden}, "
                                    f"num_attention_heads={heads})")
            head_dim = hidden // heads
        if head_dim % 2:
            raise InvalidConfig(f"{label}: HF config field 'head_dim' is {head_dim}"
                                f"{'' if 'head_dim' in data else ' (hidden_size / num_attention_heads)'}"
                                ": RoPE rotates pairs, so it must be even")
        layers, vocab_size = field("num_hidden_layers", int), field("vocab_size", int)
        model_type = field("model_type", str, "llama")
        if model_type not in HF_MODEL_TYPES:
            raise InvalidConfig(f"{label}: HF config field 'model_type' is {model_type!r}: the "
                                f"harness models {', '.join(HF_MODEL_TYPES)}")
        for key, what in UNMODELLED.items():
            if data.get(key) not in (None, False, 0):
                raise InvalidConfig(f"{label}: HF config field {key!r} is {data[key]!r}: {what} "
                                    "is not modelled")
        architectures = field("architectures", list, [])
        qwen2 = "Qwen2ForCausalLM" in architectures or model_type == "qwen2"
        attention_bias = field("attention_bias", bool, False)
        moe = _moe_fields(model_type, data, field, label)
        notes = []
        if attention_bias and model_type not in READS_ATTENTION_BIAS:
            # transformers 4.57.6: MistralAttention and MixtralAttention have no biases,
            # Qwen2Attention biases q/k/v always and Qwen2MoeAttention with ``qkv_bias``;
            # none of them reads attention_bias, and neither does the harness
            attention_bias = False
            notes.append(f"{label}: attention_bias true is not read: HF's {model_type} "
                         "attention does not read it")
        window = data.get("sliding_window")
        if window is not None and (data.get("use_sliding_window", True) is not False):
            notes.append(f"{label}: sliding_window {window} is not modelled; a check's tokens "
                         "lie within it, so attention is unchanged")
        return cls(
            name=label,
            vocab=vocab if vocab is not None else vocab_size,
            d_model=hidden,
            n_layers=n_layers if n_layers is not None else layers,
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn=field("intermediate_size", int),
            rope_theta=float(field("rope_theta", (int, float), 10000.0)),
            norm_eps=float(field("rms_norm_eps", (int, float), 1e-6)),
            tie_embeddings=field("tie_word_embeddings", bool, False),
            qkv_bias=qwen2 or attention_bias or (model_type == "qwen2_moe"
                                                 and field("qkv_bias", bool, True)),
            o_bias=attention_bias and not qwen2,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            notes=tuple(notes),
            **moe,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict of this geometry, the inverse of
        ``from_hf_config`` (``ModelConfig.from_hf_config(c.to_hf_config(), name=c.name) == c``
        for every config HF can describe): ``LlamaForCausalLM`` with ``attention_bias`` for
        q/k/v and o_proj biases, ``Qwen2ForCausalLM`` for q/k/v biases alone,
        ``Qwen3ForCausalLM`` for q/k norms (its ``attention_bias`` as Llama's), ``head_dim``
        always written (HF Llama reads it; ``hidden_size // num_attention_heads`` need not be
        it). What HF's Llama, Qwen2 and Qwen3 cannot say is an ``InvalidConfig`` naming the
        field: a down bias (``bias=True``; HF's ``mlp_bias`` biases gate and up too), an
        o_proj bias without q/k/v ones, q/k norms with q/k/v biases and no o_proj bias,
        ``vocab_multiple`` padding. The token shape (``batch``,
        ``seq_len``) is the check's, not the model's: it is not written."""
        if self.bias:
            raise InvalidConfig(f"{self.name}: bias=True (a down bias) has no HF config field: "
                                "HF's mlp_bias biases gate and up too")
        if self.o_bias and not self.qkv_bias:
            raise InvalidConfig(f"{self.name}: o_bias without qkv_bias has no HF config field "
                                "(attention_bias biases q, k, v and o_proj)")
        if self.vocab_multiple != 1:
            raise InvalidConfig(f"{self.name}: vocab_multiple={self.vocab_multiple} has no HF "
                                "config field (vocab_size is the unpadded vocabulary)")
        qwen2 = self.qkv_bias and not self.o_bias
        out = {"architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
               "model_type": "qwen2" if qwen2 else "llama",
               "hidden_size": self.d_model, "num_attention_heads": self.n_heads,
               "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
               "intermediate_size": self.ffn, "num_hidden_layers": self.n_layers,
               "vocab_size": self.vocab, "rope_theta": self.rope_theta,
               "rms_norm_eps": self.norm_eps, "tie_word_embeddings": self.tie_embeddings,
               "attention_bias": self.qkv_bias and self.o_bias, "hidden_act": "silu"}
        if self.qk_norm and self.qkv_bias and not self.o_bias:
            raise InvalidConfig(f"{self.name}: qk_norm with q/k/v biases and no o_proj bias has "
                                "no HF config (Qwen3's attention_bias biases q, k, v and o_proj)")
        if self.qk_norm and not self.n_experts:
            out.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        if self.n_experts:
            out.update(self._moe_hf_config())
        return out

    def _moe_hf_config(self) -> dict[str, Any]:
        """The MoE fields of ``to_hf_config``: Mixtral's, Qwen2-MoE's (q/k/v biases, a gated
        shared expert) or Qwen3-MoE's (q/k norms); what none of them says is an
        ``InvalidConfig`` naming it."""
        def refuse(what: str) -> InvalidConfig:
            return InvalidConfig(f"{self.name}: {what} has no HF config field of Mixtral, "
                                 "Qwen2-MoE or Qwen3-MoE")

        if self.router != "softmax" or self.router_bias or self.n_groups > 1:
            raise refuse(f"a {self.router} router with selection bias {self.router_bias} and "
                         f"{self.n_groups} groups (DeepSeek-V3's routing)")
        if self.shared_ffn and not self.shared_gate:
            raise refuse("an ungated shared expert (DeepSeek's)")
        common = {"num_experts_per_tok": self.top_k}
        if self.moe_style == "mixtral":
            if (self.qk_norm or self.qkv_bias or not self.norm_topk or self.shared_ffn
                    or self.dense_layers or self.expert_ffn != self.ffn):
                raise refuse("a Mixtral with q/k norms, biases, unnormalised top-k, a shared "
                             "expert, dense layers or an expert width other than intermediate_size")
            return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "num_local_experts": self.n_experts}
        # Qwen3-MoE has q/k norms, attention_bias (to_hf_config) and no shared expert;
        # Qwen2-MoE no q/k norms, q/k/v biases by qkv_bias and no o_proj bias
        qwen2 = not self.qk_norm
        if self.qk_norm and self.shared_ffn:
            raise refuse("a shared expert beside q/k norms (a Qwen3-MoE has no shared expert)")
        if qwen2 and self.o_bias:
            raise refuse("an o_proj bias without q/k norms (a Qwen2-MoE has none)")
        return {**common, "architectures": ["Qwen2MoeForCausalLM" if qwen2 else
                                            "Qwen3MoeForCausalLM"],
                "model_type": "qwen2_moe" if qwen2 else "qwen3_moe",
                "num_experts": self.n_experts, "moe_intermediate_size": self.expert_ffn,
                "norm_topk_prob": self.norm_topk, "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(self.dense_layers)),
                **({"shared_expert_intermediate_size": self.shared_ffn,
                    "qkv_bias": self.qkv_bias} if qwen2 else {})}


_REQUIRED = object()
# The largest size ``from_hf_config`` reads from a config.json (a width, a count of heads,
# layers, experts or tokens): 2^31-1, so that a weight's element count (two sizes
# multiplied) stays below 2^62 and no size is read that no real model approaches (the
# largest widths shipped are 152,064 rows of vocabulary). Whether a geometry within it fits
# this machine is ``model.footprint``'s to say.
MAX_HF_SIZE = 2**31 - 1

# The Hugging Face model types the harness's block is (``from_hf_config``): Llama's, with
# Qwen2's q/k/v biases, Qwen3's q/k norms, and the MoE blocks of Qwen2-MoE, Qwen3-MoE and
# Mixtral (transformers 4.57.6 modelling files). A config without a model_type reads as Llama.
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
# The model types whose HF attention reads ``attention_bias``, as q, k, v *and* o_proj biases
# (transformers 4.57.6: LlamaAttention, Qwen3Attention, Qwen3MoeAttention). The others'
# attention ignores it (``from_hf_config`` notes a true one).
READS_ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")
# The config.json field each size of a geometry is read from (``from_hf_config``): what a
# refusal names for a geometry the user gave as a config.json. Mixtral's experts are
# ``num_local_experts`` of ``intermediate_size``.
HF_NAMES = {"vocab": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "ffn": "intermediate_size", "n_experts": "num_experts",
            "expert_ffn": "moe_intermediate_size",
            "shared_ffn": "shared_expert_intermediate_size"}
# Fields that, set, change the model in a way the block does not implement.
UNMODELLED = {"kv_lora_rank": "DeepSeek's multi-head latent attention (MLA)",
              "q_lora_rank": "DeepSeek's multi-head latent attention (MLA)",
              "attention_sinks": "attention sinks", "sinks": "attention sinks",
              "layer_types": "per-layer attention types"}


def _moe_fields(model_type: str, data: Mapping[str, Any], field: Any, label: str
                ) -> dict[str, Any]:
    """The MoE fields of a ``qwen2_moe``, ``qwen3_moe`` or ``mixtral`` config (none for a dense
    one): transformers' ``Qwen3MoeSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` (softmax over
    every expert, top-k, renormalised with ``norm_topk_prob``; Qwen2-MoE's shared expert gated
    by a sigmoid) and ``MixtralSparseMoeBlock`` (always renormalised; the experts' width is
    ``intermediate_size``). The layers that are sparse: ``(i + 1) % decoder_sparse_step == 0``
    and ``i`` not in ``mlp_only_layers``; the harness models every layer sparse, or a first
    few dense (``dense_layers``), and refuses any other pattern."""
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    experts_key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    experts, top_k = field(experts_key, int), field("num_experts_per_tok", int)
    if top_k > experts:
        raise InvalidConfig(f"{label}: HF config field 'num_experts_per_tok' is {top_k}: a token "
                            f"chooses at most every expert ({experts_key}={experts})")
    if model_type == "mixtral":
        return {"n_experts": experts, "top_k": top_k,
                "expert_ffn": field("intermediate_size", int), "norm_topk": True,
                "moe_style": "mixtral"}
    step = field("decoder_sparse_step", int, 1)
    listed = field("mlp_only_layers", list, [])
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in listed):
        raise InvalidConfig(f"{label}: HF config field 'mlp_only_layers' is {listed!r}, "
                            "expected a list of layer indices (ints >= 0)")
    dense = sorted(listed)
    if step != 1 or dense != list(range(len(dense))):
        raise InvalidConfig(f"{label}: HF config fields 'decoder_sparse_step' {step} and "
                            f"'mlp_only_layers' {dense}: the harness models every layer sparse "
                            "but a first few (decoder_sparse_step 1, mlp_only_layers 0..k-1)")
    # required, as the other sizes: Qwen2MoeConfig's default is a 5632-wide shared expert
    # (transformers 4.57.6), not none; 0 is a shared expert of no width, which adds nothing
    shared = (field("shared_expert_intermediate_size", int, minimum=0)
              if model_type == "qwen2_moe" else 0)
    return {"n_experts": experts, "top_k": top_k,
            "expert_ffn": field("moe_intermediate_size", int),
            "norm_topk": field("norm_topk_prob", bool, False), "shared_ffn": shared,
            "shared_gate": shared > 0, "dense_layers": len(dense)}

VARIANT_FIELDS = ("vocab_multiple", "tie_embeddings", "bias", "qkv_bias", "o_bias", "qk_norm")
# Recorded together whenever n_experts > 0 (``geometry``): the MoE block's shape and routing.
MOE_FIELDS = ("n_experts", "top_k", "expert_ffn", "router", "norm_topk", "router_bias",
              "n_groups", "topk_groups", "shared_ffn", "shared_gate", "dense_layers", "moe_style")
_MOE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in MOE_FIELDS}
BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.type in (bool, "bool"))
ROUTERS = ("softmax", "sigmoid")
MOE_STYLES = ("qwen", "mixtral")

# The Hugging Face config.json files shipped with the package (model/hf_configs/), as on the
# Hub for these revisions. The Hub was not reachable when they were written: values come from
# the research notes (conventions.md, section 3.1), cross-checked against secondary copies.
# UNCONFIRMED (memory only, no copy seen): Qwen2.5-7B max_position_embeddings 131072 and its
# bos/eos ids; every Mistral-7B-v0.1 value except the Llama-shared geometry (hidden 4096,
# 32 heads, 8 KV heads, intermediate 14336), in particular rope_theta 10000.0 and
# sliding_window 4096; Mistral-Nemo-Base-2407 rope_theta 1000000.0 and
# max_position_embeddings 128000. None of the unconfirmed values is a shape.
HF_CONFIGS = {
    "llama3_8b": "meta-llama/Meta-Llama-3-8B",
    "qwen2_5_7b": "Qwen/Qwen2.5-7B",
    "mistral_7b": "mistralai/Mistral-7B-v0.1",
    "mistral_nemo": "mistralai/Mistral-Nemo-Base-2407",  # head_dim 128 != 5120 / 32
}
# The shipped Mixture-of-Experts configs, apart: a dense converter's fuzz never meets them
# unless asked (``--moe``). Values as on the Hub (research notes /work/notes/moe_conventions.md
# section 5): Qwen3-30B-A3B from a vendored copy matching the release (alibaba/InferSim
# f2293dab); Mixtral-8x7B-v0.1 from the Instruct-v0.1 file, whose model fields the base repo
# shares (UNCONFIRMED verbatim for the base); Qwen1.5-MoE-A2.7B rebuilt from re-saved
# derivatives (UNCONFIRMED verbatim; every shape field agrees across them).
MOE_HF_CONFIGS = {
    "qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B",  # 128 experts of 768, top 8, q/k norms
    "mixtral_8x7b": "mistralai/Mixtral-8x7B-v0.1",  # 8 experts of 14336, top 2
    "qwen1_5_moe_a2_7b": "Qwen/Qwen1.5-MoE-A2.7B",  # 60 experts of 1408, top 4, gated shared
}
SHIPPED_HF_CONFIGS = {**HF_CONFIGS, **MOE_HF_CONFIGS}


def hf_config_path(name: str) -> Path:
    """The shipped ``config.json`` of one of ``SHIPPED_HF_CONFIGS`` (package data)."""
    if name not in SHIPPED_HF_CONFIGS:
        raise InvalidConfig(f"unknown shipped HF config {name!r}; known: "
                            f"{', '.join(SHIPPED_HF_CONFIGS)}")
    return Path(__file__).resolve().parent / "hf_configs" / f"{name}.json"


def hf_config_file(given: str | Path) -> Path:
    """What a command's ``--hf-config`` names: the path given, else (no such file) the
    shipped ``config.json`` of that name (``llama3_8b``, ``qwen3_30b_a3b``, ...). Only a
    shipped name is looked up here; whatever the path is (missing, a directory, too long a
    name), ``read_hf_config`` says so when it is read."""
    path = Path(given)
    if str(given) in SHIPPED_HF_CONFIGS:
        try:
            path.stat()
        except FileNotFoundError:
            return hf_config_path(str(given))
        except OSError:
            pass
    return path


def shipped_hf_config(name: str, *, shrink: int = 1, n_layers: int | None = None,
                      vocab: int | None = None) -> ModelConfig:
    """A shipped HF geometry (``HF_CONFIGS``), optionally reduced for fast checks: hidden
    size, intermediate size and head_dim divided by ``shrink`` (head counts kept, so the
    GQA grouping and the head_dim / (hidden / heads) ratio are the model's), ``n_layers``
    and ``vocab`` overridden. ``shipped_hf_config("mistral_nemo", shrink=16)`` has
    d_model 320, head_dim 8 (5120 / 32 / 16 would be 10)."""
    data = read_hf_config(hf_config_path(name))
    for key in ("hidden_size", "intermediate_size", "head_dim", "moe_intermediate_size",
                "shared_expert_intermediate_size"):
        if data.get(key) is not None:
            if data[key] % shrink:
                raise InvalidConfig(f"{name}: {key}={data[key]} is not divisible by "
                                    f"shrink={shrink}")
            data[key] //= shrink
    return ModelConfig.from_hf_config(data, n_layers=n_layers, vocab=vocab, name=name)

TOY = ModelConfig(name="toy", vocab=32000, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2,
                  head_dim=32, ffn=704)  # 19,204,352 parameters
TOY_KV4 = TOY.replace(name="toy_kv4", n_kv_heads=4)  # 19,335,424 parameters

# The built-in MoE geometries: Qwen3-MoE's block (softmax top-2 of 8 renormalised, q/k norms)
# and DeepSeek-V3's (sigmoid scores with a selection bias, group-limited top-4 of 16, an
# ungated shared expert, the first layer dense), each about as costly to check as TOY_KV4.
TOY_MOE = TOY.replace(name="toy_moe", n_kv_heads=4, qk_norm=True, n_experts=8, top_k=2,
                      expert_ffn=128, norm_topk=True)  # 20,326,912 parameters
TOY_MOE_DS = TOY.replace(name="toy_moe_ds", n_kv_heads=4, n_experts=16, top_k=4, expert_ffn=64,
                         router="sigmoid", router_bias=True, norm_topk=True, n_groups=4,
                         topk_groups=2, shared_ffn=128, dense_layers=1)  # 20,379,952 parameters

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (TOY, TOY_KV4)}
MOE_CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (TOY_MOE, TOY_MOE_DS)}


def config_by_name(name: str) -> ModelConfig:
    """A built-in config, dense (``CONFIGS``) or MoE (``MOE_CONFIGS``), by name."""
    known = {**CONFIGS, **MOE_CONFIGS}
    try:
        return known[name]
    except KeyError:
        raise InvalidConfig(f"unknown config {name!r}; known: {', '.join(known)}") from None


@dataclass(frozen=True)
class Init:
    """How parameters are drawn: the way trained checkpoints look, not N(0, 1).

    Linear and embedding weights are N(0, std). Norm weights are 1 + N(0, norm_spread):
    near one but never all equal, so a permuted norm changes the output. Detection margins
    depend on these two numbers (bench/bench_init_scale.py measures how).

    An MoE router and a shared-expert gate are N(0, gate_scale^2 / d): logits of unit
    spread for a normed input, as a trained router's are (its logits decide; with the
    linears' 0.02 every router would be nearly uniform, every top-k a near tie, and the
    shared expert's sigmoid gate a constant 0.5 that a converter could drop unseen). The
    router's selection bias is N(0, selection_bias^2): of the order of the gaps between a
    token's sigmoid scores (their spread is about 0.2 at unit logits), as a bias trained to
    balance the experts' load is, so a bias left at zero or negated changes which experts
    many tokens choose.
    """

    std: float = 0.02
    norm_spread: float = 0.1
    gate_scale: float = 1.0
    selection_bias: float = 0.1


DEFAULT_INIT = Init()


# The dtypes a sync moves weights in, by the short names the CLI and the artifacts use.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` (or ``"bfloat16"``, ``torch.bfloat16``) -> ``torch.bfloat16``; one of
    ``DTYPES``, else ``InvalidConfig`` naming the known ones."""
    if isinstance(value, torch.dtype):
        if value in DTYPES.values():
            return value
    elif isinstance(value, str):
        key = value.removeprefix("torch.").lower()
        key = _DTYPE_ALIASES.get(key, key)
        if key in DTYPES:
            return DTYPES[key]
    raise InvalidConfig(f"dtype {value!r} is not a synced weight dtype; known: "
                        f"{', '.join(DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (the inverse of ``parse_dtype``)."""
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise InvalidConfig(f"dtype {dtype} is not a synced weight dtype; known: {', '.join(DTYPES)}")


def draw_param(name: str, shape: tuple[int, ...], gen: torch.Generator,
               init: Init = DEFAULT_INIT, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One parameter's next draw from ``gen`` (fp32), cast to ``dtype``: round to nearest
    even for bf16 and fp16, as ``Tensor.to`` does, so the fp32 draw is the same for every
    dtype and a bf16 weight is the fp32 one rounded."""
    if name.endswith("norm.weight"):
        x = 1.0 + init.norm_spread * torch.randn(shape, generator=gen)
    elif name.endswith(("router.weight", "shared_gate.weight")):
        x = torch.randn(shape, generator=gen).mul_(init.gate_scale / shape[-1] ** 0.5)
    elif name.endswith("router.bias"):
        x = torch.randn(shape, generator=gen).mul_(init.selection_bias)
    else:  # scaled in place: one fp32 copy of the largest parameter at a time, not two
        x = torch.randn(shape, generator=gen).mul_(init.std)  # bit for bit init.std * randn
    return x if dtype == torch.float32 else x.to(dtype)


def iter_params(config: ModelConfig, seed: int, init: Init = DEFAULT_INIT,
                dtype: torch.dtype = torch.float32
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """``init_params`` one parameter at a time, in the forward's order: each is made when
    the caller asks for the next, so a caller that drops it holds one parameter at a time.
    The draws are sequential from one generator per seed, which is why the order is the
    forward's (``param_shapes``): a streamed check reads them in exactly this order."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in config.param_shapes().items():
        yield name, draw_param(name, shape, gen, init, dtype)


# init_params keeps the draws of the last few models it drew and hands out copies: a copy
# costs about half the draw (``torch.randn``), and a sweep, a floor and the checks of one
# process ask for the same (config, seed) again and again. A model of over a third of
# _KEPT_BYTES (TOY's 73 MiB is kept) is drawn anew each time: a real width is never held twice.
_KEPT_BYTES = 384 << 20
_kept: OrderedDict[tuple[ModelConfig, int, Init, torch.dtype], dict[str, torch.Tensor]] = (
    OrderedDict())
_kept_bytes: dict[tuple[ModelConfig, int, Init, torch.dtype], int] = {}  # each draw's size


def init_params(config: ModelConfig, seed: int, init: Init = DEFAULT_INIT,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, a deterministic function of (config, seed, init): drawn
    in fp32, then cast to ``dtype`` (bf16 and fp16 round the same fp32 draws). The caller
    owns what it gets (a copy where the draw was kept: ``clear_kept_params``)."""
    key = (config, seed, init, dtype)
    kept = _kept.get(key)
    if kept is None:
        drawn = dict(iter_params(config, seed, init, dtype))
        size = sum(x.nbytes for x in drawn.values())
        if size > _KEPT_BYTES // 3:
            return drawn
        _kept[key] = kept = drawn
        _kept_bytes[key] = size
        while sum(_kept_bytes.values()) > _KEPT_BYTES:
            del _kept_bytes[next(iter(_kept))]
            _kept.popitem(last=False)
    else:
        _kept.move_to_end(key)
    return {name: x.clone() for name, x in kept.items()}


def clear_kept_params() -> None:
    """Forget the draws ``init_params`` keeps (a mutation-testing run draws its own)."""
    _kept.clear()
    _kept_bytes.clear()


def make_tokens(config: ModelConfig, seed: int) -> torch.Tensor:
    """Token ids of the config's token shape, ``(batch, seq_len)``, from a seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab, config.token_shape, generator=gen)

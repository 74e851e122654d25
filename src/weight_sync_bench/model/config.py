"""Model geometry, and parameters and tokens made deterministically from a seed.

The toy model is a Llama-shaped decoder (RMSNorm, GQA attention with RoPE, SwiGLU, untied
embeddings, no biases) that exists only to hold one instance of every layout the harness
checks: a vocab-parallel embedding and lm_head, a fused per-head qkv, a fused paired
gate_up, two row-parallel projections and replicated norms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from weight_sync_bench.errors import InvalidConfig


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

    def __post_init__(self) -> None:
        for field in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                      "ffn", "batch", "seq_len", "vocab_multiple"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfig(f"{self.name}: {field} must be a positive int, got {value!r}")
        for field in ("tie_embeddings", "bias"):
            if not isinstance(getattr(self, field), bool):
                raise InvalidConfig(f"{self.name}: {field} must be a bool, "
                                    f"got {getattr(self, field)!r}")
        if self.n_heads % self.n_kv_heads:
            raise InvalidConfig(
                f"{self.name}: GQA needs n_heads % n_kv_heads == 0 "
                f"(n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads})")
        if self.head_dim % 2:
            raise InvalidConfig(f"{self.name}: RoPE needs an even head_dim (head_dim={self.head_dim})")

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
    def token_shape(self) -> tuple[int, int]:
        return (self.batch, self.seq_len)

    @property
    def padded_vocab(self) -> int:
        """Rows of the vocab-parallel tables: vocab rounded up to ``vocab_multiple``. Rows
        ``vocab..padded_vocab-1`` are padding, never a token and never a valid class."""
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's full shape, in the order the forward consumes them."""
        d = self.d_model
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.padded_vocab, d)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            shapes[p + "qkv.weight"] = (self.qkv_rows, d)
            if self.bias:
                shapes[p + "qkv.bias"] = (self.qkv_rows,)
            shapes[p + "o_proj.weight"] = (d, self.q_rows)
            if self.bias:
                shapes[p + "o_proj.bias"] = (d,)
            shapes[p + "ffn_norm.weight"] = (d,)
            shapes[p + "gate_up.weight"] = (2 * self.ffn, d)
            shapes[p + "down.weight"] = (d, self.ffn)
            if self.bias:
                shapes[p + "down.bias"] = (d,)
        shapes["norm.weight"] = (d,)
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.padded_vocab, d)
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
               if f.name != "name" and f.name not in VARIANT_FIELDS
               and isinstance(getattr(self, f.name), int)}
        for f in dataclasses.fields(self):
            if f.name in VARIANT_FIELDS and getattr(self, f.name) != f.default:
                out[f.name] = int(getattr(self, f.name))
        return out

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)


VARIANT_FIELDS = ("vocab_multiple", "tie_embeddings", "bias")

TOY = ModelConfig(name="toy", vocab=32000, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2,
                  head_dim=32, ffn=704)  # 19,204,352 parameters
TOY_KV4 = TOY.replace(name="toy_kv4", n_kv_heads=4)  # 19,269,888 parameters

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (TOY, TOY_KV4)}


def config_by_name(name: str) -> ModelConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise InvalidConfig(f"unknown config {name!r}; known: {', '.join(CONFIGS)}") from None


@dataclass(frozen=True)
class Init:
    """How parameters are drawn: the way trained checkpoints look, not N(0, 1).

    Linear and embedding weights are N(0, std). Norm weights are 1 + N(0, norm_spread):
    near one but never all equal, so a permuted norm changes the output. Detection margins
    depend on these two numbers (bench/bench_init_scale.py measures how).
    """

    std: float = 0.02
    norm_spread: float = 0.1


DEFAULT_INIT = Init()


def init_params(config: ModelConfig, seed: int, init: Init = DEFAULT_INIT) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 parameters, a deterministic function of (config, seed, init)."""
    gen = torch.Generator().manual_seed(seed)
    params: dict[str, torch.Tensor] = {}
    for name, shape in config.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = 1.0 + init.norm_spread * torch.randn(shape, generator=gen)
        else:
            params[name] = init.std * torch.randn(shape, generator=gen)
    return params


def make_tokens(config: ModelConfig, seed: int) -> torch.Tensor:
    """Token ids of the config's token shape, ``(batch, seq_len)``, from a seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab, config.token_shape, generator=gen)

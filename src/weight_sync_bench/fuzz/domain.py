"""The fuzz domain: which geometries the strategies draw and the floor samples cover.

One definition, read by three consumers that must agree: ``strategies`` draws geometries
from it, ``floor`` samples the numerical floor over it, and the threshold rule for fuzzed
geometries refuses a geometry outside it (a threshold derived from samples says nothing
about geometries the samples never covered). Plain data, no Hypothesis.

The domain also fixes how a fuzzed model's weights are drawn (``fuzz_init``): unit-variance
projections at every width. With the seed's N(0, 0.02) at d_model 8 every pre-activation is
a few hundredths, SiLU is linear there, and swapping gate and up changes the logits by less
than ten times the threshold; at d_model^-1/2 the nonlinearities work in their nonlinear
range, as in a trained model, and every mutation clears the kill margin with room. This
strengthens the check where it was weak instead of shrinking the claim.

The tokens too (``fuzz_tokens``): plain random tokens can all fall in one rank's vocab
slice, or all be the same token, and then a reversed embedding or a query head read from
the wrong rank changes nothing the check can see (the fuzz found both at seq_len 2).

The coupled sizes are stated as multiples so every geometry in the domain supports every
divisor of ``n_kv_heads`` as a degree: ``n_heads = n_kv_heads * group``,
``ffn = n_kv_heads * ffn_per_kv_head``, ``vocab = n_kv_heads * vocab_per_kv_head``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import (
    CONFIGS,
    DEFAULT_INIT,
    Init,
    ModelConfig,
    init_params,
    make_tokens,
)
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET


@dataclass(frozen=True)
class IntRange:
    """The integers ``lo, lo + step, ..., <= hi``."""

    lo: int
    hi: int
    step: int = 1

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) for v in (self.lo, self.hi, self.step)):
            raise InvalidConfig(f"IntRange needs ints, got lo={self.lo!r}, hi={self.hi!r}, "
                                f"step={self.step!r}")
        if self.step < 1 or self.lo > self.hi:
            raise InvalidConfig(f"IntRange needs step >= 1 and lo <= hi "
                                f"(lo={self.lo}, hi={self.hi}, step={self.step})")

    def __contains__(self, value: object) -> bool:
        return (isinstance(value, int) and self.lo <= value <= self.hi
                and (value - self.lo) % self.step == 0)

    @property
    def top(self) -> int:
        """The largest member (``hi`` rounded down onto the step)."""
        return self.hi - (self.hi - self.lo) % self.step

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}" + (f" step {self.step}" if self.step > 1 else "")


@dataclass(frozen=True)
class FuzzDomain:
    """Ranges of every geometry field a fuzzed example may take.

    Small on purpose: at the top of every range one check (reference, split, sharded forward
    at every degree) costs tens of milliseconds on one CPU thread.
    """

    n_kv_heads: IntRange = IntRange(1, 4)
    group: IntRange = IntRange(1, 4)  # n_heads / n_kv_heads
    head_dim: IntRange = IntRange(2, 16, 2)  # RoPE rotates pairs: even
    d_model: IntRange = IntRange(8, 128, 8)
    ffn_per_kv_head: IntRange = IntRange(2, 32)
    vocab_per_kv_head: IntRange = IntRange(8, 256)
    n_layers: IntRange = IntRange(1, 3)
    batch: IntRange = IntRange(1, 2)
    seq_len: IntRange = IntRange(4, 16)  # >= 4 tokens, so fuzz_tokens reaches every vocab slice
    seed: IntRange = IntRange(0, 2**16 - 1)

    def violations(self, config: ModelConfig) -> list[str]:
        """Every way ``config`` lies outside the domain, as ``field=value not in range``;
        empty when it lies inside."""
        kv = config.n_kv_heads
        derived = {"n_kv_heads": kv,
                   "group": config.n_heads / kv,
                   "head_dim": config.head_dim,
                   "d_model": config.d_model,
                   "ffn_per_kv_head": config.ffn / kv,
                   "vocab_per_kv_head": config.vocab / kv,
                   "n_layers": config.n_layers,
                   "batch": config.batch,
                   "seq_len": config.seq_len}
        return _outside(self, derived)

    def contains(self, config: ModelConfig) -> bool:
        return not self.violations(config)

    def config(self, *, n_kv_heads: int, group: int, head_dim: int, d_model: int,
               ffn_per_kv_head: int, vocab_per_kv_head: int, n_layers: int, batch: int,
               seq_len: int, name: str = "fuzz") -> ModelConfig:
        """The ModelConfig these domain coordinates describe."""
        return ModelConfig(name=name, vocab=n_kv_heads * vocab_per_kv_head, d_model=d_model,
                           n_layers=n_layers, n_heads=n_kv_heads * group, n_kv_heads=n_kv_heads,
                           head_dim=head_dim, ffn=n_kv_heads * ffn_per_kv_head, batch=batch,
                           seq_len=seq_len)

    def smallest(self) -> ModelConfig:
        """The geometry every strategy shrinks toward."""
        return self.config(**{f: getattr(self, f).lo for f in _COORDINATES})

    def largest(self) -> ModelConfig:
        return self.config(**{f: getattr(self, f).top for f in _COORDINATES})

    def to_json(self) -> dict[str, Any]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FuzzDomain:
        return cls(**{name: IntRange(**value) for name, value in data.items()})

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self))


_COORDINATES = ("n_kv_heads", "group", "head_dim", "d_model", "ffn_per_kv_head",
                "vocab_per_kv_head", "n_layers", "batch", "seq_len")

DOMAIN = FuzzDomain()

# Where a converter into an FP8 destination is fuzzed (``vllm:fp8=block128``): widths that
# cross the 128-row block boundary (head_dim 64, 128, 192 times 1-4 KV heads; MLP widths of
# 64-256 per KV head), so that vLLM's block rules hold some geometries at some degrees and
# refuse others, and per-tensor scales meet shards of every size. Outside DOMAIN: an FP8
# check's threshold is the committed FP8 floor's or one measured on the case's dequantized
# weights (``check.fp8.fp8_threshold``), never the random-geometry rule; at least 2 KV
# heads, so the plain layout shards every geometry and that measurement has a floor.
FP8_DOMAIN = FuzzDomain(n_kv_heads=IntRange(2, 4), head_dim=IntRange(64, 192, 64),
                        d_model=IntRange(64, 256, 64),
                        ffn_per_kv_head=IntRange(64, 256, 64),
                        vocab_per_kv_head=IntRange(16, 64), n_layers=IntRange(1, 2),
                        seq_len=IntRange(4, 8))


def _outside(domain: FuzzDomain | MoeDomain, derived: dict[str, float | int]) -> list[str]:
    """Each derived value outside ``domain``'s range of the same name, said as such."""
    out = []
    for name, value in derived.items():
        allowed: IntRange = getattr(domain, name)
        as_int = int(value) if float(value).is_integer() else value
        if as_int not in allowed:
            out.append(f"{name}={_fmt(value)} not in {allowed}")
    return out


def _fmt(value: float | int) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def is_builtin(config: ModelConfig) -> bool:
    """TOY and TOY_KV4 (by name and geometry): they keep the seed's init and floor."""
    builtin = CONFIGS.get(config.name)
    return builtin is not None and builtin.geometry() == config.geometry()


def fuzz_init(config: ModelConfig) -> Init:
    """How a fuzzed geometry's weights are drawn: std d_model^-1/2 (see the module doc);
    the built-in configs keep the seed's init, which their floor was measured under."""
    return DEFAULT_INIT if is_builtin(config) else Init(std=config.d_model ** -0.5)


def fuzz_params(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    return init_params(config, seed, fuzz_init(config))


def fuzz_tokens(config: ModelConfig, seed: int) -> torch.Tensor:
    """``(batch, seq_len)`` token ids that read every rank's vocab slice at every supported
    degree: position i draws a random token from the (i mod T)-th of T equal vocab slices,
    T = gcd(n_kv_heads, vocab) (the largest degree the domain reaches), then positions are
    shuffled. Every slice is read once ``batch * seq_len >= T``, which the domain ensures.
    The built-in configs keep ``make_tokens``."""
    if is_builtin(config):
        return make_tokens(config, TOKEN_SEED_OFFSET + seed)
    gen = torch.Generator().manual_seed(TOKEN_SEED_OFFSET + seed)
    n = config.batch * config.seq_len
    slices = math.gcd(config.n_kv_heads, config.vocab)
    width = config.vocab // slices
    tokens = (torch.arange(n) % slices) * width + torch.randint(0, width, (n,), generator=gen)
    return tokens[torch.randperm(n, generator=gen)].view(config.token_shape)  # (B, T)


@dataclass(frozen=True)
class MoeDomain:
    """What a fuzzed Mixture-of-Experts geometry adds to a ``FuzzDomain`` geometry: the number
    of experts, how many a token takes, their width (a multiple of ``n_kv_heads``, so every
    TP degree the dense layers take splits them), a shared expert's width (0: none), and a
    dense first layer. The router (softmax, or sigmoid with a selection bias), its groups,
    renormalisation, the shared expert's gate, q/k norms and the family's names are drawn
    beside them (``fuzz.strategies.moe_geometries``); every choice is valid by construction."""

    n_experts: IntRange = IntRange(2, 8)
    top_k: IntRange = IntRange(1, 4)  # at most n_experts
    # up to d_model / n_kv_heads (square experts: a transposed expert keeps its shape); the
    # strategies draw 2..16 but where a mutation needs square experts
    expert_ffn_per_kv_head: IntRange = IntRange(2, 128)
    shared_ffn_per_kv_head: IntRange = IntRange(0, 16)
    dense_layers: IntRange = IntRange(0, 1)  # at most n_layers - 1: one MoE layer at least

    def violations(self, config: ModelConfig, dense: FuzzDomain = DOMAIN) -> list[str]:
        """Every way an MoE ``config`` lies outside ``dense`` and this domain."""
        kv = config.n_kv_heads
        out = dense.violations(config)
        if not config.n_experts:
            return [*out, "n_experts=0: not an MoE geometry"]
        derived = {"n_experts": config.n_experts, "top_k": config.top_k,
                   "expert_ffn_per_kv_head": config.expert_ffn / kv,
                   "shared_ffn_per_kv_head": config.shared_ffn / kv,
                   "dense_layers": config.dense_layers}
        return [*out, *_outside(self, derived)]

    def contains(self, config: ModelConfig, dense: FuzzDomain = DOMAIN) -> bool:
        return not self.violations(config, dense)

    def smallest(self, dense: FuzzDomain = DOMAIN) -> ModelConfig:
        """``dense.smallest()`` with the fewest, narrowest experts, top-1, a softmax router,
        no shared expert and no dense layer: what ``moe_geometries`` shrinks toward."""
        base = dense.smallest()
        return base.replace(name="fuzz_moe", n_experts=self.n_experts.lo, top_k=self.top_k.lo,
                            expert_ffn=base.n_kv_heads * self.expert_ffn_per_kv_head.lo,
                            shared_ffn=base.n_kv_heads * self.shared_ffn_per_kv_head.lo,
                            dense_layers=self.dense_layers.lo)

    def largest(self, dense: FuzzDomain = DOMAIN) -> ModelConfig:
        """``dense.largest()`` with every MoE range at its top and every option on: a sigmoid
        router with a selection bias over two groups (one kept), renormalised weights, a gated
        shared expert, q/k norms and a dense first layer (the most a forward computes)."""
        base = dense.largest()
        kv, e = base.n_kv_heads, self.n_experts.top
        return base.replace(name="fuzz_moe", n_experts=e, top_k=self.top_k.top,
                            expert_ffn=kv * self.expert_ffn_per_kv_head.top,
                            shared_ffn=kv * self.shared_ffn_per_kv_head.top, shared_gate=True,
                            router="sigmoid", router_bias=True, n_groups=2,
                            topk_groups=1 if self.top_k.top <= e // 2 else 2, norm_topk=True,
                            qk_norm=True, dense_layers=min(self.dense_layers.top,
                                                           base.n_layers - 1))

    def to_json(self) -> dict[str, Any]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}


MOE_DOMAIN = MoeDomain()

"""Hypothesis strategies for weight-sync-bench: geometries, TP degree pairs, seeds, cases.

Every strategy reads its ranges from ``weight_sync_bench.domain.DOMAIN``, the one definition
the floor samples also cover, and draws dependent values next to each other (``n_kv_heads``,
then ``n_heads`` as a multiple of it, then degrees from the ones the layout supports) so no
example is thrown away by ``assume`` or ``filter``. Everything shrinks toward t=1 and the
smallest dimensions of the domain.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hypothesis import strategies as st

from weight_sync_bench.check.mutations import mutation_by_name
from weight_sync_bench.fuzz.case import Case
from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN, FuzzDomain, IntRange, MoeDomain
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.plan import layout_for

__all__ = ["MoeNeeds", "Rejection", "cases", "degree_pairs", "geometries", "in_range",
           "moe_geometries",
           "rejected_layouts", "seeds"]


@functools.cache  # one strategy per range: building it on every draw costs more than the draw
def in_range(r: IntRange) -> st.SearchStrategy[int]:
    """Members of ``r`` (``lo``, ``lo + step``, ... up to ``hi``); shrinks toward ``lo``."""
    return st.integers(0, (r.top - r.lo) // r.step).map(lambda i: r.lo + i * r.step)


@st.composite
def geometries(draw: st.DrawFn, domain: FuzzDomain = DOMAIN) -> ModelConfig:
    """A ModelConfig inside ``domain``: ``n_kv_heads`` first, then ``n_heads`` as a multiple
    of it, ``ffn`` and ``vocab`` as multiples of it too (so every divisor of ``n_kv_heads`` is
    a supported degree), then head_dim, d_model, depth and the token shape.

    Shrinks toward ``domain.smallest()``: one KV head, one query head per group, the smallest
    head_dim, d_model, ffn, vocab, depth, batch and sequence.
    """
    n_kv_heads = draw(in_range(domain.n_kv_heads))
    group = draw(in_range(domain.group))
    return domain.config(
        n_kv_heads=n_kv_heads, group=group,
        ffn_per_kv_head=draw(in_range(domain.ffn_per_kv_head)),
        vocab_per_kv_head=draw(in_range(domain.vocab_per_kv_head)),
        head_dim=draw(in_range(domain.head_dim)), d_model=draw(in_range(domain.d_model)),
        n_layers=draw(in_range(domain.n_layers)), batch=draw(in_range(domain.batch)),
        seq_len=draw(in_range(domain.seq_len)))


def degree_pairs(config: ModelConfig, degrees: list[int] | None = None
                 ) -> st.SearchStrategy[tuple[int, int]]:
    """An ordered ``(src, dst)`` pair of the degrees ``layout_for(config)`` supports (or of
    ``degrees``, a non-empty subset); ``src == dst`` included. Shrinks toward ``(1, 1)``."""
    degrees = degrees if degrees is not None else layout_for(config).supported_degrees()
    if not degrees:
        raise ValueError(f"degree_pairs: degrees must be non-empty, got degrees={degrees!r}")
    return st.tuples(st.sampled_from(degrees), st.sampled_from(degrees))


def seeds(domain: FuzzDomain = DOMAIN) -> st.SearchStrategy[int]:
    """A model seed (tokens use ``1000 + seed``); weights are built from it with a
    ``torch.Generator``, never drawn as arrays. Shrinks toward 0."""
    return in_range(domain.seed)


@functools.cache  # built once per domain and per list of degrees, as ``in_range`` is
def _geometries_of(domain: FuzzDomain) -> st.SearchStrategy[ModelConfig]:
    return geometries(domain)


@functools.cache
def _one_of(degrees: tuple[int, ...]) -> st.SearchStrategy[int]:
    return st.sampled_from(degrees)


@st.composite
def cases(draw: st.DrawFn, mutation: str | None = None, phase: str = "1a",
          domain: FuzzDomain = DOMAIN) -> Case:
    """A check to run: a geometry, an ordered degree pair, a seed, and ``mutation`` applied
    at the destination. With a mutation, ``dst`` is drawn from the degrees where it is not
    the identity when there are any (so few examples are spent on no-ops); the identity
    cases that remain check the mutation's identity declaration.

    Shrinks as ``geometries`` does, then toward ``(1, 1)`` and seed 0.
    """
    config = draw(_geometries_of(domain))
    supported = tuple(layout_for(config).supported_degrees())
    dsts = supported
    if mutation is not None:
        identity = mutation_by_name(mutation).identity_reason
        live = tuple(t for t in supported if identity(config, t) is None)
        dsts = live or supported
    src = draw(_one_of(supported))
    dst = draw(_one_of(dsts))
    return Case(config=config, src=src, dst=dst, seed=draw(seeds(domain)), mutation=mutation,
                phase=phase)


@dataclass(frozen=True)
class Rejection:
    """A geometry with a degree its layout must reject, and what the error must name."""

    config: ModelConfig
    degree: int
    parameter: str  # the first parameter (in layout order) whose placement rejects the degree
    rule: str  # the rule the error message must quote


_BREAKABLE = ("n_kv_heads", "ffn", "vocab")


@st.composite
def rejected_layouts(draw: st.DrawFn) -> Rejection:
    """A geometry and a degree t >= 2 that break exactly one divisibility rule of the layout:

    - ``n_kv_heads % t != 0`` (more ranks than KV heads, or a ragged split) with ``n_heads``
      still divisible: ``layers.0.qkv.weight``, rule ``n_kv_heads % t == 0``;
    - ``ffn % t != 0``: ``layers.0.gate_up.weight``, rule ``first % t == 0``;
    - ``vocab % t != 0``: ``tok_embeddings.weight``, rule ``shape[0] % t == 0``.

    (``n_heads % t`` cannot break alone: ``n_heads`` is a multiple of ``n_kv_heads``.)
    Every other size is a multiple of t, so the rule named is the one broken. Shrinks toward
    t=2, the KV-head rule, one KV head and the smallest sizes.
    """
    t = draw(st.integers(2, 8))
    broken = draw(st.sampled_from(_BREAKABLE))
    ragged = draw(st.integers(1, t - 1))  # the remainder that breaks the rule
    if broken == "n_kv_heads":
        n_kv_heads = t * draw(st.integers(0, 1)) + ragged
        n_heads = math.lcm(n_kv_heads, t) * draw(st.integers(1, 2))
    else:
        n_kv_heads = t * draw(st.integers(1, 2))
        n_heads = n_kv_heads * draw(st.integers(1, 2))
    ffn = t * draw(st.integers(1, 8)) + (ragged if broken == "ffn" else 0)
    vocab = t * draw(st.integers(2, 16)) + (ragged if broken == "vocab" else 0)
    config = ModelConfig(name="rejected", vocab=vocab, d_model=8 * draw(st.integers(1, 4)),
                         n_layers=draw(st.integers(1, 2)), n_heads=n_heads,
                         n_kv_heads=n_kv_heads, head_dim=2 * draw(st.integers(1, 4)), ffn=ffn,
                         batch=1, seq_len=4)
    parameter, rule = {"n_kv_heads": ("layers.0.qkv.weight", "n_kv_heads % t == 0"),
                       "ffn": ("layers.0.gate_up.weight", "first % t == 0"),
                       "vocab": ("tok_embeddings.weight", "shape[0] % t == 0")}[broken]
    return Rejection(config, t, parameter, rule)


@dataclass(frozen=True)
class MoeNeeds:
    """What an MoE geometry must have for an MoE conversion mutation to be live in it: a
    selection bias and fewer experts chosen than there are (``router_bias``), a gated shared
    expert (``shared_gate``), q/k norms over two layers or more (``qk_norm``), square experts
    (``square``: expert_ffn == d_model, a multiple of n_kv_heads), an odd number of experts
    (``odd_experts``: vLLM's linear map over 2 or 4 EP ranks has a remainder), two KV heads
    or more (``min_kv_heads``: a TP (and EP) degree of 2), four experts or more
    (``min_experts``), experts 8 wide or more per KV head (``wide_experts``), a shared expert
    8 wide or more per KV head (``wide_shared``: its gate halved moved the logits by 3.8x the
    threshold at width 1 in the MoE validation, ``tolerance/random_floor_1a_moe.json``),
    heads of ``min_head_dim`` or more (a q/k norm over a head of one RoPE pair taken from the
    next layer moved them by 4.6x in the first MoE campaign, campaigns/README.md)."""

    router_bias: bool = False
    shared_gate: bool = False
    qk_norm: bool = False
    square: bool = False
    odd_experts: bool = False
    min_kv_heads: int = 1
    min_experts: int = 2
    wide_experts: bool = False
    wide_shared: bool = False
    min_head_dim: int = 2


@st.composite
def moe_geometries(draw: st.DrawFn, domain: FuzzDomain = DOMAIN,
                   moe: MoeDomain = MOE_DOMAIN, needs: MoeNeeds = MoeNeeds()) -> ModelConfig:
    """An MoE ModelConfig inside ``domain`` and ``moe`` meeting ``needs``: a dense geometry
    (``geometries``), then the experts: their number, ``top_k`` at most that, the router
    (softmax; or sigmoid, with a selection bias or not), its groups (a divisor of the experts
    with two or more each, ``topk_groups`` of them kept, enough experts for ``top_k``),
    renormalisation, the experts' and a shared expert's widths (multiples of ``n_kv_heads``),
    the shared expert's gate, q/k norms, and Mixtral's names where its block allows. Drawn in
    that order, each from what the earlier draws (and ``needs``) allow: nothing is rejected.

    Shrinks toward two experts, top-1, softmax, no groups, no shared expert, no q/k norms."""
    config = draw(geometries(domain))
    kv = max(config.n_kv_heads, needs.min_kv_heads)
    if needs.odd_experts and kv % 2:  # an even TP = EP degree that no odd count divides
        kv += 1
    if kv != config.n_kv_heads:  # the coupled sizes follow, as ``geometries`` draws them
        config = config.replace(n_kv_heads=kv, n_heads=config.n_heads // config.n_kv_heads * kv,
                                ffn=config.ffn // config.n_kv_heads * kv,
                                vocab=config.vocab // config.n_kv_heads * kv)
    if needs.qk_norm and config.n_layers < 2:
        config = config.replace(n_layers=2)
    if config.head_dim < needs.min_head_dim:  # the smallest member at least that wide
        config = config.replace(head_dim=min(h for h in range(
            domain.head_dim.lo, domain.head_dim.top + 1, domain.head_dim.step)
            if h >= needs.min_head_dim))
    if needs.square and config.d_model % kv:  # square experts: d_model a multiple of kv too
        widths = [d for d in range(domain.d_model.lo, domain.d_model.top + 1,
                                   domain.d_model.step) if d % kv == 0]
        config = config.replace(d_model=max([d for d in widths if d <= config.d_model],
                                            default=widths[0]))
    counts = [e for e in range(max(moe.n_experts.lo, needs.min_experts), moe.n_experts.top + 1)
              if not needs.odd_experts or e % 2]
    e = draw(st.sampled_from(counts))
    # a selection bias selects only where fewer experts are chosen than there are
    top_k = draw(st.integers(moe.top_k.lo, min(moe.top_k.top, e - 1 if needs.router_bias else e)))
    router = "sigmoid" if needs.router_bias else draw(st.sampled_from(("softmax", "sigmoid")))
    groups = [g for g in range(1, e + 1) if e % g == 0 and (g == 1 or e // g >= 2)]
    n_groups = draw(st.sampled_from(groups))
    keep = [k for k in range(1, n_groups + 1) if top_k <= k * (e // n_groups)]
    topk_groups = draw(st.sampled_from(keep)) if n_groups > 1 else 1
    kv = config.n_kv_heads
    shared = kv * draw(st.integers(max(moe.shared_ffn_per_kv_head.lo,
                                       8 if needs.wide_shared else 1 if needs.shared_gate
                                       else 0), moe.shared_ffn_per_kv_head.top))
    qk_norm = needs.qk_norm or draw(st.booleans())
    dense = draw(st.integers(moe.dense_layers.lo, min(moe.dense_layers.top, config.n_layers - 1)))
    if needs.square:  # the experts as wide as the model: d_model a multiple of n_kv_heads
        expert_ffn = config.d_model
    else:
        expert_ffn = kv * draw(st.integers(8 if needs.wide_experts else
                                           moe.expert_ffn_per_kv_head.lo, 16))
    fields = dict(n_experts=e, top_k=top_k, router=router, n_groups=n_groups,
                  topk_groups=topk_groups, norm_topk=draw(st.booleans()),
                  router_bias=needs.router_bias or (router == "sigmoid" and draw(st.booleans())),
                  expert_ffn=expert_ffn, shared_ffn=shared,
                  shared_gate=needs.shared_gate or (shared > 0 and draw(st.booleans())),
                  qk_norm=qk_norm, dense_layers=dense)
    mixtral_ok = not (shared or qk_norm or dense or router != "softmax" or n_groups > 1)
    fields["moe_style"] = "mixtral" if mixtral_ok and draw(st.booleans()) else "qwen"
    return config.replace(name="fuzz_moe", **fields)

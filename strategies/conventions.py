"""Hypothesis strategies for conversions between storage conventions.

- ``conversion_geometries(needs=...)``: a geometry of the fuzz domain that the conventions
  can hold, with a KV-head *replication factor* k drawn first (1, 2 or 4) and the query
  groups and the ffn drawn as multiples of it, so vLLM can store it at ``t = k *
  n_kv_heads > n_kv_heads`` (``QKVParallelLinear``'s ``num_kv_head_replicas = t /
  n_kv_heads``); the variants each framework stores differently (Qwen2's qkv bias, Llama's
  ``attention_bias``, tied embeddings) drawn too;
- ``endpoints(config)``: every (convention, degree) that can store it (probed through the
  conventions' own rules, degrees among the divisors of ``n_heads``), and Megatron's
  unpadded vocabulary and pipeline stages (``staged_endpoints``: pp, vpp, uneven stages,
  the embedding or loss counted, within Megatron's rules);
- ``conversion_cases(mutation)``: a ``ConversionCase``: the two conventions (each equally
  likely), a geometry both store, each end's degree, a seed; with a conversion mutation, an
  endpoint pair where it applies and (when there is one) is not the identity.

The geometry a mutation needs to be live somewhere (``needs_for``: Meta's order for the RoPE
bugs, a qkv bias to split, an untied output, replicated KV heads) is drawn directly, never
filtered, so every mutation is killed in a handful of examples. Everything shrinks toward
the domain's smallest geometry (k = 1, no variant), the smallest endpoints (``plain:1``
first) and seed 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st
from weight_sync_bench.fuzz.strategies import MoeNeeds, in_range, moe_geometries, seeds

from weight_sync_bench.conventions import CONVENTIONS, Endpoint, endpoint, moe_endpoints
from weight_sync_bench.conventions.mutations import MUTATIONS as CONVERSION_MUTATIONS
from weight_sync_bench.conventions.mutations import Conversion
from weight_sync_bench.fuzz.case import ConversionCase
from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN, FuzzDomain, IntRange, MoeDomain
from weight_sync_bench.model.config import ModelConfig

__all__ = ["Needs", "case_end", "conversion_cases", "conversion_geometries", "endpoints",
           "moe_conversion_cases", "moe_endpoints", "moe_needs_for", "needs_for",
           "staged_endpoints", "staged_moe_endpoints"]

REPLICATION = (1, 2, 4)  # KV-head replication factors k: vLLM at t = k * n_kv_heads


@dataclass(frozen=True)
class Needs:
    """What a geometry must have for a conversion mutation to be live somewhere in it:

    - ``min_kv_heads``: the fewest KV heads (2: more than one KV group, or a degree >= 2 on
      the conventions without replication);
    - ``min_replication`` / ``max_replication``: the range of k (2: a replicated KV head);
    - ``min_head_dim``: 4 where a head of one RoPE pair hides a permute;
    - ``k_view``: ``head_dim`` a multiple of ``2 * group`` and ``group >= 2`` (k permuted
      with ``n_heads`` is a silent bug only where that view of k is valid, and differs);
    - ``variants``: ``"any"``, ``"plain"`` (no bias, untied: Meta's checkpoints),
      ``"no_o_bias"`` (Megatron stores no linear_proj bias without fc1 biases),
      ``"qkv_bias"`` (a fused qkv bias, no o_proj bias), ``"untied"``, ``"untied_no_o_bias"``
      (both: Megatron's pipeline ends with their own output layer);
    - ``min_layers``: the fewest layers (pipeline stages need two or three)."""

    min_kv_heads: int = 1
    min_replication: int = 1
    max_replication: int = REPLICATION[-1]
    min_head_dim: int = 2
    k_view: bool = False
    variants: str = "any"
    min_layers: int = 1  # pipeline stages: 2 layers to split, 3 for an uneven last stage


_NEEDS = {
    "tp_rank_defaults_to_0": Needs(min_kv_heads=2),
    "kv_replica_modulo": Needs(min_kv_heads=2, min_replication=2),
    "megatron_qkv_read_as_plain": Needs(min_kv_heads=2, variants="no_o_bias"),
    "plain_qkv_read_as_megatron": Needs(min_kv_heads=2, variants="no_o_bias"),
    "megatron_fc1_rank_concat": Needs(min_kv_heads=2, variants="no_o_bias"),
    "rope_permute_missing": Needs(min_head_dim=4, variants="plain"),
    "rope_permute_twice": Needs(min_head_dim=4, variants="plain"),
    "rope_k_permuted_with_n_heads": Needs(k_view=True, variants="plain"),
    "qkv_bias_not_split": Needs(min_kv_heads=2, variants="qkv_bias"),
    "embedding_split_on_vocab": Needs(min_kv_heads=2, variants="plain"),
    "embedding_joined_on_vocab": Needs(min_kv_heads=2, variants="plain"),
    "output_stale_copy": Needs(variants="untied"),
    # pipeline stages (issue 25): layers to split, Megatron's variants
    "pp_local_layer_as_global": Needs(min_layers=2, variants="no_o_bias"),
    "pp_chunks_contiguous": Needs(min_layers=3, variants="no_o_bias"),
    "pp_last_stage_layers_dropped": Needs(min_layers=3, variants="no_o_bias"),
    "pp_embedding_output_swapped": Needs(min_layers=2, variants="untied_no_o_bias"),
    "vocab_padding_per_rank": Needs(min_kv_heads=2, variants="no_o_bias"),
}


def needs_for(mutation: str | None) -> Needs:
    """What a geometry needs for ``mutation`` (a conversion mutation) to be live; ``Needs()``
    for none."""
    if mutation is None:
        return Needs()
    if mutation not in CONVERSION_MUTATIONS:
        raise ValueError(f"unknown conversion mutation {mutation!r}; known: "
                         f"{', '.join(CONVERSION_MUTATIONS)}")
    return _NEEDS.get(mutation, Needs())


@st.composite
def _variants(draw: st.DrawFn, kind: str) -> dict[str, bool]:
    if kind == "plain":
        return {}
    tied = False if kind in ("untied", "qkv_bias", "untied_no_o_bias") else draw(st.booleans())
    if kind == "qkv_bias":  # Qwen2: q, k, v biases only
        return {"qkv_bias": True}
    # none, Qwen2 (qkv_bias) or Llama's attention_bias (q, k, v and o_proj biases)
    bias = draw(st.sampled_from(["none", "qkv"] if kind in ("no_o_bias", "untied_no_o_bias")
                                else ["none", "qkv", "attention"]))
    return {"tie_embeddings": tied, "qkv_bias": bias != "none", "o_bias": bias == "attention"}


@st.composite
def conversion_geometries(draw: st.DrawFn, domain: FuzzDomain = DOMAIN,
                          needs: Needs = Needs()) -> ModelConfig:
    """A geometry inside ``domain`` meeting ``needs``: ``n_kv_heads``, then the replication
    factor k, then the query group and the ffn per KV head as multiples of k (and of the
    head_dim's needs), then the rest as ``geometries`` draws them, then the variants."""
    kv_lo = max(domain.n_kv_heads.lo, needs.min_kv_heads)
    n_kv_heads = draw(st.integers(kv_lo, domain.n_kv_heads.top))
    ks = [k for k in REPLICATION if needs.min_replication <= k <= needs.max_replication
          and _multiples(domain.group, k, 2 if needs.k_view else 1)]
    k = draw(st.sampled_from(ks))
    group = draw(st.sampled_from(_multiples(domain.group, k, 2 if needs.k_view else 1)))
    ffn_per_kv_head = draw(st.sampled_from(_multiples(domain.ffn_per_kv_head, k)))
    head_dims = [h for h in range(domain.head_dim.lo, domain.head_dim.top + 1,
                                  domain.head_dim.step)
                 if h >= needs.min_head_dim and (not needs.k_view or h % (2 * group) == 0)]
    config = domain.config(
        n_kv_heads=n_kv_heads, group=group, ffn_per_kv_head=ffn_per_kv_head,
        vocab_per_kv_head=draw(in_range(domain.vocab_per_kv_head)),
        head_dim=draw(st.sampled_from(head_dims)), d_model=draw(in_range(domain.d_model)),
        n_layers=draw(in_range(_at_least(domain.n_layers, needs.min_layers))),
        batch=draw(in_range(domain.batch)),
        seq_len=draw(in_range(domain.seq_len)), name="fuzz_convert")
    return dataclasses.replace(config, **draw(_variants(needs.variants)))


def _at_least(r: IntRange, lo: int) -> IntRange:
    """``r`` from its first member >= ``lo`` (``r`` itself when none is)."""
    first = next((v for v in range(r.lo, r.top + 1, r.step) if v >= lo), r.lo)
    return IntRange(first, r.hi, r.step)


def _multiples(r: IntRange, k: int, at_least: int = 1) -> list[int]:
    """Members of IntRange ``r`` that are multiples of ``k`` and at least ``at_least``."""
    return [v for v in range(r.lo, r.top + 1, r.step) if v % k == 0 and v >= at_least]


def endpoints(config: ModelConfig, names: tuple[str, ...] | None = None) -> list[Endpoint]:
    """Every (convention, degree) that can store ``config`` (of the conventions ``names``,
    default all), smallest degree first, then in ``CONVENTIONS`` order; degrees among the
    divisors of ``n_heads`` (every convention splits the query heads); then Megatron's
    options that change a dense layout: the vocabulary unpadded, and its pipeline stages
    (``staged_endpoints``)."""
    degrees = [t for t in range(1, config.n_heads + 1) if config.n_heads % t == 0]
    found = [endpoint(f"{name}:{t}") for t in degrees for name, conv in CONVENTIONS.items()
             if (names is None or name in names) and conv.supports(config, t)]
    if names is None or "megatron" in names:
        found += [e for t in degrees if (e := endpoint(f"megatron:tp={t},vocab=unpadded"))
                  and e.convention.supports(config, e)]
        found += staged_endpoints(config)
    assert found, f"{config}: none of {names or list(CONVENTIONS)} stores it"
    return found


def staged_endpoints(config: ModelConfig, max_world: int = 8) -> list[Endpoint]:
    """Megatron's pipeline splits of ``config`` within ``max_world`` ranks, drawn from
    Megatron's own rules (``stages.Pipeline``: what it refuses is left out): pp 2 to 4 at
    each TP degree, with virtual stages, an uneven first or last stage, or the embedding /
    loss counted as a layer; smallest world first."""
    degrees = [t for t in range(1, config.n_heads + 1) if config.n_heads % t == 0]
    texts = []
    for t in degrees:
        for pp in (2, 3, 4):
            base = f"megatron:tp={t},pp={pp}"
            texts += [base, base + ",vpp=2", base + ",pp_last=2", base + ",pp_first=1",
                      base + ",pp_account=embedding", base + ",pp_account=both",
                      base + ",vpp=2,pp_account=embedding"]
    found = []
    for text in texts:
        at = endpoint(text)
        if at.world <= max_world and at.convention.supports(config, at):
            found.append(at)
    return sorted(found, key=lambda e: e.world)


def staged_moe_endpoints(config: ModelConfig, max_world: int = 8) -> list[Endpoint]:
    """Megatron's MoE endpoints (``moe_endpoints``) over two pipeline stages, where Megatron
    splits the layers and the world stays within ``max_world``: TP x EP x PP together."""
    found = []
    for at in moe_endpoints(config):
        if at.name != "megatron":
            continue
        staged = dataclasses.replace(at, pp=2)
        if staged.world <= max_world and staged.convention.supports(config, staged):
            found.append(staged)
    return found


def case_end(at: Endpoint) -> tuple[str, int]:
    """How a ``ConversionCase`` names an end: ``("vllm", 2)`` for a convention at a TP degree,
    else the whole endpoint and its world (``("megatron:tp=2,pp=2", 4)``)."""
    if str(at) == f"{at.name}:{at.degree}":
        return at.name, at.degree
    return str(at), at.world


def _pairs(config: ModelConfig, mutation: str | None, eps: Sequence[Endpoint]
           ) -> list[tuple[Endpoint, Endpoint]]:
    """Ordered pairs of ``eps`` to draw from: every pair without a mutation; with one, the
    pairs where it applies and is not the identity, else (none live) those where it applies."""
    pairs = [(a, b) for a in eps for b in eps]
    if mutation is None:
        return pairs
    m = CONVERSION_MUTATIONS[mutation]
    applies = [(a, b) for a, b in pairs if m.not_applicable(Conversion(config, a, b)) is None]
    live = [(a, b) for a, b in applies if m.identity_reason(Conversion(config, a, b)) is None]
    assert applies, (f"{mutation} applies to no conversion of {config}: needs_for({mutation!r}) "
                     "does not draw what the mutation needs")
    return live or applies


# What a convention stores of the variants: Meta's checkpoints have no bias and never tie
# the output; Megatron stores no linear_proj bias without fc1 biases (see each module).
_CONVENTION_VARIANTS = {"meta": "plain", "megatron": "no_o_bias"}
_STRICTER = ("any", "no_o_bias", "plain")  # each a subset of the one before


def _variants_for(*names: str) -> str:
    return max((_CONVENTION_VARIANTS.get(n, "any") for n in names), key=_STRICTER.index)


@st.composite
def conversion_cases(draw: st.DrawFn, mutation: str | None = None,
                     domain: FuzzDomain = DOMAIN) -> ConversionCase:
    """A conversion to fuzz, and a seed.

    Without a mutation: the source and destination conventions first (each of
    ``CONVENTIONS`` equally likely at either end), a geometry whose variants both store
    (``conversion_geometries``), then each end's degree from those its convention supports
    there. With a mutation: ``conversion_geometries(needs_for(mutation))``, then an ordered
    endpoint pair where it applies, and is live where possible.

    Shrinks toward ``plain -> plain``, the smallest geometry, t = 1 and seed 0."""
    if mutation is None:
        names = list(CONVENTIONS)
        src_name, dst_name = draw(st.sampled_from(names)), draw(st.sampled_from(names))
        config = draw(conversion_geometries(domain, Needs(
            variants=_variants_for(src_name, dst_name))))
        src = draw(st.sampled_from(endpoints(config, (src_name,))))
        dst = draw(st.sampled_from(endpoints(config, (dst_name,))))
    else:
        config = draw(conversion_geometries(domain, needs_for(mutation)))
        src, dst = draw(st.sampled_from(_pairs(config, mutation, endpoints(config))))
    (src_name, src_world), (dst_name, dst_world) = case_end(src), case_end(dst)
    return ConversionCase(config=config, src_convention=src_name, src=src_world,
                          dst_convention=dst_name, dst=dst_world, seed=draw(seeds(domain)),
                          mutation=mutation)


# ---------------------------------------------------------------- Mixture-of-Experts

_MOE_NEEDS = {
    "local_expert_id_as_global": MoeNeeds(min_kv_heads=2),
    "ep_remainder_to_last": MoeNeeds(min_kv_heads=2, odd_experts=True),
    "router_bias_not_synced": MoeNeeds(router_bias=True, min_experts=4, wide_experts=True),
    "router_bias_negated": MoeNeeds(router_bias=True, min_experts=4, wide_experts=True),
    "fc1_etp_rank_concat": MoeNeeds(min_kv_heads=2),
    "fc2_split_on_wrong_dim": MoeNeeds(min_kv_heads=2),
    "expert_transposed_twice": MoeNeeds(square=True),
    "shared_gate_dropped": MoeNeeds(shared_gate=True, wide_shared=True),
    "qk_norm_from_next_layer": MoeNeeds(qk_norm=True, min_head_dim=4),
}


def moe_needs_for(mutation: str | None) -> MoeNeeds:
    """What an MoE geometry needs for ``mutation`` (an MoE conversion mutation) to be live
    somewhere in it; ``MoeNeeds()`` for none, or for a mutation live in every MoE geometry."""
    if mutation is not None and mutation not in CONVERSION_MUTATIONS:
        raise ValueError(f"unknown conversion mutation {mutation!r}; known: "
                         f"{', '.join(CONVERSION_MUTATIONS)}")
    return _MOE_NEEDS.get(mutation, MoeNeeds()) if mutation is not None else MoeNeeds()


@st.composite
def moe_conversion_cases(draw: st.DrawFn, mutation: str | None = None,
                         domain: FuzzDomain = DOMAIN, moe: MoeDomain = MOE_DOMAIN
                         ) -> ConversionCase:
    """An MoE conversion to fuzz: a geometry (``moe_geometries``, meeting what ``mutation``
    needs to be live), an ordered pair of its MoE endpoints (``moe_endpoints``: where the
    mutation applies, and is live where possible), a seed. The case names each end by its
    whole endpoint (``megatron:tp=2,ep=4``) and world size. Shrinks toward the smallest
    geometry, the smallest worlds and seed 0."""
    config = draw(moe_geometries(domain, moe, moe_needs_for(mutation)))
    src, dst = draw(st.sampled_from(_pairs(config, mutation, moe_endpoints(config)
                                           + staged_moe_endpoints(config))))
    return ConversionCase(config=config, src_convention=str(src), src=src.world,
                          dst_convention=str(dst), dst=dst.world, seed=draw(seeds(domain)),
                          mutation=mutation)

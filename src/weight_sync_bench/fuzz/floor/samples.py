"""The random-geometry floors' measuring loops (``weight_sync_bench.fuzz.floor``'s module)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from weight_sync_bench.check.checker import Checker, Forward
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.fuzz.domain import (
    DOMAIN,
    FuzzDomain,
    IntRange,
    fuzz_params,
    fuzz_tokens,
)
from weight_sync_bench.model.config import VARIANT_FIELDS, ModelConfig
from weight_sync_bench.tolerance.phase import REPLICATED_KV
from weight_sync_bench.tolerance.sampled import (
    random_floor_artifact,
    replicated_kv_artifact,
)


def relative_floor(config: ModelConfig, seed: int, *, forward: Forward = inprocess_forward,
                   phase: str = "1a") -> float:
    """The largest floor / max |reference logit| over the geometry's degrees (0 at t=1 only)."""
    checker = Checker(config, seed=seed, threshold=math.inf, phase=phase, forward=forward,
                      params=fuzz_params(config, seed), tokens=fuzz_tokens(config, seed))
    scale = float(checker.reference.abs().max())
    return max(checker.declared_error(t) / scale for t in checker.layout.supported_degrees())


def sample(config: ModelConfig, seed: int, *, forward: Forward = inprocess_forward,
           phase: str = "1a") -> list[dict[str, Any]]:
    """One geometry's floor at each supported degree, with every non-identity mutation's
    deviation there: one record per degree."""
    checker = Checker(config, seed=seed, threshold=math.inf, phase=phase, forward=forward,
                      params=fuzz_params(config, seed), tokens=fuzz_tokens(config, seed))
    scale = float(checker.reference.abs().max())
    records = []
    for degree in checker.layout.supported_degrees():
        declared = checker.declared(degree)
        kills = {m.name: checker.verdict(m.apply(declared, checker.layout, config),
                                         dst=degree).max_abs_error
                 for m in MUTATIONS.values() if m.identity_reason(config, degree) is None}
        records.append({"geometry": config.geometry(), "seed": seed, "degree": degree,
                        "scale": scale, "floor": checker.declared_error(degree), "kills": kills})
    return records


@dataclass(frozen=True)
class SampleProgress:
    """Yielded after each geometry: how many are done of how many."""

    done: int
    total: int
    config: ModelConfig


def measure_random(cases: Iterable[tuple[ModelConfig, int]], *, phase: str = "1a",
                   forward: Forward = inprocess_forward, domain: FuzzDomain = DOMAIN,
                   searched: Iterable[tuple[ModelConfig, int]] = (),
                   profile: str | None = None, hypothesis_seed: int | None = None,
                   search_examples: int = 0) -> Iterator[SampleProgress | dict[str, Any]]:
    """Sample the floor over random ``(geometry, seed)`` cases and over ``searched`` ones (the
    worst a targeted search found: the tail random draws miss); yields a ``SampleProgress``
    per case, then the artifact (``tolerance.sampled.random_floor_artifact``, not yet
    written). Every case must lie inside ``domain``."""
    labelled = [(c, s, "random") for c, s in cases] + [(c, s, "search") for c, s in searched]
    samples: list[dict[str, Any]] = []
    for i, (config, seed, origin) in enumerate(labelled):
        outside = domain.violations(config)
        if outside:
            raise ToleranceMismatch(f"floor sample {i} lies outside the fuzz domain: "
                                    + "; ".join(outside))
        samples.extend(record | {"origin": origin}
                       for record in sample(config, seed, forward=forward, phase=phase))
        yield SampleProgress(i + 1, len(labelled), config)
    random_cases = sum(1 for c in labelled if c[2] == "random")
    yield random_floor_artifact(samples, phase=phase, domain=domain.to_json(),
                                geometries=random_cases, searched=len(labelled) - random_cases,
                                search_examples=search_examples, profile=profile,
                                hypothesis_seed=hypothesis_seed)


def remeasure_floors(artifact: dict[str, Any], *, forward: Forward = inprocess_forward,
                     progress: Callable[[int, int, str], None] | None = None) -> list[float]:
    """Each sample's floor measured again in this process, under the kernels it runs: the
    same geometry, seed, tokens and degree, so only the kernels (``ATEN_CPU_CAPABILITY``)
    can make it differ. The mutation deviations are not re-measured: they are O(1) against
    a floor of O(1e-6), and no kernel set moves them by a figure a kill ratio shows.
    ``progress(done, total, what)`` after each sample."""
    phase = artifact["phase"]
    floors: list[float] = []
    key, checker = None, None
    for i, s in enumerate(artifact["samples"]):
        here = (tuple(sorted(s["geometry"].items())), s["seed"])
        if here != key:  # a geometry's degrees are adjacent: keep one checker alive
            config = ModelConfig(name=f"floor-sample-{i}", **s["geometry"])
            checker = Checker(config, seed=s["seed"], threshold=math.inf, phase=phase,
                              forward=forward, params=fuzz_params(config, s["seed"]),
                              tokens=fuzz_tokens(config, s["seed"]))
            key = here
        assert checker is not None
        floors.append(checker.declared_error(s["degree"]))
        if progress is not None:
            progress(i + 1, len(artifact["samples"]), f"sample d_model={s['geometry']['d_model']}")
    return floors


# -- the rule validated on vLLM's replicated-KV forward (t > n_kv_heads)

REPLICATION = (2, 4)  # KV-head replication factors t / n_kv_heads the conversion fuzz draws
REPLICATED_GEOMETRIES = 300  # the validation's default sample
REPLICATED_SEED = 20261201  # its default draw seed


def max_replicated_degree(domain: FuzzDomain = DOMAIN) -> int:
    """The largest degree vLLM stores a geometry of ``domain`` at: ``n_heads`` at most."""
    return domain.n_kv_heads.top * domain.group.top


def draw_replicated_geometries(n: int, seed: int, domain: FuzzDomain = DOMAIN
                               ) -> list[tuple[ModelConfig, int]]:
    """``n`` (geometry, model seed) cases of ``domain`` that vLLM stores at some t >
    n_kv_heads, drawn uniformly from ``random.Random(seed)`` as the conversion fuzz draws
    them (``strategies.conventions.conversion_geometries``: the replication factor k first,
    the query group and the ffn per KV head as multiples of k, then the rest, then the
    variants Qwen2 and Llama store: a qkv bias, attention_bias, tied embeddings). The first
    two are the smallest and the largest such geometry."""
    rng = random.Random(seed)

    def members(r: IntRange, multiple: int = 1) -> list[int]:
        return [v for v in range(r.lo, r.top + 1, r.step) if v % multiple == 0]

    def pick(r: IntRange, multiple: int = 1) -> int:
        return rng.choice(members(r, multiple))

    ks = [k for k in REPLICATION if members(domain.group, k) and members(domain.ffn_per_kv_head, k)]
    small = domain.config(n_kv_heads=domain.n_kv_heads.lo, group=members(domain.group, ks[0])[0],
                          head_dim=domain.head_dim.lo, d_model=domain.d_model.lo,
                          ffn_per_kv_head=members(domain.ffn_per_kv_head, ks[0])[0],
                          vocab_per_kv_head=domain.vocab_per_kv_head.lo,
                          n_layers=domain.n_layers.lo, batch=domain.batch.lo,
                          seq_len=domain.seq_len.lo)
    large = domain.config(n_kv_heads=domain.n_kv_heads.top,
                          group=members(domain.group, ks[-1])[-1], head_dim=domain.head_dim.top,
                          d_model=domain.d_model.top,
                          ffn_per_kv_head=members(domain.ffn_per_kv_head, ks[-1])[-1],
                          vocab_per_kv_head=domain.vocab_per_kv_head.top,
                          n_layers=domain.n_layers.top, batch=domain.batch.top,
                          seq_len=domain.seq_len.top)
    drawn = [(small, 0), (large, 0)]
    while len(drawn) < n:
        k = rng.choice(ks)
        config = domain.config(
            n_kv_heads=pick(domain.n_kv_heads), group=pick(domain.group, k),
            head_dim=pick(domain.head_dim), d_model=pick(domain.d_model),
            ffn_per_kv_head=pick(domain.ffn_per_kv_head, k),
            vocab_per_kv_head=pick(domain.vocab_per_kv_head), n_layers=pick(domain.n_layers),
            batch=pick(domain.batch), seq_len=pick(domain.seq_len))
        bias = rng.choice(["none", "qkv", "attention"])
        config = config.replace(qkv_bias=bias != "none", o_bias=bias == "attention",
                                tie_embeddings=rng.random() < 0.5)
        drawn.append((config, rng.randint(domain.seed.lo, domain.seed.top)))
    return drawn[:n]


def sample_replicated_kv(config: ModelConfig, seed: int,
                         max_degree: int = max_replicated_degree()) -> list[dict[str, Any]]:
    """One geometry's floor at each degree n_kv_heads < t <= ``max_degree`` (default: the
    fuzz domain's largest) vLLM stores it at: vLLM's forward
    of the declared shards against the reference (as ``fuzz.case.run_conversion_case``
    judges it), with each conversion mutation's deviation there, the mutation applied to the
    harness's conversion from the first source endpoint where it applies and is live (a
    RoPE mutation only where the geometry's tokens reach its ``min_seq_len``). One record
    per degree."""
    from weight_sync_bench.check.conversion import ConversionChecker
    from weight_sync_bench.check.floor import forward_of, replicated_degrees
    from weight_sync_bench.conventions import CONVENTIONS, convert, endpoint
    from weight_sync_bench.conventions.mutations import MUTATIONS as CONVERSION_MUTATIONS
    from weight_sync_bench.conventions.mutations import Conversion
    from weight_sync_bench.fuzz.case import make_checker

    checker = ConversionChecker(make_checker(config, seed, threshold_rule=lambda c, r: math.inf))
    assert checker.checker.reference is not None
    scale = float(checker.checker.reference.abs().max())
    sources = [endpoint(f"{n}:{t}") for n, c in CONVENTIONS.items()
               for t in c.supported_degrees(config, max_degree)]
    records = []
    for t in replicated_degrees(config, max_degree):
        dst = endpoint(f"vllm:{t}")
        assert forward_of(dst.convention, config, t) == REPLICATED_KV
        kills: dict[str, float] = {}
        for m in CONVERSION_MUTATIONS.values():
            if config.seq_len < m.min_seq_len:
                continue
            for src in sources:
                conversion = Conversion(config, src, dst)
                if m.not_applicable(conversion) is None and m.identity_reason(conversion) is None:
                    out = m.apply(convert(checker.source(src), src, dst, config), conversion)
                    kills[m.name] = checker.error(dst, out)
                    break
        records.append({"geometry": config.geometry(), "seed": seed, "degree": t,
                        "forward": REPLICATED_KV, "scale": scale,
                        "floor": checker.declared_error(dst), "kills": kills})
    return records


def measure_replicated_kv(cases: Iterable[tuple[ModelConfig, int]], *, phase: str = "1a",
                          domain: FuzzDomain = DOMAIN, seed: int | None = None,
                          progress: Callable[[int, int, str], None] | None = None
                          ) -> dict[str, Any]:
    """The validation artifact (``tolerance.sampled.replicated_kv_artifact``, not yet
    written): every case's ``sample_replicated_kv`` records, the domain, and the figures of
    the rule in force (provenance: a check re-derives them from the samples).
    ``progress(done, total, what)`` after each case."""
    if phase != "1a":
        raise ToleranceMismatch(f"conversions are fuzzed in process (phase 1a), got {phase!r}")
    cases = list(cases)
    samples: list[dict[str, Any]] = []
    top = max_replicated_degree(domain)  # the degrees sampled are the ones the artifact records
    for i, (config, model_seed) in enumerate(cases):
        outside = domain.violations(config)
        if outside:
            raise ToleranceMismatch(f"replicated-KV sample {i} lies outside the fuzz domain: "
                                    + "; ".join(outside))
        samples += sample_replicated_kv(config, model_seed, top)
        if progress is not None:
            progress(i + 1, len(cases), f"geometry d_model={config.d_model} "
                                        f"kv_heads={config.n_kv_heads}")
    if not samples:
        raise ToleranceMismatch("no replicated-KV sample: no case is stored by vLLM past "
                                "n_kv_heads")
    return replicated_kv_artifact(samples, phase=phase, forward=REPLICATED_KV,
                                  domain=domain.to_json(), geometries=len(cases),
                                  draw_seed=seed, max_degree=top)


def remeasure_replicated_floors(artifact: dict[str, Any],
                                progress: Callable[[int, int, str], None] | None = None
                                ) -> list[float]:
    """Each validation sample's floor measured again in this process (its kernels);
    ``progress(done, total, what)`` after each sample."""
    from weight_sync_bench.check.conversion import ConversionChecker
    from weight_sync_bench.conventions import endpoint
    from weight_sync_bench.fuzz.case import make_checker

    floors, key, checker = [], None, None
    for i, s in enumerate(artifact["samples"]):
        here = (tuple(sorted(s["geometry"].items())), s["seed"])
        if here != key:  # a geometry's degrees are adjacent
            config = config_of(s["geometry"], f"replicated-sample-{i}")
            checker = ConversionChecker(make_checker(config, s["seed"],
                                                     threshold_rule=lambda c, r: math.inf))
            key = here
        assert checker is not None
        floors.append(checker.declared_error(endpoint(f"vllm:{s['degree']}")))
        if progress is not None:
            progress(i + 1, len(artifact["samples"]), f"sample t={s['degree']}")
    return floors


def config_of(geometry: dict[str, int], name: str) -> ModelConfig:
    """The config a sample's recorded geometry names (``ModelConfig.geometry`` writes a
    variant's bool as 0/1, as a corpus entry does)."""
    fields = {k: bool(v) if k in VARIANT_FIELDS and k != "vocab_multiple" else v
              for k, v in geometry.items()}
    return ModelConfig(name=name, **fields)



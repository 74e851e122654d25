"""The threshold the fuzz judges a drawn geometry by, and where it may: the random-geometry
rule inside the domain its samples covered (``fuzz_threshold_rule``), vLLM's replicated-KV
forward only where a measurement of it validates that rule (``require_replicated_kv``), and
a Mixture-of-Experts geometry only where a measurement of the MoE forwards validates it
(``require_moe``). The rules themselves are ``tolerance.sampled``'s and
``tolerance.sampled_moe``'s; the loops that measure the samples are ``fuzz.floor``'s."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check.floor import forward_of
from weight_sync_bench.conventions.mutations import MOE_MUTATIONS
from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN, FuzzDomain, MoeDomain, is_builtin
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance.artifacts import artifact_path, mtime
from weight_sync_bench.tolerance.rules import floor_for, strict_environment, threshold_for
from weight_sync_bench.tolerance.sampled import (
    SampledRule,
    environment_notes,
    load_random_floor,
    replicated_kv_command,
    replicated_kv_path,
    rule_from,
    why_not_validated,
)
from weight_sync_bench.tolerance.sampled_moe import moe_command, moe_path, why_moe_not_validated

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint


@dataclass(frozen=True)
class FuzzThreshold:
    """The threshold for any geometry the fuzz draws (a ``check.checker.ThresholdRule``):
    the seed's rule for TOY and TOY_KV4; ``rule`` (the phase's random-geometry rule, read from
    ``path``) for a dense geometry inside ``domain``, the domain its samples covered; for an
    MoE geometry ``rule`` only where the MoE validation validates it (``require_moe``); a
    typed error elsewhere. A type of its own, not a closure, so that a conversion case run
    under it knows the rule is the fuzz's default and asks for the validation of its
    destination's forward (``fuzz.case.run_conversion_case``)."""

    phase: str
    path: Path
    rule: SampledRule
    domain: FuzzDomain

    def __call__(self, config: ModelConfig, reference: torch.Tensor) -> float:
        if is_builtin(config):
            return threshold_for(config, self.phase)
        if config.n_experts:
            require_moe(config, self.phase, domain=self.domain)
            return self.rule(config, reference)
        outside = self.domain.violations(config)
        if outside:
            raise ToleranceMismatch(
                f"{config.name}: no threshold outside the sampled domain ({self.path}): "
                + "; ".join(outside))
        return self.rule(config, reference)


def fuzz_threshold_rule(phase: str = "1a", path: Path | None = None) -> FuzzThreshold:
    """The threshold for any geometry the fuzz draws (``FuzzThreshold``), its artifact read
    now: a missing or foreign one is refused before any example runs."""
    path = path or artifact_path(phase, kind="random_floor")
    rule, domain = _rule_and_domain(phase, path, mtime(path))
    if strict_environment():  # WSB_STRICT_ENV / --strict-env: a foreign floor is refused
        environment_notes(phase, path)
    return FuzzThreshold(phase, path, rule, domain)


@functools.lru_cache(maxsize=8)
def _rule_and_domain(phase: str, path: Path, stamp: int | None
                     ) -> tuple[SampledRule, FuzzDomain]:
    """Read once per version of the file (the key holds its mtime): every fuzzed example
    asks for the rule, and re-deriving it from a thousand samples each time would dominate."""
    artifact = load_random_floor(phase, path)
    return rule_from(artifact), FuzzDomain.from_json(artifact["domain"])


def require_replicated_kv(config: ModelConfig, degree: int, phase: str = "1a",
                          path: Path | None = None) -> None:
    """Raise ``FloorNotMeasured`` unless the threshold of a fuzzed conversion to vLLM at
    ``degree`` (> n_kv_heads: the replicated-KV forward) comes from a measurement of that
    forward: for TOY and TOY_KV4 the committed phase floor's cell at ``degree``
    (``check.convert.require_cell``); for a fuzzed geometry the validation artifact, which
    must validate the rule in force there (``tolerance.sampled.why_not_validated``)."""
    from weight_sync_bench.check.convert import require_cell
    from weight_sync_bench.conventions import endpoint

    if is_builtin(config):
        require_cell(floor_for(config, phase), config, endpoint(f"vllm:{degree}"))
        return
    path = path or replicated_kv_path(phase)
    command = replicated_kv_command(phase)
    what = (f"{config.name}: the random-geometry rule judges vLLM at t={degree} > n_kv_heads="
            f"{config.n_kv_heads} (the replicated-KV forward) only where {path.name} "
            "validates it")
    try:
        why = why_not_validated(degree, phase, path)
    except ToleranceMismatch as exc:
        raise FloorNotMeasured(f"{what}: {exc}", command=command) from None
    if why is not None:
        raise FloorNotMeasured(f"{what}: {why}. Measure it with `{command}`", command=command)


def moe_seq_lens(domain: FuzzDomain = DOMAIN) -> list[int]:
    """The sequence lengths past ``domain``'s longest at which an MoE conversion mutation's
    forward runs (``ConversionMutation.min_seq_len``: the router-bias mutations' 32 tokens,
    where a selection-only bug moves some token's choice): the MoE validation measures them,
    and ``require_moe`` admits them."""
    return sorted({m.min_seq_len for m in MOE_MUTATIONS if m.min_seq_len > domain.seq_len.top})


def require_moe(config: ModelConfig, phase: str = "1a", path: Path | None = None, *,
                where: Endpoint | None = None, domain: FuzzDomain = DOMAIN,
                moe: MoeDomain = MOE_DOMAIN) -> None:
    """Raise unless the random-geometry rule may judge the MoE geometry ``config`` (at the
    destination ``where``, when given): ``ToleranceMismatch`` naming each field outside
    ``domain`` x ``moe`` (a sequence of one of ``moe_seq_lens`` tokens is inside: the length a
    mutation's forward runs); ``FloorNotMeasured`` naming the command unless the MoE
    validation (``random_floor_<phase>_moe.json``) validates the rule in force for it
    (``tolerance.sampled_moe.why_moe_not_validated``: the domains, zero false positives,
    ``SAFETY`` x headroom over the floors and the routing deviations, ``where``'s forward at
    its world, the sequence length where it is past the domain's)."""
    longer = config.seq_len if (config.seq_len > domain.seq_len.top
                                and config.seq_len in moe_seq_lens(domain)) else None
    inside = config.replace(seq_len=domain.seq_len.top) if longer else config
    outside = moe.violations(inside, domain)
    if outside:
        raise ToleranceMismatch(f"{config.name}: no threshold outside the sampled MoE domain: "
                                + "; ".join(outside))
    path = path or moe_path(phase)
    command = moe_command(phase)
    world = forward = None
    here = ""
    if where is not None:
        # a staged endpoint's forward is its unstaged one's, over one stage's ranks
        world = (where.unstaged() if where.staged else where).world
        forward = forward_of(where.convention, config, where)
        here = f" (its {forward} forward over {world} ranks, at {where})"
    what = (f"{config.name}: the random-geometry rule judges a Mixture-of-Experts geometry"
            f"{here} only where {path.name} validates it")
    try:
        why = why_moe_not_validated(phase, path, moe_domain=moe.to_json(), world=world,
                                    forward=forward, seq_len=longer)
    except ToleranceMismatch as exc:
        raise FloorNotMeasured(f"{what}: {exc}", command=command) from None
    if why is not None:
        raise FloorNotMeasured(f"{what}: {why}. Measure it with `{command}`", command=command)

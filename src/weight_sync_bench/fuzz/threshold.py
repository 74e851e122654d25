"""The threshold the fuzz judges a drawn geometry by, and where it may: the random-geometry
rule inside the domain its samples covered (``fuzz_threshold_rule``), and vLLM's
replicated-KV forward only where a measurement of it validates that rule
(``require_replicated_kv``). The rules themselves are ``tolerance.sampled``'s; the loops that
measure the samples are ``fuzz.floor``'s."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.fuzz.domain import FuzzDomain, is_builtin
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


def fuzz_threshold_rule(phase: str = "1a", path: Path | None = None
                        ) -> Callable[[ModelConfig, torch.Tensor], float]:
    """The threshold for any geometry the fuzz draws: the seed's rule for TOY and TOY_KV4,
    the chosen sampled rule for geometries inside the sampled domain, an error elsewhere."""
    path = path or artifact_path(phase, kind="random_floor")
    rule, domain = _rule_and_domain(phase, path, mtime(path))
    if strict_environment():  # WSB_STRICT_ENV / --strict-env: a foreign floor is refused
        environment_notes(phase, path)

    def threshold(config: ModelConfig, reference: torch.Tensor) -> float:
        if is_builtin(config):
            return threshold_for(config, phase)
        outside = domain.violations(config)
        if outside:
            raise ToleranceMismatch(
                f"{config.name}: no threshold outside the sampled domain ({path}): "
                + "; ".join(outside))
        return rule(config, reference)

    return threshold




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


"""The training floors under sequence and context parallelism: their measuring loop.

    wsb floor sequence --write              # tolerance/sequence.json
    wsb floor sequence --phase 1b --write   # sequence_1b.json

The same quantities, deviations and rule as ``training.floor`` (``tolerance.training``: the
smallest power of ten at or above 100x the worst, per quantity and regime), over the meshes
that shard the
sequence: every config of the training domain (TOY, TOY_KV4, TOY with every variant, the
small variants), unpacked and packed (and the packed batch with a row of padding alone),
at every supported TP degree with and without SP (SP from t = 2), CP of 1, 2 and 4 where
the sequence splits evenly, dp of 1 and 2; the plain DP x TP shapes are training.json's.
The "cancelling" regime repeats the adversarial cancelling partial sums under SP and CP.
A floor is not reused across meshes that reorder different sums: this artifact is the
SP / CP one, and ``thresholds_for`` reads it for every mesh with ``sp`` or ``cp > 1``.
Nor across phases: phase 1b (over gloo, one process per rank of dp x cp x tp) has
``sequence_1b.json``, measured on the same domain's meshes that ``floor.over_gloo`` admits
(at most ``GLOO_WORLD`` ranks, cp <= ``GLOO_MAX_CP``; the meshes with dp or cp > 1 on the
first ``GLOO_ADDED_SEEDS`` seeds; ``floor.in_domain``); a phase 1b mesh it has no cell for
is refused
(``floor.require_mesh``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weight_sync_bench.model.config import TOY, TOY_KV4, ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.training import load
from weight_sync_bench.training import adversarial
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.floor import (
    PACKED_WITH_EMPTY_ROW,
    REPETITIONS,
    SMALL_VARIANTS,
    STEPS,
    TOY_VARIANTS,
    Groups,
    measure,
)
from weight_sync_bench.training.floor import thresholds_for as _thresholds_for
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.step import TrainingCase

KIND = "sequence"
CP_DEGREES = (1, 2, 4)


def sequence_meshes(config: ModelConfig, rows: int, seq_len: int,
                    dps: tuple[int, ...] = (1, 2)) -> list[Mesh]:
    """Every mesh of a config that shards the sequence: each supported TP degree, SP on
    (t >= 2) or off, CP in ``CP_DEGREES`` where ``seq_len`` splits evenly (and each chunk
    over t under SP), ``dps`` up to the rows; never the plain DP x TP shape."""
    out = []
    for tp, cp, sp in itertools.product(layout_for(config).supported_degrees(), CP_DEGREES,
                                        (False, True)):
        if (not sp and cp == 1) or (sp and tp == 1) or seq_len % cp or (
                sp and (seq_len // cp) % tp):
            continue
        out += [Mesh(dp, tp, sp, cp) for dp in dps if dp <= rows]
    return out


def _groups(repetitions: int, steps: int) -> Groups:
    """Every phase's cases; ``measure`` keeps those of its phase's domain
    (``floor.in_domain``)."""
    groups: Groups = []
    for config in (TOY, TOY_KV4, TOY_VARIANTS, *SMALL_VARIANTS):
        specs = [default_spec(config, packed=False), default_spec(config, packed=True)]
        if config.batch == PACKED_WITH_EMPTY_ROW.rows and config.seq_len == 8:
            specs.append(PACKED_WITH_EMPTY_ROW)
        for spec, seed in itertools.product(specs, range(repetitions)):
            params = init_params(config, seed)
            label = f"{config.name} {'packed' if spec.packed else 'unpacked'} seed={seed}"
            groups.append(("plain", label,
                           [TrainingCase(config, m, seed, steps, spec, params)
                            for m in sequence_meshes(config, spec.rows, spec.seq_len)]))
    for config, seed in itertools.product(SMALL_VARIANTS, range(repetitions)):
        spec = default_spec(config, packed=True)
        for t in (d for d in layout_for(config).supported_degrees() if d >= 2 and d % 2 == 0):
            cancel = adversarial.cancelling(config, init_params(config, seed), t)
            ms = [m for m in sequence_meshes(config, spec.rows, spec.seq_len) if m.tp == t]
            groups.append(("cancelling", f"{config.name} cancelling t={t} seed={seed}",
                           [TrainingCase(config, m, seed, steps, spec, cancel) for m in ms]))
    return groups


def measure_sequence(repetitions: int = REPETITIONS, steps: int = STEPS, phase: str = "1a",
                     progress: Callable[[int, int, str], None] | None = None
                     ) -> dict[str, Any]:
    return measure(repetitions, steps, phase, groups=_groups(repetitions, steps), kind=KIND,
                   progress=progress)


def load_sequence(path: Path | None = None, phase: str = "1a") -> dict[str, Any]:
    return load(path or artifact_path(phase, kind=KIND), phase=phase, kind=KIND)


def thresholds_for(config: ModelConfig, mesh: Mesh, regime: str = "plain",
                   artifact: dict[str, Any] | None = None, phase: str = "1a"
                   ) -> dict[str, float]:
    """The thresholds for a case: from sequence[_1b].json when the mesh shards the sequence
    (sp or cp > 1), else from training[_1b].json; ToleranceMismatch outside the measured
    domain, and ``FloorNotMeasured`` for a phase 1b mesh its artifact has no cell for
    (``floor.require_mesh``)."""
    if not (mesh.sp or mesh.cp > 1):
        return _thresholds_for(config, regime, artifact, phase=phase, mesh=mesh)
    return _thresholds_for(config, regime,
                           artifact if artifact is not None else load_sequence(phase=phase),
                           mesh=mesh)

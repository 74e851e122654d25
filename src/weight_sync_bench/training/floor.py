"""The floor of each training quantity, measured: the training floors' measuring loop.

    wsb floor training --write              # tolerance/training.json
    wsb floor training --phase 1b --write   # training_1b.json

(``python -m weight_sync_bench.tolerance training ...`` is the same command.) The correct
sharded training differs from the dense one only by reordered sums. Each quantity of
``tolerance.training.QUANTITIES`` is measured over a domain of cases: both named configs
and TOY with every variant at every supported DP x TP shape; small geometries with every
variant (padded vocab, tied embeddings, biases, packed documents with a row of padding
alone); and the adversarial values (cancelling partial sums, the maximum and the target on
different ranks, loud biases); over ``repetitions`` seeds. ``tolerance.training`` records
the worst deviation of each quantity and where it was seen, and derives its threshold, per
regime (cancelling partial sums get a floor of their own). ``replicas`` is compared exactly
and has no threshold. Phase 1b (over gloo) has its own artifact: a floor is not reused
across phases. Nor across meshes over gloo: a mesh is a different order of gloo's sums, so
a phase 1b check of a (config, mesh) its artifact has no cell for is refused
(``require_mesh``: ``FloorNotMeasured`` naming the mesh and the command that measures it),
never judged by the nearest cell.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.model.config import TOY, TOY_KV4, ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance import training as record
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.training import (
    DOMAIN_FIELDS,
    QUANTITIES,
    REGIMES,
    domain_of,
    load,
    measure_command,
    measured_meshes,
    thresholds_within,
)
from weight_sync_bench.training import adversarial
from weight_sync_bench.training.batches import BatchSpec, default_spec
from weight_sync_bench.training.compare import EXACT, Trace
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.step import Params, TrainingCase

REPETITIONS = 2
STEPS = 3
# "cancelling": row-parallel partial sums that cancel to 1e-3 of themselves (adversarial),
# whose results carry 1e3 times the relative rounding error: a floor of its own.
SMALL = ModelConfig(name="small", vocab=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                    head_dim=8, ffn=48, batch=4, seq_len=8, vocab_multiple=4)  # vocab 52 padded
SMALL_VARIANTS = (
    SMALL,
    SMALL.replace(name="small_tied_bias", tie_embeddings=True, bias=True),
    SMALL.replace(name="small_gqa_bias", n_kv_heads=2, bias=True, d_model=64, ffn=96),
)
# TOY's geometry with every variant on: vocab 31999 padded to 32000, tied, biased
TOY_VARIANTS = TOY.replace(name="toy_variants", vocab=31999, vocab_multiple=4,
                           tie_embeddings=True, bias=True)
# packed rows with 1-3 documents, uneven padding and a row of padding alone
PACKED_WITH_EMPTY_ROW = BatchSpec(((3, 5), (2,), (), (4, 1, 2)), seq_len=8, ignore_rate=0.25,
                                  packed=True)


PHASES = ("1a", "1b")  # in process; over gloo, one process per rank of the mesh

# Phase 1b's domain: the 1a domain's meshes the gloo train-check runs, one process per rank
# (``training.gloo``: gloo's ring all-reduce sums in an order of its own, so no in-process
# cell covers them), up to GLOO_WORLD ranks and CP up to GLOO_MAX_CP. Each rank is a process
# and this machine has 2 cores: with the DP x TP and CP meshes, both 1b artifacts under all
# three kernel sets took 44 minutes (17 + 27, 2026-12-01), so the meshes of the first
# measurement (dp = cp = 1) keep every seed and those added after it (dp or cp > 1) are
# measured on the first GLOO_ADDED_SEEDS seeds.
GLOO_WORLD = 8
GLOO_MAX_CP = 2
GLOO_ADDED_SEEDS = 1


def over_gloo(mesh: Mesh, seed: int | None = None) -> bool:
    """Whether phase 1b's domain trains ``mesh`` (at ``seed``; None: at any seed): at most
    GLOO_WORLD ranks and CP of at most GLOO_MAX_CP; a mesh with dp or cp > 1 on the first
    GLOO_ADDED_SEEDS seeds only."""
    if mesh.dp * mesh.cp * mesh.tp > GLOO_WORLD or mesh.cp > GLOO_MAX_CP:
        return False
    return seed is None or (mesh.dp == 1 and mesh.cp == 1) or seed < GLOO_ADDED_SEEDS


def in_domain(phase: str, mesh: Mesh, seed: int) -> bool:
    """Whether ``phase``'s domain trains ``mesh`` at ``seed``: every case in process (1a);
    over gloo (1b), ``over_gloo``'s meshes and seeds."""
    return phase == "1a" or over_gloo(mesh, seed)


def gloo_domain() -> dict[str, Any]:
    """Phase 1b's mesh domain as the artifact records it."""
    return {"max_ranks": GLOO_WORLD, "max_cp": GLOO_MAX_CP,
            "seeds": "every seed at dp = cp = 1; the first "
                     f"{GLOO_ADDED_SEEDS} with dp or cp > 1"}


def meshes(config: ModelConfig, rows: int) -> list[Mesh]:
    """Every DP x TP shape of a config: each supported TP degree, DP of 1, 2, 4 (<= rows)."""
    return [Mesh(dp, tp) for tp in layout_for(config).supported_degrees()
            for dp in (1, 2, 4) if dp <= rows]


def _cases(repetitions: int, steps: int) -> list[tuple[str, str, list[TrainingCase]]]:
    """(regime, label, cases sharing one reference) over the whole measured domain."""
    groups: list[tuple[str, str, list[TrainingCase]]] = []
    specs: list[tuple[ModelConfig, BatchSpec]] = []
    for config in (TOY, TOY_KV4, TOY_VARIANTS, *SMALL_VARIANTS):
        specs += [(config, default_spec(config, packed=False)),
                  (config, default_spec(config, packed=True))]
        if config.batch == PACKED_WITH_EMPTY_ROW.rows and config.seq_len == 8:
            specs.append((config, PACKED_WITH_EMPTY_ROW))
    for (config, spec), seed in itertools.product(specs, range(repetitions)):
        params = init_params(config, seed)
        label = f"{config.name} {'packed' if spec.packed else 'unpacked'} seed={seed}"
        groups.append(("plain", label, [TrainingCase(config, m, seed, steps, spec, params)
                               for m in meshes(config, spec.rows)]))
    for config, seed in itertools.product(SMALL_VARIANTS, range(repetitions)):
        spec = default_spec(config, packed=True)
        params = init_params(config, seed)
        if config.bias:
            params = adversarial.loud_biases(config, params)
        for t in (d for d in layout_for(config).supported_degrees() if d >= 2):
            ms = [Mesh(dp, t) for dp in (1, 2)]
            if t % 2 == 0:
                cancel = adversarial.cancelling(config, params, t)
                groups.append(("cancelling", f"{config.name} cancelling t={t} seed={seed}",
                               [TrainingCase(config, m, seed, steps, spec, cancel) for m in ms]))
            base = TrainingCase(config, ms[0], seed, steps, spec, params)
            far = adversarial.max_elsewhere(base, t)
            groups.append(("plain", f"{config.name} max_elsewhere t={t} seed={seed}",
                           [_with_mesh(far, m) for m in ms]))
    return groups


def _with_mesh(case: TrainingCase, mesh: Mesh) -> TrainingCase:
    out = TrainingCase(case.config, mesh, case.seed, case.steps, case.spec, case.params,
                       case.adamw)
    out.batches = case.batches
    return out


Groups = list[tuple[str, str, list[TrainingCase]]]  # (regime, label, cases sharing a reference)


def measure(repetitions: int = REPETITIONS, steps: int = STEPS, phase: str = "1a", *,
            groups: Groups | None = None, kind: str = "training",
            train: Callable[[TrainingCase], Trace | None] | None = None,
            progress: Callable[[int, int, str], None] | None = None,
            regimes: Sequence[str] = REGIMES) -> dict[str, Any]:
    """Run every case of the domain (``groups``, default the DP x TP one) correctly and
    return the artifact of the worst of each quantity (``tolerance.training.artifact``).
    Phase 1b trains over gloo on a rank pool, on the cases of its domain (``in_domain``; a
    group left empty is skipped). ``kind`` names the artifact (``sequence_floor`` measures
    the SP / CP domain into one of its own). ``train`` trains a case's sharded side (its
    forward and backward; default the phase's: in process, or over gloo on the shared rank
    pool). ``progress(done, total, what)`` after each group of cases sharing a reference."""
    train = _trainer(phase) if train is None else train
    worst = {regime: {q: {"worst": 0.0, "case": "", "where": ""} for q in QUANTITIES}
             for regime in regimes}  # ``regimes``: those ``groups`` measure
    cells, domain = [], {f: 0 for f in DOMAIN_FIELDS}
    never = dict.fromkeys(QUANTITIES, float("inf"))
    every = groups if groups is not None else _cases(repetitions, steps)
    for done, (regime, label, cases) in enumerate(every, start=1):
        cases = [c for c in cases if in_domain(phase, c.mesh, c.seed)]
        if not cases:
            continue
        reference = cases[0].reference()
        for case in cases:
            report = case.check(never, reference=reference, trained=train(case))
            for exact in EXACT:
                if report[exact].deviation != 0.0:
                    raise ToleranceMismatch(f"{label} {case.mesh}: {exact} is "
                                            f"{report[exact].deviation} in a correct run, not 0")
            row: dict[str, Any] = {"regime": regime, "case": f"{label} {case.mesh}"}
            for c in report.comparisons:
                if c.quantity in QUANTITIES:
                    row[c.quantity] = c.deviation
                    if c.deviation > worst[regime][c.quantity]["worst"]:
                        worst[regime][c.quantity] = {"worst": c.deviation, "case": row["case"],
                                                     "where": c.where}
            cells.append(row)
            for f, v in domain_of(case.config).items():
                domain[f] = max(domain[f], v)
        if progress is not None:
            progress(done, len(every), label)
    return record.artifact(kind, phase, repetitions, steps, worst, cells, domain,
                           gloo_domain() if phase == "1b" else None)


def _trainer(phase: str) -> Callable[[TrainingCase], Trace | None]:
    """How a phase trains the sharded side: None (in process, by ``TrainingCase.check``), or
    over gloo on the process's shared rank pool."""
    if phase not in PHASES:
        raise ToleranceMismatch(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    if phase == "1a":
        return lambda case: None
    from weight_sync_bench.collectives.gloo.pool import (
        shared_pool,  # the gloo launcher, only when asked
    )
    from weight_sync_bench.training.gloo import train_gloo
    pool = shared_pool(GLOO_WORLD)
    return lambda case: train_gloo(case, pool)


# a cell's case: "<config> <batch or adversary> seed=<s> <mesh>", the mesh as Mesh.__str__
def require_mesh(artifact: dict[str, Any], config: ModelConfig, mesh: Mesh,
                 regime: str = "plain") -> None:
    """Raise ``FloorNotMeasured`` unless ``artifact`` has a ``regime`` cell of ``config``
    trained on ``mesh``, as ``check.convert.require_cell`` refuses a conversion its floor
    never measured: over gloo a mesh sums in an order of its own (gloo's ring all-reduce,
    not the in-process rank order), so the nearest measured mesh does not judge it. The
    error names the mesh, its ranks, the meshes the artifact measured for the config, and
    the command that measures it (``command``)."""
    had = measured_meshes(artifact, config.name, regime)
    if str(mesh) in had:
        return
    kind, phase = str(artifact.get("kind", "training")), str(artifact.get("phase", "1a"))
    path = artifact_path(phase, kind=kind)
    ranks = mesh.dp * mesh.cp * mesh.tp
    command = measure_command(kind, phase)
    why = (f"{config.name}: no measured {kind} floor covers mesh {mesh} ({ranks} ranks, "
           f"phase {phase}, {regime} regime): {path.name} measured {config.name} at "
           f"{'; '.join(had) if had else 'no mesh'}; a threshold measured on another mesh "
           "(another order of the sums) does not judge it")
    if phase == "1b" and not over_gloo(mesh):
        why += (f". Phase 1b's domain (training.floor.over_gloo) stops at {GLOO_WORLD} ranks "
                f"and cp <= {GLOO_MAX_CP}, so no measurement has this cell: widen it "
                f"(GLOO_WORLD, GLOO_MAX_CP) and measure with `{command}`")
    else:
        why += f". Measure it with `{command}`"
    raise FloorNotMeasured(why, command=command)


def thresholds_on(config: ModelConfig, params: Params, mesh_list: Sequence[Mesh],
                  spec: BatchSpec, steps: int, seeds: Sequence[int], phase: str = "1a",
                  train: Callable[[TrainingCase], Trace | None] | None = None
                  ) -> dict[str, float]:
    """Thresholds for training ``params`` (a user's weights), measured on them: the correct
    sharded training on each of ``mesh_list`` at batch seeds ``seeds`` (never the checked
    run's own batches) against the dense one, the worst of each quantity as ``measure``
    records it, then ``thresholds_within``. A floor measured on other weights never judges
    them."""
    groups: Groups = [("plain", f"{config.name} your-weights seed={s}",
                       [TrainingCase(config, m, s, steps, spec, params) for m in mesh_list])
                      for s in seeds]
    return thresholds_within(config, measure(groups=groups, phase=phase, train=train,
                                             regimes=("plain",)), "plain")


def thresholds_for(config: ModelConfig, regime: str = "plain",
                   artifact: dict[str, Any] | None = None, phase: str = "1a",
                   mesh: Mesh | None = None) -> dict[str, float]:
    """The thresholds for a config inside the measured domain; ToleranceMismatch outside.
    With ``mesh``, a phase 1b artifact (over gloo) must also have a cell of the config on
    that mesh (``require_mesh``)."""
    artifact = artifact if artifact is not None else load(phase=phase)
    if mesh is not None and artifact.get("phase") == "1b":
        require_mesh(artifact, config, mesh, regime)
    return thresholds_within(config, artifact, regime)



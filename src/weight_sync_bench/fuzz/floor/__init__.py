"""The random-geometry floors' measuring loops: floor samples on geometries of the fuzz domain.

The floor moves with the geometry (roughly linear in d_model, and with depth and token
count), so a fuzzed geometry cannot borrow TOY's threshold, and it has no measurement of its
own. ``measure_random`` samples the floor, and the deviation of every mutation, over
geometries drawn from the fuzz domain, plus the worst a targeted search found (Hypothesis's
target phase aimed at floor / max |reference logit|: random draws miss that tail, which the
fuzz's own ``target()`` then finds, at d_model 8 three times their worst);
``tolerance.sampled`` records them (``tolerance/random_floor_<phase>.json``) and derives the
rule the fuzz applies (``fuzz_threshold_rule``: the rule inside the domain it was sampled
over, TOY's own floor for TOY and TOY_KV4, a refusal elsewhere). ``remeasure_floors``
measures a committed artifact's samples again, under the kernels of this process: what
``wsb floor random --from PATH`` runs under each kernel set (``tolerance.kernels``).

The samples are the plain layout's forward. A fuzzed conversion to vLLM at t > n_kv_heads
runs another one (each KV head replicated over t / n_kv_heads ranks, ``HeadReplicated``),
so the rule judges it only where ``random_floor_<phase>_replicated_kv.json`` validates it
there (``measure_replicated_kv``: random geometries of the fuzz domain at every such degree,
vLLM's forward of the declared shards, and the conversion mutations live there), with zero
false positives and ``SAFETY`` x headroom under the rule in force, and at the drawn degree
(``require_replicated_kv``, which ``fuzz.case.run_conversion_case`` calls); a missing or
failing validation refuses the case, naming the command that measures it.

A fuzzed Mixture-of-Experts conversion runs the MoE forwards (experts chosen per token,
split over every rank or whole on expert-parallel ranks), and its selection-only mutations
run 32 tokens: the rule judges it only where ``random_floor_<phase>_moe.json`` validates it
there (``fuzz.floor.moe.measure_moe``: MoE geometries drawn as the MoE fuzz draws them, at
every forward of their MoE endpoints, with the routing deviation, the near ties and the MoE
mutations' kills), with zero false positives and ``SAFETY`` x headroom over the floors and
the routing deviations (``require_moe``, which ``fuzz.threshold.FuzzThreshold`` and
``fuzz.case.run_conversion_case`` call).

``wsb floor random``, ``wsb floor replicated-kv`` and ``wsb floor moe`` run these loops
(``cli.floor``); ``python -m weight_sync_bench.fuzz.floor replicated-kv ...`` (or ``moe``)
is the same command.
"""

from weight_sync_bench.fuzz.floor.moe import (
    MOE_GEOMETRIES,
    MOE_MAX_WORLD,
    MOE_SEED,
    coverage_cases,
    coverage_grid,
    coverage_reach,
    endpoint_deviation,
    forward_groups,
    measure_moe,
    remeasure_moe_floors,
    sample_moe,
    sample_moe_geometry,
)
from weight_sync_bench.fuzz.threshold import (
    fuzz_threshold_rule,
    moe_seq_lens,
    require_moe,
    require_replicated_kv,
)
from weight_sync_bench.fuzz.floor.samples import (
    REPLICATED_GEOMETRIES,
    REPLICATED_SEED,
    REPLICATION,
    SampleProgress,
    config_of,
    draw_replicated_geometries,
    max_replicated_degree,
    measure_random,
    measure_replicated_kv,
    relative_floor,
    remeasure_floors,
    remeasure_replicated_floors,
    sample,
    sample_replicated_kv,
)

__all__ = [
    "MOE_GEOMETRIES",
    "MOE_MAX_WORLD",
    "MOE_SEED",
    "REPLICATED_GEOMETRIES",
    "REPLICATED_SEED",
    "REPLICATION",
    "SampleProgress",
    "config_of",
    "coverage_cases",
    "coverage_grid",
    "coverage_reach",
    "draw_replicated_geometries",
    "endpoint_deviation",
    "forward_groups",
    "fuzz_threshold_rule",
    "max_replicated_degree",
    "measure_moe",
    "measure_random",
    "measure_replicated_kv",
    "moe_seq_lens",
    "relative_floor",
    "remeasure_floors",
    "remeasure_moe_floors",
    "remeasure_replicated_floors",
    "require_moe",
    "require_replicated_kv",
    "sample",
    "sample_moe",
    "sample_moe_geometry",
    "sample_replicated_kv",
]

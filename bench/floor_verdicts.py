"""Every threshold the committed floors imply, and every verdict on what they cover, as JSON.

    WSB_TOLERANCE_DIR=tolerance PYTHONPATH=<checkout>/src python bench/floor_verdicts.py > x.json

Run it with the code of two checkouts (PYTHONPATH) against one tolerance directory: a change
that moves floor code (2026-12-02: the thresholds into ``tolerance/``) must print the same
bytes. Covers the phase floors of each dtype and phase (worst, threshold, ``floor_for`` of TOY
and TOY_KV4, the degrees of each forward's cells, the environment notes), the per-geometry
floors, every training and sequence threshold and ``thresholds_for`` on every mesh measured
(and the refusals past the domain), the random-geometry rules (every candidate's figures,
the held-out check, each sample's threshold, ``fuzz_threshold_rule`` on sampled geometries,
TOY and one outside the domain) and the replicated-KV validation (figures, and
``require_replicated_kv`` on its geometries at their degree and at 32). The imports try the
modules of after the move first, then those of before it.
"""
import json
import sys

import torch

torch.set_num_threads(1)

from weight_sync_bench.errors import WsbError  # noqa: E402
from weight_sync_bench.model.config import TOY, TOY_KV4, ModelConfig, shipped_hf_config  # noqa: E402
from weight_sync_bench.tolerance import rules  # noqa: E402

try:
    from weight_sync_bench.tolerance import sampled as random_rules
    from weight_sync_bench.tolerance import training as training_rules
    from weight_sync_bench.tolerance.phase import measured_degrees
    load_training = training_rules.load
except ImportError:  # before the move
    from weight_sync_bench.check.floor import measured_degrees
    from weight_sync_bench.fuzz import floor as random_rules
    from weight_sync_bench.training import floor as training_rules
    load_training = training_rules.load
from weight_sync_bench.fuzz import floor as fuzz_floor  # noqa: E402
from weight_sync_bench.training import floor as training_floor  # noqa: E402
from weight_sync_bench.training import sequence_floor  # noqa: E402
from weight_sync_bench.training.mesh import Mesh  # noqa: E402

out: dict = {}


def outcome(fn, *args, **kwargs):
    try:
        value = fn(*args, **kwargs)
        return value if not isinstance(value, float) else repr(value)
    except WsbError as exc:
        return f"{type(exc).__name__}: {exc}"


# phase floors, each dtype and phase: worst, threshold, floor_for of each config, cells
for phase, dtype in (("1a", "fp32"), ("1a", "bf16"), ("1a", "fp16"), ("1b", "fp32")):
    path = rules.artifact_path(phase, dtype=dtype)
    art = rules.load_artifact(phase, path)
    key = f"phase {phase} {dtype}"
    out[key] = {"worst": art["worst_abs"], "threshold": rules.threshold_from(art),
                "notes": rules.check_environment(art, "x")}
    for config in (TOY, TOY_KV4):
        floor = rules.floor_for(config, phase, dtype)
        out[key][config.name] = {"floor_for": floor.threshold, "source": floor.source,
                                 "plain": measured_degrees(art, config.name, "plain"),
                                 "replicated": measured_degrees(art, config.name,
                                                                "vllm-replicated-kv")}
    out[key]["threshold_for toy"] = (outcome(rules.threshold_for, TOY, phase)
                                     if dtype == "fp32" else None)

# per-geometry floors
geo = {}
for name in ("llama3_8b", "mistral_7b", "mistral_nemo", "qwen2_5_7b"):
    config = shipped_hf_config(name, n_layers=1)
    floor = outcome(rules.floor_for, config)
    geo[name] = floor if isinstance(floor, str) else {
        "threshold": floor.threshold, "source": floor.source, "path": floor.path.name,
        "notes": rules.check_environment(floor.artifact, "x")}
for path in sorted((rules.artifact_path().parent / "geometry").glob("*.json")):
    art = rules.load_artifact("1a", path)
    geo[path.name] = {"threshold": rules.threshold_from(art), "worst": art["worst_abs"]}
out["geometry"] = geo

# training and sequence floors: every threshold, and thresholds_for on each measured mesh
for kind in ("training", "sequence"):
    for phase in ("1a", "1b"):
        art = load_training(phase=phase, kind=kind)
        key = f"{kind} {phase}"
        out[key] = {r: training_rules.thresholds_from(art, r) for r in ("plain", "cancelling")}
        out[key]["notes"] = rules.check_environment(art, "x")
        meshes = {}
        configs = (TOY, TOY_KV4, *training_floor.SMALL_VARIANTS, training_floor.TOY_VARIANTS)
        for config in configs:
            for regime in ("plain", "cancelling"):
                for m in training_rules.measured_meshes(art, config.name, regime):
                    parts = dict(p.split("=") for p in m.split() if "=" in p)
                    mesh = Mesh(int(parts["dp"]), int(parts["tp"]), " sp" in f" {m}",
                                int(parts.get("cp", 1)))
                    get = (training_floor.thresholds_for if kind == "training"
                           else lambda c, r, artifact, phase, mesh: sequence_floor.thresholds_for(
                               c, mesh, r, artifact, phase))
                    meshes[f"{config.name} {regime} {m}"] = outcome(
                        get, config, regime, artifact=art, phase=phase, mesh=mesh)
        # refusals: a mesh past the domain, a config wider than measured
        meshes["refused mesh"] = outcome(training_floor.thresholds_for, TOY, "plain", art, phase,
                                         Mesh(16, 1))
        wide = ModelConfig(name="wide", vocab=64, d_model=4096, n_layers=1, n_heads=2,
                           n_kv_heads=2, head_dim=8, ffn=32)
        meshes["wide"] = outcome(training_floor.thresholds_for, wide, "plain", art, phase)
        out[key]["meshes"] = meshes

# random-geometry floors: the rule, every candidate's figures, the threshold of every sample
for phase in ("1a", "1b"):
    art = random_rules.load_random_floor(phase)
    rule = random_rules.rule_from(art)
    chosen, figures = random_rules.choose_rule(art["samples"])
    out[f"random {phase}"] = {
        "rule": [rule.name, rule.kind, rule.value], "chosen": chosen.name,
        "figures": json.loads(json.dumps(figures, default=repr)),
        "holdout": random_rules.holdout(art["samples"]),
        "per sample": [rule.threshold(s["scale"]) for s in art["samples"]],
        "notes": random_rules.environment_notes(phase)}
    fuzz = fuzz_floor.fuzz_threshold_rule(phase)
    ref = torch.tensor([[1.5, -2.0]])
    samples = art["samples"][:: max(1, len(art["samples"]) // 25)]
    out[f"random {phase}"]["fuzz_threshold_rule"] = [
        outcome(fuzz, fuzz_floor.config_of(s["geometry"], "s"), ref) for s in samples] + [
        outcome(fuzz, TOY, ref), outcome(fuzz, ModelConfig(
            name="outside", vocab=64, d_model=4096, n_layers=1, n_heads=2, n_kv_heads=2,
            head_dim=8, ffn=32), ref)]

# the replicated-KV validation and its refusals
art = random_rules.load_replicated_kv()
rule = random_rules.rule_from(random_rules.load_random_floor())
figures = random_rules.replicated_kv_figures(art, rule)
out["replicated-kv"] = {"figures": json.loads(json.dumps(figures, default=repr))}
checks = {}
for s in art["samples"][::20]:
    config = fuzz_floor.config_of(s["geometry"], "s")
    for t in (s["degree"], 32):
        checks[f"{s['geometry']} t={t}"] = outcome(fuzz_floor.require_replicated_kv, config, t)
checks["toy 8"] = outcome(fuzz_floor.require_replicated_kv, TOY, 8)
checks["toy_kv4 8"] = outcome(fuzz_floor.require_replicated_kv, TOY_KV4, 8)
out["replicated-kv"]["require"] = checks

json.dump(out, sys.stdout, indent=1, sort_keys=True, default=repr)

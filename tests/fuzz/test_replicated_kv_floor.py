"""The random-geometry rule judges a fuzzed conversion to vLLM past ``n_kv_heads`` (each KV
head replicated over t / n_kv ranks: a forward the random floor's samples never ran) only
where ``random_floor_1a_replicated_kv.json`` validates it on that forward: random geometries
of the fuzz domain at every such degree, zero false positives and ``SAFETY`` x headroom under
the rule in force, every conversion mutation live there killed by ``KILL_MARGIN``. Without
it (or where it does not validate the rule, the domain or the degree) the case is refused
naming the command; the twin: with the committed validation the same cases run and pass."""

from __future__ import annotations

import json
import math

import pytest

from weight_sync_bench import TOY
from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.check.mutations import KILL_MARGIN
from weight_sync_bench.errors import FloorNotMeasured
from weight_sync_bench.fuzz import floor
from weight_sync_bench.check.conversion import ConversionChecker
from weight_sync_bench.fuzz.case import ConversionCase, make_checker, run_case
from weight_sync_bench.fuzz.domain import DOMAIN
from weight_sync_bench.tolerance import kernels, sampled
from weight_sync_bench.tolerance.rules import SAFETY, derive_threshold

# 2 KV heads, 4 query heads: vLLM stores it at t = 4 (each KV head on 2 ranks)
GEOMETRY = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                         vocab_per_kv_head=16, n_layers=1, batch=1, seq_len=8)
COMMAND = "python -m weight_sync_bench.fuzz.floor replicated-kv --write"


def test_the_committed_validation_shows_the_rule_in_force_holds_on_the_replicated_forward():
    artifact = sampled.load_replicated_kv()
    random_floor = sampled.load_random_floor()
    rule = sampled.rule_from(random_floor)
    figures = sampled.replicated_kv_figures(artifact, rule)  # re-derived, not read
    assert artifact["domain"] == random_floor["domain"] == DOMAIN.to_json()
    assert artifact["forward"] == phase_floor.REPLICATED_KV
    assert figures["false_positives"] == 0 and figures["min_headroom"] >= SAFETY
    assert figures["min_kill_ratio"] >= KILL_MARGIN
    assert artifact["validated"]["rule"] == {"name": rule.name, "kind": rule.kind,
                                             "value": rule.value}
    for key in ("false_positives", "min_headroom", "min_kill_ratio", "degrees"):
        assert artifact["validated"][key] == figures[key], key
    assert {2, 4, 8, 16} <= set(figures["degrees"])  # every replication the fuzz draws mostly
    assert artifact["geometries"] >= 300 and all("/" in k for k in artifact["kernel_sets"])
    assert {k.split("/")[1] for k in artifact["kernel_sets"]} >= {"DEFAULT"}
    assert all(s["degree"] > s["geometry"]["n_kv_heads"] for s in artifact["samples"])
    assert all(not DOMAIN.violations(floor.config_of(s["geometry"], "s"))
               for s in artifact["samples"])


def test_a_sample_is_vllms_forward_at_every_replicated_degree_with_the_live_mutations():
    (record,) = floor.sample_replicated_kv(GEOMETRY, 3)
    assert record["degree"] == 4 and record["forward"] == phase_floor.REPLICATED_KV
    checker = ConversionChecker(make_checker(GEOMETRY, 3, threshold_rule=lambda c, r: math.inf))
    assert record["floor"] == checker.declared_error("vllm:4") > 0
    assert record["scale"] == float(checker.checker.reference.abs().max())
    assert "kv_replica_modulo" in record["kills"]  # the bug only replication has
    rule = sampled.rule_from(sampled.load_random_floor())
    assert all(d / rule.threshold(record["scale"]) >= KILL_MARGIN
               for d in record["kills"].values())


def test_the_draw_is_reproducible_inside_the_domain_and_replicated():
    drawn = floor.draw_replicated_geometries(40, 7)
    assert drawn == floor.draw_replicated_geometries(40, 7)
    assert drawn != floor.draw_replicated_geometries(40, 8)
    assert all(DOMAIN.contains(c) for c, _ in drawn)
    assert all(floor.config_of(c.geometry(), c.name) == c for c, _ in drawn)  # read back
    replicated = [c for c, _ in drawn if phase_floor.replicated_degrees(c, 16)]
    assert len(replicated) >= 30  # n_kv_heads 3 stores few: 64-padded vocab % 6 or 12
    assert any(c.qkv_bias for c, _ in drawn) and any(c.tie_embeddings for c, _ in drawn)


def test_a_kernel_set_that_raises_a_floor_raises_the_figures():
    artifact = floor.measure_replicated_kv([(GEOMETRY, 0)])
    first = artifact["samples"][0]["floor"]
    merged = kernels.merge_replicated_kv(artifact, {"DEFAULT": [first], "AVX2": [first * 50]},
                                       {"x": 1})
    (sample,) = merged["samples"]
    assert sample["floor"] == first * 50 and sample["floor_as_measured"] == first
    assert merged["validated"]["min_headroom"] == pytest.approx(
        artifact["validated"]["min_headroom"] / 50)
    assert merged["kernel_sets"] == ["DEFAULT", "AVX2"]


def _case(config=GEOMETRY, dst=4):
    return ConversionCase(config, "hf", 1, "vllm", dst, 0)


def test_the_committed_validation_lets_the_replicated_case_run_and_pass():
    assert run_case(_case()).holds("convert")


def test_without_the_validation_a_replicated_case_is_refused_naming_the_command(tolerance):
    (tolerance / "random_floor_1a_replicated_kv.json").unlink()
    with pytest.raises(FloorNotMeasured) as info:
        run_case(_case())
    assert "judges vLLM at t=4 > n_kv_heads=2 (the replicated-KV forward) only where " \
           "random_floor_1a_replicated_kv.json validates it" in str(info.value)
    assert info.value.command == COMMAND and COMMAND in str(info.value)
    # the twins: t <= n_kv_heads is the plain forward the rule was sampled on; a rule given
    # explicitly is the caller's
    assert run_case(ConversionCase(GEOMETRY, "hf", 1, "vllm", 2, 0)).holds("convert")
    loose = run_case(_case(), threshold_rule=lambda c, r: 1.0)
    assert loose.holds("convert")


@pytest.mark.parametrize("change, why", [
    (lambda a: a["samples"][0].update(floor=1e3), "the rule in force has 1 false positives"),
    (lambda a: a.update(samples=[s for s in a["samples"] if s["degree"] != 4]), "not t=4"),
    (lambda a: a["domain"]["d_model"].update(hi=64),
     "measured over another fuzz domain than the random-geometry floor's"),
])
def test_a_validation_that_does_not_hold_here_refuses_the_case(edit_artifact, change, why):
    edit_artifact("random_floor_1a_replicated_kv.json", change)
    with pytest.raises(FloorNotMeasured, match=why):
        run_case(_case())


def test_toy_in_the_fuzz_is_judged_by_its_committed_replicated_cell(tolerance):
    case = ConversionCase(TOY, "hf", 1, "vllm", 8, 0)
    assert run_case(case).holds("convert")  # phase1a.json's toy t=8 cell
    path = tolerance / "phase1a.json"
    artifact = json.loads(path.read_text())
    artifact["cells"] = [c for c in artifact["cells"] if "forward" not in c]
    artifact["worst_abs"] = max(c["worst_abs"] for c in artifact["cells"])
    artifact["threshold"] = derive_threshold(artifact["worst_abs"])
    path.write_text(json.dumps(artifact))
    with pytest.raises(FloorNotMeasured, match="phase1a.json never measured it"):
        run_case(case)


def test_a_users_converter_fuzzed_to_a_replicated_vllm_degree_needs_the_validation_too(
        tolerance):
    """``wsb fuzz --converter``: the same refusal for a user's converter as for the
    harness's own conversions, and its twin (the committed validation) runs the case."""
    from tests.fuzz import user_functions as uf
    from weight_sync_bench.fuzz.case import Case
    from weight_sync_bench.fuzz.user import UserFunction, run_user_case

    function = UserFunction(uf.convert_megatron_to_vllm, "converter", src="megatron",
                            dst="vllm")
    case = Case(GEOMETRY, 1, 4, 0)
    assert run_user_case(function, case).verdict.passed  # committed validation: judged
    (tolerance / "random_floor_1a_replicated_kv.json").unlink()
    with pytest.raises(FloorNotMeasured) as info:
        run_user_case(function, case)
    assert info.value.command == COMMAND
    assert run_user_case(function, Case(GEOMETRY, 1, 2, 0)).verdict.passed  # t <= n_kv

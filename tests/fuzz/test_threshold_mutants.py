"""``fuzz.threshold`` (issue 30, the mutation pass over ``fuzz/threshold.py``): which threshold
the fuzz judges a drawn geometry by, and where it refuses to judge.

The random-geometry rule is trusted only inside the domain its samples covered, vLLM's
replicated-KV forward only where a measurement of that forward validates the rule, and an MoE
geometry only where the MoE validation does. A gate that lets a geometry through where no
measurement covers it makes a verdict from a threshold measured on something else. These
tests pin each gate, its message and its command, with the validations stood in."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.sync.conftest import MOE_FEW
from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.fuzz import threshold as T
from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN, IntRange
from weight_sync_bench.model.config import TOY, TOY_KV4, ModelConfig
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.rules import threshold_for
from weight_sync_bench.tolerance.sampled import (
    replicated_kv_command,
    replicated_kv_path,
)
from weight_sync_bench.tolerance.sampled_moe import moe_command, moe_path

DENSE = ModelConfig(name="d", vocab=64, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=4, ffn=16, batch=1, seq_len=4)
REFERENCE = torch.ones(1, 4, 64)


class Rule:
    def __init__(self):
        self.calls = []

    def __call__(self, config, reference):
        self.calls.append((config, reference))
        return 0.125


@pytest.fixture
def moe_asked(monkeypatch):
    asked = []
    monkeypatch.setattr(T, "require_moe", lambda config, phase, *, domain: asked.append(
        (config, phase, domain)))
    return asked


def test_the_seeds_configs_keep_their_committed_threshold(moe_asked, monkeypatch):
    rule = Rule()
    threshold = T.FuzzThreshold("1b", Path("p"), rule, DOMAIN)
    assert threshold(TOY, REFERENCE) == threshold_for(TOY, "1b")
    assert threshold(TOY_KV4, REFERENCE) == threshold_for(TOY_KV4, "1b")
    assert rule.calls == [] and moe_asked == []
    asked = []
    monkeypatch.setattr(T, "threshold_for", lambda config, phase: asked.append(
        (config.name, phase)) or 0.5)
    assert threshold(TOY, REFERENCE) == 0.5 and asked == [("toy", "1b")]


def test_a_dense_geometry_is_judged_by_the_rule_only_inside_the_domain(moe_asked):
    rule = Rule()
    threshold = T.FuzzThreshold("1a", Path("/floors/random.json"), rule, DOMAIN)
    assert threshold(DENSE, REFERENCE) == 0.125
    assert rule.calls == [(DENSE, REFERENCE)]
    wide = DENSE.replace(name="wide", d_model=256, n_kv_heads=8, n_heads=8)
    with pytest.raises(ToleranceMismatch) as exc:
        threshold(wide, REFERENCE)
    assert str(exc.value) == (
        "wide: no threshold outside the sampled domain (/floors/random.json): "
        "n_kv_heads=8 not in 1..4; d_model=256 not in 8..128 step 8")
    assert len(rule.calls) == 1 and moe_asked == []
    narrow = dataclasses.replace(DOMAIN, d_model=IntRange(8, 8))  # the rule's own domain
    with pytest.raises(ToleranceMismatch, match=r"d_model=16 not in 8\.\.8"):
        T.FuzzThreshold("1a", Path("p"), rule, narrow)(DENSE, REFERENCE)
    # TOY's geometry under another name is a drawn geometry: outside the domain, refused
    with pytest.raises(ToleranceMismatch, match="^copy: no threshold outside"):
        threshold(TOY.replace(name="copy"), REFERENCE)


def test_an_moe_geometry_is_judged_by_the_rule_only_where_the_moe_validation_says(moe_asked):
    rule = Rule()
    narrow = dataclasses.replace(DOMAIN, seq_len=IntRange(4, 8))
    threshold = T.FuzzThreshold("1b", Path("p"), rule, narrow)
    assert threshold(MOE_FEW, REFERENCE) == 0.125
    assert moe_asked == [(MOE_FEW, "1b", narrow)] and rule.calls == [(MOE_FEW, REFERENCE)]


def test_an_moe_geometry_the_validation_refuses_is_not_judged(monkeypatch):
    def refuse(config, phase, *, domain):
        raise FloorNotMeasured("not validated")

    monkeypatch.setattr(T, "require_moe", refuse)
    rule = Rule()
    with pytest.raises(FloorNotMeasured):
        T.FuzzThreshold("1a", Path("p"), rule, DOMAIN)(MOE_FEW, REFERENCE)
    assert rule.calls == []


def test_the_fuzz_rule_reads_the_phases_committed_floor(monkeypatch):
    got = T.fuzz_threshold_rule()
    assert got.phase == "1a" and got.path == artifact_path("1a", kind="random_floor")
    b = T.fuzz_threshold_rule("1b")
    assert b.phase == "1b" and b.path == artifact_path("1b", kind="random_floor")
    assert got.domain == DOMAIN  # the domain its samples covered
    assert got(DENSE, REFERENCE) > 0 and got.rule is T._rule_and_domain(
        "1a", got.path, got.path.stat().st_mtime_ns)[0]


def test_the_fuzz_rule_reads_the_path_it_is_given_and_checks_its_environment_when_strict(
        monkeypatch, tmp_path):
    read, noted = [], []
    monkeypatch.setattr(T, "_rule_and_domain",
                        lambda phase, path, stamp: read.append((phase, path, stamp))
                        or ("rule", DOMAIN))
    monkeypatch.setattr(T, "environment_notes", lambda phase, path: noted.append((phase, path)))
    monkeypatch.setattr(T, "strict_environment", lambda: False)
    path = tmp_path / "floor.json"
    path.write_text("{}")
    got = T.fuzz_threshold_rule("1b", path)
    assert read == [("1b", path, path.stat().st_mtime_ns)] and noted == []
    assert (got.phase, got.path, got.rule, got.domain) == ("1b", path, "rule", DOMAIN)
    monkeypatch.setattr(T, "strict_environment", lambda: True)
    T.fuzz_threshold_rule("1b", path)
    assert noted == [("1b", path)]
    T.fuzz_threshold_rule("1b", tmp_path / "missing.json")
    assert read[-1] == ("1b", tmp_path / "missing.json", None)


def test_the_fuzz_rule_refuses_a_foreign_floor_when_strict(monkeypatch):
    def foreign(phase, path):
        raise ToleranceMismatch("measured elsewhere")

    monkeypatch.setattr(T, "environment_notes", foreign)
    monkeypatch.setattr(T, "strict_environment", lambda: True)
    with pytest.raises(ToleranceMismatch, match="measured elsewhere"):
        T.fuzz_threshold_rule("1a")


# ---- vLLM's replicated-KV forward -----------------------------------------------------------

def test_the_seeds_configs_need_their_committed_replicated_cell(monkeypatch):
    from weight_sync_bench.check import convert

    asked = []
    monkeypatch.setattr(convert, "require_cell", lambda floor, config, where: asked.append(
        (floor.artifact["phase"], config.name, str(where))))
    monkeypatch.setattr(T, "why_not_validated", lambda *a: pytest.fail("not the validation"))
    T.require_replicated_kv(TOY, 8, "1b")
    T.require_replicated_kv(TOY_KV4, 8)
    assert asked == [("1b", "toy", "vllm:8"), ("1a", "toy_kv4", "vllm:8")]


def test_a_drawn_geometry_needs_the_validation_of_the_replicated_forward(monkeypatch, tmp_path):
    answers = {}
    asked = []

    def why(degree, phase, path):
        asked.append((degree, phase, path))
        answer = answers["why"]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(T, "why_not_validated", why)
    answers["why"] = None
    T.require_replicated_kv(DENSE, 4, "1b")
    assert asked == [(4, "1b", replicated_kv_path("1b"))]
    T.require_replicated_kv(DENSE, 4, path=tmp_path / "v.json")
    assert asked[-1] == (4, "1a", tmp_path / "v.json")
    what = ("d: the random-geometry rule judges vLLM at t=8 > n_kv_heads=2 (the replicated-KV "
            "forward) only where v.json validates it")
    answers["why"] = "its cell at t=8 is missing"
    with pytest.raises(FloorNotMeasured) as exc:
        T.require_replicated_kv(DENSE, 8, "1b", tmp_path / "v.json")
    assert str(exc.value) == (f"{what}: its cell at t=8 is missing. Measure it with "
                              f"`{replicated_kv_command('1b')}`")
    assert exc.value.command == replicated_kv_command("1b")
    answers["why"] = ToleranceMismatch("no such artifact")
    with pytest.raises(FloorNotMeasured) as exc:
        T.require_replicated_kv(DENSE, 8, "1a", tmp_path / "v.json")
    assert str(exc.value) == f"{what}: no such artifact"
    assert exc.value.command == replicated_kv_command("1a")
    assert exc.value.__suppress_context__


# ---- Mixture-of-Experts geometries ----------------------------------------------------------

def test_an_moe_forward_runs_a_mutations_longer_sequence_past_the_domain():
    assert T.moe_seq_lens() == [32]
    assert T.moe_seq_lens(dataclasses.replace(DOMAIN, seq_len=IntRange(4, 31))) == [32]
    assert T.moe_seq_lens(dataclasses.replace(DOMAIN, seq_len=IntRange(4, 32))) == []


@pytest.fixture
def validation(monkeypatch):
    state = {"why": None, "asked": []}

    def why(phase, path, *, moe_domain, world, forward, seq_len):
        state["asked"].append({"phase": phase, "path": path, "moe_domain": moe_domain,
                               "world": world, "forward": forward, "seq_len": seq_len})
        if isinstance(state["why"], Exception):
            raise state["why"]
        return state["why"]

    monkeypatch.setattr(T, "why_moe_not_validated", why)
    return state


def test_an_moe_geometry_inside_the_domains_is_asked_of_the_validation(validation, tmp_path):
    from weight_sync_bench.conventions import endpoint

    T.require_moe(MOE_FEW)
    assert validation["asked"] == [{"phase": "1a", "path": moe_path("1a"),
                                    "moe_domain": MOE_DOMAIN.to_json(), "world": None,
                                    "forward": None, "seq_len": None}]
    T.require_moe(MOE_FEW, "1b", tmp_path / "m.json", where=endpoint("vllm:tp=2,ep=2"))
    assert validation["asked"][-1] == {
        "phase": "1b", "path": tmp_path / "m.json", "moe_domain": MOE_DOMAIN.to_json(),
        "world": 2, "forward": "expert-parallel", "seq_len": None}
    staged = MOE_FEW.replace(n_layers=2)
    T.require_moe(staged, where=endpoint("megatron:tp=1,ep=2,pp=2"))
    assert validation["asked"][-1]["world"] == 2  # one stage's ranks, not the 4 of both
    T.require_moe(MOE_FEW.replace(seq_len=32))  # a mutation's 32 tokens: inside
    assert validation["asked"][-1]["seq_len"] == 32


def test_an_moe_geometry_outside_the_domains_is_refused_naming_each_field(validation):
    for config, fields in ((MOE_FEW.replace(name="m", seq_len=24), "seq_len=24 not in 4..16"),
                           (MOE_FEW.replace(name="m", seq_len=64), "seq_len=64 not in 4..16")):
        with pytest.raises(ToleranceMismatch) as exc:
            T.require_moe(config)
        assert str(exc.value) == f"m: no threshold outside the sampled MoE domain: {fields}"
    both = MOE_FEW.replace(name="m", seq_len=24, top_k=8)
    with pytest.raises(ToleranceMismatch) as exc:
        T.require_moe(both)
    fields = MOE_DOMAIN.violations(both, DOMAIN)
    assert len(fields) >= 2 and str(exc.value) == (
        "m: no threshold outside the sampled MoE domain: " + "; ".join(fields))
    dense = DENSE.replace(name="m")
    with pytest.raises(ToleranceMismatch) as exc:
        T.require_moe(dense)
    assert str(exc.value).startswith("m: no threshold outside the sampled MoE domain: ")
    assert "n_experts=0: not an MoE geometry" in str(exc.value)
    wide = dataclasses.replace(DOMAIN, seq_len=IntRange(4, 64))  # 64 inside a wider domain
    T.require_moe(MOE_FEW.replace(seq_len=64), domain=wide)
    assert validation["asked"][-1]["seq_len"] is None
    assert len(validation["asked"]) == 1


def test_an_moe_geometry_the_validation_does_not_cover_is_refused_with_its_command(
        validation, tmp_path):
    from weight_sync_bench.conventions import endpoint

    validation["why"] = "no cell at world 2"
    where = endpoint("vllm:tp=2,ep=2")
    with pytest.raises(FloorNotMeasured) as exc:
        T.require_moe(MOE_FEW, "1b", tmp_path / "m.json", where=where)
    assert str(exc.value) == (
        "moe_few: the random-geometry rule judges a Mixture-of-Experts geometry (its "
        "expert-parallel forward over 2 ranks, at vllm:tp=2,ep=2) only where m.json validates "
        f"it: no cell at world 2. Measure it with `{moe_command('1b')}`")
    assert exc.value.command == moe_command("1b")
    validation["why"] = ToleranceMismatch("no such artifact")
    with pytest.raises(FloorNotMeasured) as exc:
        T.require_moe(MOE_FEW)
    assert str(exc.value) == (
        f"moe_few: the random-geometry rule judges a Mixture-of-Experts geometry only where "
        f"{moe_path('1a').name} validates it: no such artifact")
    assert exc.value.command == moe_command("1a") and exc.value.__suppress_context__

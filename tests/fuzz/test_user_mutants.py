"""``fuzz.user`` (issue 30, the mutation pass over ``fuzz/user.py``): fuzzing a user's own
splitter, resharder or converter. This is where a user's function is recorded, called on a
case, judged, counted and reported, and where a run decides that it failed.

A verdict taken from the wrong shards, a declined case counted as a pass, a shipped
geometry's failure dropped, a counterexample listed twice or a summary line that miscounts
would each tell the user something false about their code. These tests pin each of them in
process: on a tiny geometry with a fixed threshold, or with Hypothesis's runner stood in, so
that each claim is checked by itself and exactly."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import user_functions as uf

from weight_sync_bench import Unsupported
from weight_sync_bench.errors import (
    InvalidConfig,
    MissingArtifacts,
    UnknownConvention,
    UserCodeError,
    WsbError,
)
from weight_sync_bench.fuzz import user as U
from weight_sync_bench.fuzz.case import Case, ConversionCase
from weight_sync_bench.fuzz.domain import DOMAIN, FP8_DOMAIN, IntRange
from weight_sync_bench.fuzz.runner import (
    FuzzReport,
    HarnessAbort,
    PropertyFailed,
    Tally,
)
from weight_sync_bench.model.config import HF_CONFIGS, ModelConfig, shipped_hf_config

C = ModelConfig(name="u", vocab=64, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=4,
                ffn=16, batch=1, seq_len=4)
GEOMETRY = ("vocab=64 d_model=16 n_layers=1 n_heads=4 n_kv_heads=2 head_dim=4 ffn=16 batch=1 "
            "seq_len=4 rope_theta=10000 norm_eps=1e-05")
THRESHOLD = 1e-3


def rule(config, reference):
    return THRESHOLD


def resharder(fn, **kw):
    return U.UserFunction(fn, "resharder", **kw)


def converter(fn, src="megatron", dst="vllm", **kw):
    return U.UserFunction(fn, "converter", src, dst, **kw)


def run(function, case, **kw):
    return U.run_user_case(function, case, threshold_rule=rule, **kw)


# ---- the record of the function -------------------------------------------------------------

def refused(kind, *args, **kwargs) -> str:
    with pytest.raises(kind) as exc:
        U.UserFunction(*args, **kwargs)
    return str(exc.value)


def test_a_function_the_harness_cannot_record_is_refused_by_name():
    fn = uf.reshard_correct
    assert refused(InvalidConfig, fn, "merger") == (
        "unknown role 'merger'; known: splitter, resharder, converter")
    assert refused(UserCodeError, 42, "resharder") == "your resharder 42 is not callable"
    assert refused(InvalidConfig, fn, "converter", "megatron") == (
        "a converter needs src and dst conventions, and only a converter has them "
        "(role=converter, src=megatron, dst=None)")
    assert refused(InvalidConfig, fn, "converter", None, "vllm") == (
        "a converter needs src and dst conventions, and only a converter has them "
        "(role=converter, src=None, dst=vllm)")
    assert refused(InvalidConfig, fn, "resharder", "megatron", "vllm") == (
        "a converter needs src and dst conventions, and only a converter has them "
        "(role=resharder, src=megatron, dst=vllm)")
    known = "plain, megatron, vllm, hf, meta"
    assert refused(InvalidConfig, fn, "converter", "mega", "vllm") == (
        f"unknown convention 'mega'; known: {known}")
    assert refused(InvalidConfig, fn, "converter", "megatron", "vlm:tp=2") == (
        f"unknown convention 'vlm:tp=2'; known: {known}")
    assert "'vllm:tpp=2'" in refused(UnknownConvention, fn, "converter", "megatron",
                                     "vllm:tpp=2")
    assert "'megatron:tpp=2'" in refused(UnknownConvention, fn, "converter", "megatron:tpp=2",
                                         "vllm")


def test_a_function_is_named_by_its_import_path_unless_named():
    assert resharder(uf.reshard_correct).name == "user_functions:reshard_correct"
    assert resharder(uf.reshard_correct, name="mine:f").name == "mine:f"
    assert converter(uf.convert_megatron_to_vllm, "megatron:tp=2,pp=2", "vllm:2").label == (
        "converter user_functions:convert_megatron_to_vllm megatron:tp=2,pp=2 -> vllm:2")


def test_a_converter_into_fp8_is_fuzzed_over_the_fp8_domain_unless_narrowed():
    fp8 = converter(uf.convert_to_fp8, dst="vllm:fp8=block128")
    assert fp8.domain(DOMAIN) == FP8_DOMAIN
    narrowed = dataclasses.replace(DOMAIN, seq_len=IntRange(4, 8))
    assert fp8.domain(narrowed) is narrowed
    assert converter(uf.convert_megatron_to_vllm).domain(DOMAIN) == DOMAIN
    assert resharder(uf.reshard_correct).domain(DOMAIN) == DOMAIN


def test_the_function_is_refused_before_any_example_only_when_it_cannot_be_called():
    resharder(uf.reshard_correct).check_callable()  # config= accepted
    resharder(uf.reshard_without_config).check_callable()
    converter(uf.convert_to_fp8, dst="vllm:fp8=tensor").check_callable()  # source=, target=
    U.UserFunction(uf.split_correct, "splitter").check_callable()
    with pytest.raises(UserCodeError, match="has the wrong signature"):
        resharder(lambda shards: shards).check_callable()
    with pytest.raises(UserCodeError, match="has the wrong signature"):
        resharder(lambda shards, dst, *, config, extra: shards).check_callable()


def compiled(filename: str):
    namespace: dict = {}
    exec(compile("def f(shards, dst):\n    return shards\n", filename, "exec"), namespace)
    return namespace["f"]


def test_the_source_file_and_its_hash_are_recorded_where_there_is_one(tmp_path):
    path = Path(uf.__file__)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert resharder(uf.reshard_correct).source() == (str(path), digest)

    @functools.wraps(uf.reshard_correct)
    def wrapped(*a, **k):
        return uf.reshard_correct(*a, **k)

    assert resharder(wrapped).source() == (str(path), digest)  # the function it wraps
    assert resharder(len, name="builtins:len").source() == (None, None)
    assert resharder(compiled(str(tmp_path / "gone.py"))).source() == (None, None)
    folder = tmp_path / "folder.py"
    folder.mkdir()
    assert resharder(compiled(str(folder))).source() == (str(folder), None)
    assert resharder(uf.reshard_correct).entry_fields() == {"user": {
        "role": "resharder", "function": "user_functions:reshard_correct",
        "source_file": str(path), "source_sha256": digest}}


def entry(user, case):
    return SimpleNamespace(user=user, case=case)


def test_a_corpus_entry_belongs_to_the_function_that_wrote_it():
    mine = resharder(uf.reshard_correct)
    me = {"function": mine.name, "role": "resharder"}
    case = Case(C, 2, 1, 0)
    assert mine.owns(entry(me, case))
    assert not mine.owns(entry(None, case)) and not mine.owns(entry({}, case))
    assert not mine.owns(entry({**me, "function": "other:f"}, case))
    assert not mine.owns(entry({**me, "role": "splitter"}, case))
    conversion = ConversionCase(C, "megatron", 2, "vllm", 1, 0)
    assert not mine.owns(entry(me, conversion))
    conv = converter(uf.convert_megatron_to_vllm)
    cme = {"function": conv.name, "role": "converter"}
    assert conv.owns(entry(cme, conversion))
    assert not conv.owns(entry(cme, case))
    assert not conv.owns(entry(cme, ConversionCase(C, "megatron", 2, "hf", 1, 0)))
    assert not conv.owns(entry(cme, ConversionCase(C, "vllm", 2, "vllm", 1, 0)))
    # a convention named alone owns the cases drawn at its pipeline splits too, not the reverse
    two = C.replace(n_layers=2)
    staged = ConversionCase(two, "megatron:pp=2", 2, "vllm", 1, 0)
    assert conv.owns(entry(cme, staged))
    fixed = converter(uf.convert_megatron_to_vllm, "megatron:pp=2", "vllm")
    assert fixed.owns(entry(cme, staged))
    assert not fixed.owns(entry(cme, conversion))


# ---- one case -------------------------------------------------------------------------------

def test_a_correct_functions_case_is_the_fixed_checks_verdict():
    for function, case in ((U.UserFunction(uf.split_correct, "splitter"), Case(C, 1, 2, 0)),
                           (resharder(uf.reshard_correct), Case(C, 2, 1, 3)),
                           (converter(uf.convert_megatron_to_vllm), Case(C, 2, 1, 3))):
        outcome = run(function, case)
        assert outcome.verdict is not None and outcome.verdict.passed, function.label
        assert outcome.check_passed and outcome.holds("invariant")
        assert outcome.deviation == outcome.verdict.max_abs_error
        assert outcome.threshold == THRESHOLD and not outcome.shards_differ
        assert outcome.function is function and outcome.case is case
        assert outcome.error is None and outcome.declined is None and not outcome.skip


def test_a_wrong_byte_is_a_failing_verdict_naming_the_parameter():
    def wrong(shards, dst, *, config):
        out = uf.reshard_correct(shards, dst, config=config)
        out[0]["layers.0.o_proj.weight"][0, 0] += 1
        return out

    outcome = run(resharder(wrong), Case(C, 2, 1, 3))
    assert outcome.shards_differ and not outcome.check_passed
    assert not outcome.holds("invariant")
    assert outcome.deviation == outcome.verdict.max_abs_error > THRESHOLD
    assert "first parameter that differs from the declared layout: layers.0.o_proj.weight" in \
        outcome.describe()


def test_a_function_that_writes_into_its_input_is_refused_whatever_it_returns():
    def split_then_scribble(full, degree, *, config):
        out = uf.split_correct(full, degree, config=config)
        for x in full.values():
            x.zero_()
        return out

    def reshard_then_scribble(shards, dst, *, config):
        out = uf.reshard_correct(shards, dst, config=config)
        for shard in shards:
            for x in shard.values():
                x.zero_()
        return out

    for function, case in ((U.UserFunction(split_then_scribble, "splitter", name="m:s"),
                            Case(C, 1, 2, 0)),
                           (resharder(reshard_then_scribble, name="m:r"), Case(C, 2, 1, 0))):
        outcome = run(function, case)
        assert outcome.verdict is None and outcome.shards_differ, function.role
        assert "x.clone()" in outcome.error
        assert outcome.error.startswith(f"your {function.role}")


def test_a_function_is_called_as_its_role_is_with_the_cases_degrees_and_geometry():
    seen = []

    def split(full, degree, *, config):
        seen.append(("split", sorted(full)[0], degree, config))
        raise ValueError("stop")

    def reshard(shards, dst, *, config):
        seen.append(("reshard", len(shards), dst, config))
        raise ValueError("stop")

    def convert(shards, degree, *, config, hf_config):
        seen.append(("convert", len(shards), degree, config, hf_config))
        raise ValueError("stop")

    a = run(U.UserFunction(split, "splitter", name="m:s"), Case(C, 1, 2, 0))
    b = run(resharder(reshard, name="m:r"), Case(C, 2, 1, 0))
    c = run(converter(convert, name="m:c"), Case(C, 2, 1, 0))
    assert seen == [("split", "layers.0.attn_norm.weight", 2, C), ("reshard", 2, 1, C),
                    ("convert", 2, 1, C, C.to_hf_config())]
    assert a.error.startswith("your splitter `m:s` raised ValueError while splitting u for "
                              "t=2: stop\n")
    assert b.error.startswith("your resharder `m:r` raised ValueError while resharding u "
                              "2 -> 1: stop\n")
    assert c.error.startswith("your converter `m:c` raised ValueError while converting u "
                              "megatron:2 -> vllm:1: stop\n")


def test_what_the_function_raises_is_a_counterexample_and_unsupported_declines():
    def declines(shards, dst, *, config):
        raise Unsupported("only even vocabularies")

    def declines_silently(shards, dst, *, config):
        raise Unsupported()

    def raises(shards, dst, *, config):
        raise ValueError("boom")

    case = Case(C, 2, 1, 3)
    no = run(resharder(declines), case)
    assert (no.declined, no.error, no.verdict) == ("only even vocabularies", None, None)
    assert no.shards_differ is False
    assert math.isnan(no.deviation) and no.threshold == THRESHOLD
    assert not no.check_passed and not no.holds("invariant")
    assert run(resharder(declines_silently), case).declined == "(no reason given)"
    err = run(resharder(raises, name="m:raises"), case)
    assert err.declined is None and err.verdict is None and err.shards_differ
    assert err.error.startswith("your resharder `m:raises` raised ValueError while resharding "
                                "u 2 -> 1: boom\n")
    assert math.isnan(err.deviation) and err.threshold == THRESHOLD


def test_a_converters_output_that_is_not_the_conventions_shards_is_named():
    def bad(shards, degree, *, config, hf_config):
        return [{"x": torch.zeros(1)} for _ in range(degree)]

    function = converter(bad, name="mine:bad")
    outcome = run(function, Case(C, 2, 1, 3))
    assert outcome.error.startswith("your converter `mine:bad` returned shards that do not fit "
                                    "the convention: vllm:1 rank 0: missing ")
    assert outcome.shards_differ and outcome.verdict is None and math.isnan(outcome.deviation)
    assert outcome.threshold == THRESHOLD


# ---- FP8 destinations -----------------------------------------------------------------------

def test_an_fp8_converters_case_is_judged_as_check_convert_judges_one():
    case = Case(C, 2, 1, 0)
    good = run(converter(uf.convert_to_fp8, dst="vllm:fp8=tensor"), case)
    assert good.check_passed and not good.shards_differ
    assert good.threshold == good.verdict.threshold and good.threshold != THRESHOLD
    assert good.deviation == good.verdict.max_abs_error
    bad = run(converter(uf.convert_to_fp8_unclamped, dst="vllm:fp8=tensor"), case)
    assert bad.verdict is not None and bad.shards_differ and not bad.check_passed


def test_an_fp8_converter_that_raises_declines_or_returns_what_does_not_fit():
    def declines(shards, degree, *, config, source, target):
        raise Unsupported()

    def raises(shards, degree, *, config, source, target):
        raise ValueError("boom")

    def bad(shards, degree, *, config, source, target):
        return [{"x": torch.zeros(1)} for _ in range(degree)]

    case = Case(C, 2, 1, 0)
    no = run(converter(declines, dst="vllm:fp8=tensor"), case)
    assert no.declined == "(no reason given)" and no.shards_differ is False
    assert math.isnan(no.deviation) and math.isnan(no.threshold)
    reasons = run(converter(lambda *a, **k: (_ for _ in ()).throw(Unsupported("why")),
                            dst="vllm:fp8=tensor"), case)
    assert reasons.declined == "why"
    err = run(converter(raises, dst="vllm:fp8=tensor", name="m:raises"), case)
    assert err.error.startswith("your converter `m:raises` raised ValueError while ")
    assert err.shards_differ and math.isnan(err.threshold) and err.declined is None
    assert math.isnan(err.deviation)
    misfit = run(converter(bad, dst="vllm:fp8=tensor", name="m:bad"), case)
    assert misfit.error.startswith("your converter `m:bad` returned shards that do not fit the "
                                   "convention: ")
    assert misfit.shards_differ and math.isnan(misfit.threshold)
    assert math.isnan(misfit.deviation)
    assert "threshold" not in U.report(misfit).splitlines()[-1]  # no forward, none measured


# ---- which checker a case gets --------------------------------------------------------------

def test_a_shipped_geometry_is_judged_by_a_threshold_measured_for_it(monkeypatch):
    asked = []
    monkeypatch.setattr(U, "_real_threshold",
                        lambda config, ends: asked.append((config.name, ends)) or 0.5)
    real = U.real_geometries()[0]
    checker = U._checker(resharder(uf.reshard_correct), Case(real, 8, 2, 0, phase="1a"),
                         "fwd", rule)
    assert asked == [("llama3_8b", ("plain:8", "plain:2"))]
    assert checker.threshold == 0.5 and checker.forward == "fwd" and checker.seed == 0
    conv = U._checker(converter(uf.convert_megatron_to_vllm), Case(real, 8, 2, 1), "fwd", None)
    assert asked[-1] == ("llama3_8b", ("megatron:8", "vllm:2")) and conv.seed == 1


def test_a_converter_into_vllms_replicated_kv_needs_its_validation(monkeypatch):
    from weight_sync_bench.fuzz import threshold

    asked = []
    monkeypatch.setattr(threshold, "require_replicated_kv",
                        lambda config, dst, phase: asked.append((config.name, dst, phase)))
    function = converter(uf.convert_megatron_to_vllm)
    checker = U._checker(function, Case(C, 2, 4, 0), "fwd", None)
    assert asked == [("u", 4, "1a")] and checker.forward == "fwd"
    U._checker(function, Case(C, 2, 2, 0), "fwd", None)  # KV heads not replicated at 2
    U._checker(function, Case(C, 2, 4, 0), "fwd", rule)  # a rule given: the caller's
    U._checker(resharder(uf.reshard_correct), Case(C.replace(n_kv_heads=1), 2, 4, 0), "f",
               None)
    assert asked == [("u", 4, "1a")]
    assert U._checker(function, Case(C, 2, 2, 0), "fwd", rule).threshold == THRESHOLD


def test_a_converters_ends_are_the_cases_conventions_else_its_own():
    function = converter(uf.convert_megatron_to_vllm)
    assert [str(e) for e in U._ends(function, Case(C, 2, 1, 0))] == ["megatron:2", "vllm:1"]
    staged = ConversionCase(C.replace(n_layers=2), "megatron:pp=2", 2, "vllm", 1, 0)
    assert [str(e) for e in U._ends(function, staged)] == ["megatron:tp=1,pp=2", "vllm:1"]
    assert U._endpoints(function, Case(C, 2, 1, 0)) == ("megatron:2", "vllm:1")
    assert U._endpoints(resharder(uf.reshard_correct), Case(C, 2, 1, 0)) == (
        "plain:2", "plain:1")


# ---- how a case reads -----------------------------------------------------------------------

def test_the_geometry_and_degrees_read_as_the_user_wrote_them():
    assert U.format_geometry(C) == GEOMETRY
    assert U.format_geometry(C.replace(rope_theta=500000.0, norm_eps=1e-6)).endswith(
        "rope_theta=500000 norm_eps=1e-06")
    # sizes are integers, written whole however large (":g" would write 1e+06)
    assert U.format_geometry(C.replace(vocab=1_000_000)).startswith("vocab=1000000 d_model=16")
    case = Case(C, 2, 1, 0)
    assert U.degrees_text(U.UserFunction(uf.split_correct, "splitter"), case) == (
        "split of the full model -> t=1")
    assert U.degrees_text(resharder(uf.reshard_correct), case) == "t=2 -> t=1"
    assert U.degrees_text(None, case) == "t=2 -> t=1"
    assert U.degrees_text(converter(uf.convert_megatron_to_vllm), case) == (
        "megatron:2 -> vllm:1")


def test_a_counterexample_reads_with_the_function_the_geometry_and_what_went_wrong():
    case = Case(C, 2, 1, 3)
    head = ["your resharder m:f", f"  geometry: {GEOMETRY}",
            "  degrees: t=2 -> t=1; seed 3 (tokens 1003), phase 1a"]
    fn = resharder(uf.reshard_correct, name="m:f")
    common = {"case": case, "function": fn, "threshold": 0.25, "deviation": math.nan,
              "shards_differ": False}
    declined = U.UserOutcome(declined="too wide", **common)
    assert U.report(declined).splitlines() == [*head, "  declined: Unsupported: too wide"]
    assert declined.describe() == U.report(declined)
    error = U.UserOutcome(error="it broke\nhere", **common)
    assert U.report(error).splitlines() == [*head, "  it broke", "  here",
                                            "  threshold 0.25 (no forward ran)"]
    nan = U.UserOutcome(error="it broke", **{**common, "threshold": math.nan})
    assert U.report(nan).splitlines() == [*head, "  it broke"]
    judged = run(fn, case)
    lines = U.report(judged).splitlines()
    assert lines[:3] == head and lines[3:] == str(judged.verdict).splitlines()[1:]
    conv = U.UserOutcome(declined="x", **{**common, "function": converter(
        uf.convert_megatron_to_vllm, name="m:c")})
    assert U.report(conv).splitlines()[:3] == [
        "your converter m:c megatron -> vllm", head[1],
        "  degrees: megatron:2 -> vllm:1; seed 3 (tokens 1003), phase 1a"]
    nobody = U.UserOutcome(declined="x", **{**common, "function": None})
    assert U.report(nobody).splitlines()[0] == "your ?"
    real = U.real_geometries()[1]
    shipped = U.UserOutcome(declined="x", **{**common, "case": Case(real, 4, 2, 0)})
    assert U.report(shipped).splitlines()[1].startswith(
        "  geometry (qwen2_5_7b, a shipped geometry): vocab=520 ")


def test_an_outcome_holds_when_it_passed_or_is_skipped():
    common = {"case": Case(C, 2, 1, 0), "threshold": 1.0, "deviation": 0.0,
              "shards_differ": False}
    assert not U.UserOutcome(**common).holds("invariant")  # no verdict: nothing passed
    assert U.UserOutcome(skip=True, **common).holds("invariant")
    passed = run(resharder(uf.reshard_correct), Case(C, 2, 1, 0))
    assert passed.holds("invariant") and passed.holds("convert")


# ---- the shipped geometries -----------------------------------------------------------------

def test_the_shipped_geometries_are_each_config_json_reduced():
    assert (U.REAL_SHRINK, U.REAL_VOCAB) == (16, 520)
    assert U.real_geometries() == [shipped_hf_config(n, shrink=16, n_layers=1, vocab=520)
                                   for n in HF_CONFIGS]
    assert U._is_real(U.real_geometries()[0]) and not U._is_real(C)


def cases(function, **kw):
    return [(c.config.name, c.src, c.dst) for c in U.real_cases(function, **kw)]


def test_each_role_runs_the_shipped_geometries_at_the_degrees_that_move_rows():
    names = ["llama3_8b", "qwen2_5_7b", "mistral_7b", "mistral_nemo"]
    assert cases(U.UserFunction(uf.split_correct, "splitter")) == [
        (n, 1, t) for n, t in zip(names, (8, 4, 8, 8))]
    assert cases(resharder(uf.reshard_correct)) == [
        (n, t, 2) for n, t in zip(names, (8, 4, 8, 8))]
    assert cases(converter(uf.convert_megatron_to_vllm)) == [
        (n, t, 2) for n, t in zip(names, (8, 4, 8, 8))]
    assert cases(converter(uf.convert_megatron_to_vllm, "megatron", "hf")) == [
        (n, t, 1) for n, t in zip(names, (8, 4, 8, 8))]  # hf holds t = 1 only
    assert cases(converter(uf.convert_megatron_to_vllm, "hf", "hf")) == [
        (n, 1, 1) for n in names]  # nowhere else to go
    assert all(c.phase == "1b" and c.seed == 0
               for c in U.real_cases(resharder(uf.reshard_correct), phase="1b"))
    conversion = U.real_cases(converter(uf.convert_megatron_to_vllm))[0]
    assert (conversion.src_convention, conversion.dst_convention) == ("megatron", "vllm")


def test_a_fixed_degree_keeps_only_the_geometries_that_hold_it():
    function = resharder(uf.reshard_correct)
    assert cases(function, src=8) == [("llama3_8b", 8, 2), ("mistral_7b", 8, 2),
                                      ("mistral_nemo", 8, 2)]
    assert cases(function, src=2, dst=4) == [(n, 2, 4) for n in (
        "llama3_8b", "qwen2_5_7b", "mistral_7b", "mistral_nemo")]
    assert cases(function, dst=8) == [("llama3_8b", 8, 8), ("mistral_7b", 8, 8),
                                      ("mistral_nemo", 8, 8)]
    assert cases(function, src=1) == [(n, 1, 2) for n in (
        "llama3_8b", "qwen2_5_7b", "mistral_7b", "mistral_nemo")]
    assert cases(U.UserFunction(uf.split_correct, "splitter"), dst=2) == [
        (n, 1, 2) for n in ("llama3_8b", "qwen2_5_7b", "mistral_7b", "mistral_nemo")]


def test_an_fp8_converter_runs_the_shipped_geometries_its_destination_stores():
    """The FP8 domain is the harness's choice for an FP8 destination, not a narrowing: the
    shipped geometries run wherever the destination stores them (per tensor: at every degree;
    per 128-row block: nowhere, their reduced widths are not whole blocks)."""
    tensor = converter(uf.convert_to_fp8, dst="vllm:fp8=tensor")
    assert cases(tensor, domain=tensor.domain(DOMAIN)) == [
        ("llama3_8b", 8, 2), ("qwen2_5_7b", 4, 2), ("mistral_7b", 8, 2), ("mistral_nemo", 8, 2)]
    block = converter(uf.convert_to_fp8, dst="vllm:fp8=block128")
    assert cases(block, domain=block.domain(DOMAIN)) == []
    narrowed = dataclasses.replace(FP8_DOMAIN, d_model=IntRange(64, 320, 64))
    assert [n for n, *_ in cases(tensor, domain=narrowed)] == ["llama3_8b", "mistral_7b",
                                                                "mistral_nemo"]


def test_a_field_the_user_narrowed_leaves_out_the_shipped_geometries_outside_it():
    function = resharder(uf.reshard_correct)
    group = dataclasses.replace(DOMAIN, group=IntRange(1, 5))  # qwen's 7 is outside
    assert [n for n, *_ in cases(function, domain=group)] == [
        "llama3_8b", "mistral_7b", "mistral_nemo"]
    wide = dataclasses.replace(DOMAIN, d_model=IntRange(8, 256, 8))  # nemo's 320 is outside
    assert [n for n, *_ in cases(function, domain=wide)] == [
        "llama3_8b", "qwen2_5_7b", "mistral_7b"]
    # a field not narrowed leaves every geometry in, however far outside the domain it is
    heads = dataclasses.replace(DOMAIN, head_dim=IntRange(2, 8, 2))  # every one's 8 inside
    assert len(cases(function, domain=heads)) == 4


# ---- counting a run -------------------------------------------------------------------------

def outcome(config=C, *, declined=None, passed=True, src=2, dst=1, function=None):
    case = Case(config, src, dst, 0)
    verdict = SimpleNamespace(passed=passed) if declined is None else None
    return U.UserOutcome(case=case, deviation=0.0, threshold=1.0, shards_differ=False,
                         verdict=verdict, declined=declined,
                         function=function or resharder(uf.reshard_correct))


def test_the_stats_count_declined_cases_apart_and_keep_the_smallest():
    stats = U.UserStats()
    big = C.replace(d_model=32)
    for o in (outcome(), outcome(big, declined="big"), outcome(C, declined="small", src=4),
              outcome(C, declined="same size, fewer ranks", src=2),
              outcome(big, declined="bigger again", src=1)):
        stats.add(o)
    assert (stats.examples, stats.declined, stats.checked) == (5, 4, 1)
    assert stats.smallest_declined.declined == "same size, fewer ranks"
    assert stats.first_failure_at is None and stats.real == {}
    assert stats.lines() == [
        "1 cases checked, 4 declined (Unsupported: skipped, not passed)",
        f"smallest declined: {GEOMETRY}, t=2 -> t=1: same size, fewer ranks"]


def test_the_stats_keep_the_first_failure_and_every_shipped_geometrys_outcome():
    stats = U.UserStats()
    real = U.real_geometries()
    stats.add(outcome())
    stats.add(outcome(real[0], passed=False, src=8, dst=2))
    stats.add(outcome(passed=False))
    stats.add(outcome(real[1], src=4, dst=2))
    stats.add(outcome(real[2], declined="no", src=8, dst=2))
    assert stats.first_failure_at == 2 and stats.checked == 4
    assert list(stats.real) == ["llama3_8b", "qwen2_5_7b", "mistral_7b"]
    assert [o.case.config.name for o in stats.held_back()] == ["llama3_8b"]
    assert stats.lines() == [
        "4 cases checked, 1 declined (Unsupported: skipped, not passed)",
        "smallest declined: " + U.format_geometry(real[2]) + ", t=8 -> t=2: no",
        "first failing example: the 2nd run",
        "shipped geometries (explicit examples, 1 layer, sizes / 16, vocab 520): "
        "llama3_8b t=8 -> t=2 FAIL, qwen2_5_7b t=4 -> t=2 PASS, mistral_7b t=8 -> t=2 declined"]
    assert U.UserStats().lines() == [
        "0 cases checked, 0 declined (Unsupported: skipped, not passed)"]


@pytest.mark.parametrize("n, text", [
    (1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (9, "9th"), (10, "10th"), (11, "11th"),
    (12, "12th"), (13, "13th"), (20, "20th"), (21, "21st"), (22, "22nd"), (23, "23rd"),
    (100, "100th"), (101, "101st"), (111, "111th"), (112, "112th"), (120, "120th"),
    (121, "121st")])
def test_ordinals(n, text):
    assert U._ordinal(n) == text


def test_the_case_runner_counts_each_case_and_skips_what_is_no_counterexample(monkeypatch):
    real = U.real_geometries()[0]
    answers = {}
    calls = []

    def fake(function, case, *, forward, threshold_rule):
        calls.append((function, case, forward, threshold_rule))
        return answers[case]

    monkeypatch.setattr(U, "run_user_case", fake)
    function = resharder(uf.reshard_correct)
    stats = U.UserStats()
    runner = U.case_runner(function, stats)
    rows = [(outcome(), False), (outcome(passed=False), False),
            (outcome(declined="no"), True), (outcome(real, passed=False, src=8), True),
            (outcome(real, src=4), False)]
    for o, skip in rows:
        answers[o.case] = o
        got = runner(o.case, forward="fw", threshold_rule="r")
        assert got.skip is skip and dataclasses.replace(got, skip=False) == o
    assert [c[2:] for c in calls] == [("fw", "r")] * 5 and calls[0][0] is function
    assert stats.examples == 5 and stats.declined == 1 and stats.first_failure_at == 2
    calls.clear()
    runner(rows[0][0].case)
    assert calls[0][2] is U.inprocess_forward and calls[0][3] is None


def test_a_shipped_geometrys_failure_is_raised_only_as_the_held_back_one():
    stats = U.UserStats()
    assert U._held_back_failure(stats) is None
    stats.add(outcome(U.real_geometries()[0], src=8, dst=2))
    assert U._held_back_failure(stats) is None
    failing = outcome(U.real_geometries()[1], passed=False, src=4, dst=2)
    stats.add(failing)
    failure = U._held_back_failure(stats)
    assert failure.prop == "invariant" and failure.outcome is failing
    assert str(failure) == (
        f"invariant fails on {U.report(failing)}\n  (a shipped geometry, run as an explicit "
        "example: not shrunk, not written to the corpus; no random draw failed)")
    conv = converter(uf.convert_megatron_to_vllm)
    stats = U.UserStats()
    stats.add(dataclasses.replace(failing, function=conv))
    assert U._held_back_failure(stats).prop == "convert"
    stats = U.UserStats()
    stats.add(dataclasses.replace(failing, function=None))
    assert U._held_back_failure(stats).prop == "invariant"


def test_the_corpus_cases_are_this_functions_entries(monkeypatch, tmp_path):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    function = resharder(uf.reshard_correct)
    me = {"function": function.name, "role": "resharder"}
    a, b = Case(C, 2, 1, 0), Case(C, 2, 1, 1)
    entries = [entry(me, a), entry({**me, "function": "x:y"}, b), entry(me, b)]
    asked = []
    monkeypatch.setattr(U, "entry_paths", lambda d: asked.append(d) or ["p"])
    monkeypatch.setattr(U, "load_corpus", lambda paths: entries if paths == ["p"] else [])
    assert U.corpus_cases(function) == [a, b]
    assert asked == [tmp_path]


# ---- a run ----------------------------------------------------------------------------------

@pytest.fixture
def property_runs(monkeypatch):
    """``runner.run_property`` stood in: records its arguments, runs each example through the
    case runner it was given, and returns a tally."""
    runs = []

    def fake(prop, mutation, *, corpus, phase, strategy, examples, case_runner, entry_fields,
             **kwargs):
        runs.append({"prop": prop, "mutation": mutation, "corpus": corpus, "phase": phase,
                     "strategy": strategy, "examples": examples, "entry_fields": entry_fields,
                     **kwargs})
        for case in examples:
            case_runner(case)
        return Tally(prop, mutation, examples=len(examples))

    monkeypatch.setattr(U, "run_property", fake)
    return runs


def test_a_fuzz_run_runs_the_corpus_and_shipped_geometries_first(property_runs, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    corpus = [Case(C, 2, 1, 7)]
    monkeypatch.setattr(U, "corpus_cases", lambda function: corpus)
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f))
    function = resharder(uf.reshard_correct)
    stats = U.UserStats()
    run_ = U.fuzz_run(function, stats=stats, src=2)
    tally = run_("invariant", None, phase="1a", budget=3)
    [first] = property_runs
    assert first["examples"] == [*corpus, *U.real_cases(function, src=2)]
    assert first["corpus_path"] == tmp_path and first["budget"] == 3
    assert first["entry_fields"] == function.entry_fields() and first["corpus"] is True
    assert tally.examples == 5 and stats.examples == 5
    run_("invariant", None, corpus_path=tmp_path / "mine")
    assert property_runs[1]["corpus_path"] == tmp_path / "mine"
    run_("invariant", None, corpus=False)
    assert property_runs[2]["examples"] == [] and property_runs[2]["corpus"] is False
    U.fuzz_run(function, stats=stats, real=False)("invariant", None)
    assert property_runs[3]["examples"] == corpus


def test_a_fuzz_run_refuses_an_uncallable_function_before_drawing(property_runs):
    with pytest.raises(UserCodeError, match="has the wrong signature"):
        U.fuzz_run(resharder(lambda shards: shards), stats=U.UserStats())
    assert property_runs == []


def test_a_fuzz_run_fuzzes_an_fp8_converter_over_the_fp8_domain(monkeypatch):
    seen = []
    monkeypatch.setattr(U, "user_cases", lambda role, **kw: seen.append((role, kw)) or "s")
    U.fuzz_run(converter(uf.convert_to_fp8, dst="vllm:fp8=block128"), stats=U.UserStats(),
               dst=2, phase="1a")
    [(role, kw)] = seen
    assert role == "converter" and kw["domain"] == FP8_DOMAIN and kw["dst"] == 2
    assert kw["conventions"] == ("megatron", "vllm:fp8=block128") and kw["src"] is None
    assert kw["stages"] == (True, True) and kw["phase"] == "1a"


def test_a_shipped_geometrys_failure_fails_the_run_after_its_round(property_runs, monkeypatch):
    monkeypatch.setattr(U, "corpus_cases", lambda function: [])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f,
        passed=case.config.name != "qwen2_5_7b"))
    stats = U.UserStats()
    run_ = U.fuzz_run(resharder(uf.reshard_correct), stats=stats)
    with pytest.raises(PropertyFailed) as info:
        run_("invariant", None)
    assert info.value.outcome.case.config.name == "qwen2_5_7b"
    assert info.value.tally.failures == 1 and info.value.tally.examples == 4
    assert run_("invariant", None, corpus=False).failures == 0  # not judged without a corpus


def failure(case):
    return PropertyFailed("invariant", dataclasses.replace(outcome(passed=False), case=case))


def test_the_users_report_counts_checked_cases_and_each_counterexample_once():
    a, b = Case(C, 2, 1, 0), Case(C, 2, 1, 1)
    tallies = [Tally("invariant", None, examples=10, failures=3),
               Tally("invariant", None, examples=7, failures=0)]
    report = FuzzReport(tallies=tallies, failures=[failure(a), failure(b), failure(a)],
                        elapsed=1.0, profile="wsb-test", master_seed=7)
    stats = U.UserStats(declined=2)
    got = U.user_report(report, stats)
    assert [f.outcome.case for f in got.failures] == [a, b]
    assert [(t.examples, t.failures) for t in got.tallies] == [(8, 2), (5, 2)]
    assert [(t.examples, t.failures) for t in report.tallies] == [(10, 3), (7, 0)]


# ---- from pytest ----------------------------------------------------------------------------

@pytest.fixture
def inner(monkeypatch):
    """``runner.property_test`` stood in: a Hypothesis test running the given examples once
    through the case runner, raising what ``raise_`` says after them."""
    state = {"raise": None, "args": None}

    def fake(prop, mutation, tally, *, phase, forward, threshold_rule, examples, strategy,
             case_runner):
        state["args"] = {"prop": prop, "tally": tally, "phase": phase, "forward": forward,
                         "threshold_rule": threshold_rule, "examples": examples,
                         "strategy": strategy}

        ran = []

        @given(st.just(None))
        def test(_):
            if not ran:  # once, however often Hypothesis replays the example
                ran.append(True)
                for case in examples:
                    case_runner(case, forward=forward, threshold_rule=threshold_rule)
            if state["raise"] is not None:
                raise state["raise"]()
        return test

    monkeypatch.setattr(U, "property_test", fake)
    return state


def test_a_pytest_property_runs_the_corpus_and_shipped_geometries_with_the_fuzz_rule(
        inner, monkeypatch, tmp_path):
    monkeypatch.setattr(U, "corpus_cases", lambda function: [Case(C, 2, 1, 5)])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f))
    function = resharder(uf.reshard_correct)
    test = U.user_property(function, phase="1a", forward="fw", src=2)
    assert test.__name__ == test.__qualname__ == "test_resharder_property"
    assert test.__doc__ == ("The resharder user_functions:reshard_correct gives the declared "
                            "shards on every fuzzed geometry.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        test()
    args = inner["args"]
    assert args["examples"] == [Case(C, 2, 1, 5), *U.real_cases(function, src=2)]
    assert args["prop"] == "invariant" and args["forward"] == "fw" and args["phase"] == "1a"
    assert args["tally"].prop == "invariant" and args["tally"].mutation == function.label
    assert args["threshold_rule"].__class__.__name__ == U.fuzz_threshold_rule("1a").__class__ \
        .__name__
    assert test.stats.examples == 5 and test.stats.checked == 5
    with pytest.raises(WsbError) as exc:
        U.user_property(function, corpus=False, real=False)()
    assert inner["args"]["examples"] == []
    assert str(exc.value) == ("resharder user_functions:reshard_correct: no case ran, so "
                              "nothing was checked")
    U.user_property(function, corpus=False)()
    assert inner["args"]["examples"] == U.real_cases(function)
    U.user_property(function, real=False)()
    assert inner["args"]["examples"] == [Case(C, 2, 1, 5)]


def test_a_pytest_property_warns_of_declined_cases_and_fails_when_all_declined(
        inner, monkeypatch):
    monkeypatch.setattr(U, "corpus_cases",
                        lambda function: [Case(C, 2, 1, 5), Case(C, 2, 1, 6)])
    declines = {6}
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f,
        declined="no" if case.seed in declines else None))
    function = resharder(uf.reshard_correct, name="m:f")
    with pytest.warns(UserWarning) as caught:
        U.user_property(function, real=False)()
    assert [str(w.message) for w in caught] == [
        "resharder m:f: 1 cases checked, 1 declined (Unsupported: skipped, not passed); "
        f"smallest declined: {GEOMETRY}, t=2 -> t=1: no"]
    declines.add(5)
    with pytest.raises(WsbError) as exc:
        U.user_property(function, real=False)()
    assert str(exc.value) == ("resharder m:f: every one of the 2 cases was declined "
                              "(Unsupported), so nothing was checked: narrow the domain")


def test_a_pytest_property_raises_the_held_back_shipped_failure(inner, monkeypatch):
    monkeypatch.setattr(U, "corpus_cases", lambda function: [])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f,
        passed=case.config.name != "mistral_7b"))
    with pytest.raises(PropertyFailed) as info:
        U.user_property(resharder(uf.reshard_correct))()
    assert info.value.outcome.case.config.name == "mistral_7b"
    assert "(a shipped geometry, run as an explicit example" in str(info.value)


def test_a_pytest_propertys_abort_raises_the_harness_error(inner, monkeypatch):
    monkeypatch.setattr(U, "corpus_cases", lambda function: [])
    error = WsbError("the harness broke")
    inner["raise"] = lambda: HarnessAbort(error, Case(C, 2, 1, 0))
    with pytest.raises(WsbError) as info:
        U.user_property(resharder(uf.reshard_correct), real=False)()
    assert info.value is error


def test_a_pytest_propertys_failure_is_recorded_with_the_runs_lines(inner, monkeypatch,
                                                                    tmp_path):
    monkeypatch.setattr(U, "corpus_cases", lambda function: [Case(C, 2, 1, 5)])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f, declined="no"))
    failing = outcome(C.replace(d_model=24), passed=False)
    inner["raise"] = lambda: PropertyFailed("invariant", failing)
    recorded = []
    monkeypatch.setattr(U, "_record", lambda failure, tally, function, path: recorded.append(
        (failure.outcome, tally.prop, function.name, path)))
    function = resharder(uf.reshard_correct, name="m:f")
    with pytest.raises(PropertyFailed) as info:
        U.user_property(function, real=False, corpus_path=tmp_path)()
    assert recorded == [(failing, "invariant", "m:f", tmp_path)]
    assert str(info.value) == "\n  ".join([
        f"invariant fails on {U.report(failing)}",
        "0 cases checked, 1 declined (Unsupported: skipped, not passed)",
        f"smallest declined: {GEOMETRY}, t=2 -> t=1: no"])


def test_a_pytest_property_runs_under_the_users_settings_else_without_a_deadline(inner,
                                                                                  monkeypatch):
    from hypothesis import settings

    monkeypatch.setattr(U, "corpus_cases", lambda function: [Case(C, 2, 1, 0)])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(function=f))
    seen = []
    real = settings.__call__

    def spy(self, test):
        seen.append(self)
        return real(self, test)

    monkeypatch.setattr(settings, "__call__", spy)
    U.user_property(resharder(uf.reshard_correct), real=False)()
    assert seen[-1].deadline is None
    mine = settings(max_examples=3, deadline=1000)
    U.user_property(resharder(uf.reshard_correct), real=False, settings=mine)()
    assert seen[-1] is mine


def test_a_real_pytest_property_passes_a_correct_function_and_fails_a_wrong_one(tmp_path):
    from hypothesis import settings

    few = settings(max_examples=3, database=None, deadline=None)
    test = U.user_property(resharder(uf.reshard_correct), settings=few, real=False,
                           corpus=False, domain=dataclasses.replace(
                               DOMAIN, d_model=IntRange(8, 16, 8), n_layers=IntRange(1, 1)))
    test()
    assert test.stats.checked >= 3
    with pytest.raises(PropertyFailed) as info:
        U.user_property(resharder(uf.reshard_vocab_tiles_of_64), real=False,
                        corpus_path=tmp_path,
                        settings=settings(max_examples=60, database=None, deadline=None))()
    assert info.value.entry is not None and info.value.entry.parent == tmp_path
    assert f"corpus entry: {info.value.entry}" in str(info.value)


# ---- recording a pytest property's failure --------------------------------------------------

def test_a_failure_is_written_with_the_functions_block(monkeypatch, tmp_path):
    function = resharder(uf.reshard_correct)
    failing = outcome(passed=False, function=function)
    failure = PropertyFailed("invariant", failing)
    tally = Tally("invariant", function.label)
    U._record(failure, tally, function, tmp_path)
    assert failure.entry is not None and failure.entry.parent == tmp_path
    assert str(failure).endswith(f"\n  corpus entry: {failure.entry}")
    import json
    written = json.loads(failure.entry.read_text())
    assert written["user"] == function.entry_fields()["user"]
    assert written["property"] == "invariant" and written["found"]["profile"] is None
    assert written["found"]["hypothesis_seed"] is None


def test_a_failure_records_the_worst_deviation_the_run_saw(monkeypatch, tmp_path):
    made = []
    real = U.make_entry

    def spy(prop, outcome_, **kw):
        made.append((prop, outcome_, kw))
        return real(prop, outcome_, **kw)

    monkeypatch.setattr(U, "make_entry", spy)
    function = resharder(uf.reshard_correct)
    shrunk = dataclasses.replace(outcome(passed=False, function=function), deviation=2.0)
    worst = dataclasses.replace(shrunk, deviation=8.0, threshold=2.0)
    tally = Tally("invariant", None, worst_failing=worst)
    U._record(PropertyFailed("invariant", shrunk), tally, function, tmp_path)
    U._record(PropertyFailed("invariant", shrunk), Tally("invariant", None), function, tmp_path)
    import hypothesis
    assert [(p, o is shrunk, kw) for p, o, kw in made] == [
        ("invariant", True, {"worst_deviation": 8.0, "worst_ratio": 4.0, "profile": None,
                             "hypothesis_seed": None,
                             "hypothesis_version": hypothesis.__version__}),
        ("invariant", True, {"worst_deviation": 2.0, "worst_ratio": 2.0, "profile": None,
                             "hypothesis_seed": None,
                             "hypothesis_version": hypothesis.__version__})]


def test_a_failure_whose_corpus_cannot_be_found_says_so(monkeypatch, tmp_path):
    def nowhere(entry, directory):
        raise MissingArtifacts("no corpus here")

    monkeypatch.setattr(U, "save_entry", nowhere)
    monkeypatch.chdir(tmp_path)
    failure = PropertyFailed("invariant", outcome(passed=False))
    U._record(failure, Tally("invariant", None), resharder(uf.reshard_correct), None)
    assert failure.entry is None
    assert str(failure).endswith("\n  corpus entry not written: no corpus here")


def test_a_failure_goes_to_the_users_corpus_unless_told_where(monkeypatch, tmp_path):
    where = []
    monkeypatch.setattr(U, "save_entry", lambda entry, directory: where.append(directory) or
                        SimpleNamespace(path=directory / "e.json", note="noted"))
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path / "env"))
    function = resharder(uf.reshard_correct)
    U._record(PropertyFailed("invariant", outcome(passed=False)), Tally("invariant", None),
              function, None)
    U._record(PropertyFailed("invariant", outcome(passed=False)), Tally("invariant", None),
              function, tmp_path / "given")
    assert where == [tmp_path / "env", tmp_path / "given"]


# ---- what the first pass left -------------------------------------------------------------

def test_an_fp8_case_is_checked_on_its_seeds_fuzz_weights(monkeypatch):
    from weight_sync_bench.check import fp8
    from weight_sync_bench.fuzz.domain import fuzz_params

    seen = []
    real = fp8.check_fp8_convert

    def spy(fn, config, src, dst, params, **kw):
        seen.append((fn, config, str(src), str(dst), params, kw))
        return real(fn, config, src, dst, params, **kw)

    monkeypatch.setattr(fp8, "check_fp8_convert", spy)
    function = converter(uf.convert_to_fp8, dst="vllm:fp8=tensor", name="m:q")
    run(function, Case(C, 2, 1, 3))
    [(fn, config, src, dst, params, kw)] = seen
    assert (fn, config, src, dst) == (uf.convert_to_fp8, C, "megatron:2", "vllm:fp8=tensor")
    assert kw == {"seed": 3, "name": "m:q"}
    expected = fuzz_params(C, 3)
    assert all(torch.equal(params[n], expected[n]) for n in expected)


def test_a_converter_gets_the_endpoints_it_asks_for():
    seen = []

    def convert(shards, degree, *, config, source, target):
        seen.append((str(source), str(target)))
        raise ValueError("stop")

    run(converter(convert, name="m:c"), Case(C, 2, 1, 0))
    assert seen == [("megatron:2", "vllm:1")]


def test_a_resharders_verdict_names_both_degrees():
    outcome = run(resharder(uf.reshard_correct), Case(C, 2, 1, 0))
    assert (outcome.verdict.src, outcome.verdict.dst) == (2, 1)
    split = run(U.UserFunction(uf.split_correct, "splitter"), Case(C, 1, 2, 0))
    assert (split.verdict.src, split.verdict.dst) == (None, 2)


def test_a_cases_checker_is_of_the_cases_phase(monkeypatch):
    monkeypatch.setattr(U, "_real_threshold", lambda config, ends: 0.5)
    real = U.real_geometries()[0]
    assert U._checker(resharder(uf.reshard_correct), Case(real, 8, 2, 0, phase="1b"), "f",
                      rule).phase == "1b"
    assert U._checker(resharder(uf.reshard_correct), Case(C, 2, 1, 0, phase="1b"), "f",
                      rule).phase == "1b"


def test_the_stats_name_a_converters_degrees_by_its_endpoints_and_keep_the_first_smallest():
    conv = converter(uf.convert_megatron_to_vllm)
    stats = U.UserStats()
    stats.add(outcome(declined="first", function=conv))
    stats.add(outcome(declined="second, the same size", function=conv))
    real = U.real_geometries()[0]
    stats.add(outcome(real, src=8, dst=2, function=conv))
    assert stats.smallest_declined.declined == "first"
    assert stats.lines() == [
        "1 cases checked, 2 declined (Unsupported: skipped, not passed)",
        f"smallest declined: {GEOMETRY}, megatron:2 -> vllm:1: first",
        "shipped geometries (explicit examples, 1 layer, sizes / 16, vocab 520): "
        "llama3_8b megatron:8 -> vllm:2 PASS"]


@pytest.fixture
def strategies(monkeypatch):
    """``user_cases`` stood in: records what it was asked, returns a marker."""
    asked = []

    def user_cases(role, **kw):
        asked.append((role, kw))
        return ("strategy", len(asked))

    monkeypatch.setattr(U, "user_cases", user_cases)
    return asked


def test_a_fuzz_run_draws_and_runs_what_it_was_asked_for(property_runs, strategies,
                                                          monkeypatch, tmp_path):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    function = resharder(uf.reshard_correct)
    corpus_of = []
    monkeypatch.setattr(U, "corpus_cases", lambda f: corpus_of.append(f) or [])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f))
    group = dataclasses.replace(DOMAIN, d_model=IntRange(8, 256, 8))  # nemo's 320 outside
    stats = U.UserStats()
    run_ = U.fuzz_run(function, domain=group, src=8, dst=4, stats=stats, phase="1b")
    assert strategies == [("resharder", {"domain": group, "src": 8, "dst": 4,
                                         "conventions": None, "phase": "1b",
                                         "stages": (False, False)})]
    run_("invariant", "a mutation", phase="1b")
    got = property_runs[-1]
    assert (got["prop"], got["mutation"], got["phase"], got["strategy"]) == (
        "invariant", "a mutation", "1b", ("strategy", 1))
    assert got["examples"] == U.real_cases(function, domain=group, src=8, dst=4, phase="1b")
    assert [(c.config.name, c.src, c.dst) for c in got["examples"]] == [
        ("llama3_8b", 8, 4), ("mistral_7b", 8, 4)]
    assert corpus_of == [function]
    assert all(o.function is function for o in stats.real.values()) and stats.real
    run_("invariant", None)
    assert property_runs[-1]["phase"] == "1a"
    assert all(c.phase == "1a" for c in property_runs[-1]["examples"])
    U.fuzz_run(function, stats=stats)
    assert strategies[-1][1]["phase"] == "1a"


def test_a_held_back_failure_adds_to_the_failures_the_run_counted(monkeypatch, strategies):
    def fake(prop, mutation, **kw):
        for case in kw["examples"]:
            kw["case_runner"](case)
        return Tally(prop, mutation, examples=4, failures=2)

    monkeypatch.setattr(U, "run_property", fake)
    monkeypatch.setattr(U, "corpus_cases", lambda f: [])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f, passed=False))
    with pytest.raises(PropertyFailed) as info:
        U.fuzz_run(resharder(uf.reshard_correct), stats=U.UserStats())("invariant", None)
    assert info.value.tally.failures == 3


def test_a_pytest_property_draws_what_it_was_asked_for(inner, strategies, monkeypatch):
    monkeypatch.setattr(U, "corpus_cases", lambda f: [Case(C, 2, 1, 0)])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f))
    function = converter(uf.convert_to_fp8, dst="vllm:fp8=tensor")
    group = dataclasses.replace(FP8_DOMAIN, batch=IntRange(1, 3))  # every shipped one inside
    U.user_property(function, domain=group, src=8, dst=4, phase="1a")()
    assert strategies == [("converter", {"domain": group, "src": 8, "dst": 4,
                                         "conventions": ("megatron", "vllm:fp8=tensor"),
                                         "phase": "1a", "stages": (True, True)})]
    assert inner["args"]["strategy"] == ("strategy", 1)
    shipped = U.real_cases(function, domain=group, src=8, dst=4)
    assert len(shipped) == 3 and {c.dst for c in shipped} == {4}
    assert inner["args"]["examples"] == [Case(C, 2, 1, 0), *shipped]


def test_a_pytest_propertys_shipped_cases_are_of_its_phase(inner, strategies, monkeypatch):
    monkeypatch.setattr(U, "corpus_cases", lambda f: [])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f))
    U.user_property(resharder(uf.reshard_correct), phase="1b", dst=2)()
    assert inner["args"]["examples"] == U.real_cases(resharder(uf.reshard_correct), dst=2,
                                                     phase="1b")
    assert inner["args"]["phase"] == "1b"


def test_the_declined_warning_points_at_the_caller_and_says_two_lines(inner, monkeypatch):
    real = U.real_geometries()[0]
    monkeypatch.setattr(U, "corpus_cases", lambda f: [Case(C, 2, 1, 5), Case(real, 8, 2, 0)])
    monkeypatch.setattr(U, "run_user_case", lambda f, case, **k: outcome(
        case.config, src=case.src, dst=case.dst, function=f,
        declined="no" if case.seed == 5 else None))
    test = U.user_property(resharder(uf.reshard_correct, name="m:f"), real=False)
    with pytest.warns(UserWarning) as caught:
        test()
    [warning] = caught
    assert warning.filename == __file__
    assert str(warning.message) == (
        "resharder m:f: 1 cases checked, 1 declined (Unsupported: skipped, not passed); "
        f"smallest declined: {GEOMETRY}, t=2 -> t=1: no")

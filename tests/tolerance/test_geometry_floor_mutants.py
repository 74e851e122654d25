"""Per-geometry floor claims that mutation testing found unpinned (mutation/report.md): what a
geometry's floor depends on (``geometry_record``) and the cache key digested from it (it moves
with each of those things and with nothing else, and the committed floors' keys stay what
they were committed under), the exact cache path, the exact command ``measure_command``
prints (and that the CLI reads it back as the same geometry), and ``floor_for``'s choice of
committed or cached floor, with the exact refusal text when neither covers a check.

Every config here is tiny or only described (a ``ModelConfig`` draws nothing), and every
floor a test writes goes to the ``tolerance`` fixture's copy under ``tmp_path``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from weight_sync_bench import TOY, TOY_KV4
from weight_sync_bench.cli.floor_measure import geometry_config
from weight_sync_bench.cli.main import build_parser
from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.model.config import (
    Init,
    ModelConfig,
    hf_config_path,
    shipped_hf_config,
)
from weight_sync_bench.tolerance import rules
from weight_sync_bench.tolerance.artifacts import write_artifact
from weight_sync_bench.tolerance.rules import (
    cached_floor_path,
    coverage,
    floor_for,
    geometry_key,
    geometry_record,
    load_artifact,
    load_geometry_floor,
    measure_command,
    numerics,
    threshold_from,
    weights_dtype,
)

CHECKOUT = Path(__file__).resolve().parents[2] / "tolerance"
TINY = ModelConfig(name="tiny", vocab=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                   head_dim=8, ffn=32)
TINY_GEOMETRY = {"vocab": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                 "head_dim": 8, "ffn": 32, "batch": 2, "seq_len": 16}
BASE = "python -m weight_sync_bench.tolerance geometry"


def _synthetic_floor(config, phase="1a", dtype="fp32", worst=3e-7, **edits):
    """A per-geometry floor as ``check.floor.measure_geometry`` writes it (schema, phase,
    configs, cells, worst, dtype, kind, key), with ``edits`` applied over it."""
    artifact = {
        "schema": 1, "phase": phase, "kind": "geometry", "weights_dtype": dtype,
        "configs": {config.name: {"geometry": config.geometry(),
                                  "token_shape": list(config.token_shape),
                                  "numerics": numerics(config)}},
        "cells": [{"config": config.name, "degree": 1, "worst_abs": worst / 2},
                  {"config": config.name, "degree": 2, "worst_abs": worst}],
        "worst_abs": worst, "key": geometry_key(config, phase, dtype),
        "record": geometry_record(config, phase, dtype),
    }
    artifact.update(edits)
    return artifact


def _cache(config, phase="1a", dtype="fp32", **edits):
    path = cached_floor_path(config, phase, dtype)
    write_artifact(_synthetic_floor(config, phase, dtype, **edits), path)
    return path


# -- what a floor depends on, and the key digested from it

def test_the_geometry_record_is_every_input_of_the_floor_under_its_own_name():
    assert geometry_record(TINY, "1b", "bf16") == {
        "phase": "1b", "weights_dtype": "bf16", "geometry": TINY_GEOMETRY,
        "token_shape": [2, 16], "numerics": {"rope_theta": 10000.0, "norm_eps": 1e-5},
        "init": {"std": 0.02, "norm_spread": 0.1}}
    assert numerics(TINY.replace(rope_theta=5e5, norm_eps=1e-6)) == {"rope_theta": 5e5,
                                                                    "norm_eps": 1e-6}


@pytest.mark.parametrize("name", ["llama3_8b", "qwen2_5_7b", "mistral_7b", "mistral_nemo"])
def test_a_committed_geometry_floor_keeps_the_key_record_and_path_it_was_committed_under(
        name, tolerance):
    (committed,) = (CHECKOUT / "geometry").glob(f"{name}-1a-fp32-*.json")
    artifact = json.loads(committed.read_text())
    config = shipped_hf_config(name, n_layers=1)
    # the defaults are phase 1a and fp32 weights; the digest is of the sorted-key JSON, 12
    # hex digits: a key computed any other way orphans every floor measured before
    assert geometry_key(config) == artifact["key"] == committed.stem.rsplit("-", 1)[1]
    assert len(artifact["key"]) == 12
    assert geometry_record(config, "1a", "fp32") == artifact["record"]
    assert cached_floor_path(config) == tolerance / "geometry" / committed.name


def test_the_key_changes_with_each_thing_the_floor_depends_on(monkeypatch):
    changed = {
        **{f: TINY.replace(**{f: TINY_GEOMETRY[f] * 2})
           for f in ("vocab", "d_model", "n_layers", "head_dim", "ffn", "batch", "seq_len")},
        "n_heads": TINY.replace(n_heads=4), "n_kv_heads": TINY.replace(n_heads=4, n_kv_heads=2),
        "qkv_bias": TINY.replace(qkv_bias=True), "tie": TINY.replace(tie_embeddings=True),
        "rope_theta": TINY.replace(rope_theta=5e5), "norm_eps": TINY.replace(norm_eps=1e-6),
    }
    keys = {what: geometry_key(c) for what, c in changed.items()}
    keys |= {"phase": geometry_key(TINY, "1b"), "bf16": geometry_key(TINY, dtype="bf16"),
             "fp16": geometry_key(TINY, dtype="fp16")}
    for what, init in (("std", Init(std=0.01)), ("norm_spread", Init(norm_spread=0.2))):
        with monkeypatch.context() as patch:
            patch.setattr(rules, "DEFAULT_INIT", init)
            keys[what] = geometry_key(TINY)
    keys["base"] = geometry_key(TINY)
    assert len(set(keys.values())) == len(keys), keys  # every one distinct from every other


def test_the_key_does_not_change_with_the_name_or_how_the_defaults_are_passed():
    key = geometry_key(TINY)
    assert all(c in "0123456789abcdef" for c in key) and len(key) == 12
    assert geometry_key(TINY.replace(name="renamed")) == key
    assert geometry_key(TINY, "1a", "fp32") == key == geometry_key(TINY, phase="1a")
    assert geometry_key(TINY, "1a", "fp32") == geometry_key(TINY.replace(), dtype="fp32")


def test_the_cache_path_names_config_phase_dtype_and_that_combinations_key(tolerance):
    for phase, dtype in (("1b", "bf16"), ("1a", "fp16"), ("1b", "fp32")):
        assert cached_floor_path(TINY, phase, dtype) == (
            tolerance / "geometry" / f"tiny-{phase}-{dtype}-{geometry_key(TINY, phase, dtype)}"
            ".json")
    assert cached_floor_path(TINY) == tolerance / "geometry" / f"tiny-1a-fp32-{geometry_key(TINY)}.json"
    # the key of the phase and dtype asked for, not of the defaults
    assert geometry_key(TINY, "1b", "bf16") not in {geometry_key(TINY), geometry_key(TINY, "1b"),
                                                    geometry_key(TINY, dtype="bf16")}
    assert cached_floor_path(TINY.replace(name="a/b c")).name.startswith("a_b_c-1a-fp32-")


# -- the command that measures a floor

def _command_config(command):
    """The geometry the CLI reads from a printed ``measure_command``."""
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "weight_sync_bench.tolerance", "geometry"], command
    args = build_parser().parse_args(["floor", *argv[3:]])  # the alias of `wsb floor`
    return geometry_config(args), args.phase, args.dtype


def test_a_builtin_config_is_measured_by_name_with_phase_and_dtype_only_where_not_default():
    assert measure_command(TOY) == f"{BASE} --config toy"
    assert measure_command(TOY_KV4, "1b") == f"{BASE} --config toy_kv4 --phase 1b"
    assert measure_command(TOY, dtype="bf16") == f"{BASE} --config toy --dtype bf16"
    assert measure_command(TOY, "1b", "fp16") == f"{BASE} --config toy --phase 1b --dtype fp16"
    assert _command_config(measure_command(TOY, "1b", "fp16")) == (TOY, "1b", "fp16")


@pytest.mark.parametrize("config, flags", [
    (shipped_hf_config("llama3_8b", n_layers=3), " --layers 3"),
    (shipped_hf_config("llama3_8b", n_layers=2, vocab=1024), " --layers 2 --vocab 1024"),
    (shipped_hf_config("qwen2_5_7b", n_layers=1, vocab=152064), " --layers 1"),  # full vocab
    (shipped_hf_config("mistral_7b", n_layers=1).replace(batch=4),
     " --layers 1 --batch 4 --seq-len 16"),
    (shipped_hf_config("mistral_nemo", n_layers=2).replace(seq_len=64),
     " --layers 2 --batch 2 --seq-len 64"),
    (shipped_hf_config("mistral_nemo", n_layers=1, vocab=4096).replace(batch=1, seq_len=32),
     " --layers 1 --vocab 4096 --batch 1 --seq-len 32"),
], ids=["depth", "depth-vocab", "full-vocab", "batch", "seq-len", "vocab-and-shape"])
def test_a_shipped_hf_geometry_at_another_depth_vocab_or_token_shape_is_one_command(config,
                                                                                    flags):
    path = hf_config_path(config.name)
    assert measure_command(config) == f"{BASE} --hf-config {path}{flags}"
    assert measure_command(config, "1b", "bf16") == (
        f"{BASE} --hf-config {path}{flags} --phase 1b --dtype bf16")
    assert _command_config(measure_command(config, "1b", "bf16")) == (config, "1b", "bf16")


@pytest.mark.parametrize("config", [
    TOY.replace(d_model=512),  # a built-in's name on another geometry
    shipped_hf_config("llama3_8b", shrink=16, n_layers=1),  # a shipped name at another width
    TINY,  # a name nobody ships
])
def test_a_geometry_no_command_line_names_gets_the_python_call(config):
    assert measure_command(config) == ("weight_sync_bench.check.floor.measure_geometry(config, "
                                       "phase='1a', dtype='fp32')")
    assert measure_command(config, "1b", "bf16") == (
        "weight_sync_bench.check.floor.measure_geometry(config, phase='1b', dtype='bf16')")


# -- which floor a check reads

def test_weights_dtype_is_fp32_where_an_artifact_does_not_record_it():
    assert weights_dtype({}) == "fp32"
    assert weights_dtype({"weights_dtype": "bf16"}) == "bf16"


def test_coverage_checks_fp32_weights_by_default():
    assert coverage(load_artifact("1a"), TOY) is None
    bf16 = load_artifact("1a", CHECKOUT / "phase1a_bf16.json")
    assert coverage(bf16, TOY) == "measured on bf16 weights, the check syncs fp32"
    assert coverage(bf16, TOY, "bf16") is None  # the twin


@pytest.mark.parametrize("phase, dtype, name", [("1a", "fp32", "phase1a.json"),
                                                ("1b", "fp32", "phase1b.json"),
                                                ("1a", "bf16", "phase1a_bf16.json"),
                                                ("1a", "fp16", "phase1a_fp16.json"),
                                                ("1a", "fp8_block128",
                                                 "phase1a_fp8_block128.json"),
                                                ("1a", "fp8_tensor", "phase1a_fp8_tensor.json")])
def test_a_committed_floor_of_the_phase_and_dtype_asked_for_is_chosen(phase, dtype, name,
                                                                     tolerance):
    floor = floor_for(TOY, phase, dtype)
    assert (floor.source, floor.path) == ("committed", tolerance / name)
    assert floor.artifact == load_artifact(phase, tolerance / name)
    assert floor.threshold == threshold_from(floor.artifact)


def test_a_cached_floor_of_the_dtype_asked_for_is_chosen_when_no_committed_one_covers(tolerance):
    path = _cache(TINY, "1a", "bf16")
    _cache(TINY, "1a", "fp32", worst=4e-3)  # another dtype's floor beside it, never read
    floor = floor_for(TINY, dtype="bf16")
    assert (floor.source, floor.path) == ("geometry", path)
    assert floor.threshold == 1e-4  # 100 x 3e-7, up to a power of ten
    assert floor.artifact == _synthetic_floor(TINY, "1a", "bf16")
    assert load_geometry_floor(path, TINY, "1a", "bf16") == floor.artifact
    # a committed floor that covers the geometry wins over a cached one
    _cache(TOY, "1a", "fp32", worst=4e-3)
    assert floor_for(TOY).source == "committed"


def test_no_covering_floor_is_refused_with_each_reason_and_the_command(tolerance):
    cached = cached_floor_path(TINY)
    with pytest.raises(FloorNotMeasured) as raised:
        floor_for(TINY)
    command = "weight_sync_bench.check.floor.measure_geometry(config, phase='1a', dtype='fp32')"
    assert raised.value.command == command
    assert str(raised.value) == (
        "tiny: no measured floor covers this check (phase 1a, fp32 weights, d_model 16, "
        "n_layers 1, tokens 2x16): phase1a.json: phase 1a: no floor recorded for config "
        "'tiny' (recorded: toy, toy_kv4); pass threshold= explicitly, or for a geometry "
        "inside the fuzz domain threshold_rule=floor.fuzz_threshold_rule(); no per-geometry "
        f"floor at {cached}. Measure it with `{command}`, or pass measure_floor=True to "
        "measure it on first use (cached, so the next check of this geometry reads it)")


def test_a_phase_and_dtype_with_no_committed_floor_says_not_measured(tolerance):
    assert not (tolerance / "phase1b_bf16.json").exists()
    with pytest.raises(FloorNotMeasured) as raised:
        floor_for(TOY, "1b", "bf16")
    assert str(raised.value) == (
        "toy: no measured floor covers this check (phase 1b, bf16 weights, d_model 256, "
        "n_layers 4, tokens 2x16): phase1b_bf16.json: not measured; no per-geometry floor "
        f"at {cached_floor_path(TOY, '1b', 'bf16')}. Measure it with "
        f"`{BASE} --config toy --phase 1b --dtype bf16`, or pass measure_floor=True to "
        "measure it on first use (cached, so the next check of this geometry reads it)")


def test_a_cached_floor_of_another_dtype_covers_nothing(tolerance):
    _cache(TINY, "1a", "fp32")
    with pytest.raises(FloorNotMeasured, match=r"no per-geometry floor at .*tiny-1a-bf16-"):
        floor_for(TINY, dtype="bf16")
    assert floor_for(TINY).source == "geometry"  # the twin


# -- a cached floor read back

def test_a_cached_floor_whose_key_is_another_geometrys_is_refused(tolerance):
    path = _cache(TINY, "1a", "bf16", key="0" * 12)
    with pytest.raises(ToleranceMismatch) as raised:
        load_geometry_floor(path, TINY, "1a", "bf16")
    assert str(raised.value) == (f"{path}: field 'key' records '000000000000', this "
                                 f"geometry's is {geometry_key(TINY, '1a', 'bf16')!r}")


def test_a_cached_floor_with_the_right_key_that_records_another_geometry_is_refused(tolerance):
    path = _cache(TINY, configs={"tiny": {"geometry": {**TINY_GEOMETRY, "d_model": 32},
                                          "token_shape": [2, 16]}})
    with pytest.raises(ToleranceMismatch) as raised:
        load_geometry_floor(path, TINY, "1a", "fp32")
    assert str(raised.value) == (f"{path}: tiny: running geometry differs from the phase 1a "
                                 "floor's: d_model recorded 32 running 16")
    with pytest.raises(ToleranceMismatch, match="d_model recorded 32 running 16"):
        floor_for(TINY)


def test_a_cached_floor_with_the_right_key_that_records_another_dtype_is_refused(tolerance):
    path = _cache(TINY, "1a", "bf16", weights_dtype="fp16")
    with pytest.raises(ToleranceMismatch) as raised:
        load_geometry_floor(path, TINY, "1a", "bf16")
    assert str(raised.value) == f"{path}: measured on fp16 weights, the check syncs bf16"
    untouched = _cache(TINY, "1a", "bf16")  # the twin
    assert load_geometry_floor(untouched, TINY, "1a", "bf16")["weights_dtype"] == "bf16"

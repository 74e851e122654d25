"""Floors where they are used: a check takes its threshold only from a measurement that
covers its geometry, token shape, numerics and weight dtype (``tolerance.rules.floor_for``).
A geometry nobody measured is refused naming the command that measures it, or measured on
first use and cached under ``WSB_TOLERANCE_DIR`` (a copy under ``tmp_path`` here, never the
checkout), so the second check of it measures nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weight_sync_bench import (
    TOY,
    TOY_KV4,
    check_reshard,
    check_split,
    layout_for,
    split,
)
from weight_sync_bench.check import threshold as threshold_module
from weight_sync_bench.cli.floor import as_floor_argv
from weight_sync_bench.cli.main import main as wsb_main
from weight_sync_bench.errors import FloorNotMeasured, ToleranceMismatch
from weight_sync_bench.layout.reshard import reshard
from weight_sync_bench.model.config import (
    ModelConfig,
    hf_config_path,
    shipped_hf_config,
)
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.rules import (
    cached_floor_path,
    coverage,
    floor_for,
    load_artifact,
)

CHECKOUT = Path(__file__).resolve().parents[2] / "tolerance"
# A reduced shipped geometry (head_dim 8 != 320 / 32, GQA 32:8): small enough to measure
SMALL = shipped_hf_config("mistral_nemo", shrink=16, n_layers=1, vocab=512)


def declared(config):
    layout = layout_for(config)
    return lambda full, degree: split(full, layout, degree)


@pytest.mark.parametrize("phase, dtype", [("1a", "fp32"), ("1b", "fp32"), ("1a", "bf16"),
                                          ("1a", "fp16")])
def test_each_committed_phase_floor_covers_its_recorded_configs_in_its_dtype_only(phase, dtype):
    artifact = load_artifact(phase, artifact_path(phase, dtype=dtype))
    assert sorted(artifact["configs"]) == ["toy", "toy_kv4"]
    for config in (TOY, TOY_KV4):
        assert coverage(artifact, config, dtype) is None
        other = "bf16" if dtype != "bf16" else "fp16"
        assert coverage(artifact, config, other) == (
            f"measured on {dtype} weights, the check syncs {other}")
    # a real width, a changed width, a longer sequence: none borrows this floor
    assert "no floor recorded for config 'llama3_8b'" in coverage(
        artifact, shipped_hf_config("llama3_8b", n_layers=1), dtype)
    assert "d_model recorded 256 running 512" in coverage(artifact, TOY.replace(d_model=512),
                                                          dtype)
    assert "seq_len recorded 16 running 128" in coverage(artifact, TOY.replace(seq_len=128),
                                                         dtype)


def test_a_full_width_check_is_refused_before_anything_is_drawn_naming_the_command(tolerance):
    config = shipped_hf_config("llama3_8b", n_layers=1)  # 8,192 x 128,256 vocab: 2.1e9 params
    with pytest.raises(FloorNotMeasured) as caught:
        check_split(declared(config), config, 8)
    command = (f"python -m weight_sync_bench.tolerance geometry --hf-config "
               f"{hf_config_path('llama3_8b')} --layers 1")
    assert caught.value.command == command
    text = str(caught.value)
    assert text.startswith("llama3_8b: no measured floor covers this check (phase 1a, fp32 "
                           "weights, d_model 4096, n_layers 1, tokens 2x16): phase1a.json: "
                           "phase 1a: no floor recorded for config 'llama3_8b'")
    assert f"Measure it with `{command}`" in text
    with pytest.raises(FloorNotMeasured, match="--layers 2 --dtype bf16`"):
        check_reshard(lambda s, d: s, config.replace(n_layers=2), 8, 8, dtype="bf16")


def test_a_toy_whose_geometry_changed_is_refused_not_judged_by_toys_threshold(tolerance):
    wider = TOY.replace(d_model=512)
    with pytest.raises(FloorNotMeasured, match=r"d_model recorded 256 running 512.*"
                       r"check\.floor\.measure_geometry\(config, phase='1a', dtype='fp32'\)"):
        check_split(declared(wider), wider, 2)
    assert check_split(declared(TOY), TOY, 2).passed  # the twin: TOY itself is covered


def test_first_use_measures_and_caches_and_the_second_check_measures_nothing(tolerance,
                                                                           monkeypatch):
    path = cached_floor_path(SMALL)
    assert path.parent.parent == tolerance and not path.exists()
    first = check_split(declared(SMALL), SMALL, 4, measure_floor=True)
    assert first.passed and path.is_file()
    cached = json.loads(path.read_text())
    assert cached["kind"] == "geometry" and cached["configs"]["mistral_nemo"]["geometry"] == \
        SMALL.geometry()
    assert cached["repetitions"] == 4 and {"commit", "cpu_capability", "torch"} <= set(
        cached["environment"])
    assert {c["degree"] for c in cached["cells"]} == set(layout_for(SMALL).supported_degrees())

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached geometry was measured again")

    monkeypatch.setattr(threshold_module, "measure_geometry", no_measuring)
    second = check_reshard(lambda s, d: reshard(s, layout_for(SMALL), d), SMALL, 4, 2)
    assert second.passed and second.threshold == first.threshold
    assert floor_for(SMALL).source == "geometry" and floor_for(SMALL).path == path
    assert not (CHECKOUT / "geometry" / path.name).exists()  # the checkout never written


def test_an_edited_cached_floor_is_refused_and_an_untouched_one_read(tolerance):
    # SMALL shrunk 4x further (d_model 80, head_dim 2, a vocabulary of 64), a fifth of its
    # measuring time: any geometry measured on first use is cached under its key
    config = shipped_hf_config("mistral_nemo", shrink=64, n_layers=1, vocab=64)
    path = cached_floor_path(config)
    check_split(declared(config), config, 1, measure_floor=True)
    assert floor_for(config).path == path  # the twin
    artifact = json.loads(path.read_text())
    artifact["key"] = "0" * 12
    path.write_text(json.dumps(artifact))
    with pytest.raises(ToleranceMismatch, match="field 'key' records '000000000000'"):
        floor_for(config)


def test_the_geometry_command_measures_once_and_reports_the_cache_the_second_time(
        tolerance, tmp_path, capsys):
    hf = json.loads(hf_config_path("qwen2_5_7b").read_text())
    hf.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)
    source = tmp_path / "tiny_qwen.json"
    source.write_text(json.dumps(hf))
    # the running kernel set only: the measurement under every set is
    # test_geometry_kernel_sets.py's (a process per set, 10 s more here)
    argv = ["geometry", "--hf-config", str(source), "--layers", "1", "--repetitions", "2",
            "--kernel-sets", "current"]
    assert wsb_main(as_floor_argv(argv)) == 0
    config = ModelConfig.from_hf_config(source, n_layers=1)
    assert f"wrote {cached_floor_path(config)}" in capsys.readouterr().out
    assert wsb_main(as_floor_argv(argv)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tiny_qwen: already measured ({cached_floor_path(config)})")
    assert check_split(declared(config), config, 2).passed  # read from the cache


def test_the_geometry_command_measures_nothing_a_committed_floor_already_covers(tolerance,
                                                                              capsys):
    assert wsb_main(as_floor_argv(["geometry", "--config", "toy", "--dtype", "bf16"])) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"toy: already measured ({tolerance / 'phase1a_bf16.json'}), "
                          "threshold 0.001")
    assert not (tolerance / "geometry").exists()

"""A per-geometry floor measured under every kernel set (``python -m weight_sync_bench.tolerance
geometry ... --kernel-sets all``, the default): one process per ``ATEN_CPU_CAPABILITY``, each
cell the worst of them, cached where ``floor_for`` reads it, so a check under any of those
kernel sets reads a floor that covers it."""

import json

import pytest

from weight_sync_bench.cli.measure import main as measure_main
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance.artifacts import runtime
from weight_sync_bench.tolerance.rules import (
    cached_floor_path,
    check_environment,
    environment_drift,
    floor_for,
)

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 32, "num_hidden_layers": 1,
        "vocab_size": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.fixture
def tiny(tmp_path, tolerance):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path, ModelConfig.from_hf_config(path)


def test_a_geometry_floor_is_measured_under_every_kernel_set_and_covers_each(tiny, capsys,
                                                                          monkeypatch):
    # two kernel sets, the default and the running one, without probing the others (a
    # process each); the merge itself is tested on any number (test_kernels_mutants.py)
    here = runtime()["cpu_capability"]
    chosen = ["default"] if here == "DEFAULT" else ["default", here.lower()]
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.available", lambda: chosen)
    path, config = tiny
    assert measure_main(["geometry", "--hf-config", str(path), "--repetitions", "1"]) == 0
    printed = capsys.readouterr().out
    artifact = json.loads(cached_floor_path(config).read_text())
    sets = artifact["kernel_sets"]
    assert sets == [k.upper() for k in chosen] and f"kernel sets {', '.join(sets)}; wrote" in printed
    for cell in artifact["cells"]:
        assert set(cell["by_kernel_set"]) == set(sets)
        assert cell["worst_abs"] == max(cell["by_kernel_set"].values())
    assert artifact["worst_abs"] == max(c["worst_abs"] for c in artifact["cells"])
    floor = floor_for(config)
    assert floor.source == "geometry" and floor.threshold == artifact["threshold"]
    # no drift note under any of the kernel sets it was measured under
    for kernel_set in sets:
        recorded = {**artifact["environment"], "kernel_sets": sets}
        assert environment_drift(recorded, {**runtime(), "cpu_capability": kernel_set}) == []
    assert check_environment(artifact, "the floor") == ()


def test_the_twin_measured_under_the_running_kernel_set_only_is_noted_under_another(tiny):
    path, config = tiny
    assert measure_main(["geometry", "--hf-config", str(path), "--repetitions", "1",
                         "--kernel-sets", "current"]) == 0
    artifact = json.loads(cached_floor_path(config).read_text())
    assert "kernel_sets" not in artifact
    other = "DEFAULT" if runtime()["cpu_capability"] != "DEFAULT" else "AVX2"
    (note,) = environment_drift(artifact["environment"], {**runtime(), "cpu_capability": other})
    assert note == f"cpu_capability recorded {artifact['environment']['cpu_capability']} running {other}"

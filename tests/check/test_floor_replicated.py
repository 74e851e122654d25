"""The floors measure vLLM's replicated-KV forward (t > n_kv_heads, each KV head on t / n_kv
ranks) in cells of its own, as ``check_convert`` runs it: every committed phase floor has
them at every such degree up to ``REPLICATED_MAX_DEGREE``, a cell is the deviation of that
very forward, and the streamed measurement of a per-geometry floor gives the same cells as
the whole-model one."""

import json

import pytest

from weight_sync_bench import TOY, TOY_KV4, ModelConfig
from weight_sync_bench.check import floor
from weight_sync_bench.check.convert import conversion_checker
from weight_sync_bench.cli.floor_report import phase_table
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.phase import cell_forward, measured_degrees
from weight_sync_bench.tolerance.rules import load_artifact

# 8 heads over 2 KV heads: vLLM replicates at t = 4 and 8; the plain layout stops at 2
SMALL = ModelConfig(name="small", vocab=100, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2,
                    head_dim=4, ffn=48)


@pytest.mark.parametrize("phase, dtype", [("1a", "fp32"), ("1a", "bf16"), ("1a", "fp16"),
                                          ("1b", "fp32")])
def test_every_committed_phase_floor_has_the_replicated_kv_cells_of_each_config(phase, dtype):
    artifact = load_artifact(phase, artifact_path(phase, dtype=dtype))
    assert set(artifact["configs"]) == {"toy", "toy_kv4"}
    for config in (TOY, TOY_KV4):
        wide = measured_degrees(artifact, config.name, floor.REPLICATED_KV)
        assert wide == floor.replicated_degrees(config) == (
            [4, 8] if config is TOY else [8]), (phase, dtype, config.name)
        plain = measured_degrees(artifact, config.name, floor.PLAIN_FORWARD)
        assert plain == [t for t in (1, 2, 4) if t <= config.n_kv_heads]
    # every cell of the replicated forward is a measurement as the plain ones are
    cells = [c for c in artifact["cells"] if cell_forward(c) == floor.REPLICATED_KV]
    assert all(c["elements"] == artifact["cells"][0]["elements"] > 0 for c in cells)
    assert all(c["worst_abs"] > 0 for c in cells)  # t > 1: o_proj sums t partials
    # measured under every kernel set the plain cells were, each keeping the worst
    assert all(set(c["by_kernel_set"]) == set(artifact["kernel_sets"]) and
               c["worst_abs"] == max(c["by_kernel_set"].values()) for c in cells)


def test_the_replicated_degrees_are_vllms_past_n_kv_heads_up_to_the_harness_bound():
    assert floor.replicated_degrees(SMALL) == [4, 8]
    assert floor.replicated_degrees(SMALL.replace(n_heads=16), 16) == [4, 8, 16]
    assert floor.replicated_degrees(SMALL.replace(n_kv_heads=8)) == []  # n_heads 8: none past 8
    assert floor.forward_of("vllm", SMALL, 4) == floor.REPLICATED_KV
    assert floor.forward_of("vllm", SMALL, 2) == floor.PLAIN_FORWARD  # t <= n_kv: partitioned
    assert floor.forward_of("megatron", SMALL, 2) == floor.PLAIN_FORWARD


def test_a_replicated_cell_is_the_deviation_of_the_forward_check_convert_runs():
    """Cell for cell, the worst deviation over one seed is ``ConversionChecker``'s of the
    declared vLLM shards (the conversion check's forward), for fp32 and bf16 weights."""
    for dtype in ("fp32", "bf16"):
        artifact = floor.measure("1a", configs=[SMALL], repetitions=1, dtype=dtype,
                                 replicated=True)
        wide = {c["degree"]: c for c in artifact["cells"]
                if cell_forward(c) == floor.REPLICATED_KV}
        assert sorted(wide) == [4, 8]
        checker = conversion_checker(SMALL, threshold=1.0, dtype=dtype)
        for t, cell in wide.items():
            assert cell["worst_abs"] == checker.declared_error(f"vllm:{t}"), (dtype, t)
        assert artifact["worst_abs"] == max(c["worst_abs"] for c in artifact["cells"])


def test_measuring_the_replicated_cells_leaves_the_plain_ones_as_they_were():
    both = floor.measure("1a", configs=[SMALL], repetitions=2, replicated=True)["cells"]
    plain = floor.measure("1a", configs=[SMALL], repetitions=2)["cells"]  # chosen configs: plain
    assert [c["degree"] for c in plain] == [1, 2] and all("forward" not in c for c in plain)
    assert plain == [c for c in both if cell_forward(c) == floor.PLAIN_FORWARD]


@pytest.mark.parametrize("config", [SMALL, SMALL.replace(name="small_tied", tie_embeddings=True,
                                                         qkv_bias=True)],
                         ids=["untied", "tied_qkv_bias"])
def test_the_streamed_per_geometry_floor_has_the_whole_model_replicated_cells(config, tmp_path):
    whole = floor.measure("1a", configs=[config], repetitions=2, replicated=True)["cells"]
    artifact, path = floor.measure_geometry(config, repetitions=2, out=tmp_path / "g.json")
    assert artifact["cells"] == whole  # streamed, bit for bit the whole-model measurement
    assert measured_degrees(artifact, config.name, floor.REPLICATED_KV) == [4, 8]
    assert json.loads(path.read_text())["cells"] == whole
    # the bound: past it no cell, unless asked for
    wider = config.replace(name=f"{config.name}16", n_heads=16)
    bounded, _ = floor.measure_geometry(wider, repetitions=1, out=tmp_path / "w.json")
    assert measured_degrees(bounded, wider.name, floor.REPLICATED_KV) == [4, 8]
    reached, _ = floor.measure_geometry(wider, repetitions=1, out=tmp_path / "w16.json",
                                        max_degree=16)
    assert measured_degrees(reached, wider.name, floor.REPLICATED_KV) == [4, 8, 16]


def test_the_table_names_the_forward_of_each_replicated_cell():
    table = phase_table(load_artifact("1a"))
    assert "toy_kv4, t=8 (vllm-replicated-kv)" in table
    assert "toy_kv4, t=4  " in table  # a plain cell carries no label


def test_every_shipped_per_geometry_floor_has_the_replicated_cells_its_geometry_needs():
    """Llama-3-8B, Mistral-7B, Mistral-Nemo and Llama-3-70B's width have 8 KV heads,
    Qwen2.5-7B 4 with 28 heads (vLLM stores no t past 4 there): no vLLM degree up to 8
    exceeds n_kv_heads, so their floors are complete without such a cell. Qwen3-30B-A3B has 4
    KV heads over 32 query heads: vLLM replicates at 8, and that cell is measured."""
    from weight_sync_bench.tolerance.artifacts import tolerance_dir

    floors = sorted((tolerance_dir() / "geometry").glob("*-1a-fp32-*.json"))
    assert len(floors) >= 8
    needing = {}
    for path in floors:
        artifact = json.loads(path.read_text())
        ((name, recorded),) = artifact["configs"].items()
        config = ModelConfig.from_geometry(recorded["geometry"], name)
        wide = floor.replicated_degrees(config)
        assert measured_degrees(artifact, name, floor.REPLICATED_KV) == wide, name
        needing[name] = wide
    assert needing["llama3_8b"] == [] and needing["qwen2_5_7b"] == []
    assert needing["qwen3_30b_a3b"] == [8]  # not vacuous: one shipped floor needs the cell

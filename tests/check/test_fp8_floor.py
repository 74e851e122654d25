"""The FP8 floor: ``tolerance/phase1a_fp8_block128.json`` and ``phase1a_fp8_tensor.json``
measure the forward of an FP8 destination (bf16 weights through the reference quantizer,
the reference and the sharded forward on the same dequantized values) under every kernel
set, as the other phase floors are measured; a seeded FP8 check at a committed geometry is
judged by it, and says so. Its twins: the user's own weights, or a geometry the floor did
not measure, get a threshold measured on their dequantized weights, and say that."""

from __future__ import annotations

import pytest

from tests.check.test_fp8_convert import TOY_FP8, good
from weight_sync_bench import check_convert
from weight_sync_bench.check import floor
from weight_sync_bench.model.config import TOY_KV4, init_params
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.rules import load_artifact, threshold_from


@pytest.mark.parametrize("scheme", ["block128", "tensor"])
def test_the_committed_fp8_floor_records_what_it_measured(scheme):
    artifact = load_artifact("1a", artifact_path("1a", dtype=f"fp8_{scheme}"))
    assert artifact["weights_dtype"] == f"fp8_{scheme}"
    assert artifact["quantized_from"] == "bf16" and artifact["compute_dtype"] == "fp32"
    assert set(artifact["configs"]) == {"toy", "toy_kv4"}
    assert all(len(c["by_kernel_set"]) >= 2 for c in artifact["cells"])  # every kernel set
    sharded = [c["worst_abs"] for c in artifact["cells"] if c["degree"] > 1]
    assert min(sharded) > 0  # a sharded forward sums in another order: a floor, not zero


@pytest.fixture(scope="module")
def bf16_cells():
    """TOY_KV4's bf16 floor measured as the FP8 ones below are (one seed, replicated cells):
    the weights each scheme quantizes, measured once for both."""
    return floor.measure("1a", configs=[TOY_KV4], repetitions=1, dtype="bf16",
                         replicated=True)["cells"]


@pytest.mark.parametrize("scheme", ["block128", "tensor"])
def test_measuring_again_stays_within_the_committed_cells(scheme, bf16_cells):
    """Seed 0 on the running kernel set is one of the observations each committed cell is
    the worst of: measured again by the same code, no cell exceeds it (a quantizer or a
    measurement that changed without the artifact would)."""
    committed = load_artifact("1a", artifact_path("1a", dtype=f"fp8_{scheme}"))
    again = floor.measure("1a", configs=[TOY_KV4], repetitions=1, dtype=f"fp8_{scheme}",
                          replicated=True)
    worst = {(c["config"], c["degree"], c.get("forward")): c["worst_abs"]
             for c in committed["cells"]}
    for cell in again["cells"]:
        key = (cell["config"], cell["degree"], cell.get("forward"))
        assert cell["worst_abs"] <= worst[key], (key, cell["worst_abs"], worst[key])
    assert sum(c["worst_abs"] for c in again["cells"]) > 0
    # and it measured the quantized weights, not the bf16 ones they were quantized from
    assert [c["worst_abs"] for c in again["cells"]] != [c["worst_abs"] for c in bf16_cells]


def test_a_seeded_check_at_a_committed_geometry_reads_the_fp8_floor_and_its_twins_measure(
        monkeypatch):
    from weight_sync_bench.check import fp8

    at = "vllm:tp=2,fp8=tensor"
    v = check_convert(good, TOY_KV4, "megatron:2", at, dtype="bf16")
    artifact = load_artifact("1a", artifact_path("1a", dtype="fp8_tensor"))
    assert v.passed and v.threshold == threshold_from(artifact)
    assert any("committed FP8 floor" in n and "phase1a_fp8_tensor.json" in n for n in v.notes)
    # the user's own weights: measured on them, whatever the geometry
    mine = check_convert(good, TOY_KV4, "megatron:2", at, weights=init_params(TOY_KV4, 0))
    assert mine.passed and not any("committed FP8 floor" in n for n in mine.notes)
    assert any("measured on them" in n for n in mine.notes)
    # a geometry the floor did not measure: measured on its dequantized weights, and where
    # every sharded forward sums exactly there (which it does depends on the CPU's kernels:
    # on an AVX-512 Intel CPU this one does), the committed FP8 floor's threshold, said so
    worst: list[float] = []
    measure = fp8.measure_worst
    monkeypatch.setattr(fp8, "measure_worst",
                        lambda *a, **k: worst.append(measure(*a, **k)) or worst[-1])
    other = check_convert(good, TOY_FP8, "megatron:2", at, dtype="bf16")
    assert other.passed and len(worst) == 1
    said = "measured on them" if worst[0] > 0 else "summed exactly"
    assert any(said in n for n in other.notes), other.notes


def test_the_readme_states_the_committed_fp8_floors_figures():
    import re

    from tests.documentation import documentation

    text = " ".join(documentation().split())
    said = re.search(r"worst (\S+) for both schemes, threshold (\S+), as bf16's", text)
    assert said is not None, "the README no longer states the FP8 floor"
    for scheme in ("block128", "tensor"):
        artifact = load_artifact("1a", artifact_path("1a", dtype=f"fp8_{scheme}"))
        assert f"{artifact['worst_abs']:.3g}".replace("e-06", "e-6") == said.group(1)
        assert f"{threshold_from(artifact):g}".replace("0.001", "1e-3") == said.group(2)
    bf16 = load_artifact("1a", artifact_path("1a", dtype="bf16"))
    assert threshold_from(bf16) == threshold_from(
        load_artifact("1a", artifact_path("1a", dtype="fp8_tensor")))

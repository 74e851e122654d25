"""A conversion is judged only by a floor that measured its destination's forward at its
degree: vLLM past ``n_kv_heads`` (replicated KV heads) by the floor's ``vllm-replicated-kv``
cells, never by the plain cells' threshold. Without the cell the check is refused
(``FloorNotMeasured``, exit 2 from the command line) before the converter runs, naming the
geometry, the degree, the convention and the command that measures it; the twin: the
committed floors have the cells, and the same checks pass (and a wrong converter fails)."""

from __future__ import annotations

import json
import textwrap

import pytest

from weight_sync_bench import TOY, TOY_KV4, ModelConfig, check_convert, convert
from weight_sync_bench.check import floor
from weight_sync_bench.check.convert import conversion_checker
from weight_sync_bench.cli.main import main
from weight_sync_bench.conventions import materialize
from weight_sync_bench.errors import FloorNotMeasured
from weight_sync_bench.tolerance.artifacts import write_artifact
from weight_sync_bench.tolerance.phase import measured_degrees
from weight_sync_bench.tolerance.rules import (
    cached_floor_path,
    derive_threshold,
    load_artifact,
)

QKV = "model.layers.0.self_attn.qkv_proj.weight"


def harness(src, dst, config):
    return lambda shards, degree: convert(shards, src, dst, config)


def never(shards, degree):
    raise AssertionError("the converter ran")


def edit_cells(path, keep=lambda c: "forward" not in c, change=lambda c: c):
    """The artifact at ``path`` with only the cells ``keep`` accepts, each passed through
    ``change``, its worst and threshold made consistent again (as a floor measured before
    the replicated-KV cells existed reads)."""
    artifact = json.loads(path.read_text())
    artifact["cells"] = [change(dict(c)) for c in artifact["cells"] if keep(c)]
    artifact["worst_abs"] = max(c["worst_abs"] for c in artifact["cells"])
    artifact["threshold"] = derive_threshold(artifact["worst_abs"])
    write_artifact(artifact, path)


def test_the_committed_floor_judges_toy_kv4_megatron_to_vllm_8_by_its_own_cell():
    verdict = check_convert(harness("megatron:4", "vllm:8", TOY_KV4), TOY_KV4, "megatron:4",
                            "vllm:8")
    assert verdict.passed and verdict.notes == ()  # no borrowed threshold to note
    assert verdict.threshold == derive_threshold(load_artifact("1a")["worst_abs"])
    cell = next(c for c in load_artifact("1a")["cells"]
                if (c["config"], c["degree"]) == ("toy_kv4", 8))
    assert cell["forward"] == floor.REPLICATED_KV
    assert 0 < verdict.max_abs_error <= cell["worst_abs"]  # seed 0 is one of its 20 seeds

    def swapped(shards, degree):  # the twin: ranks 0 and 2 hold each other's KV replica
        out = convert(shards, "megatron:4", "vllm:8", TOY_KV4)
        out[0][QKV], out[2][QKV] = out[2][QKV], out[0][QKV]
        return out
    failed = check_convert(swapped, TOY_KV4, "megatron:4", "vllm:8")
    assert not failed.passed and failed.first_mismatch == QKV


@pytest.mark.parametrize("config, src, dst", [(TOY_KV4, "megatron:4", "vllm:8"),
                                              (TOY, "megatron:2", "vllm:4"),
                                              (TOY, "hf", "vllm:8")])
def test_a_floor_without_the_replicated_cell_refuses_the_conversion_before_it_runs(
        tolerance, config, src, dst):
    edit_cells(tolerance / "phase1a.json")  # the committed floor as it was: plain cells only
    with pytest.raises(FloorNotMeasured) as info:
        check_convert(never, config, src, dst)
    t = int(dst.split(":")[1])
    message = str(info.value)
    plain = ", ".join(str(d) for d in (1, 2, 4) if d <= config.n_kv_heads)
    assert message.startswith(f"{config.name}: no measured floor covers the forward of {dst} "
                              "(phase 1a, fp32 weights, d_model 256, n_heads 8, n_kv_heads "
                              f"{config.n_kv_heads}): vllm at t={t} runs the vllm-replicated-kv "
                              "forward, and phase1a.json never measured it (its plain cells: "
                              f"t={plain})")
    assert info.value.command == "python -m weight_sync_bench.tolerance --write"
    assert message.endswith("Measure it with `python -m weight_sync_bench.tolerance --write`")
    # streamed, and a verdict on shards already made (wsb verify's path): refused alike
    with pytest.raises(FloorNotMeasured, match=f"vllm at t={t} runs the vllm-replicated-kv"):
        check_convert(never, config, src, dst, stream="layer")
    checker = conversion_checker(config)
    from weight_sync_bench.conventions import endpoint
    with pytest.raises(FloorNotMeasured):
        checker.verdict(materialize(endpoint(dst).pieces(config), checker.checker.full),
                        src=src, dst=dst)
    # the twin on the same floor: a destination whose forward it measured is judged
    assert check_convert(harness(src, "vllm:2", config), config, src, "vllm:2").passed


def test_a_plain_cell_at_the_degree_does_not_judge_the_replicated_forward(tolerance):
    """The cell must be of the forward that runs: toy_kv4's t=8 cell relabelled as a plain
    one (what a floor of another forward at that degree would hold) is not read."""
    edit_cells(tolerance / "phase1a.json", keep=lambda c: True,
               change=lambda c: {k: v for k, v in c.items() if k != "forward"})
    with pytest.raises(FloorNotMeasured, match="phase1a.json never measured it "
                                               r"\(its plain cells: t=1, 2, 4, 8\)"):
        check_convert(never, TOY_KV4, "megatron:4", "vllm:8")


def test_each_dtype_and_phase_is_refused_naming_its_own_floor_and_command(tolerance):
    edit_cells(tolerance / "phase1a_bf16.json")
    with pytest.raises(FloorNotMeasured) as info:
        check_convert(never, TOY, "hf", "vllm:4", dtype="bf16")
    assert "phase 1a, bf16 weights" in str(info.value)
    assert "phase1a_bf16.json never measured it" in str(info.value)
    assert info.value.command == "python -m weight_sync_bench.tolerance --dtype bf16 --write"
    assert check_convert(harness("hf", "vllm:4", TOY), TOY, "hf", "vllm:4").passed  # fp32's
    edit_cells(tolerance / "phase1b.json")
    with pytest.raises(FloorNotMeasured) as info:
        check_convert(never, TOY, "megatron:2", "vllm:4", backend="gloo")
    assert info.value.command == "python -m weight_sync_bench.tolerance --phase 1b --write"


SMALL = ModelConfig(name="small16", vocab=100, d_model=32, n_layers=1, n_heads=16,
                    n_kv_heads=2, head_dim=4, ffn=48)


def test_a_per_geometry_floor_measures_the_replicated_cells_up_to_8_and_refuses_past(tolerance):
    assert check_convert(harness("hf", "vllm:8", SMALL), SMALL, "hf", "vllm:8",
                         measure_floor=True).passed  # measured on first use, t = 4 and 8 too
    path = cached_floor_path(SMALL)
    assert measured_degrees(json.loads(path.read_text()), SMALL.name,
                                  floor.REPLICATED_KV) == [4, 8]
    with pytest.raises(FloorNotMeasured) as info:  # t=16: past the measurement's bound
        check_convert(never, SMALL, "hf", "vllm:16", measure_floor=True)
    assert "measured it at t=4, 8" in str(info.value)
    assert info.value.command == ("weight_sync_bench.check.floor.measure_geometry(config, "
                                  "phase='1a', dtype='fp32', max_degree=16)")
    floor.measure_geometry(SMALL, repetitions=2, max_degree=16)  # what the command says
    assert check_convert(harness("hf", "vllm:16", SMALL), SMALL, "hf", "vllm:16").passed


def test_a_per_geometry_floor_cached_before_the_cells_existed_is_refused_naming_it(tolerance):
    floor.measure_geometry(SMALL, repetitions=1)
    edit_cells(cached_floor_path(SMALL))  # as a floor cached before this change reads
    with pytest.raises(FloorNotMeasured) as info:
        check_convert(never, SMALL, "hf", "vllm:4")
    assert f"{cached_floor_path(SMALL).name} never measured it" in str(info.value)
    assert info.value.command == ("weight_sync_bench.check.floor.measure_geometry(config, "
                                  "phase='1a', dtype='fp32')")
    assert check_convert(harness("hf", "vllm:2", SMALL), SMALL, "hf", "vllm:2").passed


@pytest.fixture
def converters(tmp_path, monkeypatch):
    module = "wsb_replicated_converters"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent("""
        from weight_sync_bench import TOY_KV4, convert

        def megatron_to_vllm(shards, degree):
            return convert(shards, "megatron", f"vllm:{degree}", TOY_KV4)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["check", "--config", "toy_kv4", "--from", "megatron:4", "--to", "vllm:8",
            "--converter", f"{module}:megatron_to_vllm"]


def test_from_the_command_line_the_refusal_is_exit_2_and_names_the_command(
        converters, tolerance, capsys):
    assert main(converters) == 0  # the committed floor (copied): judged by its own cell
    assert "1 passed, 0 failed" in capsys.readouterr().out
    edit_cells(tolerance / "phase1a.json")
    assert main(converters) == 2
    err = capsys.readouterr().err
    assert "vllm at t=8 runs the vllm-replicated-kv forward" in err
    assert "`python -m weight_sync_bench.tolerance --write`" in err

"""``wsb floor phase | training | sequence | geometry``'s own code (issue 30, the mutation
pass over ``cli/floor_measure.py``): what it hands each measurement, where it writes, what it
refuses, what it prints and the code it returns.

The measurements themselves and the kernel-set machinery are stood in (``Rig``): each records
what it was handed and returns a committed artifact, so every test runs in milliseconds. What
they do for real is ``tests/cli/test_floor.py``'s (one measurement under every kernel set),
``tests/tolerance``'s (merging, ``over``, ``kept_vendors``) and ``tests/check``'s (the phase
and geometry floors). Here: the flow between them, which is the command's alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from weight_sync_bench.check import floor as phase_floor
from weight_sync_bench.check import forwards
from weight_sync_bench.cli import floor_measure as M
from weight_sync_bench.cli.output import EXIT_OK, Ticker
from weight_sync_bench.errors import ArtifactProtected, FloorNotMeasured, InvalidConfig
from weight_sync_bench.model.config import TOY, TOY_KV4, config_by_name
from weight_sync_bench.paths import checkout
from weight_sync_bench.tolerance import kernels
from weight_sync_bench.training import floor as training_floor
from weight_sync_bench.training import sequence_floor

# Read once, at import: a mutated command that writes to a committed path (``--out``
# ignored) must not change what the next test reads. The rig stands in every committed path
# too, so no test, mutated or not, can write into the checkout.
COMMITTED = {name: (checkout() / "tolerance" / f"{name}.json").read_text()
             for name in ("phase1a", "phase1b", "training", "sequence")}


def committed(name: str) -> dict:
    return json.loads(COMMITTED[name])


class Rig:
    """The stand-ins: ``calls[name]`` lists what each was handed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.calls: dict[str, list] = {}
        self.sets = ["default", "avx2"]
        self.floor: object = FloorNotMeasured("no floor")
        self.drift: list[str] = []
        self.kept: list[str] = []
        self.merged = {**committed("phase1a"), "merged": True}
        record = self.record
        monkeypatch.setattr(kernels, "available", lambda: record("available") or self.sets)
        monkeypatch.setattr(kernels, "measure_under", self.measure_under)
        monkeypatch.setattr(kernels, "merge", lambda arts: record("merge", arts) or self.merged)
        monkeypatch.setattr(kernels, "kept_vendors", self.kept_vendors)
        monkeypatch.setattr(kernels, "over", self.over)
        monkeypatch.setattr(phase_floor, "measure", self.phase)
        monkeypatch.setattr(phase_floor, "measure_geometry", self.geometry)
        monkeypatch.setattr(training_floor, "measure", self.training("training"))
        monkeypatch.setattr(sequence_floor, "measure_sequence", self.training("sequence"))
        monkeypatch.setattr(forwards, "phase1b_runner", lambda: "RUNNER")
        monkeypatch.setattr(forwards, "gloo_forward", lambda: "GLOO FORWARD")
        monkeypatch.setattr(M, "cpu_vendor", lambda: "GenuineIntel")
        monkeypatch.setattr(M, "running_kernel_set", lambda: "GenuineIntel/AVX512")
        monkeypatch.setattr(M, "guard", lambda args, config, unit: record("guard", config, unit,
                                                                          args=args))
        monkeypatch.setattr(M, "floor_for", self.floor_for)
        monkeypatch.setattr(M, "artifact_drift", lambda a: record("drift", a) or self.drift)
        monkeypatch.setattr(M, "artifact_path", lambda *a, **k: tmp_path / "committed.json")
        monkeypatch.setattr(M, "cached_floor_path", lambda *a, **k: tmp_path / "cached.json")

    def record(self, name: str, *args, **kwargs) -> None:
        self.calls.setdefault(name, []).append((args, kwargs))

    def measure_under(self, kernel_set, argv, out, progress):
        self.record("measure_under", kernel_set, list(argv), out)
        progress(f"{kernel_set} half way")
        return {"measured under": kernel_set}

    def kept_vendors(self, old, vendor, *, force, where, measuring):
        self.record("kept_vendors", old, vendor, force=force, where=where, measuring=measuring)
        return self.kept

    def over(self, old, new, *, force, where):
        self.record("over", old, new, force=force, where=where)
        return {**new, "over": True}

    def phase(self, phase, **kwargs):
        self.record("phase", phase, **kwargs)
        return {**committed(f"phase{phase}"), "repetitions": kwargs["repetitions"]}

    def training(self, kind):
        def measure(repetitions, steps, phase, *, progress):
            self.record(kind, repetitions, steps, phase, progress=progress)
            return {**committed(kind), "repetitions": repetitions}
        return measure

    def geometry(self, config, **kwargs):
        self.record("geometry", config, **kwargs)
        return {**committed("phase1a"), "repetitions": kwargs["repetitions"]}, kwargs["out"]

    def floor_for(self, config, phase, dtype):
        self.record("floor_for", config, phase, dtype)
        if isinstance(self.floor, Exception):
            raise self.floor
        return self.floor


@pytest.fixture
def rig(monkeypatch, tmp_path):
    return Rig(monkeypatch, tmp_path)


def written(path: Path) -> dict:
    return json.loads(path.read_text())


# -- measure_kind: what each kind measures, with what


@pytest.mark.parametrize(("kind", "repetitions"), [
    ("phase", phase_floor.REPETITIONS), ("training", training_floor.REPETITIONS),
    ("sequence", training_floor.REPETITIONS)])
def test_each_kind_measures_in_process_with_its_default_repetitions(rig, tmp_path, capsys,
                                                                      kind, repetitions):
    out = tmp_path / "floor.json"
    line = Line()
    assert M.measure_kind(parse(kind, "--out", str(out), "--kernel-sets", "current"),
                          line) == EXIT_OK
    ((args, kwargs),) = rig.calls[kind]
    if kind == "phase":
        assert args == ("1a",)
        assert kwargs["runner"] is None and kwargs["forward"] is None
        assert (kwargs["repetitions"], kwargs["dtype"]) == (repetitions, "fp32")
    else:
        assert args == (repetitions, training_floor.STEPS, "1a")
    progress = kwargs["progress"]
    assert isinstance(progress, Ticker) and progress.line is line
    assert "available" not in rig.calls and "measure_under" not in rig.calls
    # the artifact written is what ``over`` made of the measurement
    ((old, new), over) = rig.calls["over"][0]
    assert old is None and over == {"force": False, "where": str(out)}
    assert written(out) == {**new, "over": True}
    assert new["repetitions"] == repetitions
    assert line.closed == 1
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(f"wrote {out}")
    assert ("max ULP" in printed) == (kind == "phase")


def test_the_flags_reach_the_measurement(rig, tmp_path):
    out = tmp_path / "f.json"
    M.measure_kind(parse("training", "--out", str(out), "--kernel-sets", "current",
                         "--repetitions", "3", "--steps", "4", "--phase", "1b"), Line())
    ((args, _),) = rig.calls["training"]
    assert args == (3, 4, "1b")
    M.measure_kind(parse("phase", "--out", str(out), "--kernel-sets", "current",
                         "--repetitions", "5", "--dtype", "bf16", "--force"), Line())
    ((args, kwargs),) = rig.calls["phase"]
    assert args == ("1a",) and (kwargs["repetitions"], kwargs["dtype"]) == (5, "bf16")
    assert rig.calls["over"][-1][1]["force"] is True


def test_a_quiet_line_gets_no_ticker(rig, tmp_path):
    M.measure_kind(parse("sequence", "--out", str(tmp_path / "f.json"), "--kernel-sets",
                         "current"), Line(enabled=False))
    assert rig.calls["sequence"][0][1]["progress"] is None
    assert M.ticker(Line(enabled=False)) is None
    line = Line()
    assert M.ticker(line).line is line


@pytest.mark.parametrize(("dtype", "forward"), [("fp32", None), ("bf16", "GLOO FORWARD")])
def test_phase_1b_measures_over_the_gloo_runner(rig, tmp_path, dtype, forward):
    M.measure_kind(parse("phase", "--phase", "1b", "--dtype", dtype, "--out",
                         str(tmp_path / "f.json"), "--kernel-sets", "current"), Line())
    ((args, kwargs),) = rig.calls["phase"]
    assert args == ("1b",) and kwargs["runner"] == "RUNNER" and kwargs["forward"] == forward


# -- measure_kind: refusals, before anything is measured


@pytest.mark.parametrize(("argv", "message"), [
    (["training", "--dtype", "bf16"], "--dtype bf16: the training floor is measured on fp32 "
                                      "weights only"),
    (["sequence", "--dtype", "fp16"], "--dtype fp16: the sequence floor is measured on fp32 "
                                      "weights only"),
    (["phase", "--dtype", "fp8_block128", "--phase", "1b"],
     "--dtype fp8_block128: an FP8 destination is checked in process, phase 1a only")])
def test_a_dtype_the_kind_does_not_measure_is_refused(rig, tmp_path, argv, message):
    with pytest.raises(InvalidConfig) as caught:
        M.measure_kind(parse(*argv, "--out", str(tmp_path / "f.json")), Line())
    assert str(caught.value) == message
    assert not rig.calls


def test_fp8_at_phase_1a_and_bf16_of_the_phase_floor_are_measured(rig, tmp_path):
    for dtype in ("fp8_tensor", "bf16"):
        assert M.measure_kind(parse("phase", "--dtype", dtype, "--out", str(tmp_path / "f"),
                                    "--kernel-sets", "current"), Line()) == EXIT_OK
    assert [c[1]["dtype"] for c in rig.calls["phase"]] == ["fp8_tensor", "bf16"]


def test_without_out_or_write_the_committed_artifact_is_not_replaced(rig):
    with pytest.raises(ArtifactProtected, match="measuring the training floor: would replace "
                       "the committed .*committed.json: pass --write"):
        M.measure_kind(parse("training"), Line())
    assert not rig.calls


@pytest.mark.parametrize(("kind", "dtype", "phase", "name"), [
    ("phase", "fp32", "1a", "phase1a.json"), ("phase", "bf16", "1a", "phase1a_bf16.json"),
    ("training", "fp32", "1b", "training_1b.json"), ("sequence", "fp32", "1a", "sequence.json")])
def test_write_goes_to_the_kinds_committed_artifact(rig, monkeypatch, tmp_path, kind, dtype,
                                                     phase, name):
    seen = []
    target = tmp_path / "committed.json"

    def path(phase, *, kind, dtype):
        seen.append((phase, kind, dtype))
        return target
    monkeypatch.setattr(M, "artifact_path", path)
    M.measure_kind(parse(kind, "--write", "--dtype", dtype, "--phase", phase,
                         "--kernel-sets", "current"), Line())
    assert seen == [(phase, kind, dtype)] and target.is_file()
    from weight_sync_bench.tolerance.artifacts import artifact_path
    assert artifact_path(phase, kind=kind, dtype=dtype).name == name
from tests.cli.floor_cli import Line, parse


def test_a_larger_measurement_is_replaced_only_with_force(rig, tmp_path, capsys):
    out = tmp_path / "f.json"
    out.write_text(json.dumps({**committed("training"), "repetitions": 9}))
    with pytest.raises(ArtifactProtected, match=f"{out} holds 9 repetitions; this measurement "
                       "would have 2: pass --force"):
        M.measure_kind(parse("training", "--out", str(out), "--kernel-sets", "current"), Line())
    assert "training" not in rig.calls
    M.measure_kind(parse("training", "--out", str(out), "--kernel-sets", "current",
                         "--repetitions", "9"), Line())  # as many: no force needed
    M.measure_kind(parse("training", "--out", str(out), "--kernel-sets", "current",
                         "--force"), Line())
    assert [c[0][0] for c in rig.calls["training"]] == [9, 2]


def test_an_old_artifact_without_an_integer_count_is_replaced(rig, tmp_path):
    out = tmp_path / "f.json"
    out.write_text(json.dumps({**committed("training"), "repetitions": "9"}))
    assert M.measure_kind(parse("training", "--out", str(out), "--kernel-sets", "current"),
                          Line()) == EXIT_OK


# -- measure_kind: the artifact replaced


def test_the_vendors_kept_are_asked_before_measuring_with_what_is_measured(rig, tmp_path):
    out = tmp_path / "f.json"
    old = {**committed("phase1a"), "repetitions": 1}
    out.write_text(json.dumps(old))
    M.measure_kind(parse("phase", "--out", str(out), "--kernel-sets", "current"), Line())
    ((args, kwargs),) = rig.calls["kept_vendors"]
    assert args == (old, "GenuineIntel")
    assert kwargs == {"force": False, "where": str(out), "measuring": ["GenuineIntel/AVX512"]}
    assert rig.calls["over"][0][0][0] == old
    M.measure_kind(parse("phase", "--out", str(out), "--force"), Line())
    assert rig.calls["kept_vendors"][1][1]["measuring"] == [
        "GenuineIntel/DEFAULT", "GenuineIntel/AVX2"]
    assert rig.calls["kept_vendors"][1][1]["force"] is True


def test_a_replaced_phase_floor_is_compared_by_the_phase_figures(rig, tmp_path, capsys):
    out = tmp_path / "f.json"
    out.write_text(json.dumps({**committed("phase1a"), "repetitions": 1}))
    M.measure_kind(parse("phase", "--out", str(out), "--kernel-sets", "current"), Line())
    rows = {line.split("  ")[0] for line in capsys.readouterr().out.splitlines()}
    assert {"repetitions", "cells", "worst |error|", "threshold"} <= rows
    assert "unreadable" not in rows


def test_a_replaced_artifact_is_compared_side_by_side(rig, tmp_path, capsys):
    out = tmp_path / "f.json"
    out.write_text(json.dumps({**committed("training"), "repetitions": 1}))
    M.measure_kind(parse("training", "--out", str(out), "--kernel-sets", "current"), Line())
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    header = lines.index(next(line for line in lines if "replaced (" in line))
    assert lines[header - 1] == "" and lines[header].split() == ["replaced", "(f.json)", "new"]
    assert any(line.split()[:3] == ["repetitions", "1", "2"] for line in lines)
    M.measure_kind(parse("training", "--out", str(tmp_path / "g.json"), "--kernel-sets",
                         "current"), Line())
    assert "replaced (" not in capsys.readouterr().out


# -- measure_kind: every kernel set, a process each


def test_all_kernel_sets_measure_each_in_a_process_and_merge(rig, tmp_path, capsys):
    out = tmp_path / "f.json"
    rig.merged = {**committed("training"), "merged": True}
    M.measure_kind(parse("training", "--out", str(out), "--steps", "3", "--phase", "1b"), Line())
    runs = rig.calls["measure_under"]
    assert [r[0][0] for r in runs] == ["default", "avx2"]
    argv = ["training", "--phase", "1b", "--steps", "3", "--repetitions",
            str(training_floor.REPETITIONS), "--dtype", "fp32"]
    assert all(r[0][1] == argv for r in runs)
    scratch = runs[0][0][2].parent
    assert [r[0][2].name for r in runs] == ["default.json", "avx2.json"]
    assert runs[1][0][2].parent == scratch and scratch.name.startswith("wsb-kernels-")
    assert not scratch.exists()  # the scratch directory is gone
    ((arts,), _), = rig.calls["merge"]
    assert arts == [{"measured under": "default"}, {"measured under": "avx2"}]
    assert len(rig.calls["available"]) == 1  # asked once, the sets handed on
    assert "training" not in rig.calls
    assert written(out) == {**rig.merged, "over": True}
    assert capsys.readouterr().out.rstrip().endswith(
        f"kernel sets {', '.join(rig.merged['kernel_sets'])}; wrote {out}")


def test_each_kernel_set_relays_its_progress_behind_its_name(rig, monkeypatch, tmp_path):
    # each set's start and end on the monotonic clock: they took 30 s, then 70 s, then 10 s
    clock = iter([1000.0, 1030.0, 1030.0, 1100.0, 1100.0, 1110.0, 1110.0, 1120.0])
    monkeypatch.setattr(M.time, "monotonic", lambda: next(clock))
    line = Line()
    rig.sets = ["default", "avx2", "avx512", "amx"]
    got = M.each_kernel_set(["phase"], tmp_path, line, rig.sets)
    assert got == [{"measured under": k} for k in rig.sets]
    assert line.shown == [
        "kernel set 1/4 default: starting", "kernel set 1/4 default: default half way",
        "kernel set 2/4 avx2: starting (then 2 more at ~30s each)",
        "kernel set 2/4 avx2: avx2 half way (then 2 more at ~30s each)",
        "kernel set 3/4 avx512: starting (then 1 more at ~50s each)",
        "kernel set 3/4 avx512: avx512 half way (then 1 more at ~50s each)",
        "kernel set 4/4 amx: starting", "kernel set 4/4 amx: amx half way"]
    assert [r[0][2] for r in rig.calls["measure_under"]] == [
        tmp_path / f"{k}.json" for k in rig.sets]


def test_each_kernel_set_asks_which_sets_there_are_only_where_not_told(rig, tmp_path):
    M.each_kernel_set(["phase"], tmp_path, Line())
    assert len(rig.calls["available"]) == 1
    assert [r[0][0] for r in rig.calls["measure_under"]] == rig.sets
    M.each_kernel_set(["phase"], tmp_path, Line(), [])
    assert len(rig.calls["available"]) == 1


def test_measuring_names_the_sets_with_this_cpus_vendor(rig):
    assert M.measuring(None) == ["GenuineIntel/AVX512"]
    assert M.measuring(["default", "avx512"]) == ["GenuineIntel/DEFAULT", "GenuineIntel/AVX512"]


def test_what_the_last_line_says_it_wrote(tmp_path):
    path = tmp_path / "x.json"
    assert M._wrote({"kernel_sets": ["A", "B"], "cells": [1]}, path) == (
        f"kernel sets A, B; wrote {path}")
    assert M._wrote({"kernel_sets": [], "regimes": [], "cells": [1, 2]}, path) == (
        f"2 cells; wrote {path}")
    assert M._wrote({"cells": [1, 2, 3]}, path) == f"wrote {path}"


# -- geometry: which geometry


def hf_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "vocab_size": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False}))
    return path


def test_geometry_config_reads_a_name_or_a_config_file_and_applies_the_shape(tmp_path):
    assert M.geometry_config(parse("geometry", "--config", "toy")) == config_by_name("toy")
    shaped = M.geometry_config(parse("geometry", "--config", "toy", "--batch", "3",
                                     "--seq-len", "7"))
    assert shaped == config_by_name("toy").replace(batch=3, seq_len=7)
    assert M.geometry_config(parse("geometry", "--config", "toy", "--batch", "3")) == (
        config_by_name("toy").replace(batch=3))
    path = hf_file(tmp_path)
    config = M.geometry_config(parse("geometry", "--hf-config", str(path)))
    assert (config.d_model, config.n_layers, config.vocab) == (64, 3, 128)
    config = M.geometry_config(parse("geometry", "--hf-config", str(path), "--layers", "2",
                                     "--vocab", "96"))
    assert (config.d_model, config.n_layers, config.vocab) == (64, 2, 96)


@pytest.mark.parametrize(("argv", "message"), [
    ([], "geometry: pass exactly one of --hf-config PATH and --config NAME"),
    (["--config", "toy", "--hf-config", "x.json"],
     "geometry: pass exactly one of --hf-config PATH and --config NAME"),
    (["--config", "toy", "--layers", "2"], "geometry: --layers and --vocab apply to "
                                           "--hf-config only"),
    (["--config", "toy", "--vocab", "64"], "geometry: --layers and --vocab apply to "
                                           "--hf-config only")])
def test_geometry_config_refuses_what_names_no_one_geometry(argv, message):
    with pytest.raises(InvalidConfig) as caught:
        M.geometry_config(parse("geometry", *argv))
    assert str(caught.value) == message


# -- geometry: measured, found, or measured again


def geometry(tmp_path: Path, *argv: str) -> argparse.Namespace:
    return parse("geometry", "--config", "toy", "--out", str(tmp_path / "g.json"),
                 "--kernel-sets", "current", *argv)


def test_an_unmeasured_geometry_is_measured_here_and_written(rig, tmp_path, capsys):
    line = Line()
    args = geometry(tmp_path, "--phase", "1a")
    assert M.measure_geometry(args, line) == EXIT_OK
    out = tmp_path / "g.json"
    assert rig.calls["guard"] == [((TOY, "layer"), {"args": args})]
    assert rig.calls["floor_for"] == [((TOY, "1a", "fp32"), {})]
    ((config,), kwargs), = rig.calls["geometry"]
    assert config == TOY and kwargs["out"] == out
    assert (kwargs["phase"], kwargs["dtype"], kwargs["repetitions"], kwargs["forward"]) == (
        "1a", "fp32", phase_floor.GEOMETRY_REPETITIONS, None)
    assert isinstance(kwargs["progress"], Ticker)
    assert written(out)["over"] is True
    assert rig.calls["over"][0][1] == {"force": False, "where": str(out)}
    assert line.closed == 1
    printed = capsys.readouterr().out
    assert printed.startswith(
        f"measuring toy (d_model {TOY.d_model}, {TOY.n_layers} layers, {TOY.n_params:,} "
        f"parameters, fp32) over {phase_floor.GEOMETRY_REPETITIONS} seeds ...\n")
    assert "max ULP" in printed and printed.rstrip().endswith(f"wrote {out}")


def test_phase_1b_guards_the_whole_model_and_measures_over_gloo(rig, tmp_path):
    M.measure_geometry(geometry(tmp_path, "--phase", "1b", "--repetitions", "2",
                                "--dtype", "bf16"), Line(enabled=False))
    assert [c[0] for c in rig.calls["guard"]] == [(TOY, "model")]
    kwargs = rig.calls["geometry"][0][1]
    assert (kwargs["phase"], kwargs["dtype"], kwargs["repetitions"], kwargs["forward"],
            kwargs["progress"]) == ("1b", "bf16", 2, "GLOO FORWARD", None)


def test_an_fp8_geometry_is_refused_before_anything(rig, tmp_path):
    with pytest.raises(InvalidConfig) as caught:
        M.measure_geometry(geometry(tmp_path, "--dtype", "fp8_block128"), Line())
    assert str(caught.value) == (
        "--dtype fp8_block128: an FP8 destination's floor is measured for the committed "
        "configs (wsb floor phase --dtype ...); another geometry's is measured by each check "
        "on its dequantized weights")
    assert not rig.calls


def floor(source: str, path: Path, threshold: float = 0.25):
    return SimpleNamespace(source=source, path=path, threshold=threshold,
                           artifact={"environment": {}})


@pytest.mark.parametrize("source", ["geometry", "committed"])
def test_a_geometry_measured_here_already_is_not_measured_again(rig, tmp_path, capsys, source):
    rig.floor = floor(source, tmp_path / "there.json")
    assert M.measure_geometry(geometry(tmp_path), Line()) == EXIT_OK
    assert capsys.readouterr().out == (
        f"toy: already measured ({tmp_path / 'there.json'}), threshold 0.25; --force measures "
        "it again\n")
    assert "geometry" not in rig.calls and not (tmp_path / "g.json").exists()
    assert rig.calls["drift"] == [((rig.floor.artifact,), {})]


def test_force_measures_a_measured_geometry_again_without_asking(rig, tmp_path):
    rig.floor = floor("geometry", tmp_path / "there.json")
    M.measure_geometry(geometry(tmp_path, "--force"), Line())
    assert "floor_for" not in rig.calls and len(rig.calls["geometry"]) == 1
    assert rig.calls["over"][0][1]["force"] is True


def test_a_committed_floor_measured_elsewhere_still_covers_the_geometry(rig, tmp_path, capsys):
    rig.floor, rig.drift = floor("committed", tmp_path / "there.json"), ["machine: other"]
    M.measure_geometry(geometry(tmp_path), Line())
    assert "already measured" in capsys.readouterr().out and "geometry" not in rig.calls


def test_a_geometry_floor_measured_elsewhere_is_measured_here(rig, tmp_path, capsys):
    rig.floor = floor("geometry", tmp_path / "g.json")
    rig.drift = ["machine class x86 (recorded arm)", "torch 2.12"]
    M.measure_geometry(geometry(tmp_path), Line())
    printed = capsys.readouterr().out
    assert printed.startswith(
        f"toy: measured elsewhere ({tmp_path / 'g.json'}: machine class x86 (recorded arm); "
        "torch 2.12); measuring it here\nmeasuring toy ")
    assert len(rig.calls["geometry"]) == 1


def test_write_measures_again_a_floor_only_in_the_users_cache(rig, monkeypatch, tmp_path):
    paths = []

    def cached(config, phase, dtype, *, committed):
        paths.append((config, phase, dtype, committed))
        return tmp_path / ("checkout.json" if committed else "cache.json")
    monkeypatch.setattr(M, "cached_floor_path", cached)
    rig.floor = floor("geometry", tmp_path / "cache.json")
    args = parse("geometry", "--config", "toy_kv4", "--write", "--kernel-sets", "current")
    M.measure_geometry(args, Line())
    assert paths == [(TOY_KV4, "1a", "fp32", True)]
    assert (tmp_path / "checkout.json").is_file() and len(rig.calls["geometry"]) == 1
    # the same floor already in the checkout: found
    rig.floor = floor("geometry", tmp_path / "checkout.json")
    M.measure_geometry(args, Line())
    assert len(rig.calls["geometry"]) == 1
    # a committed phase floor recording it: found, --write or not
    rig.floor = floor("committed", tmp_path / "phase1a.json")
    M.measure_geometry(args, Line())
    assert len(rig.calls["geometry"]) == 1
    M.measure_geometry(parse("geometry", "--config", "toy_kv4", "--kernel-sets", "current"),
                       Line())
    assert paths[-1] == (TOY_KV4, "1a", "fp32", False)


def test_a_floor_merged_over_another_machine_keeps_its_sample_size(rig, tmp_path):
    out = tmp_path / "g.json"
    old = {**committed("phase1a"), "repetitions": 7}
    out.write_text(json.dumps(old))
    rig.kept = ["AuthenticAMD"]
    M.measure_geometry(geometry(tmp_path), Line())
    assert rig.calls["geometry"][0][1]["repetitions"] == 7
    ((args, kwargs),) = rig.calls["kept_vendors"]
    assert args == (old, "GenuineIntel")
    assert kwargs == {"force": False, "where": str(out), "measuring": ["GenuineIntel/AVX512"]}
    assert rig.calls["over"][0][0][0] == old
    M.measure_geometry(geometry(tmp_path, "--repetitions", "3"), Line())  # the flag wins
    assert rig.calls["geometry"][1][1]["repetitions"] == 3
    rig.kept = []  # nothing kept: the default sample
    M.measure_geometry(geometry(tmp_path), Line())
    assert rig.calls["geometry"][2][1]["repetitions"] == phase_floor.GEOMETRY_REPETITIONS


def test_a_geometry_under_every_kernel_set_passes_its_flags_on(rig, tmp_path, capsys):
    path = hf_file(tmp_path)
    args = parse("geometry", "--hf-config", str(path), "--layers", "2", "--vocab", "96",
                 "--batch", "3", "--seq-len", "5", "--max-gib", "1.5", "--max-gflop", "7",
                 "--phase", "1b", "--dtype", "bf16", "--out", str(tmp_path / "g.json"))
    M.measure_geometry(args, Line())
    runs = rig.calls["measure_under"]
    assert [r[0][0] for r in runs] == rig.sets
    assert runs[0][0][1] == [
        "geometry", "--phase", "1b", "--dtype", "bf16", "--repetitions",
        str(phase_floor.GEOMETRY_REPETITIONS), "--force", "--hf-config", str(path),
        "--layers", "2", "--vocab", "96", "--batch", "3", "--seq-len", "5",
        "--max-gib", "1.5", "--max-gflop", "7.0"]
    assert "geometry" not in rig.calls and len(rig.calls["available"]) == 1
    scratch = runs[0][0][2].parent
    assert scratch.name.startswith("wsb-kernels-") and not scratch.exists()
    assert written(tmp_path / "g.json") == {**rig.merged, "over": True}
    assert rig.calls["kept_vendors"][0][1]["measuring"] == [
        "GenuineIntel/DEFAULT", "GenuineIntel/AVX2"]
    runs.clear()
    M.measure_geometry(parse("geometry", "--config", "toy", "--out", str(tmp_path / "h.json")),
                       Line())
    assert runs[0][0][1] == ["geometry", "--phase", "1a", "--dtype", "fp32", "--repetitions",
                             str(phase_floor.GEOMETRY_REPETITIONS), "--force", "--config",
                             "toy", "--max-gflop", str(parse("geometry").max_gflop)]  # default



def test_what_comes_before_a_long_measurement_is_flushed(rig, monkeypatch, tmp_path):
    """Printed to a pipe (a CI log), the line saying what is measured must show before the
    minutes the measurement takes, not after."""
    printed = []
    monkeypatch.setattr(M, "print", lambda *a, **k: printed.append((a, k)), raising=False)
    rig.floor = floor("geometry", tmp_path / "g.json")
    rig.drift = ["torch 2.12"]
    M.measure_geometry(geometry(tmp_path), Line())
    flushed = [a[0].split(" (")[0] for a, k in printed if k.get("flush") is True]
    assert flushed == ["toy: measured elsewhere", "measuring toy"]

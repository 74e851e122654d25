"""A per-geometry floor measured under every kernel set (``python -m weight_sync_bench.tolerance
geometry ... --kernel-sets all``, the default): one process per ``ATEN_CPU_CAPABILITY``, each
cell the worst of them, cached where ``floor_for`` reads it, so a check under any of those
kernel sets reads a floor that covers it."""

import json
import os

import pytest

from weight_sync_bench.cli.floor import as_floor_argv
from weight_sync_bench.cli.main import main as wsb_main
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance.artifacts import cpu_vendor, kernel_set_label, runtime
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


# The long run's: a fresh floor measured under every kernel set (a torch process each, 2.4 s).
# The default run's equivalent is
# test_a_geometry_floor_of_another_cpu_vendor_is_measured_here_and_keeps_it: the same command
# (--kernel-sets all, one kernel set, the running one, in a process of its own whose progress
# is relayed) on a floor another vendor measured, each cell the worst of its kernel sets, read
# back by floor_for, with no drift note under the kernel set it was measured under.
@pytest.mark.slow
def test_a_geometry_floor_is_measured_under_every_kernel_set_and_covers_each(tiny, capsys,
                                                                          monkeypatch):
    # one kernel set, the running one (a floor under which a check here reads no drift
    # note), without probing the others (a process each, 2.4 s): the merge itself is tested
    # on any number (test_kernels_mutants.py), and this command merging a kernel set into a
    # floor that holds others by _on_two_vendors' tests below
    chosen = [runtime()["cpu_capability"].lower()]
    asked = []  # each ask is a fresh torch process per kernel set: asked once a measurement
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.available",
                        lambda: asked.append(1) or chosen)
    path, config = tiny
    assert wsb_main(as_floor_argv(["geometry", "--hf-config", str(path),
                                   "--repetitions", "1"])) == 0
    assert len(asked) == 1
    printed, progress = capsys.readouterr()
    artifact = json.loads(cached_floor_path(config).read_text())
    # each kernel set's process shows its progress line (an ETA), relayed behind the set
    assert f"kernel set {len(chosen)}/{len(chosen)} {chosen[-1]}: " in progress
    assert "elapsed, ETA" in progress
    sets = artifact["kernel_sets"]
    assert sets == [kernel_set_label(cpu_vendor(), k.upper()) for k in chosen]
    assert f"kernel sets {', '.join(sets)}; wrote" in printed
    for cell in artifact["cells"]:
        assert set(cell["by_kernel_set"]) == set(sets)
        assert cell["worst_abs"] == max(cell["by_kernel_set"].values())
    assert artifact["worst_abs"] == max(c["worst_abs"] for c in artifact["cells"])
    floor = floor_for(config)
    assert floor.source == "geometry" and floor.threshold == artifact["threshold"]
    # no drift note under any of the kernel sets it was measured under
    for kernel_set in sets:
        recorded = {**artifact["environment"], "kernel_sets": sets}
        capability = kernel_set.split("/")[-1]
        assert environment_drift(recorded, {**runtime(), "cpu_capability": capability}) == []
    assert check_environment(artifact, "the floor") == ()


def test_the_twin_measured_under_the_running_kernel_set_only_is_noted_under_another(tiny):
    path, config = tiny
    assert wsb_main(as_floor_argv(["geometry", "--hf-config", str(path), "--repetitions", "1",
                         "--kernel-sets", "current"])) == 0
    artifact = json.loads(cached_floor_path(config).read_text())
    assert "kernel_sets" not in artifact
    other = "DEFAULT" if runtime()["cpu_capability"] != "DEFAULT" else "AVX2"
    (note,) = environment_drift(artifact["environment"], {**runtime(), "cpu_capability": other})
    assert note == f"cpu_capability recorded {artifact['environment']['cpu_capability']} running {other}"


def _as_if_measured_on(path, vendor):
    """The floor at ``path`` rewritten as if its measurement ran on ``vendor``'s CPU."""
    artifact = json.loads(path.read_text())
    artifact["environment"].update(cpu_vendor=vendor, cpu_model=f"{vendor} CPU")
    path.write_text(json.dumps(artifact))
    return artifact


def test_a_geometry_floor_of_another_cpu_vendor_is_measured_here_and_keeps_it(tiny, capsys,
                                                                             monkeypatch):
    """MKL and oneDNN dispatch by vendor, so another vendor's floor does not cover this CPU;
    measured here, the floor covers both (worst over all), and the other vendor's figures
    stay as they were measured."""
    monkeypatch.delenv("WSB_STRICT_ENV", raising=False)
    running = runtime()["cpu_capability"]  # one kernel set, the running one (a process each)
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.available",
                        lambda: [running.lower()])
    path, config = tiny
    argv = ["geometry", "--hf-config", str(path), "--repetitions", "1"]
    assert wsb_main(as_floor_argv([*argv, "--kernel-sets", "current"])) == 0
    cached = cached_floor_path(config)
    other = _as_if_measured_on(cached, "OtherVendor")
    here = cpu_vendor()
    (note,) = check_environment(other, "the floor")
    assert note == f"the floor measured elsewhere: cpu_vendor recorded OtherVendor running {here}"
    capsys.readouterr()
    assert wsb_main(as_floor_argv(argv)) == 0  # no --force: not measured on this vendor yet
    printed, progress = capsys.readouterr()
    assert "measured elsewhere" in printed
    # the kernel set's process shows its progress line (an ETA), relayed behind the set
    assert f"kernel set 1/1 {running.lower()}: " in progress and "elapsed, ETA" in progress
    merged = json.loads(cached.read_text())
    capability = other["environment"]["cpu_capability"]
    assert merged["kernel_sets"] == [f"OtherVendor/{capability}", f"{here}/{running}"]
    assert set(merged["machines"]) == {"OtherVendor", here}
    for old, cell in zip(other["cells"], merged["cells"], strict=True):
        assert cell["by_kernel_set"][f"OtherVendor/{capability}"] == old["worst_abs"]
        assert cell["worst_abs"] == max(cell["by_kernel_set"].values())
    assert check_environment(merged, "the floor") == ()
    floor = floor_for(config)
    assert floor.source == "geometry" and floor.threshold == merged["threshold"]
    assert wsb_main(as_floor_argv(argv)) == 0  # now it is: not measured again
    assert "already measured" in capsys.readouterr().out
    assert json.loads(cached.read_text()) == merged


_TWO_VENDORS: dict[str, str] = {}  # the floor _on_two_vendors measured, kept per process


def _on_two_vendors(tiny, monkeypatch):
    """The tiny geometry's cached floor measured under the running kernel set as if on
    another vendor's CPU, then under DEFAULT on this one (merged): ``(argv, path)``. Measured
    once per process (the DEFAULT measurement is a torch process, 2.4 s), the floor written
    again for each test that asks; never under mutmut (``MUTANT_UNDER_TEST``), whose mutants'
    runs fork from a process that ran the tests unmutated: a mutant of the merge measures
    its own."""
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.available", lambda: ["default"])
    path, config = tiny
    argv = ["geometry", "--hf-config", str(path), "--repetitions", "1"]
    cached = cached_floor_path(config)
    if "floor" not in _TWO_VENDORS or "MUTANT_UNDER_TEST" in os.environ:
        assert wsb_main(as_floor_argv([*argv, "--kernel-sets", "current"])) == 0
        _as_if_measured_on(cached, "OtherVendor")
        assert wsb_main(as_floor_argv(argv)) == 0
        if "MUTANT_UNDER_TEST" not in os.environ:
            _TWO_VENDORS["floor"] = cached.read_text()
    else:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(_TWO_VENDORS["floor"])
    return argv, cached


def test_the_twin_a_floor_holding_this_vendor_beside_another_is_not_re_measured_silently(
        tiny, capsys, monkeypatch):
    """Measured again on a vendor it holds beside another, the other vendor's figures could
    not be told apart from the ones replaced: refused before anything is measured, unless
    --force (which replaces them all)."""
    argv, cached = _on_two_vendors(tiny, monkeypatch)
    both = cached.read_text()

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before the refusal")
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.measure_under", no_measuring)
    capsys.readouterr()
    assert wsb_main(as_floor_argv([*argv, "--kernel-sets", "all", "--out", str(cached)])) == 2
    err = capsys.readouterr().err
    assert (f"{cached} holds measurements on OtherVendor, {cpu_vendor()}: measured again on "
            f"{cpu_vendor()}, its OtherVendor figures cannot be told apart") in err
    assert "Pass --force to replace them" in err
    assert cached.read_text() == both


def test_a_kernel_set_the_floor_lacks_is_measured_alone_and_merged_beside_both_vendors(
        tiny, capsys, monkeypatch):
    """A floor holding this vendor beside another, but not the kernel set this CPU runs (a
    machine with AVX-512 where it was measured without): ``--kernel-sets current`` replaces
    nothing, so it merges in, every figure before kept; the refusal names that remedy."""
    running = runtime()["cpu_capability"]
    if running == "DEFAULT":
        pytest.skip("this CPU runs DEFAULT only: it has no kernel set beyond the one measured")
    argv, cached = _on_two_vendors(tiny, monkeypatch)
    both = json.loads(cached.read_text())
    here = cpu_vendor()
    assert both["kernel_sets"] == [f"OtherVendor/{running}", f"{here}/DEFAULT"]
    capsys.readouterr()
    # the twin: what re-measures DEFAULT is refused, naming the kernel set it could add
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.available",
                        lambda: ["default", running.lower()])
    assert wsb_main(as_floor_argv([*argv, "--out", str(cached)])) == 2
    err = capsys.readouterr().err
    assert "cannot be told apart" in err
    assert (f"it lacks {here}/{running}: --kernel-sets current measures only the kernel "
            "set this CPU runs and merges it in") in err
    assert json.loads(cached.read_text()) == both
    assert wsb_main(as_floor_argv([*argv, "--kernel-sets", "current", "--out",
                                   str(cached)])) == 0
    merged = json.loads(cached.read_text())
    assert merged["kernel_sets"] == [*both["kernel_sets"], f"{here}/{running}"]
    assert set(merged["machines"]) == {"OtherVendor", here}
    for old, cell in zip(both["cells"], merged["cells"], strict=True):
        for kernel_set, worst in old["by_kernel_set"].items():
            assert cell["by_kernel_set"][kernel_set] == worst  # kept as measured
        assert cell["worst_abs"] == max(cell["by_kernel_set"].values())
    assert merged["repetitions"] == both["repetitions"]

"""Merging floors measured under several CPU kernel sets (``tolerance.kernels``), pinned
directly (mutation/report.md): before this file no test of the mutation selection called it.
``merge`` is pure; the three functions that start a process are checked with the process
replaced by a recorder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from weight_sync_bench import ToleranceMismatch
from weight_sync_bench.errors import ArtifactProtected
from weight_sync_bench.tolerance import kernels
from weight_sync_bench.tolerance.kernels import merge


def _phase(kernel_set, worsts, **extra):
    cells = [{"config": "toy", "degree": d, "worst_abs": w, "max_ulp": w * 8e6}
             for d, w in zip((1, 2), worsts, strict=True)]
    return {"schema": 1, "phase": "1a", "configs": {"toy": {}}, "cells": cells,
            "worst_abs": max(worsts), "threshold": 1.0,
            "environment": {"cpu_capability": kernel_set}, **extra}


def test_merged_phase_cells_keep_the_worst_kernel_set_and_every_figure():
    a, b = _phase("AVX2", [0.0, 2e-6]), _phase("AVX512", [0.0, 9e-7])
    b["cells"][0]["worst_abs"] = 1e-9  # AVX512 worse at t=1, AVX2 at t=2
    b["threshold"] = 1e-4  # each run's own threshold differs: it is derived again, not compared
    out = merge([a, b])
    assert out["kernel_sets"] == ["AVX2", "AVX512"]
    assert out["cells"][0] == {**b["cells"][0], "kernel_set": "AVX512",
                               "by_kernel_set": {"AVX2": 0.0, "AVX512": 1e-9}}
    assert out["cells"][1] == {**a["cells"][1], "kernel_set": "AVX2",
                               "by_kernel_set": {"AVX2": 2e-6, "AVX512": 9e-7}}
    assert out["worst_abs"] == 2e-6 and out["threshold"] == 1e-3
    assert out["environment"] == a["environment"] and "kernel_sets" not in a  # inputs kept
    assert merge([b, a])["worst_abs"] == 2e-6  # order of the inputs does not matter


def test_a_single_measurement_merges_to_itself_with_its_kernel_set_named():
    a = _phase("DEFAULT", [0.0, 3e-7])
    out = merge([a])
    assert out["kernel_sets"] == ["DEFAULT"] and out["threshold"] == 1e-4
    assert [c["kernel_set"] for c in out["cells"]] == ["DEFAULT", "DEFAULT"]


def _training(kernel_set, loss, grad):
    return {"schema": 1, "kind": "training", "phase": "1a", "cells": [{"case": kernel_set}],
            "environment": {"cpu_capability": kernel_set},
            "regimes": {"plain": {"loss": {"worst": loss, "case": f"{kernel_set} loss",
                                           "threshold": 1.0},
                                  "param_grad": {"worst": grad, "case": f"{kernel_set} grad",
                                                 "threshold": 1.0}}}}


def test_merged_training_quantities_keep_the_worst_kernel_set_and_re_derive_the_threshold():
    inputs = [_training("AVX2", 2e-7, 2e-6), _training("AVX512", 5e-7, 1e-8)]
    out = merge(inputs)
    assert inputs == [_training("AVX2", 2e-7, 2e-6), _training("AVX512", 5e-7, 1e-8)]  # untouched
    assert out["regimes"]["plain"] == {
        "loss": {"worst": 5e-7, "case": "AVX512 loss", "kernel_set": "AVX512",
                 "threshold": 1e-4},
        "param_grad": {"worst": 2e-6, "case": "AVX2 grad", "kernel_set": "AVX2",
                       "threshold": 1e-3}}
    assert out["cells"] == [{"case": "AVX2", "kernel_set": "AVX2"},
                            {"case": "AVX512", "kernel_set": "AVX512"}]
    assert out["kernel_sets"] == ["AVX2", "AVX512"]


@pytest.mark.parametrize("artifacts, message", [
    ([], "no artifact to merge"),
    ([_phase("AVX2", [0.0, 1e-6]), _phase("AVX2", [0.0, 2e-6])],
     "two measurements under one kernel set: ['AVX2', 'AVX2']"),
    ([_phase("AVX2", [0.0, 1e-6], repetitions=2), _phase("AVX512", [0.0, 1e-6], repetitions=3)],
     "measurements of different things cannot merge: ['repetitions']"),
])
def test_measurements_that_cannot_merge_are_refused_with_the_reason(artifacts, message):
    with pytest.raises(ToleranceMismatch) as raised:
        merge(artifacts)
    assert str(raised.value) == message


def test_cells_listed_in_different_orders_are_refused():
    a, b = _phase("AVX2", [0.0, 1e-6]), _phase("AVX512", [0.0, 1e-6])
    b["cells"].reverse()
    with pytest.raises(ToleranceMismatch) as raised:
        merge([a, b])
    assert str(raised.value) == "measurements list their cells in different orders"


# -- the process-starting half, with subprocess.run recorded

class _Run:
    def __init__(self, monkeypatch, stdout="", returncode=0, stderr=""):
        self.calls = []
        self.result = subprocess.CompletedProcess([], returncode, stdout, stderr)
        monkeypatch.setattr(kernels.subprocess, "run", self)

    def __call__(self, argv, **kwargs):
        self.calls.append((argv, kwargs))
        return self.result


def test_capability_under_asks_a_fresh_interpreter_with_the_kernel_set_in_its_environment(
        monkeypatch):
    run = _Run(monkeypatch, stdout="AVX2\n")
    assert kernels.capability_under("avx2") == "AVX2"
    ((argv, kwargs),) = run.calls
    assert argv == [sys.executable, "-c",
                    "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    assert kwargs["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and "PATH" in kwargs["env"]
    assert kwargs["capture_output"] is True and kwargs["text"] is True
    assert kwargs["timeout"] == 120  # a probe that hangs is stopped, not waited on for ever


def test_capability_under_nothing_asks_with_the_variable_unset(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # this process's own, not passed on
    run = _Run(monkeypatch, stdout="AVX2\n")
    assert kernels.capability_under(None) == "AVX2"
    ((_, kwargs),) = run.calls
    assert "ATEN_CPU_CAPABILITY" not in kwargs["env"] and "PATH" in kwargs["env"]


def test_available_keeps_the_kernel_sets_a_fresh_process_reports(monkeypatch):
    reported = {None: "AVX512", "default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX2",
                "sve256": "DEFAULT"}
    monkeypatch.setattr(kernels, "capability_under", lambda k: reported[k])
    assert kernels.available() == ["default", "avx2"]  # avx512 fell back: not available


def test_available_stops_at_the_capability_torch_detects_unasked(monkeypatch):
    """A Zen 3 EPYC: torch detects AVX2, yet reports AVX512 when asked for it (and dies of
    SIGILL in its first AVX-512 kernel); the twin, a CPU that detects AVX512, keeps it."""
    reported = {None: "AVX2", "default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512",
                "sve256": "DEFAULT"}
    monkeypatch.setattr(kernels, "capability_under", lambda k: reported[k])
    assert kernels.available() == ["default", "avx2"]
    reported[None] = "AVX512"
    assert kernels.available() == ["default", "avx2", "avx512"]
    reported.update({None: "SVE256", "sve256": "SVE256"})  # aarch64: its own ladder
    assert kernels.available() == ["default", "sve256"]


class _Popen:
    """``subprocess.Popen`` recorded: a process that writes ``stderr`` and exits ``returncode``."""

    def __init__(self, monkeypatch, returncode=0, stderr=""):
        self.calls, self.returncode, self.lines = [], returncode, stderr.splitlines(keepends=True)
        monkeypatch.setattr(kernels.subprocess, "Popen", self)

    def __call__(self, argv, **kwargs):
        self.calls.append((argv, kwargs))
        self.stderr = iter(self.lines)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self):
        return self.returncode


def test_measure_under_runs_the_measurement_with_the_kernel_set_and_reads_its_output(
        monkeypatch, tmp_path):
    out = tmp_path / "m.json"
    out.write_text('{"phase": "1a"}')
    run = _Popen(monkeypatch, stderr="phase 1a: 1/2\n\nphase 1a: 2/2\n")
    shown = []
    assert kernels.measure_under("avx512", ["--phase", "1a"], out,
                                 progress=shown.append) == {"phase": "1a"}
    ((argv, kwargs),) = run.calls
    assert argv == [sys.executable, "-m", "weight_sync_bench.tolerance", "--phase", "1a",
                    "--kernel-sets", "current", "--out", str(out)]
    assert kwargs["env"]["ATEN_CPU_CAPABILITY"] == "avx512" and "PATH" in kwargs["env"]
    assert kwargs["stderr"] is subprocess.PIPE and kwargs["text"] is True  # stderr as text
    assert kwargs["stdout"] is subprocess.DEVNULL  # its tables: the parent prints the merge
    assert shown == ["phase 1a: 1/2", "phase 1a: 2/2"]  # its progress line, as it came


def test_a_failed_measurement_names_the_kernel_set_exit_code_and_stderr_tail(monkeypatch,
                                                                            tmp_path):
    _Popen(monkeypatch, returncode=3, stderr="x" * 2500 + "\nboom")
    with pytest.raises(ToleranceMismatch) as raised:
        kernels.measure_under("avx2", [], tmp_path / "m.json")
    assert str(raised.value) == ("measuring under ATEN_CPU_CAPABILITY=avx2 failed (exit 3):\n"
                                 + ("x" * 2500 + "\nboom")[-2000:])


@pytest.mark.parametrize("name", ["training.json", "training_1b.json"])
def test_a_merged_training_quantity_lists_its_fields_as_the_committed_floor_does(name):
    """The kernel set, then the re-derived threshold, last: re-merging a training floor
    changes only its figures in the committed JSON, never the order of its fields."""
    committed = json.loads((Path(__file__).resolve().parents[2] / "tolerance" / name).read_text())
    assert committed["kernel_sets"]  # a merged floor
    for quantities in committed["regimes"].values():
        for fields in quantities.values():
            assert list(fields)[-2:] == ["kernel_set", "threshold"]
    out = merge([_training("AVX2", 2e-7, 2e-6), _training("AVX512", 5e-7, 1e-8)])
    for fields in out["regimes"]["plain"].values():
        assert list(fields) == ["worst", "case", "kernel_set", "threshold"]


# -- machine classes: the same kernel set sums in another order on another vendor's CPU

def _on(vendor, artifact):
    return {**artifact, "environment": {**artifact["environment"], "cpu_vendor": vendor,
                                        "cpu_model": f"{vendor} model"}}


def test_floors_measured_on_two_cpu_vendors_merge_into_one_that_covers_both():
    amd = merge([_on("AuthenticAMD", _phase("AVX2", [0.0, 1e-6])),
                 _on("AuthenticAMD", _phase("AVX512", [0.0, 9e-7]))])
    intel = merge([_on("GenuineIntel", _phase("AVX2", [0.0, 1.6e-6])),
                   _on("GenuineIntel", _phase("AVX512", [0.0, 1.4e-6]))])
    out = merge([amd, intel])
    assert out["kernel_sets"] == ["AuthenticAMD/AVX2", "AuthenticAMD/AVX512",
                                  "GenuineIntel/AVX2", "GenuineIntel/AVX512"]
    assert out["cells"][1]["by_kernel_set"] == {
        "AuthenticAMD/AVX2": 1e-6, "AuthenticAMD/AVX512": 9e-7,
        "GenuineIntel/AVX2": 1.6e-6, "GenuineIntel/AVX512": 1.4e-6}
    assert out["cells"][1]["kernel_set"] == "GenuineIntel/AVX2"
    assert out["worst_abs"] == 1.6e-6 and out["threshold"] == 1e-3
    assert {v: e["cpu_model"] for v, e in out["machines"].items()} == {
        "AuthenticAMD": "AuthenticAMD model", "GenuineIntel": "GenuineIntel model"}
    swapped = merge([intel, amd])  # the order of the inputs orders the list, nothing else
    assert swapped["worst_abs"] == out["worst_abs"] and [c["by_kernel_set"] for c in
                                                         swapped["cells"]] == [
        c["by_kernel_set"] for c in out["cells"]]
    # an artifact written before the vendor was recorded: unqualified kernel sets, on the
    # vendor its cpu_model names
    older = merge([_phase("AVX2", [0.0, 1e-6])])
    older["environment"]["cpu_model"] = "AMD EPYC"
    assert merge([older, intel])["kernel_sets"] == ["AuthenticAMD/AVX2", "GenuineIntel/AVX2",
                                                    "GenuineIntel/AVX512"]


def test_merged_training_floors_name_each_quantity_and_cell_by_vendor_and_kernel_set():
    amd = merge([_on("AuthenticAMD", _training("AVX2", 2e-7, 2e-6))])
    intel = merge([_on("GenuineIntel", _training("AVX2", 5e-7, 1e-8))])
    out = merge([amd, intel])
    assert out["regimes"]["plain"]["loss"]["kernel_set"] == "GenuineIntel/AVX2"
    assert out["regimes"]["plain"]["param_grad"]["kernel_set"] == "AuthenticAMD/AVX2"
    assert [c["kernel_set"] for c in out["cells"]] == ["AuthenticAMD/AVX2", "GenuineIntel/AVX2"]


def test_one_kernel_set_measured_twice_on_one_vendor_is_refused_on_two_it_is_not():
    a, b = _on("GenuineIntel", _phase("AVX2", [0.0, 1e-6])), _phase("AVX2", [0.0, 2e-6])
    with pytest.raises(ToleranceMismatch, match=r"two measurements under one kernel set: "
                                                r"\['GenuineIntel/AVX2', 'GenuineIntel/AVX2'\]"):
        merge([a, _on("GenuineIntel", b)])
    assert merge([a, _on("AuthenticAMD", b)])["worst_abs"] == 2e-6  # the twin


def test_measurements_under_another_torch_do_not_merge():
    a = _on("AuthenticAMD", _phase("AVX2", [0.0, 1e-6]))
    b = _on("GenuineIntel", _phase("AVX2", [0.0, 1e-6]))
    a["environment"]["torch"], b["environment"]["torch"] = "2.13.0", "2.4.0"
    with pytest.raises(ToleranceMismatch) as raised:
        merge([a, b])
    assert str(raised.value) == ("measurements in different environments cannot merge: torch "
                                 "2.13.0, 2.4.0")


def test_a_measurement_written_over_another_vendors_keeps_it_and_over_its_own_replaces_it():
    amd = merge([_on("AuthenticAMD", _phase("AVX2", [0.0, 2e-6]))])
    intel = merge([_on("GenuineIntel", _phase("AVX2", [0.0, 1e-6]))])
    assert kernels.over(None, intel) is intel
    both = kernels.over(amd, intel)
    assert both["kernel_sets"] == ["AuthenticAMD/AVX2", "GenuineIntel/AVX2"]
    assert both["worst_abs"] == 2e-6  # the other vendor's worst is kept, never lowered
    again = merge([_on("GenuineIntel", _phase("AVX2", [0.0, 3e-7]))])
    assert kernels.over(intel, again) is again  # its own vendor only: replaced
    assert kernels.over(amd, intel, force=True) is intel
    with pytest.raises(ArtifactProtected) as raised:  # both vendors, re-measured on one
        kernels.over(both, again, where="phase1a.json")
    assert str(raised.value).startswith(
        "phase1a.json holds measurements on AuthenticAMD, GenuineIntel: measured again on "
        "GenuineIntel, its AuthenticAMD figures cannot be told apart from the ones this "
        "measurement replaces. Pass --force")
    assert kernels.over(both, again, force=True) is again
    other = merge([_on("GenuineIntel", _phase("AVX2", [0.0, 1e-6], repetitions=3))])
    with pytest.raises(ArtifactProtected, match=r"holds measurements on AuthenticAMD that "
                                                r"cannot merge with this one \(measurements "
                                                r"of different things"):
        kernels.over(amd, other)


def test_a_kernel_set_the_floor_lacks_merges_in_beside_every_vendor_and_one_it_holds_does_not():
    amd = merge([_on("AuthenticAMD", _phase("AVX2", [0.0, 2e-6]))])
    intel = merge([_on("GenuineIntel", _phase("AVX2", [0.0, 1e-6]))])
    both = kernels.over(amd, intel)
    added = merge([_on("GenuineIntel", _phase("AVX512", [3e-6, 1e-7]))])
    assert kernels.kept_vendors(both, "GenuineIntel", measuring=["GenuineIntel/AVX512"]) \
        == ["AuthenticAMD", "GenuineIntel"]
    out = kernels.over(both, added)
    assert out["kernel_sets"] == ["AuthenticAMD/AVX2", "GenuineIntel/AVX2", "GenuineIntel/AVX512"]
    assert [c["worst_abs"] for c in out["cells"]] == [3e-6, 2e-6]  # worst over all, kept
    assert out["cells"][1]["by_kernel_set"] == {"AuthenticAMD/AVX2": 2e-6,
                                                "GenuineIntel/AVX2": 1e-6,
                                                "GenuineIntel/AVX512": 1e-7}
    # the twin: a measurement holding a kernel set ``both`` has is refused, naming the rest
    with pytest.raises(ArtifactProtected) as raised:
        kernels.kept_vendors(both, "GenuineIntel", where="p.json",
                             measuring=["GenuineIntel/AVX2", "GenuineIntel/AVX512"])
    assert str(raised.value).endswith(
        "--out PATH to write it elsewhere; it lacks GenuineIntel/AVX512: --kernel-sets "
        "current measures only the kernel set this CPU runs and merges it in")
    with pytest.raises(ArtifactProtected) as raised:
        kernels.kept_vendors(both, "GenuineIntel", measuring=["GenuineIntel/AVX2"])
    assert str(raised.value).endswith("--out PATH to write it elsewhere")
    assert kernels.kept_vendors(amd, "AuthenticAMD", measuring=["AuthenticAMD/AVX512"]) \
        == ["AuthenticAMD"]  # one vendor, a set it lacks: merged, not replaced
    assert kernels.kept_vendors(both, "GenuineIntel", force=True,
                                measuring=["GenuineIntel/AVX512"]) == []

"""``tolerance.artifacts`` (issue 30, the mutation pass over ``tolerance/artifacts.py``): where
each committed measurement lives, what a measurement records of the machine it ran on, which
kernel sets an artifact names, and reading and writing them with every refusal named.

Every floor the harness derives a threshold from is found, read and labelled here, so a name
one character off, a refusal that lets a wrong schema through, or a kernel set read on the
wrong vendor makes every verdict after it wrong. These tests pin each name, message and label
exactly, in process, with the machine's own facts stood in for."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.tolerance import artifacts as A


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("WSB_TOLERANCE_DIR", str(tmp_path / "tol"))
    monkeypatch.setenv("WSB_FLOOR_CACHE", str(tmp_path / "cache"))
    return tmp_path


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(ToleranceMismatch) as exc:
        call(*args, **kwargs)
    return str(exc.value)


# ---- where each kind lives ------------------------------------------------------------------

def test_every_artifact_has_the_name_it_was_committed_under(dirs):
    tol = dirs / "tol"
    assert A.artifact_path() == tol / "phase1a.json"
    assert A.artifact_path("1b") == tol / "phase1b.json"
    assert A.artifact_path("1a", dtype="bf16") == tol / "phase1a_bf16.json"
    assert A.artifact_path("1b", dtype="fp16") == tol / "phase1b_fp16.json"
    assert A.artifact_path("1a", dtype="fp8_block128") == tol / "phase1a_fp8_block128.json"
    assert A.artifact_path("1a", dtype="fp8_tensor") == tol / "phase1a_fp8_tensor.json"
    assert A.artifact_path("1a", kind="training") == tol / "training.json"
    assert A.artifact_path("1b", kind="training") == tol / "training_1b.json"
    assert A.artifact_path("1a", kind="sequence") == tol / "sequence.json"
    assert A.artifact_path("1b", kind="sequence") == tol / "sequence_1b.json"
    assert A.artifact_path("1a", kind="random_floor") == tol / "random_floor_1a.json"
    assert A.artifact_path("1b", kind="random_floor") == tol / "random_floor_1b.json"
    assert A.artifact_path(kind="training", dtype="fp32") == tol / "training.json"


def test_the_committed_names_are_files_of_this_checkout():
    """The stand-in directory above is not where the floors are: the real names resolve."""
    for kind in ("phase", "training", "sequence", "random_floor"):
        assert A.artifact_path("1a", kind=kind).is_file(), kind
    assert A.artifact_path("1a", dtype="fp8_block128").is_file()


def test_an_unknown_phase_dtype_or_kind_is_refused_by_name(dirs):
    assert refusal(A.artifact_path, "2") == "unknown phase '2'; known: 1a, 1b"
    assert refusal(A.artifact_path, "1a", dtype="fp64") == (
        "unknown weight dtype 'fp64'; known: fp32, bf16, fp16, fp8_block128, fp8_tensor")
    assert refusal(A.artifact_path, "1a", kind="training", dtype="bf16") == (
        "the training floor is measured on fp32 weights only, asked for bf16")
    assert refusal(A.artifact_path, "1b", kind="sequence", dtype="fp8_tensor") == (
        "the sequence floor is measured on fp32 weights only, asked for fp8_tensor")
    assert refusal(A.artifact_path, "1a", kind="plot") == (
        "unknown artifact kind 'plot'; known: phase, training, sequence, random_floor")
    # the phase is checked before the dtype, the dtype before the kind
    assert refusal(A.artifact_path, "2", kind="plot", dtype="fp64").startswith("unknown phase")
    assert refusal(A.artifact_path, "1a", kind="plot", dtype="fp64").startswith(
        "unknown weight dtype")


def test_the_plot_lies_beside_the_random_geometry_floor(dirs):
    assert A.plot_path() == dirs / "tol" / "random_floor_1a.png"
    assert A.plot_path("1b") == dirs / "tol" / "random_floor_1b.png"


def test_a_geometry_floor_is_kept_under_a_safe_name_committed_or_cached(dirs):
    got = A.geometry_path("Qwen/Qwen3 30B:a3b", "k0", "1b", "bf16")
    assert got == dirs / "tol" / "geometry" / "Qwen_Qwen3_30B_a3b-1b-bf16-k0.json"
    kept = A.geometry_path("toy-1.x_y", "abc", "1a", "fp32", committed=False)
    assert kept == dirs / "cache" / "geometry" / "toy-1.x_y-1a-fp32-abc.json"
    assert A.geometry_path("", "k", "1a", "fp32").name == "config-1a-fp32-k.json"
    assert A.geometry_path("../..", "k", "1a", "fp32").parent == dirs / "tol" / "geometry"


# ---- what a measurement records of its machine ----------------------------------------------

@pytest.fixture
def cpuinfo(monkeypatch):
    """Stand in /proc/cpuinfo's text (None: the file cannot be opened)."""
    def use(text):
        def fake_open(path, *args, **kwargs):
            assert path == "/proc/cpuinfo"
            if text is None:
                raise PermissionError(path)
            import io
            return io.StringIO(text)
        monkeypatch.setattr(A, "open", fake_open, raising=False)
    return use


def test_cpuinfo_reads_the_first_line_naming_a_key_up_to_its_first_colon(cpuinfo):
    cpuinfo("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon: v2  \n"
            "vendor_id\t: AuthenticAMD\n")
    assert A._cpuinfo("vendor_id") == "GenuineIntel"
    assert A._cpuinfo("model name") == "Intel(R) Xeon: v2"
    assert A._cpuinfo("nothing", "model name") == "Intel(R) Xeon: v2"
    assert A._cpuinfo("nothing") is None
    assert A.cpu_vendor() == "GenuineIntel"
    assert A.cpu_model() == "Intel(R) Xeon: v2"


def test_cpuinfo_that_cannot_be_read_names_nothing(cpuinfo, monkeypatch):
    cpuinfo(None)
    assert A._cpuinfo("vendor_id") is None
    assert A.cpu_vendor() is None
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert A.cpu_model() == "x86_64"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert A.cpu_model() is None


def test_the_cpu_model_is_read_under_each_architectures_key(cpuinfo, monkeypatch):
    monkeypatch.setattr(platform, "processor", lambda: "fallback")
    cpuinfo("Model\t: Raspberry Pi 4\n")
    assert A.cpu_model() == "Raspberry Pi 4"
    cpuinfo("cpu model\t: R4000\n")
    assert A.cpu_model() == "R4000"
    cpuinfo("model name\t: \n")  # present but empty: the platform's name
    assert A.cpu_model() == "fallback"


def test_runtime_is_the_running_process(monkeypatch):
    monkeypatch.setattr(A, "cpu_vendor", lambda: "GenuineIntel")
    assert A.runtime() == {
        "torch": torch.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpu_vendor": "GenuineIntel", "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    assert tuple(A.runtime()) == A.RUNTIME_FIELDS
    assert A.COMPARED_ALIKE == ("torch", "numpy", "python", "machine")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_environment_records_the_commit_and_whether_src_was_edited(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("x = 1\n")
    git(root, "init", "-q")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(A, "checkout", lambda: root)
    monkeypatch.setattr(A, "cpu_model", lambda: "Some CPU")
    env = A.environment()
    assert env == {**A.runtime(), "platform": platform.platform(), "cpu_model": "Some CPU",
                   "dtype": str(torch.get_default_dtype()),
                   "torch_threads": torch.get_num_threads(),
                   "commit": git(root, "rev-parse", "HEAD"), "src_dirty": False}
    (root / "notes.txt").write_text("outside src\n")
    assert A.environment()["src_dirty"] is False
    (root / "src" / "a.py").write_text("x = 2\n")
    assert A.environment()["src_dirty"] is True


def test_environment_outside_a_repository_records_no_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(A, "checkout", lambda: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    env = A.environment()
    assert env["commit"] is None and env["src_dirty"] is False


def test_environment_asks_git_in_the_checkout_with_a_bound(tmp_path, monkeypatch):
    calls = []
    real = subprocess.run

    def spy(args, **kwargs):
        calls.append((args, kwargs))
        return real(args, **kwargs)

    monkeypatch.setattr(A, "checkout", lambda: tmp_path)
    monkeypatch.setattr(subprocess, "run", spy)
    A.environment()
    assert [a for a, _ in calls] == [["git", "rev-parse", "--verify", "--quiet", "HEAD"],
                                     ["git", "status", "--porcelain", "--", "src"]]
    assert all(k == {"cwd": tmp_path, "capture_output": True, "text": True, "timeout": 10}
               for _, k in calls)


@pytest.mark.parametrize("fault", [OSError("no git"), subprocess.TimeoutExpired("git", 10)])
def test_environment_without_git_records_neither(tmp_path, monkeypatch, fault):
    def broken(*args, **kwargs):
        raise fault
    monkeypatch.setattr(A, "checkout", lambda: tmp_path)
    monkeypatch.setattr(subprocess, "run", broken)
    env = A.environment()
    assert env["commit"] is None and env["src_dirty"] is None


def test_a_failed_rev_parse_is_no_commit(tmp_path, monkeypatch):
    """git answering with output but a failure code, or success with nothing: no commit."""
    answers = iter([subprocess.CompletedProcess([], 1, "deadbeef\n", ""),
                    subprocess.CompletedProcess([], 0, "", ""),
                    subprocess.CompletedProcess([], 0, "  \n", ""),
                    subprocess.CompletedProcess([], 0, "", "")])
    monkeypatch.setattr(A, "checkout", lambda: tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: next(answers))
    env = A.environment()
    assert env["commit"] is None and env["src_dirty"] is False
    env = A.environment()
    assert env["commit"] is None and env["src_dirty"] is False


# ---- which kernel sets an artifact names ----------------------------------------------------

def test_the_vendor_is_recorded_or_read_from_the_model_name():
    recorded = {"cpu_vendor": "GenuineIntel", "cpu_model": "AMD EPYC"}
    assert A.vendor_of(recorded) == "GenuineIntel"
    assert A.vendor_of({"cpu_vendor": "", "cpu_model": "AMD EPYC 7B13"}) == "AuthenticAMD"
    assert A.vendor_of({"cpu_vendor": None, "cpu_model": "Intel(R) Xeon(R)"}) == "GenuineIntel"
    assert A.vendor_of({"cpu_model": "AMD and Intel"}) == "AuthenticAMD"  # AMD read first
    assert A.vendor_of({"cpu_model": "AMDX IntelY"}) is None  # whole words only
    assert A.vendor_of({"cpu_model": None}) is None
    assert A.vendor_of({}) is None


def test_a_kernel_set_is_named_with_its_vendor():
    assert A.kernel_set_label("GenuineIntel", "AVX512") == "GenuineIntel/AVX512"
    assert A.kernel_set_label(None, "AVX2") == "AVX2"
    assert A.kernel_set_label("AuthenticAMD", "GenuineIntel/AVX2") == "GenuineIntel/AVX2"
    assert A.running_kernel_set({"cpu_vendor": "AuthenticAMD", "cpu_capability": "DEFAULT"}) \
        == "AuthenticAMD/DEFAULT"
    assert A.running_kernel_set({"cpu_capability": "AVX2"}) == "AVX2"
    here = A.runtime()
    assert A.running_kernel_set() == A.kernel_set_label(here["cpu_vendor"],
                                                        here["cpu_capability"])
    with pytest.raises(KeyError):
        A.running_kernel_set({})  # a runtime given is read, never replaced by this process's


def test_an_artifacts_kernel_sets_are_read_on_the_vendor_that_measured_them():
    intel = {"cpu_vendor": "GenuineIntel"}
    amd = {"cpu_model": "AMD EPYC 7B13"}
    merged = {"kernel_sets": ["AVX2", "AuthenticAMD/DEFAULT"], "environment": intel}
    assert A.kernel_sets_of(merged) == ["GenuineIntel/AVX2", "AuthenticAMD/DEFAULT"]
    remeasured = {**merged, "kernel_sets_measured": {"environment": amd}}
    assert A.measured_vendor(remeasured) == "AuthenticAMD"
    assert A.kernel_sets_of(remeasured) == ["AuthenticAMD/AVX2", "AuthenticAMD/DEFAULT"]
    empty_remeasure = {**merged, "kernel_sets_measured": {"environment": {}}}
    assert A.measured_vendor(empty_remeasure) == "GenuineIntel"
    assert A.measured_vendor({"kernel_sets_measured": {}, "environment": amd}) == "AuthenticAMD"
    assert A.measured_vendor({}) is None
    single = {"environment": {**intel, "cpu_capability": "AVX512"}}
    assert A.kernel_sets_of(single) == ["GenuineIntel/AVX512"]
    assert A.kernel_sets_of({"environment": {"cpu_capability": "AVX2"}}) == ["AVX2"]
    assert A.kernel_sets_of({"environment": intel}) == []
    assert A.kernel_sets_of({}) == []
    assert A.kernel_sets_of({"kernel_sets": [], "environment": single["environment"]}) == []


# ---- writing and reading ---------------------------------------------------------------------

def test_an_artifact_is_written_whole_through_a_temporary_beside_it(tmp_path, monkeypatch):
    path = tmp_path / "deep" / "er" / "phase1a.json"
    replaced = []
    real = os.replace

    def spy(src, dst):
        replaced.append((Path(src), Path(dst), Path(src).read_text()))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    A.write_artifact({"a": [1, 2]}, path)
    tmp = path.with_name(f".phase1a.json.{os.getpid()}.tmp")
    assert replaced == [(tmp, path, json.dumps({"a": [1, 2]}, indent=2) + "\n")]
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ]\n}\n'
    A.write_artifact({"b": 1}, path)  # over an existing one, its directory already there
    assert json.loads(path.read_text()) == {"b": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["phase1a.json"]


def test_read_json_names_the_file_and_what_is_wrong(tmp_path):
    path = tmp_path / "a.json"
    assert refusal(A.read_json, path) == f"{path}: no such artifact"
    assert refusal(A.read_json, path, "wsb floor phase") == (
        f"{path}: no such artifact; measure it with `wsb floor phase`")
    path.write_text("{nope")
    message = refusal(A.read_json, path)
    assert message.startswith(f"{path}: not valid JSON (Expecting")
    assert message.endswith(")")
    path.write_text("[1]")
    assert refusal(A.read_json, path) == f"{path}: expected a JSON object, got list"
    path.write_text('{"k": 1}')
    assert A.read_json(path) == {"k": 1}


def read(path, **kw):
    return A.read_artifact(path, **{"phase": "1a", "fields": ("floor",),
                                    "remedy": "wsb floor phase --write", **kw})


def test_read_artifact_names_every_refusal(tmp_path):
    path = tmp_path / "phase1a.json"
    assert refusal(read, path) == (
        f"{path}: no such artifact; measure it with `wsb floor phase --write`")
    path.write_text("{")
    assert refusal(read, path).startswith(f"{path}: not valid JSON (Expecting")
    path.write_text('"text"')
    assert refusal(read, path) == f"{path}: expected a JSON object, got str"
    good = {"schema": 1, "phase": "1a", "floor": 2.0}
    for missing in ("schema", "phase", "floor"):
        path.write_text(json.dumps({k: v for k, v in good.items() if k != missing}))
        assert refusal(read, path) == f"{path}: missing field {missing!r}"
    path.write_text(json.dumps({"floor": 1}))
    assert refusal(read, path) == f"{path}: missing field 'schema'"  # the first one missing
    path.write_text(json.dumps({**good, "schema": 2}))
    assert refusal(read, path) == f"{path}: field 'schema' is 2, this code reads 1"
    path.write_text(json.dumps({**good, "schema": "1"}))
    assert refusal(read, path) == f"{path}: field 'schema' is '1', this code reads 1"
    path.write_text(json.dumps({**good, "phase": "1b"}))
    assert refusal(read, path) == f"{path}: field 'phase' records '1b', asked for '1a'"
    path.write_text(json.dumps(good))
    assert read(path) == good
    assert refusal(read, path, phase="1b") == (
        f"{path}: field 'phase' records '1a', asked for '1b'")
    assert refusal(read, path, schema=3) == f"{path}: field 'schema' is 1, this code reads 3"
    path.write_text(json.dumps({**good, "schema": 3}))
    assert read(path, schema=3)["schema"] == 3
    assert read(path, schema=3, fields=()) == {**good, "schema": 3}


def test_an_unreadable_artifact_is_refused_by_name(tmp_path):
    path = tmp_path / "dir.json"
    path.mkdir()  # not a missing artifact: no remedy offered, the reason given
    assert refusal(read, path).startswith(f"{path}: cannot read the artifact ([Errno 21]")

"""The README's pytest quickstart, as written, in a fresh project outside the checkout:
nothing of the harness's own ``tests/conftest.py`` applies there (no profile loaded, no
corpus copy), only what installing the package gives (the ``pytest11`` plugin). The fuzzing
guide's buggy resharder fails with its counterexample (not ``DeadlineExceeded``: one example
checks a whole model), the converter guide's converter and a correct resharder pass, and the
counterexample is written in the project, not the harness."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.documentation import blocks, converter_module

README = Path(__file__).resolve().parents[1] / "README.md"

# The README's quickstart block, run as written, beside the functions it names (the fuzzing
# guide's buggy resharder, the converter guide's converter) and a correct resharder.
IMPORTS = """from weight_sync_bench import layout_for, reshard

from my_converters import megatron_to_vllm
from my_resharders import my_reshard

"""
GOOD = """

def good(shards, dst, *, config):
    return reshard(shards, layout_for(config), dst)


test_good = reshard_property(good)
"""


def fresh_project(root: Path) -> Path:
    """A project with the README's quickstart block as its test module, and the guides'
    functions it names (their code blocks, as written)."""
    python = [b.body for b in blocks() if b.lang == "python"]
    (root / "my_resharders.py").write_text(
        next(b for b in python if "def my_reshard(shards, dst, *, config)" in b))
    (root / "my_converters.py").write_text(converter_module())
    quickstart = next(b for b in python if "test_my_converter = convert_property(" in b)
    (root / "test_mine.py").write_text(IMPORTS + quickstart + GOOD)
    return root


def pytest_in(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest run in ``project`` as its owner would: none of this suite's environment (its
    corpus copy, fuzz directory, profile) and no path into the checkout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WSB_", "PYTEST_", "HYPOTHESIS")) and k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *args], cwd=project, env={**env,
                           "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600, check=False)


def test_the_readme_pytest_example_runs_as_documented_in_a_fresh_project(tmp_path):
    project = fresh_project(tmp_path)
    done = pytest_in(project)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out  # one test failed: the README's buggy resharder
    # ... and two passed: the README's converter property and the correct resharder's
    assert "FAILED test_mine.py::test_my_reshard" in out and "2 passed" in out, out
    assert "DeadlineExceeded" not in out
    assert "geometry: vocab=" in out and "degrees: t=" in out  # the counterexample's report
    entries = list((project / "wsb-corpus").glob("*.json"))
    assert len(entries) == 1  # written in the user's project


def test_the_plugin_loads_a_harness_profile_and_refuses_an_unknown_one(tmp_path):
    (tmp_path / "test_profile.py").write_text(
        "from hypothesis import settings\n\n\n"
        "def test_profile():\n    assert settings.default.max_examples == 1\n")
    assert pytest_in(tmp_path, "--wsb-profile", "wsb-replay").returncode == 0
    done = pytest_in(tmp_path, "--wsb-profile", "nope")
    assert done.returncode == 4  # pytest's usage error
    assert "--wsb-profile nope: not a profile of the harness (wsb-test, " in done.stderr
    assert pytest_in(tmp_path).returncode == 1  # the twin: Hypothesis's default profile


def test_loading_a_profile_imports_no_torch():
    """The plugin loads in every pytest run of an environment holding the package, the user's
    own suites included: ``--wsb-profile`` registers the profiles without torch (seconds a
    run otherwise)."""
    code = ("import sys\nfrom weight_sync_bench.fuzz.profiles import PROFILES, profile_name\n"
            "assert profile_name() == 'wsb-test' and 'wsb-nightly' in PROFILES\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True,
                          env={k: v for k, v in os.environ.items() if k != "WSB_PROFILE"})
    assert done.stdout.strip() == "[]", done.stdout

"""``paths`` and ``fuzz.profiles``: where every file the harness reads or writes lives, each
variable against its default, and the Hypothesis profiles by name. A wrong default here is a
test run or a user's run writing into the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase

from weight_sync_bench import paths
from weight_sync_bench.errors import MissingArtifacts, WsbError
from weight_sync_bench.fuzz import profiles

VARIABLES = ("WSB_TOLERANCE_DIR", "WSB_CORPUS_DIR", "WSB_FUZZ_DIR", "WSB_FLOOR_CACHE",
             "XDG_CACHE_HOME")
# the package's grandparent (the ``src/`` layout): this checkout, or a copy it runs from
ROOT = Path(paths.__file__).resolve().parents[2]


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """No location variable set, the current directory and home a temporary one."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_the_checkout_is_the_repository_this_package_runs_from():
    assert paths.checkout() == ROOT
    assert (ROOT / "pyproject.toml").is_file() and paths._PACKAGE == ROOT / "src" / (
        "weight_sync_bench")


def test_without_a_variable_each_location_is_its_default(bare):
    assert paths.tolerance_dir() == ROOT / "tolerance"
    assert paths.corpus_dir() == ROOT / "corpus"
    assert paths.fuzz_dir() == bare / ".hypothesis"
    assert paths.user_corpus_dir() == bare / "wsb-corpus"
    assert paths.floor_cache_dir() == bare / "home" / ".cache" / "weight-sync-bench"


def test_each_variable_moves_its_location(bare, monkeypatch):
    for name, value in zip(VARIABLES, ("t", "c", "f", "fc", "x")):
        monkeypatch.setenv(name, str(bare / value))
    assert paths.tolerance_dir() == bare / "t"
    assert paths.corpus_dir() == paths.user_corpus_dir() == bare / "c"
    assert paths.fuzz_dir() == bare / "f"
    assert paths.floor_cache_dir() == bare / "fc"
    monkeypatch.delenv("WSB_FLOOR_CACHE")  # then XDG's cache home
    assert paths.floor_cache_dir() == bare / "x" / "weight-sync-bench"


def test_an_empty_variable_is_no_variable(bare, monkeypatch):
    for name in VARIABLES:
        monkeypatch.setenv(name, "")
    assert paths.tolerance_dir() == ROOT / "tolerance"
    assert paths.fuzz_dir() == bare / ".hypothesis"
    assert paths.user_corpus_dir() == bare / "wsb-corpus"
    assert paths.floor_cache_dir() == bare / "home" / ".cache" / "weight-sync-bench"


def test_outside_a_checkout_the_committed_artifacts_name_the_variable_to_set(bare, monkeypatch):
    monkeypatch.setattr(paths, "checkout", lambda: None)
    for fn, variable, folder in ((paths.tolerance_dir, "WSB_TOLERANCE_DIR", "tolerance"),
                                 (paths.corpus_dir, "WSB_CORPUS_DIR", "corpus")):
        with pytest.raises(MissingArtifacts) as err:
            fn()
        assert str(err.value) == (f"no checkout of weight-sync-bench around {paths._PACKAGE} "
                                  f"to find {folder}/ in: set {variable} to the directory that "
                                  "holds it")
        monkeypatch.setenv(variable, str(bare / folder))  # the twin: the variable is enough
        assert fn() == bare / folder


def test_a_checkout_needs_both_pyproject_and_src(tmp_path, monkeypatch):
    package = tmp_path / "src" / "weight_sync_bench"
    package.mkdir(parents=True)
    monkeypatch.setattr(paths, "_PACKAGE", package)
    assert paths.checkout() is None
    (tmp_path / "pyproject.toml").mkdir()  # a directory is not the file
    assert paths.checkout() is None
    (tmp_path / "pyproject.toml").rmdir()
    (tmp_path / "pyproject.toml").write_text("")
    assert paths.checkout() == tmp_path
    other = tmp_path / "other"
    (other / "lib" / "weight_sync_bench").mkdir(parents=True)
    (other / "pyproject.toml").write_text("")
    monkeypatch.setattr(paths, "_PACKAGE", other / "lib" / "weight_sync_bench")
    assert paths.checkout() is None  # no src/ beside pyproject.toml


def test_each_profile_is_as_documented():
    p = profiles.PROFILES
    assert list(p) == ["wsb-test", "wsb-nightly", "wsb-replay", "wsb-generate"]
    every = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
    test, nightly, replay, generate = (p[n] for n in p)
    assert (test.max_examples, test.derandomize, test.database, test.deadline) == (
        100, True, None, None)
    assert (tuple(test.phases), test.report_multiple_bugs, test.print_blob) == (every, False,
                                                                                 False)
    assert (nightly.max_examples, nightly.derandomize, nightly.deadline) == (2000, False, None)
    assert tuple(nightly.phases) == every and nightly.report_multiple_bugs is False
    assert list(nightly.suppress_health_check) == [HealthCheck.too_slow]
    assert (replay.max_examples, replay.derandomize, replay.database, replay.deadline) == (
        1, True, None, None)
    assert tuple(replay.phases) == (Phase.explicit,) and replay.report_multiple_bugs is False
    assert (generate.max_examples, generate.derandomize, generate.database,
            generate.deadline) == (100, False, None, None)
    assert tuple(generate.phases) == (Phase.generate,)
    assert list(generate.suppress_health_check) == [HealthCheck.too_slow]


def test_the_nightly_database_is_under_the_fuzz_directory(bare, monkeypatch):
    monkeypatch.setenv("WSB_FUZZ_DIR", str(bare / "f"))
    assert profiles._nightly_database().path == bare / "f" / "wsb-nightly"
    monkeypatch.setattr(profiles, "fuzz_dir", lambda: paths.tolerance_dir())
    monkeypatch.setattr(paths, "checkout", lambda: None)
    monkeypatch.delenv("WSB_TOLERANCE_DIR", raising=False)
    assert profiles._nightly_database() is None  # nowhere to keep it


def test_a_profile_is_chosen_by_name_else_the_variable_else_the_default(monkeypatch):
    monkeypatch.delenv("WSB_PROFILE", raising=False)
    assert profiles.profile_name() == "wsb-test" == profiles.DEFAULT_PROFILE
    monkeypatch.setenv("WSB_PROFILE", "wsb-nightly")
    assert profiles.profile_name() == "wsb-nightly"
    assert profiles.profile_name("wsb-replay") == "wsb-replay"
    with pytest.raises(WsbError) as err:
        profiles.profile_name("ci")
    assert str(err.value) == ("unknown profile 'ci' (from --profile); known: wsb-test, "
                              "wsb-nightly, wsb-replay, wsb-generate")
    monkeypatch.setenv("WSB_PROFILE", "fast")
    with pytest.raises(WsbError) as err:
        profiles.profile_name()
    assert str(err.value) == ("unknown profile 'fast' (from $WSB_PROFILE); known: wsb-test, "
                              "wsb-nightly, wsb-replay, wsb-generate")

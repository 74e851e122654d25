"""The pytest plugin (entry point ``pytest11``: ``weight_sync_bench``), loaded by pytest in
any environment where the harness is installed, so that ``weight_sync_bench.testing``'s
properties run in a user's own project as the README shows them:

- the harness's Hypothesis profiles are registered (``wsb-test``, ``wsb-nightly``,
  ``wsb-replay``, ``wsb-generate``: ``fuzz.profiles.PROFILES``), and ``--wsb-profile NAME``
  loads one; without it the user's own profile applies (``testing``'s properties lift only
  its deadline, which one example of a whole model would exceed);
- fixtures: ``wsb_corpus_dir``, where a failing property writes its counterexample (the
  user's project: ``WSB_CORPUS_DIR``, else ``wsb-corpus/`` in the current directory), and
  ``wsb_configs``, the built-in geometries by name (dense and MoE).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from weight_sync_bench.model.config import ModelConfig

PROFILE_OPTION = "--wsb-profile"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("weight-sync-bench")
    group.addoption(PROFILE_OPTION, default=None, metavar="NAME",
                    help="load a Hypothesis profile of the harness (wsb-test: 100 derandomized "
                         "examples; wsb-nightly: 2000 with a database; wsb-replay; "
                         "wsb-generate) for weight_sync_bench.testing's properties")


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption(PROFILE_OPTION)
    if name is None:
        return  # nothing imported: the harness (and torch) load when a test uses them
    from hypothesis import settings

    from weight_sync_bench.fuzz.profiles import PROFILES  # registers them (no torch)

    if name not in PROFILES:
        raise pytest.UsageError(f"{PROFILE_OPTION} {name}: not a profile of the harness "
                                f"({', '.join(PROFILES)})")
    settings.load_profile(name)


@pytest.fixture
def wsb_corpus_dir() -> Path:
    """Where ``weight_sync_bench.testing``'s properties write a counterexample of your
    function: ``$WSB_CORPUS_DIR``, else ``wsb-corpus/`` in the current directory."""
    from weight_sync_bench.paths import user_corpus_dir

    return user_corpus_dir()


@pytest.fixture
def wsb_configs() -> dict[str, ModelConfig]:
    """The built-in geometries by name: ``toy``, ``toy_kv4`` and the MoE ones."""
    from weight_sync_bench.model.config import CONFIGS, MOE_CONFIGS

    return {**CONFIGS, **MOE_CONFIGS}

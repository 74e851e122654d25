"""``pytest_plugin``'s hooks called directly and its fixtures used as a user's suite uses
them. ``test_plugin.py`` runs the plugin in a fresh project through a subprocess, where a
change to this process's copy of it cannot show."""

from __future__ import annotations

import pytest
from hypothesis import settings

from weight_sync_bench import pytest_plugin
from weight_sync_bench.model.config import CONFIGS, MOE_CONFIGS
from weight_sync_bench.paths import user_corpus_dir


class Group:
    def __init__(self):
        self.options = []

    def addoption(self, *names, **kwargs):
        self.options.append((names, kwargs))


def test_the_option_is_added_to_the_harness_group_with_its_help():
    group, asked = Group(), []
    parser = type("Parser", (), {"getgroup": lambda self, name: asked.append(name) or group})()
    pytest_plugin.pytest_addoption(parser)
    assert asked == ["weight-sync-bench"]
    assert group.options == [(("--wsb-profile",), {
        "default": None, "metavar": "NAME",
        "help": "load a Hypothesis profile of the harness (wsb-test: 100 derandomized "
                "examples; wsb-nightly: 2000 with a database; wsb-replay; wsb-generate) for "
                "weight_sync_bench.testing's properties"})]


def configured(name):
    config = type("Config", (), {"getoption": lambda self, option: {
        "--wsb-profile": name}[option]})()
    return pytest_plugin.pytest_configure(config)


@pytest.fixture
def profile():
    """The suite's profile, loaded again after the test loads another."""
    before = settings.get_current_profile_name()
    yield before
    settings.load_profile(before)


def test_a_named_profile_is_loaded_and_none_leaves_the_users_own(profile):
    assert configured(None) is None
    assert settings.get_current_profile_name() == profile
    configured("wsb-replay")
    assert settings.get_current_profile_name() == "wsb-replay"
    assert settings.default.max_examples == 1


def test_an_unknown_profile_is_a_usage_error_naming_the_known_ones(profile):
    with pytest.raises(pytest.UsageError) as err:
        configured("ci")
    assert str(err.value) == ("--wsb-profile ci: not a profile of the harness (wsb-test, "
                              "wsb-nightly, wsb-replay, wsb-generate)")
    assert settings.get_current_profile_name() == profile


def test_the_fixtures_give_the_users_corpus_and_the_built_in_geometries(wsb_corpus_dir,
                                                                        wsb_configs):
    assert wsb_corpus_dir == user_corpus_dir()
    assert wsb_configs == {**CONFIGS, **MOE_CONFIGS}
    assert {"toy", "toy_kv4", "toy_moe"} <= set(wsb_configs)

"""``weight_sync_bench.testing``: what each public property hands the one runner of user
properties (``fuzz.user.user_property``), recorded instead of run: the role, the conventions
and degrees as ``wsb fuzz --from`` / ``--to`` read them, the narrowed domain, the settings,
the shipped configs and the corpus. ``test_user_properties.py`` runs them for real."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync_bench import testing
from weight_sync_bench.fuzz.strategies.user import narrow


@pytest.fixture
def handed(monkeypatch):
    calls = []

    def record(function, **kwargs):
        calls.append((function, kwargs))
        return "the test"

    monkeypatch.setattr(testing, "user_property", record)
    return calls


def f(shards, degree):
    return shards


def test_a_split_property_hands_the_splitter_its_degree_and_domain(handed):
    fast = settings(max_examples=3)
    assert testing.split_property(f, dst=4, settings=fast, real=False, corpus=False,
                                  max_d_model=64) == "the test"
    ((function, kwargs),) = handed
    assert (function.fn, function.role, function.src, function.dst) == (f, "splitter", None,
                                                                        None)
    assert function.name == f"{f.__module__}:f"  # its import path, as describe says
    assert kwargs == {"domain": narrow(max_d_model=64), "src": None, "dst": 4,
                      "settings": fast, "real": False, "corpus": False}
    handed.clear()
    testing.split_property(f)  # the defaults: the shipped configs first, the corpus kept
    ((function, kwargs),) = handed
    assert kwargs == {"domain": narrow(), "src": None, "dst": None, "settings": None,
                      "real": True, "corpus": True}


def test_a_reshard_property_hands_both_degrees_and_the_defaults(handed):
    testing.reshard_property(f, src=2, dst=1)
    ((function, kwargs),) = handed
    assert (function.role, function.src, function.dst) == ("resharder", None, None)
    assert kwargs == {"domain": narrow(), "src": 2, "dst": 1, "settings": None, "real": True,
                      "corpus": True}
    handed.clear()
    fast = settings(max_examples=3)
    testing.reshard_property(f, settings=fast, real=False, corpus=False, kv_heads=(1, 2))
    ((function, kwargs),) = handed
    assert kwargs == {"domain": narrow(kv_heads=(1, 2)), "src": None, "dst": None,
                      "settings": fast, "real": False, "corpus": False}


def test_a_convert_property_reads_its_ends_as_wsb_fuzz_does(handed):
    testing.convert_property(f, "megatron:4", "vllm", gqa=False)
    ((function, kwargs),) = handed
    assert (function.fn, function.role, function.src, function.dst) == (f, "converter",
                                                                        "megatron", "vllm")
    assert kwargs == {"domain": narrow(gqa=False), "src": 4, "dst": None, "settings": None,
                      "real": True, "corpus": True}
    handed.clear()
    fast = settings(max_examples=3)
    testing.convert_property(f, "megatron", "vllm:2", real=False, corpus=False, settings=fast)
    ((function, kwargs),) = handed
    assert kwargs["settings"] is fast
    assert (function.src, function.dst, kwargs["src"], kwargs["dst"]) == ("megatron", "vllm",
                                                                          None, 2)
    assert (kwargs["real"], kwargs["corpus"]) == (False, False)


@settings(max_examples=10, database=None, deadline=None)
@given(st.data())
def test_the_strategies_are_the_fuzz_domains_narrowed(data):
    assert testing.__all__ == ["convert_property", "degree_pairs", "geometries", "narrow",
                               "reshard_property", "seeds", "split_property"]
    config = data.draw(testing.geometries(max_d_model=16, kv_heads=(2, 2)))
    assert config.d_model <= 16 and config.n_kv_heads == 2
    src, dst = data.draw(testing.degree_pairs(config, [2]))
    assert (src, dst) == (2, 2)
    # without degrees, the layout's: the divisors of the 2 KV heads
    assert set(data.draw(testing.degree_pairs(config))) <= {1, 2}
    assert 0 <= data.draw(testing.seeds()) <= 65535

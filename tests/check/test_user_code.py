"""``check.user_code``: the one place the harness calls a user's function. Every check gives
it the geometry it checks (``config=``, and a converter ``hf_config=``) where its signature
takes them, whole or streamed; ``load_function`` says where it looked for a module it cannot
find, and tells a module that is not there (bad input) from one that raises (the user's)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import TOY, TOY_KV4, check_convert, check_reshard, check_split
from weight_sync_bench.check.convert import stage_convert
from weight_sync_bench.check.stream import stage_reshard, stage_split
from weight_sync_bench.check.user_code import (
    check_signature,
    geometry,
    load_function,
)
from weight_sync_bench.errors import InvalidShards, UserCodeError, WsbError
from weight_sync_bench.model.plan import layout_for

# Functions written for one geometry unless told another: each reads the geometry only from
# ``config``, whose default is TOY's (2 KV heads), and works on the whole model or on one
# stage of it (a streamed check's call). Checked at KV4 (TOY_KV4's 4 KV heads over a 512-word
# vocabulary: a fifth of the cost, judged by an explicit threshold, as no floor is committed
# for it), they pass only if the check passes KV4 as ``config``.
KV4 = narrowed(TOY_KV4)
SEEN: list[tuple[str, object]] = []


def split_by_config(full, degree, *, config=TOY):
    SEEN.append(("config", config))
    return stage_split(layout_for(config))(full, degree)


def reshard_by_config(shards, dst, config=TOY):
    SEEN.append(("config", config))
    return stage_reshard(layout_for(config))(shards, dst)


def convert_by_config(shards, degree, *, config=TOY, hf_config=None):
    SEEN.append(("config", config))
    SEEN.append(("hf_config", hf_config))
    return stage_convert("megatron:4", f"vllm:{degree}", config)(shards, degree)


CHECKS = {
    "split": lambda fn, **kw: check_split(fn, KV4, 2, threshold=THRESHOLD, **kw),
    "reshard": lambda fn, **kw: check_reshard(fn, KV4, 4, 2, threshold=THRESHOLD, **kw),
    "convert": lambda fn, **kw: check_convert(fn, KV4, "megatron:4", "vllm:2",
                                              threshold=THRESHOLD, **kw),
}
FUNCTIONS = {"split": split_by_config, "reshard": reshard_by_config,
             "convert": convert_by_config}


@pytest.mark.parametrize("stream", [None, "layer"])
@pytest.mark.parametrize("which", list(CHECKS))
def test_every_check_gives_the_function_the_geometry_it_checks(which, stream):
    SEEN.clear()
    verdict = CHECKS[which](FUNCTIONS[which], stream=stream)
    assert verdict.passed, verdict
    calls = 1 if stream is None else KV4.n_layers + 2  # the embedding, the layers, the head
    assert SEEN.count(("config", KV4)) == calls and ("config", TOY) not in SEEN
    if which == "convert":  # a converter reads config.json: the checked geometry's
        assert SEEN.count(("hf_config", KV4.to_hf_config())) == calls


@pytest.mark.parametrize("which", list(CHECKS))
def test_the_same_function_called_without_the_geometry_is_wrong_at_this_one(which):
    # the twin: with no config= the function falls back to TOY and fails at KV4, so the
    # test above passes only because each check passes the geometry
    fn = FUNCTIONS[which]
    with pytest.raises((UserCodeError, InvalidShards)) as info:
        CHECKS[which](lambda *args: fn(*args))
    if isinstance(info.value, UserCodeError):
        assert re.search("your (splitter|resharder|converter) `.*<lambda>` (raised|returned)",
                         str(info.value)), info.value
    else:  # TOY's megatron:4 exists (TP > KV heads): its vLLM shards have TOY's shapes
        assert which == "convert" and "shape [192, 256], declared [256, 256]" in str(info.value)


def test_the_keywords_given_are_those_the_signature_takes():
    def positional(shards, degree, config): ...
    def keyword_only(shards, degree, *, config, hf_config): ...
    def anything(shards, degree, **kwargs): ...
    def plain(shards, degree): ...

    hf = TOY.to_hf_config()
    assert geometry(positional, "converter", TOY) == {"config": TOY}
    assert geometry(keyword_only, "converter", TOY) == {"config": TOY, "hf_config": hf}
    assert geometry(anything, "converter", TOY) == {"config": TOY, "hf_config": hf}
    assert geometry(anything, "resharder", TOY) == {"config": TOY}  # hf_config: converters'
    assert geometry(plain, "converter", TOY) == {}
    assert geometry(keyword_only, "converter", None) == {}  # no geometry to give
    assert geometry(len, "splitter", TOY) == {}  # no signature to read


def test_a_signature_that_cannot_take_the_call_names_the_call_with_its_keywords():
    def one_positional(shards, *, config): ...

    with pytest.raises(UserCodeError) as err:
        check_signature(one_positional, ([], 2), role="resharder", keywords=("config",))
    assert str(err.value) == (
        f"your resharder `{__name__}:test_a_signature_that_cannot_take_the_call_names_the_"
        "call_with_its_keywords.<locals>.one_positional` has the wrong signature: it is "
        "one_positional(shards, *, config), the harness calls it as fn(shards, dst, "
        "config=config) (too many positional arguments)")
    with pytest.raises(UserCodeError, match=r"the harness calls it as fn\(full, degree\) \("):
        check_signature(one_positional, ({}, 2), role="splitter")
    check_signature(one_positional, ([],), role="resharder", keywords=("config",))  # it fits


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A user's module in a directory that is not the current one nor on the path."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "mine_elsewhere.py").write_text("def fn(shards, dst):\n    return shards\n")
    (home / "raises_at_import.py").write_text("import os\nVALUE = undefined + 1\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    for name in ("mine_elsewhere", "raises_at_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return home


def test_a_module_not_found_is_bad_input_saying_where_it_looked(elsewhere, monkeypatch):
    with pytest.raises(WsbError) as err:
        load_function("mine_elsewhere:fn", "resharder")
    assert not isinstance(err.value, UserCodeError)
    assert str(err.value) == (
        "cannot import 'mine_elsewhere' (from 'mine_elsewhere:fn'): No module named "
        "'mine_elsewhere'. It is imported as `python -m` would: from the current directory "
        f"({os.getcwd()}), then PYTHONPATH (not set) and the installed packages. Run from the "
        "directory that holds mine_elsewhere.py (or the package mine_elsewhere/), or add that "
        "directory to PYTHONPATH")
    monkeypatch.chdir(elsewhere)  # the hint's first way: run from where it lives
    assert load_function("mine_elsewhere:fn", "resharder")([1], 1) == [1]


def test_a_function_not_there_is_bad_input_and_a_module_that_raises_is_the_users(elsewhere,
                                                                                  monkeypatch):
    monkeypatch.syspath_prepend(str(elsewhere))  # the hint's second way: on the path
    with pytest.raises(WsbError, match="^mine_elsewhere:nope: mine_elsewhere has no callable "
                                       "'nope'$") as err:
        load_function("mine_elsewhere:nope", "resharder")
    assert not isinstance(err.value, UserCodeError)
    with pytest.raises(WsbError, match="^expected module:function, got 'mine_elsewhere'$"):
        load_function("mine_elsewhere", "resharder")
    with pytest.raises(UserCodeError) as err:
        load_function("raises_at_import:fn", "converter")
    assert str(err.value).startswith("your converter `raises_at_import:fn` raised NameError at "
                                     "import: name 'undefined' is not defined")
    assert 'raises_at_import.py", line 2' in str(err.value)

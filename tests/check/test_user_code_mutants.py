"""``check.user_code`` read exactly (issue 30, the mutation pass over the one place that
calls user code): how a function with no qualified name is named, every malformed
``module:function``, where the current directory goes on ``sys.path``, a missing parent
package, the role kept on what a module raises at import, every way an input comes back
changed (on the last rank), and every refusal of a returned container. Each has its twin."""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from pathlib import Path

import pytest
import torch

from weight_sync_bench import TOY
from weight_sync_bench.check.user_code import (
    _PACKAGE,
    _check_container,
    _harness,
    accepts,
    call,
    call_user,
    check_signature,
    deadline,
    describe,
    fingerprint,
    frame_error,
    geometry,
    load_function,
    set_deadline,
    user_frames,
)
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.errors import (
    InvalidNumber,
    InvalidUserShards,
    ModifiedInput,
    UserCodeError,
    UserCodeTimeout,
    WrongUserShard,
    WsbError,
)
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import init_params
from weight_sync_bench.model.plan import layout_for


class _Callable:
    def __call__(self, *args):
        return args

    def __repr__(self):
        return "<a callable>"


class _Nameless:
    __module__ = None  # type: ignore[assignment]

    def __call__(self):
        return None

    def __repr__(self):
        return "<nameless>"


def test_a_callable_without_a_qualified_name_is_named_by_its_name_or_its_repr():
    assert describe(describe) == "weight_sync_bench.check.user_code:describe"  # the twin
    assert describe(_Callable()) == f"{__name__}:<a callable>"
    named = _Callable()
    named.__name__ = "renamed"  # a name, no qualified name
    assert describe(named) == f"{__name__}:renamed"
    assert describe(_Nameless()) == "?:<nameless>"
    partial = functools.partial(print, 1)
    assert describe(partial) == f"functools:{partial!r}"


@pytest.fixture
def home(tmp_path, monkeypatch):
    (tmp_path / "uc_mod.py").write_text("def fn(*a):\n    return 'fn'\n")
    (tmp_path / "uc_raises.py").write_text("raise ValueError('at import')\n")
    monkeypatch.chdir(tmp_path)
    for name in ("uc_mod", "uc_raises"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


@pytest.mark.parametrize("spec", [":fn", "uc_mod:", ":", ""])
def test_a_spec_without_a_module_or_a_function_is_refused_as_such(home, spec):
    with pytest.raises(WsbError, match=f"^expected module:function, got {spec!r}$"):
        load_function(spec, "resharder")
    assert load_function("uc_mod:fn", "resharder")() == "fn"  # the twin


def test_a_second_colon_belongs_to_the_function_name(home):
    with pytest.raises(WsbError, match="^uc_mod:fn:x: uc_mod has no callable 'fn:x'$"):
        load_function("uc_mod:fn:x", "resharder")


def test_the_current_directory_goes_first_on_the_path_only_where_neither_it_nor_empty_is(
        home, monkeypatch):
    rest = [p for p in sys.path if p not in ("", str(home))]
    monkeypatch.setattr(sys, "path", list(rest))
    load_function("uc_mod:fn", "resharder")
    assert sys.path == [str(home), *rest]
    monkeypatch.delitem(sys.modules, "uc_mod")
    monkeypatch.setattr(sys, "path", ["", *rest])  # `python -m`'s own entry: nothing added
    load_function("uc_mod:fn", "resharder")
    assert sys.path == ["", *rest]


def test_a_missing_parent_package_is_bad_input_not_the_users_error(home):
    with pytest.raises(WsbError, match="^cannot import 'uc_no_pkg.sub'") as err:
        load_function("uc_no_pkg.sub:fn", "resharder")
    assert not isinstance(err.value, UserCodeError)


def test_a_module_raising_at_import_is_the_users_error_in_its_role(home):
    with pytest.raises(UserCodeError) as err:
        load_function("uc_raises:fn", "converter")
    assert (err.value.role, err.value.function) == ("converter", "uc_raises:fn")
    assert str(err.value).startswith("your converter `uc_raises:fn` raised ValueError at "
                                     "import: at import")


def _shards():
    return [{"a": torch.ones(2), "b": torch.ones(3)}, {"a": torch.ones(2), "b": torch.ones(3)}]


@pytest.mark.parametrize(("harm", "how"), [
    (lambda s: s[1].pop("b"), "removed"),
    (lambda s: s[1].__setitem__("b", torch.ones(3)), "replaced"),
    (lambda s: s[1]["b"].resize_(2), "resized or re-strided in place"),
    (lambda s: s[1]["b"].__setitem__(2, 1.5), "modified in place"),
])
def test_an_input_changed_on_the_last_rank_is_named_with_how(harm, how):
    def fn(shards, dst):
        harm(shards)
        return shards

    with pytest.raises(ModifiedInput) as err:
        call(fn, [_shards(), 2], role="resharder", during="while resharding toy 2 -> 2")
    assert (err.value.rank, err.value.name) == (1, "b")
    assert (err.value.role, err.value.function) == ("resharder", describe(fn))
    assert str(err.value).endswith(
        "while resharding toy 2 -> 2: the harness's inputs must come back as they were given "
        "(in a weight sync this destroys the trainer's weights); copy before changing a tensor "
        "(x.clone())")
    assert str(err.value).startswith(
        f"your resharder `{describe(fn)}` {how} source rank 1 `b` while resharding toy 2 -> 2:")
    untouched = _shards()
    assert call(lambda shards, dst: dst, [untouched, 2], role="resharder",
                during="x") == 2  # the twin
    assert fingerprint([untouched]).changed([untouched]) is None


def test_a_full_models_tensor_changed_is_named_without_a_rank():
    full = {"w": torch.zeros(2)}

    def fn(params, degree):
        params["w"].add_(1)

    with pytest.raises(ModifiedInput, match="modified in place `w` while splitting") as err:
        call(fn, [full, 2], role="splitter", during="while splitting")
    assert err.value.rank is None


@pytest.mark.parametrize(("result", "said"), [
    ("shards", "returned a str, expected a list of 2 rank dicts"),
    ({"a": 1}, "returned a dict, expected a list of 2 rank dicts"),
    ([{}, {1: 0, 2: 0, 3: 0, 4: 0}], "returned a dict with non-string keys at rank 1 (1, 2, "
                                     "3, ...): keys are the harness's parameter names"),
    ([{}, {(1,): 0}], "returned a dict with non-string keys at rank 1 ((1,)): keys"),
    ([[1], {1: 0, 2: 0, 3: 0}], "returned a dict with non-string keys at rank 1 (1, 2, 3): "
                                "keys"),  # past a rank that is not a dict (validate's to name)
    ([{}, {"w": torch.empty(2, device="meta")}], "returned rank 1 w on the meta device: the "
                                                 "check compares values, so return CPU tensors"),
])
def test_a_returned_container_is_refused_naming_the_rank_and_what(result, said):
    with pytest.raises(InvalidUserShards) as err:
        _check_container(result, 2, role="resharder", function="m:f")
    assert str(err.value).startswith(f"your resharder `m:f` {said}"), str(err.value)
    assert (err.value.role, err.value.function) == ("resharder", "m:f")
    _check_container([{"w": torch.zeros(1)}, [1]], 2, role="resharder", function="m:f")  # twin


def test_a_module_missing_one_of_its_own_imports_is_the_users_error_in_its_role(home):
    (home / "uc_needs.py").write_text("import uc_not_installed_anywhere\n")
    sys.modules.pop("uc_needs", None)
    with pytest.raises(UserCodeError) as err:
        load_function("uc_needs:fn", "splitter")
    assert (err.value.role, err.value.function) == ("splitter", "uc_needs:fn")
    assert str(err.value).startswith("your splitter `uc_needs:fn` raised ModuleNotFoundError "
                                     "at import: No module named 'uc_not_installed_anywhere'")


def test_the_import_hint_names_pythonpath_and_the_top_package(home, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/nowhere/a:/nowhere/b")
    with pytest.raises(WsbError) as err:
        load_function("uc_no_pkg.sub:fn", "resharder")
    assert str(err.value).endswith(
        "then PYTHONPATH (/nowhere/a:/nowhere/b) and the installed packages. Run from the "
        "directory that holds uc_no_pkg.py (or the package uc_no_pkg/), or add that directory "
        "to PYTHONPATH")


class _NoSignature:
    __signature__ = "not a signature"  # inspect.signature raises TypeError on it

    def __call__(self, *args, **kwargs):
        return args


def test_a_callable_whose_signature_cannot_be_read_is_given_no_keywords():
    assert accepts(lambda shards, dst, config=None: 0, "config")  # the twin
    assert not accepts(_NoSignature(), "config")
    assert geometry(_NoSignature(), "resharder", TOY) == {}
    assert describe((1).__add__) == "?:int.__add__"  # no __module__ at all


def test_a_converter_is_given_both_endpoints_where_it_takes_them():
    ends = (endpoint("megatron:2"), endpoint("vllm:4"))

    def conv(shards, degree, *, source=None, target=None):
        return shards

    assert geometry(conv, "converter", TOY, ends) == {"source": ends[0], "target": ends[1]}
    assert geometry(conv, "converter", TOY) == {}  # no endpoints: neither keyword
    assert geometry(conv, "converter", None, ends) == {}  # no geometry: nothing


def test_a_signature_that_cannot_take_the_call_is_refused_with_every_keyword():
    def two(shards, degree):
        return shards

    with pytest.raises(UserCodeError) as err:
        check_signature(two, [[], 2], role="converter", keywords=("config", "hf_config"))
    assert (err.value.role, err.value.function) == ("converter", describe(two))
    assert str(err.value) == (
        f"your converter `{describe(two)}` has the wrong signature: it is two(shards, degree), "
        "the harness calls it as fn(shards, degree, config=config, hf_config=hf_config) (got "
        "an unexpected keyword argument 'config')")
    with pytest.raises(UserCodeError) as err:
        check_signature(5, [[], 2], role="resharder")
    assert (str(err.value), err.value.role, err.value.function) == (
        "your resharder 5 is not callable", "resharder", "5")
    check_signature(two, [[], 2], role="converter")  # the twin: no keywords, it fits


def test_call_hands_a_converter_its_endpoints():
    ends = (endpoint("megatron:2"), endpoint("vllm:4"))
    seen = {}

    def conv(shards, degree, *, source=None, target=None):
        seen.update(source=source, target=target)
        return shards

    call(conv, [[], 4], role="converter", during="x", config=TOY, ends=ends)
    assert seen == {"source": ends[0], "target": ends[1]}


def test_a_call_past_its_deadline_is_named_with_role_function_and_when():
    """The function blocks until released (after the assertion), so it outlasts any
    deadline whatever the machine's load: nothing here depends on how fast it runs."""
    release = threading.Event()

    def stuck(shards, dst):
        release.wait(60)
        return shards

    try:
        with deadline(0.05), pytest.raises(UserCodeTimeout) as err:
            call(stuck, [[], 2], role="resharder", during="while resharding toy 2 -> 2",
                 name="mine:stuck")
        left = [t for t in threading.enumerate() if t.name == "wsb-user-resharder"]
        assert left and all(t.daemon for t in left)  # it cannot keep the process alive
    finally:
        release.set()
    assert (err.value.role, err.value.function) == ("resharder", "mine:stuck")
    where = err.value.user_traceback
    assert where == where.rstrip() and "in stuck" in where and "release.wait(60)" in where
    assert all(line.startswith(("  File ", "    ")) for line in where.splitlines())
    assert str(err.value).endswith("Where it was:\n" + "\n".join(where.splitlines()[-12:]))
    assert str(err.value).startswith(
        "your resharder `mine:stuck` did not return within 0.05 s (--deadline) while "
        "resharding toy 2 -> 2; it was left running in a daemon thread")


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_a_deadline_that_is_not_a_positive_number_is_refused_naming_it(seconds):
    with pytest.raises(InvalidNumber) as err:
        set_deadline(seconds)
    assert str(err.value) == f"deadline must be a finite number > 0, got {seconds}"
    with deadline(2.0):  # the twin
        pass


def test_under_a_deadline_the_function_still_gets_its_geometry():
    def needs(shards, dst, *, config):
        return config

    with deadline(30.0):
        assert call(needs, [[], 2], role="resharder", during="x", config=TOY) is TOY


def test_call_user_names_the_function_as_told_and_a_wrong_shard_with_its_fields():
    layout = layout_for(TOY)
    shards = split(init_params(TOY, 0), layout, 2)
    name = next(iter(shards[1]))
    wrong = [dict(shards[0]), {**shards[1], name: shards[1][name][:1].clone()}]

    def boom(full, degree):
        raise ValueError("no")

    with pytest.raises(UserCodeError, match="^your splitter `mine:boom` raised ValueError"):
        call_user(boom, [{}, 2], role="splitter", during="x", layout=layout, degree=2,
                  name="mine:boom")
    with pytest.raises(WrongUserShard) as err:
        call_user(lambda full, degree: wrong, [{}, 2], role="splitter", during="x",
                  layout=layout, degree=2, name="mine:split")
    e = err.value
    assert (e.role, e.function, e.rank, e.name) == ("splitter", "mine:split", 1, name)
    shape = tuple(shards[1][name].shape)
    assert (e.expected, e.actual) == (shape, (1, *shape[1:]))
    assert str(e).startswith("your splitter `mine:split` returned shards that do not fit the "
                             "layout: ")
    assert call_user(lambda full, degree: shards, [{}, 2], role="splitter", during="x",
                     layout=layout, degree=2) == shards  # the twin


def test_user_frames_start_at_the_first_frame_that_is_not_the_harness(tmp_path):
    """A traceback that begins in a harness frame (code compiled under the package's path),
    passes through the import machinery's, and ends in the user's file: only the user's
    frames are quoted. Called directly, so no frame of a mutation tool's trampoline sits in
    the traceback."""
    user = tmp_path / "uc_user_frames.py"
    user.write_text("def inner():\n    raise ValueError('mine')\n\n\ndef outer():\n    inner()\n")
    namespace: dict = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)
    harness: dict = {}
    exec(compile("def run(fn):\n    try:\n        fn()\n    except Exception as exc:\n"
                 "        return exc\n", str(_PACKAGE / "check" / "planted.py"), "exec"), harness)
    exc = harness["run"](namespace["outer"])
    frames = user_frames(exc.__traceback__)
    assert frames.splitlines()[0] == f'  File "{user}", line 6, in outer'
    assert "planted.py" not in frames and frames.rstrip().endswith("raise ValueError('mine')")
    error = frame_error(exc, role="resharder", function="m:f", during="while x")
    assert (error.role, error.function, error.user_traceback) == ("resharder", "m:f", frames)
    assert str(error) == f"your resharder `m:f` raised ValueError while x: mine\n{frames}"
    assert len(frames.splitlines()) == 4 and all(  # two frames, each its two lines
        line.startswith(("  File ", "    ")) for line in frames.splitlines())
    assert error.__cause__ is exc
    inside: dict = {}
    exec(compile("def boom():\n    raise KeyError(1)\n", str(_PACKAGE / "y.py"), "exec"), inside)
    assert user_frames(harness["run"](inside["boom"]).__traceback__) == ""  # none the user's


def test_which_files_are_the_harness_or_the_import_machinery(tmp_path):
    assert _harness("<frozen importlib._bootstrap>")
    assert _harness(str(Path(importlib.__file__)))
    assert _harness(str(_PACKAGE / "check" / "user_code.py"))
    assert not _harness(str(tmp_path / "mine.py"))
    assert not _harness(str(tmp_path / "pkg" / "__init__.py"))  # a user's package
    assert not _harness("<frozen os>")


def test_an_error_with_no_user_frames_is_the_message_alone():
    error = frame_error(ValueError("bare"), role="converter", function="m:f", during="at import")
    assert str(error) == "your converter `m:f` raised ValueError at import: bare"
    assert error.user_traceback is None


def test_call_user_says_how_many_ranks_and_keeps_every_field_of_a_refusal():
    layout = layout_for(TOY)
    shards = split(init_params(TOY, 0), layout, 2)
    name = next(iter(shards[1]))

    def run(result):
        return call_user(lambda full, degree: result, [{}, 2], role="splitter", during="x",
                         layout=layout, degree=2, name="mine:f")

    with pytest.raises(InvalidUserShards, match="returned a str, expected a list of 2 rank"):
        run("nope")
    with pytest.raises(WrongUserShard) as err:
        run([shards[0], {**shards[1], name: shards[1][name].double()}])
    e = err.value
    assert (e.rank, e.name, e.expected_dtype, e.actual_dtype) == (1, name, torch.float32,
                                                                  torch.float64)
    missing = {k: v for k, v in shards[1].items() if k != name}
    with pytest.raises(InvalidUserShards) as err:
        run([shards[0], missing])
    assert not isinstance(err.value, WrongUserShard)
    assert (err.value.role, err.value.function) == ("splitter", "mine:f")
    assert str(err.value).startswith("your splitter `mine:f` returned shards that do not fit "
                                      "the layout: ")


def test_a_callable_object_of_the_wrong_signature_is_shown_by_its_repr():
    with pytest.raises(UserCodeError) as err:
        check_signature(_OneArg(), [[], 2], role="resharder")
    assert ("has the wrong signature: it is <one arg>(x), the harness calls it as "
            "fn(shards, dst)") in str(err.value)


class _OneArg:
    def __call__(self, x):
        return x

    def __repr__(self):
        return "<one arg>"

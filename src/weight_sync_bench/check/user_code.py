"""The user's own functions, called as the user's: the one place the harness calls user code.

Every caller goes through here: ``check_split`` / ``check_reshard`` / ``check_convert`` (whole
or streamed), ``wsb check``, ``wsb fuzz`` and ``weight_sync_bench.testing`` (``fuzz.user``),
and ``wsb replay`` of a user function's corpus entry.

- ``load_function("module:function", role)`` imports it as ``python -m`` would find it (the
  current directory, then ``PYTHONPATH``). One rule for what is whose: a ``module:function``
  that names nothing (a malformed spec, a module not found, no callable of that name) is bad
  input, ``WsbError`` (exit 2), with a hint where the module is not importable from here; a
  module that raises while importing is the user's code, ``UserCodeError`` (exit 4), framed
  with their frames of the traceback.
- ``call`` checks that the function can be called the way the harness calls it (``CALLS``,
  plus the geometry keywords it accepts), passes the geometry where the signature takes it
  (``config=`` the ``ModelConfig``, and for a converter ``hf_config=`` its ``config.json``
  dict, ``ModelConfig.to_hf_config``: what a real converter reads), calls it and turns an
  exception it raises into ``UserCodeError`` ("your resharder `mod:fn` raised ValueError
  while resharding toy 1 -> 2: ...", quoting the user's frames, not the harness's).
- ``call_user`` is ``call`` whose result is checked as shards of a layout: a list of dicts of
  ``str`` -> CPU tensors of the layout's names, shapes and dtypes (``InvalidUserShards``,
  ``WrongUserShard``, naming the rank and the parameter). A converter's output is checked
  against its convention by the conversion check (``check.convert``), in that convention's
  words.

- Every call is guarded on both sides. What the harness hands the function (source shards,
  full tensors) is fingerprinted before the call (each tensor's identity, shape, stride,
  dtype and a CRC-32 of its bytes) and checked after it: a function that changed
  an input in place, or replaced or removed a tensor of the dicts it was given, fails with
  ``ModifiedInput`` naming the rank and the tensor (in a weight sync, a converter that
  zeroes its input destroys the trainer's weights). With a deadline (``deadline(seconds)``,
  ``wsb ... --deadline``), the function runs in a daemon thread and a call that has not
  returned in time raises ``UserCodeTimeout`` with the function's stack; the thread cannot
  be stopped from outside, so it is abandoned and ends with the process. Code stuck in a
  native call that holds the GIL (a C extension blocking without releasing it) stops the
  whole interpreter, the deadline's thread included: only an outer timeout ends that.

A ``KeyboardInterrupt`` is not the user's code failing, and passes through.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import threading
import traceback
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.errors import (
    InvalidNumber,
    InvalidShards,
    InvalidUserShards,
    ModifiedInput,
    UserCodeError,
    UserCodeTimeout,
    WrongShardShape,
    WrongUserShard,
    WsbError,
)
from weight_sync_bench.layout.reshard import validate_shards

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.layout.table import LayoutTable
    from weight_sync_bench.model.config import ModelConfig

_PACKAGE = Path(__file__).resolve().parents[1]  # src/weight_sync_bench

# How the harness calls each role's function, positionally; then, by name, the geometry
# keywords of ``GEOMETRY`` that its signature accepts.
CALLS = {"splitter": "fn(full, degree)", "resharder": "fn(shards, dst)",
         "converter": "fn(shards, degree)"}
GEOMETRY = {"splitter": ("config",), "resharder": ("config",),
            "converter": ("config", "hf_config", "source", "target")}


def describe(fn: object) -> str:
    """``module:qualname``, the way ``--resharder`` names a function."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}:{name}"


# -- loading ``module:function``


def load_function(spec: str, role: str) -> Callable[..., Any]:
    """``module:function`` imported as ``python -m`` would find it (the current directory
    first). A spec that names no module or no callable is bad input (``WsbError``, exit 2);
    a module that raises while importing is the user's code (``UserCodeError``, exit 4)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise WsbError(f"expected module:function, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's module beside them, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise WsbError(f"cannot import {module_name!r} (from {spec!r}): {exc}. "
                           f"{_import_hint(module_name)}") from None
        raise frame_error(exc, role=role, function=spec, during="at import") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises is theirs
        raise frame_error(exc, role=role, function=spec, during="at import") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise WsbError(f"{spec}: {module_name} has no callable {attr!r}")
    return fn


def _import_hint(module_name: str) -> str:
    """Where the import looked, and the two ways to make the module importable from here."""
    top = module_name.split(".")[0]
    path = os.environ.get("PYTHONPATH")
    return (f"It is imported as `python -m` would: from the current directory ({os.getcwd()}), "
            f"then PYTHONPATH ({path if path else 'not set'}) and the installed packages. Run "
            f"from the directory that holds {top}.py (or the package {top}/), or add that "
            "directory to PYTHONPATH")


# -- calling


def accepts(fn: Callable[..., Any], keyword: str) -> bool:
    """Whether ``fn``'s signature accepts ``keyword=`` (by name, or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == keyword and p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) for p in params)


def geometry_keywords(fn: Callable[..., Any], role: str) -> tuple[str, ...]:
    """The geometry keywords (``GEOMETRY[role]``) that ``fn`` accepts, in that order."""
    return tuple(k for k in GEOMETRY[role] if accepts(fn, k))


def geometry(fn: Callable[..., Any], role: str, config: ModelConfig | None,
             ends: tuple[Endpoint, Endpoint] | None = None) -> dict[str, Any]:
    """The keyword arguments the harness passes ``fn`` for ``config``: ``config=`` and, for a
    converter, ``hf_config=`` (``config.to_hf_config()``) and ``source=`` / ``target=`` (the
    two endpoints, ``ends``: their pipeline stages, experts and options, and each rank's
    coordinates through ``conventions.rank_coordinates``), each where the signature accepts
    it; none without a config."""
    if config is None:
        return {}
    values = {"config": lambda: config, "hf_config": config.to_hf_config,
              "source": lambda: ends[0] if ends else None,
              "target": lambda: ends[1] if ends else None}
    return {k: v for k in geometry_keywords(fn, role)
            if (v := values[k]()) is not None}


def require_callable(fn: object, role: str) -> None:
    if not callable(fn):
        raise UserCodeError(f"your {role} {fn!r} is not callable", role=role, function=repr(fn))


def check_signature(fn: Callable[..., Any], args: Sequence[object], *, role: str,
                    keywords: Sequence[str] = ()) -> None:
    """Refuse a function that cannot take ``args`` and ``keywords`` (the harness calls it as
    ``CALLS[role]``, with those keywords)."""
    require_callable(fn, role)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: no signature to read, calling it will tell
    try:
        signature.bind(*args, **dict.fromkeys(keywords))
    except TypeError as exc:
        call = CALLS[role]
        if keywords:
            call = f"{call[:-1]}, {', '.join(f'{k}={k}' for k in keywords)})"
        raise UserCodeError(f"your {role} `{describe(fn)}` has the wrong signature: it is "
                            f"{fn.__name__ if hasattr(fn, '__name__') else fn}{signature}, the "
                            f"harness calls it as {call} ({exc})", role=role,
                            function=describe(fn)) from None


def call(fn: Callable[..., Any], args: Sequence[object], *, role: str, during: str,
         config: ModelConfig | None = None, name: str | None = None,
         ends: tuple[Endpoint, Endpoint] | None = None) -> Any:
    """``fn(*args, **geometry(fn, role, config))``, its signature checked first, what it
    raises framed as the user's (``name``, default ``describe(fn)``, names it); its inputs
    checked unchanged after it returns (``ModifiedInput``), and bounded by the deadline where
    one is set (``UserCodeTimeout``)."""
    kwargs = geometry(fn, role, config, ends)
    check_signature(fn, args, role=role, keywords=tuple(kwargs))
    function = name or describe(fn)
    before = fingerprint(args)
    try:
        result = _bounded(fn, args, kwargs, role=role, function=function, during=during)
    except (UserCodeTimeout, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise frame_error(exc, role=role, function=function, during=during) from exc
    changed = before.changed(args)
    if changed is not None:
        rank, tensor, how = changed
        where = f"source rank {rank} `{tensor}`" if rank is not None else f"`{tensor}`"
        raise ModifiedInput(f"your {role} `{function}` {how} {where} {during}: the harness's "
                            "inputs must come back as they were given (in a weight sync this "
                            "destroys the trainer's weights); copy before changing a tensor "
                            "(x.clone())", role=role, function=function, rank=rank,
                            name=tensor)
    return result


# -- what the user's function is handed, unchanged


def _digest(x: torch.Tensor) -> bytes:
    """A CRC-32 of the tensor's bytes. The guard is against slips, not adversaries: CRC-32
    catches every change confined to 32 consecutive bits (so any one element of a <= 4-byte
    dtype changed, whatever its value), any other change but with probability 2**-32, and
    costs a fraction of a cryptographic digest's time, which matters: it runs twice per
    call over every input tensor."""
    flat = x.detach().reshape(-1)
    if flat.numel() == 0:
        return b""
    raw = flat.contiguous().view(torch.uint8).numpy()  # the bytes, whatever the dtype
    return zlib.crc32(memoryview(raw)).to_bytes(4, "little")


def _tensors(args: Sequence[object]) -> Iterator[tuple[int | None, str, object]]:
    """``(rank, name, value)`` of every tensor the arguments hold: shards (a list of rank
    dicts) by rank and name, a full model (a dict) by name, a bare tensor by position."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            yield None, f"argument {i}", arg
        elif isinstance(arg, Mapping):
            yield from ((None, str(k), v) for k, v in arg.items())
        elif isinstance(arg, Sequence) and not isinstance(arg, (str, bytes)):
            for rank, params in enumerate(arg):
                if isinstance(params, Mapping):
                    yield from ((rank, str(k), v) for k, v in params.items())


@dataclass(frozen=True)
class Fingerprint:
    """Each input tensor's object, layout and digest, by ``(rank, name)``."""

    tensors: dict[tuple[int | None, str], tuple[object, tuple[Any, ...], bytes]]

    def changed(self, args: Sequence[object]) -> tuple[int | None, str, str] | None:
        """The first input the call changed, as ``(rank, name, how)``; None where none."""
        seen = {}
        for rank, name, value in _tensors(args):
            seen[rank, name] = value
        for (rank, name), (obj, layout, digest) in self.tensors.items():
            if (rank, name) not in seen:
                return rank, name, "removed"
            now = seen[rank, name]
            if now is not obj:
                return rank, name, "replaced"
            assert isinstance(now, torch.Tensor)
            if _layout(now) != layout:
                return rank, name, "resized or re-strided in place"
            if _digest(now) != digest:
                return rank, name, "modified in place"
        return None


def _layout(x: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(x.shape), x.stride(), x.dtype, x.storage_offset())


def fingerprint(args: Sequence[object]) -> Fingerprint:
    """What ``call`` checks unchanged after the user's function returns."""
    return Fingerprint({(rank, name): (x, _layout(x), _digest(x))
                        for rank, name, x in _tensors(args) if isinstance(x, torch.Tensor)})


# -- the deadline


_DEADLINE: list[float | None] = [None]  # seconds a call of the user's function may take


def set_deadline(seconds: float | None) -> None:
    """Bound every later call of the user's function to ``seconds`` (None: unbounded), as
    ``wsb ... --deadline`` does."""
    _DEADLINE[0] = None if seconds is None else InvalidNumber.positive("deadline", seconds)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """``set_deadline(seconds)`` for the block, the previous deadline restored after it."""
    previous = _DEADLINE[0]
    set_deadline(seconds)
    try:
        yield
    finally:
        _DEADLINE[0] = previous


def _bounded(fn: Callable[..., Any], args: Sequence[object], kwargs: dict[str, Any], *,
             role: str, function: str, during: str) -> Any:
    """``fn(*args, **kwargs)``, in a daemon thread when a deadline is set (with this
    thread's grad mode), ``UserCodeTimeout`` with its stack where it has not returned in
    time; what it raised is re-raised here."""
    seconds = _DEADLINE[0]
    if seconds is None:
        return fn(*args, **kwargs)
    outcome: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad):
                outcome["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name=f"wsb-user-{role}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        frame = sys._current_frames().get(worker.ident or -1)
        stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else ""
        raise UserCodeTimeout(
            f"your {role} `{function}` did not return within {seconds:g} s (--deadline) "
            f"{during}; it was left running in a daemon thread (Python cannot stop it) and "
            "ends with the process. Where it was:\n" + "\n".join(stack.splitlines()[-12:]),
            role=role, function=function, user_traceback=stack or None)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def call_user(fn: Callable[..., Any], args: Sequence[object], *, role: str, during: str,
              layout: LayoutTable, degree: int,
              dtypes: torch.dtype | Mapping[str, torch.dtype] = torch.float32,
              config: ModelConfig | None = None, name: str | None = None
              ) -> list[dict[str, torch.Tensor]]:
    """``call``, its result checked as shards of ``layout`` at ``degree``."""
    result = call(fn, args, role=role, during=during, config=config, name=name)
    function = name or describe(fn)
    _check_container(result, degree, role=role, function=function)
    try:
        validate_shards(result, layout, degree, dtypes)
    except WrongShardShape as exc:  # the rank, name and expected / actual shape or dtype kept
        raise WrongUserShard(f"your {role} `{function}` returned shards that do not fit the "
                             f"layout: {exc}", role=role, function=function, rank=exc.rank,
                             name=exc.name, expected=exc.expected, actual=exc.actual,
                             expected_dtype=exc.expected_dtype,
                             actual_dtype=exc.actual_dtype) from None
    except InvalidShards as exc:
        raise InvalidUserShards(f"your {role} `{function}` returned shards that do not fit the "
                                f"layout: {exc}", role=role, function=function) from None
    return list(result)


def _check_container(result: object, degree: int, *, role: str, function: str) -> None:
    """A list of ``degree`` dicts of str -> CPU tensors (validate_shards says the rest)."""
    def refuse(what: str) -> InvalidUserShards:
        return InvalidUserShards(f"your {role} `{function}` returned {what}", role=role,
                                 function=function)

    if not isinstance(result, Sequence) or isinstance(result, (str, bytes)):
        raise refuse(f"a {type(result).__name__}, expected a list of {degree} rank dicts")
    for rank, params in enumerate(result):
        if not isinstance(params, Mapping):
            continue  # validate_shards names it
        odd = [k for k in params if not isinstance(k, str)]
        if odd:
            raise refuse(f"a dict with non-string keys at rank {rank} "
                         f"({', '.join(repr(k) for k in odd[:3])}{', ...' if len(odd) > 3 else ''}"
                         "): keys are the harness's parameter names, e.g. 'norm.weight'")
        for name, x in params.items():
            if isinstance(x, torch.Tensor) and x.device.type != "cpu":
                raise refuse(f"rank {rank} {name} on the {x.device.type} device: the check "
                             "compares values, so return CPU tensors holding them")


# -- framing what the user's code raised


def _harness(filename: str) -> bool:
    """Frames of the harness or of the import machinery, not the user's."""
    if filename.startswith("<frozen importlib"):
        return True
    path = Path(filename)
    return (path.name == "__init__.py" and path.parent.name == "importlib") or \
        _PACKAGE in path.resolve().parents


def user_frames(tb: TracebackType | None) -> str:
    """The traceback from the first frame that is not the harness's (what the user wrote,
    and anything it called), formatted as Python prints it."""
    frames = traceback.extract_tb(tb)
    start = next((i for i, f in enumerate(frames) if not _harness(f.filename)), len(frames))
    return "".join(traceback.format_list(frames[start:])).rstrip()


def frame_error(exc: BaseException, *, role: str, function: str, during: str) -> UserCodeError:
    """``exc``, raised by the user's code ``during`` (``"while resharding toy 1 -> 2"``,
    ``"at import"``), as a ``UserCodeError``."""
    frames = user_frames(exc.__traceback__)
    message = f"your {role} `{function}` raised {type(exc).__name__} {during}: {exc}"
    if frames:
        message += f"\n{frames}"
    error = UserCodeError(message, role=role, function=function, user_traceback=frames or None)
    error.__cause__ = exc
    return error

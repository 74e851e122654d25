"""The user's own functions, called as the user's: a failure of theirs is framed as theirs.

``call_user`` checks that a resharder or splitter can be called the way the harness calls it,
calls it, turns an exception it raises into ``UserCodeError`` ("your resharder `mod:fn`
raised ValueError while resharding toy 1 -> 2: ...", quoting the user's frames of the
traceback, not the harness's), and checks that what came back is shards: a list of dicts of
``str`` -> CPU tensors that fit the layout (``InvalidUserShards``, naming the rank and the
parameter). A ``KeyboardInterrupt`` is not the user's code failing, and passes through.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.errors import (
    InvalidShards,
    InvalidUserShards,
    UserCodeError,
    WrongShardShape,
    WrongUserShard,
)
from weight_sync_bench.layout.reshard import validate_shards

if TYPE_CHECKING:
    from weight_sync_bench.layout.table import LayoutTable

_PACKAGE = Path(__file__).resolve().parents[1]  # src/weight_sync_bench


def describe(fn: object) -> str:
    """``module:qualname``, the way ``--resharder`` names a function."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}:{name}"


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


def check_signature(fn: Callable[..., Any], args: Sequence[object], *, role: str, call: str
                    ) -> None:
    """Refuse a function that cannot take ``args`` (the harness calls ``call``)."""
    if not callable(fn):
        raise UserCodeError(f"your {role} {fn!r} is not callable", role=role, function=repr(fn))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: no signature to read, calling it will tell
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise UserCodeError(f"your {role} `{describe(fn)}` has the wrong signature: it is "
                            f"{fn.__name__ if hasattr(fn, '__name__') else fn}{signature}, the "
                            f"harness calls it as {call} ({exc})", role=role,
                            function=describe(fn)) from None


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


def call_user(fn: Callable[..., Any], args: Sequence[object], *, role: str, call: str,
              during: str, layout: LayoutTable, degree: int,
              dtypes: torch.dtype | Mapping[str, torch.dtype] = torch.float32
              ) -> list[dict[str, torch.Tensor]]:
    """``fn(*args)``, framed as the user's code, its result checked as shards at ``degree``."""
    check_signature(fn, args, role=role, call=call)
    function = describe(fn)
    try:
        result = fn(*args)
    except Exception as exc:
        raise frame_error(exc, role=role, function=function, during=during) from exc
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

"""Breadth the default run leaves to the long one (``make nightly`` runs ``-m "slow or not
slow"``): of a parametrized test's cases, those not kept are marked ``slow``. The kept ones
are the default run's equivalent case, chosen by the test module (a comment there says why);
a kept name that matches no case fails at import, so a rename never moves a whole test to the
nightly run unseen."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

_PARAM = type(pytest.param(None))


def breadth(values: Iterable[Any], *, keep: Iterable[str],
            name: Callable[[Any], str] = str) -> list[Any]:
    """``values`` (plain values, tuples of several, or ``pytest.param``s) as
    ``pytest.param``s, those whose ``name`` is not in ``keep`` marked slow."""
    values, keep = list(values), set(keep)
    names = [name(v) for v in values]
    missing = keep - set(names)
    if missing or not keep:
        raise ValueError(f"breadth: kept {sorted(missing) or 'nothing'}, not among {names}")
    out = []
    for v, n in zip(values, names):
        slow = () if n in keep else (pytest.mark.slow,)
        if isinstance(v, _PARAM):
            out.append(pytest.param(*v.values, id=v.id, marks=(*v.marks, *slow)))
        else:  # a tuple is the values of several argument names, as parametrize takes them
            out.append(pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=slow))
    return out


def budget(default: int, *, nightly: int) -> int:
    """A Hypothesis budget: ``default`` examples in the default run (the ``wsb-test``
    profile), ``nightly`` under any other (``make nightly``'s ``wsb-nightly``): the default
    run's share of a property is smaller, the long run's is not cut with it. ``nightly`` is
    given from the active profile (``settings().max_examples // 4``, say)."""
    from weight_sync_bench.fuzz.profiles import DEFAULT_PROFILE, profile_name

    if default < 1 or nightly < 1:
        raise ValueError(f"budget: {default=}, {nightly=}: a budget is at least one example")
    return default if profile_name() == DEFAULT_PROFILE else nightly

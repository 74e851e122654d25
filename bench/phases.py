"""Where the time goes: exclusive wall time per phase, by wrapping the functions that do it.

``Phases`` replaces attributes (a module's function, a class's method) with timing wrappers
for the length of a ``with`` block and restores them after, as ``bench_width.py overhead``
does. Time is exclusive: a wrapped call nested in another is taken out of the outer one's
bucket, so the buckets add up to the time spent inside any wrapped call, and the rest of a
measured span is what no wrapper covers. A bucket name may hold ``{scope}``, filled with the
innermost enclosing wrapper opened with ``scope=...`` (the same ``AdamW.step`` counts as the
reference's or the sharded run's). The wrappers cost about a microsecond a call: benches
time their ratios in runs without them and print the breakdown from a run of its own.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_INHERITED = object()  # restore by deleting the override: the attribute came from a base class


class Phases:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # time.thread_time: CPU time, steadier on a loaded machine
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._frames: list[list[Any]] = []  # [start, time in nested wrapped calls]
        self._scopes: list[str] = []
        self._patched: list[tuple[object, str, object]] = []

    def wrap_fn(self, fn: Callable[..., Any], bucket: str, *, scope: str | None = None
                ) -> Callable[..., Any]:
        """``fn`` timed into ``bucket`` (exclusive of nested wrapped calls)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if scope is not None:
                self._scopes.append(scope)
            frame = [self.clock(), 0.0]
            self._frames.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - frame[0]
                self._frames.pop()
                name = bucket.format(scope=self._scopes[-1] if self._scopes else "-")
                self.spent[name] += elapsed - frame[1]
                self.calls[name] += 1
                if self._frames:
                    self._frames[-1][1] += elapsed
                if scope is not None:
                    self._scopes.pop()

        return timed

    def wrap(self, owner: object, attr: str, bucket: str, *, scope: str | None = None) -> None:
        """Replace ``owner.attr`` by its timed version until ``restore``."""
        own = not isinstance(owner, type) or attr in owner.__dict__  # else inherited
        original = owner.__dict__[attr] if isinstance(owner, type) and own else getattr(owner, attr)
        self._patched.append((owner, attr, original if own else _INHERITED))
        fn = original.__func__ if isinstance(original, staticmethod) else original
        timed = self.wrap_fn(fn, bucket, scope=scope)
        setattr(owner, attr, staticmethod(timed) if isinstance(original, staticmethod) else timed)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._patched):
            if original is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._patched.clear()

    @contextmanager
    def active(self) -> Iterator[Phases]:
        try:
            yield self
        finally:
            self.restore()

    def total(self) -> float:
        return sum(self.spent.values())


def mean_phases(runs: list[Phases]) -> dict[str, float]:
    """Each bucket's mean over runs (0 where a run never entered it): means, so that the
    buckets still add up to the mean total."""
    names = {k for p in runs for k in p.spent}
    return {k: statistics.fmean(p.spent.get(k, 0.0) for p in runs) for k in names}


def side_by_side(columns: list[tuple[str, float, float, dict[str, float]]],
                 other: str = "other (outside every wrapped call)") -> str:
    """One row per phase, one column per case: ``(label, bare, total, spent)`` with each
    phase's seconds as a ratio to that case's ``bare``, largest first; then what no wrapper
    covered of ``total`` and ``total`` itself."""
    names = sorted({k for *_, spent in columns for k in spent},
                   key=lambda k: -max(spent.get(k, 0.0) / bare for _, bare, _, spent in columns))
    rows = [["phase"] + [label for label, *_ in columns]]
    for k in names:
        rows.append([k] + [f"{spent.get(k, 0.0) / bare:.3f}x" for _, bare, _, spent in columns])
    rows.append([other] + [f"{(total - sum(spent.values())) / bare:.3f}x"
                           for _, bare, total, spent in columns])
    rows.append(["total, wrapped"] + [f"{total / bare:.3f}x" for _, bare, total, _ in columns])
    return table(rows)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def hottest(fn: Callable[[], object], n: int) -> str:
    """cProfile's ``n`` hottest functions of ``fn()``, by own time."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return "\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip())

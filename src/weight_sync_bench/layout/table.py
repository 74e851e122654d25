"""``ShardSpec`` and ``LayoutTable``: the declared layout of a whole model, as data you can
print (``wsb layout``): each parameter, its full shape, its placement, its local shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.layout.placements import (
    Placement,
    Shape,
    index_ranges,
    local_shape,
)

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping


def _validate(placement: Placement, shape: Shape, degree: int, name: str) -> None:
    placement.validate(shape, degree, name)


def _index_ranges(placement: Placement, shape: Shape, degree: int, rank: int
                  ) -> tuple[int, tuple[tuple[int, int], ...]]:
    dim, ranges = index_ranges(placement, shape, degree, rank)
    return dim, tuple(ranges)


# ``placement.validate`` and ``index_ranges`` once per argument tuple: pure functions of frozen
# values, asked for every piece of every reshard (the fuzz asked ~100 times a pair). A
# rejection raises, so it is never cached: it is raised anew every time. The uncached
# functions are what mutation testing mutates (mutmut leaves decorated functions alone).
_validated = functools.lru_cache(maxsize=1 << 16)(_validate)
_ranges = functools.lru_cache(maxsize=1 << 16)(_index_ranges)


@dataclass(frozen=True)
class ShardSpec:
    """One parameter's declared layout: its full shape and its placement."""

    name: str
    shape: Shape
    placement: Placement

    def __post_init__(self) -> None:
        # a tuple, whatever sequence it was given as: the layout's lookups are cached by it
        object.__setattr__(self, "shape", tuple(self.shape))

    def validate(self, degree: int) -> None:
        _validated(self.placement, self.shape, degree, self.name)

    def local_shape(self, degree: int, rank: int = 0) -> Shape:
        """Rank ``rank``'s local shape (the same on every rank but under an uneven ``Experts``)."""
        self.validate(degree)
        return local_shape(self.placement, self.shape, degree, rank)

    def ranges(self, degree: int, rank: int) -> tuple[int, list[tuple[int, int]]]:
        """``index_ranges`` of rank ``rank`` at ``degree`` (the dim, its global ``[start,
        stop)`` ranges in order), computed once per (placement, shape, degree, rank); the
        list is the caller's own."""
        self.validate(degree)
        if not 0 <= rank < degree:
            raise UnsupportedLayout(f"{self.name}: rank {rank} is outside 0..{degree - 1} at t={degree}")
        dim, ranges = _ranges(self.placement, self.shape, degree, rank)
        return dim, list(ranges)


@dataclass(frozen=True)
class LayoutTable:
    """The declared layout of a whole model: parameter name -> ShardSpec, in forward order."""

    specs: tuple[ShardSpec, ...]

    @classmethod
    def from_mapping(cls, shapes: Mapping[str, Shape], placements: Mapping[str, Placement]
                     ) -> LayoutTable:
        return cls(tuple(ShardSpec(name, tuple(shape), placements[name])
                         for name, shape in shapes.items()))

    def __iter__(self) -> Iterator[ShardSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, name: str) -> ShardSpec:
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def validate(self, degree: int) -> None:
        """Raise the first parameter's UnsupportedLayout at this degree, if any."""
        for spec in self.specs:
            spec.validate(degree)

    def supports(self, degree: int) -> bool:
        try:
            self.validate(degree)
        except UnsupportedLayout:
            return False
        return True

    def supported_degrees(self, max_degree: int = 64) -> list[int]:
        """Every degree in 1..max_degree at which every placement validates (found by probing,
        never listed by hand; probed once per table and bound)."""
        return list(_supported_degrees(self, max_degree))

    def render(self, degrees: list[int] | None = None) -> str:
        """A table: each parameter, its full shape, its placement and its local shape at each
        degree (``-`` where the placement rejects that degree)."""
        degrees = degrees if degrees is not None else self.supported_degrees()
        header = ["parameter", "shape", "placement", *[f"t={t}" for t in degrees]]
        rows = [header]
        for spec in self.specs:
            cells = [spec.name, _shape_str(spec.shape), str(spec.placement)]
            for t in degrees:
                try:
                    cells.append(_shape_str(spec.local_shape(t)))
                except UnsupportedLayout:
                    cells.append("-")
            rows.append(cells)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                         for row in rows)

    def __str__(self) -> str:
        return self.render()


def _shape_str(shape: Shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _probe_degrees(table: LayoutTable, max_degree: int) -> tuple[int, ...]:
    return tuple(t for t in range(1, max_degree + 1) if table.supports(t))


# a table is frozen: what it supports never changes
_supported_degrees = functools.lru_cache(maxsize=1024)(_probe_degrees)


def clear_caches() -> None:
    """Forget every lookup this module cached. Tests call it before each test: mutmut forks
    each mutant's run from a process that ran the unmutated code, whose cached answers
    would otherwise stand in for the mutant's."""
    for cached in (_validated, _ranges, _supported_degrees):
        cached.cache_clear()

"""Which measured floor judges a check, and what the running environment changes about it.

``resolve_floor``: the floor that covers a geometry (``tolerance.rules.floor_for``), or,
when asked, one measured for it now and cached (``check.floor.measure_geometry``).
``environment_notes``: how the running environment differs from the one that floor was
measured in, named as a reader asks. ``Checker``, the streamed checks and the conversion
checks all read their threshold through these two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.check.floor import measure_geometry
from weight_sync_bench.check.forwards import Forward, inprocess_forward
from weight_sync_bench.errors import FloorNotMeasured
from weight_sync_bench.tolerance.rules import Floor, check_environment, floor_for

if TYPE_CHECKING:
    from weight_sync_bench.model.config import ModelConfig


def resolve_floor(config: ModelConfig, phase: str, dtype: str, *, measure: bool = False,
                  forward: Forward = inprocess_forward) -> Floor:
    """The floor covering a check (``floor_for``); with ``measure``, one measured for this
    geometry when none does (cached: the next check of it reads it)."""
    try:
        return floor_for(config, phase, dtype)
    except FloorNotMeasured:
        if not measure:
            raise
    measure_geometry(config, phase=phase, dtype=dtype,
                     forward=None if phase == "1a" else forward)
    return floor_for(config, phase, dtype)


def environment_notes(floor: Floor, config: ModelConfig, phase: str, dtype: str
                      ) -> tuple[str, ...]:
    """``check_environment``'s notes on the floor a check reads, named as a reader asks."""
    what = f"the phase {phase} floor" if dtype == "fp32" else f"the phase {phase} {dtype} floor"
    return check_environment(floor.artifact, what if floor.source == "committed"
                             else f"{what} of {config.name}")

"""``plain``: the harness's own convention, its parameter names and ``layout_for``'s placements.

``shards_for(config, "plain", t)`` is exactly ``split(init_params(config, seed),
layout_for(config), t)``, canonical vocabulary padding rows included (``vocab_multiple``):
``check_split`` and ``check_reshard`` check this convention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.conventions.convention import Convention, ForwardLayout
from weight_sync_bench.conventions.maps import Pieces, placed
from weight_sync_bench.model.plan import layout_for

if TYPE_CHECKING:
    from weight_sync_bench.model.config import ModelConfig


def _build(config: ModelConfig, degree: int) -> Pieces:
    layout = layout_for(config)
    layout.validate(degree)  # UnsupportedLayout naming the parameter and rule, as today
    return [{spec.name: placed(spec, degree, rank) for spec in layout} for rank in range(degree)]


def _reads(config: ModelConfig, degree: int) -> ForwardLayout:
    return ForwardLayout(config, layout_for(config))


PLAIN = Convention("plain", "the harness's names and layout_for's placements (fused [Q | K | V] "
                   "and [gate | up])", _build, _reads)

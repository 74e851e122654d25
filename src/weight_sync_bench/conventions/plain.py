"""``plain``: the harness's own convention, its parameter names and ``layout_for``'s placements.

``shards_for(config, "plain", t)`` is exactly ``split(init_params(config, seed),
layout_for(config), t)``, canonical vocabulary padding rows included (``vocab_multiple``):
``check_split`` and ``check_reshard`` check this convention. An MoE model's experts may be
placed over expert-parallel ranks (``plain:tp=4,ep=2``: ``Experts`` with ``ep`` 2 and the
contiguous order, expert-TP the rest of the degree, or ``etp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.conventions.convention import Convention, ForwardLayout, relaid
from weight_sync_bench.conventions.maps import Pieces, placed
from weight_sync_bench.layout.placements import Experts
from weight_sync_bench.model.plan import experts_placement, layout_for

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.layout.table import LayoutTable
    from weight_sync_bench.model.config import ModelConfig


def _layout(config: ModelConfig, at: Endpoint) -> LayoutTable:
    layout = layout_for(config)
    if at.ep == 1 and not at.etp:
        return layout
    return relaid(layout, {
        s.name: experts_placement(config, down=s.name.endswith("down.weight"), ep=at.ep,
                                  etp=at.etp)
        for s in layout if isinstance(s.placement, Experts)})


def _build(config: ModelConfig, at: Endpoint) -> Pieces:
    layout = _layout(config, at)
    layout.validate(at.degree)  # UnsupportedLayout naming the parameter and rule, as today
    return [{spec.name: placed(spec, at.degree, rank) for spec in layout}
            for rank in range(at.degree)]


def _reads(config: ModelConfig, at: Endpoint) -> ForwardLayout:
    return ForwardLayout(config, _layout(config, at))


PLAIN = Convention("plain", "the harness's names and layout_for's placements (fused [Q | K | V] "
                   "and [gate | up], experts side by side)", _build, _reads)

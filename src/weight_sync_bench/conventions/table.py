"""A convention's layout as a table you can print (for ``wsb layout --convention NAME``):
each stored name, the canonical parameter it is cut from, and at each degree its local shape
and the placement the framework's forward reads its source with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.layout.placements import HeadReplicated

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Convention, Endpoint
    from weight_sync_bench.model.config import ModelConfig


def render(config: ModelConfig, convention: Convention,
           degrees: list[int] | list[Endpoint] | None = None) -> str:
    """The table: ``stored name  source  t=1 ...`` (or one column per endpoint given, rank 0's
    shapes) with cells ``[rows, cols] placement`` (``-`` where the convention rejects the
    degree), then a legend line per placement that replicates, e.g. ``HR(8,2,32): Q heads
    split; rank r holds replicated KV head r*2/t``."""
    degrees = degrees if degrees is not None else convention.supported_degrees(config, 8)
    supported = [t for t in degrees if convention.supports(config, t)]
    if not supported and len(degrees) == 1:
        convention.pieces(config, degrees[0])  # UnsupportedConvention naming the rule
    if not supported:
        raise UnsupportedLayout(f"{convention.name}: {config.name} is stored at none of the "
                                f"degrees {[str(t) for t in degrees]}")
    names = {}  # every rank's names (a pipeline stage's ranks hold their stage's only)
    for rank in convention.pieces(config, supported[0]):
        for name, piece in rank.items():
            names.setdefault(name, piece)
    rows = [["stored name", "source", *[f"t={t}" if isinstance(t, int) else str(t)
                                        for t in degrees]]]
    legend: dict[str, str] = {}
    for name, piece in names.items():
        cells = [name, piece.source]
        for t in degrees:
            if t not in supported:
                cells.append("-")
                continue
            shape = next(rank[name] for rank in convention.local_shapes(config, t)
                         if name in rank)
            forward = convention.forward_layout(config, t)
            placement = forward.layout[piece.source].placement
            if isinstance(placement, HeadReplicated):
                legend[str(placement)] = (f"{placement}: Q heads split; rank r holds replicated "
                                          f"KV head r*{placement.n_kv_heads}/t")
            if piece.source in forward.gathered:
                legend["gathered"] = (
                    "gathered: the forward all-gathers these stored rows (raw row slices of "
                    "the grouped linear_qkv) over TP, then reads them as the placement says")
            cells.append(f"[{', '.join(str(s) for s in shape)}] {placement}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + list(legend.values()))


def render_ranks(config: ModelConfig, at: Endpoint) -> str:
    """Per rank of an endpoint: its coordinates (its pipeline stage and the global layers of
    each of its chunks, where staged; attention TP rank and data-parallel replica; the
    experts' EP, expert-TP and expert-DP ranks), the experts it holds (global ids, in its
    local order) and which rows of each expert's ``[gate | up]`` (columns of its
    down) it holds, e.g. for ``megatron:tp=2,ep=4`` of 8 experts of 128:
    ``2  0  1  1  0  0  2-3  gate 0-63, up 0-63``."""
    from weight_sync_bench.conventions.coordinates import rank_coordinates
    from weight_sync_bench.layout.placements import format_ranges, index_runs

    staged = at.staged
    world = (at.unstaged() if staged else at).world  # the ranks of one pipeline stage
    placement = at.convention.forward_layout(config, at).experts
    rows = [["rank", *(["pp", "layers (per chunk)"] if staged else []), "tp", "dp", "ep", "etp",
             "edp", "experts", "rows of each expert"]]
    f = config.expert_ffn
    for g in range(at.world):
        c = rank_coordinates(config, at, g)  # the one place coordinates are computed
        stage = [str(c.pp), " | ".join(format_ranges(index_runs(list(layers))) or "none"
                                       for layers in c.layers)] if staged else []
        cells = [str(g), *stage, str(c.tp), str(c.dp)]
        if placement is None:
            cells += ["-", "-", "-", "-", "-"]
        else:
            etp = placement.expert_tp(world)
            chunk = (c.etp * f // etp, (c.etp + 1) * f // etp)
            cells += [str(c.ep), str(c.etp), str(c.edp),
                      format_ranges(index_runs(list(c.experts))) or "none",
                      f"gate {format_ranges([chunk])}, up {format_ranges([chunk])}"]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

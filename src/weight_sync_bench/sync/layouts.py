"""One side of a sync: a model's rank-local tensors over a world of ranks, as index maps.

A ``SyncLayout`` is a storage convention at a TP degree (``megatron:4``, ``vllm:2``,
``hf``), optionally replicated over ``dp`` data-parallel groups (global rank
``dp_rank * degree + tp_rank``, TP fastest, as Megatron orders ranks), or FSDP-style
``fsdp:D``: every canonical parameter ``Shard(0)`` over D ranks, under the harness's names.
Each rank's tensors are ``conventions.Piece`` index maps of the canonical parameters.

Beside the maps, a layout *states* its replication in the harness's placement vocabulary
(``statement``: a ``LayoutTable`` whose placements say which canonical indices each rank
holds, e.g. ``Replicate`` norms, ``HeadReplicated`` KV heads, ``Shard(0)`` under FSDP), so
``boxes.validate_cover`` can check the maps against a declaration made independently of
them: bounds, no overlap except the stated replication, total volume.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weight_sync_bench.conventions import convention_by_name, endpoint
from weight_sync_bench.conventions.maps import Piece, placed
from weight_sync_bench.conventions.megatron import qkv_stored_rows
from weight_sync_bench.conventions.staging import stage_holds
from weight_sync_bench.errors import UnknownConvention, UnsupportedLayout
from weight_sync_bench.layout.placements import Shard
from weight_sync_bench.layout.table import LayoutTable

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from weight_sync_bench.conventions import Convention, Endpoint
    from weight_sync_bench.conventions.maps import Pieces
    from weight_sync_bench.model.config import ModelConfig

FSDP = "fsdp"


@dataclass(frozen=True, eq=False)
class SyncLayout:
    """A model's rank-local tensors over ``world = degree * dp`` ranks.

    ``pieces[rank]`` is ``{stored name: Piece}``; ``statement`` (canonical parameter names,
    at ``degree``) declares which canonical indices each TP (or FSDP) rank holds; ranks
    ``g * degree + r`` for ``g < dp`` hold TP rank r's tensors. ``convention`` is None for
    FSDP, which has no TP forward of its own."""

    label: str
    config: ModelConfig
    degree: int
    dp: int
    pieces: tuple[dict, ...]
    statement: LayoutTable
    convention: Convention | None
    endpoint: Endpoint | None = None  # a whole endpoint (``megatron:tp=2,pp=2,ep=2``)

    @property
    def world(self) -> int:
        return len(self.pieces)

    @property
    def replica(self) -> int:
        """The ranks of one data-parallel replica: the endpoint's world (TP, EP and pipeline
        stages), the degree for a ``name:degree`` layout."""
        return len(self.pieces) // self.dp

    @property
    def at(self) -> Endpoint | None:
        """The endpoint it is (a ``name:degree`` layout's at its degree; None for FSDP)."""
        if self.endpoint is not None:
            return self.endpoint
        return self.convention.at(self.degree) if self.convention is not None else None

    @property
    def runs_forward(self) -> bool:
        """Whether phase 2 runs its forward: a convention whose ranks are one TP group, each
        reading its own tensors (staged and expert-parallel endpoints, and Megatron's qkv
        gathered at t > n_kv_heads, are checked element by element only)."""
        at = self.at
        return (at is not None and not at.staged and at.world == at.degree
                and not at.convention.forward_layout(self.config, at).gathered)

    @functools.cached_property
    def parts(self) -> tuple[dict, ...]:
        """``pieces`` with every stacked tensor cut into its members: what phase 2 plans,
        moves and checks. A member of a stacked tensor (vLLM's fused-MoE ``w13_weight``
        ``[E_local, 2F/t, d]``: one local expert's rows) is a plain selection of its own,
        named ``{stored name}[{i}]``; ``members`` gives the views that address it."""
        return tuple({part: piece for name, stored in rank.items()
                      for part, piece in _members(name, stored)} for rank in self.pieces)

    def members(self, rank: int, tensors: Mapping[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        """``rank``'s stored ``tensors`` as ``parts``: a stacked tensor's member i is the view
        ``tensors[name][i]`` (writing it writes the stored tensor), any other tensor itself.
        Names the tensors lack are left out (a structure check reports them)."""
        out: dict[str, torch.Tensor] = {}
        for name, piece in (self.pieces[rank].items() if rank < self.world else ()):
            if name not in tensors:
                continue
            if not piece.is_stacked:
                out[name] = tensors[name]
            else:
                out.update((f"{name}[{i}]", tensors[name][i]) for i in range(piece.stack))
        return out

    @property
    def key(self) -> tuple[str, ModelConfig]:
        return (self.label, self.config)

    def tp_rank(self, rank: int) -> int:
        return rank % self.degree

    def stated_ranges(self, name: str, rank: int) -> tuple[int, list[tuple[int, int]]]:
        """``(dim, [(start, stop)])`` of canonical ``name`` that ``rank`` is stated to hold,
        clipped to the canonical shape (a convention's forward may pad the vocabulary)."""
        spec = self.statement[name]
        at = self.at
        if at is not None and name in at.convention.forward_layout(self.config, at).gathered:
            # stored as raw row slices the forward gathers (Megatron's qkv at t > n_kv_heads):
            # the statement is what each TP rank stores, once per replica and stage
            r = rank % self.replica
            inner = at.unstaged().world if at.staged else at.world
            held = (not at.staged) or stage_holds(self.config, at, name, r // inner)
            return 0, qkv_stored_rows(self.config, at.degree, r % inner % at.degree) if held else []
        if self.endpoint is None:
            dim, ranges = spec.ranges(self.degree, self.tp_rank(rank))
        else:  # the forward layout's placements over one stage's ranks, on their stage only
            at, r = self.endpoint, rank % self.replica
            inner = at.unstaged().world if at.staged else at.world
            dim, ranges = spec.ranges(inner, r % inner)
            if at.staged and not stage_holds(self.config, at, name, r // inner):
                ranges = []
        size = self.config.param_shapes()[name][dim]
        return dim, [(a, min(b, size)) for a, b in ranges if a < size]

    def __str__(self) -> str:
        return self.label


def sync_layout(config: ModelConfig, text: str, *, dp: int = 1) -> SyncLayout:
    """``"megatron:4"``, ``"vllm:2"``, ``"hf"`` (degree 1), ``"plain:2"``, ``"fsdp:4"`` or a whole
    endpoint (``"megatron:tp=2,pp=2,ep=2"``, ``"vllm:tp=4,ep=4"``), over
    ``dp`` data-parallel replicas (``dp`` > 1 labels it ``"megatron:4 x dp2"``). Cached: the
    same arguments give the same object, so plans cache on it. Raises ``UnsupportedLayout``
    (``UnsupportedConvention``) naming the rule where the layout cannot hold ``config``."""
    return _sync_layout(config, text, dp)


@functools.lru_cache(maxsize=256)
def _sync_layout(config: ModelConfig, text: str, dp: int) -> SyncLayout:
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise UnsupportedLayout(f"{text}: dp must be a positive int, got dp={dp!r}")
    name, sep, degree_text = text.partition(":")
    if "=" in degree_text:  # a whole endpoint: TP, EP, pipeline stages, options
        at = endpoint(text)
        label = str(at) + (f" x dp{dp}" if dp > 1 else "")
        pieces = at.pieces(config)
        statement = at.convention.forward_layout(config, at).layout
        return SyncLayout(label, config, at.degree, dp, tuple(pieces) * dp, statement,
                          at.convention, at)
    if sep and (not degree_text.isdigit() or int(degree_text) < 1):
        raise UnknownConvention(f"{text!r}: the degree after ':' must be a positive integer")
    degree = int(degree_text) if sep else 1
    label = text if sep else f"{name}:1"
    if dp > 1:
        label += f" x dp{dp}"
    if name == FSDP:
        statement = fsdp_table(config)
        statement.validate(degree)  # Shard(0) needs shape[0] % D == 0, naming the parameter
        pieces: Pieces = [{spec.name: placed(spec, degree, r) for spec in statement}
                          for r in range(degree)]
        return SyncLayout(label, config, degree, dp, tuple(pieces) * dp, statement, None)
    try:
        convention = convention_by_name(name)
    except UnknownConvention:
        raise UnknownConvention(f"unknown layout {name!r} in {text!r}; known: fsdp and the "
                                "conventions (plain, megatron, vllm, hf, meta)") from None
    pieces = convention.pieces(config, degree)
    statement = convention.forward_layout(config, degree).layout
    return SyncLayout(label, config, degree, dp, tuple(pieces) * dp, statement, convention)


def _members(name: str, piece: Piece) -> list[tuple[str, Piece]]:
    """A stored tensor as the plain selections phase 2 addresses: itself, or each member of
    a stacked one (``Piece.members``), named ``{name}[{i}]``."""
    if not piece.is_stacked:
        return [(name, piece)]
    return [(f"{name}[{i}]", member) for i, member in enumerate(piece.members())]


def fsdp_table(config: ModelConfig) -> LayoutTable:
    """FSDP-style sharding as a layout: every canonical parameter ``Shard(0)`` (dim-0 chunk r of
    D, FSDP2's ``fully_shard`` placement), under the harness's names. Uneven dim 0 is
    rejected, as every placement here is, rather than padded as FSDP2 pads it."""
    shapes = config.param_shapes()
    return LayoutTable.from_mapping(shapes, {name: Shard(0) for name in shapes})

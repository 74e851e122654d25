"""The training mesh: ``dp`` data-parallel replicas of ``cp`` context-parallel ranks of a
tensor-parallel group of degree ``tp``, with sequence parallelism on or off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective, InProcessGroups
from weight_sync_bench.errors import InvalidMesh
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.sharded import check_sequence_split

if TYPE_CHECKING:
    from weight_sync_bench.collectives.protocol import Collective


@dataclass(frozen=True)
class Mesh:
    """``dp`` data-parallel replicas, each ``cp`` context-parallel ranks of a tensor-parallel
    group of degree ``tp``; ``sp`` shards each TP group's residual stream along the sequence.

    One replica's ``cp * tp`` ranks sit at flat positions ``e = j * tp + r`` (CP rank j, TP
    rank r): TP groups are the rows ``{j * tp + r : r}``, CP groups the columns
    ``{j * tp + r : j}``.
    """

    dp: int
    tp: int
    sp: bool = False
    cp: int = 1

    def validate(self, config: ModelConfig, rows: int, seq_len: int | None = None) -> None:
        """Every size a positive int (never read as 1), then the rules of the batch, the
        layout and the sequence split."""
        for name in ("dp", "tp", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidMesh(f"{config.name}: {name} must be a positive int, "
                                  f"got {name}={value!r}")
        if not isinstance(self.sp, bool):
            raise InvalidMesh(f"{config.name}: sp must be a bool, got sp={self.sp!r}")
        if self.dp > rows:
            raise InvalidMesh(f"{config.name}: dp({self.dp}) > batch rows({rows}): "
                              "a data-parallel rank would hold no rows")
        layout_for(config).validate(self.tp)
        if seq_len is not None:
            check_sequence_split(config.name, seq_len, self.cp, self.tp, self.sp)

    @property
    def replica_size(self) -> int:
        """Ranks of one DP replica: ``cp * tp``."""
        return self.cp * self.tp

    def tp_groups(self) -> list[list[int]]:
        return [[j * self.tp + r for r in range(self.tp)] for j in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        return [[j * self.tp + r for j in range(self.cp)] for r in range(self.tp)]

    def row_blocks(self, rows: int) -> list[list[int]]:
        """DP rank d's rows: contiguous blocks, sizes differing by at most one."""
        return [block.tolist() for block in torch.arange(rows).tensor_split(self.dp)]

    def __str__(self) -> str:
        return (f"dp={self.dp} tp={self.tp}" + (" sp" if self.sp else "")
                + (f" cp={self.cp}" if self.cp > 1 else ""))


def mesh_groups(mesh: Mesh, collective: Callable[[int], Collective] = InProcessCollective
                ) -> tuple[Collective, Collective | None]:
    """One DP replica's TP group and CP group (None without CP), every rank in process.
    Without CP: ``collective(tp)``. With CP: the TP groups (one per CP rank) and the CP
    groups (one per TP rank), each side by side over the replica's flat positions."""
    if mesh.cp == 1:
        return collective(mesh.tp), None
    return InProcessGroups(mesh.tp_groups()), InProcessGroups(mesh.cp_groups())

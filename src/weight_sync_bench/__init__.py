"""weight-sync-bench: prove a tensor-parallel weight layout right by running it.

Reshard a model between TP degrees, run the sharded forward over real collectives and
compare it with the dense reference, within a tolerance derived from a measured floor.

The names below are imported on first use (PEP 562), so ``import weight_sync_bench`` stays
cheap and ``python -m weight_sync_bench.tolerance`` runs a module the package has not
already imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "weight_sync_bench.layout.reshard": ("gather", "reshard", "split"),
    "weight_sync_bench.check.checker": ("Checker", "Verdict", "check_reshard", "check_split",
                                        "checker_for", "sweep"),
    "weight_sync_bench.check.convert": ("check_convert", "verify_checkpoint"),
    "weight_sync_bench.check.stream": ("stream_check",),
    "weight_sync_bench.conventions": ("CONVENTIONS", "convert", "shards_for"),
    "weight_sync_bench.model.config": ("TOY", "TOY_KV4", "ModelConfig", "init_params",
                                       "make_tokens"),
    "weight_sync_bench.errors": ("CheckpointError", "InvalidConfig", "InvalidShards", "ToleranceMismatch",
                                 "UnknownConvention", "Unsupported", "UnsupportedConvention",
                                 "UnsupportedLayout", "WsbError", "FloorNotMeasured",
                                 "WrongUserShard"),
    "weight_sync_bench.model.reference": ("ReferenceModel",),
    "weight_sync_bench.collectives.protocol": ("Collective",),
    "weight_sync_bench.collectives.inprocess": ("InProcessCollective",),
    "weight_sync_bench.model.sharded": ("ShardedModel",),
    "weight_sync_bench.layout.placements": ("FusedPaired", "HeadPartitioned", "HeadReplicated",
                                            "Replicate", "Shard"),
    "weight_sync_bench.layout.table": ("LayoutTable", "ShardSpec"),
    "weight_sync_bench.model.plan": ("layout_for",),
    "weight_sync_bench.training.optimizer": ("AdamW",),
    "weight_sync_bench.training.mesh": ("Mesh",),
    "weight_sync_bench.training.step": ("TrainingCase",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'weight_sync_bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

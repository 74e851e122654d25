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

# Eager, and after any lazy path could run: importing the submodule ``reshard`` binds the
# package attribute ``reshard`` to the module, which this import rebinds to the function.
from weight_sync_bench.reshard import gather, reshard, split  # noqa: F401 (exported)

_EXPORTS = {
    "weight_sync_bench.check": ("Checker", "Verdict", "check_reshard", "check_split",
                                "checker_for", "sweep"),
    "weight_sync_bench.config": ("TOY", "TOY_KV4", "ModelConfig", "init_params", "make_tokens"),
    "weight_sync_bench.errors": ("InvalidConfig", "InvalidShards", "ToleranceMismatch",
                                 "UnsupportedLayout", "WsbError"),
    "weight_sync_bench.model": ("ReferenceModel",),
    "weight_sync_bench.sharded": ("Collective", "InProcessCollective", "ShardedModel"),
    "weight_sync_bench.shardspec": ("FusedPaired", "HeadPartitioned", "LayoutTable", "Replicate",
                                    "Shard", "ShardSpec", "layout_for"),
    "weight_sync_bench.training": ("AdamW", "Mesh", "TrainingCase"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted([*_MODULE_OF, "gather", "reshard", "split"])


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'weight_sync_bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""weight-sync-bench: prove a tensor-parallel weight layout right by running it.

Reshard a model between TP degrees, run the sharded forward over real collectives and
compare it with the dense reference, within a tolerance derived from a measured floor.
"""

from weight_sync_bench.check import (Checker, Verdict, check_reshard, check_split, checker_for,
                                     sweep)
from weight_sync_bench.config import TOY, TOY_KV4, ModelConfig, init_params, make_tokens
from weight_sync_bench.errors import (InvalidConfig, InvalidShards, ToleranceMismatch,
                                      UnsupportedLayout, WsbError)
from weight_sync_bench.model import ReferenceModel
from weight_sync_bench.reshard import gather, reshard, split
from weight_sync_bench.sharded import Collective, InProcessCollective, ShardedModel
from weight_sync_bench.shardspec import (FusedPaired, HeadPartitioned, LayoutTable, Replicate,
                                         Shard, ShardSpec, layout_for)
from weight_sync_bench.training import AdamW, Mesh, TrainingCase

__all__ = [
    "TOY", "TOY_KV4", "AdamW", "Checker", "Mesh", "TrainingCase", "Collective", "FusedPaired", "HeadPartitioned",
    "InProcessCollective", "InvalidConfig", "InvalidShards", "LayoutTable", "ModelConfig",
    "ReferenceModel", "Replicate", "Shard", "ShardSpec", "ShardedModel", "ToleranceMismatch",
    "UnsupportedLayout", "Verdict", "WsbError", "check_reshard", "check_split", "checker_for", "gather",
    "init_params", "layout_for", "make_tokens", "reshard", "split", "sweep",
]

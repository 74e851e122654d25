"""Users' distributed resharders, for the tests: module-level, so the rank processes can
import them by reference."""

from __future__ import annotations

import torch

from weight_sync_bench.sync import execute_plan


def flip_one_bit(ctx, rank, local, plan):
    """The harness's executor, then the lowest mantissa bit of one element flipped on rank 0."""
    out = execute_plan(ctx, rank, local, plan)
    if rank == 0:
        name = next(n for n, p in plan.dst.pieces[0].items() if p.source.endswith("qkv.weight"))
        out[name].view(-1).view(torch.int32)[5] ^= 1
    return out


def drops_a_name(ctx, rank, local, plan):
    out = execute_plan(ctx, rank, local, plan)
    if rank == 0:
        out.pop(next(iter(out)))
    return out


def raises(ctx, rank, local, plan):
    raise ValueError(f"rank {rank} cannot reshard {plan.label}")

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


def returns_fresh_tensors(ctx, rank, local, plan):
    """Ignores ``ctx.destination``: the harness's executor into storage of its own."""
    destination, ctx.destination = ctx.destination, None
    out = execute_plan(ctx, rank, local, plan)
    assert destination is None or all(out[n].data_ptr() != x.data_ptr()
                                      for n, x in destination.items())
    return out


def insists_on_in_place(ctx, rank, local, plan):
    """The harness's executor, refusing to return unless it wrote into ``ctx.destination``."""
    if rank < plan.dst.world and not ctx.destination:
        raise AssertionError(f"rank {rank}: no existing destination storage in ctx")
    destination = dict(ctx.destination or {})
    out = execute_plan(ctx, rank, local, plan)
    moved = [n for n, x in destination.items() if out[n].data_ptr() != x.data_ptr()]
    if moved:
        raise AssertionError(f"rank {rank}: {', '.join(moved)} not written in place")
    return out


def insists_on_the_cached_cut(ctx, rank, local, plan):
    """The harness's executor, refusing to run unless the plan arrived with its cut into
    messages for this bucket and its local runs already made (by the session, outside the
    timed region)."""
    if ctx.bucket_bytes not in plan._messages:
        raise AssertionError(f"rank {rank}: the plan's messages for bucket {ctx.bucket_bytes} "
                             "would be cut inside the timed region")
    if rank not in plan._local:
        raise AssertionError(f"rank {rank}: the plan's local runs would be made inside the "
                             "timed region")
    return execute_plan(ctx, rank, local, plan)

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


def flip_one_bit_on_the_last_rank(ctx, rank, local, plan):
    """``flip_one_bit`` on the destination's last rank, in the last element of its first
    tensor: a verdict computed from rank 0 alone would miss it."""
    out = execute_plan(ctx, rank, local, plan)
    if rank == plan.dst.world - 1:
        name = next(iter(plan.dst.pieces[rank]))
        out[name].view(-1).view(torch.int32)[-1] ^= 1
    return out


def negative_zero_on_the_last_rank(ctx, rank, local, plan):
    """The harness's executor, then ``-0.0`` written over one ``+0.0`` the last rank must
    hold (a padding row): equal in value, not in bytes. Raises where that rank holds no
    zero, so the test cannot pass by having nothing to corrupt."""
    out = execute_plan(ctx, rank, local, plan)
    if rank == plan.dst.world - 1:
        for x in out.values():
            flat = x.view(-1)
            zeros = ((flat == 0) & ~torch.signbit(flat)).nonzero()
            if len(zeros):
                flat[zeros[-1, 0]] = -0.0
                return out
        raise AssertionError(f"rank {rank} holds no +0.0 to corrupt")
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


def read_from_checkpoint(ctx, rank, local, plan, *, directory, seed=None):
    """No data movement: each destination rank reads its declared tensors straight from the
    checkpoint ``directory`` (or, given ``seed``, from ``init_params`` of that seed), float32:
    right exactly when the session moves that checkpoint's weights."""
    from weight_sync_bench.conventions.checkpoint import read_weights
    from weight_sync_bench.conventions.maps import materialize
    from weight_sync_bench.model.config import init_params

    if rank >= plan.dst.world:
        return {}
    config = plan.dst.config
    source = (init_params(config, seed) if seed is not None
              else {n: x.float() for n, x in read_weights(directory, config).items()})
    return materialize([plan.dst.pieces[rank]], source)[0]

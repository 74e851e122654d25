"""GlooTransport delivers exactly the declared split, and refuses wrong shards by name.

Data movement is compared bit for bit (int32 views of the fp32 bytes), never with a
tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.breadth import breadth
from weight_sync_bench.check.forwards import run_phase1b
from weight_sync_bench.collectives.gloo.pool import shared_pool
from weight_sync_bench.collectives.gloo.transport import (
    ParamSink,
    SyncRecord,
    Transport,
)
from weight_sync_bench.errors import InvalidShards, WrongShardShape
from weight_sync_bench.layout.reshard import split, validate_shards
from weight_sync_bench.model.config import TOY, TOY_KV4, init_params
from weight_sync_bench.model.plan import layout_for


def first_bit_difference(got, want):
    """The first (rank, parameter, flat index) whose bits differ, or None."""
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.keys() != w.keys():
            return rank, sorted(g.keys() ^ w.keys()), None
        for name in w:
            a, b = g[name].view(torch.int32).flatten(), w[name].view(torch.int32).flatten()
            if a.shape != b.shape:
                return rank, name, None
            diff = (a != b).nonzero()
            if len(diff):
                return rank, name, int(diff[0])
    return None


# TOY_KV4 at t=4 by default, the most ranks, every rank's shards a cut; the long run adds
# TOY at t=2 and TOY_KV4 at t=1 (by default the degree-2 transport is also checked bit for
# bit by test_callers_shards_arrive_unchanged)
@pytest.mark.parametrize(("config", "degree"), breadth(
    [(TOY, 2), (TOY_KV4, 4), (TOY_KV4, 1)], keep={"toy_kv4 t=4"},
    name=lambda case: f"{case[0].name} t={case[1]}"))
def test_received_bytes_equal_the_declared_split_bit_for_bit(config, degree):
    result = run_phase1b(config, degree, param_seed=11, token_seed=0, pool=shared_pool(4),
                         return_shards=True)
    want = split(init_params(config, 11), layout_for(config), degree)
    assert first_bit_difference(result.shards, want) is None
    # Not vacuous: one ULP in one element of one rank's shard is found.
    bumped = [dict(params) for params in result.shards]
    name = layout_for(config).names[-1]
    x = bumped[degree - 1][name].clone()
    x.view(torch.int32).view(-1)[5] += 1
    bumped[degree - 1][name] = x
    assert first_bit_difference(bumped, want) == (degree - 1, name, 5)


def test_callers_shards_arrive_unchanged():
    """``shards=``: the caller's rank-local dicts (here: another seed's split) reach the
    ranks as they are; the transport does not re-derive them from the seed."""
    theirs = split(init_params(TOY_KV4, 12), layout_for(TOY_KV4), 2)
    result = run_phase1b(TOY_KV4, 2, param_seed=11, token_seed=0, pool=shared_pool(4),
                         shards=theirs, return_shards=True)
    assert first_bit_difference(result.shards, theirs) is None
    assert first_bit_difference(result.shards, split(init_params(TOY_KV4, 11),
                                                      layout_for(TOY_KV4), 2)) is not None


def test_sync_records_count_every_parameter_of_every_rank():
    result = run_phase1b(TOY, 2, param_seed=0, token_seed=0, pool=shared_pool(4))
    layout = layout_for(TOY)
    assert [r.rank for r in result.records] == [0, 1]
    for record in result.records:
        assert isinstance(record, SyncRecord)
        assert [p.name for p in record.params] == layout.names
        assert [p.nbytes for p in record.params] == [
            4 * torch.Size(spec.local_shape(2)).numel() for spec in layout]
        assert record.total_seconds > 0
    assert sum(r.total_bytes for r in result.records) == 4 * TOY.n_params + 4 * (
        2 * TOY.d_model * TOY.n_layers + TOY.d_model)  # replicated norms arrive twice


def _shards(config, degree):
    return split(init_params(config, 0), layout_for(config), degree)


def _short(shards, rank, name):
    shards[rank][name] = shards[rank][name][:-1]
    return shards


def _as_double(shards, rank, name):
    shards[rank][name] = shards[rank][name].double()
    return shards


def _drop(shards, rank, name):
    del shards[rank][name]
    return shards


@pytest.mark.parametrize(("spoil", "error", "message"), [
    # One row short: the case gloo would meet with a C++ abort.
    (lambda s: _short(s, 1, "layers.0.qkv.weight"), WrongShardShape,
     r"rank 1 layers.0.qkv.weight: shape \[255, 256\], declared \[256, 256\] "
     r"\(HP\(8,4,32\) at t=2\)"),
    # Right shape, wrong dtype: the byte counts would disagree just the same.
    (lambda s: _as_double(s, 0, "norm.weight"), WrongShardShape,
     r"rank 0 norm.weight: dtype torch.float64, expected torch.float32"),
    (lambda s: _drop(s, 1, "lm_head.weight"), InvalidShards, r"rank 1: missing lm_head.weight"),
    (lambda s: s[:1], InvalidShards, r"expected 2 rank dicts at t=2, got 1"),
])
def test_wrong_shards_are_named_before_any_rank_sees_them(spoil, error, message):
    with pytest.raises(error, match=message):
        validate_shards(spoil(_shards(TOY_KV4, 2)), layout_for(TOY_KV4), 2)
    with pytest.raises(error, match=message):  # run_phase1b checks before a rank starts
        run_phase1b(TOY_KV4, 2, param_seed=0, token_seed=0, pool=None,
                    shards=spoil(_shards(TOY_KV4, 2)))


def test_correct_shards_pass_the_shape_check():
    validate_shards(_shards(TOY_KV4, 2), layout_for(TOY_KV4), 2)


def test_a_sink_refuses_a_parameter_twice():
    sink = ParamSink()
    sink.receive("norm.weight", torch.ones(2))
    with pytest.raises(InvalidShards, match="norm.weight: received twice"):
        sink.receive("norm.weight", torch.ones(2))


def test_gloo_transport_is_a_transport():
    from weight_sync_bench.collectives.gloo.breadcrumbs import Tracer
    from weight_sync_bench.collectives.gloo.rank import RankContext
    from weight_sync_bench.collectives.gloo.transport import GlooTransport

    ctx = RankContext(rank=0, degree=1, group=None, tracer=Tracer(0))
    assert isinstance(GlooTransport(ctx, layout_for(TOY)), Transport)

"""A streamed check over gloo (``check.stream.stream_task``): rank 0 draws each stage,
steps the reference, calls the user's function and compares its bytes; ``GlooTransport``
scatters the stage's shards; every rank steps the sharded forward on its own shards of one
stage at a time. Its verdict is the in-process streamed one's (bytes exactly, logits within
the phase 1b floor); a wrong shard is found and named; a raising fn is the user's error;
each rank's memory high-water mark comes back."""

from __future__ import annotations

import pytest
import torch

from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import TOY
from weight_sync_bench.check.checker import check_split
from weight_sync_bench.check.stream import stage_split, stream_check, stream_run
from weight_sync_bench.collectives.gloo.pool import shared_pool
from weight_sync_bench.errors import UserCodeError
from weight_sync_bench.model.plan import layout_for

SPLIT = stage_split(layout_for(TOY))
# TOY over a 512-word vocabulary, for the checks that do not read TOY's committed floor or
# weigh its memory: a fifth of the bytes to draw, scatter and compare; an explicit
# threshold judges it (100x what its declared shards deviate by over gloo, 1e-6).
NARROW = narrowed(TOY)
NARROW_SPLIT = stage_split(layout_for(NARROW))


def _touch(ctx, *, nbytes):
    torch.ones(nbytes // 4).sum()


def _declared(full, degree):  # module level: rank 0 imports it by reference
    return SPLIT(full, degree)


def _narrow_declared(full, degree):
    return NARROW_SPLIT(full, degree)


def _swaps_gate_and_up(full, degree):
    out = NARROW_SPLIT(full, degree)
    name = "layers.2.gate_up.weight"
    if name in out[1]:
        out[1][name] = out[1][name].roll(out[1][name].shape[0] // 2, 0)  # [up_1 | gate_1]
    return out


def _raises(full, degree):
    if "layers.1.qkv.weight" in full:
        raise KeyError("their bug")
    return NARROW_SPLIT(full, degree)


def test_streamed_over_gloo_is_the_in_process_verdict_and_reports_each_ranks_memory():
    big = torch.ones(40 << 20)  # 160 MiB on rank 0 of the pool, before: not this check's
    shared_pool(4).run(_touch, 2, kwargs={"nbytes": big.nbytes})
    verdict, rss = stream_run(TOY, 2, fn=_declared, per="parameter", backend="gloo",
                              pool=shared_pool(4))
    here = stream_check(TOY, 2, fn=_declared, per="parameter")
    assert verdict.passed and verdict.first_mismatch is None
    assert verdict.threshold > 0 and verdict.max_abs_error <= verdict.threshold
    assert abs(verdict.max_abs_error - here.max_abs_error) <= verdict.threshold
    assert len(rss) == 2 and all(0 < began <= peak for began, peak in rss)
    largest = TOY.padded_vocab * TOY.d_model * 4  # the embedding
    # one stage's shards at a time: rank 1 far under the model (TOY's is ~100 MB), and
    # neither rank reports the 160 MiB of the task before (the high-water mark was reset)
    assert rss[1][1] - rss[1][0] < 2 * largest
    assert all(peak - began < big.nbytes for began, peak in rss)


def test_a_wrong_shard_streamed_over_gloo_is_named_and_its_twin_passes():
    pool = shared_pool(4)
    wrong = stream_check(NARROW, 2, fn=_swaps_gate_and_up, per="layer", backend="gloo",
                         pool=pool, threshold=THRESHOLD)
    assert not wrong.passed and wrong.first_mismatch == "layers.2.gate_up.weight"
    assert wrong.diagnosis and "rank 1 layers.2.gate_up.weight" in wrong.diagnosis[0]
    assert wrong.max_abs_error > wrong.threshold  # the gloo forward sees it too
    assert check_split(_narrow_declared, NARROW, 2, backend="gloo", stream="layer",
                       threshold=THRESHOLD).passed


def test_a_user_function_raising_on_rank_0_is_their_error_and_the_pool_survives():
    pool = shared_pool(4)
    pool.start()
    pids = pool.pids
    with pytest.raises(UserCodeError, match="_raises") as caught:
        stream_check(NARROW, 2, fn=_raises, per="layer", backend="gloo", pool=pool,
                     threshold=THRESHOLD)
    assert "their bug" in str(caught.value)
    assert pool.pids == pids
    assert stream_check(NARROW, 2, fn=_narrow_declared, backend="gloo", pool=pool,
                        threshold=THRESHOLD).passed


def test_a_function_rank_0_cannot_import_is_refused_before_any_rank_runs():
    with pytest.raises(TypeError, match="picklable by reference"):
        stream_check(TOY, 2, fn=lambda full, degree: SPLIT(full, degree), backend="gloo")
    with pytest.raises(ValueError, match="backend='nccl'"):
        stream_check(TOY, 2, backend="nccl")


def test_a_reshard_streamed_over_gloo_passes():
    verdict = stream_check(TOY, 2, src=1, per="parameter", backend="gloo")
    assert verdict.passed and verdict.src == 1
    assert torch.isfinite(torch.tensor(verdict.max_abs_error))

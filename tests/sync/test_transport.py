"""Counted at the transport, not taken from the plan: over a matrix of layout pairs the bytes
the ranks' ``CountingP2P`` sent equal ``B_min`` exactly, every destination element is
bit-exact without a gather, and the executor's staging stays within two buckets. The naive
gather-then-scatter, run through the same harness, moves what ``naive_bytes`` says."""

from __future__ import annotations

import pytest

from tests.breadth import breadth
from tests.sync.conftest import tiny
from weight_sync_bench.sync import SyncSession, gather_scatter

BUCKET = 4096  # small: messages pack several segments and transfers split across messages
MATRIX = (
    [(tiny(4), f"plain:{a}", f"plain:{b}", 1) for a in (1, 2, 4) for b in (1, 2, 4)]
    + [(tiny(1), "megatron:1", "vllm:4", 1), (tiny(2), "megatron:2", "vllm:4", 1),
       (tiny(8), "megatron:4", "vllm:2", 1), (tiny(2), "vllm:4", "megatron:2", 1)]
    + [(tiny(4), "fsdp:4", "vllm:2", 1), (tiny(4), "fsdp:2", "megatron:4", 1)]
    + [(tiny(4), "megatron:2", "vllm:4", 2), (tiny(4), "megatron:1", "vllm:2", 4)]
    + [(tiny(4), "megatron:4", "vllm:2", 1), (tiny(4), "megatron:2", "meta:2", 1),
       (tiny(4), "meta:2", "megatron:2", 1), (tiny(4), "hf", "vllm:4", 1)]
)


def _id(case):
    config, a, b, dp = case
    return f"{config.name}-{a}{'x' + str(dp) if dp > 1 else ''}-{b}"


# By default 14 of the 21 pairs: of plain TP a -> b, a cycle that has every degree at each end
# (1 -> 2, 2 -> 4, 4 -> 1) and a layout onto itself (2 -> 2: only local copies); every KV
# replication pair and every convention pair; one FSDP source (fsdp:4 -> vllm:2) and one
# data-parallel one (megatron:2x2 -> vllm:4, the naive twin's). The other plain pairs,
# fsdp:2 -> megatron:4 and megatron:1x4 -> vllm:2 (0.05-0.1 s each) in the long run; the
# planner's bytes on every pair are tests/sync/test_planner.py's, by default.
TRANSPORT_DEFAULT = {"tiny_kv4-plain:1-plain:2", "tiny_kv4-plain:2-plain:4",
                     "tiny_kv4-plain:4-plain:1", "tiny_kv4-plain:2-plain:2",
                     "tiny_kv1-megatron:1-vllm:4", "tiny_kv2-megatron:2-vllm:4",
                     "tiny_kv8-megatron:4-vllm:2", "tiny_kv2-vllm:4-megatron:2",
                     "tiny_kv4-fsdp:4-vllm:2", "tiny_kv4-megatron:2x2-vllm:4",
                     "tiny_kv4-megatron:4-vllm:2", "tiny_kv4-megatron:2-meta:2",
                     "tiny_kv4-meta:2-megatron:2", "tiny_kv4-hf-vllm:4"}


@pytest.mark.parametrize("case", breadth([pytest.param(c, id=_id(c)) for c in MATRIX],
                                         keep=TRANSPORT_DEFAULT, name=lambda p: p.id))
def test_bytes_counted_at_the_transport_equal_b_min_and_every_element_is_exact(case, pool):
    config, a, b, dp = case
    with SyncSession(config, a, b, dp=dp, pool=pool, forward=False) as session:
        result = session.run(bucket_bytes=BUCKET)
        assert result.bytes_moved == result.b_min, result.summary()
        assert sum(r.received for r in result.ranks) == result.b_min
        assert result.elements_passed and result.coverage == 1.0, result.summary()
        assert all(r.staging_peak <= 2 * BUCKET for r in result.ranks)
        if (a, b) == ("megatron:2", "vllm:4"):
            naive = session.run(gather_scatter, bucket_bytes=BUCKET)
            assert naive.bytes_moved == naive.naive and naive.elements_passed


def test_the_matrix_covers_tp_pairs_fsdp_dp_replication_kv_heads_and_conventions():
    ids = {_id(c) for c in MATRIX}
    assert {f"tiny_kv4-plain:{a}-plain:{b}" for a in (1, 2, 4) for b in (1, 2, 4)} <= ids
    assert {"tiny_kv1-megatron:1-vllm:4", "tiny_kv2-megatron:2-vllm:4", "tiny_kv8-megatron:4-vllm:2",
            "tiny_kv4-fsdp:4-vllm:2", "tiny_kv4-megatron:2x2-vllm:4",
            "tiny_kv4-megatron:2-meta:2"} <= ids

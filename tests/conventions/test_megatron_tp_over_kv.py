"""Megatron-Core with TP greater than the KV heads (Megatron-LM PR #2565, commit f7dfb99795):
each rank keeps a raw 1/t row slice of the grouped ``linear_qkv`` (no whole group), and the
forward all-gathers ``mixed_qkv`` over TP and reads group ``rank // (t / ng)``: Qwen3-MoE's 4
KV heads at TP 8. The harness stores it, reads it as the framework does (across the TP group),
judges it by the replicated-KV cells of the floor (the same forward), and moves it in phase 2."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.check.convert import check_convert
from weight_sync_bench.check.floor import REPLICATED_KV, forward_of
from weight_sync_bench.conventions import convert, endpoint, shards_for
from weight_sync_bench.conventions.megatron import grouped_qkv_order
from weight_sync_bench.errors import UnsupportedConvention
from weight_sync_bench.model.config import TOY, init_params
from weight_sync_bench.sync import SyncSession

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def test_each_rank_holds_a_raw_slice_of_the_grouped_rows():
    full = init_params(TOY, 0)["layers.0.qkv.weight"]
    grouped = full[grouped_qkv_order(TOY.n_heads, TOY.n_kv_heads, TOY.head_dim)]
    shards = shards_for(TOY, "megatron:4")  # 2 groups of [q x4, k, v] over 4 ranks
    for r in range(4):
        assert torch.equal(shards[r][QKV], grouped[r * 96:(r + 1) * 96])
    # rank 1: the last Q head of group 0, then K_0 and V_0: no rank holds a whole group
    hd = TOY.head_dim
    assert torch.equal(shards[1][QKV][:hd], full[3 * hd:4 * hd])
    assert torch.equal(shards[1][QKV][hd:2 * hd], full[TOY.q_rows:TOY.q_rows + hd])


def test_the_rules():
    with pytest.raises(UnsupportedConvention, match=r"t % n_kv_heads == 0.*n_kv_heads=2, t=3"):
        shards_for(TOY.replace(n_heads=6), "megatron:3")
    assert forward_of("megatron", TOY, endpoint("megatron:4")) == REPLICATED_KV
    assert forward_of("megatron", TOY, endpoint("megatron:2")) != REPLICATED_KV


@pytest.mark.parametrize(("src", "dst"), [("hf", "megatron:4"), ("megatron:8", "vllm:4"),
                                          ("megatron:tp=4,pp=2", "hf")])
def test_conversions_through_it_pass(src, dst, tolerance):
    verdict = check_convert(lambda shards, t: convert(shards, src, dst, TOY), TOY, src, dst)
    assert verdict.passed, verdict


def test_the_forward_reads_other_ranks_slices(tolerance):
    # rank 1 holds K_0 and V_0, which ranks 0 and 1 both read: a wrong K_0 row there moves
    # the logits of rank 0's heads too (the forward gathers; it does not read rank 1 alone)
    def wrong_k0(shards, t):
        out = convert(shards, "hf", "megatron:4", TOY)
        w = out[1][QKV].clone()
        w[TOY.head_dim] += 1.0  # the first row of K_0, on rank 1
        out[1][QKV] = w
        return out

    verdict = check_convert(wrong_k0, TOY, "hf", "megatron:4")
    assert not verdict.passed and verdict.ratio > 10, verdict
    assert verdict.first_mismatch == QKV


# TOY's 8 query and 2 KV heads at width 64, one layer, vocabulary 256: phase 2 into the raw
# slices is index bookkeeping, the same at any width (megatron:4 runs no forward, as the note
# says); TOY's 19M parameters made it 1.4 s.
NARROW = TOY.replace(name="toy_narrow", vocab=256, d_model=64, head_dim=8, ffn=128, n_layers=1)


def test_phase_2_moves_it_and_checks_every_element():
    with SyncSession(NARROW, "vllm:4", "megatron:4") as session:
        result = session.run()
    assert result.passed and result.bytes_moved == result.b_min
    assert result.verdict is None and any("no forward" in n for n in result.notes)

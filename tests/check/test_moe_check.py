"""Checking an MoE model: the routing check's two promises (no false positive from near-tied
router scores, and the selection still checked where it is not near-tied), a streamed MoE
conversion's verdict equal to the whole model's, an MoE destination's forward over gloo, and
what the checks refuse."""

from __future__ import annotations

import math

import pytest
import torch

from tests.breadth import breadth
from tests.check.narrow import narrowed
from weight_sync_bench import check_convert
from weight_sync_bench.check.checker import Checker
from weight_sync_bench.check.convert import measure_threshold, stage_convert
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.model.config import TOY, TOY_MOE, TOY_MOE_DS, init_params
from weight_sync_bench.model.sharded import RoutingGuard

# One expert of two per token, the two routers' rows about to tie: every token's choice is
# within the last bits of flipping.
TIED = TOY.replace(name="tied_router", vocab=256, d_model=64, n_heads=4, n_kv_heads=4,
                   head_dim=16, ffn=96, n_layers=2, seq_len=32, n_experts=2, top_k=1,
                   expert_ffn=64)


def _nearly_tied(scale):
    """TIED's weights with router row 1 = row 0 + scale x noise in every layer."""
    params = init_params(TIED, 0)
    for i in range(TIED.n_layers):
        w = params[f"layers.{i}.router.weight"]
        noise = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(i))
        w[1] = w[0] + scale * noise
    return params


def test_near_tied_routing_is_no_false_positive_and_would_be_without_the_routing_check():
    """Correct shards, every token near-tied: the sharded forward's last-bit differences flip
    choices, and a check comparing its own selection everywhere (bound 0) fails them by
    O(1e-2), hundreds of times the threshold. The routing check keeps the reference's choice
    where the margin is within the bound (the threshold) and passes, counting the ties."""
    threshold = measure_threshold(TIED, [endpoint(f"plain:{t}") for t in (1, 2, 4)])
    false_positives = 0
    for scale in (1e-8, 1e-7, 1e-6):
        checker = Checker(TIED, params=_nearly_tied(scale), threshold=threshold)
        assert checker.guard is not None and checker.guard.bound == threshold
        assert checker.guard.near_ties() == (TIED.n_layers * TIED.batch * TIED.seq_len,) * 2
        for degree in (2, 4):
            shards = checker.declared(degree)
            verdict = checker.verdict(shards, src=1, dst=degree)
            assert verdict.passed and verdict.near_ties == checker.guard.near_ties(), str(verdict)
            unguarded = RoutingGuard(checker.guard.routings, 0.0)  # own choice everywhere
            error = checker.deviation(checker.forward(TIED, shards, checker.tokens,
                                                      guard=unguarded))
            false_positives += error > threshold
    # Non-vacuous on this machine: some flip happened (every scale and degree, measured: 3e-2
    # to 6e-2 against 1e-4), so the guard had something to absorb.
    assert false_positives >= 1


def test_a_token_far_from_a_tie_is_routed_by_the_sharded_forward_itself():
    """The guard keeps the reference's choice only where near-tied: with the rows apart
    (margins far above the bound), a sharded rank that chose other experts is seen."""
    checker = Checker(TIED, params=_nearly_tied(1.0), threshold=1e-4)
    assert checker.guard is not None
    near, total = checker.guard.near_ties()
    assert near < total // 4
    own = torch.zeros(total // TIED.n_layers, 1, dtype=torch.long)
    chosen = checker.guard.choice(0, own)
    far = ~checker.guard.near(0)
    assert torch.equal(chosen[far], own[far])  # the sharded rank's own, even where it is wrong
    assert torch.equal(chosen[~far], checker.guard.routings[0].experts[~far])


STREAMED = ("megatron:tp=2,ep=4", "vllm:tp=4,ep=4")
EMBEDDING = "embedding.word_embeddings.weight"


@pytest.fixture(scope="module")
def streamed_per_parameter():
    """The streamed check per parameter of the harness's conversion ``STREAMED``, and the
    embedding's source tensors on each of the 8 source ranks as ``fn`` was given them (each
    time it was): shared by the two tests below."""
    src, dst = STREAMED
    seen = []

    def spy(shards, degree):
        if EMBEDDING in shards[0]:
            seen.append([shards[r][EMBEDDING] for r in range(8)])
        return stage_convert(src, dst, TOY_MOE)(shards, degree)
    return check_convert(spy, TOY_MOE, src, dst, stream="parameter"), seen


@pytest.mark.parametrize("per", breadth(["layer", "parameter"], keep={"parameter"}))
def test_a_streamed_moe_conversion_gives_the_whole_model_verdict(per, request):
    src, dst = STREAMED
    whole = check_convert(stage_convert(src, dst, TOY_MOE), TOY_MOE, src, dst)
    streamed = (request.getfixturevalue("streamed_per_parameter")[0] if per == "parameter"
                else check_convert(stage_convert(src, dst, TOY_MOE), TOY_MOE, src, dst,
                                   stream=per))
    assert whole.passed and streamed.passed
    assert (streamed.max_abs_error, streamed.threshold, streamed.near_ties, streamed.route) == (
        whole.max_abs_error, whole.threshold, whole.near_ties, whole.route)
    name = "model.layers.1.mlp.experts.routed_experts.w13_weight"

    def wrong(shards, degree):  # the twin: rank 3's experts' gate and up exchanged
        out = stage_convert(src, dst, TOY_MOE)(shards, degree)
        if name in out[3]:
            w = out[3][name]
            out[3][name] = torch.cat([w[:, w.shape[1] // 2:], w[:, :w.shape[1] // 2]], dim=1)
        return out
    failed = check_convert(wrong, TOY_MOE, src, dst, stream=per)
    assert not failed.passed and failed.first_mismatch == name and failed.ratio > 10


def test_an_moe_destination_runs_over_gloo_one_process_per_rank():
    """Phase 1b: vLLM's EP-2 forward, one process per rank, its dispatch over gloo's
    collectives; judged by an explicit threshold (no phase 1b floor of an MoE geometry is
    committed)."""
    src, dst = "hf", "vllm:tp=2,ep=2"
    inprocess = check_convert(stage_convert(src, dst, TOY_MOE_DS), TOY_MOE_DS, src, dst)
    gloo = check_convert(stage_convert(src, dst, TOY_MOE_DS), TOY_MOE_DS, src, dst,
                         backend="gloo", threshold=inprocess.threshold)
    assert gloo.passed and gloo.phase == "1b" and gloo.near_ties == inprocess.near_ties
    assert gloo.max_abs_error <= inprocess.threshold / 100


def test_a_gloo_forward_of_an_endpoint_with_data_parallel_replicas_is_refused():
    # megatron:tp=2,ep=4 holds four replicas of the TP-2 dense layers: no gloo forward yet
    # (TOY_MOE over a 512-word vocabulary: the refusal does not depend on it)
    narrow = narrowed(TOY_MOE)
    with pytest.raises(UnsupportedLayout, match="4 data-parallel replicas of TP 2 .* in process"):
        check_convert(stage_convert("hf", "megatron:tp=2,ep=4", narrow), narrow, "hf",
                      "megatron:tp=2,ep=4", backend="gloo", threshold=math.inf)


def test_a_streamed_conversion_hands_fn_one_tensor_per_replicated_piece(
        streamed_per_parameter):
    """megatron:tp=2,ep=4 holds four data-parallel replicas of its TP-2 dense layers: the
    streamed check cuts each replica's bytes once (the embedding of a real model is 1.2 GiB:
    four copies would be the peak), and fn, which may not write into what it is given, sees
    equal tensors on every replica."""
    verdict, seen = streamed_per_parameter
    assert verdict.passed
    (held,) = seen
    assert held[0] is held[2] is held[4] is held[6] and held[1] is held[3] is held[5] is held[7]
    assert held[0] is not held[1] and not torch.equal(held[0], held[1])  # TP ranks differ

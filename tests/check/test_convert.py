"""check_convert: a user's converter between two frameworks' storage conventions, checked
byte for byte against the declared destination shards and by running the destination's
forward against the reference. The worked example is the README's (Megatron TP=4 -> vLLM)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.breadth import breadth
from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import (
    TOY,
    TOY_KV4,
    InvalidShards,
    ModelConfig,
    UnknownConvention,
    UnsupportedConvention,
    check_convert,
    convert,
    shards_for,
)
from weight_sync_bench.check.convert import measure_threshold
from weight_sync_bench.errors import UserCodeError, WrongShardShape
from weight_sync_bench.tolerance.rules import threshold_for


def megatron_to_vllm(shards, degree, config=TOY_KV4):
    """Megatron-Core TP=len(shards) -> vLLM TP=degree, for a Llama-style config without biases."""
    nh, nkv, hd, vocab = config.n_heads, config.n_kv_heads, config.head_dim, config.vocab
    group = nh // nkv

    def full(name, dim=0):  # Megatron's rank shards are contiguous chunks of the full tensor
        return torch.cat([s[name] for s in shards], dim=dim)

    def vocab_shard(table, r):  # vLLM pads the vocabulary to a multiple of 64, then splits it
        padded = torch.zeros(-(-vocab // 64) * 64, table.shape[1])
        padded[:vocab] = table[:vocab]  # Megatron's own padding rows are dropped
        return padded.chunk(degree)[r].clone()

    out = [{} for _ in range(degree)]
    embed = full("embedding.word_embeddings.weight")
    head = full("output_layer.weight")
    for r in range(degree):
        out[r]["model.embed_tokens.weight"] = vocab_shard(embed, r)
        out[r]["lm_head.weight"] = vocab_shard(head, r)
        out[r]["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    for i in range(config.n_layers):
        m, v = f"decoder.layers.{i}.", f"model.layers.{i}."
        # linear_qkv rows: for each KV group, its Q heads, then K, then V
        qkv = full(m + "self_attention.linear_qkv.weight").view(nkv, group + 2, hd, -1)
        q = qkv[:, :group].reshape(nh, hd, -1)   # (nh, hd, d)
        k, val = qkv[:, group], qkv[:, group + 1]  # (nkv, hd, d) each
        # linear_fc1 on each rank is [gate_r | up_r]
        halves = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        gate = torch.cat([g for g, _ in halves])
        up = torch.cat([u for _, u in halves])
        o_proj = full(m + "self_attention.linear_proj.weight", dim=1)
        down = full(m + "mlp.linear_fc2.weight", dim=1)
        for r in range(degree):
            heads = slice(r * nh // degree, (r + 1) * nh // degree)
            if degree <= nkv:
                kv = slice(r * nkv // degree, (r + 1) * nkv // degree)
            else:  # vLLM replicates KV head r * nkv // degree
                kv = slice(r * nkv // degree, r * nkv // degree + 1)
            out[r][v + "self_attn.qkv_proj.weight"] = torch.cat(
                [q[heads].flatten(0, 1), k[kv].flatten(0, 1), val[kv].flatten(0, 1)])
            out[r][v + "self_attn.o_proj.weight"] = o_proj.chunk(degree, dim=1)[r].clone()
            out[r][v + "mlp.gate_up_proj.weight"] = torch.cat(
                [gate.chunk(degree)[r], up.chunk(degree)[r]])
            out[r][v + "mlp.down_proj.weight"] = down.chunk(degree, dim=1)[r].clone()
            out[r][v + "input_layernorm.weight"] = (
                shards[0][m + "self_attention.linear_qkv.layer_norm_weight"].clone())
            out[r][v + "post_attention_layernorm.weight"] = (
                shards[0][m + "mlp.linear_fc1.layer_norm_weight"].clone())
    return out


def read_as_plain(shards, degree, config=TOY_KV4):
    """The classic bug: Megatron's grouped linear_qkv read as if it were [Q | K | V]."""
    out = megatron_to_vllm(shards, degree, config)
    q_rows, kv_rows = config.q_rows, config.kv_rows
    for i in range(config.n_layers):
        qkv = torch.cat([s[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] for s in shards])
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
        for r in range(degree):
            out[r][f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
                [q.chunk(degree)[r], k.chunk(degree)[r], v.chunk(degree)[r]])
    return out


def test_the_worked_megatron_to_vllm_converter_passes_at_tp2_and_with_kv_replication_at_tp8():
    for dst in ("vllm:2", "vllm:8"):  # TOY_KV4 has 4 KV heads: at t=8 each is replicated twice
        verdict = check_convert(megatron_to_vllm, TOY_KV4, "megatron:4", dst)
        assert verdict.passed, str(verdict)
        assert verdict.threshold == threshold_for(TOY_KV4)  # check_split's measured threshold
    assert str(verdict).splitlines()[0] == "PASS toy_kv4 megatron:4 -> vllm:8 (phase 1a)"


def test_grouped_qkv_read_as_plain_fails_with_the_heads_each_rank_holds():
    verdict = check_convert(read_as_plain, TOY_KV4, "megatron:4", "vllm:2")
    assert not verdict.passed and verdict.ratio > 1000
    assert verdict.first_mismatch == "model.layers.0.self_attn.qkv_proj.weight"
    assert verdict.mismatches == tuple(f"model.layers.{i}.self_attn.qkv_proj.weight"
                                       for i in range(4))
    assert verdict.diagnosis == (
        ("rank 0 model.layers.0.self_attn.qkv_proj.weight holds Q heads 0-1, K head 0, V head 0, "
        "Q heads 4-7; declared Q heads 0-3, K heads 0-1, V heads 0-1"),
        ("rank 1 model.layers.0.self_attn.qkv_proj.weight holds Q heads 2-3, K head 1, V head 1, "
        "K head 2, V head 2, K head 3, V head 3; declared Q heads 4-7, K heads 2-3, V heads 2-3"))
    assert str(verdict).startswith("FAIL toy_kv4 megatron:4 -> vllm:2 (phase 1a)")


QKV = "model.layers.0.self_attn.qkv_proj.weight"


def harness(src, dst, config):
    return lambda shards, degree: convert(shards, src, dst, config)


def test_qkv_shards_of_two_ranks_exchanged_under_kv_replication_are_diagnosed_in_heads():
    def swapped(shards, degree):
        out = convert(shards, "hf", "vllm:4", TOY)  # TOY: 2 KV heads, each on 2 ranks
        out[0][QKV], out[2][QKV] = out[2][QKV], out[0][QKV]
        return out
    verdict = check_convert(swapped, TOY, "hf", "vllm:4")
    assert verdict.first_mismatch == QKV and verdict.mismatches == (QKV,)
    assert verdict.diagnosis == (
        (f"rank 0 {QKV} holds Q heads 4-5, K head 1, V head 1; declared Q heads 0-1, K head 0, "
        "V head 0"),
        (f"rank 2 {QKV} holds Q heads 0-1, K head 0, V head 0; declared Q heads 4-5, K head 1, "
        "V head 1"))


def test_meta_rows_left_in_hf_order_are_diagnosed_as_the_wrong_pair_order():
    def no_permute(shards, degree):
        out = convert(shards, "hf", "meta:2", TOY)
        q = shards[0]["model.layers.0.self_attn.q_proj.weight"]
        for r in range(degree):
            out[r]["layers.0.attention.wq.weight"] = q.chunk(degree)[r].clone()
        return out
    verdict = check_convert(no_permute, TOY, "hf", "meta:2")
    assert not verdict.passed and verdict.ratio > 100
    assert verdict.diagnosis[0] == ("rank 0 layers.0.attention.wq.weight holds Q heads 0-3; "
                                    "declared Q heads 0-3 in pair order")


def test_one_flipped_mantissa_bit_fails_though_the_logits_stay_within_tolerance():
    def flipped(shards, degree):
        out = convert(shards, "megatron", "vllm:2", TOY)
        w = out[1]["model.norm.weight"]
        w.view(torch.int32)[5] ^= 1  # the lowest mantissa bit of one element on rank 1
        return out
    verdict = check_convert(flipped, TOY, "megatron:2", "vllm:2")
    assert verdict.max_abs_error <= verdict.threshold  # the logits cannot tell
    assert not verdict.passed and verdict.first_mismatch == "model.norm.weight"
    assert verdict.diagnosis == (("rank 1 model.norm.weight holds elements 0-4, ?, 6-255; "
                                 "declared elements 0-255"),)


def test_non_finite_logits_never_pass():
    def poisoned(shards, degree):
        out = convert(shards, "hf", "plain:2", TOY)
        out[0]["layers.0.down.weight"][0, 0] = float("nan")
        return out
    verdict = check_convert(poisoned, TOY, "hf", "plain:2")
    assert not verdict.finite and not verdict.passed and math.isnan(verdict.ratio)
    assert "logits are not finite" in str(verdict)


def test_the_same_check_passes_the_harness_converter_for_each_of_those_pairs():
    # the twin of the failures above: nothing vacuous about them
    for src, dst, config in (("megatron:4", "vllm:2", TOY_KV4), ("hf", "vllm:4", TOY),
                             ("hf", "meta:2", TOY), ("megatron:2", "vllm:2", TOY)):
        assert check_convert(harness(src, dst, config), config, src, dst).passed


# The malformed outputs below are refused before any forward runs: on TOY over a 512-word
# vocabulary (a fifth of the weights to draw; every shape a message names is TOY's) with an
# explicit threshold, as no floor is committed for it.
NARROW = narrowed(TOY)


def _drop(name):
    def fn(shards, degree):
        out = convert(shards, "hf", "vllm:2", NARROW)
        del out[1][name]
        return out
    return fn


def _edit(rank, name, value):
    def fn(shards, degree):
        out = convert(shards, "hf", "vllm:2", NARROW)
        out[rank][name] = value(out[rank][name]) if callable(value) else value
        return out
    return fn



@pytest.mark.parametrize("fn, error, message", [
    (lambda s, t: convert(s, "hf", "vllm:2", NARROW)[0], InvalidShards,
     "vllm:2: expected a list of 2 rank dicts, got dict"),
    (lambda s, t: convert(s, "hf", "vllm:4", NARROW), InvalidShards,
     "vllm:2: expected 2 rank dicts, got 4"),
    (lambda s, t: [list(r.values()) for r in convert(s, "hf", "vllm:2", NARROW)], InvalidShards,
     "vllm:2 rank 0: expected a dict of tensors, got list"),
    (_drop("lm_head.weight"), InvalidShards, "vllm:2 rank 1: missing lm_head.weight"),
    (lambda s, t: [{**r, "output_layer.weight": r["lm_head.weight"]}
                   for r in convert(s, "hf", "vllm:2", NARROW)], InvalidShards,
     "vllm:2 rank 0: unexpected output_layer.weight"),
    (lambda s, t: [{**r, 7: r["lm_head.weight"]} for r in convert(s, "hf", "vllm:2", NARROW)],
     InvalidShards, "vllm:2 rank 0: key 7 is a int, expected a str parameter name"),
    (_edit(1, QKV, lambda x: x.numpy()), InvalidShards,
     f"vllm:2 rank 1 {QKV}: expected a Tensor, got ndarray"),
    (_edit(1, QKV, lambda x: x[:-1]), WrongShardShape,
     f"vllm:2 rank 1 {QKV}: shape [191, 256], declared [192, 256]"),
    (_edit(0, QKV, lambda x: x.bfloat16()), WrongShardShape,
     f"vllm:2 rank 0 {QKV}: dtype torch.bfloat16, declared torch.float32"),
])
def test_malformed_output_is_a_typed_error_naming_convention_rank_and_name(fn, error, message):
    with pytest.raises(error) as info:
        check_convert(fn, NARROW, "hf", "vllm:2", threshold=THRESHOLD)
    assert str(info.value) == message


def test_a_tied_config_names_why_an_output_layer_is_unexpected():
    tied = TOY.replace(name="toy_tied", tie_embeddings=True)
    def with_head(shards, degree):
        out = convert(shards, "hf", "vllm:2", tied)
        return [{**r, "lm_head.weight": r["model.embed_tokens.weight"]} for r in out]
    with pytest.raises(InvalidShards, match=r"unexpected lm_head.weight \(tied embeddings"):
        check_convert(with_head, tied, "hf", "vllm:2", threshold=THRESHOLD)


@pytest.mark.parametrize("src, dst, error, message", [
    ("foo:2", "vllm:2", UnknownConvention,
     "unknown convention 'foo' in 'foo:2'; known: plain, megatron, vllm, hf, meta"),
    ("hf", "vllm:two", UnknownConvention, "'vllm:two': the degree after ':' must be a positive integer"),
    # TOY has 2 KV heads and 8 query heads: Megatron takes TP 4 and 8 now, not 3
    ("hf", "megatron:3", UnsupportedConvention,
     "megatron: decoder.layers.0.self_attention.linear_qkv.weight needs n_heads % t == 0 "
     "(n_heads=8, t=3)"),
    ("hf:2", "vllm:2", UnsupportedConvention,
     "hf: model.embed_tokens.weight needs t == 1 (a Hugging Face checkpoint is unsharded) (t=2)"),
])
def test_an_endpoint_that_cannot_exist_is_rejected_before_the_converter_runs(src, dst, error,
                                                                            message):
    def never(shards, degree):
        raise AssertionError("the converter ran")
    with pytest.raises(error) as info:
        check_convert(never, TOY, src, dst)
    assert str(info.value) == message


@pytest.mark.parametrize("src, dst, wrong", [
    # Meta's ParallelEmbedding: a local lookup of d/t columns, all-gathered over gloo (5 s; the
    # long run: its forward runs in process by default, the gloo path on vLLM's layout below)
    pytest.param("hf", "meta:2", "tok_embeddings.weight", marks=pytest.mark.slow),
    # vLLM at t=4 > TOY's 2 KV heads: each KV head replicated on 2 ranks (HeadReplicated)
    ("megatron:2", "vllm:4", QKV),
])
def test_over_gloo_every_forward_layout_runs_and_a_wrong_shard_still_fails(src, dst, wrong):
    """gloo scatters the destination's forward layout, whatever its placements: Meta's
    hidden-split embedding and vLLM's replicated KV heads pass over gloo as in process."""
    verdict = check_convert(harness(src, dst, TOY), TOY, src, dst, backend="gloo")
    inprocess = check_convert(harness(src, dst, TOY), TOY, src, dst)
    assert verdict.passed and verdict.phase == "1b" and inprocess.passed
    assert verdict.threshold == threshold_for(TOY, "1b")  # phase 1b's, not 1a's
    assert verdict.max_abs_error > 0  # a forward really ran

    def swapped(shards, degree):  # the twin: ranks 0 and 1 exchange one parameter
        out = convert(shards, src, dst, TOY)
        out[0][wrong], out[1][wrong] = out[1][wrong], out[0][wrong]
        return out
    failed = check_convert(swapped, TOY, src, dst, backend="gloo")
    assert not failed.passed and failed.first_mismatch == wrong and failed.ratio >= 10


def test_an_unmeasured_geometry_takes_a_threshold_measured_for_it():
    small = ModelConfig(name="small", vocab=64, d_model=32, n_layers=1, n_heads=8,
                        n_kv_heads=2, head_dim=8, ffn=48)
    threshold = measure_threshold(small, ["plain:2", "vllm:4", "meta:2"], seeds=range(2))
    assert threshold in (1e-6, 1e-5, 1e-4)  # a power of ten, >= 100x the floor
    verdict = check_convert(harness("meta:2", "vllm:4", small), small, "meta:2", "vllm:4",
                            threshold=threshold)
    assert verdict.passed and verdict.threshold == threshold
    # rank 3 of vllm:4 holds 2 Q heads and a copy of KV head 1: (2 + 2 * 1) * 8 rows
    assert shards_for(small, "vllm", 4)[3][QKV].shape == (32, 32)


def test_what_the_converter_raises_is_framed_as_the_users_code():
    def broken(shards, degree):
        raise KeyError("decoder.layers.0.self_attention.linear_qkv.weight")
    with pytest.raises(UserCodeError, match=r"^your converter `.*broken` raised KeyError while "
                       r"converting toy megatron:2 -> vllm:2: "):
        check_convert(broken, TOY, "megatron:2", "vllm:2")
    with pytest.raises(UserCodeError, match=r"has the wrong signature"):
        check_convert(lambda shards: shards, TOY, "megatron:2", "vllm:2")


# The long run: the default run's equivalent is the vLLM TP-4 case of
# test_over_gloo_every_forward_layout_runs_and_a_wrong_shard_still_fails (the same
# destination forward one process per rank, phase 1b's threshold, a wrong shard set failed).
@pytest.mark.slow
def test_over_gloo_the_destination_forward_runs_one_process_per_rank_with_phase_1b_threshold():
    verdict = check_convert(harness("megatron", "vllm:2", TOY), TOY, "megatron:2", "vllm:2",
                            backend="gloo")
    assert verdict.passed and verdict.phase == "1b"
    assert verdict.threshold == threshold_for(TOY, "1b")

    def swapped(shards, degree):  # the twin: the same check fails a wrong shard set over gloo
        out = convert(shards, "megatron", "vllm:2", TOY)
        out[0], out[1] = out[1], out[0]
        return out
    failed = check_convert(swapped, TOY, "megatron:2", "vllm:2", backend="gloo")
    assert not failed.passed and failed.ratio >= 10


# -- bf16 and fp16 weights, and streamed conversions (real widths)


# bf16 by default, fp16 in the long run: the same comparison in the other 16-bit dtype
# (fp16 verdicts by default: tests/check/test_dtype.py).
@pytest.mark.parametrize("dtype", breadth(["bf16", "fp16"], keep={"bf16"}))
def test_a_low_precision_conversion_is_compared_bit_exactly_in_its_dtype(dtype):
    src, dst = "megatron:4", "vllm:2"
    verdict = check_convert(harness(src, dst, TOY_KV4), TOY_KV4, src, dst, dtype=dtype)
    assert verdict.passed and verdict.dtype == dtype and f"{dtype} weights" in str(verdict)
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def upcast(shards, degree):  # the fp32 the dtype was rounded from is not what is synced
        out = harness(src, dst, TOY_KV4)(shards, degree)
        out[1]["model.layers.0.mlp.down_proj.weight"] = out[1][
            "model.layers.0.mlp.down_proj.weight"].float()
        return out
    with pytest.raises(WrongShardShape, match=r"vllm:2 rank 1 model.layers.0.mlp.down_proj"
                       r".weight: dtype torch.float32, declared " + str(wanted)) as caught:
        check_convert(upcast, TOY_KV4, src, dst, dtype=dtype)
    assert caught.value.rank == 1 and caught.value.actual_dtype == torch.float32

    other = torch.float16 if wanted == torch.bfloat16 else torch.bfloat16

    def round_trip(shards, degree):  # through the other 16-bit dtype and back: bytes moved
        out = harness(src, dst, TOY_KV4)(shards, degree)
        name = "model.layers.0.self_attn.o_proj.weight"
        out[0][name] = out[0][name].to(other).to(wanted)
        return out
    failed = check_convert(round_trip, TOY_KV4, src, dst, dtype=dtype)
    assert not failed.passed and failed.first_mismatch == "model.layers.0.self_attn.o_proj.weight"
    assert "o_proj.weight holds columns" in failed.diagnosis[0] and "?" in failed.diagnosis[0]


@pytest.fixture(scope="module")
def whole_verdict():
    """``whole_verdict(src, dst, config, dtype)``: the harness converter's whole-model
    ``check_convert`` verdict, computed once per module (both ``per`` of a pair compare with
    the same one)."""
    verdicts = {}

    def whole(src, dst, config, dtype):
        key = (src, dst, config, dtype)
        if key not in verdicts:
            verdicts[key] = check_convert(harness(src, dst, config), config, src, dst,
                                          dtype=dtype)
        return verdicts[key]
    return whole


# One pair per layer by default, every pair at both grains in the long run: a streamed
# conversion per parameter gives the whole model's verdict by default in
# tests/check/test_moe_check.py (test_a_streamed_moe_conversion_gives_the_whole_model_verdict,
# its twin failing), and runs one parameter at a time in tests/check/test_stream.py
# (test_a_streamed_conversion_drops_each_parameter_before_it_draws_the_next, megatron:2 ->
# vllm:4 in bf16) and here, hf -> vllm:2 (its twin passing in
# test_a_streamed_converter_that_writes_into_its_input_is_refused_and_its_twin_passes).
@pytest.mark.parametrize("per, src, dst, config", breadth(
    [pytest.param(per, src, dst, config, id=f"{src}-{dst}-{per}")
     for src, dst, config in [("megatron:4", "vllm:8", TOY_KV4), ("meta:2", "hf", TOY),
                              ("hf", "megatron:2", TOY)] for per in ("layer", "parameter")],
    keep={"hf-megatron:2-layer"}, name=lambda p: p.id))
def test_a_streamed_conversion_gives_the_whole_model_verdict(per, src, dst, config,
                                                             whole_verdict):
    from weight_sync_bench.check.convert import stage_convert

    for dtype in ("fp32", "bf16"):
        whole = whole_verdict(src, dst, config, dtype)
        streamed = check_convert(stage_convert(src, dst, config), config, src, dst,
                                 dtype=dtype, stream=per)
        assert whole.passed and streamed.passed
        assert (streamed.max_abs_error, streamed.threshold, streamed.notes, streamed.route) == (
            whole.max_abs_error, whole.threshold, whole.notes, whole.route)
    qkv = next(n for n in shards_for(config, dst.split(":")[0], int(dst.partition(":")[2] or 1))[0]
               if "qkv" in n or n.endswith(("wq.weight", "q_proj.weight")))
    calls = []

    def wrong(shards, degree):  # the twin: one stored tensor of the last rank negated
        calls.append(sorted(shards[0]))
        out = stage_convert(src, dst, config)(shards, degree)
        if qkv in out[-1]:
            out[-1][qkv] = -out[-1][qkv]
        return out
    streamed = check_convert(wrong, config, src, dst, stream=per)
    whole = whole_verdict(src, dst, config, "fp32")
    assert not streamed.passed and streamed.first_mismatch == qkv and streamed.ratio > 10
    assert streamed.max_abs_error > whole.max_abs_error
    assert streamed.diagnosis and f"{qkv} holds" in streamed.diagnosis[0]  # diagnosed
    # fn saw one stage (or one canonical parameter) at a time, never the whole model
    assert len(calls) > config.n_layers + 2 if per == "parameter" else len(calls) == \
        config.n_layers + 2


def test_a_streamed_conversion_runs_in_process_only():
    with pytest.raises(ValueError, match="runs in process"):
        check_convert(harness("hf", "vllm:2", TOY), TOY, "hf", "vllm:2", stream="layer",
                      backend="gloo")


def test_a_streamed_converter_that_writes_into_its_input_is_refused_and_its_twin_passes():
    from weight_sync_bench.check.convert import stage_convert

    def scribbles(shards, degree):  # the harness rebuilds the canonical rows from its input
        out = stage_convert("hf", "vllm:2", TOY)(shards, degree)
        for rank in shards:
            for x in rank.values():
                x.zero_()
        return out
    with pytest.raises(UserCodeError, match="modified in place source rank 0"):
        check_convert(scribbles, TOY, "hf", "vllm:2", stream="parameter")
    assert check_convert(stage_convert("hf", "vllm:2", TOY), TOY, "hf", "vllm:2",
                         stream="parameter").passed

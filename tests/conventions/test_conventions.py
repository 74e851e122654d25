"""Each convention stores what its framework stores: names, row orders, splits, vocabulary
padding, tied and biased variants, and the rules it rejects, pinned against the worked
layouts of the research notes (conventions.md section 5) and the frameworks' own functions."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench import TOY, TOY_KV4, ModelConfig, init_params, layout_for, split
from weight_sync_bench.check.diagnosis import describe
from weight_sync_bench.conventions import CONVENTIONS, endpoint, render, shards_for
from weight_sync_bench.conventions.megatron import padded_vocab as megatron_vocab
from weight_sync_bench.conventions.meta import permute
from weight_sync_bench.conventions.vllm import padded_vocab as vllm_vocab
from weight_sync_bench.errors import (
    UnknownConvention,
    UnsupportedConvention,
    UnsupportedLayout,
)

# nh=8, ng=2 (4 Q heads per group), the notes' worked example; hd=4 keeps rows readable
G2 = ModelConfig(name="g2", vocab=64, d_model=16, n_layers=1, n_heads=8, n_kv_heads=2,
                 head_dim=4, ffn=12)
G4 = G2.replace(name="g4", n_kv_heads=4)


def heads(config, convention, degree, name):
    """What each rank of ``convention`` holds of ``name``, in canonical head terms."""
    pieces = CONVENTIONS[convention].pieces(config, degree)
    return [describe(p[name].idx.tolist(), p[name], config) for p in pieces]


MEG_QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
VLLM_QKV = "model.layers.0.self_attn.qkv_proj.weight"


def test_megatron_and_vllm_agree_when_each_rank_holds_one_whole_kv_group():
    # t=2, ng=2: Megatron r0 [q0 q1 q2 q3 k0 v0] is vLLM's [q0..q3 | k0 | v0]
    assert heads(G2, "megatron", 2, MEG_QKV) == heads(G2, "vllm", 2, VLLM_QKV) == [
        "Q heads 0-3, K head 0, V head 0", "Q heads 4-7, K head 1, V head 1"]


def test_megatron_interleaves_per_group_where_vllm_concatenates_q_k_v():
    # nh=8, ng=4, t=2: Megatron r0 [q0 q1 k0 v0 q2 q3 k1 v1], vLLM r0 [q0..q3 | k0 k1 | v0 v1]
    assert heads(G4, "megatron", 2, MEG_QKV)[0] == (
        "Q heads 0-1, K head 0, V head 0, Q heads 2-3, K head 1, V head 1")
    assert heads(G4, "vllm", 2, VLLM_QKV)[0] == "Q heads 0-3, K heads 0-1, V heads 0-1"
    # t=1: the whole interleaved tensor, [q0 q1 k0 v0 | q2 q3 k1 v1 | ...]
    assert heads(G4, "megatron", 1, MEG_QKV)[0].startswith("Q heads 0-1, K head 0, V head 0, Q")


def test_vllm_replicates_kv_head_r_times_n_kv_over_t_past_n_kv_ranks():
    # t=4 > ng=2: rank r holds Q heads 2r, 2r+1 and a copy of KV head r // 2
    assert heads(G2, "vllm", 4, VLLM_QKV) == [
        "Q heads 0-1, K head 0, V head 0", "Q heads 2-3, K head 0, V head 0",
        "Q heads 4-5, K head 1, V head 1", "Q heads 6-7, K head 1, V head 1"]
    local = CONVENTIONS["vllm"].local_shapes(G2, 4)[0][VLLM_QKV]
    assert local == ((2 + 1 + 1) * 4, 16)  # two Q heads, one K, one V


def test_megatron_fc1_is_gate_r_then_up_r_so_rank_shards_do_not_concatenate_to_it():
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert heads(G2, "megatron", 2, fc1) == ["gate rows 0-5, up rows 0-5",
                                             "gate rows 6-11, up rows 6-11"]
    assert heads(G2, "megatron", 1, fc1) == ["gate rows 0-11, up rows 0-11"]
    t1, t2 = shards_for(G2, "megatron", 1), shards_for(G2, "megatron", 2)
    assert not torch.equal(torch.cat([s[fc1] for s in t2]), t1[0][fc1])  # [g0 u0 g1 u1]


@pytest.mark.parametrize("vocab, t, padded", [
    (32000, 2, 32000), (32001, 2, 32256), (128256, 8, 129024), (152064, 4, 152064)])
def test_megatron_pads_the_vocabulary_to_a_multiple_of_128_t(vocab, t, padded):
    assert megatron_vocab(vocab, t) == padded  # calculate_padded_vocab_size, the notes' cases


@pytest.mark.parametrize("vocab, padded", [(32000, 32000), (32001, 32064), (128256, 128256)])
def test_vllm_pads_the_vocabulary_to_a_multiple_of_64_whatever_the_degree(vocab, padded):
    assert vllm_vocab(vocab) == padded


def test_padding_rows_are_zeros_at_the_end_of_the_last_shard():
    config = G2.replace(vocab=100)
    meg = shards_for(config, "megatron", 2)  # 100 -> 256 rows, 128 per rank
    first, second = (s["embedding.word_embeddings.weight"] for s in meg)
    assert first.shape == (128, 16) and not first[100:].any() and first[99].abs().min() > 0
    assert not second.any()  # rank 1 holds padding only, as Megatron's does at this size
    vl = shards_for(config, "vllm", 2)  # 100 -> 128 rows, 64 per rank
    assert vl[1]["lm_head.weight"].shape == (64, 16) and not vl[1]["lm_head.weight"][36:].any()
    assert heads(config, "vllm", 2, "lm_head.weight")[1] == "vocabulary rows 64-99, padding x28"


def test_plain_is_exactly_the_declared_split_padding_tied_and_biases_included():
    for config in (TOY_KV4, G2.replace(vocab_multiple=8, vocab=60, tie_embeddings=True,
                                        bias=True)):
        params = init_params(config, 0)
        for t in layout_for(config).supported_degrees():
            ours, theirs = shards_for(config, "plain", t), split(params, layout_for(config), t)
            assert [list(r) for r in ours] == [list(r) for r in theirs]
            assert all(torch.equal(a[n], b[n]) for a, b in zip(ours, theirs) for n in a)


def test_meta_rows_are_hfs_permute_inverted_and_its_embedding_splits_the_hidden_dim():
    meta, hf = shards_for(G2, "meta", 1)[0], shards_for(G2, "hf", 1)[0]
    # convert_llama_weights_to_hf.py: q = permute(wq, n_heads), k = permute(wk, n_kv_heads)
    assert torch.equal(permute(meta["layers.0.attention.wq.weight"], 8),
                       hf["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(permute(meta["layers.0.attention.wk.weight"], 2),
                       hf["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(meta["layers.0.attention.wv.weight"], hf["model.layers.0.self_attn.v_proj.weight"])
    # per head: Meta row 2j is HF row j, Meta row 2j+1 is HF row hd/2 + j
    assert CONVENTIONS["meta"].pieces(G2, 1)[0]["layers.0.attention.wq.weight"].idx[:4].tolist() == [
        0, 2, 1, 3]
    two = CONVENTIONS["meta"].local_shapes(G2, 2)[0]
    assert two["tok_embeddings.weight"] == (64, 8)  # ParallelEmbedding: [V, d / t]
    assert two["output.weight"] == (32, 16)  # ColumnParallelLinear: [V / t, d]
    assert two["layers.0.attention.wo.weight"] == (16, 16)  # RowParallelLinear: dim 1


NAMES_L0 = {
    "megatron": ["embedding.word_embeddings.weight",
                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                 MEG_QKV, "decoder.layers.0.self_attention.linear_proj.weight",
                 "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                 "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                 "decoder.final_layernorm.weight", "output_layer.weight"],
    "vllm": ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", VLLM_QKV,
             "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.post_attention_layernorm.weight",
             "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.norm.weight", "lm_head.weight"],
    "hf": ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
           "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
           "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
           "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
           "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
           "model.norm.weight", "lm_head.weight"],
    "meta": ["tok_embeddings.weight", "layers.0.attention_norm.weight",
             "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
             "layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
             "layers.0.ffn_norm.weight", "layers.0.feed_forward.w1.weight",
             "layers.0.feed_forward.w3.weight", "layers.0.feed_forward.w2.weight",
             "norm.weight", "output.weight"],
}


@pytest.mark.parametrize("convention", NAMES_L0)
def test_each_convention_stores_its_frameworks_names_in_forward_order(convention):
    assert CONVENTIONS[convention].names(G2, 1) == NAMES_L0[convention]


@pytest.mark.parametrize("convention, absent", [
    ("plain", "lm_head.weight"), ("megatron", "output_layer.weight"),
    ("vllm", "lm_head.weight"), ("hf", "lm_head.weight")])
def test_a_tied_model_stores_no_output_layer(convention, absent):
    names = CONVENTIONS[convention].names(G2.replace(tie_embeddings=True), 1)
    assert absent not in names and len(names) == len(CONVENTIONS[convention].names(G2, 1)) - 1


def test_biases_are_stored_where_each_framework_has_them():
    qwen2 = G2.replace(qkv_bias=True)  # Qwen2Attention: q, k, v biases
    llama = G2.replace(qkv_bias=True, o_bias=True)  # LlamaAttention(attention_bias=True)
    assert [n for n in CONVENTIONS["hf"].names(qwen2, 1) if n.endswith("bias")] == [
        "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias"]
    assert "model.layers.0.self_attn.o_proj.bias" in CONVENTIONS["hf"].names(llama, 1)
    assert [n for n in CONVENTIONS["megatron"].names(qwen2, 2) if n.endswith("bias")] == [
        "decoder.layers.0.self_attention.linear_qkv.bias"]
    # the qkv bias follows its rows, in Megatron's grouped order and under vLLM replication
    assert heads(qwen2, "megatron", 1, "decoder.layers.0.self_attention.linear_qkv.bias") == \
        heads(qwen2, "megatron", 1, MEG_QKV)
    assert heads(qwen2, "vllm", 4, "model.layers.0.self_attn.qkv_proj.bias") == \
        heads(qwen2, "vllm", 4, VLLM_QKV)
    # vLLM's row-parallel bias: full on every rank
    o = [s["model.layers.0.self_attn.o_proj.bias"] for s in shards_for(llama, "vllm", 4)]
    assert all(torch.equal(o[0], x) and x.shape == (16,) for x in o)


REJECTED = [
    # Megatron since f7dfb99795 takes TP > num_query_groups only as a multiple of them
    ("megatron", G2.replace(n_heads=6, d_model=24, ffn=6), 3, ("megatron: decoder.layers.0."
     "self_attention.linear_qkv.weight needs n_kv_heads % t == 0, or t % n_kv_heads == 0 (TP > "
     "num_query_groups: Megatron-Core since f7dfb99795) (n_kv_heads=2, t=3)")),
    # vLLM replicates KV heads only when t is a multiple of n_kv_heads
    ("vllm", G2.replace(n_heads=6, d_model=24, ffn=6), 3, ("vllm: model.layers.0.self_attn."
     "qkv_proj.weight needs t % n_kv_heads == 0 when t > n_kv_heads (n_kv_heads=2, t=3)")),
    # 96 tokens pad to 128, which 3 ranks do not split (vLLM's divide asserts)
    ("vllm", G2.replace(vocab=96, n_heads=6, n_kv_heads=6, d_model=24, ffn=6), 3,
     ("vllm: model.embed_tokens.weight needs padded vocab % t == 0 (the vocabulary padded to a "
     "multiple of 64) (vocab=96, padded vocab=128, t=3)")),
    # a down bias alone: vLLM's mlp_bias biases gate_up_proj too
    ("vllm", G2.replace(bias=True), 1, ("vllm: model.layers.0.mlp.down_proj.bias needs no down "
     "bias without a gate_up bias (LlamaMLP's mlp_bias biases gate_up_proj and down_proj "
     "together) (bias=True, t=1)")),
    ("megatron", G2.replace(o_bias=True), 1, ("megatron: decoder.layers.0.self_attention."
     "linear_proj.bias needs no o_proj bias (a linear_proj bias comes only with "
     "add_bias_linear, which also biases linear_fc1, absent from the harness block) "
     "(o_bias=True, bias=False, t=1)")),
    ("hf", G2, 2, ("hf: model.embed_tokens.weight needs t == 1 (a Hugging Face checkpoint is "
     "unsharded) (t=2)")),
    # Meta has no KV replication: n_local_kv_heads = n_kv_heads // t would be 0
    ("meta", TOY, 4, ("meta: layers.0.attention.wk.weight needs n_kv_heads % t == 0 "
     "(n_local_kv_heads = n_kv_heads // t: no KV replication) (n_kv_heads=2, t=4)")),
    ("meta", G2.replace(tie_embeddings=True), 1, ("meta: output.weight needs tie_embeddings == "
     "False (Meta Llama checkpoints store output separately) (tie_embeddings=True, t=1)")),
    ("meta", G2.replace(qkv_bias=True), 1, ("meta: layers.0.attention.wq.weight needs no biases "
     "(Meta Llama linears are bias-free) (bias=False, qkv_bias=True, o_bias=False, t=1)")),
    # fairscale's ColumnParallelLinear over the unpadded vocabulary
    ("meta", G2.replace(vocab=63), 2, ("meta: output.weight needs vocab % t == 0 "
     "(ColumnParallelLinear over the unpadded vocabulary) (vocab=63, t=2)")),
    # the canonical model of a framework convention has no padding of its own
    ("vllm", G2.replace(vocab_multiple=8), 1, ("vllm: model.embed_tokens.weight needs an "
     "unpadded canonical vocabulary (vocab_multiple == 1: the convention pads by its own rule) "
     "(vocab_multiple=8, t=1)")),
]


@pytest.mark.parametrize("convention, config, degree, message", REJECTED)
def test_a_rule_a_framework_enforces_is_a_typed_error_naming_it(convention, config, degree,
                                                                 message):
    with pytest.raises(UnsupportedConvention) as info:
        shards_for(config, convention, degree)
    assert str(info.value) == message
    assert degree not in CONVENTIONS[convention].supported_degrees(config, 8)


def test_plain_keeps_the_layouts_own_error():
    with pytest.raises(UnsupportedLayout, match=r"^layers.0.qkv.weight: HeadPartitioned needs "
                       r"n_kv_heads % t == 0 \(n_kv_heads=2, t=4\)$"):
        shards_for(TOY, "plain", 4)


def test_supported_degrees_are_probed_from_the_rules():
    assert {n: c.supported_degrees(TOY, 8) for n, c in CONVENTIONS.items()} == {
        "plain": [1, 2], "megatron": [1, 2, 4, 8], "vllm": [1, 2, 4, 8], "hf": [1],
        "meta": [1, 2]}


@pytest.mark.parametrize("text, message", [
    ("foo", "unknown convention 'foo' in 'foo'; known: plain, megatron, vllm, hf, meta"),
    ("vllm:0", "'vllm:0': the degree after ':' must be a positive integer"),
    ("vllm:", "'vllm:': the degree after ':' must be a positive integer"),
    (2, "a conversion endpoint is a 'name:degree' string, got int 2"),
])
def test_endpoints_parse_or_say_why_not(text, message):
    with pytest.raises(UnknownConvention) as info:
        endpoint(text)
    assert str(info.value) == message


def test_an_endpoint_without_a_degree_is_degree_one():
    assert (str(endpoint("hf")), str(endpoint("megatron:4"))) == ("hf:1", "megatron:4")


def test_the_convention_table_shows_replicated_kv_heads_where_the_bytes_are_replicated():
    text = render(TOY.replace(n_layers=1), CONVENTIONS["vllm"], [1, 2, 4, 8, 3])
    qkv = next(line for line in text.splitlines() if line.startswith(VLLM_QKV))
    assert qkv.split()[1:] == ["layers.0.qkv.weight", "[384,", "256]", "HP(8,2,32)", "[192,",
                               "256]", "HP(8,2,32)", "[128,", "256]", "HR(8,2,32)", "[96,",
                               "256]", "HR(8,2,32)", "-"]
    assert text.splitlines()[-1] == "HR(8,2,32): Q heads split; rank r holds replicated KV head r*2/t"


def test_a_refusal_is_remembered_with_its_message_and_an_answer_still_answers():
    """``Convention.pieces`` remembers a refusal (``supported_degrees`` probes 64 degrees at
    a time): asked again, the same type and message, each time a fresh exception; the degrees
    it accepts still answer, with the same index maps."""
    from weight_sync_bench.conventions.convention import clear_caches

    vllm = CONVENTIONS["vllm"]
    clear_caches()
    raised = []
    for _ in range(2):
        with pytest.raises(UnsupportedConvention) as info:
            vllm.pieces(TOY_KV4, 3)
        raised.append(info.value)
    assert type(raised[0]) is type(raised[1]) and raised[0] is not raised[1]
    assert str(raised[0]) == str(raised[1]) and "t=3" in str(raised[0])
    assert vllm.supported_degrees(TOY_KV4) == vllm.supported_degrees(TOY_KV4)
    assert 3 not in vllm.supported_degrees(TOY_KV4)
    answer = vllm.pieces(TOY_KV4, 2)  # the twin: a supported degree is answered, and kept
    assert vllm.pieces(TOY_KV4, 2) is answer and len(answer) == 2

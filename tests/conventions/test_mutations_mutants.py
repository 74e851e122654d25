"""``conventions.mutations`` read byte by byte (issue 30, the mutation pass over
``conventions/mutations.py``).

Each ``ConversionMutation`` is one of the field's layout bugs planted in what a correct
converter writes. The kill matrices (``tests/conventions/test_mutations.py``,
``tests/check/test_moe_kill.py``, ``tests/check/test_pipeline_kill.py``) show each is
detected wherever it is live; a mutation that drifted into another bug, or a smaller one
(one layer of two, one rank of four), would still be detected there. These tests pin what
each one writes: exactly which tensors of which rank differ from the correct destination,
and how, computed here on the bug's own terms (the framework's stored tensors read the
wrong way, written out as the public bug does: Megatron-Core's grouped ``linear_qkv``,
gpt-fast's / HF's RoPE permute, Megatron's ``[gate_r | up_r]`` fc1 shards, vLLM's expert
map), and where that is the canonical tensors changed, by cutting them with the
convention's index maps (``conventions.maps``, tested on their own). Also each mutation's
reasons for not applying and for being the identity, word for word, and ``apply``'s
contract (shapes kept, input untouched)."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import endpoint, materialize, shards_for
from weight_sync_bench.conventions.maps import expert_cols, expert_rows
from weight_sync_bench.conventions.mutations import (
    CONVERSION_MUTATIONS,
    MUTATIONS,
    Conversion,
    ConversionMutation,
    mutation_by_name,
)
from weight_sync_bench.errors import UnknownMutation
from weight_sync_bench.model.config import ModelConfig, init_params

# 8 Q heads over 2 KV groups, a qkv bias, untied, two layers
D = ModelConfig(name="d", vocab=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2,
                head_dim=8, ffn=48, qkv_bias=True)
Q, KV = D.q_rows, D.kv_rows  # 64, 16
# square experts (a transposed one keeps its shape), 6 of them (uneven over 4 EP ranks), a
# selection bias, a gated shared expert, q/k norms
M = D.replace(name="m", qkv_bias=False, n_experts=6, top_k=2, expert_ffn=32, qk_norm=True,
              router="sigmoid", router_bias=True, shared_ffn=16, shared_gate=True)
F = M.expert_ffn
# 4 layers, a vocabulary of 250: Megatron pads it to 256 at TP 2 (128 a rank, 125 real)
P = D.replace(name="p", vocab=250, n_layers=4, qkv_bias=False)


def changed(before, after):
    """``{(rank, name)}`` of every stored tensor whose bytes differ (a mutation keeps the
    names, shapes and dtypes: ``apply`` asserts it)."""
    assert len(before) == len(after)
    out = set()
    for r, (a, b) in enumerate(zip(before, after)):
        assert list(a) == list(b), r
        out |= {(r, n) for n in a if not torch.equal(a[n], b[n])}
    return out


def run(name, config, src, dst):
    good = shards_for(config, dst)
    snapshot = [{n: x.clone() for n, x in rank.items()} for rank in good]
    bad = MUTATIONS[name].apply(good, Conversion(config, endpoint(src), endpoint(dst)))
    assert changed(snapshot, good) == set()  # the input is left untouched
    return good, bad


def cut(config, dst, **replaced):
    """The destination ``dst`` cut from the canonical parameters with ``replaced`` swapped
    in: what a converter that got those canonical tensors wrong writes."""
    params = init_params(config, 0)
    params.update(replaced)
    return materialize(endpoint(dst).pieces(config), params)


def same(a, b):
    return changed(a, b) == set()


def canonical(config, name):
    return init_params(config, 0)[name]


# ---------------------------------------------------------------- TP rank and KV replicas

QKV_V, GU_V = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"


def test_tp_rank_defaults_to_0_gives_every_rank_rank_0s_fused_qkv_and_gate_up_only():
    good, bad = run("tp_rank_defaults_to_0", D, "hf", "vllm:2")
    fused = {f"model.layers.{i}.{n}" for i in range(2)
             for n in (QKV_V, "self_attn.qkv_proj.bias", GU_V)}
    assert changed(good, bad) == {(1, n) for n in fused}
    assert all(torch.equal(bad[1][n], good[0][n]) for n in fused)


def test_tp_rank_defaults_to_0_copies_metas_wq_wk_wv_w1_w3_not_wo_or_w2():
    good, bad = run("tp_rank_defaults_to_0", D.replace(qkv_bias=False), "hf", "meta:2")
    fused = {f"layers.{i}.{n}.weight" for i in range(2)
             for n in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                       "feed_forward.w3")}
    assert changed(good, bad) == {(1, n) for n in fused}
    assert all(torch.equal(bad[1][n], good[0][n]) for n in fused)


def test_tp_rank_defaults_to_0_on_a_pipeline_stage_copies_its_own_stages_first_rank():
    """Keyed by the stage-local name alone (the first form), stage 1's ranks got stage 0's
    rank 0 tensor of another layer: detected, but not the bug the mutation names."""
    # megatron:tp=2,pp=2: ranks 0, 1 hold layers 0-1, ranks 2, 3 layers 2-3, each stage
    # naming its layers decoder.layers.0 and .1 (Megatron's local numbering)
    good, bad = run("tp_rank_defaults_to_0", P, "hf", "megatron:tp=2,pp=2")
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(bad[1][qkv], good[0][qkv])
    assert torch.equal(bad[3][qkv], good[2][qkv])  # rank 2: stage 1's first rank
    assert torch.equal(bad[2][qkv], good[2][qkv])


def _vllm_local_qkv(config, what, rank, t, kv_head):
    """vLLM's QKVParallelLinear rank-local rows: its n_heads / t Q heads, then one K and one
    V head (``kv_head``: vLLM's ``tp_rank // (t // n_kv_heads)`` when t > n_kv_heads)."""
    full, hd, q_local = canonical(config, f"layers.0.qkv.{what}"), config.head_dim, Q // t
    k0, v0 = Q + kv_head * hd, Q + KV + kv_head * hd
    return torch.cat([full[rank * q_local:(rank + 1) * q_local], full[k0:k0 + hd],
                      full[v0:v0 + hd]])


def test_kv_replica_modulo_gives_rank_r_kv_head_r_mod_n_kv_heads_weight_and_bias():
    good, bad = run("kv_replica_modulo", D, "hf", "vllm:4")
    for r in range(4):
        for what in ("weight", "bias"):
            name = f"model.layers.0.self_attn.qkv_proj.{what}"
            assert torch.equal(good[r][name], _vllm_local_qkv(D, what, r, 4, r // 2))
            assert torch.equal(bad[r][name], _vllm_local_qkv(D, what, r, 4, r % 2))
    # ranks 1 and 2 pick the other head of the two; ranks 0 and 3 the right one
    assert changed(good, bad) == {(r, f"model.layers.{i}.self_attn.qkv_proj.{w}")
                                  for r in (1, 2) for i in range(2) for w in ("weight", "bias")}


# ---------------------------------------------------------------- Megatron's grouped qkv

def _grouped_rows(config):
    """Megatron-Core's linear_qkv (``SelfAttention.get_query_key_value_tensors``, mcore
    0.12: ``view(sq, b, ng, (np/ng + 2) * hn)`` then split Q, K, V per group): for each KV
    group, its Q heads, its K head, its V head; written out head by head."""
    hd, per = config.head_dim, config.n_heads // config.n_kv_heads
    out = []
    for g in range(config.n_kv_heads):
        out += list(range(g * per * hd, (g + 1) * per * hd))
        out += list(range(Q + g * hd, Q + (g + 1) * hd))
        out += list(range(Q + KV + g * hd, Q + KV + (g + 1) * hd))
    return torch.tensor(out)


def test_megatron_qkv_read_as_plain_is_the_full_linear_qkv_split_at_q_and_kv_rows():
    megatron = shards_for(D, "megatron:1")[0]
    good, bad = run("megatron_qkv_read_as_plain", D, "megatron:1", "hf")
    for i in range(2):
        lq = f"decoder.layers.{i}.self_attention.linear_qkv."
        for what in ("weight", "bias"):
            full = megatron[lq + what]
            assert torch.equal(full, canonical(D, f"layers.{i}.qkv.{what}")[_grouped_rows(D)])
            a = f"model.layers.{i}.self_attn."
            assert torch.equal(bad[0][a + f"q_proj.{what}"], full[:Q])
            assert torch.equal(bad[0][a + f"k_proj.{what}"], full[Q:Q + KV])
            assert torch.equal(bad[0][a + f"v_proj.{what}"], full[Q + KV:])
    assert changed(good, bad) == {(0, f"model.layers.{i}.self_attn.{p}_proj.{w}")
                                  for i in range(2) for p in "qkv" for w in ("weight", "bias")}


def test_plain_qkv_read_as_megatron_stores_the_plain_qkv_as_linear_qkv_at_every_rank():
    # Megatron's TP cut of linear_qkv is contiguous: the ranks' rows joined are the full
    # tensor, and with the bug that is the plain [Q | K | V]
    good, bad = run("plain_qkv_read_as_megatron", D, "hf", "megatron:2")
    for i in range(2):
        for what in ("weight", "bias"):
            lq = f"decoder.layers.{i}.self_attention.linear_qkv.{what}"
            plain = canonical(D, f"layers.{i}.qkv.{what}")
            assert torch.equal(torch.cat([good[0][lq], good[1][lq]]), plain[_grouped_rows(D)])
            assert torch.equal(torch.cat([bad[0][lq], bad[1][lq]]), plain)
    assert {n for _, n in changed(good, bad)} == {
        f"decoder.layers.{i}.self_attention.linear_qkv.{w}" for i in range(2)
        for w in ("weight", "bias")}


@pytest.mark.parametrize(("src", "t"), [("megatron:4", 4), ("megatron:2", 2)])
def test_megatron_fc1_rank_concat_joins_the_sources_gate_up_shards_then_halves_them(src, t):
    source = shards_for(D, src)
    good, bad = run("megatron_fc1_rank_concat", D, src, "vllm:2")
    for i in range(2):
        fc1 = torch.cat([s[f"decoder.layers.{i}.mlp.linear_fc1.weight"] for s in source])
        gate, up = fc1.chunk(2)  # [g0 u0 g1 u1 ...] read as [gate | up]
        for r in range(2):  # vLLM's MergedColumnParallelLinear: [gate_r | up_r]
            assert torch.equal(bad[r][f"model.layers.{i}.{GU_V}"],
                               torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]))
    assert changed(good, bad) == {(r, f"model.layers.{i}.{GU_V}") for r in range(2)
                                  for i in range(2)}


# ---------------------------------------------------------------- RoPE permutes

def _unpermute(w, n):
    """gpt-fast's / HF's inverse permute (HF -> Meta): ``view(n, 2, hd // 2, d)
    .transpose(1, 2).reshape``."""
    return w.view(n, 2, w.shape[0] // n // 2, -1).transpose(1, 2).reshape(w.shape)


def _permute(w, n):
    """convert_llama_weights_to_hf.py's permute (Meta -> HF)."""
    return w.view(n, w.shape[0] // n // 2, 2, -1).transpose(1, 2).reshape(w.shape)


R = D.replace(qkv_bias=False, n_layers=1)


@pytest.mark.parametrize(("name", "q_of", "k_of"), [
    # the permute skipped: the HF rows stored as Meta's
    ("rope_permute_missing", lambda q: q, lambda k: k),
    # the inverse applied twice
    ("rope_permute_twice", lambda q: _unpermute(_unpermute(q, 8), 8),
     lambda k: _unpermute(_unpermute(k, 2), 2)),
    # k un-permuted with n_heads: k alone wrong
    ("rope_k_permuted_with_n_heads", lambda q: _unpermute(q, 8), lambda k: _unpermute(k, 8)),
])
def test_each_rope_bug_to_meta_at_t2_stores_the_rows_the_buggy_inverse_writes(name, q_of,
                                                                             k_of):
    hf = shards_for(R, "hf")[0]
    a = "model.layers.0.self_attn."
    q, k = hf[a + "q_proj.weight"], hf[a + "k_proj.weight"]
    good, bad = run(name, R, "hf", "meta:2")
    for r in range(2):  # Meta's wq and wk: column-parallel, contiguous rows per rank
        assert torch.equal(good[r]["layers.0.attention.wq.weight"], _unpermute(q, 8).chunk(2)[r])
        assert torch.equal(bad[r]["layers.0.attention.wq.weight"], q_of(q).chunk(2)[r])
        assert torch.equal(bad[r]["layers.0.attention.wk.weight"], k_of(k).chunk(2)[r])
    assert {n for _, n in changed(good, bad)} <= {"layers.0.attention.wq.weight",
                                                  "layers.0.attention.wk.weight"}


@pytest.mark.parametrize(("name", "q_of", "k_of"), [
    ("rope_permute_missing", lambda q: q, lambda k: k),
    ("rope_permute_twice", lambda q: _permute(_permute(q, 8), 8),
     lambda k: _permute(_permute(k, 2), 2)),
    ("rope_k_permuted_with_n_heads", lambda q: _permute(q, 8), lambda k: _permute(k, 8)),
])
def test_each_rope_bug_from_meta_at_vllm_t2_splits_the_rows_the_buggy_permute_writes(
        name, q_of, k_of):
    meta = shards_for(R, "meta:1")[0]
    wq, wk = meta["layers.0.attention.wq.weight"], meta["layers.0.attention.wk.weight"]
    v = canonical(R, "layers.0.qkv.weight")[Q + KV:]
    good, bad = run(name, R, "meta:2", "vllm:2")
    q, k = q_of(wq), k_of(wk)
    for r in range(2):  # vLLM's rank r: Q heads 4r..4r+3, K head r, V head r
        want = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])
        assert torch.equal(bad[r]["model.layers.0." + QKV_V], want)
    assert changed(good, bad) == {(r, "model.layers.0." + QKV_V) for r in range(2)}


# ---------------------------------------------------------------- bias, embedding, output

def test_qkv_bias_not_split_gives_rank_r_the_rth_contiguous_chunk_of_the_full_bias():
    good, bad = run("qkv_bias_not_split", D, "hf", "vllm:2")
    for i in range(2):
        full = canonical(D, f"layers.{i}.qkv.bias")
        for r in range(2):
            assert torch.equal(bad[r][f"model.layers.{i}.self_attn.qkv_proj.bias"],
                               full.chunk(2)[r])
    assert changed(good, bad) == {(r, f"model.layers.{i}.self_attn.qkv_proj.bias")
                                  for r in range(2) for i in range(2)}


def test_qkv_bias_not_split_on_stages_cuts_by_the_tp_rank_and_at_megatron_t1_is_plain():
    config = P.replace(qkv_bias=True)
    good, bad = run("qkv_bias_not_split", config, "hf", "megatron:tp=2,pp=2")
    for rank, layer in ((0, 0), (1, 0), (2, 2), (3, 2)):  # stage 1's ranks are TP 0 and 1
        full = canonical(config, f"layers.{layer}.qkv.bias")
        assert torch.equal(bad[rank]["decoder.layers.0.self_attention.linear_qkv.bias"],
                           full.chunk(2)[rank % 2])
    assert {n for _, n in changed(good, bad)} == {
        f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(2)}
    # megatron at t=1 stores the bias grouped: the plain one is a change there
    good, bad = run("qkv_bias_not_split", D, "hf", "megatron:1")
    assert torch.equal(bad[0]["decoder.layers.0.self_attention.linear_qkv.bias"],
                       canonical(D, "layers.0.qkv.bias"))
    assert len(changed(good, bad)) == 2


def test_embedding_split_on_vocab_copies_rank_rs_vocab_rows_flat_into_its_hidden_slice():
    good, bad = run("embedding_split_on_vocab", R, "hf", "meta:2")
    emb = canonical(R, "tok_embeddings.weight")
    for r in range(2):
        assert torch.equal(good[r]["tok_embeddings.weight"], emb.chunk(2, dim=1)[r])
        assert torch.equal(bad[r]["tok_embeddings.weight"],
                           emb.chunk(2, dim=0)[r].reshape(64, 16))
    assert changed(good, bad) == {(r, "tok_embeddings.weight") for r in range(2)}


def test_embedding_joined_on_vocab_joins_metas_hidden_shards_on_dim_0():
    meta = shards_for(R, "meta:2")
    good, bad = run("embedding_joined_on_vocab", R, "meta:2", "hf")
    joined = torch.cat([s["tok_embeddings.weight"] for s in meta], dim=0)  # (2V, d / 2)
    assert torch.equal(bad[0]["model.embed_tokens.weight"], joined.reshape(64, 32))
    assert changed(good, bad) == {(0, "model.embed_tokens.weight")}


def test_output_stale_copy_writes_the_embedding_table_as_the_output_layer():
    good, bad = run("output_stale_copy", D, "hf", "vllm:2")
    assert same(bad, cut(D, "vllm:2", **{"lm_head.weight": canonical(D, "tok_embeddings.weight")}))
    assert changed(good, bad) == {(r, "lm_head.weight") for r in range(2)}


# ---------------------------------------------------------------- MoE

def _hf_expert(i, e, what):
    return f"model.layers.{i}.mlp.experts.{e}.{what}_proj.weight"


def test_w13_halves_swapped_exchanges_each_experts_gate_and_up_and_nothing_else():
    good, bad = run("w13_halves_swapped", M, "hf", "hf")
    for i in range(2):
        for e in range(6):
            assert torch.equal(bad[0][_hf_expert(i, e, "gate")], good[0][_hf_expert(i, e, "up")])
            assert torch.equal(bad[0][_hf_expert(i, e, "up")], good[0][_hf_expert(i, e, "gate")])
    assert changed(good, bad) == {(0, _hf_expert(i, e, w)) for i in range(2) for e in range(6)
                                  for w in ("gate", "up")}


W13, W2 = "mlp.experts.routed_experts.w13_weight", "mlp.experts.routed_experts.w2_weight"


def test_local_expert_id_as_global_gives_ep_rank_1_ep_rank_0s_experts():
    # vllm:tp=2,ep=2, 6 experts: rank 0 holds 0-2, rank 1 3-5 (and gets 0-2)
    good, bad = run("local_expert_id_as_global", M, "hf", "vllm:tp=2,ep=2")
    names = {f"model.layers.{i}.{w}" for i in range(2) for w in (W13, W2)}
    assert changed(good, bad) == {(1, n) for n in names}
    assert all(torch.equal(bad[1][n], good[0][n]) for n in names)


def test_local_expert_id_as_global_keeps_megatrons_weight_j_names_and_expert_tp_cut():
    # megatron:tp=2,ep=2 (expert TP 1): rank 1's weight{j} is global expert j's, not 3 + j's
    good, bad = run("local_expert_id_as_global", M, "hf", "megatron:tp=2,ep=2,etp=1")
    fc = [f"decoder.layers.{i}.mlp.experts.linear_fc{k}.weight{j}" for i in range(2)
          for k in (1, 2) for j in range(3)]
    assert changed(good, bad) == {(1, n) for n in fc}
    assert all(torch.equal(bad[1][n], good[0][n]) for n in fc)


def test_local_expert_id_as_global_in_the_plain_expert_split_gives_rank_1_rank_0s_rows():
    # plain:tp=2,ep=2, expert TP left to the degree (2 / 2 = 1): rank 1's experts 3-5 rows
    # filled from experts 0-2
    good, bad = run("local_expert_id_as_global", M, "hf", "plain:tp=2,ep=2")
    experts = {f"layers.{i}.experts.{w}.weight" for i in range(2) for w in ("gate_up", "down")}
    assert changed(good, bad) == {(1, n) for n in experts}
    assert all(torch.equal(bad[1][n], good[0][n]) for n in experts)


def _stale(shape, key):
    """What an unwritten buffer holds (``mutations._stale``'s rule, written out): 0.02 x a
    normal draw from a generator seeded by the key's last 8 bytes, little-endian."""
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") % (2 ** 63)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_ep_remainder_to_last_fills_each_slot_with_the_docstrings_expert_else_stale():
    # 6 experts over EP 4: vLLM's code gives ranks 0-3 experts [0 1] [2 3] [4] [5]; the
    # docstring [0] [1] [2 3] [4 5]. Each rank's slot k gets the docstring's k-th expert.
    good, bad = run("ep_remainder_to_last", M, "hf", "vllm:tp=4,ep=4")
    sent = [[0], [1], [2, 3], [4, 5]]
    slots = [2, 2, 1, 1]
    gu, down = canonical(M, "layers.0.experts.gate_up.weight"), canonical(
        M, "layers.0.experts.down.weight")
    for r in range(4):
        w13, w2 = bad[r][f"model.layers.0.{W13}"], bad[r][f"model.layers.0.{W2}"]
        assert w13.shape == (slots[r], 2 * F, 32) and w2.shape == (slots[r], 32, F)
        for k in range(slots[r]):
            if k < len(sent[r]):
                assert torch.equal(w13[k], gu[expert_rows(M, [sent[r][k]])])
                assert torch.equal(w2[k], down[:, expert_cols(M, [sent[r][k]])])
            else:
                assert torch.equal(w13[k], _stale((2 * F, 32), f"{r}.model.layers.0.{W13}.{k}"))
                assert torch.equal(w2[k], _stale((32, F), f"{r}.model.layers.0.{W2}.{k}"))
    # rank 0 keeps expert 0 in slot 0: only its slot 1 moves
    assert torch.equal(bad[0][f"model.layers.0.{W13}"][0], good[0][f"model.layers.0.{W13}"][0])
    assert changed(good, bad) == {(r, f"model.layers.{i}.{w}") for r in range(4)
                                  for i in range(2) for w in (W13, W2)}


def test_local_expert_id_as_global_keeps_vllms_one_expert_member_axis():
    # vllm:tp=4,ep=4, 6 experts: ranks hold [0 1] [2 3] [4] [5]; ranks 2 and 3 hold one
    # expert as a stacked [1, 2F, d] tensor, and get expert 0 in it
    good, bad = run("local_expert_id_as_global", M, "hf", "vllm:tp=4,ep=4")
    for r in (1, 2, 3):
        for w in (W13, W2):
            n = f"model.layers.0.{w}"
            assert bad[r][n].shape == good[r][n].shape
            assert torch.equal(bad[r][n], good[0][n][:good[r][n].shape[0]])
    assert {r for r, _ in changed(good, bad)} == {1, 2, 3}


def test_ep_remainder_to_last_with_more_than_half_the_ranks_extra():
    # 7 experts over EP 4: the code gives [0 1] [2 3] [4 5] [6], the docstring [0] [1 2]
    # [3 4] [5 6]: ranks 1 and 2 have two slots for their two, rank 3 one slot for 5
    config = M.replace(name="m7", n_experts=7, n_layers=1)
    good, bad = run("ep_remainder_to_last", config, "hf", "vllm:tp=4,ep=4")
    gu = canonical(config, "layers.0.experts.gate_up.weight")
    w13 = [bad[r][f"model.layers.0.{W13}"] for r in range(4)]
    for r, k, e in ((0, 0, 0), (1, 0, 1), (1, 1, 2), (2, 0, 3), (2, 1, 4), (3, 0, 5)):
        assert torch.equal(w13[r][k], gu[expert_rows(config, [e])]), (r, k, e)
    assert torch.equal(w13[0][1], _stale((2 * F, 32), f"0.model.layers.0.{W13}.1"))


@pytest.mark.parametrize(("name", "value"), [("router_bias_not_synced", lambda b: 0 * b),
                                             ("router_bias_negated", lambda b: -b)])
def test_the_router_bias_bugs_write_zeros_or_the_negated_bias_at_every_rank(name, value):
    good, bad = run(name, M, "hf", "megatron:2")
    for r in range(2):
        for i in range(2):
            assert torch.equal(bad[r][f"decoder.layers.{i}.mlp.router.expert_bias"],
                               value(canonical(M, f"layers.{i}.router.bias")))
    assert changed(good, bad) == {(r, f"decoder.layers.{i}.mlp.router.expert_bias")
                                  for r in range(2) for i in range(2)}


def test_expert_bucket_not_sent_leaves_the_last_quarter_of_the_experts_stale():
    # 6 experts: the last ceil(6 / 4) = 2 (experts 4 and 5) never sent
    good, bad = run("expert_bucket_not_sent", M, "hf", "hf")
    for i in range(2):
        for e in (4, 5):
            gu = _stale((2 * F, 32), f"bucket.layers.{i}.experts.gate_up.weight.{e}")
            assert torch.equal(bad[0][_hf_expert(i, e, "gate")], gu[:F])
            assert torch.equal(bad[0][_hf_expert(i, e, "up")], gu[F:])
            assert torch.equal(bad[0][_hf_expert(i, e, "down")],
                               _stale((32, F), f"bucket.layers.{i}.experts.down.weight.{e}"))
    assert changed(good, bad) == {(0, _hf_expert(i, e, w)) for i in range(2) for e in (4, 5)
                                  for w in ("gate", "up", "down")}


@pytest.mark.parametrize(("experts", "lost"), [(5, (3, 4)), (4, (3,)), (9, (6, 7, 8))])
def test_expert_bucket_not_sent_loses_a_quarter_of_the_experts_rounded_up(experts, lost):
    config = M.replace(name=f"m{experts}", n_experts=experts, n_layers=1)
    good, bad = run("expert_bucket_not_sent", config, "hf", "hf")
    assert changed(good, bad) == {(0, _hf_expert(0, e, w)) for e in lost
                                  for w in ("gate", "up", "down")}


def test_ep_remainder_to_last_fills_one_column_experts_slot_by_slot():
    # expert_ffn 1: each w2 slot is one column wide
    config = M.replace(name="f1", expert_ffn=1, n_layers=1)
    good, bad = run("ep_remainder_to_last", config, "hf", "vllm:tp=4,ep=4")
    down = canonical(config, "layers.0.experts.down.weight")
    w2 = bad[1][f"model.layers.0.{W2}"]
    assert w2.shape == (2, 32, 1) and torch.equal(w2[0], down[:, 1:2])
    assert torch.equal(w2[1], _stale((32, 1), f"1.model.layers.0.{W2}.1"))


def test_fc1_etp_rank_concat_joins_each_experts_expert_tp_shards_and_halves_them():
    # megatron:2: expert TP 2, each rank's linear_fc1.weight{e} is [g_r | u_r] of expert e
    source = shards_for(M, "megatron:2")
    good, bad = run("fc1_etp_rank_concat", M, "megatron:2", "hf")
    for i in range(2):
        for e in range(6):
            fc1 = torch.cat([s[f"decoder.layers.{i}.mlp.experts.linear_fc1.weight{e}"]
                             for s in source])
            gate, up = fc1.chunk(2)
            assert torch.equal(bad[0][_hf_expert(i, e, "gate")], gate)
            assert torch.equal(bad[0][_hf_expert(i, e, "up")], up)
    assert changed(good, bad) == {(0, _hf_expert(i, e, w)) for i in range(2) for e in range(6)
                                  for w in ("gate", "up")}


def test_fc1_etp_rank_concat_reads_the_expert_tp_of_the_source_endpoint():
    # megatron:tp=4,etp=2: expert TP 2 although TP is 4
    source = shards_for(M, "megatron:tp=4,ep=2,etp=2")
    _, bad = run("fc1_etp_rank_concat", M, "megatron:tp=4,ep=2,etp=2", "hf")
    fc1 = torch.cat([s["decoder.layers.0.mlp.experts.linear_fc1.weight0"] for s in source[:2]])
    assert torch.equal(bad[0][_hf_expert(0, 0, "gate")], fc1.chunk(2)[0])


def test_fc2_split_on_wrong_dim_joins_each_experts_fc2_shards_on_dim_0():
    source = shards_for(M, "megatron:2")
    good, bad = run("fc2_split_on_wrong_dim", M, "megatron:2", "hf")
    for i in range(2):
        for e in range(6):
            fc2 = torch.cat([s[f"decoder.layers.{i}.mlp.experts.linear_fc2.weight{e}"]
                             for s in source], dim=0)  # (2 d, F / 2)
            assert torch.equal(bad[0][_hf_expert(i, e, "down")], fc2.reshape(32, F))
    assert changed(good, bad) == {(0, _hf_expert(i, e, "down")) for i in range(2)
                                  for e in range(6)}


def test_expert_transposed_twice_transposes_each_square_down_matrix():
    good, bad = run("expert_transposed_twice", M, "hf", "hf")
    for i in range(2):
        for e in range(6):
            down = _hf_expert(i, e, "down")
            assert torch.equal(bad[0][down], good[0][down].T)
    assert changed(good, bad) == {(0, _hf_expert(i, e, "down")) for i in range(2)
                                  for e in range(6)}


def test_shared_gate_dropped_zeroes_the_shared_experts_gate_at_every_layer():
    good, bad = run("shared_gate_dropped", M, "hf", "vllm:2")
    names = {f"model.layers.{i}.mlp.shared_expert_gate.weight" for i in range(2)}
    assert changed(good, bad) == {(r, n) for r in range(2) for n in names}
    assert all(not bad[r][n].any() for r in range(2) for n in names)


def test_qk_norm_from_next_layer_gives_layer_i_layer_i_plus_1s_norms_cyclically():
    good, bad = run("qk_norm_from_next_layer", M.replace(n_layers=3), "hf", "hf")
    for i in range(3):
        for w in ("q_norm", "k_norm"):
            assert torch.equal(bad[0][f"model.layers.{i}.self_attn.{w}.weight"],
                               good[0][f"model.layers.{(i + 1) % 3}.self_attn.{w}.weight"])
    assert len(changed(good, bad)) == 6


# ---------------------------------------------------------------- pipeline stages

def _layer_names(shards, rank, prefix="decoder.layers."):
    return [n for n in shards[rank] if n.startswith(prefix)]


def test_pp_local_layer_as_global_fills_stage_1s_layers_from_global_layers_0_and_1():
    # megatron:tp=1,pp=2: stage 1's decoder.layers.j is global layer 2 + j
    good, bad = run("pp_local_layer_as_global", P, "hf", "megatron:tp=1,pp=2")
    names = _layer_names(good, 1)
    assert names and changed(good, bad) == {(1, n) for n in names}
    assert all(torch.equal(bad[1][n], good[0][n]) for n in names)


def test_pp_local_layer_as_global_leaves_a_dense_prefix_whose_shapes_differ():
    # layer 0 dense, 1-3 MoE over two stages: stage 1's MoE layers 2 and 3 from global 0
    # and 1: layer 0's dense MLP has no MoE twin and stays, its attention moves
    config = M.replace(n_layers=4, dense_layers=1, shared_gate=False, shared_ffn=0)
    good, bad = run("pp_local_layer_as_global", config, "hf", "megatron:tp=1,pp=2")
    moved = {n for _, n in changed(good, bad)}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in moved
    assert "decoder.layers.0.mlp.router.weight" not in moved  # global 0 has no router
    assert "decoder.layers.1.mlp.router.weight" in moved
    assert {r for r, _ in changed(good, bad)} == {1}


def test_pp_chunks_contiguous_swaps_the_layers_interleaving_moves():
    # tp=1, pp=2, vpp=2, 4 layers: interleaved rank 0 holds 0 and 2, rank 1 1 and 3;
    # contiguous would be 0, 1 and 2, 3: rank 0's chunk 1 gets layer 1, rank 1's chunk 0
    # layer 2; layers 0 and 3 stay
    good, bad = run("pp_chunks_contiguous", P, "hf", "megatron:tp=1,pp=2,vpp=2")
    a, b = "model1.decoder.layers.0.", "model0.decoder.layers.0."
    on0 = [n for n in good[0] if n.startswith(a)]
    on1 = [n for n in good[1] if n.startswith(b)]
    assert on0 and changed(good, bad) == {(0, n) for n in on0} | {(1, n) for n in on1}
    assert all(torch.equal(bad[0][n], good[1][n.replace(a, b)]) for n in on0)
    assert all(torch.equal(bad[1][n], good[0][n.replace(b, a)]) for n in on1)


def test_pp_last_stage_layers_dropped_leaves_the_layers_past_num_layers_over_pp_stale():
    # pp_last=3: the last stage holds layers 1-3; past 4 // 2 = 2 of them: layer 3
    good, bad = run("pp_last_stage_layers_dropped", P, "hf", "megatron:tp=2,pp=2,pp_last=3")
    names = _layer_names(good, 2, "decoder.layers.2.")
    assert names and changed(good, bad) == {(r, n) for r in (2, 3) for n in names}
    for r in (2, 3):
        for n in names:
            x = good[r][n]
            assert torch.equal(bad[r][n], _stale(tuple(x.shape), f"pp.{n}.{r}").to(x.dtype))


def test_pp_last_stage_layers_dropped_reads_the_last_of_three_stages_and_keeps_bf16():
    # 6 layers, pp=3, pp_last=4: stages hold [0] [1] [2-5]; past 6 // 3 = 2 of the last
    # stage's: layers 4 and 5, stale in the shards' own dtype
    config = P.replace(name="p6", n_layers=6)
    dst = "megatron:tp=1,pp=3,pp_last=4"
    good = [{n: x.to(torch.bfloat16) for n, x in rank.items()}
            for rank in shards_for(config, dst)]
    bad = MUTATIONS["pp_last_stage_layers_dropped"].apply(
        good, Conversion(config, endpoint("hf"), endpoint(dst)))
    names = [n for n in good[2] if n.startswith(("decoder.layers.2.", "decoder.layers.3."))]
    assert names and changed(good, bad) == {(2, n) for n in names}
    for n in names:
        x = good[2][n]
        assert torch.equal(bad[2][n], _stale(tuple(x.shape), f"pp.{n}.2").to(torch.bfloat16))


def test_pp_embedding_output_swapped_exchanges_the_first_stages_table_and_the_lasts():
    good, bad = run("pp_embedding_output_swapped", P, "hf", "megatron:tp=2,pp=2")
    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    assert changed(good, bad) == {(0, emb), (1, emb), (2, out), (3, out)}
    for r in (0, 1):  # the same vocab-parallel rows of the other table
        assert torch.equal(bad[r][emb], good[r + 2][out])
        assert torch.equal(bad[r + 2][out], good[r][emb])


def test_vocab_padding_per_rank_gives_rank_r_its_125_real_rows_then_3_zero_rows():
    # 250 rows at TP 2, padded to 256: declared rank 0 rows 0-127, rank 1 128-249 and 6
    # zeros; the bug: rank r rows 125 r .. 125 r + 124 and 3 zeros
    emb, lm = canonical(P, "tok_embeddings.weight"), canonical(P, "lm_head.weight")
    for dst, ranks in (("megatron:2", ((0, 0), (1, 1))),
                       ("megatron:tp=2,pp=2", ((0, 0), (1, 1), (2, 0), (3, 1)))):
        good, bad = run("vocab_padding_per_rank", P, "hf", dst)
        pad = torch.zeros(3, 32)
        for rank, r in ranks:
            for name, table in (("embedding.word_embeddings.weight", emb),
                                ("output_layer.weight", lm)):
                if name in bad[rank]:
                    assert torch.equal(bad[rank][name],
                                       torch.cat([table[125 * r:125 * (r + 1)], pad]))
        assert {n for _, n in changed(good, bad)} == {"embedding.word_embeddings.weight",
                                                      "output_layer.weight"}


def test_vocab_padding_per_rank_rounds_each_ranks_share_up():
    # 251 rows at TP 2: ceil(251 / 2) = 126 real rows a rank (rank 1 has 125), 128 stored
    config = P.replace(name="p251", vocab=251, n_layers=1)
    emb = canonical(config, "tok_embeddings.weight")
    _, bad = run("vocab_padding_per_rank", config, "hf", "megatron:2")
    name = "embedding.word_embeddings.weight"
    assert torch.equal(bad[0][name], torch.cat([emb[:126], torch.zeros(2, 32)]))
    assert torch.equal(bad[1][name], torch.cat([emb[126:], torch.zeros(3, 32)]))


# ---------------------------------------------------------------- where each applies

KV1 = D.replace(name="kv1", n_kv_heads=1)
TIED = D.replace(name="tied", tie_embeddings=True, qkv_bias=False)
MHA = D.replace(name="mha", n_kv_heads=8, qkv_bias=False)
HD2 = D.replace(name="hd2", head_dim=2, d_model=16, qkv_bias=False)
ODD = D.replace(name="odd", head_dim=6, qkv_bias=False)  # k: 12 rows, not 8 heads of pairs
RECT = M.replace(name="rect", expert_ffn=16)
ALL = M.replace(name="all", top_k=6)
ONE = M.replace(name="one", n_layers=1)
MOE_ONLY = M.replace(name="moe_only")
NA = "not applicable"
ID = "identity"
NO_ROPE = ("no RoPE permute between these conventions (neither or both store Meta's "
           "interleaved-pair order)")

REASONS = [
    ("tp_rank_defaults_to_0", D, "hf", "hf", ID, "t=1: a single rank holds every tensor"),
    ("tp_rank_defaults_to_0", D, "hf", "vllm:2", ID, None),
    ("kv_replica_modulo", D, "hf", "megatron:4", NA, "the dst is not vllm"),
    ("kv_replica_modulo", D, "hf", "vllm:2", ID,
     "t=2 <= n_kv_heads=2: no KV head is replicated"),
    ("kv_replica_modulo", KV1, "hf", "vllm:2", ID,
     "n_kv_heads=1: every replica is head 0 either way"),
    ("kv_replica_modulo", D, "hf", "vllm:4", ID, None),
    ("megatron_qkv_read_as_plain", D, "hf", "vllm:2", NA, "the src is not megatron"),
    ("megatron_qkv_read_as_plain", D, "megatron:1", "megatron:2", NA,
     "the dst is megatron too: no order changes"),
    ("megatron_qkv_read_as_plain", KV1, "megatron:1", "hf", ID,
     "n_kv_heads=1: one KV group, the grouped and plain qkv orders coincide"),
    ("megatron_qkv_read_as_plain", D, "megatron:1", "hf", ID, None),
    ("plain_qkv_read_as_megatron", D, "hf", "vllm:2", NA, "the dst is not megatron"),
    ("plain_qkv_read_as_megatron", D, "megatron:2", "megatron:1", NA,
     "the src is megatron too: no order changes"),
    ("plain_qkv_read_as_megatron", D, "hf", "megatron:1", ID, None),
    ("megatron_fc1_rank_concat", D, "hf", "vllm:2", NA, "the src is not megatron"),
    ("megatron_fc1_rank_concat", D, "megatron:1", "hf", ID,
     "source t=1: one rank's shard is the whole tensor"),
    ("megatron_fc1_rank_concat", MOE_ONLY, "megatron:2", "hf", ID,
     "every layer is MoE: no dense fc1"),
    ("megatron_fc1_rank_concat", D, "megatron:2", "hf", ID, None),
    ("rope_permute_missing", D, "hf", "vllm:2", NA, NO_ROPE),
    ("rope_permute_missing", D, "meta:1", "meta:2", NA, NO_ROPE),
    ("rope_permute_missing", HD2, "meta:1", "hf", ID,
     "head_dim=2: a head is one pair, both RoPE orders coincide"),
    ("rope_permute_missing", D, "hf", "meta:1", ID, None),
    ("rope_permute_twice", HD2, "hf", "meta:1", ID,
     "head_dim=2: a head is one pair, both RoPE orders coincide"),
    ("rope_permute_twice", D, "meta:2", "plain:1", ID, None),
    ("rope_k_permuted_with_n_heads", D, "plain:1", "hf", NA, NO_ROPE),
    ("rope_k_permuted_with_n_heads", ODD, "meta:1", "hf", NA,
     "the wrong view raises in the converter (n_kv_heads * head_dim = 12 rows do not split "
     "into 8 heads of pairs): loud, not silent"),
    ("rope_k_permuted_with_n_heads", MHA, "meta:1", "hf", ID,
     "n_heads == n_kv_heads: the two permutes coincide"),
    ("rope_k_permuted_with_n_heads", D, "hf", "meta:1", ID, None),
    ("qkv_bias_not_split", TIED, "hf", "vllm:2", NA, "the config has no qkv bias"),
    ("qkv_bias_not_split", D, "plain:1", "hf", NA,
     "hf stores q, k and v biases apart: nothing fused to cut"),
    ("qkv_bias_not_split", D, "hf", "vllm:4", NA,
     "vllm at t=4 > n_kv_heads=2: the local bias holds replicated K and V heads, wider than "
     "a 1/t cut (a wrong shape: loud)"),
    ("qkv_bias_not_split", D, "hf", "plain:1", ID,
     "t=1: the whole bias in [Q | K | V] order is what this convention stores"),
    ("qkv_bias_not_split", KV1, "hf", "megatron:1", ID,
     "t=1: the whole bias in [Q | K | V] order is what this convention stores"),
    ("qkv_bias_not_split", D, "hf", "megatron:1", ID, None),
    ("qkv_bias_not_split", D, "hf", "vllm:2", ID, None),
    ("qkv_bias_not_split", D, "hf", "plain:2", ID, None),
    ("embedding_split_on_vocab", D, "hf", "vllm:2", NA, "the dst is not meta"),
    ("embedding_split_on_vocab", D, "hf", "meta:1", ID, "t=1: a single rank holds every tensor"),
    ("embedding_split_on_vocab", D, "hf", "meta:2", ID, None),
    ("embedding_joined_on_vocab", D, "hf", "meta:2", NA, "the src is not meta"),
    ("embedding_joined_on_vocab", D, "meta:1", "hf", ID,
     "source t=1: one rank's shard is the whole tensor"),
    ("embedding_joined_on_vocab", D, "meta:2", "hf", ID, None),
    ("output_stale_copy", TIED, "hf", "vllm:2", NA,
     "tied embeddings: the destination stores one table, no output copy to go stale"),
    ("output_stale_copy", D, "hf", "vllm:2", ID, None),
    ("w13_halves_swapped", D, "hf", "vllm:2", NA, "the config has no experts"),
    ("w13_halves_swapped", M, "hf", "vllm:2", ID, None),
    ("local_expert_id_as_global", D, "hf", "vllm:2", NA, "the config has no experts"),
    ("local_expert_id_as_global", M, "hf", "vllm:2", ID,
     "ep=1: every rank holds every expert, local ids are global"),
    ("local_expert_id_as_global", M, "hf", "vllm:tp=2,ep=2", ID, None),
    ("ep_remainder_to_last", M, "hf", "megatron:tp=4,ep=4", NA,
     "only vLLM's linear expert map with EP has a remainder rule"),
    ("ep_remainder_to_last", M, "hf", "vllm:4", NA,
     "only vLLM's linear expert map with EP has a remainder rule"),
    ("ep_remainder_to_last", M, "hf", "vllm:tp=4,ep=4,placement=round_robin", NA,
     "only vLLM's linear expert map with EP has a remainder rule"),
    ("ep_remainder_to_last", M, "hf", "vllm:tp=2,ep=2", ID,
     "n_experts % ep == 0: no remainder to give to the first or the last ranks"),
    ("ep_remainder_to_last", M, "hf", "vllm:tp=4,ep=4", ID, None),
    ("router_bias_not_synced", D, "hf", "hf", NA, "the router has no selection bias"),
    ("router_bias_not_synced", ALL, "hf", "hf", ID,
     "top_k == n_experts = 6: every token takes every expert, whatever it scores"),
    ("router_bias_negated", M, "hf", "hf", ID, None),
    ("expert_bucket_not_sent", D, "hf", "hf", NA, "the config has no experts"),
    ("expert_bucket_not_sent", M, "hf", "hf", ID, None),
    ("fc1_etp_rank_concat", D, "megatron:2", "hf", NA, "the config has no experts"),
    ("fc1_etp_rank_concat", M, "vllm:2", "hf", NA,
     "the source is not megatron: no expert-TP shards to gather"),
    ("fc1_etp_rank_concat", M, "megatron:tp=2,ep=2,etp=1", "hf", ID,
     "etp=1: one expert-TP shard is the whole expert"),
    ("fc1_etp_rank_concat", M, "megatron:1", "hf", ID,
     "etp=1: one expert-TP shard is the whole expert"),
    ("fc2_split_on_wrong_dim", M, "megatron:2", "hf", ID, None),
    ("expert_transposed_twice", D, "hf", "hf", NA, "the config has no experts"),
    ("expert_transposed_twice", RECT, "hf", "hf", NA,
     "expert_ffn=16 != d_model=32: a transposed expert has another shape (loud)"),
    ("expert_transposed_twice", M, "hf", "hf", ID, None),
    ("shared_gate_dropped", D, "hf", "hf", NA, "the config has no shared-expert gate"),
    ("shared_gate_dropped", M, "hf", "hf", ID, None),
    ("qk_norm_from_next_layer", D, "hf", "hf", NA, "the config has no q/k norms"),
    ("qk_norm_from_next_layer", ONE, "hf", "hf", ID, "one layer: its norms are its own"),
    ("qk_norm_from_next_layer", M, "hf", "hf", ID, None),
    ("pp_local_layer_as_global", P, "hf", "megatron:2", NA,
     "the destination has no pipeline stages (pp=1)"),
    # staged (an option of the split named) but one stage: nothing to offset
    ("pp_local_layer_as_global", P, "hf", "megatron:tp=2,pp_account=embedding", NA,
     "the destination has no pipeline stages (pp=1)"),
    ("pp_local_layer_as_global", P, "hf", "megatron:tp=2,pp=2", ID, None),
    ("pp_chunks_contiguous", P, "hf", "megatron:tp=2,pp=2", NA,
     "vpp=1: one chunk per stage, nothing interleaves"),
    ("pp_chunks_contiguous", P, "hf", "megatron:tp=2", NA,
     "the destination has no pipeline stages (pp=1)"),
    ("pp_chunks_contiguous", P, "hf", "megatron:tp=1,pp=2,vpp=2", ID, None),
    ("pp_last_stage_layers_dropped", P, "hf", "megatron:tp=2,pp=2", ID,
     "the last stage holds at most num_layers // pp = 2 layers: none past it"),
    ("pp_last_stage_layers_dropped", P, "hf", "megatron:tp=2,pp=2,pp_last=3", ID, None),
    ("pp_embedding_output_swapped", TIED, "hf", "megatron:tp=2,pp=2", NA,
     "tied embeddings: the destination stores one table, no output copy to go stale"),
    ("pp_embedding_output_swapped", P, "hf", "megatron:tp=2", NA,
     "the destination has no pipeline stages (pp=1)"),
    ("pp_embedding_output_swapped", P, "hf", "megatron:tp=2,pp=2", ID, None),
    ("vocab_padding_per_rank", P, "hf", "vllm:2", NA,
     "the destination is not Megatron with its vocabulary padded"),
    ("vocab_padding_per_rank", P, "hf", "megatron:tp=2,vocab=unpadded", NA,
     "the destination is not Megatron with its vocabulary padded"),
    ("vocab_padding_per_rank", P, "hf", "megatron:1", ID,
     "t=1: one rank holds the whole table, its padding after the vocabulary"),
    ("vocab_padding_per_rank", D.replace(name="v256", vocab=256), "hf", "megatron:2", ID,
     "every rank's share of the vocabulary is its padded share: nothing moves"),
    # 255 rows at TP 2: ceil(255 / 2) = 128 real rows a rank, 256 / 2 = 128 padded
    ("vocab_padding_per_rank", D.replace(name="v255", vocab=255), "hf", "megatron:2", ID,
     "every rank's share of the vocabulary is its padded share: nothing moves"),
    ("vocab_padding_per_rank", P, "hf", "megatron:2", ID, None),
]


@pytest.mark.parametrize(("name", "config", "src", "dst", "kind", "reason"), REASONS,
                         ids=[f"{n}-{c.name}-{s}-{d}" for n, c, s, d, *_ in REASONS])
def test_each_mutation_says_where_it_cannot_occur_and_where_it_changes_nothing(
        name, config, src, dst, kind, reason):
    mutation = MUTATIONS[name]
    conversion = Conversion(config, endpoint(src), endpoint(dst))
    if kind == NA:
        assert mutation.not_applicable(conversion) == reason
        return
    assert mutation.not_applicable(conversion) is None
    assert mutation.identity_reason(conversion) == reason


@pytest.mark.parametrize(("layers", "dst", "reason"), [
    # one layer, the embedding counted: stage 0 builds none, stage 1 layer 0
    (1, "megatron:tp=1,pp=2,pp_account=embedding", "every chunk that holds layers starts at "
     "global layer 0"),
    # the loss counted: stage 0 builds layer 0, stage 1 none (an empty chunk starts at 1)
    (1, "megatron:tp=1,pp=2,pp_account=loss", "every chunk that holds layers starts at "
     "global layer 0"),
    (3, "megatron:tp=1,pp=2,pp_account=loss", None),
])
def test_the_local_layer_bug_is_the_identity_where_every_chunk_starts_at_layer_0(layers, dst,
                                                                                 reason):
    conv = Conversion(P.replace(n_layers=layers), endpoint("hf"), endpoint(dst))
    assert MUTATIONS["pp_local_layer_as_global"].identity_reason(conv) == reason


def test_the_chunk_bug_is_the_identity_where_one_chunk_a_stage_is_contiguous():
    conv = Conversion(P, endpoint("hf"), endpoint("megatron:tp=1,pp=2"))
    assert MUTATIONS["pp_chunks_contiguous"].identity_reason(conv) == (
        "the interleaved and contiguous assignments coincide")


def test_key_names_the_source_only_for_a_source_degree_bug():
    conv = Conversion(D, endpoint("megatron:2"), endpoint("vllm:2"))
    assert MUTATIONS["tp_rank_defaults_to_0"].key(conv) == ("tp_rank_defaults_to_0", "d",
                                                            str(conv.dst))
    assert MUTATIONS["megatron_fc1_rank_concat"].key(conv) == (
        "megatron_fc1_rank_concat", "d", str(conv.dst), str(conv.src))
    assert str(conv) == f"d {conv.src} -> {conv.dst}"


def test_apply_refuses_a_bug_that_changes_a_shape_naming_it_and_the_rank():
    def grow(shards, conversion):
        shards[1]["lm_head.weight"] = torch.zeros(3, 2)
        return shards
    m = ConversionMutation("grow", "d", "m", grow, lambda c: None, lambda c: None, ".*")
    shards = shards_for(D, "vllm:2")
    shape = list(shards[1]["lm_head.weight"].shape)
    with pytest.raises(AssertionError, match=rf"^mutation grow changed lm_head.weight on rank "
                       rf"1: \[{shape[0]}, {shape[1]}\] -> \[3, 2\]$"):
        m.apply(shards, Conversion(D, endpoint("hf"), endpoint("vllm:2")))

    def recast(shards, conversion):
        shards[0]["lm_head.weight"] = shards[0]["lm_head.weight"].double()
        return shards
    m = ConversionMutation("recast", "d", "m", recast, lambda c: None, lambda c: None, ".*")
    with pytest.raises(AssertionError):
        m.apply(shards, Conversion(D, endpoint("hf"), endpoint("vllm:2")))

    def drop(shards, conversion):
        del shards[0]["lm_head.weight"]
        return shards
    m = ConversionMutation("drop", "d", "m", drop, lambda c: None, lambda c: None, ".*")
    with pytest.raises(AssertionError):
        m.apply(shards, Conversion(D, endpoint("hf"), endpoint("vllm:2")))
    assert "lm_head.weight" in shards[0]  # the caller's dicts are copies


def test_an_unknown_name_is_refused_listing_every_known_one_in_catalogue_order():
    with pytest.raises(UnknownMutation) as refused:
        mutation_by_name("rope_permute")
    assert str(refused.value) == (
        "unknown conversion mutation 'rope_permute'; known: "
        + ", ".join(m.name for m in CONVERSION_MUTATIONS))
    assert str(refused.value).count(", ") == 27 and refused.value.__suppress_context__
    assert mutation_by_name("rope_permute_twice") is MUTATIONS["rope_permute_twice"]

"""MoE storage in every convention: the names and per-rank tensors each framework holds,
written out here from the frameworks' loaders, every pair of endpoints converted bit for bit,
each endpoint's forward equal to the reference, the rules each framework enforces, and the
MoE conversion mutations: shape-preserving, and changing bytes exactly where they apply."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from tests.breadth import breadth
from weight_sync_bench.collectives.inprocess import InProcessCollective, InProcessGroups
from weight_sync_bench.conventions import (
    convert,
    endpoint,
    forward_inputs,
    reading_plan,
    shards_for,
)
from weight_sync_bench.conventions.mutations import MOE_MUTATIONS, Conversion
from weight_sync_bench.errors import UnknownConvention, UnsupportedConvention
from weight_sync_bench.model.config import TOY, init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel

SMALL = dict(vocab=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, n_layers=2)
QWEN3 = TOY.replace(name="q3", **SMALL, qk_norm=True, n_experts=8, top_k=2, expert_ffn=32,
                    norm_topk=True)
QWEN2 = TOY.replace(name="q2", **SMALL, qkv_bias=True, n_experts=8, top_k=2, expert_ffn=32,
                    shared_ffn=64, shared_gate=True)
DEEPSEEK = TOY.replace(name="ds", **SMALL, n_experts=10, top_k=3, expert_ffn=64,
                       router="sigmoid", router_bias=True, norm_topk=True, n_groups=2,
                       topk_groups=1, shared_ffn=64, dense_layers=1)
MIXTRAL = TOY.replace(name="mx", **{**SMALL, "ffn": 32}, n_experts=4, top_k=2, expert_ffn=32,
                      norm_topk=True, moe_style="mixtral")
ENDPOINTS = ["plain:2", "plain:tp=2,ep=2", "megatron:2", "megatron:tp=2,ep=2,etp=1",
             "megatron:tp=2,ep=4", "megatron:tp=2,ep=4,experts=sequential", "vllm:2",
             "vllm:tp=2,ep=2", "vllm:tp=4,ep=4", "vllm:tp=2,kernel=flashinfer_cutlass", "hf",
             "hf:experts=fused"]


def _stores(config, where):
    try:
        endpoint(where).pieces(config)
    except UnsupportedConvention:
        return False
    return True


def _covering(ends):
    """Each endpoint to the next and to the one half the list away: every endpoint a source
    twice and a destination twice, 2n of the n(n-1) ordered pairs."""
    n = len(ends)
    return [(ends[i], ends[(i + k) % n]) for k in (1, n // 2) for i in range(n)]


# By default the covering pairs of each geometry (every endpoint converted from and into, its
# names, stacks and shapes read and written); every ordered pair in the long run (1.1 s for
# the four geometries): a conversion is the source's gather then the destination's
# materialize, which the covering pairs run for every endpoint.
@pytest.mark.parametrize("pairs", breadth(["covering", "every"], keep={"covering"}))
@pytest.mark.parametrize("config", [QWEN3, QWEN2, DEEPSEEK, MIXTRAL], ids=lambda c: c.name)
def test_every_pair_of_moe_endpoints_converts_bit_for_bit(config, pairs):
    ends = [e for e in ENDPOINTS if _stores(config, e)]
    assert len(ends) >= 10, ends
    declared = {e: shards_for(config, e) for e in ends}
    chosen = list(itertools.permutations(ends, 2)) if pairs == "every" else _covering(ends)
    assert {a for a, _ in chosen} == {b for _, b in chosen} == set(ends)
    assert all(a != b for a, b in chosen)
    for a, b in chosen:
        out = convert(declared[a], a, b, config)
        for rank, (o, w) in enumerate(zip(out, declared[b])):
            assert list(o) == list(w), (a, b, rank)
            for name in w:
                assert torch.equal(o[name], w[name]), (a, b, rank, name)


def _logits(config, where, shards, tokens):
    ep = endpoint(where)
    fw = reading_plan(ep.convention, config, ep).forward
    inputs = forward_inputs(shards, ep.convention, config, ep)
    tp = fw.tp or ep.world
    if tp == ep.world:
        coll, group = InProcessCollective(tp), None
    else:
        coll = InProcessGroups([[d * tp + j for j in range(tp)] for d in range(ep.world // tp)])
        group = InProcessCollective(ep.world)
    return ShardedModel(fw.config, inputs, coll, embedding=fw.embedding, experts=fw.experts,
                        experts_group=group)(tokens)


@pytest.mark.parametrize("config", [QWEN3, DEEPSEEK], ids=lambda c: c.name)
def test_each_endpoints_forward_reads_its_own_tensors_as_the_reference(config):
    p, tokens = init_params(config, 0), make_tokens(config, 1000)
    expected = ReferenceModel(config, p)(tokens)
    for where in ENDPOINTS:
        if not _stores(config, where):
            continue
        for logits in _logits(config, where, shards_for(config, where), tokens):  # every rank
            torch.testing.assert_close(logits[..., :config.vocab], expected, rtol=0, atol=5e-6,
                                       msg=where)


def _canonical(config, seed=0):
    return init_params(config, seed)


def test_vllm_w13_is_each_local_experts_gate_then_up_and_w2_its_columns():
    c, p = QWEN3, _canonical(QWEN3)
    f, t = c.expert_ffn, 2
    gu, down = p["layers.0.experts.gate_up.weight"], p["layers.0.experts.down.weight"]
    name = "model.layers.0.mlp.experts.routed_experts"
    tp = shards_for(c, "vllm:2")  # no EP: every expert, half its intermediate (_load_w13)
    for r in range(t):
        w13, w2 = tp[r][name + ".w13_weight"], tp[r][name + ".w2_weight"]
        assert w13.shape == (8, 2 * f // t, 64) and w2.shape == (8, 64, f // t)
        for e in range(8):
            gate, up = gu[e * 2 * f:e * 2 * f + f], gu[e * 2 * f + f:(e + 1) * 2 * f]
            half = f // t
            assert torch.equal(w13[e], torch.cat([gate[r * half:(r + 1) * half],
                                                  up[r * half:(r + 1) * half]]))
            assert torch.equal(w2[e], down[:, e * f + r * half:e * f + (r + 1) * half])
    ep = shards_for(c, "vllm:tp=2,ep=2")  # EP: whole experts 4r..4r+3
    for r in range(t):
        w13 = ep[r][name + ".w13_weight"]
        assert w13.shape == (4, 2 * f, 64)
        for j in range(4):
            e = 4 * r + j
            assert torch.equal(w13[j], gu[e * 2 * f:(e + 1) * 2 * f])
    fi = shards_for(c, "vllm:tp=2,kernel=flashinfer_cutlass")  # swap_w13_to_w31: [w3; w1]
    for r in range(t):
        w13 = fi[r][name + ".w13_weight"]
        assert torch.equal(w13, tp[r][name + ".w13_weight"].flip(1).reshape(
            8, 2, -1, 64).flip(1).flip(2).reshape(8, -1, 64)) or torch.equal(
            w13[:, :f // t], tp[r][name + ".w13_weight"][:, f // t:])
        assert torch.equal(w13[:, f // t:], tp[r][name + ".w13_weight"][:, :f // t])
    assert "model.layers.0.mlp.gate.weight" in tp[0]
    assert "model.layers.0.self_attn.q_norm.weight" in tp[0]


def test_megatron_stores_local_expert_ids_on_each_ep_rank():
    c, p = QWEN3, _canonical(QWEN3)
    f = c.expert_ffn
    gu = p["layers.0.experts.gate_up.weight"]
    shards = shards_for(c, "megatron:tp=2,ep=4")  # 8 ranks, etp 2: ranks 2k, 2k+1 hold EP rank k
    assert len(shards) == 8
    for g in range(8):
        etp_rank, ep_rank = g % 2, g // 2
        for j in range(2):  # two local experts, global 2 * ep_rank + j
            e = 2 * ep_rank + j
            w = shards[g][f"decoder.layers.0.mlp.experts.linear_fc1.weight{j}"]
            h = f // 2
            assert torch.equal(w, torch.cat([gu[e * 2 * f + etp_rank * h:e * 2 * f + (etp_rank + 1) * h],
                                             gu[e * 2 * f + f + etp_rank * h:
                                                e * 2 * f + f + (etp_rank + 1) * h]]))
        # the dense layers: attention TP rank g % 2 on each of 4 data-parallel replicas
        assert torch.equal(shards[g]["decoder.layers.0.self_attention.linear_qkv.weight"],
                           shards[g % 2]["decoder.layers.0.self_attention.linear_qkv.weight"])
    names = set(shards[0])
    assert {"decoder.layers.0.mlp.router.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
            "decoder.layers.0.self_attention.q_layernorm.weight",
            "decoder.layers.0.mlp.experts.linear_fc2.weight1"} <= names
    seq = shards_for(c, "megatron:tp=2,ep=4,experts=sequential")
    assert torch.equal(seq[5]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                       shards[5]["decoder.layers.1.mlp.experts.linear_fc2.weight1"])
    ds = shards_for(DEEPSEEK, "megatron:2")
    assert "decoder.layers.1.mlp.router.expert_bias" in ds[0]  # the buffer moves too
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in ds[0]  # a dense first layer
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in ds[0]


def test_hf_names_per_expert_fused_and_mixtrals():
    c, p = QWEN2, _canonical(QWEN2)
    f = c.expert_ffn
    (hf,) = shards_for(c, "hf")
    gu = p["layers.1.experts.gate_up.weight"]
    assert torch.equal(hf["model.layers.1.mlp.experts.3.up_proj.weight"],
                       gu[3 * 2 * f + f:4 * 2 * f])
    assert torch.equal(hf["model.layers.1.mlp.experts.3.down_proj.weight"],
                       p["layers.1.experts.down.weight"][:, 3 * f:4 * f])
    assert {"model.layers.0.mlp.shared_expert.gate_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate.weight",
            "model.layers.0.self_attn.q_proj.bias"} <= set(hf)
    (fused,) = shards_for(c, "hf:experts=fused")
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * f, 64)
    assert torch.equal(fused["model.layers.1.mlp.experts.gate_up_proj"][3],
                       gu[3 * 2 * f:4 * 2 * f])  # gate first
    assert fused["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, f)
    (mx,) = shards_for(MIXTRAL, "hf")
    assert {"model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.experts.2.w1.weight",
            "model.layers.0.block_sparse_moe.experts.2.w3.weight",
            "model.layers.0.block_sparse_moe.experts.2.w2.weight"} <= set(mx)
    (mx5,) = shards_for(MIXTRAL, "hf:experts=fused")  # v5 renames the block to mlp
    assert "model.layers.0.mlp.experts.gate_up_proj" in mx5
    assert "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight" in shards_for(
        MIXTRAL, "vllm:2")[0]
    (ds,) = shards_for(DEEPSEEK, "hf")
    assert {"model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.shared_experts.up_proj.weight"} <= set(ds)


@pytest.mark.parametrize("config, where, rule", [
    (QWEN3, "vllm:tp=4,ep=2", "ep == 1 or ep == t (FusedMoEParallelConfig"),
    (QWEN3, "vllm:tp=2,etp=1", "no expert-TP degree of its own"),
    (QWEN3.replace(n_experts=10, top_k=2), "megatron:tp=2,ep=4,etp=1",
     "n_experts % ep == 0 (BaseMoELayer: num_moe_experts % ep_size) (n_experts=10, ep=4"),
    (QWEN3, "vllm:tp=4,ep=4,placement=round_robin", "placement=round_robin only with expert "
                                                    "parallelism and grouped top-k"),
    (QWEN3, "hf:tp=1,ep=2", "ep == 1 (a Hugging Face checkpoint holds every expert)"),
    (QWEN3, "meta:2", "a dense Llama 2 block"),
    (TOY, "megatron:tp=2,ep=2", "an MoE config for ep or etp (a dense model has no experts)"),
    (QWEN3.replace(n_experts=2, top_k=1), "vllm:4", "t <= n_experts"),
])
def test_what_a_framework_cannot_store_names_its_rule(config, where, rule):
    with pytest.raises(UnsupportedConvention, match=re.escape(rule)):
        shards_for(config, where)


@pytest.mark.parametrize("text, message", [
    ("vllm:tp=2,ep", "after ':' a TP degree alone or key=value items"),
    ("vllm:two", "the degree after ':' must be a positive integer"),
    ("vllm:tp=2,tp=4", "tp given twice"),
    ("vllm:tp=2,experts=fused", "vllm has no option 'experts'; known: tp, ep, etp, placement, "
                                "kernel"),
    ("hf:experts=grouped", "hf option experts='grouped'; known: per_expert, fused"),
    ("megatron:tp=0", "tp must be a positive integer, got '0'"),
])
def test_an_endpoint_that_does_not_parse_says_why(text, message):
    with pytest.raises(UnknownConvention, match=re.escape(message)):
        endpoint(text)


def test_endpoints_print_as_written_and_count_their_ranks():
    assert str(endpoint("megatron:4")) == "megatron:4"
    assert str(endpoint("megatron:tp=2,ep=4,experts=sequential")) == (
        "megatron:tp=2,ep=4,experts=sequential")
    assert endpoint(str(endpoint("vllm:tp=4,ep=4"))) == endpoint("vllm:tp=4,ep=4")
    # the fewest ranks Megatron lays the endpoint out on: lcm(tp, ep * etp), etp defaulting to tp
    assert [endpoint(e).world for e in ("megatron:tp=2,ep=4", "megatron:tp=2,ep=4,etp=1",
                                         "megatron:tp=4,ep=2,etp=1", "vllm:tp=4,ep=4", "hf")] == [
        8, 4, 4, 4, 1]


def _mutation_matrix():
    pairs = [(QWEN3, "megatron:tp=2,ep=4", "vllm:4"), (QWEN3, "hf", "vllm:tp=2,ep=2"),
             (QWEN2, "megatron:tp=2,ep=2,etp=1", "hf:experts=fused"),
             (DEEPSEEK, "megatron:2", "vllm:tp=2,ep=2"),
             (DEEPSEEK.replace(n_experts=6, top_k=2, n_groups=2, topk_groups=1), "hf",
              "vllm:tp=4,ep=4"),
             (QWEN3.replace(expert_ffn=64), "hf", "megatron:tp=2,ep=2,etp=1")]
    return [(c, a, b, m) for c, a, b in pairs for m in MOE_MUTATIONS]


@pytest.mark.parametrize("config, src, dst, mutation", _mutation_matrix(),
                         ids=lambda x: getattr(x, "name", x))
def test_each_moe_mutation_keeps_shapes_and_changes_bytes_exactly_where_it_applies(
        config, src, dst, mutation):
    conversion = Conversion(config, endpoint(src), endpoint(dst))
    if mutation.not_applicable(conversion) is not None:
        return  # the bug cannot occur here (where it can is the next test's)
    declared = shards_for(config, dst)
    out = mutation.apply(declared, conversion)
    changed = any(not torch.equal(o[n], d[n]) for o, d in zip(out, declared) for n in d)
    assert changed == (mutation.identity_reason(conversion) is None), mutation.name


def test_every_moe_mutation_applies_somewhere_in_the_matrix():
    applied = {m.name for c, a, b, m in _mutation_matrix()
               if not (m.not_applicable(Conversion(c, endpoint(a), endpoint(b)))
                       or m.identity_reason(Conversion(c, endpoint(a), endpoint(b))))}
    assert applied == {m.name for m in MOE_MUTATIONS}


@pytest.mark.parametrize("where", ["megatron:tp=2,ep=4", "vllm:tp=2,ep=2", "hf",
                                   "hf:experts=fused"])
def test_moe_checkpoints_round_trip_through_their_files(tmp_path, where):
    from weight_sync_bench.conventions.checkpoint import read_checkpoint, write_checkpoint

    ep = endpoint(where)
    declared = shards_for(QWEN3, where)
    write_checkpoint(tmp_path / "ckpt", declared, ep, QWEN3)
    back = read_checkpoint(tmp_path / "ckpt", ep, QWEN3)
    assert len(back.shards) == ep.world
    for got, want in zip(back.shards, declared):
        assert list(sorted(got)) == list(sorted(want))
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_vllm_rank_with_one_expert_still_stacks_it():
    """FusedMoE's ``w13_weight`` is ``[E_local, 2F/t, d]`` whatever E_local
    (``UnquantizedFusedMoEMethod.create_weights``): a rank holding one expert (EP 8 over 8
    experts) stores ``[1, 2F, d]``, not the expert's 2-D tensor (the twin: EP 4 stacks two);
    the harness's own conversion into it and back is exact."""
    from weight_sync_bench import convert
    from weight_sync_bench.conventions import shards_for
    from weight_sync_bench.model.config import MOE_CONFIGS

    # TOY_MOE's experts, heads and layers with a vocabulary of 1000: the stacking depends on
    # the experts; TOY_MOE's 32000-row embedding and head made it 0.8 s
    config = MOE_CONFIGS["toy_moe"].replace(name="toy_moe_v1000", vocab=1000)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    one = shards_for(config, "vllm:tp=8,ep=8")
    assert tuple(one[3][w13].shape) == (1, 2 * config.expert_ffn, config.d_model)
    assert tuple(shards_for(config, "vllm:tp=4,ep=4")[0][w13].shape)[0] == 2
    back = convert(one, "vllm:tp=8,ep=8", "megatron:tp=2,ep=2", config)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(
        back, shards_for(config, "megatron:tp=2,ep=2")) for n in a)

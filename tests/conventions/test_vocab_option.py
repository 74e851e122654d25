"""Megatron's vocabulary padding as an endpoint option: ``megatron:tp=4,vocab=unpadded`` is the
model verl and mbridge build (the Hugging Face vocabulary as it is), and a converter written
for it passes ``check_convert`` where the padded default refused its correct output."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.check.convert import check_convert
from weight_sync_bench.conventions import convert, endpoint, shards_for
from weight_sync_bench.errors import InvalidShards, UnsupportedConvention
from weight_sync_bench.model.config import TOY_KV4


def verl_megatron_to_hf(shards, degree):
    """Megatron-Core TP shards -> one Hugging Face state dict, as verl 0.9.1's documented
    Megatron -> HF path does it (``default_tp_concat_fn`` with
    ``McoreToHFWeightConverterDense``'s names), written here from that behaviour: each TP
    shard of ``linear_qkv`` is viewed as its ``n_kv_heads / t`` groups of ``[q heads, k, v]``
    and the q, k and v parts concatenated over the ranks; ``linear_fc1`` chunked into gate
    and up halves per rank; column-parallel tensors concatenated on dim 0, row-parallel on dim
    1, replicated ones taken from rank 0. The vocabulary tables are concatenated as they are:
    no padding is removed, as none was added."""
    c, tp = TOY_KV4, len(shards)
    group, hn, d = c.n_heads // c.n_kv_heads, c.head_dim, c.d_model
    out = {}

    def cat(name, dim):
        return torch.cat([s[name] for s in shards], dim=dim)

    out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)
    for i in range(c.n_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = shards[0][
            m + "self_attention.linear_qkv.layer_norm_weight"].clone()
        q, k, v = [], [], []
        for s in shards:
            w = s[m + "self_attention.linear_qkv.weight"].view(c.n_kv_heads // tp,
                                                               (group + 2) * hn, d)
            q.append(w[:, :group * hn].reshape(-1, d))
            k.append(w[:, group * hn:(group + 1) * hn].reshape(-1, d))
            v.append(w[:, (group + 1) * hn:].reshape(-1, d))
        out[h + "self_attn.q_proj.weight"] = torch.cat(q)
        out[h + "self_attn.k_proj.weight"] = torch.cat(k)
        out[h + "self_attn.v_proj.weight"] = torch.cat(v)
        out[h + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        out[h + "post_attention_layernorm.weight"] = shards[0][
            m + "mlp.linear_fc1.layer_norm_weight"].clone()
        halves = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
    out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    out["lm_head.weight"] = cat("output_layer.weight", 0)
    return [out]


def test_unpadded_tables_hold_the_vocabulary_as_it_is():
    padded = shards_for(TOY_KV4, "megatron:4")
    unpadded = shards_for(TOY_KV4, "megatron:tp=4,vocab=unpadded")
    name = "embedding.word_embeddings.weight"
    assert padded[0][name].shape[0] == 8064  # 32000 padded to a multiple of 128 x 4, / 4
    assert unpadded[0][name].shape[0] == 8000
    assert str(endpoint("megatron:tp=4,vocab=unpadded")) == "megatron:tp=4,vocab=unpadded"
    back = convert(unpadded, "megatron:tp=4,vocab=unpadded", "megatron:4", TOY_KV4)
    assert all(torch.equal(back[r][n], padded[r][n]) for r in range(4) for n in padded[r])


def test_unpadded_needs_a_vocabulary_tp_divides():
    with pytest.raises(UnsupportedConvention, match=r"vocab % t == 0.*vocab=31999, t=4"):
        shards_for(TOY_KV4.replace(vocab=31999), "megatron:tp=4,vocab=unpadded")
    shards_for(TOY_KV4.replace(vocab=31999), "megatron:4")  # the padded default stores it


def test_verls_megatron_to_hf_passes_with_the_unpadded_option(tolerance):
    verdict = check_convert(verl_megatron_to_hf, TOY_KV4, "megatron:tp=4,vocab=unpadded", "hf")
    assert verdict.passed, verdict


def test_the_same_converter_is_refused_where_the_convention_pads():
    # the padded default: the concatenated tables are 32256 rows where HF has 32000
    with pytest.raises(InvalidShards, match="model.embed_tokens.weight"):
        check_convert(verl_megatron_to_hf, TOY_KV4, "megatron:4", "hf")


def test_a_bug_in_the_same_converter_still_fails_with_the_unpadded_option(tolerance):
    def swapped_k_v(shards, degree):
        out = verl_megatron_to_hf(shards, degree)
        k = "model.layers.1.self_attn.k_proj.weight"
        v = "model.layers.1.self_attn.v_proj.weight"
        out[0][k], out[0][v] = out[0][v], out[0][k]
        return out

    verdict = check_convert(swapped_k_v, TOY_KV4, "megatron:tp=4,vocab=unpadded", "hf")
    assert not verdict.passed
    assert verdict.first_mismatch == "model.layers.1.self_attn.k_proj.weight"

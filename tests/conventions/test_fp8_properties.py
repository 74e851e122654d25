"""The FP8 layout over drawn geometries: widths that cross the 128-block boundary and
degrees that do and do not align with it. For every draw, either the layout is refused
with vLLM's rule, exactly where some TP cut or merged part is not whole blocks (the rule
computed here from the sizes, not from the harness's runs), or every rank's tensors
dequantize to the rank's cut of the dequantized model, bit for bit, and quantizing each
rank's own tensor gives the same bytes (per shard equals whole, where blocks align)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.fp8 import (
    FP8,
    SCALE_SUFFIX,
    dequantize_blocks,
    dequantize_canonical,
    fp8_shards,
    quantize_blocks,
    quantize_canonical,
)
from weight_sync_bench.errors import UnsupportedConvention
from weight_sync_bench.model.config import ModelConfig, init_params


@st.composite
def geometries(draw):
    head_dim = draw(st.sampled_from([64, 128, 192]))
    n_kv = draw(st.sampled_from([1, 2]))
    n_heads = n_kv * draw(st.sampled_from([1, 2]))
    ffn = draw(st.sampled_from([128, 192, 256, 320, 384]))
    d_model = draw(st.sampled_from([128, 160, 256]))
    config = ModelConfig(name="fp8_drawn", vocab=300, d_model=d_model, n_layers=1,
                         n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn=ffn)
    t = draw(st.sampled_from([t for t in (1, 2, 4) if n_heads % t == 0]))
    return config, t


def aligned(config: ModelConfig, t: int) -> bool:
    """vLLM's rules from the sizes: every part of the merged qkv_proj and gate_up_proj per
    rank whole 128-row blocks (even at TP 1), and at TP > 1 the row-parallel inputs too."""
    hd, kv = config.head_dim, config.n_kv_heads
    q_rank = config.n_heads * hd // t
    kv_rank = hd * max(kv // t, 1)  # replicated KV heads: one head per rank
    parts = [q_rank, kv_rank, config.ffn // t]
    inputs = [config.n_heads * hd // t, config.ffn // t] if t > 1 else []
    return all(x % 128 == 0 for x in parts + inputs)


@given(geometries(), st.integers(0, 3))
def test_the_layout_is_refused_exactly_where_vllm_refuses_it_and_exact_elsewhere(drawn, seed):
    config, t = drawn
    if config.ffn % t:
        return
    where = endpoint(f"vllm:tp={t}")
    params = init_params(config, seed)
    try:
        ranks = fp8_shards(config, endpoint(f"vllm:tp={t},fp8=block128"), params)
    except UnsupportedConvention as exc:
        assert not aligned(config, t), (config, t, str(exc))
        assert "128-blocks" in str(exc)
        return
    assert aligned(config, t), (config, t)
    values, scales = quantize_canonical(config, params)
    full = dequantize_canonical(config, values, scales, params)
    cuts = materialize(where.pieces(config), params)  # each rank's own source tensors
    for rank, want, own in zip(ranks, materialize(where.pieces(config), full), cuts):
        for name, x in want.items():
            got = rank[name]
            if got.dtype == FP8:
                own_q, own_s = quantize_blocks(own[name])  # quantized per shard, as one tensor
                got = dequantize_blocks(got, rank[name + SCALE_SUFFIX])
                assert torch.equal(own_s, rank[name + SCALE_SUFFIX]), name
                assert torch.equal(own_q.view(torch.uint8), rank[name].view(torch.uint8)), name
            assert torch.equal(got, x), name

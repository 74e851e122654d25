"""The reference model's math against independent, naive implementations (the mutation pass
over ``model/reference.py``).

The reference and the sharded forward share these blocks (norm, RoPE, attention, SwiGLU,
the experts' FFN): a bug in one of them is in both, so no comparison of the two can see it,
and every verdict would still pass. Each block is checked here against the formula written
out element by element (loops over positions, heads and keys, in float64), the way
transformers' Llama, Qwen2 and Qwen3-MoE modules define it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from weight_sync_bench.model.config import TOY, TOY_MOE, init_params
from weight_sync_bench.model.reference import (
    ReferenceModel,
    ReferenceState,
    apply_rope,
    attend,
    document_mask,
    expert_hidden,
    expert_output,
    rms_norm,
    rope_tables,
    step_of,
)

SMALL = TOY.replace(name="small", vocab=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                    head_dim=8, ffn=24, batch=2, seq_len=6)


def test_rms_norm_is_x_over_the_root_mean_square_plus_eps_times_the_weight():
    torch.manual_seed(0)
    x, w, eps = torch.randn(3, 5), torch.rand(5) + 0.5, 0.25  # eps the size of mean(x^2)
    got = rms_norm(x, w, eps)
    for r in range(3):
        ms = sum(float(v) ** 2 for v in x[r]) / 5
        for c in range(5):
            want = float(x[r, c]) / math.sqrt(ms + eps) * float(w[c])
            assert float(got[r, c]) == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_rope_tables_are_the_cos_and_sin_of_position_times_theta_to_the_minus_2i_over_d():
    """Positions up to 4095: an inverse frequency or angle computed in fp32 instead of fp64
    is off there by ~1e-4 (the fp64 tables rounded once are within 6e-8)."""
    seq_len, head_dim, theta = 4096, 8, 10000.0
    cos, sin = rope_tables(seq_len, head_dim, theta)
    assert cos.shape == sin.shape == (seq_len, head_dim // 2)
    assert cos.dtype == sin.dtype == torch.float32
    for t in (0, 1, 7, 1000, 4095):
        for i in range(head_dim // 2):
            angle = t * theta ** (-2 * i / head_dim)
            assert abs(float(cos[t, i]) - math.cos(angle)) <= 1e-7
            assert abs(float(sin[t, i]) - math.sin(angle)) <= 1e-7


def test_apply_rope_rotates_each_first_half_second_half_pair():
    """Llama's ``rotate_half`` convention: element i pairs with element i + D/2."""
    torch.manual_seed(1)
    b, t, h, d = 2, 3, 2, 6
    x = torch.randn(b, t, h, d)
    cos, sin = torch.rand(t, d // 2) * 2 - 1, torch.rand(t, d // 2) * 2 - 1
    got = apply_rope(x, cos, sin)
    assert got.shape == x.shape
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                for i in range(d // 2):
                    x1, x2 = float(x[bi, ti, hi, i]), float(x[bi, ti, hi, i + d // 2])
                    c, s = float(cos[ti, i]), float(sin[ti, i])
                    assert float(got[bi, ti, hi, i]) == pytest.approx(x1 * c - x2 * s, abs=1e-6)
                    assert float(got[bi, ti, hi, i + d // 2]) == pytest.approx(x1 * s + x2 * c,
                                                                               abs=1e-6)


def naive_attention(q, k, v, sees):
    """Softmax attention written out: query head h reads KV head h // (H / Hkv), over the keys
    ``sees(b, i, j)`` allows; a query that sees no key outputs zeros."""
    b, tq, n_heads, d = q.shape
    group = n_heads // k.shape[2]
    out = torch.zeros(b, tq, n_heads, d, dtype=torch.float64)
    for bi in range(b):
        for i in range(tq):
            keys = [j for j in range(k.shape[1]) if sees(bi, i, j)]
            for h in range(n_heads):
                if not keys:
                    continue
                kv = h // group
                scores = [float(q[bi, i, h] @ k[bi, j, kv]) / math.sqrt(d) for j in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for w, j in zip(weights, keys):
                    out[bi, i, h] += (w / total) * v[bi, j, kv].double()
    return out.reshape(b, tq, n_heads * d)


def _qkv(b=2, tq=5, tk=5, heads=4, kv_heads=2, d=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, tq, heads, d, generator=g), torch.randn(b, tk, kv_heads, d, generator=g),
            torch.randn(b, tk, kv_heads, d, generator=g))


def test_attend_without_a_mask_is_causal_grouped_query_attention():
    q, k, v = _qkv()
    got = attend(q, k, v)
    assert got.shape == (2, 5, 16)
    want = naive_attention(q, k, v, lambda b, i, j: j <= i)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_attend_under_a_document_mask_zeroes_a_padding_query_and_matches_the_formula():
    q, k, v = _qkv()
    segments = torch.tensor([[0, 0, 1, 1, -1], [0, 1, 1, -1, -1]])
    mask = document_mask(segments)
    got = attend(q, k, v, mask)
    want = naive_attention(q, k, v, lambda b, i, j: bool(mask[b, 0, i, j]))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.all(got[0, 4] == 0) and torch.all(got[1, 3:] == 0)  # the padding queries
    assert torch.all(got[0, :4] != 0)  # twin: the real ones are not zeroed


def test_a_general_mask_adds_no_key_a_query_does_not_see():
    """A query that sees key 0 only (not itself) reads key 0 only: its own position is added
    only to a row that sees nothing, to keep its softmax defined before it is zeroed."""
    q, k, v = _qkv(b=1, tq=3, tk=3)
    mask = torch.tensor([[True, False, False], [True, False, False],
                         [False, False, False]])[None, None]
    got = attend(q, k, v, mask)
    want = naive_attention(q, k, v, lambda b, i, j: bool(mask[b, 0, i, j]))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.all(got[0, 2] == 0)


@pytest.mark.parametrize("tq, offset", [(1, 0), (3, 0), (2, 3)])
def test_a_query_that_sees_no_key_gets_a_zero_output_and_gradients_that_are_finite(tq, offset):
    """Its last row sees nothing: forward and backward stay finite (no 0/0 softmax), and the
    row passes no gradient to q, k or v. ``q_offset`` places query i at key offset + i; the
    default is 0 (a single query at key 0 over a single key)."""
    tk = offset + tq
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, tq=tq, tk=tk))
    mask = torch.ones(1, 1, tq, tk, dtype=torch.bool).tril(offset)
    mask[..., -1, :] = False
    kwargs = {"q_offset": offset} if offset else {}
    out = attend(q, k, v, mask, **kwargs)
    assert torch.all(out[0, -1] == 0)
    out.sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
    assert torch.all(q.grad[0, -1] == 0)
    if tq == tk == 1:  # the only key, seen by no query: no gradient at all
        assert torch.all(k.grad == 0) and torch.all(v.grad == 0)


def test_swiglu_experts_and_their_weighted_sum_are_the_formula_token_by_token():
    """Each expert's SwiGLU over the tokens routed to it, from its own row block of
    ``gate_up`` (gate rows first) and column block of ``down``, times the token's weight,
    summed into the token's output; an expert no token chose computes nothing (None)."""
    torch.manual_seed(3)
    n, d, f, experts = 5, 4, 3, [0, 1, 2]
    x = torch.randn(n, d)
    gate_up, down = torch.randn(2 * f * len(experts), d), torch.randn(d, f * len(experts))
    routed = [(torch.tensor([0, 3]), torch.tensor([0.25, 0.5])),
              (torch.tensor([1, 3, 4]), torch.tensor([1.0, 0.125, 0.75])),
              (torch.tensor([], dtype=torch.long), torch.tensor([]))]
    hidden = expert_hidden(x, gate_up, routed, experts)
    assert hidden[2] is None and hidden[0] is not None and hidden[1] is not None
    out = expert_output(hidden, down, routed, experts, torch.zeros(n, d))
    want = torch.zeros(n, d, dtype=torch.float64)
    for e in experts:
        rows = gate_up[2 * f * e:2 * f * (e + 1)].double()
        cols = down[:, f * e:f * (e + 1)].double()
        for token, weight in zip(*routed[e]):
            gate, up = rows[:f] @ x[token].double(), rows[f:] @ x[token].double()
            h = gate * torch.sigmoid(gate) * up
            want[token] += float(weight) * (cols @ h)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.all(out[2] == 0)  # token 2 chose no expert


def test_step_of_splits_a_layer_parameter_and_leaves_the_rest_unprefixed():
    assert step_of("layers.3.qkv.weight") == ("layers.3.", "qkv.weight")
    assert step_of("norm.weight") == ("", "norm.weight")
    assert step_of("lm_head.weight") == ("", "lm_head.weight")


def test_the_model_holds_no_embedding_output_before_a_forward_and_its_lookup_after():
    params = init_params(SMALL, 0)
    model = ReferenceModel(SMALL, params)
    assert model.embedding_output is None
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    model(tokens)
    assert torch.equal(model.embedding_output, params["tok_embeddings.weight"][tokens])


def test_a_routing_step_consumes_the_router_logits():
    params = init_params(TOY_MOE, 0)
    model = ReferenceModel(TOY_MOE, params)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    state = model.begin(tokens)
    layer = next(i for i in range(TOY_MOE.n_layers)
                 if any("router" in s for s in TOY_MOE.suffixes_of(i)))
    for suffix in TOY_MOE.suffixes_of(layer):
        model.step(state, f"layers.{layer}.{suffix}")
        if "router" in suffix and (suffix.endswith("bias") or not TOY_MOE.router_bias):
            break
    assert state.logits is None and layer in model.routings and state.routed


def test_finish_refuses_a_state_whose_head_has_not_run():
    state = ReferenceState(torch.zeros(1, 2, 16), rope_tables(2, 8, 1e4), None)
    with pytest.raises(AssertionError, match="^finish: the head's step has not run$"):
        ReferenceModel(SMALL, {}).finish(state)


def test_finish_cuts_the_padded_vocab_off_the_logits():
    padded = SMALL.replace(vocab=38, vocab_multiple=8)
    assert padded.padded_vocab == 40
    state = ReferenceState(torch.zeros(1, 2, 16), rope_tables(2, 8, 1e4), None)
    state.y = torch.arange(80.0).view(1, 2, 40)
    assert torch.equal(ReferenceModel(padded, {}).finish(state), state.y[..., :38])


def test_the_whole_forward_is_the_blocks_composed():
    """One dense layer by hand from the blocks above (already checked against the formula):
    embedding, norm, attention, residual, norm, SwiGLU, residual, norm, head."""
    c = SMALL
    p = init_params(c, 0)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
    h = F.embedding(tokens, p["tok_embeddings.weight"])
    pre = "layers.0."
    x = rms_norm(h, p[pre + "attn_norm.weight"], c.norm_eps)
    qkv = x @ p[pre + "qkv.weight"].T
    q, k, v = qkv.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                         c.n_kv_heads * c.head_dim], dim=-1)
    cos, sin = rope_tables(6, c.head_dim, c.rope_theta)
    q = apply_rope(q.view(2, 6, c.n_heads, c.head_dim), cos, sin)
    k = apply_rope(k.view(2, 6, c.n_kv_heads, c.head_dim), cos, sin)
    v = v.view(2, 6, c.n_kv_heads, c.head_dim)
    h = h + attend(q, k, v) @ p[pre + "o_proj.weight"].T
    x = rms_norm(h, p[pre + "ffn_norm.weight"], c.norm_eps)
    gate, up = (x @ p[pre + "gate_up.weight"].T).chunk(2, dim=-1)
    h = h + (F.silu(gate) * up) @ p[pre + "down.weight"].T
    want = rms_norm(h, p["norm.weight"], c.norm_eps) @ p["lm_head.weight"].T
    torch.testing.assert_close(ReferenceModel(c, p)(tokens), want[..., :c.vocab],
                               rtol=1e-5, atol=1e-6)

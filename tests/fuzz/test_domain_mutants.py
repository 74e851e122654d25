"""``fuzz.domain`` (issue 30, the mutation pass over ``fuzz/domain.py``): the geometries the
fuzz draws, the floor samples cover and the threshold rule admits.

The three consumers agree only through this module, so a range read one off, a derived
size computed per KV head the wrong way round, or a refusal that drops a field changes what
all three believe without any of them noticing. These tests pin:

- ``IntRange``: its members (``lo, lo + step, ... <= hi``, ints only), its top, its text and
  its refusals;
- ``FuzzDomain``: the geometry its coordinates describe (``n_heads = n_kv_heads * group``,
  ``ffn`` and ``vocab`` per KV head), every field ``violations`` names, with fractions said as
  such, its smallest and largest geometry, its JSON round trip and text; every geometry of
  the domain's coordinates is inside it, and each one step past a range is outside, naming
  that field alone;
- ``MoeDomain``: its fields, the non-MoE refusal, its smallest and largest geometry (every
  option on; one kept group of two where top_k allows it; a dense layer only with a second
  layer);
- the fuzz's weights and tokens: the seed's init for the built-in configs only, std
  d_model^-1/2 otherwise; tokens from every vocab slice of gcd(n_kv_heads, vocab), from the
  case's own generator (``TOKEN_SEED_OFFSET + seed``), whatever the global one holds."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.fuzz import domain as D
from weight_sync_bench.fuzz.domain import (
    DOMAIN,
    MOE_DOMAIN,
    FuzzDomain,
    IntRange,
    MoeDomain,
)
from weight_sync_bench.model.config import (
    DEFAULT_INIT,
    TOY,
    TOY_KV4,
    Init,
    ModelConfig,
    init_params,
    make_tokens,
)
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET


@pytest.mark.parametrize("r, members", [
    (IntRange(1, 4), [1, 2, 3, 4]),
    (IntRange(2, 16, 2), [2, 4, 6, 8, 10, 12, 14, 16]),
    (IntRange(3, 10, 3), [3, 6, 9]),  # hi off the step: top 9
    (IntRange(5, 5), [5]),
    (IntRange(-2, 2, 2), [-2, 0, 2]),
    (IntRange(1, 10, 3), [1, 4, 7, 10]),  # counted from lo: not 3, 6, 9 nor 2, 5, 8
])
def test_an_int_range_holds_lo_lo_plus_step_up_to_hi(r, members):
    assert [v for v in range(-5, 25) if v in r] == members
    assert r.top == members[-1]
    assert 2.0 not in r and "2" not in r and None not in r  # ints only


@pytest.mark.parametrize("r, text", [
    (IntRange(1, 4), "1..4"), (IntRange(2, 16, 2), "2..16 step 2"),
    (IntRange(3, 10, 3), "3..10 step 3"), (IntRange(0, 0), "0..0"),
])
def test_an_int_range_says_its_ends_and_a_step_above_one(r, text):
    assert str(r) == text


@pytest.mark.parametrize("args, message", [
    ((1, 4, 0), "IntRange needs step >= 1 and lo <= hi (lo=1, hi=4, step=0)"),
    ((5, 4), "IntRange needs step >= 1 and lo <= hi (lo=5, hi=4, step=1)"),
    ((1, 4.0), "IntRange needs ints, got lo=1, hi=4.0, step=1"),
    ((1, 4, "2"), "IntRange needs ints, got lo=1, hi=4, step='2'"),
])
def test_an_int_range_refuses_a_step_below_one_reversed_ends_and_non_ints(args, message):
    with pytest.raises(InvalidConfig) as info:
        IntRange(*args)
    assert str(info.value) == message


def test_twin_one_member_and_a_step_of_one_are_ranges():
    assert IntRange(4, 4).top == 4 and IntRange(1, 4, 1).top == 4 and IntRange(1, 2, 5).top == 1


def test_the_domains_coordinates_describe_a_geometry_per_kv_head():
    config = DOMAIN.config(n_kv_heads=3, group=2, head_dim=6, d_model=24, ffn_per_kv_head=5,
                           vocab_per_kv_head=10, n_layers=2, batch=2, seq_len=7)
    assert config == ModelConfig(name="fuzz", vocab=30, d_model=24, n_layers=2, n_heads=6,
                                 n_kv_heads=3, head_dim=6, ffn=15, batch=2, seq_len=7)
    assert DOMAIN.config(n_kv_heads=1, group=1, head_dim=2, d_model=8, ffn_per_kv_head=2,
                         vocab_per_kv_head=8, n_layers=1, batch=1, seq_len=4,
                         name="x").name == "x"


def test_the_smallest_and_largest_geometries_are_each_ranges_ends():
    assert DOMAIN.smallest() == ModelConfig(name="fuzz", vocab=8, d_model=8, n_layers=1,
                                            n_heads=1, n_kv_heads=1, head_dim=2, ffn=2,
                                            batch=1, seq_len=4)
    assert DOMAIN.largest() == ModelConfig(name="fuzz", vocab=1024, d_model=128, n_layers=3,
                                           n_heads=16, n_kv_heads=4, head_dim=16, ffn=128,
                                           batch=2, seq_len=16)
    # top, not hi, where the step does not reach hi
    odd = dataclasses.replace(DOMAIN, d_model=IntRange(8, 100, 8), head_dim=IntRange(2, 9, 2))
    assert (odd.largest().d_model, odd.largest().head_dim) == (96, 8)


@pytest.mark.parametrize("change, violation", [
    (dict(n_kv_heads=5, n_heads=5, vocab=40, ffn=10), "n_kv_heads=5 not in 1..4"),
    (dict(n_heads=10), "group=5 not in 1..4"),
    # (a fractional group or an odd head_dim is no ModelConfig: InvalidConfig refuses it)
    (dict(head_dim=18), "head_dim=18 not in 2..16 step 2"),
    (dict(d_model=136), "d_model=136 not in 8..128 step 8"),
    (dict(d_model=12), "d_model=12 not in 8..128 step 8"),
    (dict(ffn=66), "ffn_per_kv_head=33 not in 2..32"),
    (dict(ffn=3), "ffn_per_kv_head=1.5 not in 2..32"),
    (dict(vocab=14), "vocab_per_kv_head=7 not in 8..256"),
    (dict(vocab=515), "vocab_per_kv_head=258 not in 8..256"),
    (dict(vocab=209), "vocab_per_kv_head=104 not in 8..256"),  # 104.5: 3 digits
    (dict(vocab=2000), "vocab_per_kv_head=1000 not in 8..256"),  # an int: not 1e+03
    (dict(n_layers=4), "n_layers=4 not in 1..3"),
    (dict(batch=3), "batch=3 not in 1..2"),
    (dict(seq_len=3), "seq_len=3 not in 4..16"),
    (dict(seq_len=17), "seq_len=17 not in 4..16"),
])
def test_a_geometry_one_step_outside_names_that_field_alone(change, violation):
    inside = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                           vocab_per_kv_head=16, n_layers=2, batch=1, seq_len=8)
    assert DOMAIN.violations(inside) == [] and DOMAIN.contains(inside)
    outside = inside.replace(**change)
    assert DOMAIN.violations(outside) == [violation]
    assert not DOMAIN.contains(outside)


def test_every_field_outside_is_named_in_the_domains_order():
    config = ModelConfig(name="x", vocab=3 * 300, d_model=200, n_layers=5, n_heads=15,
                         n_kv_heads=3, head_dim=20, ffn=3 * 40, batch=4, seq_len=30)
    assert DOMAIN.violations(config) == [
        "group=5 not in 1..4", "head_dim=20 not in 2..16 step 2",
        "d_model=200 not in 8..128 step 8", "ffn_per_kv_head=40 not in 2..32",
        "vocab_per_kv_head=300 not in 8..256", "n_layers=5 not in 1..3", "batch=4 not in 1..2",
        "seq_len=30 not in 4..16"]
    # another domain's ranges, not the fuzz's
    assert D.FP8_DOMAIN.violations(DOMAIN.smallest())[:2] == ["n_kv_heads=1 not in 2..4",
                                                             "head_dim=2 not in 64..192 step 64"]


def test_every_geometry_of_the_coordinates_lies_inside():
    """Each coordinate at its ends and one inside point (3 x ... = 19,683 geometries over the
    nine ranges would take seconds: the ends of each range crossed with the others' middle)."""
    middle = {"n_kv_heads": 3, "group": 2, "head_dim": 8, "d_model": 64, "ffn_per_kv_head": 16,
              "vocab_per_kv_head": 100, "n_layers": 2, "batch": 1, "seq_len": 10}
    for field in middle:
        r = getattr(DOMAIN, field)
        for v in range(r.lo, r.top + 1, r.step):
            config = DOMAIN.config(**{**middle, field: v})
            assert DOMAIN.violations(config) == [], (field, v)
    for kv, group in itertools.product(range(1, 5), range(1, 5)):
        assert DOMAIN.contains(DOMAIN.config(**{**middle, "n_kv_heads": kv, "group": group}))


def test_the_domain_travels_as_json_and_says_each_range():
    data = DOMAIN.to_json()
    assert list(data) == ["n_kv_heads", "group", "head_dim", "d_model", "ffn_per_kv_head",
                          "vocab_per_kv_head", "n_layers", "batch", "seq_len", "seed"]
    assert data["head_dim"] == {"lo": 2, "hi": 16, "step": 2}
    assert data["seed"] == {"lo": 0, "hi": 65535, "step": 1}
    assert FuzzDomain.from_json(data) == DOMAIN
    assert FuzzDomain.from_json(D.FP8_DOMAIN.to_json()) == D.FP8_DOMAIN
    assert str(DOMAIN) == ("n_kv_heads 1..4, group 1..4, head_dim 2..16 step 2, "
                           "d_model 8..128 step 8, ffn_per_kv_head 2..32, "
                           "vocab_per_kv_head 8..256, n_layers 1..3, batch 1..2, "
                           "seq_len 4..16, seed 0..65535")
    assert MOE_DOMAIN.to_json() == {
        "n_experts": {"lo": 2, "hi": 8, "step": 1}, "top_k": {"lo": 1, "hi": 4, "step": 1},
        "expert_ffn_per_kv_head": {"lo": 2, "hi": 128, "step": 1},
        "shared_ffn_per_kv_head": {"lo": 0, "hi": 16, "step": 1},
        "dense_layers": {"lo": 0, "hi": 1, "step": 1}}


# --- the MoE domain -----------------------------------------------------------------------

MOE = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                    vocab_per_kv_head=16, n_layers=2, batch=1, seq_len=8).replace(
    name="fuzz_moe", n_experts=4, top_k=2, expert_ffn=8, shared_ffn=4, dense_layers=1)


@pytest.mark.parametrize("change, violation", [
    (dict(n_experts=9), "n_experts=9 not in 2..8"),
    (dict(top_k=1, n_experts=1), "n_experts=1 not in 2..8"),
    (dict(top_k=3), None),
    (dict(n_experts=5, top_k=5), "top_k=5 not in 1..4"),
    (dict(expert_ffn=2), "expert_ffn_per_kv_head=1 not in 2..128"),
    (dict(expert_ffn=5), "expert_ffn_per_kv_head=2.5 not in 2..128"),
    (dict(expert_ffn=258), "expert_ffn_per_kv_head=129 not in 2..128"),
    (dict(shared_ffn=34), "shared_ffn_per_kv_head=17 not in 0..16"),
    (dict(shared_ffn=3), "shared_ffn_per_kv_head=1.5 not in 0..16"),
    (dict(shared_ffn=0), None),
    (dict(dense_layers=0), None),
])
def test_an_moe_geometry_outside_the_moe_domain_names_the_field(change, violation):
    assert MOE_DOMAIN.violations(MOE) == [] and MOE_DOMAIN.contains(MOE)
    config = MOE.replace(**change)
    assert MOE_DOMAIN.violations(config) == ([violation] if violation else [])
    assert MOE_DOMAIN.contains(config) is (violation is None)


def test_the_moe_domain_checks_the_dense_domain_given_first():
    config = MOE.replace(d_model=136, n_experts=9)
    assert MOE_DOMAIN.violations(config) == ["d_model=136 not in 8..128 step 8",
                                             "n_experts=9 not in 2..8"]
    wide = dataclasses.replace(DOMAIN, d_model=IntRange(8, 256, 8))
    assert MOE_DOMAIN.violations(config, wide) == ["n_experts=9 not in 2..8"]
    assert MOE_DOMAIN.contains(MOE.replace(d_model=136), wide)
    assert not MOE_DOMAIN.contains(MOE.replace(d_model=136))
    # a dense geometry is not an MoE one, whatever else is wrong with it
    dense = DOMAIN.smallest()
    assert MOE_DOMAIN.violations(dense) == ["n_experts=0: not an MoE geometry"]
    assert MOE_DOMAIN.violations(dense.replace(seq_len=3)) == [
        "seq_len=3 not in 4..16", "n_experts=0: not an MoE geometry"]
    assert not MOE_DOMAIN.contains(dense)


def test_the_moe_domains_smallest_geometry_is_top_1_of_the_fewest_narrowest_experts():
    assert MOE_DOMAIN.smallest() == DOMAIN.smallest().replace(
        name="fuzz_moe", n_experts=2, top_k=1, expert_ffn=2, shared_ffn=0, dense_layers=0)
    other = MoeDomain(n_experts=IntRange(3, 5), top_k=IntRange(2, 3),
                      expert_ffn_per_kv_head=IntRange(4, 8), shared_ffn_per_kv_head=IntRange(2, 3),
                      dense_layers=IntRange(1, 1))
    dense = dataclasses.replace(DOMAIN, n_kv_heads=IntRange(2, 3), n_layers=IntRange(2, 3))
    got = other.smallest(dense)
    assert (got.n_kv_heads, got.n_experts, got.top_k, got.expert_ffn, got.shared_ffn,
            got.n_layers, got.dense_layers) == (2, 3, 2, 8, 4, 2, 1)
    assert got.router == "softmax" and not got.router_bias and not got.shared_gate
    assert other.contains(got, dense) and MOE_DOMAIN.contains(MOE_DOMAIN.smallest())


def test_the_moe_domains_largest_geometry_has_every_option_on():
    assert MOE_DOMAIN.largest() == DOMAIN.largest().replace(
        name="fuzz_moe", n_experts=8, top_k=4, expert_ffn=4 * 128, shared_ffn=4 * 16,
        shared_gate=True, router="sigmoid", router_bias=True, n_groups=2, topk_groups=1,
        norm_topk=True, qk_norm=True, dense_layers=1)
    assert MOE_DOMAIN.contains(MOE_DOMAIN.largest())


@pytest.mark.parametrize("experts, top_k, layers, kept, dense_layers", [
    (IntRange(2, 8), IntRange(1, 4), IntRange(1, 3), 1, 1),  # top 4 of 2 groups of 4: one
    (IntRange(2, 8), IntRange(1, 5), IntRange(1, 3), 2, 1),  # top 5: both groups
    (IntRange(2, 6), IntRange(1, 3), IntRange(1, 2), 1, 1),  # two layers: one dense
    (IntRange(2, 6), IntRange(1, 4), IntRange(1, 1), 2, 0),  # one layer: no dense layer
])
def test_the_largest_keeps_one_group_where_top_k_fits_in_it_and_one_moe_layer(
        experts, top_k, layers, kept, dense_layers):
    dense = dataclasses.replace(DOMAIN, n_layers=layers)
    got = MoeDomain(n_experts=experts, top_k=top_k).largest(dense)
    assert (got.n_experts, got.top_k, got.n_groups, got.topk_groups, got.dense_layers) == (
        experts.top, top_k.top, 2, kept, dense_layers)
    assert got.n_layers == layers.top and got.n_layers - got.dense_layers >= 1


# --- the fuzz's weights and tokens ----------------------------------------------------------

def test_the_built_in_configs_keep_the_seeds_init_and_tokens():
    assert D.is_builtin(TOY) and D.is_builtin(TOY_KV4)
    assert not D.is_builtin(TOY.replace(seq_len=TOY.seq_len + 1))  # the name alone is not it
    assert not D.is_builtin(TOY.replace(name="mine"))  # nor the geometry alone
    assert D.fuzz_init(TOY) == DEFAULT_INIT
    assert torch.equal(D.fuzz_tokens(TOY, 3), make_tokens(TOY, TOKEN_SEED_OFFSET + 3))
    assert not torch.equal(D.fuzz_tokens(TOY, 3), D.fuzz_tokens(TOY, 4))


def test_a_fuzzed_geometrys_weights_have_unit_variance_projections():
    config = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=64, ffn_per_kv_head=8,
                           vocab_per_kv_head=16, n_layers=1, batch=1, seq_len=4)
    assert D.fuzz_init(config) == Init(std=64 ** -0.5)
    assert D.fuzz_init(TOY.replace(seq_len=TOY.seq_len + 1)) == Init(std=TOY.d_model ** -0.5)
    params = D.fuzz_params(config, 5)
    want = init_params(config, 5, Init(std=0.125))
    assert params.keys() == want.keys()
    assert all(torch.equal(params[k], want[k]) for k in want)
    assert not torch.equal(params["layers.0.qkv.weight"],
                           D.fuzz_params(config, 6)["layers.0.qkv.weight"])


@pytest.mark.parametrize("kv, vocab_per_kv, batch, seq, vocab", [
    (1, 8, 1, 4, None), (2, 8, 1, 4, None), (3, 10, 2, 5, None), (4, 9, 1, 4, None),
    (4, 64, 2, 16, None), (3, 8, 1, 7, None),
    (4, 8, 1, 4, 30),  # outside the domain, a vocabulary 4 does not divide: 2 slices of 15
])
def test_fuzz_tokens_read_every_slice_from_their_own_generator(kv, vocab_per_kv, batch, seq,
                                                               vocab):
    config = DOMAIN.config(n_kv_heads=kv, group=1, head_dim=2, d_model=8, ffn_per_kv_head=2,
                           vocab_per_kv_head=vocab_per_kv, n_layers=1, batch=batch,
                           seq_len=seq)
    config = config.replace(vocab=vocab or config.vocab)
    torch.manual_seed(0)
    tokens = D.fuzz_tokens(config, 11)
    torch.manual_seed(1)  # the global generator plays no part
    assert torch.equal(D.fuzz_tokens(config, 11), tokens)
    assert tokens.shape == (batch, seq) and tokens.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < config.vocab
    # the docstring's draw: position i from the (i mod T)-th of T slices, then shuffled
    n, slices = batch * seq, math.gcd(kv, config.vocab)
    width = config.vocab // slices
    gen = torch.Generator().manual_seed(TOKEN_SEED_OFFSET + 11)
    drawn = torch.arange(n) % slices * width + torch.randint(0, width, (n,), generator=gen)
    assert torch.equal(tokens.flatten(), drawn[torch.randperm(n, generator=gen)])
    # every slice of every degree that divides the vocabulary is read
    for t in range(1, slices + 1):
        if slices % t == 0:
            assert set((tokens.flatten() // (config.vocab // t)).tolist()) == set(range(t))
    assert not torch.equal(tokens, D.fuzz_tokens(config, 12))


def test_fuzz_tokens_pinned():
    assert D.fuzz_tokens(DOMAIN.smallest(), 0).tolist() == [[0, 3, 7, 7]]
    largest = D.fuzz_tokens(DOMAIN.largest(), 3).tolist()
    assert largest[0][:6] == [736, 3, 912, 151, 594, 397]
    assert largest[1][-4:] == [140, 624, 29, 803]

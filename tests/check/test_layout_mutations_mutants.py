"""``check.mutations`` at what the mutation pass over ``check/mutations.py`` found unread
(issue 30): a mutation that would change a shard's shape or dtype is refused, saying which,
and the identity rules say why in words a report shows. What each mutation does, and that
the check kills it, is ``test_mutations.py``'s and ``test_breaks.py``'s."""

from __future__ import annotations

import re

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench import layout_for
from weight_sync_bench.check.mutations import MUTATIONS, Mutation
from weight_sync_bench.layout.reshard import split_tensor
from weight_sync_bench.model.config import init_params

CONFIG = tiny(2, n_layers=1)


def shards_of(config, degree):
    layout, params = layout_for(config), init_params(config, 0)
    pieces = {spec.name: split_tensor(params[spec.name], spec, degree) for spec in layout}
    return [{n: p[r] for n, p in pieces.items()} for r in range(degree)], layout


@pytest.mark.parametrize("bug,said", [
    (lambda xs, spec, config: [x[:-1] for x in xs], "[32] -> [31]"),
    (lambda xs, spec, config: [x.double() for x in xs], "[32] -> [32]"),  # the dtype
])
def test_a_mutation_that_would_change_a_shard_is_refused_naming_it_and_the_shapes(bug, said):
    shards, layout = shards_of(CONFIG, 2)
    bad = Mutation("bad", "changes a shard", r"norm\.weight", bug, lambda config, t: None)
    with pytest.raises(AssertionError, match=r"^mutation bad changed norm\.weight on rank 0: "
                                             + re.escape(said) + "$"):
        bad.apply(shards, layout, CONFIG)
    kept = Mutation("kept", "keeps a shard", r"norm\.weight",  # the twin: shape-preserving
                    lambda xs, spec, config: [x.flip(0) for x in xs], lambda config, t: None)
    assert torch.equal(kept.apply(shards, layout, CONFIG)[0]["norm.weight"],
                       shards[0]["norm.weight"].flip(0))


def test_the_identity_rules_say_why_in_words():
    assert MUTATIONS["o_proj_reversed"].identity_reason(CONFIG, 1) == (
        "t=1: a single rank holds the whole tensor")
    assert MUTATIONS["o_proj_reversed"].identity_reason(CONFIG, 2) is None
    one = tiny(1, n_layers=1)
    assert MUTATIONS["qkv_interleaved_read_as_plain"].identity_reason(one, 1) == (
        "n_kv_heads=1: one query group, so the interleaved and plain orders coincide")
    assert MUTATIONS["qkv_interleaved_read_as_plain"].identity_reason(CONFIG, 1) is None


def mutated(name, config, degree):
    """``name``'s mutation applied to the declared shards at ``degree``: (before, after)."""
    from weight_sync_bench.check.mutations import DTYPE_MUTATIONS_BY_NAME

    shards, layout = shards_of(config, degree)
    m = MUTATIONS.get(name) or DTYPE_MUTATIONS_BY_NAME[name]
    return shards, m.apply(shards, layout, config), layout


def test_gate_up_swapped_exchanges_the_two_halves_of_each_ranks_shard():
    before, after, _ = mutated("gate_up_swapped", CONFIG, 2)
    for b, a in zip(before, after):
        x, y = b["layers.0.gate_up.weight"], a["layers.0.gate_up.weight"]
        half = x.shape[0] // 2
        assert torch.equal(y, torch.cat([x[half:], x[:half]]))


def test_gate_up_interleaved_read_as_plain_takes_gate_and_up_rows_in_turn():
    from weight_sync_bench.layout.reshard import gather_tensor

    before, after, layout = mutated("gate_up_interleaved_read_as_plain", CONFIG, 2)
    spec = layout["layers.0.gate_up.weight"]
    full = gather_tensor([b[spec.name] for b in before], spec)  # [gate | up]
    read = gather_tensor([a[spec.name] for a in after], spec)
    assert torch.equal(read[0::2], full[:CONFIG.ffn]) and torch.equal(read[1::2],
                                                                      full[CONFIG.ffn:])


def test_replica_scaled_scales_the_last_ranks_copy_only():
    from weight_sync_bench.check.mutations import REPLICA_SCALE

    kv4 = tiny(4, n_layers=1)
    before, after, _ = mutated("replica_scaled", kv4, 4)
    name = "norm.weight"
    assert all(torch.equal(a[name], b[name]) for a, b in zip(after[:-1], before[:-1]))
    assert torch.equal(after[-1][name], before[-1][name] * REPLICA_SCALE)
    assert not torch.equal(after[-1][name], before[-1][name])


@pytest.mark.parametrize("name,via", [("bf16_round_trip", torch.bfloat16),
                                      ("fp16_round_trip", torch.float16)])
def test_a_round_trip_sends_every_shard_through_its_dtype_and_back(name, via):
    before, after, _ = mutated(name, CONFIG, 2)
    for b, a in zip(before, after):
        for n, x in b.items():
            assert a[n].dtype == x.dtype and torch.equal(a[n], x.to(via).to(x.dtype))


def test_a_round_trip_is_the_identity_exactly_for_weights_already_in_its_dtype():
    from weight_sync_bench.check.mutations import DTYPE_MUTATIONS_BY_NAME

    bf16, fp16 = (DTYPE_MUTATIONS_BY_NAME[n].dtype_identity
                  for n in ("bf16_round_trip", "fp16_round_trip"))
    assert bf16(torch.bfloat16) == "bf16 weights are already bf16: the round trip is exact"
    assert fp16(torch.float16) == "fp16 weights are already fp16: the round trip is exact"
    assert fp16(torch.bfloat16) == (
        "bf16 -> fp16 -> bf16 changes only values below 2^-17 or above 65504: not declared a "
        "bug for bf16 weights")
    assert bf16(torch.float32) is None and fp16(torch.float32) is None
    assert bf16(torch.float16) is None  # fp16 through bf16: 3 significant bits lost


def test_a_mutation_is_found_by_name_in_either_catalogue_or_refused_listing_both():
    from weight_sync_bench.check.mutations import (
        DTYPE_MUTATIONS_BY_NAME,
        mutation_by_name,
    )
    from weight_sync_bench.errors import UnknownMutation

    assert mutation_by_name("kv_swapped") is MUTATIONS["kv_swapped"]
    assert mutation_by_name("bf16_round_trip") is DTYPE_MUTATIONS_BY_NAME["bf16_round_trip"]
    known = ", ".join([*MUTATIONS, *DTYPE_MUTATIONS_BY_NAME])
    with pytest.raises(UnknownMutation, match=rf"^unknown mutation 'nope'; known: "
                                              rf"{re.escape(known)}$"):
        mutation_by_name("nope")

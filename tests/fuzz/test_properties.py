"""The fuzzed properties, parametrized so ``pytest -n auto`` spreads them over workers.

Each property runs under the loaded profile (``wsb-test`` by default: derandomized, a few
dozen examples; ``WSB_PROFILE=wsb-nightly`` for the long run), with the corpus's entries as
explicit examples first. A failure is shrunk, written to ``corpus/`` and re-raised. Every
detection property has a twin below showing it can fail.
"""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tests.breadth import breadth, budget
from weight_sync_bench.fuzz.strategies import (
    degree_pairs,
    geometries,
    rejected_layouts,
    seeds,
)

from weight_sync_bench.check.checker import Checker, sweep
from weight_sync_bench.check.mutations import MUTATIONS
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.fuzz.case import Case, run_case
from weight_sync_bench.fuzz.domain import DOMAIN, fuzz_params
from weight_sync_bench.fuzz.floor import fuzz_threshold_rule
from weight_sync_bench.fuzz.runner import PropertyFailed, run_property
from weight_sync_bench.layout.reshard import gather, reshard, split
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.sharded import ShardedModel

# The default run's share of each property: 25 examples; the long run's: the profile's (the
# invariant's examples each check every degree pair of their geometry, 3.6 on average)
EXAMPLES = budget(25, nightly=settings().max_examples)
GENERATES = Phase.generate in settings().phases  # False under wsb-replay (corpus only)


def test_invariant_holds_on_fuzzed_geometries_and_degree_pairs():
    tally = run_property("invariant", None, max_examples=EXAMPLES)
    assert tally.examples >= (EXAMPLES if GENERATES else 0)
    assert tally.failures == 0 and tally.max_ratio <= 1.0


# Three layout mutations fuzzed by default (a fused qkv, a fused gate_up, a row-parallel
# weight); every one is killed at every degree of the fixed matrix by default
# (tests/check/test_mutations.py), and all are fuzzed in the long run.
@pytest.mark.parametrize("mutation", breadth(MUTATIONS, keep={"contiguous_qkv", "gate_up_swapped",
                                                            "o_proj_reversed"}))
def test_mutation_is_killed_by_ten_x_wherever_it_is_not_the_identity(mutation):
    tally = run_property("kill", mutation, max_examples=EXAMPLES)
    live = tally.examples - tally.identity
    assert live > 0 or not GENERATES, f"{mutation}: every example was an identity case"
    assert tally.killed == live and tally.min_ratio >= 10


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@settings(max_examples=EXAMPLES)
@given(data=st.data(), config=geometries(), seed=seeds())
def test_gather_of_split_and_reshard_are_byte_exact(data, config, seed):
    layout = layout_for(config)
    src, dst = data.draw(degree_pairs(config), label="src, dst")
    full = fuzz_params(config, seed)
    assert all(torch.equal(_bits(full[n]), _bits(x))
               for n, x in gather(split(full, layout, src), layout).items())
    moved, direct = reshard(split(full, layout, src), layout, dst), split(full, layout, dst)
    assert all(torch.equal(_bits(m[n]), _bits(d[n]))
               for m, d in zip(moved, direct) for n in layout.names)


@settings(max_examples=EXAMPLES)
@given(rejection=rejected_layouts())
def test_rejected_layout_raises_naming_parameter_rule_and_degree(rejection):
    layout = layout_for(rejection.config)
    t = rejection.degree
    assert t not in layout.supported_degrees()
    for attempt in (lambda: layout.validate(t),
                    lambda: split(fuzz_params(rejection.config, 0), layout, t)):
        with pytest.raises(UnsupportedLayout) as err:
            attempt()
        message = str(err.value)
        assert message.startswith(rejection.parameter + ":"), message
        assert rejection.rule in message and f"t={t})" in message, message


@settings(max_examples=EXAMPLES)
@given(config=geometries(), seed=seeds())
def test_every_accepted_degree_splits_and_runs(config, seed):
    layout = layout_for(config)
    full = fuzz_params(config, seed)
    tokens = torch.zeros(config.token_shape, dtype=torch.long)
    for t in layout.supported_degrees():
        logits = ShardedModel(config, split(full, layout, t), InProcessCollective(t))(tokens)
        assert len(logits) == t and logits[0].shape == (*config.token_shape, config.vocab)


# --- twins: the properties are not vacuous -------------------------------------------------

def _zeroed_o_proj_forward(config, shards, tokens):
    broken = [{n: (torch.zeros_like(x) if n.endswith("o_proj.weight") else x)
               for n, x in p.items()} for p in shards]
    return ShardedModel(config, broken, InProcessCollective(len(shards)))(tokens)[0]


def test_invariant_property_fails_and_lands_in_the_corpus_when_the_forward_is_broken(tmp_path):
    with pytest.raises(PropertyFailed) as err:
        run_property("invariant", None, forward=_zeroed_o_proj_forward, corpus=False,
                     corpus_path=tmp_path, profile="wsb-test")  # any profile that generates
    assert err.value.outcome.ratio > 1
    written = list(tmp_path.glob("*.json"))
    assert len(written) == 1 and str(written[0]) in str(err.value)
    # shrunk: the smallest geometry of the domain already shows it
    assert err.value.outcome.case.config.d_model == 8
    assert err.value.outcome.case.config.n_layers == 1


def test_kill_property_fails_when_the_margin_is_not_there(tmp_path):
    # a threshold of 0.01 x max|logit| leaves replica_scaled well short of 10x somewhere
    with pytest.raises(PropertyFailed) as err:
        run_property("kill", "replica_scaled", corpus=False, corpus_path=tmp_path,
                     profile="wsb-test",
                     threshold_rule=lambda config, ref: 0.01 * float(ref.abs().max()))
    assert err.value.outcome.ratio < 10
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_run_case_passes_clean_and_kills_a_mutation_of_the_same_case():
    config = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                           vocab_per_kv_head=16, n_layers=1, batch=1, seq_len=4)
    clean = run_case(Case(config, src=1, dst=2, seed=3))
    bug = run_case(Case(config, src=1, dst=2, seed=3, mutation="lm_head_reversed"))
    assert clean.check_passed and not clean.shards_differ
    assert bug.killed and bug.shards_differ


def test_tokens_that_stay_in_one_vocab_slice_hide_a_reversed_embedding_which_fuzz_tokens_prevent():
    # what the nightly fuzz found at seq_len 2: both tokens in the middle of three vocab
    # slices, where reversing the rank order maps the slice onto itself
    config = DOMAIN.config(n_kv_heads=3, group=1, head_dim=2, d_model=8, ffn_per_kv_head=2,
                           vocab_per_kv_head=82, n_layers=1, batch=1, seq_len=4)
    middle = torch.tensor([[90, 100, 120, 150]])  # slice 1 of 0-81, 82-163, 164-245
    hidden = Checker(config, seed=0, tokens=middle, params=fuzz_params(config, 0),
                     threshold_rule=fuzz_threshold_rule())
    mutation = MUTATIONS["embedding_reversed"]
    (blind,) = sweep(config, pairs=[(1, 3)], mutation=mutation, checker=hidden)
    assert blind.max_abs_error <= blind.threshold  # the forward cannot see it: floor noise only
    assert run_case(Case(config, 1, 3, 0, mutation="embedding_reversed")).killed

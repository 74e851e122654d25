"""A user's own splitter, resharder or converter, fuzzed: the planted geometry-specific bugs
of ``user_functions`` pass the fixed checks on TOY and TOY_KV4, and the property finds each
within the default budget (the ``wsb-test`` profile) and shrinks it to a small geometry; the
correct functions pass with zero failures; declined cases are counted, never passed; the
shipped geometries run first; a failure's corpus entry replays against the function."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis.errors import NoSuchExample

sys.path.insert(0, str(Path(__file__).parent))
import user_functions as uf

from tests.breadth import budget
from weight_sync_bench import TOY, TOY_KV4, ModelConfig, check_reshard, check_split
from weight_sync_bench.check.checker import checker_for
from weight_sync_bench.errors import InvalidConfig, UserCodeError, WsbError
from weight_sync_bench.fuzz.corpus import load_corpus, load_entry
from weight_sync_bench.fuzz.domain import DOMAIN, IntRange
from weight_sync_bench.fuzz.profiles import profile_name
from weight_sync_bench.fuzz.runner import PropertyFailed, corpus_examples
from weight_sync_bench.fuzz.replay import replay_entry
from weight_sync_bench.fuzz.user import (
    UserFunction,
    real_geometries,
    user_property,
)
from weight_sync_bench.model.config import HF_CONFIGS
from weight_sync_bench.testing import (
    convert_property,
    degree_pairs,
    geometries,
    narrow,
    reshard_property,
    seeds,
    split_property,
)


@pytest.fixture(autouse=True)
def _own_corpus(monkeypatch, tmp_path_factory):
    """Each test writes the user-function entries it finds into a corpus of its own, not the
    process's shared copy, which other test files replay (and count) entry by entry."""
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path_factory.mktemp("corpus")))


PLANTED_SPLITTERS = [uf.split_kv_at_least_two, uf.split_head_dim_from_d_model]
PLANTED_RESHARDERS = [uf.reshard_wrong_for_mha, uf.reshard_vocab_tiles_of_64]

# pytest collects these as they are: the public API as a user writes it, with a budget of
# its own (the settings a user may pass): a quarter of the profile's, 25 examples by default,
# 500 in the long run (the default budget's reach is
# test_the_correct_functions_pass_with_zero_failures_and_check_the_shipped_geometries)
COLLECTED = settings(max_examples=budget(25, nightly=settings().max_examples))
test_a_correct_resharder_as_a_collected_property = reshard_property(uf.reshard_correct,
                                                                    settings=COLLECTED)
test_a_correct_splitter_on_a_narrowed_domain = split_property(uf.split_correct, max_d_model=32,
                                                              kv_heads=(1, 2), settings=COLLECTED)


# Every degree of TOY and TOY_KV4 in the long run. The default run's equivalent is
# test_the_fixed_checks_themselves_pass_the_planted_functions: each planted function passes
# the fixed check on TOY (splitters) and TOY_KV4 (resharders, replicated KV heads) at a
# sharded degree, as a user calls it; the planted bugs are fuzzed by default over geometries
# that replicate KV heads too (test_each_planted_bug_is_found_...)
@pytest.mark.slow
@pytest.mark.parametrize("config", [TOY, TOY_KV4], ids=lambda c: c.name)
def test_the_planted_functions_pass_the_fixed_checks_on_toy_and_toy_kv4_at_every_degree(config):
    checker = checker_for(config)  # one reference forward for every function and degree
    degrees = checker.layout.supported_degrees()
    for fn in [uf.split_correct, *PLANTED_SPLITTERS]:
        for t in degrees:
            full = {n: x.clone() for n, x in checker.full.items()}
            assert checker.verdict(fn(full, t, config=config), dst=t).passed, (fn.__name__, t)
    for fn in [uf.reshard_correct, *PLANTED_RESHARDERS]:
        for s in degrees:
            for t in degrees:
                source = [{n: x.clone() for n, x in p.items()} for p in checker.declared(s)]
                verdict = checker.verdict(fn(source, t, config=config), src=s, dst=t)
                assert verdict.passed, (fn.__name__, s, t)


def test_the_fixed_checks_themselves_pass_the_planted_functions():
    """``check_split`` / ``check_reshard`` as a user calls them today (the geometry bound)."""
    for fn in PLANTED_SPLITTERS:
        assert check_split(functools.partial(fn, config=TOY), TOY, 2).passed
    for fn in PLANTED_RESHARDERS:
        assert check_reshard(functools.partial(fn, config=TOY_KV4), TOY_KV4, 2, 4).passed


def _found(prop):
    with pytest.raises(PropertyFailed) as info:
        prop()
    return info.value


# What each bug needs, the shrunk geometry must have; and it must be small.
BUGS = {
    "split_kv_at_least_two": lambda c, case: c.n_kv_heads < 2,
    "split_head_dim_from_d_model": lambda c, case: c.d_model // c.n_heads != c.head_dim,
    "reshard_wrong_for_mha": lambda c, case: c.n_heads == c.n_kv_heads and c.n_heads >= 2,
    "reshard_vocab_tiles_of_64": lambda c, case: (c.vocab // case.dst) % 64 != 0,
}


@pytest.mark.parametrize("fn", PLANTED_SPLITTERS + PLANTED_RESHARDERS, ids=lambda f: f.__name__)
def test_each_planted_bug_is_found_in_the_default_budget_and_shrunk_to_a_small_geometry(fn):
    make = split_property if fn in PLANTED_SPLITTERS else reshard_property
    prop = make(fn)
    failure = _found(prop)
    case = failure.outcome.case
    assert case.config.name not in HF_CONFIGS  # a random draw, shrunk; not the shipped one
    assert BUGS[fn.__name__](case.config, case)
    assert case.config.n_layers == 1 and case.config.d_model == 8 and case.seed == 0
    assert case.config.n_kv_heads <= 2 and case.dst <= 2
    assert prop.stats.first_failure_at is not None and prop.stats.first_failure_at <= 100
    text = str(failure)
    assert f"your {'splitter' if make is split_property else 'resharder'} user_functions:" \
           f"{fn.__name__}" in text
    assert "geometry: vocab=" in text and "seq_len=" in text and "degrees: " in text
    assert "corpus entry: " in text


def test_a_failure_names_the_heads_each_rank_holds_the_deviation_and_the_threshold():
    text = str(_found(reshard_property(uf.reshard_wrong_for_mha)))
    assert "first parameter that differs from the declared layout: layers.0.qkv.weight" in text
    # rows 0-1, 6-7, 2-3, 8-9, 4-5, 10-11; declared 0-11
    assert "rank 0 layers.0.qkv.weight holds Q head 0, K head 1, Q head 1, V head 0, K head 0, " \
           "V head 1; declared Q heads 0-1, K heads 0-1, V heads 0-1" in text
    assert "max |logit error| " in text and "> threshold " in text


def test_the_correct_functions_pass_with_zero_failures_and_check_the_shipped_geometries():
    prop = split_property(uf.split_correct)
    prop()
    assert prop.stats.declined == 0 and prop.stats.checked >= 100
    assert sorted(prop.stats.real) == sorted(HF_CONFIGS)
    assert all(o.check_passed for o in prop.stats.real.values())


@pytest.mark.skipif(profile_name() != "wsb-nightly",
                    reason="the long run: WSB_PROFILE=wsb-nightly (make nightly)")
@pytest.mark.parametrize("make,fn", [(split_property, uf.split_correct),
                                     (reshard_property, uf.reshard_correct),
                                     (functools.partial(convert_property, src="megatron",
                                                        dst="vllm"), uf.convert_megatron_to_vllm)])
def test_the_correct_functions_pass_a_long_run_with_zero_failures(make, fn):
    prop = make(fn)  # the nightly profile: 2000 random examples
    prop()
    assert prop.stats.checked >= 2000 and prop.stats.first_failure_at is None


def test_a_shipped_geometry_that_fails_is_held_back_while_random_draws_shrink_a_smaller_one():
    prop = split_property(uf.split_head_dim_from_d_model)
    failure = _found(prop)
    assert prop.stats.real["mistral_nemo"].check_passed is False  # 5120 / 32 != 128
    assert failure.outcome.case.config.name not in HF_CONFIGS  # a drawn (or corpus) case


def test_a_shipped_geometry_failure_is_raised_when_the_draws_find_none():
    prop = split_property(uf.split_head_dim_from_d_model, corpus=False,  # the shipped ones only
                          settings=settings(phases=[Phase.explicit], database=None))
    failure = _found(prop)
    assert failure.outcome.case.config.name == "mistral_nemo"
    assert "a shipped geometry, run as an explicit example: not shrunk" in str(failure)


def test_the_shipped_geometries_are_every_config_json_at_one_layer_and_a_reduced_vocab():
    configs = real_geometries()
    assert [c.name for c in configs] == list(HF_CONFIGS)
    assert all(c.n_layers == 1 and c.vocab == 520 for c in configs)
    nemo = configs[list(HF_CONFIGS).index("mistral_nemo")]
    assert (nemo.n_heads, nemo.n_kv_heads, nemo.d_model // nemo.n_heads, nemo.head_dim) == \
        (32, 8, 10, 8)  # the head_dim ratio kept: head_dim != d_model / n_heads


def test_declined_cases_are_counted_with_the_smallest_and_never_passed():
    # 15 examples, not the profile's 100 (3 declined, derandomized): the claim is the counting
    # (the budget's reach is
    # test_the_correct_functions_pass_with_zero_failures_and_check_the_shipped_geometries)
    prop = reshard_property(uf.reshard_declines_odd_vocab,
                            settings=settings(max_examples=15, database=None))
    with pytest.warns(UserWarning, match=r"declined \(Unsupported") as caught:
        prop()
    stats = prop.stats
    assert 0 < stats.declined < stats.examples and stats.checked == stats.examples - stats.declined
    assert stats.smallest_declined.case.config.vocab % 2 == 1
    assert "only even vocabularies" in str(caught[0].message)


def test_a_function_that_declines_every_case_fails_the_test():
    # 10 drawn examples after the shipped geometries, not the profile's 100: the claim is
    # what a run that checked nothing says, whatever its budget
    with pytest.raises(WsbError, match="every one of the .* cases was declined"):
        reshard_property(uf.reshard_declines_everything,
                         settings=settings(max_examples=10, database=None))()


def test_the_function_gets_config_and_a_converter_hf_config():
    # 10 drawn examples after the shipped geometries: the claim is what each call receives
    convert_property(uf.convert_megatron_to_vllm, "megatron", "vllm",
                     settings=settings(max_examples=10))()  # it asserts hf_config == config


def test_a_converter_bug_on_head_dim_is_found_with_the_canonical_heads_named():
    failure = _found(convert_property(uf.convert_megatron_to_vllm_head_dim_from_hidden,
                                      "megatron", "vllm"))
    assert "holds V head 0, Q head 0, K head 0; declared Q head 0, K head 0, V head 0" in \
        str(failure)


def test_a_fixed_degree_fixes_it_in_every_case():
    prop = reshard_property(uf.reshard_correct, src=2, dst=4,
                            settings=settings(max_examples=10, database=None))
    prop()
    assert prop.stats.checked >= 10


def test_a_function_the_harness_cannot_call_is_refused_before_any_example():
    with pytest.raises(UserCodeError, match="has the wrong signature"):
        reshard_property(lambda shards: shards)


def test_a_function_without_config_is_called_without_it():
    failure = _found(reshard_property(uf.reshard_without_config))
    assert "raised ValueError while resharding" in str(failure)


# -- the domain


def test_narrowing_stays_inside_the_sampled_domain():
    assert narrow(gqa=False).group == IntRange(1, 1)
    assert narrow(gqa=True).group == IntRange(2, 4)
    assert narrow(max_d_model=20).d_model == IntRange(8, 16, 8)
    assert narrow(vocab_multiple=8).vocab_per_kv_head == IntRange(8, 256, 8)
    assert narrow(kv_heads=(2, 3)).n_kv_heads == IntRange(2, 3)
    assert narrow() == DOMAIN


@pytest.mark.parametrize(("kwargs", "message"), [
    # wider than the floor samples: no threshold is derived there
    ({"kv_heads": (1, 8)}, "n_kv_heads=1-8: the fuzz domain has n_kv_heads 1..4"),
    ({"max_d_model": 4}, "max_d_model=4: no d_model of the fuzz domain (8..128 step 8) is left"),
    ({"colour": 3}, "unknown domain field 'colour'"),
    ({"vocab_multiple": 0}, "vocab_multiple must be an int >= 1, got 0"),
])
def test_a_bad_narrowing_is_refused_naming_the_field_and_the_domain(kwargs, message):
    with pytest.raises(InvalidConfig, match="^" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.").replace("+", r"\+")):
        narrow(**kwargs)


@given(config=geometries(gqa=False, max_d_model=32))
def test_narrowed_geometries_draw_only_what_was_asked(config: ModelConfig):
    assert config.n_heads == config.n_kv_heads and config.d_model <= 32
    assert DOMAIN.violations(config) == []


def test_the_exported_strategies_shrink_toward_the_smallest():
    assert find(geometries(), lambda c: True) == DOMAIN.smallest()
    assert find(seeds(), lambda s: True) == 0
    assert find(degree_pairs(TOY_KV4), lambda p: True) == (1, 1)


# -- the corpus


def _only_entry(tmp_path):
    (path,) = sorted(tmp_path.glob("*.json"))
    return load_entry(path)


def test_a_failure_is_written_with_the_function_and_its_source_hash_and_replays(tmp_path):
    function = UserFunction(uf.reshard_wrong_for_mha, "resharder")
    with pytest.raises(PropertyFailed):
        user_property(function, corpus_path=tmp_path, real=False)()
    entry = _only_entry(tmp_path)
    source = Path(uf.__file__).resolve()
    assert entry.user["function"] == "user_functions:reshard_wrong_for_mha"
    assert entry.user["role"] == "resharder" and Path(entry.user["source_file"]) == source
    assert len(entry.user["source_sha256"]) == 64

    def load(spec, role):
        return getattr(uf, spec.split(":")[1])

    replayed = replay_entry(entry, load=load)
    assert replayed.status == "still failing" and replayed.note is None
    assert not replayed.claim_holds
    fixed = replay_entry(entry, load=lambda spec, role: uf.reshard_correct)
    assert fixed.status == "fixed" and fixed.claim_holds


def test_a_replay_says_when_the_source_changed_since_the_entry(tmp_path):
    function = UserFunction(uf.reshard_vocab_tiles_of_64, "resharder")
    with pytest.raises(PropertyFailed):
        user_property(function, corpus_path=tmp_path, real=False)()
    path = next(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    data["user"]["source_sha256"] = "0" * 64
    path.write_text(json.dumps(data))
    replayed = replay_entry(load_entry(path), load=lambda s, r: uf.reshard_vocab_tiles_of_64)
    assert "changed since the entry was written (sha256 000000000000 -> " in replayed.note


def test_a_user_entry_feeds_that_function_only_not_the_harness_invariant(monkeypatch, tmp_path):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    with pytest.raises(PropertyFailed):
        reshard_property(uf.reshard_wrong_for_mha, real=False)()
    assert [e.user["function"] for e in load_corpus()] == ["user_functions:reshard_wrong_for_mha"]
    assert corpus_examples("invariant", None) == []
    function = UserFunction(uf.reshard_wrong_for_mha, "resharder")
    assert [e.case for e in load_corpus() if function.owns(e)] == [e.case for e in load_corpus()]
    assert not any(UserFunction(uf.reshard_correct, "resharder").owns(e) for e in load_corpus())


def test_to_hf_config_is_the_inverse_of_from_hf_config():
    for config in [TOY, TOY.replace(qkv_bias=True), TOY.replace(qkv_bias=True, o_bias=True),
                   TOY.replace(tie_embeddings=True), *real_geometries()]:
        back = ModelConfig.from_hf_config(config.to_hf_config(), name=config.name)
        assert back == config
    with pytest.raises(InvalidConfig, match="bias=True .* has no HF config field"):
        TOY.replace(bias=True).to_hf_config()


def test_a_converters_ends_are_staged_only_where_it_can_place_a_stages_layers():
    """Megatron's pipeline splits are drawn for an end whose endpoint the converter takes
    (``source=`` / ``target=``), shrinking to TP; never for one that takes neither."""
    from weight_sync_bench.fuzz.strategies.user import user_cases

    staged = user_cases("converter", conventions=("megatron", "hf"), stages=(True, False))
    case = find(staged, lambda c: "pp=" in c.src_convention)
    assert case.src_convention.startswith("megatron:tp=") and case.dst_convention == "hf"
    assert case.src == case.conversion().src.world  # a ConversionCase names a staged end so
    assert find(staged, lambda c: True).src_convention == "megatron"  # shrinks to TP
    with pytest.raises(NoSuchExample):
        find(user_cases("converter", conventions=("megatron", "hf"), stages=(False, False)),
             lambda c: "pp=" in c.src_convention, settings=settings(max_examples=60))
    assert UserFunction(uf.convert_staged_megatron_to_hf, "converter", "megatron",
                        "hf").stages == (True, False)
    assert UserFunction(uf.convert_megatron_to_vllm, "converter", "megatron",
                        "vllm").stages == (False, False)

"""The strategies: they stay inside the one domain the floor samples cover, draw only
supported degrees, and shrink toward t=1 and the smallest dimensions."""

import pytest
from hypothesis import find, given, settings
from tests.breadth import budget
from weight_sync_bench.fuzz.strategies import (
    cases,
    degree_pairs,
    geometries,
    rejected_layouts,
    seeds,
)

from weight_sync_bench.errors import InvalidConfig, ToleranceMismatch
from weight_sync_bench.fuzz.domain import DOMAIN, FuzzDomain, IntRange, fuzz_tokens
from weight_sync_bench.fuzz.floor import fuzz_threshold_rule
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.sampled import load_random_floor

# A quarter of the profile's budget per drawn property: wsb-test: 25; nightly: 500
QUARTER = settings(max_examples=budget(25, nightly=settings().max_examples))


def test_the_floor_samples_were_drawn_over_this_domain():
    assert FuzzDomain.from_json(load_random_floor()["domain"]) == DOMAIN


@QUARTER
@given(config=geometries())
def test_every_fuzzed_geometry_lies_inside_the_domain_the_floor_samples_cover(config):
    assert DOMAIN.violations(config) == []
    assert layout_for(config).supported_degrees() == [
        t for t in range(1, config.n_kv_heads + 1) if config.n_kv_heads % t == 0]


def test_floor_samples_reach_both_ends_of_every_domain_range():
    samples = load_random_floor()["samples"]
    coordinates = {
        "n_kv_heads": lambda g: g["n_kv_heads"], "group": lambda g: g["n_heads"] // g["n_kv_heads"],
        "head_dim": lambda g: g["head_dim"], "d_model": lambda g: g["d_model"],
        "ffn_per_kv_head": lambda g: g["ffn"] // g["n_kv_heads"],
        "vocab_per_kv_head": lambda g: g["vocab"] // g["n_kv_heads"],
        "n_layers": lambda g: g["n_layers"], "batch": lambda g: g["batch"],
        "seq_len": lambda g: g["seq_len"]}
    for name, value in coordinates.items():
        seen = [value(s["geometry"]) for s in samples]
        r = getattr(DOMAIN, name)
        assert (min(seen), max(seen)) == (r.lo, r.top), name


@QUARTER
@given(case=cases())
def test_cases_draw_ordered_pairs_of_supported_degrees(case):
    degrees = layout_for(case.config).supported_degrees()
    assert case.src in degrees and case.dst in degrees


@pytest.mark.parametrize("mutation", [None, "lm_head_reversed"])
def test_cases_draw_what_they_drew_when_every_draw_built_its_strategies(mutation):
    """``cases`` builds its geometry and degree strategies once (per domain, per degree
    list) instead of per draw: the same choices give the same cases, examples for
    examples, so a derandomized run draws what it drew before."""
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    from weight_sync_bench.check.mutations import mutation_by_name
    from weight_sync_bench.fuzz.case import Case

    @st.composite
    def built_per_draw(draw):  # cases() before its strategies were kept
        config = draw(geometries(DOMAIN))
        supported = layout_for(config).supported_degrees()
        dsts = supported
        if mutation is not None:
            identity = mutation_by_name(mutation).identity_reason
            dsts = [t for t in supported if identity(config, t) is None] or supported
        src = draw(st.sampled_from(supported))
        dst = draw(st.sampled_from(dsts))
        return Case(config=config, src=src, dst=dst, seed=draw(seeds(DOMAIN)),
                    mutation=mutation)

    def drawn(strategy):
        out = []

        @hypothesis_seed(20261204)
        @settings(max_examples=40, database=None, derandomize=False)
        @given(case=strategy)
        def collect(case):
            out.append(case)

        collect()
        return out

    kept = drawn(cases(mutation=mutation))
    assert len(kept) == 40 and kept == drawn(built_per_draw())


def test_geometries_shrink_to_the_smallest_geometry_of_the_domain():
    assert find(geometries(), lambda c: True) == DOMAIN.smallest()


def test_cases_shrink_toward_t1_and_the_smallest_geometry_that_allows_the_condition():
    case = find(cases(), lambda c: c.dst > 1)
    assert (case.src, case.dst, case.seed) == (1, 2, 0)
    assert case.config == DOMAIN.smallest().replace(n_kv_heads=2, n_heads=2, ffn=4, vocab=16)


def test_cases_with_a_t1_identity_mutation_draw_dst_above_one_where_the_geometry_allows():
    case = find(cases(mutation="lm_head_reversed"), lambda c: c.config.n_kv_heads == 2)
    assert case.dst == 2


def test_degree_pairs_rejects_an_empty_degree_list():
    with pytest.raises(ValueError, match=r"degrees must be non-empty, got degrees=\[\]"):
        degree_pairs(DOMAIN.smallest(), [])


def test_rejected_layouts_shrink_to_more_ranks_than_kv_heads():
    rejection = find(rejected_layouts(), lambda r: True)
    assert (rejection.degree, rejection.config.n_kv_heads, rejection.rule) == (
        2, 1, "n_kv_heads % t == 0")


def test_domain_names_every_field_a_geometry_leaves():
    outside = DOMAIN.largest().replace(d_model=136, n_layers=4)
    assert DOMAIN.violations(outside) == ["d_model=136 not in 8..128 step 8",
                                          "n_layers=4 not in 1..3"]
    ragged = DOMAIN.smallest().replace(n_kv_heads=2, n_heads=2, ffn=3, vocab=16)
    assert DOMAIN.violations(ragged) == ["ffn_per_kv_head=1.5 not in 2..32"]


def test_threshold_outside_the_sampled_domain_is_an_error_naming_the_field():
    import torch
    rule = fuzz_threshold_rule()
    inside = DOMAIN.smallest()
    assert rule(inside, torch.tensor([[-2.0, 1.0]])) > 0
    with pytest.raises(ToleranceMismatch, match=r"outside the sampled domain .*d_model=256"):
        rule(inside.replace(d_model=256), torch.tensor([1.0]))


def test_int_range_rejects_an_empty_range():
    with pytest.raises(InvalidConfig, match=r"lo <= hi \(lo=4, hi=2, step=1\)"):
        IntRange(4, 2)


@QUARTER
@given(config=geometries(), seed=seeds())
def test_fuzz_tokens_read_every_ranks_vocab_slice_at_every_supported_degree(config, seed):
    tokens = fuzz_tokens(config, seed)
    assert tokens.shape == config.token_shape
    for t in layout_for(config).supported_degrees():
        assert set((tokens // (config.vocab // t)).flatten().tolist()) == set(range(t))


def test_core_modules_never_import_hypothesis_or_the_strategies():
    import subprocess
    import sys
    core = ["model.config", "layout.placements", "layout.reshard", "model.reference",
            "model.sharded", "check.checker", "tolerance.rules", "check.mutations",
            "fuzz.domain", "fuzz.floor", "fuzz.corpus", "fuzz.case"]
    code = ("import sys\n" + "".join(f"import weight_sync_bench.{m}\n" for m in core)
            + "print(sorted(m for m in ('hypothesis', 'weight_sync_bench.fuzz.strategies') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

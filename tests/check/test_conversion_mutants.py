"""``check.conversion``'s checker read across destinations (issue 30, the mutation pass over
``check/conversion.py``): one ``ConversionChecker`` judges several destinations in turn, as
the fuzz and ``wsb check`` over several pairs do, so what it caches per destination (the
declared shards, their forward's error) must be keyed by the destination. A cache keyed by
nothing hands the second destination the first's shards: a correct conversion fails, or,
worse, one destination's error is reported for another."""

from __future__ import annotations

import torch

from weight_sync_bench import TOY
from weight_sync_bench.check.conversion import conversion_checker, endpoint_name
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.conventions import convert, endpoint
from weight_sync_bench.model.config import init_params


def test_one_checker_judges_each_destination_by_its_own_declared_shards_and_error():
    checker = conversion_checker(TOY)
    source = checker.source("megatron:2")
    errors = {}
    for dst in ("vllm:2", "vllm:4", "hf", "vllm:2"):
        verdict = checker.verdict(convert(source, "megatron:2", dst, TOY), src="megatron:2",
                                  dst=dst)
        assert verdict.passed and verdict.first_mismatch is None, (dst, verdict)
        assert len(checker.declared(dst)) == (1 if dst == "hf" else int(dst[-1]))
        fresh = checker.error(dst, checker.declared(dst))  # not cached
        assert verdict.max_abs_error == fresh, dst
        errors[dst] = fresh
    assert len(set(errors.values())) > 1  # the destinations' errors differ: keys matter


def test_the_checker_is_built_from_every_option_it_is_given():
    default = conversion_checker(TOY).checker
    assert (default.seed, default.phase, default.dtype, default.mixed) == (0, "1a",
                                                                         torch.float32, False)
    assert all(bit_equal(default.full[n], x) for n, x in init_params(TOY, 0).items())
    seeded = conversion_checker(TOY, seed=3, threshold=0.25, mixed=True).checker
    assert (seeded.seed, seeded.threshold, seeded.mixed) == (3, 0.25, True)
    assert all(bit_equal(seeded.full[n], x) for n, x in init_params(TOY, 3).items())
    mine = {n: x * 0.5 for n, x in init_params(TOY, 1).items()}
    given = conversion_checker(TOY, params=mine).checker
    assert all(bit_equal(given.full[n], x) for n, x in mine.items())


def test_a_verdict_names_an_endpoint_by_its_convention_where_the_degree_says_the_rest():
    assert endpoint_name(endpoint("vllm:2")) == "vllm"
    assert endpoint_name(endpoint("hf")) == "hf"
    assert endpoint_name(endpoint("megatron:tp=2,pp=2")) == "megatron:tp=2,pp=2"
    assert endpoint_name(endpoint("vllm:tp=2,ep=2")) == "vllm:tp=2,ep=2"

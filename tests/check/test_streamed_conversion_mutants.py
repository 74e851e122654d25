"""``check.streamed_conversion`` at its seams (issue 30, the mutation pass over
``check/streamed_conversion.py``): what a streamed conversion refuses before anything is
drawn, which floor judges it, what ``fn`` is asked, how the source is cut, the verdict's
fields, and the run-by-run comparison. That a streamed verdict is the whole check's is
``test_convert.py``'s, ``test_stream_views.py``'s and ``test_moe_check.py``'s."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from tests.sync.conftest import MOE_FEW as MOE
from tests.sync.conftest import tiny
from weight_sync_bench.check import streamed_conversion as sc
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.errors import InvalidNumber, UnsupportedLayout
from weight_sync_bench.model.config import init_params

DENSE = tiny(2, n_layers=1)


def never(*a, **k):
    pytest.fail("called")


def test_a_bad_seed_or_unit_is_refused_before_fn_runs():
    with pytest.raises(InvalidNumber, match=r"^seed must be an int in 0\.\.2\^63-1, got -1$"):
        sc.stream_convert(never, DENSE, "megatron:2", "vllm:2", seed=-1, threshold=1.0)
    with pytest.raises(ValueError, match=r"^per='stage': a streamed check calls fn per layer "
                                         r"or per parameter$"):
        sc.stream_convert(never, DENSE, "megatron:2", "vllm:2", per="stage", threshold=1.0)


def test_a_destination_forward_over_replicas_of_its_tp_group_is_refused_saying_so():
    with pytest.raises(UnsupportedLayout, match=re.escape(
            "megatron:tp=2,ep=4: a streamed conversion runs the destination's forward over one "
            "TP group; 8 ranks hold 4 replicas of TP 2: check it whole (stream=None)")):
        sc.stream_convert(never, MOE, "hf", "megatron:tp=2,ep=4", threshold=1.0)


@pytest.fixture
def floors(monkeypatch):
    """The floor standing in: records what it was asked, gives threshold 0.5."""
    asked = []

    def resolve_floor(config, phase, name, *, measure):
        asked.append(("floor", config, phase, name, measure))
        return SimpleNamespace(threshold=0.5)
    monkeypatch.setattr(sc, "resolve_floor", resolve_floor)
    monkeypatch.setattr(sc, "environment_notes",
                        lambda floor, config, phase, name: (f"<{config.name} {phase} {name}>",))
    monkeypatch.setattr(sc, "require_cell", lambda floor, config, target: asked.append(
        ("cell", floor.threshold, config, target)))
    return asked


@pytest.mark.parametrize("measure", [False, True])
def test_with_no_threshold_the_phase_1a_floor_of_the_dtype_judges_with_its_cell(floors,
                                                                              measure):
    src, dst = "megatron:2", "vllm:2"
    v = sc.stream_convert(sc.stage_convert(src, dst, DENSE), DENSE, src, dst, dtype="bf16",
                          measure_floor=measure)
    assert floors == [("floor", DENSE, "1a", "bf16", measure),
                      ("cell", 0.5, DENSE, endpoint(dst))]
    assert v.threshold == 0.5 and v.notes == ("<tiny_kv2 1a bf16>", *DENSE.notes)
    assert v.passed and v.dtype == "bf16"


def test_a_given_threshold_reads_no_floor(floors):
    v = sc.stream_convert(sc.stage_convert("hf", "vllm:2", DENSE), DENSE, "hf", "vllm:2",
                          threshold=0.25)
    assert not floors and v.threshold == 0.25 and v.notes == DENSE.notes


def test_a_streamed_verdict_names_both_ends_their_degrees_and_the_dtype(floors):
    v = sc.stream_convert(sc.stage_convert("megatron:2", "vllm:1", DENSE), DENSE,
                          "megatron:2", "vllm:1", threshold=1.0)
    assert (v.config, v.src, v.dst, v.conventions, v.dtype) == (
        "tiny_kv2", 2, 1, ("megatron", "vllm"), "fp32")
    assert (v.first_mismatch, v.mismatches, v.diagnosis, v.own_forward) == (None, (), (), False)
    assert v.near_ties is None and v.route_bound is None  # a dense model routes nothing
    assert 0 <= v.max_abs_error < 1e-4


def test_an_moe_streamed_verdict_says_its_near_ties_under_its_threshold(floors):
    v = sc.stream_convert(sc.stage_convert("hf", "vllm:tp=2,ep=2", MOE), MOE, "hf",
                          "vllm:tp=2,ep=2", threshold=1.0, per="parameter")
    assert v.passed and v.route_bound == 1.0
    assert v.near_ties == (MOE.batch * MOE.seq_len * MOE.n_layers,) * 2  # all, at bound 1


def test_fn_is_asked_for_each_unit_with_the_destination_degree_and_its_names(floors):
    seen = []
    convert = sc.stage_convert("megatron:2", "vllm:2", DENSE)

    def fn(shards, degree, *, config):
        seen.append((len(shards), degree, config, sorted(shards[0])))
        return convert(shards, degree)
    sc.stream_convert(fn, DENSE, "megatron:2", "vllm:2", threshold=1.0)
    assert [s[:3] for s in seen] == [(2, 2, DENSE)] * 3  # embedding, the layer, the head
    assert "layers.0.qkv.weight" not in seen[0][3]

    def raises(shards, degree):
        if len(shards[0]) > 1:
            raise RuntimeError("no")
        return convert(shards, degree)
    from weight_sync_bench.errors import UserCodeError
    with pytest.raises(UserCodeError, match=r"while converting tiny_kv2 megatron:2 -> vllm:2 "
                                            r"\(layers\.0\.attn_norm\.weight, "):
        sc.stream_convert(raises, DENSE, "megatron:2", "vllm:2", threshold=1.0)


def test_the_source_is_cut_once_per_distinct_slice_replicas_sharing_it():
    pieces = endpoint("megatron:tp=2,ep=2").pieces(MOE)
    full = init_params(MOE, 0)
    given = sc._cut(pieces, full)
    name = next(n for n in pieces[0] if "embed" in n)
    # ranks 0 and 2 (the two EP replicas of TP rank 0) hold the same slice: one tensor
    assert given[0][name] is given[2][name] and given[1][name] is given[3][name]
    assert given[0][name] is not given[1][name]
    assert all(torch.equal(given[r][n], p.take(full[p.source]))
               for r, rank in enumerate(pieces) for n, p in rank.items())


def test_stage_convert_answers_at_the_degree_it_is_asked_for():
    fn = sc.stage_convert("megatron:2", "vllm:2", DENSE)
    src = [{n: p.take(x) for n, p in rank.items()
            for x in [init_params(DENSE, 0)[p.source]]}
           for rank in endpoint("megatron:2").pieces(DENSE)]
    one = fn(src, 1)  # another degree than the endpoint's: vLLM's cut at 1
    assert len(one) == 1 and all(
        torch.equal(one[0][n], p.take(init_params(DENSE, 0)[p.source]))
        for n, p in endpoint("vllm:1").pieces(DENSE)[0].items())


def test_a_piece_cut_along_another_dim_than_its_source_is_compared_through_the_canonical():
    """Meta's embedding is split along the hidden dim, Megatron's along the vocabulary: no
    run of one dim describes one from the other, so it is compared through the canonical
    tensor; a wrong element there is still found (the twin: the correct converter)."""
    convert = sc.stage_convert("megatron:2", "meta:2", DENSE)
    name = "tok_embeddings.weight"

    def wrong(shards, degree):
        out = convert(shards, degree)
        if name in out[1]:
            out[1][name] = out[1][name].clone()
            out[1][name][-1, -1] += 1.0
        return out
    assert sc.stream_convert(convert, DENSE, "megatron:2", "meta:2", threshold=1.0).passed
    v = sc.stream_convert(wrong, DENSE, "megatron:2", "meta:2", threshold=1.0)
    assert not v.passed and v.first_mismatch == name and v.mismatches == (name,)
    assert v.own_forward and v.diagnosis  # its own forward ran on what it returned


def test_a_streamed_conversion_defaults_to_seed_0_and_the_committed_floor(floors):
    src, dst = "megatron:2", "vllm:2"
    convert = sc.stage_convert(src, dst, DENSE)
    default = sc.stream_convert(convert, DENSE, src, dst)
    assert floors[0] == ("floor", DENSE, "1a", "fp32", False)  # never measured unasked
    assert default.max_abs_error == sc.stream_convert(convert, DENSE, src, dst,
                                                      seed=0).max_abs_error
    assert default.max_abs_error != sc.stream_convert(convert, DENSE, src, dst,
                                                      seed=1).max_abs_error


def test_a_streamed_moe_forward_keeps_the_references_near_tied_choices(floors,
                                                                      sharded_guards):
    from weight_sync_bench.model.sharded import RoutingGuard

    made = sharded_guards
    v = sc.stream_convert(sc.stage_convert("hf", "vllm:tp=2,ep=2", MOE), MOE, "hf",
                          "vllm:tp=2,ep=2", threshold=0.25)
    guard, = made
    assert isinstance(guard, RoutingGuard) and guard.bound == 0.25
    assert sorted(guard.routings) == list(range(MOE.n_layers))  # the reference's, filled
    assert v.near_ties == guard.near_ties()
    sc.stream_convert(sc.stage_convert("hf", "vllm:2", DENSE), DENSE, "hf", "vllm:2",
                      threshold=0.25)
    assert made[-1] is None  # the twin: a dense model's forward routes nothing


def test_a_streamed_conversion_reports_its_progress_per_stage(floors):
    reports = []
    sc.stream_convert(sc.stage_convert("hf", "vllm:2", DENSE), DENSE, "hf", "vllm:2",
                      threshold=1.0, per="parameter", progress=reports.append)
    assert [r.label for r in reports] == ["embedding", "layers.0", "head"]


def test_a_converter_asking_for_its_ends_gets_them_per_unit(floors):
    seen = []
    convert = sc.stage_convert("megatron:2", "vllm:2", DENSE)

    def fn(shards, degree, *, source, target):
        seen.append((source, target))
        return convert(shards, degree)
    sc.stream_convert(fn, DENSE, "megatron:2", "vllm:2", threshold=1.0)
    assert seen == [(endpoint("megatron:2"), endpoint("vllm:2"))] * 3


def test_a_streamed_output_of_the_wrong_shape_is_refused_naming_the_destination(floors):
    from weight_sync_bench.errors import WrongShardShape
    convert = sc.stage_convert("megatron:2", "vllm:2", DENSE)

    def short(shards, degree):
        out = convert(shards, degree)
        name = "model.norm.weight"
        if name in out[1]:
            out[1][name] = out[1][name][:-1]
        return out
    with pytest.raises(WrongShardShape, match=r"^vllm:2 rank 1 model\.norm\.weight: shape "):
        sc.stream_convert(short, DENSE, "megatron:2", "vllm:2", threshold=1.0)

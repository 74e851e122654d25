"""Pins on the index-map primitive that its callers' tests left loose (issue 30, the third
mutation pass over ``conventions/maps.py``): the edges of each helper (no experts, a width
chunked to nothing, a piece of one index), the fields ``Piece.equals`` and ``same_cut``
compare, a subset of names or sources asked for, each parameter's dtype kept through
``translate`` as ``gather_canonical`` keeps it, and the invariants a piece refuses to be
built without. Each test has its twin in the same test: the case that passes beside the
one that must fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weight_sync_bench import TOY
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.conventions import CONVENTIONS, gather_canonical, materialize
from weight_sync_bench.conventions.maps import (
    Piece,
    Run,
    expert_cols,
    expert_rows,
    runs,
    translate,
)
from weight_sync_bench.model.config import init_params

MOE = TOY.replace(name="toy_moe", n_experts=4, top_k=2, expert_ffn=8)


def rows_of(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_no_experts_or_a_chunk_of_nothing_is_an_empty_int64_selection():
    for empty in (expert_rows(MOE, []), expert_cols(MOE, []),
                  expert_rows(MOE, [1], etp=16), expert_cols(MOE, [0, 2], etp=9)):
        assert empty.dtype == torch.int64 and empty.tolist() == []
    # the twins: one expert, and a chunk that is not empty
    assert expert_cols(MOE, [1]).tolist() == list(range(8, 16))
    assert expert_rows(MOE, [1], etp=4, etp_rank=3).tolist() == [22, 23, 30, 31]


def test_a_piece_is_equal_only_in_every_field_it_compares():
    base = Piece("w", 0, torch.tensor([0, 1, 2, 3]), stack=2)
    assert base.equals(base) and base.equals(Piece("w", 0, torch.tensor([0, 1, 2, 3]), stack=2))
    for other in (Piece("v", 0, base.idx, stack=2), Piece("w", 1, base.idx, stack=2),
                  Piece("w", 0, base.idx), Piece("w", 0, base.idx, stack=2, keep=True),
                  Piece("w", 0, torch.tensor([0, 1, 3, 2]), stack=2)):
        assert not base.equals(other) and not other.equals(base), other


def test_the_same_cut_without_a_span_is_told_by_its_indices():
    """Two replicas' pieces of the same gathered (not contiguous) rows are the same cut; a
    different order of the same rows is not."""
    a = Piece("w", 0, torch.tensor([0, 2, 4]))
    assert a.span is None and a.same_cut(Piece("w", 0, torch.tensor([0, 2, 4])))
    assert not a.same_cut(Piece("w", 0, torch.tensor([0, 4, 2])))
    assert Piece("w", 0, torch.tensor([1, 2])).same_cut(Piece("w", 0, torch.tensor([1, 2])))
    assert not Piece("w", 0, torch.tensor([1, 2])).same_cut(Piece("w", 0, torch.tensor([2, 3])))


def test_a_stacked_pieces_shape_is_whole_numbers():
    shape = Piece("w", 0, torch.arange(6), stack=3).local_shape((6, 4))
    assert shape == (3, 2, 4) and all(type(n) is int for n in shape)
    assert Piece("w", 0, torch.arange(6)).local_shape((6, 4)) == (6, 4)


def test_a_piece_is_refused_without_a_vector_of_int64_indices_or_an_even_stack():
    with pytest.raises(AssertionError):
        Piece("w", 0, torch.zeros(2, 2, dtype=torch.int64))  # int64, not a vector
    with pytest.raises(AssertionError):
        Piece("w", 0, torch.arange(4, dtype=torch.int32))  # a vector, not int64
    with pytest.raises(AssertionError):
        Piece("w", 0, torch.arange(3), stack=2)  # 3 indices do not stack in 2
    assert Piece("w", 0, torch.arange(4), stack=2).is_stacked  # the twin


def test_a_whole_span_taken_from_a_transposed_tensor_is_a_contiguous_copy():
    full = torch.arange(12.0).view(3, 4).t()  # dense, not contiguous
    out = Piece("w", 0, torch.arange(4)).take(full)
    assert out.is_contiguous() and torch.equal(out, full)
    assert out.data_ptr() != full.data_ptr()


def test_runs_tell_index_0_from_index_1_and_a_piece_of_one_index_is_one_run():
    src = [{"a": Piece("w", 0, torch.tensor([0]))}, {"b": Piece("w", 0, torch.tensor([1, 2, 3]))}]
    assert runs(src, Piece("w", 0, torch.tensor([0, 1, 2, 3])), 4) == [
        Run(0, 1, 0, "a", 0), Run(1, 3, 1, "b", 0)]
    assert runs(src, Piece("w", 0, torch.tensor([2])), 4) == [Run(0, 1, 1, "b", 1)]
    assert runs(src, Piece("w", 0, torch.tensor([0])), 4) == [Run(0, 1, 0, "a", 0)]
    assert runs(src, Piece("w", 0, rows_of([])), 4) == []


def _mixed(config):
    """``init_params`` as a checkpoint may keep them: fp32 norms beside bf16 matrices."""
    return {n: x if "norm" in n else x.to(torch.bfloat16)
            for n, x in init_params(config, 4).items()}


def test_translate_keeps_each_parameters_dtype_as_gather_canonical_does():
    """A source holding fp32 norms beside bf16 matrices: ``translate`` is still
    ``materialize(dst, gather_canonical(...))`` bit for bit, dtypes included (one dtype for
    every tensor, the first one's, would round the norms to bf16)."""
    shapes = TOY.param_shapes()
    src, dst = CONVENTIONS["megatron"].pieces(TOY, 2), CONVENTIONS["vllm"].pieces(TOY, 4)
    shards = materialize(src, _mixed(TOY))
    want = materialize(dst, gather_canonical(shards, src, shapes))
    got = translate(shards, src, dst, shapes)
    dtypes = {w[n].dtype for w in want for n in w}
    assert dtypes == {torch.float32, torch.bfloat16}  # the case is mixed
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for g, w in zip(got, want):
        for n in w:
            assert g[n].dtype == w[n].dtype and bit_equal(g[n], w[n]), n


def test_translate_and_gather_give_only_what_was_asked_for():
    shapes = TOY.param_shapes()
    src, dst = CONVENTIONS["megatron"].pieces(TOY, 2), CONVENTIONS["hf"].pieces(TOY, 1)
    shards = materialize(src, init_params(TOY, 2))
    name = next(n for n in dst[0] if "down" in n)
    got = translate(shards, src, dst, shapes, names=[name])
    assert [sorted(r) for r in got] == [[name]]
    assert bit_equal(got[0][name], translate(shards, src, dst, shapes)[0][name])  # the twin
    source = dst[0][name].source
    assert sorted(gather_canonical(shards, src, shapes, [source])) == [source]
    last = next(reversed(src[0].values())).source  # past every other source on the rank
    assert bit_equal(gather_canonical(shards, src, shapes, [last])[last],
                     gather_canonical(shards, src, shapes)[last])
    assert len(gather_canonical(shards, src, shapes)) == len(shapes)


def test_a_parameter_no_rank_stores_gathers_as_fp32_zeros_whatever_the_default_dtype():
    shapes = {"w": (2,), "unstored": (3,)}
    pieces = [{"a": Piece("w", 0, torch.tensor([0, 1]))}]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        back = gather_canonical([{"a": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}],
                                pieces, shapes)
    finally:
        torch.set_default_dtype(before)
    assert back["unstored"].dtype == torch.float32 and back["unstored"].tolist() == [0, 0, 0]
    assert back["w"].dtype == torch.bfloat16  # the twin: a stored one keeps its dtype


def test_the_fallback_through_the_canonical_tensor_keeps_a_subset_too():
    """Meta's hidden-split embedding from a vocabulary-split one: no runs of one dim describe
    it, so ``translate`` goes through that parameter's canonical tensor."""
    shapes = TOY.param_shapes()
    src, dst = CONVENTIONS["megatron"].pieces(TOY, 2), CONVENTIONS["meta"].pieces(TOY, 2)
    shards = materialize(src, init_params(TOY, 1))
    name = next(n for n, p in dst[0].items() if runs(src, p, shapes[p.source][p.dim]) is None)
    got = translate(shards, src, dst, shapes, names=[name])
    want = materialize(dst, gather_canonical(shards, src, shapes), names=[name])
    assert [sorted(r) for r in got] == [[name], [name]]
    assert all(bit_equal(g[name], w[name]) for g, w in zip(got, want))


def test_members_of_a_stacked_piece_are_its_runs_in_order_and_plain_is_itself():
    piece = Piece("w", 0, torch.tensor([4, 5, 0, 1, 2, 3]), stack=3)
    members = piece.members()
    assert [m.idx.tolist() for m in members] == [[4, 5], [0, 1], [2, 3]]
    assert all(not m.is_stacked and m.source == "w" and m.dim == 0 for m in members)
    plain = Piece("w", 0, torch.tensor([1, 2]))
    assert plain.members() == [plain]
    kept = dataclasses.replace(plain, keep=True)  # one member, stacked: [1, ...]
    assert [m.idx.tolist() for m in kept.members()] == [[1, 2]]


def test_translate_makes_no_canonical_tensor_where_runs_describe_the_cut(monkeypatch):
    """The streamed conversion's memory claim: a cut that runs describe is written from
    views of the source tensors, never through ``gather_canonical``; where none do (Meta's
    hidden-split embedding), only that parameter's canonical tensor is made. Each
    parameter's owners are found once, however many destination ranks read them."""
    import weight_sync_bench.conventions.maps as maps

    shapes = TOY.param_shapes()
    src = CONVENTIONS["megatron"].pieces(TOY, 2)
    shards = materialize(src, init_params(TOY, 1))
    gathered, owners = [], []
    real_gather, real_of = maps.gather_canonical, maps.Owners.of.__func__

    def spy_gather(shards, pieces, shapes, sources=None):
        gathered.append(None if sources is None else list(sources))
        return real_gather(shards, pieces, shapes, sources)

    def spy_of(cls, src, source, dim, size):
        owners.append((source, dim))
        return real_of(cls, src, source, dim, size)

    monkeypatch.setattr(maps, "gather_canonical", spy_gather)
    monkeypatch.setattr(maps.Owners, "of", classmethod(spy_of))
    translate(shards, src, CONVENTIONS["vllm"].pieces(TOY, 4), shapes)
    assert gathered == [] and len(owners) == len(set(owners)) == len(shapes)
    meta = CONVENTIONS["meta"].pieces(TOY, 2)
    translate(shards, src, meta, shapes)  # the twin: one parameter through its canonical
    assert gathered == [["tok_embeddings.weight"]], gathered


def test_a_destination_parameter_no_source_holds_is_fp32_zeros_whatever_the_default():
    src = [{"a": Piece("w", 0, torch.tensor([0, 1]))}]
    dst = [{"x": Piece("w", 0, torch.tensor([1, 0])), "y": Piece("u", 0, torch.tensor([2, 0]))}]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = translate([{"a": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}], src, dst,
                        {"w": (2,), "u": (3,)})
    finally:
        torch.set_default_dtype(before)
    assert got[0]["y"].dtype == torch.float32 and got[0]["y"].tolist() == [0.0, 0.0]
    assert got[0]["x"].dtype == torch.bfloat16 and got[0]["x"].tolist() == [2.0, 1.0]

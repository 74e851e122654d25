"""The index-map primitive: a stored tensor is an index selection of one canonical
parameter, -1 a zero slice; gathering back is its exact inverse."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench import TOY, TOY_KV4
from tests.breadth import breadth
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.conventions import (
    CONVENTIONS,
    gather_canonical,
    materialize,
    shards_for,
)
from weight_sync_bench.conventions.maps import Piece, Run, padded, placed, rows, runs, translate
from weight_sync_bench.layout.placements import Shard
from weight_sync_bench.layout.table import ShardSpec
from weight_sync_bench.model.config import init_params


def test_a_piece_selects_along_its_dim_and_minus_one_is_a_zero_slice():
    full = torch.arange(12.0).view(3, 4)
    assert torch.equal(Piece("w", 0, torch.tensor([2, -1, 0])).take(full),
                       torch.tensor([[8.0, 9, 10, 11], [0, 0, 0, 0], [0, 1, 2, 3]]))
    assert torch.equal(Piece("w", 1, rows(1, 3)).take(full), full[:, 1:3])
    assert Piece("w", 1, rows(1, 3)).local_shape((3, 4)) == (3, 2)
    assert padded(3, 5).tolist() == [0, 1, 2, -1, -1]


def test_a_taken_piece_never_aliases_its_source():
    full = torch.ones(4, 2)
    out = Piece("w", 0, rows(0, 4)).take(full)
    out.zero_()
    assert full.sum() == 8


def test_gather_drops_padding_and_takes_a_replica_from_the_lowest_rank():
    pieces = [{"a": Piece("w", 0, torch.tensor([0, 1, -1]))}, {"b": Piece("w", 0, torch.tensor([1, 2]))}]
    shards = [{"a": torch.tensor([10.0, 11.0, 0.0])}, {"b": torch.tensor([99.0, 12.0])}]
    assert gather_canonical(shards, pieces, {"w": (3,)})["w"].tolist() == [10.0, 11.0, 12.0]


# TOY_KV4's heads and layers with a vocabulary of 1000 (padded by Megatron and vLLM at every
# degree; 32000 is not at tp 1 or 2): the maps depend on the heads; TOY_KV4's 32000-row
# embedding and head made the five cases below 1.7 s, these 0.3.
KV4_V1000 = TOY_KV4.replace(name="toy_kv4_v1000", vocab=1000)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_gather_is_the_exact_inverse_of_materialize_at_every_degree(convention):
    config = KV4_V1000
    params = init_params(config, 1)
    conv = CONVENTIONS[convention]
    for t in conv.supported_degrees(config, 8):
        back = gather_canonical(materialize(conv.pieces(config, t), params),
                                conv.pieces(config, t), config.param_shapes())
        assert set(back) == set(params)
        assert all(torch.equal(back[n].view(torch.int32), params[n].view(torch.int32))
                   for n in params), (convention, t)


def test_shards_for_materializes_the_declared_maps_from_init_params():
    config = KV4_V1000
    params = init_params(config, 5)
    pieces = CONVENTIONS["megatron"].pieces(config, 4)
    expected = materialize(pieces, params)
    got = shards_for(config, "megatron", 4, seed=5)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(got, expected) for n in a)


def _endpoints(config):
    return [(name, t) for name, conv in CONVENTIONS.items()
            for t in conv.supported_degrees(config, 8)]


def _covering_pairs(eps):
    """Every ordered pair of conventions once, the degrees at each end rotating so that every
    endpoint is a source and a destination: 25 pairs of the 169. For source convention i and
    destination convention j, the source takes its degree j (mod its count), the destination
    its degree i: each convention has at most five degrees, one per partner convention."""
    by = {}
    for name, t in eps:
        by.setdefault(name, []).append((name, t))
    names = list(by)
    return [(by[a][j % len(by[a])], by[b][i % len(by[b])])
            for i, a in enumerate(names) for j, b in enumerate(names)]


# By default the covering pairs (each convention to each, every endpoint at each end: padding,
# replicated KV heads at vllm:4 and 8, Meta's hidden-split embedding as a source and as a
# destination); every ordered pair in the long run (5.4 s).
@pytest.mark.parametrize("pairs", breadth(["covering", "every"], keep={"covering"}))
def test_translate_is_gather_then_materialize_bit_for_bit_between_every_pair(pairs):
    """The streamed check's converter and comparison read source views run by run; every
    ordered pair of endpoints (padding, replicated KV heads, Meta's hidden-split embedding
    through its fallback) gives the canonical route's bytes. A small vocabulary (1000 rows,
    padded by Megatron and vLLM) keeps the 169 pairs fast; the maps depend on the heads."""
    config = TOY.replace(name="toy_v1000", vocab=1000)  # KV heads replicated at vllm:4, 8
    params, shapes = init_params(config, 3), config.param_shapes()
    eps = _endpoints(config)
    chosen = ([(a, b) for a in eps for b in eps] if pairs == "every"
              else _covering_pairs(eps))
    assert {a for a, _ in chosen} == {b for _, b in chosen} == set(eps)
    assert {(a[0], b[0]) for a, b in chosen} == {(a, b) for a in CONVENTIONS for b in CONVENTIONS}
    for a, ta in eps:  # each source's shards and canonical route once, for every destination
        if not any(x == (a, ta) for x, _ in chosen):
            continue
        src = CONVENTIONS[a].pieces(config, ta)
        shards = materialize(src, params)
        canonical = gather_canonical(shards, src, shapes)
        held = {x.data_ptr() for r in shards for x in r.values()}
        for b, tb in [y for x, y in chosen if x == (a, ta)]:
            dst = CONVENTIONS[b].pieces(config, tb)
            want = materialize(dst, canonical)
            got = translate(shards, src, dst, shapes)
            assert [sorted(r) for r in got] == [sorted(r) for r in want], (a, ta, b, tb)
            assert all(bit_equal(g[n], w[n]) for g, w in zip(got, want) for n in w), (a, ta, b,
                                                                                      tb)
            assert not any(g[n].data_ptr() in held for g in got for n in g)  # fresh tensors


def test_runs_read_a_replica_from_the_lowest_rank_and_unheld_indices_as_zeros():
    src = [{"a": Piece("w", 0, torch.tensor([2, 3]))},
           {"b": Piece("w", 0, torch.tensor([0, 1, 2, 3]))}]  # 2 and 3 on both ranks
    found = runs(src, Piece("w", 0, torch.tensor([0, 1, 2, 3, -1, 5])), 6)
    assert found == [Run(0, 2, 1, "b", 0), Run(2, 2, 0, "a", 0), Run(4, 2)]  # 4 is padding,
    # 5 no source holds (gather_canonical leaves it zero)
    shards = [{"a": torch.tensor([20.0, 30.0])}, {"b": torch.tensor([0.5, 1.5, 99.0, 99.0])}]
    got = translate(shards, src, [{"x": Piece("w", 0, torch.tensor([3, 0, 1, 2, -1, 5]))}],
                    {"w": (6,)})
    assert got[0]["x"].tolist() == [30.0, 0.5, 1.5, 20.0, 0.0, 0.0]
    assert runs(src, Piece("w", 1, rows(0, 2)), 2) is None  # another dim: no runs of one dim


def test_a_run_breaks_where_the_source_index_jumps_even_on_one_rank():
    src = [{"a": Piece("w", 0, torch.tensor([0, 1, 2, 3]))}]
    assert runs(src, Piece("w", 0, torch.tensor([0, 1, 3, 2])), 4) == [
        Run(0, 2, 0, "a", 0), Run(2, 1, 0, "a", 3), Run(3, 1, 0, "a", 2)]


def test_a_piece_knows_its_contiguous_span_and_its_padding():
    """What a piece derives once from its indices: the span it covers where they run
    contiguously upward (a slice instead of a gather), and where they are padding (-1)."""
    assert Piece("w", 0, rows(3, 7)).span == (3, 7)
    assert Piece("w", 0, rows(5, 6)).span == (5, 6)
    assert Piece("w", 0, rows(0, 3)).padding is None
    for gapped in ([0, 2, 3], [1, 0], [0, 2, 1, 3]):  # the last: its ends as a span's are
        assert Piece("w", 0, torch.tensor(gapped)).span is None, gapped
    padded_piece = Piece("w", 0, torch.tensor([4, 5, -1, -1]))
    assert padded_piece.span is None and padded_piece.padding.tolist() == [2, 3]
    assert padded_piece.padding.dtype == torch.int64


def test_placed_pads_exactly_the_rows_past_the_real_ones():
    """A table stored with more rows than the canonical one (a padded vocabulary): the rows
    past ``real`` are padding, one row of it included, and none where there are none."""
    spec = ShardSpec("tok_embeddings.weight", (10, 4), Shard(0))
    assert placed(spec, 2, 1, real=9).idx.tolist() == [5, 6, 7, 8, -1]
    assert placed(spec, 2, 1, real=10).idx.tolist() == [5, 6, 7, 8, 9]
    assert placed(spec, 2, 0, real=5).idx.tolist() == [0, 1, 2, 3, 4]
    assert placed(spec, 2, 1, real=5).idx.tolist() == [-1] * 5

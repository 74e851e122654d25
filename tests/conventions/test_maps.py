"""The index-map primitive: a stored tensor is an index selection of one canonical
parameter, -1 a zero slice; gathering back is its exact inverse."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench import TOY_KV4
from weight_sync_bench.conventions import (
    CONVENTIONS,
    gather_canonical,
    materialize,
    shards_for,
)
from weight_sync_bench.conventions.maps import Piece, padded, rows
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


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_gather_is_the_exact_inverse_of_materialize_at_every_degree(convention):
    params = init_params(TOY_KV4, 1)
    conv = CONVENTIONS[convention]
    for t in conv.supported_degrees(TOY_KV4, 8):
        back = gather_canonical(materialize(conv.pieces(TOY_KV4, t), params),
                                conv.pieces(TOY_KV4, t), TOY_KV4.param_shapes())
        assert set(back) == set(params)
        assert all(torch.equal(back[n].view(torch.int32), params[n].view(torch.int32))
                   for n in params), (convention, t)


def test_shards_for_materializes_the_declared_maps_from_init_params():
    params = init_params(TOY_KV4, 5)
    pieces = CONVENTIONS["megatron"].pieces(TOY_KV4, 4)
    expected = materialize(pieces, params)
    got = shards_for(TOY_KV4, "megatron", 4, seed=5)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(got, expected) for n in a)

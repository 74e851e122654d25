"""split / gather / reshard / validate_shards claims that mutation testing found unpinned
(mutation/report.md): every error's exact text and typed fields, the dtype a gather keeps,
and the fresh contiguous shards split and reshard promise even from a non-contiguous input."""

import pytest
import torch

from weight_sync_bench import InvalidShards
from weight_sync_bench.errors import WrongShardShape
from weight_sync_bench.layout.placements import (
    FusedPaired,
    HeadPartitioned,
    Replicate,
    Shard,
)
from weight_sync_bench.layout.reshard import (
    gather,
    gather_tensor,
    reshard,
    reshard_pieces,
    reshard_tensor,
    shard_of,
    split,
    split_tensor,
    validate_shards,
)
from weight_sync_bench.layout.table import LayoutTable, ShardSpec

A = ShardSpec("a.weight", (4, 6), Shard(dim=1))
B = ShardSpec("b.weight", (4,), Replicate())
C = ShardSpec("c.weight", (6, 4), Shard(dim=0))
SMALL = LayoutTable((A, B, C))


def _full(dtype=torch.float32):
    return {s.name: torch.arange(torch.Size(s.shape).numel(), dtype=dtype).reshape(s.shape)
            for s in SMALL}


def _transposed(x):
    """The same values as ``x``, dense but not contiguous (a transposed copy's view)."""
    return x.t().contiguous().t() if x.dim() == 2 else x


# -- error text: each names where, what and the numbers (STYLE.md 6)

def test_split_names_the_parameter_and_both_shapes_of_a_wrong_full_tensor():
    with pytest.raises(InvalidShards) as raised:
        split_tensor(torch.zeros(4, 5), A, 2)
    assert str(raised.value) == "a.weight: full tensor has shape [4, 5], layout declares [4, 6]"


@pytest.mark.parametrize("op", [lambda: gather([], SMALL), lambda: reshard([], SMALL, 2)],
                         ids=["gather", "reshard"])
def test_gather_and_reshard_of_no_ranks_say_so(op):
    with pytest.raises(InvalidShards, match=r"^(gather|reshard) needs at least one rank's "
                                            r"shards, got none$"):
        op()


@pytest.mark.parametrize("op", ["gather", "reshard"])
def test_gather_and_reshard_name_the_rank_whose_names_differ(op):
    shards = split(_full(), SMALL, 2)
    del shards[1]["b.weight"]
    with pytest.raises(InvalidShards) as raised:
        gather(shards, SMALL) if op == "gather" else reshard(shards, SMALL, 1)
    assert str(raised.value) == "rank 1: missing b.weight"


# Each case: how the shards are spoiled, and the exact message. Only-missing and only-extra
# cases show that an empty half is left out; two names show the separator.
NAME_CASES = [
    (lambda p: [p.pop("a.weight"), p.pop("b.weight")], "rank 0: missing a.weight, b.weight"),
    (lambda p: p.update(x=p["b.weight"], y=p["b.weight"]), "rank 0: unexpected x, y"),
    (lambda p: [p.pop("c.weight"), p.update(z=p["b.weight"])],
     "rank 0: missing c.weight; unexpected z"),
]


@pytest.mark.parametrize("spoil, message", NAME_CASES, ids=["missing", "extra", "both"])
def test_a_rank_with_wrong_names_is_refused_with_both_lists_named(spoil, message):
    for check in (lambda s: validate_shards(s, SMALL, 2), lambda s: gather(s, SMALL)):
        shards = split(_full(), SMALL, 2)
        spoil(shards[0])
        with pytest.raises(InvalidShards) as raised:
            check(shards)
        assert str(raised.value) == message


@pytest.mark.parametrize("shards, message", [
    ("ab", "expected a list of 2 rank dicts, got str"),  # a str is a Sequence of length 2
    ({0: {}, 1: {}}, "expected a list of 2 rank dicts, got dict"),
    (["not a dict", {}], "rank 0: expected a dict of tensors, got str"),
])
def test_validate_shards_names_a_wrong_container(shards, message):
    with pytest.raises(InvalidShards) as raised:
        validate_shards(shards, SMALL, 2)
    assert str(raised.value) == message


def test_a_wrong_local_shape_carries_rank_name_and_both_shapes():
    shards = split(_full(), SMALL, 2)
    shards[1]["a.weight"] = torch.zeros(4, 2)
    with pytest.raises(WrongShardShape) as raised:
        validate_shards(shards, SMALL, 2)
    e = raised.value
    assert str(e) == "rank 1 a.weight: shape [4, 2], declared [4, 3] (S(1) at t=2)"
    assert (e.rank, e.name, e.expected, e.actual) == (1, "a.weight", (4, 3), (4, 2))
    assert (e.expected_dtype, e.actual_dtype) == (None, None)


@pytest.mark.parametrize("dtype", [torch.float32, {"a.weight": torch.float32,
                                                   "b.weight": torch.float32,
                                                   "c.weight": torch.float32}],
                         ids=["one-dtype", "per-name"])
def test_a_wrong_dtype_carries_rank_name_and_both_dtypes(dtype):
    shards = split(_full(), SMALL, 2)
    assert validate_shards(shards, SMALL, 2, dtype) is None  # the twin: right dtypes pass
    shards[1]["c.weight"] = shards[1]["c.weight"].double()
    with pytest.raises(WrongShardShape) as raised:
        validate_shards(shards, SMALL, 2, dtype)
    e = raised.value
    assert str(e) == "rank 1 c.weight: dtype torch.float64, expected torch.float32"
    assert (e.rank, e.name, e.expected_dtype, e.actual_dtype) == (
        1, "c.weight", torch.float32, torch.float64)
    assert (e.expected, e.actual) == (None, None)


# -- data

@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32])
def test_gather_keeps_the_shards_dtype_byte_for_byte(dtype):
    full = _full(dtype)
    out = gather(split(full, SMALL, 2), SMALL)
    for name, x in full.items():
        assert out[name].dtype == dtype
        assert out[name].view(torch.uint8).equal(x.view(torch.uint8)), name
    assert gather_tensor([s["a.weight"] for s in split(full, SMALL, 3)], A).dtype == dtype


def test_split_shards_are_contiguous_even_from_a_non_contiguous_full_tensor():
    full = {n: _transposed(x) for n, x in _full().items()}
    assert not full["a.weight"].is_contiguous()
    for t in (1, 2, 3):
        for params in split(full, SMALL, t):
            for name, x in params.items():
                assert x.is_contiguous(), (t, name)
    assert all(a[n].equal(b[n]) for a, b in zip(split(full, SMALL, 3), split(_full(), SMALL, 3))
               for n in SMALL.names)


def test_resharded_split_shards_are_contiguous_even_from_non_contiguous_sources():
    """Each destination shard is a fresh contiguous tensor, as ``split`` gives. Sharded
    placements only: a Replicate shard is cloned as it comes (mutation/report.md)."""
    # (1, 2) ... (3, 6): each destination shard lies inside one source shard; (6, 3): two
    for src, dst in [(1, 2), (2, 2), (3, 3), (2, 6), (3, 6), (6, 3)]:
        shards = [{n: _transposed(x) for n, x in p.items()} for p in split(_full(), SMALL, src)]
        out = reshard_tensor([p["a.weight"] for p in shards], A, dst)
        expected = split(_full(), SMALL, dst)
        for rank, x in enumerate(out):
            assert x.is_contiguous(), (src, dst, rank)
            assert x.equal(expected[rank]["a.weight"]), (src, dst, rank)



# -- the views a streamed check compares against (check.stream): shard_of, reshard_pieces

FP = ShardSpec("gate_up.weight", (8, 3), FusedPaired(first=4, second=4))  # 2 ranges per rank
HP = ShardSpec("qkv.weight", (16, 3), HeadPartitioned(n_heads=4, n_kv_heads=2, head_dim=2))


def _arange(spec):
    return torch.arange(torch.Size(spec.shape).numel(), dtype=torch.float32).reshape(spec.shape)


def _shares_memory(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("spec, degrees", [(A, (1, 2, 3, 6)), (B, (1, 2)), (C, (1, 2, 3)),
                                           (FP, (1, 2, 4)), (HP, (1, 2))],
                         ids=["S(1)", "R", "S(0)", "FP", "HP"])
def test_shard_of_is_split_s_shard_and_a_view_of_the_full_tensor_where_one_range_holds_it(
        spec, degrees):
    full = _arange(spec)
    for t in degrees:
        for rank, expected in enumerate(split_tensor(full, spec, t)):
            got = shard_of(full, spec, t, rank)
            assert got.equal(expected), (t, rank)
            one_range = len(spec.ranges(t, rank)[1]) == 1
            assert _shares_memory(got, full) == one_range, (t, rank)  # no copy, else cat's


def test_reshard_pieces_of_a_replicated_parameter_is_rank_0s_copy_whole_at_offset_0():
    shards = [torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)]  # replicas that disagree
    for rank in range(2):
        ((at, piece),) = reshard_pieces(shards, B, 2, rank)
        assert at == 0 and piece is shards[0]


@pytest.mark.parametrize("src, dst, expected", [
    # S(1) of width 6: each destination rank's columns, as (offset, width) of each piece
    (6, 2, [[(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]),
    (3, 2, [[(0, 2), (2, 1)], [(0, 1), (1, 2)]]),
    (2, 3, [[(0, 2)], [(0, 1), (1, 1)], [(0, 2)]]),
    (2, 6, [[(0, 1)]] * 6),
    (1, 1, [[(0, 6)]]),
])
def test_reshard_pieces_are_the_overlapping_source_views_in_order_with_their_offsets(
        src, dst, expected):
    """One piece per source segment that overlaps the destination range, none for a segment
    that only touches it, each at the offset where it lands in the destination shard."""
    shards = split_tensor(_arange(A), A, src)
    for rank in range(dst):
        pieces = reshard_pieces(shards, A, dst, rank)
        assert [(at, piece.shape[1]) for at, piece in pieces] == expected[rank], rank
        assert all(any(_shares_memory(piece, s) for s in shards) for _, piece in pieces)
        assert torch.cat([piece for _, piece in pieces], dim=1).equal(
            split_tensor(_arange(A), A, dst)[rank]), rank


def test_reshard_pieces_of_a_fused_placement_cover_each_block_in_order():
    shards = split_tensor(_arange(FP), FP, 4)  # rank r: gate row r, then up row r
    pieces = reshard_pieces(shards, FP, 2, 1)  # gate rows 2-3, then up rows 6-7
    assert [(at, piece.shape[0]) for at, piece in pieces] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert torch.cat([p for _, p in pieces]).equal(split_tensor(_arange(FP), FP, 2)[1])

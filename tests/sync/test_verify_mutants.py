"""Phase 2's element check read exactly, in process (issue 30's mutation testing of
``sync/verify.py``): the functions the ranks run to judge what arrived (``check_elements``,
``first_difference``, ``structure_error``, ``expected``) called on the generator's own
destination tensors, which pass, and on copies with one fault each, on the last rank:
a flipped bit, a -0.0 where +0.0 is declared (equal values, other bytes), a wrong name,
shape, dtype or type. ``test_verify.py`` runs the same over gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.sync import plan_for, sync_layout
from weight_sync_bench.sync.boxes import cover_of
from weight_sync_bench.sync.values import region_of
from weight_sync_bench.sync.verify import (
    ElementCheck,
    Regenerated,
    check_elements,
    expected,
    first_difference,
    generated,
    structure_error,
)

SEED = 5
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
OUT = "output_layer.weight"


@pytest.fixture(scope="module")
def plan():
    # megatron:4 pads the 256-row vocabulary to 512: rank 3's output rows are all padding
    config = tiny(2)
    return plan_for(sync_layout(config, "vllm:2"), sync_layout(config, "megatron:4"))


def _arrived(plan, rank):
    return {n: x.clone() for n, x in generated(plan.dst, rank, SEED).items()}


def _counts(plan, rank):
    """(elements checked, elements stored) of ``rank``, from its cover: every element,
    padding included (compared with the zeros it must hold)."""
    total = sum(s.numel for s in cover_of(plan.dst).ranks[rank].values())
    return total, total


def test_the_generators_own_tensors_pass_with_every_element_counted(plan):
    for rank in range(plan.dst.world):
        got = check_elements(plan, rank, _arrived(plan, rank), SEED)
        held, total = _counts(plan, rank)
        assert got == ElementCheck(rank, held, total, (), ()) and got.passed
        assert type(got.checked) is int  # an element count, not a float equal to it
    padding = [b for b in cover_of(plan.dst).ranks[3][OUT].boxes if b.source is None]
    assert padding and sum(b.length for b in padding) == 128  # checked too: as zeros
    # a rank past the destination's world holds nothing and checks nothing
    assert check_elements(plan, plan.dst.world, {}, SEED) == ElementCheck(4, 0, 0, (), ())
    assert generated(plan.dst, plan.dst.world, SEED) == {}


def test_a_flipped_bit_on_the_last_rank_names_the_tensor_and_diagnoses_it(plan):
    rank = plan.dst.world - 1
    out = _arrived(plan, rank)
    flat = out[QKV].view(torch.int32).view(-1)
    flat[-1] ^= 1
    got = check_elements(plan, rank, out, SEED)
    assert got.differ == (QKV,) and not got.passed
    # rank 3 of megatron:4 over 2 KV heads holds Q head 7, K and V head 1: the last row, V's
    # last, is the one that changed
    assert got.lines == ((f"rank 3 {QKV} holds Q head 7, K head 1, V head 1 rows 0-6, ?; "
                         "declared Q head 7, K head 1, V head 1"),)
    assert (got.rank, got.checked, got.total) == (rank, *_counts(plan, rank))


def test_a_layer_stored_under_another_layers_index_is_diagnosed_as_such():
    config = tiny(2, n_layers=2)
    plan = plan_for(sync_layout(config, "vllm:2"), sync_layout(config, "megatron:4"))
    out = {n: x.clone() for n, x in generated(plan.dst, 3, SEED).items()}
    layer0, layer1 = QKV, QKV.replace("layers.0", "layers.1")
    out[layer0] = out[layer1].clone()
    got = check_elements(plan, 3, out, SEED)
    assert got.differ == (layer0,)
    assert got.lines == ((f"rank 3 {layer0} holds layer 1's qkv.weight (its declared cut) byte "
                         "for byte; declared layer 0's: a layer stored under another layer's "
                         "index (a stage's local index read as global, or its offset wrong)"),)


def test_expected_is_float32_whatever_the_default_dtype(plan):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert expected(plan.dst, 3, OUT, SEED).dtype == torch.float32
        assert expected(plan.dst, 0, QKV, SEED).dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)


def test_a_negative_zero_over_declared_padding_differs(plan):
    out = _arrived(plan, 3)
    assert not out[OUT].any()  # rank 3's output rows: all padding
    out[OUT] = -out[OUT]  # equal values, other bytes
    got = check_elements(plan, 3, out, SEED)
    assert got.differ == (OUT,) and not got.passed
    assert got.lines == (f"rank 3 {OUT} holds zeros x128; declared padding x128",)


def test_tensors_that_differ_are_listed_in_the_layouts_order_and_the_first_diagnosed(plan):
    rank = plan.dst.world - 1
    out = _arrived(plan, rank)
    names = list(plan.dst.pieces[rank])
    first, last = names[0], names[-1]
    for name in (last, first):
        out[name] = out[name] + 1.0
    got = check_elements(plan, rank, out, SEED)
    assert got.differ == (first, last)
    alone = _arrived(plan, rank)
    alone[first] = alone[first] + 1.0
    assert got.lines == check_elements(plan, rank, alone, SEED).lines != ()


def test_first_difference_orders_by_the_layout_and_keeps_the_lines_of_that_tensor(plan):
    emb = "embedding.word_embeddings.weight"  # first in the layout, not in the alphabet
    ok = ElementCheck(0, 1, 1, (), ())
    a = ElementCheck(1, 1, 1, (QKV,), ("rank 1 qkv",))
    b = ElementCheck(2, 1, 1, (emb, QKV), ("rank 2 emb",))
    c = ElementCheck(3, 1, 1, (emb,), ("rank 3 emb",))
    order = list(dict.fromkeys(n for rank in plan.dst.pieces for n in rank))
    assert order.index(emb) < order.index(QKV) and QKV < emb
    assert first_difference(plan.dst, [ok, a, b, c]) == ((emb, QKV), ("rank 2 emb", "rank 3 emb"))
    assert first_difference(plan.dst, [ok, a]) == ((QKV,), ("rank 1 qkv",))
    assert first_difference(plan.dst, [ok]) == ((), ())


def test_each_structural_fault_is_named_on_its_rank(plan):
    rank = plan.dst.world - 1
    where = f"megatron:4 rank {rank}"
    good = _arrived(plan, rank)
    assert structure_error(plan, rank, good) is None
    assert structure_error(plan, rank, [1]) == f"{where}: expected a dict of tensors, got list"
    missing = {n: x for n, x in good.items() if n != QKV}
    assert structure_error(plan, rank, missing) == f"{where}: missing {QKV}"
    two = {n: x for n, x in missing.items() if n != OUT}
    assert structure_error(plan, rank, two) == f"{where}: missing {QKV}, {OUT}"
    both = {**missing, "z.weight": good[QKV], "a.weight": good[QKV]}
    assert structure_error(plan, rank, both) == (f"{where}: missing {QKV}; unexpected "
                                                 "a.weight, z.weight")
    assert structure_error(plan, rank, {**good, QKV: good[QKV].tolist()}) == (
        f"{where} {QKV}: expected a Tensor, got list")
    shape = list(good[QKV].shape)
    assert structure_error(plan, rank, {**good, QKV: good[QKV][:-1]}) == (
        f"{where} {QKV}: torch.float32 {[shape[0] - 1, *shape[1:]]}, declared torch.float32 "
        f"{shape}")
    assert structure_error(plan, rank, {**good, QKV: good[QKV].double()}) == (
        f"{where} {QKV}: torch.float64 {shape}, declared torch.float32 {shape}")
    # past the destination's world a rank holds nothing: anything it returns is unexpected
    assert structure_error(plan, 4, {}) is None
    assert structure_error(plan, 4, {"x": good[QKV]}) == "megatron:4 rank 4: unexpected x"


def test_expected_is_the_canonical_region_box_by_box_and_zeros_in_padding(plan):
    config = plan.dst.config
    shapes = config.param_shapes()
    canonical = Regenerated(SEED, shapes)
    assert len(canonical) == len(shapes) and list(canonical) == list(shapes)
    qkv = canonical["layers.0.qkv.weight"]
    assert torch.equal(qkv, region_of(SEED, "layers.0.qkv.weight", shapes["layers.0.qkv.weight"],
                                      tuple((0, n) for n in shapes["layers.0.qkv.weight"])))
    for rank in range(plan.dst.world):
        for name, piece in plan.dst.pieces[rank].items():
            want = canonical[piece.source].index_select(piece.dim, piece.idx.clamp(min=0))
            if bool((piece.idx < 0).any()):
                want.index_fill_(piece.dim, torch.nonzero(piece.idx < 0).flatten(), 0.0)
            assert torch.equal(expected(plan.dst, rank, name, SEED), want), (rank, name)
    assert not expected(plan.dst, 3, OUT, SEED).any()

"""Exact pins on ``training/mutations.py``: what each planted bug computes on small tensors,
and what each identity rule answers on hand-built cases, written against the mutants that
survived the behavioural kill matrix (tests/training/test_mutations.py trains a model per
mutation; these call each piece directly). Every rule is shown both ways: a case where it
declares the identity (with its exact reason) and a case where it does not (None)."""

from types import SimpleNamespace

import pytest
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import UnknownMutation
from weight_sync_bench.model.reference import context_mask, document_mask
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.training import mutations as mut
from weight_sync_bench.training.batches import BatchSpec, TrainBatch, segments_from_documents
from weight_sync_bench.training.floor import SMALL, thresholds_for
from weight_sync_bench.training.loss import IGNORE_INDEX
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.optimizer import AdamW
from weight_sync_bench.training.step import CORRECT, TrainingCase

X = IGNORE_INDEX


def batch(documents, seq_len, *, packed=True, ignored=(), labels=None):
    """A batch laid out as ``documents``: every real position's label valid (1) except the
    (row, position) pairs in ``ignored``; padding ignored unless ``labels`` gives them all."""
    spec = BatchSpec(tuple(documents), seq_len, packed=packed)
    segments = segments_from_documents(spec.documents, seq_len)
    if labels is None:
        targets = torch.where(segments >= 0, 1, X)
        for row, pos in ignored:
            targets[row, pos] = X
    else:
        targets = torch.tensor(labels)
    return TrainBatch(spec, torch.zeros_like(segments), targets, segments)


def case(mesh, batches, *, layers=2, **config):
    """What the identity rules read of a ``TrainingCase``: config, mesh, spec, batches."""
    first = batches[0]
    return SimpleNamespace(config=SimpleNamespace(n_layers=layers, **config), mesh=mesh,
                           spec=first.spec, batches=batches)


def counts_case(mesh, *targets):
    """A case whose batches hold only ``targets`` (what ``_equal_counts`` reads)."""
    rows, seq_len = torch.tensor(targets[0]).shape
    return SimpleNamespace(mesh=mesh, spec=SimpleNamespace(rows=rows, seq_len=seq_len),
                           batches=[SimpleNamespace(targets=torch.tensor(t)) for t in targets])


# ---- the planted bugs' arithmetic ----

def test_equal_average_divides_the_local_sum_by_the_local_count_and_dp_times_cp():
    losses = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    targets = torch.tensor([[4, X, 7, X]])
    out = mut._equal_average(losses, targets, 99, Mesh(2, 1, cp=3))
    assert out.item() == 12.0 / 2 / 6  # the global total (99) is not read


def test_mean_over_group_sums_then_divides_by_the_degree_with_the_tag():
    coll = InProcessCollective(2)
    out = mut._mean_over_group([torch.ones(2), 3 * torch.ones(2)], coll, "layers.0.qkv.bias")
    assert [o.tolist() for o in out] == [[2.0, 2.0], [2.0, 2.0]]
    assert coll.calls == [("all_reduce", "layers.0.qkv.bias")]


def test_every_rank_seeds_backward_with_one_and_every_label_is_counted():
    assert mut._seed_every_rank((0, 1, 2)) == [1.0, 1.0, 1.0]
    targets = [torch.full((2, 4), X), torch.tensor([[1, X, 2]])]
    assert mut._count_every_label(targets, Mesh(2, 1)) == 11


def test_only_the_last_dp_rank_is_one_late():
    assert [mut._last_rank_late(d, Mesh(3, 1)) for d in range(3)] == [0, 0, 1]
    assert mut._last_rank_late(0, Mesh(1, 1)) == 1


def test_the_optimizer_mutations_change_one_hyperparameter_each():
    adamw = AdamW(lr=0.25, betas=(0.5, 0.75), eps=1e-3, weight_decay=0.0)
    assert mut._beta2_0999(adamw) == AdamW(lr=0.25, betas=(0.5, 0.999), eps=1e-3,
                                           weight_decay=0.0)
    assert mut._lr_half_percent_high(adamw) == AdamW(lr=0.25 * 1.005, betas=(0.5, 0.75),
                                                     eps=1e-3, weight_decay=0.0)
    assert adamw.betas == (0.5, 0.75) and adamw.lr == 0.25  # a new optimizer, not modified


NORM, QKV = "layers.1.ffn_norm.weight", "layers.1.qkv.weight"


def test_norm_unreduced_keeps_each_norm_gradient_and_sums_the_rest():
    coll = InProcessCollective(2)
    grads = [torch.ones(2), 2 * torch.ones(2)]
    kept = mut._norm_unreduced(grads, coll, NORM)
    assert kept == grads and kept is not grads and coll.calls == []
    summed = mut._norm_unreduced(grads, coll, QKV)
    assert [s.tolist() for s in summed] == [[3.0, 3.0]] * 2
    assert coll.calls == [("all_reduce", QKV)]


def test_norm_reduced_twice_sums_norm_gradients_twice_and_the_rest_once():
    coll = InProcessCollective(2)
    grads = [torch.ones(2), 2 * torch.ones(2)]
    twice = mut._norm_reduced_twice(grads, coll, NORM)
    assert [s.tolist() for s in twice] == [[6.0, 6.0]] * 2
    assert coll.calls == [("all_reduce", NORM)] * 2
    once = mut._norm_reduced_twice(grads, coll, QKV)
    assert [s.tolist() for s in once] == [[3.0, 3.0]] * 2
    assert coll.calls[2:] == [("all_reduce", QKV)]


def test_keep_own_returns_each_ranks_gradient_unreduced():
    grads = (torch.ones(1), torch.zeros(1))
    kept = mut._keep_own(grads, InProcessCollective(2), "x")
    assert isinstance(kept, list) and kept[0] is grads[0] and kept[1] is grads[1]


# ---- the mutant models ----

def test_bias_every_rank_adds_each_ranks_bias_before_the_all_reduce():
    bias = torch.tensor([10.0, 20.0])
    shards = [{"layers.0.o_proj.bias": bias}, {"layers.0.o_proj.bias": bias}]
    partial = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])]
    coll = InProcessCollective(2)
    out = mut.BiasEveryRankModel(SMALL, shards, coll).reduce_row_parallel(partial,
                                                                          "layers.0.o_proj")
    assert [o.tolist() for o in out] == [[[24.0, 46.0]]] * 2  # the bias twice
    assert coll.calls == [("all_reduce", "layers.0.o_proj.weight")]
    right = ShardedModel(SMALL, shards, InProcessCollective(2)).reduce_row_parallel(
        partial, "layers.0.o_proj")
    assert [o.tolist() for o in right] == [[[14.0, 26.0]]] * 2  # the twin: once


def test_bias_every_rank_without_a_bias_is_the_plain_sum_and_with_sp_reduce_scatters():
    partial = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])]
    coll = InProcessCollective(2)
    out = mut.BiasEveryRankModel(SMALL, [{}, {}], coll).reduce_row_parallel(partial,
                                                                           "layers.0.down")
    assert [o.tolist() for o in out] == [[[4.0, 6.0]]] * 2
    shards = [{"layers.0.down.bias": torch.tensor([1.0])}] * 2
    partial = [torch.arange(4.0).view(1, 4, 1), torch.ones(1, 4, 1)]
    coll = InProcessCollective(2)
    out = mut.BiasEveryRankModel(SMALL, shards, coll, sequence_parallel=True
                                 ).reduce_row_parallel(partial, "layers.0.down")
    assert [o.flatten().tolist() for o in out] == [[3.0, 4.0], [5.0, 6.0]]
    assert coll.calls == [("reduce_scatter", "layers.0.down.weight")]


def key_offset(cp, width, tail):
    """A KeyOffsetModel over ``cp`` CP ranks, and the gather of K/V chunks holding their
    global positions along dim 1 (``(1, width, tail)`` each)."""
    context = InProcessCollective(cp)
    model = mut.KeyOffsetModel(SMALL, [{}] * cp, InProcessCollective(cp), context=context)
    kv = [(j * width + torch.arange(float(width))).view(1, width, 1).expand(1, width, tail)
          for j in range(cp)]
    return model.gather_context(kv, "layers.0.attn"), context


def test_key_offset_rolls_the_last_cp_ranks_keys_one_chunk_late():
    out, context = key_offset(3, 2, 3)
    assert [o[0, :, 0].tolist() for o in out] == [[0, 1, 2, 3, 4, 5]] * 2 + [[4, 5, 0, 1, 2, 3]]
    assert all(o.shape == (1, 6, 3) for o in out)
    assert all(torch.equal(o[..., 0], o[..., 2]) for o in out)  # rolled along positions only
    assert context.calls == [("all_gather", "layers.0.attn")]


def test_key_offset_over_one_cp_rank_is_the_identity():
    out, _ = key_offset(1, 2, 3)
    assert [o[0, :, 0].tolist() for o in out] == [[0, 1]]


def test_local_causal_masks_with_local_query_positions_and_keeps_documents():
    # chunk [4, 8) of 8: query 4 + i sees keys 0..i (not 0..4 + i)
    plain = mut.LocalCausalModel.chunk_mask(None, 4, 8, 8)
    assert plain.shape == (1, 1, 4, 8)
    assert torch.equal(plain[0, 0], torch.ones(4, 8, dtype=torch.bool).tril())
    segments = torch.tensor([[0, 1, 1, 1, 1, 1, 1, -1]])
    packed = mut.LocalCausalModel.chunk_mask(segments, 4, 8, 8)[0, 0].int().tolist()
    assert packed == [[0, 0, 0, 0, 0, 0, 0, 0],   # query 4: key 0 only, of doc 0: hidden
                      [0, 1, 0, 0, 0, 0, 0, 0],   # query 5: keys 0, 1, of which doc 1's: 1
                      [0, 1, 1, 0, 0, 0, 0, 0],
                      [0, 0, 0, 0, 0, 0, 0, 0]]   # padding query 7 sees nothing
    right = ShardedModel.chunk_mask(segments, 0, 4, 8)  # the twin: the first chunk is right
    assert torch.equal(mut.LocalCausalModel.chunk_mask(segments, 0, 4, 8), right)


def test_doc_edge_lets_real_queries_see_earlier_remote_keys_of_any_document():
    segments = torch.tensor([[0, 0, 1, 1, 1, 2, 2, -1]])
    out = mut.DocEdgeModel.chunk_mask(segments, 4, 8, 8)[0, 0].int().tolist()
    assert out == [[1, 1, 1, 1, 1, 0, 0, 0],   # query 4 (doc 1): remote 0..3, local doc rule
                   [1, 1, 1, 1, 0, 1, 0, 0],   # query 5 (doc 2): remote 0..3, not local 4
                   [1, 1, 1, 1, 0, 1, 1, 0],
                   [0, 0, 0, 0, 0, 0, 0, 0]]   # padding sees nothing
    right = ShardedModel.chunk_mask(segments, 4, 8, 8)
    assert right[0, 0, 1].int().tolist() == [0, 0, 0, 0, 0, 1, 0, 0]  # the twin
    assert torch.equal(mut.DocEdgeModel.chunk_mask(None, 4, 8, 8),
                       ShardedModel.chunk_mask(None, 4, 8, 8))


def test_doc_edge_treats_every_non_negative_id_as_a_real_document():
    segments = torch.tensor([[1, 1, 0, 0]])
    assert mut.DocEdgeModel.chunk_mask(segments, 2, 4, 4)[0, 0].int().tolist() == [
        [1, 1, 1, 0], [1, 1, 1, 1]]


def sp_model(cls=mut.GatherBackwardSplitModel, sp=True):
    return cls(SMALL, [{}, {}], InProcessCollective(2), sequence_parallel=sp)


def test_gather_backward_split_gathers_forward_but_splits_backward():
    xs = [torch.arange(6.0).view(1, 2, 3).requires_grad_(), (6 + torch.arange(6.0)).view(
        1, 2, 3).requires_grad_()]
    model = sp_model()
    out = model.enter_region(xs, "layers.0.qkv")
    assert [o.shape for o in out] == [(1, 4, 3)] * 2
    assert all(torch.equal(o, torch.arange(12.0).view(1, 4, 3)) for o in out)
    assert model.collective.calls == [("all_gather", "layers.0.qkv")]
    weights = [torch.full((1, 4, 3), 1.0), torch.full((1, 4, 3), 10.0)]
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    assert xs[0].grad.unique().tolist() == [1.0] and xs[1].grad.unique().tolist() == [10.0]
    ys = [x.detach().clone().requires_grad_() for x in xs]  # the twin: a reduce-scatter
    right = sp_model(ShardedModel).enter_region(ys, "layers.0.qkv")
    sum((o * w).sum() for o, w in zip(right, weights)).backward()
    assert ys[0].grad.unique().tolist() == [11.0] and ys[1].grad.unique().tolist() == [11.0]


def test_gather_backward_split_without_sp_passes_the_input_through():
    xs = [torch.ones(1, 2, 3), torch.zeros(1, 2, 3)]
    model = sp_model(sp=False)
    assert model.enter_region(xs, "t") is xs and model.collective.calls == []


# ---- the masks the identity rules compare ----

def test_full_mask_stacks_every_chunks_rows_to_the_dense_mask():
    segments = segments_from_documents(((3, 4), (8,)), 8)
    out = mut.full_mask(ShardedModel, segments, 2, 8, 2)
    assert out.shape == (2, 1, 8, 8) and torch.equal(out, document_mask(segments))
    plain = mut.full_mask(ShardedModel, None, 3, 8, 4)
    assert plain.shape == (3, 1, 8, 8)
    assert torch.equal(plain, context_mask(None, 0, 8, 8).expand(3, 1, 8, 8))


def test_full_mask_asks_the_given_model_for_each_chunk():
    out = mut.full_mask(mut.LocalCausalModel, None, 1, 4, 2)[0, 0].int().tolist()
    assert out == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]


CAUSAL4 = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]  # (1, 1, 4, 4)


def _late_row2():
    late = CAUSAL4.clone()
    late[0, 0, 2, 0] = False  # query 2 no longer sees key 0
    return late


def valid_at(*positions):
    valid = torch.zeros(1, 4, dtype=torch.bool)
    valid[0, list(positions)] = True
    return valid


def test_reaches_a_label_through_a_changed_row_at_the_first_layer():
    late = _late_row2()
    assert mut._reaches_a_label(CAUSAL4, late, valid_at(2), 1) is True
    assert mut._reaches_a_label(CAUSAL4, late, valid_at(0, 1, 3), 1) is False
    assert mut._reaches_a_label(CAUSAL4, CAUSAL4, valid_at(0, 1, 2, 3), 2) is False


def test_reaches_a_label_through_later_layers_of_the_late_mask_only():
    late = _late_row2()
    assert mut._reaches_a_label(CAUSAL4, late, valid_at(3), 2) is True  # 3 sees 2
    assert mut._reaches_a_label(CAUSAL4, late, valid_at(0, 1), 2) is False  # they do not
    blind = late.clone()
    blind[0, 0, 3, 2] = False  # query 3 no longer sees 2: row 3 changed itself
    assert mut._reaches_a_label(CAUSAL4, blind, valid_at(3), 1) is True
    chain = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    for q in range(4):
        chain[0, 0, q, max(q - 1, 0):q + 1] = True  # q sees q-1 and itself
    moved = chain.clone()
    moved[0, 0, 1, 0] = False  # row 1 changes; row 2 (sees 1) at layer 2, row 3 at layer 3
    assert mut._reaches_a_label(chain, moved, valid_at(3), 2) is False
    assert mut._reaches_a_label(chain, moved, valid_at(3), 3) is True


# ---- the identity rules ----

def test_tp1_cp1_and_no_sp_name_their_reasons():
    assert mut._tp1(case(Mesh(1, 1), [batch([(8,)], 8)])) == "tp=1: a group of one rank"
    assert mut._tp1(case(Mesh(1, 2), [batch([(8,)], 8)])) is None
    assert mut._cp1(case(Mesh(1, 2), [batch([(8,)], 8)])) == (
        "cp=1: one context chunk, no remote keys")
    assert mut._cp1(case(Mesh(1, 1, cp=2), [batch([(8,)], 8)])) is None
    assert mut._no_sp(case(Mesh(1, 2), [batch([(8,)], 8)])) == (
        "no sequence parallelism: no all-gather enters a region")
    assert mut._no_sp(case(Mesh(1, 1, sp=True), [batch([(8,)], 8)])) == (
        "tp=1: a group of one rank")
    assert mut._no_sp(case(Mesh(1, 2, sp=True), [batch([(8,)], 8)])) is None
    assert mut._never(case(Mesh(1, 1), [batch([(8,)], 8)])) is None


def test_no_row_bias_needs_tp_above_one_and_a_bias():
    one = [batch([(8,)], 8)]
    assert mut._no_row_bias(case(Mesh(1, 1), one, has_o_bias=True, has_down_bias=True)) == (
        "tp=1: a group of one rank")
    assert mut._no_row_bias(case(Mesh(1, 2), one, has_o_bias=False, has_down_bias=False)) == (
        "config has no row-parallel bias")
    # either row-parallel bias is enough: o_proj's alone (o_bias), or down's
    assert mut._no_row_bias(case(Mesh(1, 2), one, has_o_bias=True, has_down_bias=False)) is None
    assert mut._no_row_bias(case(Mesh(1, 2), one, has_o_bias=False, has_down_bias=True)) is None


def test_a_row_bias_added_on_every_rank_is_live_with_an_o_proj_bias_alone():
    # the rule read only bias=True once: an o_bias config was declared the identity, and the
    # check then flagged it (a broken claim)
    real = SMALL.replace(qkv_bias=True, o_bias=True)
    row_bias = mut.training_mutation("row_bias_every_rank")
    assert row_bias.identity_reason(TrainingCase(real, Mesh(1, 2), seed=2)) is None
    assert row_bias.broken_claim(TrainingCase(real, Mesh(1, 2), seed=2),
                                 thresholds_for(real)) is None
    assert row_bias.identity_reason(TrainingCase(SMALL, Mesh(1, 2), seed=2)) == (
        "config has no row-parallel bias")  # the twin


def test_no_vocab_padding_names_the_vocab():
    one = [batch([(8,)], 8)]
    assert mut._no_vocab_padding(case(Mesh(1, 2), one, vocab=52, padded_vocab=52)) == (
        "vocab 52 needs no padding")
    assert mut._no_vocab_padding(case(Mesh(1, 2), one, vocab=50, padded_vocab=52)) is None


def test_all_labels_valid_looks_at_every_batch():
    full = batch([(4,), (4,)], 4)
    assert mut._all_labels_valid(case(Mesh(2, 1), [full, full])) == (
        "no label is ignored or padding")
    holed = batch([(4,), (4,)], 4, ignored=[(1, 3)])
    assert mut._all_labels_valid(case(Mesh(2, 1), [full, holed])) is None


def test_equal_counts_over_one_rank_is_the_identity():
    assert mut._equal_counts(counts_case(Mesh(1, 1), [[1, X, 1, 1]])) == (
        "dp=1: one local mean is the global mean")


def test_equal_counts_compares_every_dp_rank_and_cp_chunk():
    even = [[1, X, 1, X, X, 1, 1, X], [X, 1, 1, X, 1, X, X, 1]]  # 2 per row and chunk
    same = "every DP rank holds the same number of valid tokens"
    assert mut._equal_counts(counts_case(Mesh(2, 1, cp=2), even)) == same
    assert mut._equal_counts(counts_case(Mesh(2, 1), even)) == same
    chunks = [[1, 1, 1, X, X, 1, X, X]]  # one row: its chunks hold 3 and 1
    assert mut._equal_counts(counts_case(Mesh(1, 1, cp=2), chunks)) is None
    assert mut._equal_counts(counts_case(Mesh(1, 1, cp=2), [[1, 1, X, X, 1, X, 1, X]])) == same


def test_equal_counts_reads_every_batch_and_two_counts_differ():
    even, uneven = [[1, 1, X, X], [X, 1, 1, X]], [[1, 1, X, X], [1, 1, 1, X]]
    assert mut._equal_counts(counts_case(Mesh(2, 1), even, uneven)) is None
    assert mut._equal_counts(counts_case(Mesh(2, 1), even, even)) == (
        "every DP rank holds the same number of valid tokens")


LATE = ("on the last DP rank no valid label depends on a position whose visible keys the "
        "late boundaries change")


def test_no_boundary_on_last_rank_unpacked_is_the_identity():
    one = batch([(8,), (6,)], 8, packed=False)
    assert mut._no_boundary_on_last_rank(case(Mesh(2, 1), [one])) == (
        "unpacked: attention is plainly causal, no document mask")


def test_no_boundary_on_last_rank_reads_the_last_dp_ranks_rows_only():
    # rows 0 and 1 have a boundary; row 2 (the last of dp=3) is one full document
    full_last = batch([(3, 5), (2, 6), (8,)], 8)
    assert mut._no_boundary_on_last_rank(case(Mesh(3, 1), [full_last])) == LATE
    boundary_last = batch([(8,), (8,), (2, 6)], 8)
    assert mut._no_boundary_on_last_rank(case(Mesh(3, 1), [boundary_last])) is None
    assert mut._no_boundary_on_last_rank(case(Mesh(2, 1), [boundary_last])) is None


def test_no_boundary_on_last_rank_shifts_by_exactly_one_position():
    # one document of 5 then padding: one late, padding position 5 joins the document (its
    # label ignored, and no later query sees it); a label at 6 would need a shift of two
    labels = [[1, 1, 1, 1, 1, X, 1, X]]
    one = batch([(5,)], 8, labels=labels)
    assert mut._no_boundary_on_last_rank(case(Mesh(1, 1), [one])) == LATE
    labels = [[1, 1, 1, 1, 1, 1, X, X]]
    assert mut._no_boundary_on_last_rank(case(Mesh(1, 1), [batch([(5,)], 8, labels=labels)])
                                         ) is None


def test_no_boundary_on_last_rank_counts_the_layers():
    # doc (3, 5): one late, query 3 joins doc 0 and 4..7 lose key 3; queries 0..2 never
    # see them, whatever the depth, while a valid label at 4 changes at the first layer
    labels = [[1, 1, 1, X, X, X, X, X]]
    one = batch([(3, 5)], 8, labels=labels)
    assert mut._no_boundary_on_last_rank(case(Mesh(1, 1), [one], layers=4)) == LATE
    labels = [[1, 1, 1, X, 1, X, X, X]]
    two = batch([(3, 5)], 8, labels=labels)
    assert mut._no_boundary_on_last_rank(case(Mesh(1, 1), [two], layers=1)) is None


MASK = "no valid label depends on a query whose visible keys the mutant changes"


def test_mask_identity_over_one_cp_rank_is_the_identity():
    rule = mut._mask_identity(mut.DocEdgeModel)
    assert rule(case(Mesh(1, 1), [batch([(1, 3)], 4)])) == "cp=1: one context chunk, no remote keys"


def test_mask_identity_doc_edge_changes_only_packed_rows_after_an_edge():
    rule = mut._mask_identity(mut.DocEdgeModel)
    cp2 = Mesh(1, 1, cp=2)
    # doc 0 = {0}, doc 1 = {1, 2, 3}: only chunk 1's queries (2, 3) see key 0 wrongly
    assert rule(case(cp2, [batch([(1, 3)], 4)])) is None
    assert rule(case(cp2, [batch([(1, 3)], 4, ignored=[(0, 2), (0, 3)])])) == MASK
    assert rule(case(cp2, [batch([(4,)], 4, packed=False)])) == MASK  # unpacked: nothing


def test_mask_identity_local_causal_changes_the_later_chunks():
    rule = mut._mask_identity(mut.LocalCausalModel)
    cp2 = Mesh(1, 1, cp=2)
    assert rule(case(cp2, [batch([(4,)], 4, packed=False)])) is None
    # only queries 2 and 3 change; their labels ignored, and no earlier query sees them
    quiet = batch([(4,)], 4, packed=False, ignored=[(0, 2), (0, 3)])
    assert rule(case(cp2, [quiet])) == MASK
    assert rule(case(cp2, [quiet, batch([(4,)], 4, packed=False)])) is None  # every batch


OFFSET = ("no valid label depends on a last-chunk query whose set of visible keys the "
          "offset changes")


def test_offset_identity_over_one_cp_rank():
    rule = mut._offset_reaches_no_label
    assert rule(case(Mesh(1, 1), [batch([(4,)], 4)])) == "cp=1: one context chunk, no remote keys"


def test_offset_changes_last_chunk_queries_that_do_not_see_every_key():
    rule = mut._offset_reaches_no_label
    cp2 = Mesh(1, 1, cp=2)
    plain = batch([(4,)], 4, packed=False)
    assert rule(case(cp2, [plain], layers=1)) is None  # query 2 sees 0..2: rolled, changed
    # query 3 sees every key (unchanged by the rotation); with query 2's label ignored and
    # one layer nothing valid changes; at two layers query 3 reads query 2
    quiet = batch([(4,)], 4, packed=False, ignored=[(0, 2)])
    assert rule(case(cp2, [quiet], layers=1)) == OFFSET
    assert rule(case(cp2, [quiet], layers=2)) is None
    assert rule(case(cp2, [batch([(4,)], 4, packed=False, ignored=[(0, 0), (0, 1), (0, 3)])],
                     layers=1)) is None


def test_offset_over_three_chunks_rolls_the_last_chunk_only():
    rule = mut._offset_reaches_no_label
    cp3 = Mesh(1, 1, cp=3)
    # 6 positions, chunks of 2: queries 4 (changed) and 5 (sees all); 0..3 untouched
    quiet = batch([(6,)], 6, packed=False, ignored=[(0, 4)])
    assert rule(case(cp3, [quiet], layers=1)) == OFFSET
    assert rule(case(cp3, [batch([(6,)], 6, packed=False, ignored=[(0, 5)])], layers=1)
                ) is None
    packed = batch([(2, 2, 2)], 6, ignored=[(0, 4), (0, 5)])  # doc 2's queries only
    assert rule(case(cp3, [packed], layers=3)) == OFFSET


def test_offset_reads_the_document_mask_of_packed_rows():
    rule = mut._offset_reaches_no_label
    cp2 = Mesh(1, 1, cp=2)
    # unpacked, query 3 sees every key (unchanged); packed (3, 1), it sees key 3 alone,
    # which the rotation moves to key 1
    assert rule(case(cp2, [batch([(4,)], 4, packed=False, ignored=[(0, 2)])], layers=1)
                ) == OFFSET
    assert rule(case(cp2, [batch([(3, 1)], 4, ignored=[(0, 2)])], layers=1)) is None


def test_offset_rotates_each_query_row_on_its_own():
    # row 0 one document: query 3 sees every key, unchanged; row 1's last chunk is its second
    # document, labels ignored. Rotating the chunk's rows as one flat block would hand
    # row 0's query 3 row 1's first keys (unseen there) and call it changed
    rows = batch([(4,), (2, 2)], 4, ignored=[(0, 2), (1, 2), (1, 3)])
    assert mut._offset_reaches_no_label(case(Mesh(1, 1, cp=2), [rows], layers=1)) == OFFSET


# ---- the mutation objects ----

class FakeCase:
    def __init__(self, passed):
        self.passed, self.calls = passed, []

    def check(self, thresholds, **kwargs):
        self.calls.append((thresholds, kwargs))
        return SimpleNamespace(passed=self.passed, worst="WORST")


def mutation(reason):
    seen = []

    def rule(c):
        seen.append(c)
        return reason

    return mut.TrainingMutation("bug", "a bug", CORRECT, rule), seen


def test_a_mutation_asks_its_rule_and_checks_with_its_recipe_and_name():
    m, seen = mutation("why")
    c = FakeCase(True)
    assert m.identity_reason(c) == "why" and seen == [c]
    ref = object()
    assert m.check(c, {"loss": 1.0}, reference=ref).passed is True
    assert c.calls == [({"loss": 1.0}, {"recipe": CORRECT, "mutation": "bug", "reference": ref})]


@pytest.mark.parametrize(("reason", "passed", "claim"), [
    ("why", True, None),
    ("why", False, "bug: declared identity (why) but WORST"),
    (None, True, "bug: not the identity, yet undetected (worst WORST)"),
    (None, False, None),
])
def test_broken_claim_names_the_contradiction(reason, passed, claim):
    m, seen = mutation(reason)
    c = FakeCase(passed)
    assert m.broken_claim(c, {"loss": 2.0}) == claim
    assert seen == [c]
    assert c.calls == [({"loss": 2.0}, {"recipe": CORRECT, "mutation": "bug"})]


def test_training_mutation_finds_every_name_and_lists_them_when_unknown():
    for m in mut.ALL_TRAINING_MUTATIONS:
        assert mut.training_mutation(m.name) is m
    with pytest.raises(UnknownMutation) as err:
        mut.training_mutation("nope")
    names = ", ".join(m.name for m in mut.ALL_TRAINING_MUTATIONS)
    assert err.value.args[0] == f"unknown training mutation 'nope'; known: {names}"


class MatrixCase(FakeCase):
    def __init__(self, packed):
        super().__init__(False)
        self.config, self.mesh = SimpleNamespace(name="small"), Mesh(2, 2)
        self.spec, self.references = SimpleNamespace(packed=packed), []

    def reference(self):
        self.references.append(object())
        return self.references[-1]


def test_the_matrix_skips_identity_cells_and_checks_the_rest_against_one_reference():
    skip, _ = mutation("why")
    run, seen = mutation(None)
    run = mut.TrainingMutation("real", "a bug", CORRECT, run.identity)
    cases = [MatrixCase(True), MatrixCase(False)]
    rows = mut.mutation_matrix(cases, {"loss": 3.0}, (skip, run))
    assert [(r.mutation, r.case, r.identity) for r in rows] == [
        ("bug", "small dp=2 tp=2 packed", "why"), ("real", "small dp=2 tp=2 packed", None),
        ("bug", "small dp=2 tp=2", "why"), ("real", "small dp=2 tp=2", None)]
    assert rows[0].report is None and rows[0].detected is None
    assert rows[1].report.worst == "WORST" and rows[1].detected is True
    assert seen == [cases[0], cases[1]]  # the run rule was asked about each case
    for c in cases:
        assert len(c.references) == 1
        assert c.calls == [({"loss": 3.0}, {"recipe": CORRECT, "mutation": "real",
                                            "reference": c.references[0]})]


def test_the_matrix_trains_elsewhere_when_given_a_trainer():
    run, _ = mutation(None)
    recipe = mut.BY_NAME["cp_key_offset"].recipe
    run = mut.TrainingMutation("real", "a bug", recipe, run.identity)
    c, trained = MatrixCase(False), []

    def train(case_, recipe_):
        trained.append((case_, recipe_))
        return "TRACE"

    rows = mut.mutation_matrix([c], {"loss": 4.0}, (run,), train=train)
    assert trained == [(c, recipe)] and rows[0].report.worst == "WORST"
    assert c.calls == [({"loss": 4.0}, {"reference": c.references[0], "mutation": "real",
                                        "trained": "TRACE"})]

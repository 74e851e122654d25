"""Exact pins on what a training check starts from and what it counts: the mesh
(``training/mesh.py``), the optimizer (``training/optimizer.py``), the batches
(``training/batches.py``) and the collective counts (``training/counts.py``), written against
the mutants that the behavioural tests let survive. The mesh's validation messages, groups,
row blocks and name; AdamW's hyperparameters, step and moments; the batch spec's rules and the
exact tokens, labels and document ids a batch holds; the expected counts written out, the
counted ones' types, spans, format and divisibility check. All on SMALL or smaller: the file
runs in about a second."""

import pytest
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective, InProcessGroups
from weight_sync_bench.errors import (
    InvalidBatch,
    InvalidMesh,
    InvalidNumber,
    UnevenSequence,
    UnsupportedLayout,
)
from weight_sync_bench.training.batches import (
    PAD_TOKEN,
    BatchSpec,
    default_spec,
    make_batch,
    segments_from_documents,
)
from weight_sync_bench.training.counts import count_collectives, expected_counts
from weight_sync_bench.training.floor import SMALL
from weight_sync_bench.training.loss import IGNORE_INDEX
from weight_sync_bench.training.mesh import Mesh, mesh_groups
from weight_sync_bench.training.optimizer import (
    HYPERPARAMETERS,
    AdamW,
    hyperparameters,
    moments,
    same_optimizer,
)
from weight_sync_bench.training.step import (
    Recipe,
    TrainingCase,
    global_mean_share,
    sum_over_group,
)


def _message(error, call):
    with pytest.raises(error) as info:
        call()
    return str(info.value)


# ---------------------------------------------------------------- mesh.py


def test_a_mesh_of_ones_and_a_mesh_as_large_as_the_batch_validate():
    Mesh(1, 1).validate(SMALL, rows=1)
    Mesh(4, 2, sp=True, cp=2).validate(SMALL, rows=4, seq_len=8)
    Mesh(2, 4, cp=1).validate(SMALL, rows=2, seq_len=None)


@pytest.mark.parametrize("field, value", [("dp", 0), ("tp", -1), ("cp", 0), ("dp", True),
                                          ("tp", 2.0), ("cp", "2")])
def test_each_size_must_be_a_positive_int_and_the_message_names_it(field, value):
    sizes = {"dp": 1, "tp": 1, "cp": 1, field: value}
    mesh = Mesh(sizes["dp"], sizes["tp"], cp=sizes["cp"])
    assert _message(InvalidMesh, lambda: mesh.validate(SMALL, rows=4)) == (
        f"small: {field} must be a positive int, got {field}={value!r}")


def test_sp_must_be_a_bool():
    assert _message(InvalidMesh, lambda: Mesh(1, 2, sp=1).validate(SMALL, rows=4)) == (
        "small: sp must be a bool, got sp=1")
    Mesh(1, 2, sp=False).validate(SMALL, rows=4)


def test_more_dp_ranks_than_rows_is_rejected_with_its_sizes():
    assert _message(InvalidMesh, lambda: Mesh(3, 1).validate(SMALL, rows=2)) == (
        "small: dp(3) > batch rows(2): a data-parallel rank would hold no rows")
    Mesh(2, 1).validate(SMALL, rows=2)


def test_the_tp_degree_is_checked_against_the_layout():
    with pytest.raises(UnsupportedLayout):
        Mesh(1, 3).validate(SMALL, rows=4)  # 4 heads over 3 ranks


def test_the_sequence_split_is_checked_only_when_a_length_is_given():
    cp = Mesh(1, 1, cp=3)
    assert _message(UnevenSequence, lambda: cp.validate(SMALL, rows=4, seq_len=8)) == (
        "small: context parallelism needs seq_len % cp == 0 (seq_len=8, cp=3)")
    cp.validate(SMALL, rows=4)
    sp = Mesh(1, 2, sp=True, cp=2)
    assert _message(UnevenSequence, lambda: sp.validate(SMALL, rows=4, seq_len=6)) == (
        "small: sequence parallelism needs (seq_len / cp) % t == 0 (seq_len=6, cp=2, t=2)")
    Mesh(1, 2, sp=False, cp=2).validate(SMALL, rows=4, seq_len=6)


def test_tp_groups_are_rows_and_cp_groups_columns_of_the_flat_positions():
    mesh = Mesh(1, 2, cp=3)
    assert mesh.replica_size == 6
    assert mesh.tp_groups() == [[0, 1], [2, 3], [4, 5]]
    assert mesh.cp_groups() == [[0, 2, 4], [1, 3, 5]]
    assert Mesh(1, 3, cp=2).tp_groups() == [[0, 1, 2], [3, 4, 5]]


def test_row_blocks_are_contiguous_and_differ_by_at_most_one():
    assert Mesh(3, 1).row_blocks(7) == [[0, 1, 2], [3, 4], [5, 6]]
    assert Mesh(1, 1).row_blocks(2) == [[0, 1]]


def test_a_mesh_prints_sp_and_cp_only_when_on():
    assert str(Mesh(2, 4)) == "dp=2 tp=4"
    assert str(Mesh(1, 2, sp=True)) == "dp=1 tp=2 sp"
    assert str(Mesh(1, 2, cp=2)) == "dp=1 tp=2 cp=2"
    assert str(Mesh(3, 2, sp=True, cp=4)) == "dp=3 tp=2 sp cp=4"


def test_without_cp_the_tp_group_is_the_factorys_and_there_is_no_cp_group():
    made = []

    def factory(degree):
        made.append(InProcessCollective(degree))
        return made[-1]

    tp, cp = mesh_groups(Mesh(1, 3), factory)
    assert cp is None and tp is made[0] and tp.degree == 3


def test_with_cp_both_groups_lie_side_by_side_over_the_replica():
    tp, cp = mesh_groups(Mesh(1, 2, cp=3), lambda degree: pytest.fail("no factory with CP"))
    assert isinstance(tp, InProcessGroups) and isinstance(cp, InProcessGroups)
    assert tp.groups == ((0, 1), (2, 3), (4, 5)) and tp.degree == 2
    assert cp.groups == ((0, 2, 4), (1, 3, 5)) and cp.degree == 3


# ---------------------------------------------------------------- optimizer.py


def _stepped(adamw=AdamW(), steps=1):
    params = {"a": torch.tensor([1.0, -2.0], requires_grad=True),
              "b": torch.tensor([3.0], requires_grad=True)}
    optim = adamw.make(list(params.values()))
    for _ in range(steps):
        optim.zero_grad()
        (params["a"] * torch.tensor([0.5, 2.0])).sum().backward()
        optim.step()
    return optim, params


def test_make_passes_every_hyperparameter_and_steps_one_tensor_at_a_time():
    adamw = AdamW(lr=0.25, betas=(0.5, 0.75), eps=1e-3, weight_decay=0.5)
    optim, params = _stepped(adamw, steps=0)
    (group,) = optim.param_groups
    assert group["params"] == list(params.values())
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        0.25, (0.5, 0.75), 1e-3, 0.5)
    assert group["foreach"] is False
    assert hyperparameters(optim) == {"lr": 0.25, "beta1": 0.5, "beta2": 0.75, "eps": 1e-3,
                                      "weight_decay": 0.5}
    assert tuple(hyperparameters(optim)) == HYPERPARAMETERS


def test_the_default_optimizer_and_its_hyperparameters():
    optim, _ = _stepped()
    assert hyperparameters(optim) == {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-6,
                                      "weight_decay": 0.1}
    assert all(type(v) is float for v in hyperparameters(optim).values())
    adamw = AdamW()
    assert same_optimizer(adamw) is adamw


def test_one_step_moves_each_parameter_by_adamws_rule():
    adamw = AdamW(lr=0.5, betas=(0.5, 0.75), eps=1e-3, weight_decay=0.5)
    _, params = _stepped(adamw)
    g = torch.tensor([0.5, 2.0])
    decayed = torch.tensor([1.0, -2.0]) * (1 - 0.5 * 0.5)
    expected = decayed - 0.5 * g / (g.abs() + 1e-3)  # bias-corrected moments: g and g^2
    torch.testing.assert_close(params["a"].detach(), expected, rtol=0, atol=1e-6)
    # b has no gradient: AdamW skips it, weight decay included
    assert torch.equal(params["b"].detach(), torch.tensor([3.0]))


def test_moments_are_copies_by_default_and_zeros_for_an_unstepped_parameter():
    optim, params = _stepped(AdamW(betas=(0.5, 0.75)))
    first, second = moments(optim, params)
    g = torch.tensor([0.5, 2.0])
    assert list(first) == list(second) == ["a", "b"]
    torch.testing.assert_close(first["a"], 0.5 * g, rtol=0, atol=0)
    torch.testing.assert_close(second["a"], 0.25 * g * g, rtol=0, atol=0)
    assert torch.equal(first["b"], torch.zeros(1)) and torch.equal(second["b"], torch.zeros(1))
    state = optim.state[params["a"]]
    assert first["a"].data_ptr() != state["exp_avg"].data_ptr()
    assert second["a"].data_ptr() != state["exp_avg_sq"].data_ptr()
    first["a"].add_(1.0)
    assert torch.equal(state["exp_avg"], 0.5 * g)  # the copy is the caller's own


def test_moments_without_copy_are_the_optimizers_own_tensors():
    optim, params = _stepped()
    first, second = moments(optim, params, copy=False)
    state = optim.state[params["a"]]
    assert first["a"].data_ptr() == state["exp_avg"].data_ptr()
    assert second["a"].data_ptr() == state["exp_avg_sq"].data_ptr()
    assert not first["a"].requires_grad
    assert torch.equal(first["b"], torch.zeros(1))


# ---------------------------------------------------------------- batches.py


@pytest.mark.parametrize("kwargs, message", [
    ({"documents": ()}, "a batch needs at least one row, got documents=()"),
    ({"documents": ((3,), (2, 0)), "packed": True},
     "row 1: document lengths must be >= 1, got (2, 0)"),
    ({"documents": ((3,), (5, 4)), "packed": True},
     "row 1: documents (5, 4) fill 9 positions, seq_len=8"),
    ({"documents": ((2, 3),)},
     "row 0: 2 documents in an unpacked batch (set packed=True for a document mask)"),
    ({"documents": ((3,),), "ignore_rate": 1.0}, "ignore_rate must be in [0, 1), got 1.0"),
    ({"documents": ((3,),), "ignore_rate": -0.1}, "ignore_rate must be in [0, 1), got -0.1"),
])
def test_a_batch_spec_rejects_what_it_cannot_hold_and_says_why(kwargs, message):
    assert _message(InvalidBatch, lambda: BatchSpec(seq_len=8, **kwargs)) == message


@pytest.mark.parametrize("seq_len", [0, -1, True, 2.0, "8"])
def test_a_batch_spec_refuses_a_sequence_length_that_is_not_a_positive_int(seq_len):
    """Checked first: a spec of empty rows once took seq_len=-1 and failed in torch.full."""
    assert _message(InvalidNumber, lambda: BatchSpec(((),), seq_len=seq_len)) == (
        f"seq_len must be an int >= 1, got {seq_len!r}")
    assert BatchSpec(((),), seq_len=1).rows == 1  # twin: the smallest length is accepted


def test_a_batch_spec_accepts_its_limits():
    """The twin of the rejections: length-1 documents, a full row, an empty row, one
    document unpacked, several packed, rate 0 and just below 1."""
    spec = BatchSpec(((1,), (8,), ()), seq_len=8, ignore_rate=0.0)
    assert spec.rows == 3 and not spec.packed and spec.ignore_rate == 0.0
    assert BatchSpec(((1, 1, 6), (2,)), seq_len=8, ignore_rate=0.99, packed=True).rows == 2


DOCS = ((2, 3), (4,), ())


def test_document_ids_count_up_per_row_and_padding_is_minus_one():
    segments = segments_from_documents(DOCS, 6)
    assert segments.dtype == torch.long
    assert segments.tolist() == [[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, -1, -1], [-1] * 6]


def test_a_shift_moves_every_boundary_and_the_padding_right_but_never_past_the_row():
    """The off-by-one ``doc_mask_offset`` injects: the first document still starts at 0."""
    assert segments_from_documents(DOCS, 6, shift=1).tolist() == [
        [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, -1], [-1] * 6]
    assert segments_from_documents(((1, 1, 2),), 5, shift=2).tolist() == [[0, 0, 0, 1, 2]]


SPEC = BatchSpec(((2, 3), (4,), (), (6,)), seq_len=6, ignore_rate=0.25, packed=True)


def _draws(config, spec, seed, layout_seed=None):
    """What ``make_batch`` draws, in its order: tokens, labels, then the ignored draws from
    the layout seed's own generator (or the same one)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (spec.rows, spec.seq_len)
    tokens = torch.randint(0, config.vocab, shape, generator=gen)
    labels = torch.randint(0, config.vocab, shape, generator=gen)
    layout = gen if layout_seed is None else torch.Generator().manual_seed(layout_seed)
    return tokens, labels, torch.rand(shape, generator=layout)


def test_a_batch_holds_the_seeds_tokens_with_padding_and_ignored_labels_masked():
    batch = make_batch(SMALL, SPEC, seed=7)
    tokens, labels, draws = _draws(SMALL, SPEC, 7)
    real = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0] * 6, [1] * 6]).bool()
    assert batch.spec == SPEC and batch.segments.tolist() == [
        [0, 0, 1, 1, 1, -1], [0, 0, 0, 0, -1, -1], [-1] * 6, [0] * 6]
    assert torch.equal(batch.tokens, torch.where(real, tokens, PAD_TOKEN)) and PAD_TOKEN == 0
    kept = real & (draws >= 0.25)
    assert 0 < int(kept.sum()) < int(real.sum())  # some real labels ignored, some kept
    assert torch.equal(batch.targets, torch.where(kept, labels, IGNORE_INDEX))
    assert batch.valid == int(kept.sum())
    assert torch.equal(batch.model_segments, batch.segments)


def test_the_ignored_labels_come_from_the_layout_seed_when_given():
    batch = make_batch(SMALL, SPEC, seed=7, layout_seed=3)
    tokens, labels, draws = _draws(SMALL, SPEC, 7, layout_seed=3)
    kept = (batch.segments >= 0) & (draws >= 0.25)
    assert torch.equal(batch.tokens, tokens.masked_fill(batch.segments < 0, 0))
    assert torch.equal(batch.targets, torch.where(kept, labels, IGNORE_INDEX))
    assert not torch.equal(batch.targets, make_batch(SMALL, SPEC, seed=7).targets)
    other = make_batch(SMALL, SPEC, seed=8, layout_seed=3)
    assert torch.equal(other.targets == IGNORE_INDEX, batch.targets == IGNORE_INDEX)


def test_a_label_is_ignored_only_when_its_draw_is_strictly_below_the_rate():
    spec = BatchSpec(((6,),), seq_len=6)
    draws = _draws(SMALL, spec, 0, layout_seed=5)[2]
    at = float(draws[0, 2])  # a float32 draw is exactly a Python float
    rate = BatchSpec(((6,),), seq_len=6, ignore_rate=at)
    batch = make_batch(SMALL, rate, seed=0, layout_seed=5)
    assert (batch.targets[0] != IGNORE_INDEX).tolist() == (draws[0] >= at).tolist()
    assert batch.targets[0, 2] != IGNORE_INDEX


def test_when_every_real_label_is_drawn_ignored_the_first_real_one_is_kept():
    spec = BatchSpec(((), (3,), (2,)), seq_len=4, ignore_rate=0.999999)
    batch = make_batch(SMALL, spec, seed=1)
    labels = _draws(SMALL, spec, 1)[1]
    assert batch.valid == 1
    assert batch.targets[1, 0] == labels[1, 0]  # row 0 is padding: flat position 4


def test_a_real_label_drawn_ignored_stays_ignored_while_another_is_kept():
    """The keep-one rule only applies when nothing else is valid: the first real token's
    label here is drawn ignored and stays so."""
    spec = BatchSpec(((), (6,)), seq_len=6, ignore_rate=0.5)
    for seed in range(50):
        draws = _draws(SMALL, spec, seed)[2]
        if draws[1, 0] < 0.5 and (draws[1] >= 0.5).any():
            break
    batch = make_batch(SMALL, spec, seed=seed)
    assert batch.targets[1, 0] == IGNORE_INDEX
    assert (batch.targets[1] != IGNORE_INDEX).tolist() == (draws[1] >= 0.5).tolist()


def test_a_batch_of_padding_alone_is_rejected():
    spec = BatchSpec(((), ()), seq_len=4)
    assert _message(InvalidBatch, lambda: make_batch(SMALL, spec, seed=0)) == (
        "every one of the 2 rows is padding: a valid-token mean over zero tokens")


def test_rows_are_a_batch_of_their_own_with_rebuilt_document_ids():
    batch = make_batch(SMALL, SPEC, seed=2)
    part = batch.rows([3, 0])
    assert part.spec == BatchSpec(((6,), (2, 3)), 6, 0.25, True)
    assert torch.equal(part.tokens, batch.tokens[[3, 0]])
    assert torch.equal(part.targets, batch.targets[[3, 0]])
    assert part.segments.tolist() == [[0] * 6, [0, 0, 1, 1, 1, -1]]
    shifted = batch.rows([0, 1], shift=1)
    assert shifted.segments.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, -1]]
    assert torch.equal(shifted.tokens, batch.tokens[:2])


def test_rows_of_an_unpacked_batch_stay_unpacked_and_pass_no_document_ids():
    spec = BatchSpec(((3,), (4,)), seq_len=4, ignore_rate=0.5)
    part = make_batch(SMALL, spec, seed=0).rows([1])
    assert part.spec == BatchSpec(((4,),), 4, 0.5, False) and part.spec.packed is False
    assert part.model_segments is None


@pytest.mark.parametrize("config, packed, documents", [
    (SMALL, False, ((8,), (7,), (6,), (5,))),
    (SMALL, True, ((2, 4, 1), (2, 3, 1), (2, 3, 1), (1, 2, 1))),
    (SMALL.replace(batch=3), False, ((8,), (7,), (6,))),
    (SMALL.replace(seq_len=3, batch=1), True, ((1, 1, 1),)),
    (SMALL.replace(seq_len=2, batch=2), True, ((1, 1), (1, 1))),
    (SMALL.replace(seq_len=1, batch=2), True, ((1,), (1,))),
])
def test_the_default_spec_gives_every_row_its_own_length(config, packed, documents):
    spec = default_spec(config, packed=packed)
    assert spec == BatchSpec(documents, config.seq_len, 0.25, packed)
    assert all(type(n) is int for docs in spec.documents for n in docs)
    assert type(spec.packed) is bool
    assert default_spec(config, packed=packed, ignore_rate=0.5).ignore_rate == 0.5


# ---------------------------------------------------------------- counts.py

N = SMALL.n_layers  # 2
NO_SP = {("forward", "tp", "all_reduce"): 2 * N + 3, ("forward", "tp", "all_gather"): 1,
         ("backward", "tp", "all_reduce"): 2 * N + 3, ("reduction", "tp", "all_reduce"): 5}
SP = {("forward", "tp", "reduce_scatter"): 2 * N + 1, ("forward", "tp", "all_gather"): 2 * N + 2,
      ("forward", "tp", "all_reduce"): 2, ("backward", "tp", "all_gather"): 2 * N + 1,
      ("backward", "tp", "reduce_scatter"): 2 * N + 1, ("backward", "tp", "all_reduce"): 2,
      ("reduction", "tp", "all_reduce"): 5}  # 5 replicated: 2 norms a layer and the final one
CP = {("forward", "cp", "all_gather"): N, ("backward", "cp", "reduce_scatter"): N,
      ("reduction", "cp", "all_reduce"): 15}  # every parameter


@pytest.mark.parametrize("mesh, expected", [
    (Mesh(1, 2), NO_SP), (Mesh(2, 4), NO_SP), (Mesh(1, 2, sp=True), SP),
    (Mesh(1, 2, cp=2), {**NO_SP, **CP}), (Mesh(1, 2, sp=True, cp=3), {**SP, **CP})])
def test_the_expected_counts_of_small_written_out(mesh, expected):
    assert expected_counts(SMALL, mesh) == expected


def test_one_more_layer_adds_its_collectives_and_bias_adds_replicated_reductions():
    deeper = SMALL.replace(n_layers=3)
    assert expected_counts(deeper, Mesh(1, 2, sp=True, cp=2)) == {
        ("forward", "tp", "reduce_scatter"): 7, ("forward", "tp", "all_gather"): 8,
        ("forward", "tp", "all_reduce"): 2, ("backward", "tp", "all_gather"): 7,
        ("backward", "tp", "reduce_scatter"): 7, ("backward", "tp", "all_reduce"): 2,
        ("reduction", "tp", "all_reduce"): 7, ("forward", "cp", "all_gather"): 3,
        ("backward", "cp", "reduce_scatter"): 3, ("reduction", "cp", "all_reduce"): 21}


def test_a_counted_step_is_per_group_in_ints_and_formats_sorted():
    mesh = Mesh(1, 2, cp=2)
    counted = count_collectives(TrainingCase(SMALL, mesh, steps=1))
    assert counted.mesh is mesh
    assert counted.counts == {**NO_SP, **CP}
    assert all(type(n) is int for n in counted.counts.values())
    assert counted.spans == {("tp", "all_reduce"): {(0, 1), (2, 3)},
                             ("tp", "all_gather"): {(0, 1), (2, 3)},
                             ("cp", "all_gather"): {(0, 2), (1, 3)},
                             ("cp", "reduce_scatter"): {(0, 2), (1, 3)},
                             ("cp", "all_reduce"): {(0, 2), (1, 3)}}
    assert all(type(s) is frozenset for s in counted.spans.values())
    assert counted.format() == (
        "backward cp reduce_scatter x2, backward tp all_reduce x7, forward cp all_gather x2, "
        "forward tp all_gather x1, forward tp all_reduce x7, reduction cp all_reduce x15, "
        "reduction tp all_reduce x5")


def test_without_cp_a_single_group_spans_all_its_ranks():
    counted = count_collectives(TrainingCase(SMALL, Mesh(1, 4, sp=True), steps=1))
    assert counted.counts == SP
    assert counted.spans == {("tp", op): {(0, 1, 2, 3)}
                             for op in ("reduce_scatter", "all_gather", "all_reduce")}


def _stray_reduction(extra):
    """A TP reduction that records ``extra`` more all-reduces than the groups ran (as if one
    group had run a collective alone), once."""
    done = []

    def tp_reduce(grads, coll, name):
        out = sum_over_group(grads, coll, name)
        if not done:
            done.append(name)
            coll.calls.extend([("all_reduce", "stray", (0, 1))] * extra)
        return out

    return Recipe(tp_reduce=tp_reduce)


def test_calls_that_do_not_divide_over_the_groups_are_an_error_naming_them():
    case = TrainingCase(SMALL, Mesh(1, 2, cp=2), steps=1)
    assert _message(AssertionError, lambda: count_collectives(case, _stray_reduction(1))) == (
        "('reduction', 'tp', 'all_reduce'): 11 calls over 2 groups")
    twin = count_collectives(case, _stray_reduction(2))  # 12 over 2 groups: 6 each
    assert twin.counts[("reduction", "tp", "all_reduce")] == 6


def test_the_counted_replica_hands_its_objective_its_own_valid_count_at_least_one():
    """Replica 0 of dp=2 holds row 0 alone: one valid label, so the hooks see 1 (not the
    batch's 4); a replica of padding alone would see 1 as well, never 0."""
    seen = []

    def objective(losses, targets, total, mesh):
        seen.append(total)
        return global_mean_share(losses, targets, total, mesh)

    recipe = Recipe(objective=objective)
    case = TrainingCase(SMALL, Mesh(2, 2), steps=1, spec=BatchSpec(((1,), (3,)), seq_len=8))
    assert case.batches[0].valid == 4
    count_collectives(case, recipe)
    padded = TrainingCase(SMALL, Mesh(2, 2), steps=1, spec=BatchSpec(((), (3,)), seq_len=8))
    count_collectives(padded, recipe)
    assert seen == [1, 1, 1, 1]

"""In-process collectives, pinned directly (mutation/report.md): before this file they were
exercised only through the forward and the loss, and reduce_scatter and InProcessGroups not
at all by the mutation selection. Values, the calls and adjoint calls a test counts, and each
refusal's exact text."""

import pytest
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective, InProcessGroups


def _leaves(*rows):
    return [torch.tensor(r, dtype=torch.float64, requires_grad=True) for r in rows]


# -- InProcessCollective

def test_all_reduce_gives_every_rank_the_sum_and_records_the_call_and_its_adjoint():
    c = InProcessCollective(3)
    xs = _leaves([1.0, 2.0], [10.0, 20.0], [100.0, 200.0])
    out = c.all_reduce(xs, tag="t.ar")
    assert len(out) == 3 and all(o.tolist() == [111.0, 222.0] for o in out)
    assert c.calls == [("all_reduce", "t.ar")] and c.backward_calls == []
    (out[0] * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum().backward()
    assert c.backward_calls == [("all_reduce", "t.ar")]
    assert all(x.grad.tolist() == [1.0, 2.0] for x in xs)


def test_all_gather_concatenates_in_rank_order_and_its_adjoint_is_a_reduce_scatter():
    c = InProcessCollective(2)
    xs = _leaves([[1.0]], [[2.0, 3.0]])  # gathered sizes may differ along dim
    out = c.all_gather(xs, -1, tag="t.ag")
    assert out[0].tolist() == out[1].tolist() == [[1.0, 2.0, 3.0]]
    assert c.calls == [("all_gather", "t.ag")]
    out[1].sum().backward()
    assert c.backward_calls == [("reduce_scatter", "t.ag")]


def test_reduce_scatter_gives_rank_r_chunk_r_of_the_sum_and_its_adjoint_is_an_all_gather():
    c = InProcessCollective(2)
    xs = _leaves([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0])
    out = c.reduce_scatter(xs, 0, tag="t.rs")
    assert [o.tolist() for o in out] == [[11.0, 22.0], [33.0, 44.0]]
    assert c.calls == [("reduce_scatter", "t.rs")]
    (out[0].sum() + 2 * out[1].sum()).backward()
    assert c.backward_calls == [("all_gather", "t.rs")]
    assert all(x.grad.tolist() == [1.0, 1.0, 2.0, 2.0] for x in xs)


def test_reduce_scatter_chunks_the_sum_along_the_dim_it_is_given():
    c = InProcessCollective(2)
    xs = [torch.arange(8.0).reshape(2, 4), torch.ones(2, 4)]
    out = c.reduce_scatter(xs, -1, tag="t")
    assert [o.tolist() for o in out] == [[[1.0, 2.0], [5.0, 6.0]], [[3.0, 4.0], [7.0, 8.0]]]


def test_reduce_scatter_at_degree_one_is_the_input():
    c = InProcessCollective(1)
    (out,) = c.reduce_scatter(_leaves([[1.0, 2.0]]), 1, tag="t")
    assert out.tolist() == [[1.0, 2.0]]


def test_untracked_inputs_record_no_adjoint():
    c = InProcessCollective(2)
    c.all_reduce([torch.ones(2), torch.ones(2)], tag="t")
    assert c.calls == [("all_reduce", "t")] and c.backward_calls == []


@pytest.mark.parametrize("op, xs, message", [
    ("all_reduce", [torch.zeros(2)], "all_reduce t: got 1 tensors for 2 ranks"),
    ("all_gather", [torch.zeros(2)] * 3, "all_gather t: got 3 tensors for 2 ranks"),
    ("all_reduce", [torch.zeros(2), torch.zeros(3)],
     "all_reduce t: ranks disagree on shape: rank 0 [2], rank 1 [3]"),
    ("reduce_scatter", [torch.zeros(2, 2), torch.zeros(2, 4)],
     "reduce_scatter t: ranks disagree on shape: rank 0 [2, 2], rank 1 [2, 4]"),
    ("reduce_scatter", [torch.zeros(3), torch.zeros(3)],
     "reduce_scatter t: dim 0 of size 3 does not split evenly over degree 2"),
])
def test_a_malformed_collective_is_refused_naming_op_tag_and_numbers(op, xs, message):
    c = InProcessCollective(2)
    with pytest.raises(ValueError) as raised:
        getattr(c, op)(xs, tag="t") if op == "all_reduce" else getattr(c, op)(xs, 0, tag="t")
    assert str(raised.value) == message
    if "evenly" not in message:  # refused before it is recorded (the evenness check comes after)
        assert c.calls == []


@pytest.mark.parametrize("degree", [0, -1])
def test_a_group_of_no_ranks_is_refused(degree):
    with pytest.raises(ValueError) as raised:
        InProcessCollective(degree)
    assert str(raised.value) == f"InProcessCollective needs degree >= 1, got {degree}"


# -- InProcessGroups

def test_groups_report_each_positions_rank_and_run_each_group_on_its_own():
    g = InProcessGroups([[0, 2], [1, 3]])  # positions 0, 2 form one group; 1, 3 the other
    assert g.degree == 2 and g.ranks == (0, 0, 1, 1) and g.groups == ((0, 2), (1, 3))
    xs = _leaves([1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [1000.0, 2000.0])
    summed = g.all_reduce(xs, tag="t.ar")
    assert [s.tolist() for s in summed] == [[101.0, 202.0], [1010.0, 2020.0],
                                            [101.0, 202.0], [1010.0, 2020.0]]
    gathered = g.all_gather(xs, 0, tag="t.ag")
    assert gathered[2].tolist() == [1.0, 2.0, 100.0, 200.0]
    assert gathered[1].tolist() == [10.0, 20.0, 1000.0, 2000.0]
    scattered = g.reduce_scatter(xs, 0, tag="t.rs")
    assert [s.tolist() for s in scattered] == [[101.0], [1010.0], [202.0], [2020.0]]
    assert g.calls == [("all_reduce", "t.ar", (0, 2)), ("all_reduce", "t.ar", (1, 3)),
                       ("all_gather", "t.ag", (0, 2)), ("all_gather", "t.ag", (1, 3)),
                       ("reduce_scatter", "t.rs", (0, 2)), ("reduce_scatter", "t.rs", (1, 3))]
    sum(y.sum() for y in (*summed, *gathered, *scattered)).backward()
    assert sorted(g.backward_calls) == [("all_gather", "t.rs", (0, 2)),
                                        ("all_gather", "t.rs", (1, 3)),
                                        ("all_reduce", "t.ar", (0, 2)),
                                        ("all_reduce", "t.ar", (1, 3)),
                                        ("reduce_scatter", "t.ag", (0, 2)),
                                        ("reduce_scatter", "t.ag", (1, 3))]


@pytest.mark.parametrize("groups", [
    [[0, 1], [2]],  # groups of different sizes
    [[0, 1], [1, 2]],  # position 1 twice, 3 missing
    [[1, 2], [3, 4]],  # positions do not start at 0
])
def test_groups_must_be_same_sized_and_cover_every_position_once(groups):
    with pytest.raises(ValueError) as raised:
        InProcessGroups(groups)
    expected = tuple(tuple(g) for g in groups)
    assert str(raised.value) == (f"InProcessGroups: groups {expected} must be same-sized and "
                                 "cover positions 0..n-1 once each")


def test_groups_refuse_a_tensor_list_of_the_wrong_length():
    g = InProcessGroups([[0, 1], [2, 3]])
    with pytest.raises(ValueError) as raised:
        g.all_reduce([torch.zeros(1)] * 3, tag="t")
    assert str(raised.value) == "all_reduce t: got 3 tensors for 4 positions"
    assert g.calls == []

"""A sharded run is compared shard by shard against the reference's declared slices
(``training.compare.Shards``), not gathered first, and its DP replicas share replica 0's
storage, stepped by one optimizer (``training.step.train_sharded``). Both are speed-ups
(issue 33): these tests pin that neither changes a value or a verdict. The pieces tile the
global tensor exactly once, under every placement of the training layout; every deviation
of a sharded trace is the one of its gathered trace (to the bit, or within the norm's fp64
rounding); a fault on the last rank's shard is found where it lies; and the shared replicas
train to the bits that separate replicas stepped one by one reach."""

import math

import pytest
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.layout.placements import HeadReplicated
from weight_sync_bench.layout.reshard import declared_pieces, split, split_tensor
from weight_sync_bench.layout.table import LayoutTable, ShardSpec
from weight_sync_bench.model.config import init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.training import QUANTITIES
from weight_sync_bench.training.compare import (
    BLOCK,
    Shards,
    deviations,
    gathered,
    relative_deviation,
    update_deviation,
)
from weight_sync_bench.training.floor import SMALL, SMALL_VARIANTS
from weight_sync_bench.training.mesh import Mesh, mesh_groups
from weight_sync_bench.training.optimizer import AdamW
from weight_sync_bench.training.step import CORRECT, TrainingCase, TrainStep

GQA = SMALL_VARIANTS[2]  # two KV heads, biases: HeadPartitioned with K/V rows apart


def _sharded(config, degree, seed=0):
    full = init_params(config, seed)
    layout = layout_for(config)
    ranks = split(full, layout, degree)
    return full, {spec.name: Shards(tuple(r[spec.name] for r in ranks), spec)
                  for spec in layout}


@pytest.mark.parametrize("degree", [1, 2])
def test_the_pieces_tile_every_global_tensor_exactly_once_and_hold_its_bytes(degree):
    full, held = _sharded(GQA, degree)
    kinds = set()
    for name, shards in held.items():
        kinds.add(type(shards.spec.placement).__name__)
        covered = torch.zeros(shards.shape, dtype=torch.int64)
        for piece, index in shards.pieces():
            covered[index] += 1
            assert torch.equal(piece, full[name][index]), name
        assert torch.all(covered == 1), name  # every element once: none missed, none twice
        assert torch.equal(shards.gather(), full[name])
    assert {"Shard", "Replicate", "HeadPartitioned", "FusedPaired"} <= kinds


@pytest.mark.parametrize("rows", [(0, 1), (5, 40), (40, 52), (51, 52)])
def test_pieces_within_rows_tile_those_rows_of_dim_0_only(rows):
    full, held = _sharded(GQA, 2)
    lo, hi = rows
    for name, shards in held.items():
        if shards.shape[0] < hi:
            continue
        covered = torch.zeros(shards.shape, dtype=torch.int64)
        for piece, index in shards.pieces(rows):
            assert piece.numel(), name  # a piece outside the rows is left out, not empty
            covered[index] += 1
            assert torch.equal(piece, full[name][index]), name
        assert torch.all(covered[lo:hi] == 1) and not covered[:lo].any() \
            and not covered[hi:].any(), name


def test_a_replicated_parameter_is_rank_0s_copy_as_gather_takes_it():
    _, held = _sharded(SMALL, 2)
    norm = held["norm.weight"]
    (piece, index), = declared_pieces(norm.tensors, norm.spec)
    assert piece is norm.tensors[0] and index == ()


@pytest.mark.parametrize("name", ["tok_embeddings.weight", "layers.1.qkv.weight",
                                  "layers.0.o_proj.weight", "layers.1.gate_up.weight"])
def test_one_element_off_on_the_last_ranks_shard_is_the_gathered_deviation(name):
    """Each placement, the fault on the last rank's last element: the shard comparison finds
    what the gathered one finds, to the bit; the twin, no fault, is 0."""
    full, held = _sharded(GQA, 2)
    shards = held[name]
    assert relative_deviation(shards, full[name]) == 0.0  # the twin
    last = shards.tensors[-1].clone()
    last.view(-1)[-1] += 0.25
    wrong = Shards(shards.tensors[:-1] + (last,), shards.spec)
    found = relative_deviation(wrong, full[name])
    assert found > 0.0
    assert found == relative_deviation(wrong.gather(), full[name])
    nan = last.clone()
    nan.view(-1)[-1] = math.nan
    assert relative_deviation(Shards(shards.tensors[:-1] + (nan,), shards.spec),
                              full[name]) == math.inf


def test_nothing_to_compare_deviates_by_nothing():
    """Empty tensors (and rows holding none): deviation 0, not an error, not infinite."""
    empty = torch.empty(0, 4)
    assert relative_deviation(empty, empty) == 0.0
    assert relative_deviation(torch.ones(3, 4), torch.ones(3, 4), (2, 2)) == 0.0
    assert relative_deviation(torch.ones(3, 4), torch.zeros(3, 4), (2, 3)) == math.inf  # twin


def test_the_k_and_v_rows_alone_see_a_fault_in_k_and_not_one_in_q():
    full, held = _sharded(GQA, 2)
    name = "layers.0.qkv.weight"
    kv = (GQA.q_rows, full[name].shape[0])
    wrong_q, wrong_k = full[name].clone(), full[name].clone()
    wrong_q[GQA.q_rows - 1, 0] += 1.0  # the last Q row
    wrong_k[GQA.q_rows, 0] += 1.0  # the first K row
    layout = {spec.name: spec for spec in layout_for(GQA)}
    for wrong, seen in ((wrong_q, False), (wrong_k, True)):
        ranks = split({name: wrong}, LayoutTable((layout[name],)), 2)
        shards = Shards(tuple(r[name] for r in ranks), layout[name])
        assert (relative_deviation(shards, full[name], kv) > 0) is seen
        assert relative_deviation(shards, full[name]) > 0


@pytest.mark.parametrize("mesh", [Mesh(2, 2), Mesh(1, 2, sp=True, cp=2)], ids=str)
def test_a_sharded_traces_deviations_are_its_gathered_traces(mesh):
    """Every quantity of a real dp 2 x tp 2 run and a tp 2 x sp x cp 2 one: the max-based
    ones to the bit, the parameter norms within their fp64 rounding."""
    case = TrainingCase(GQA, mesh, steps=2)
    ref, got = case.reference(), case.sharded()
    assert isinstance(got.params[1]["layers.0.qkv.weight"], Shards)
    by_shards = deviations(GQA, case.params, ref, got)
    by_gather = deviations(GQA, case.params, ref, gathered(got))
    for quantity, (value, where) in by_gather.items():
        if quantity.startswith("params_"):
            assert by_shards[quantity][1] == where
            assert by_shards[quantity][0] == pytest.approx(value, rel=1e-12, abs=0)
        else:
            assert by_shards[quantity] == (value, where), quantity
    assert by_gather["param_grad"][0] > 0.0  # not vacuous: the two runs round differently


def test_a_sharded_trace_as_the_reference_is_gathered_first():
    """Two sharded runs compared (the reference a sharded trace): every field gathered to
    its global tensor, so a run against itself deviates by nothing."""
    case = TrainingCase(SMALL, Mesh(2, 2), steps=2)
    got = case.sharded()
    whole = gathered(got)
    for before, after in ((got.grads, whole.grads), *zip(got.params, whole.params),
                          *zip(got.exp_avg, whole.exp_avg),
                          *zip(got.exp_avg_sq, whole.exp_avg_sq)):
        assert before.keys() == after.keys()
        for name, shards in before.items():
            assert type(after[name]) is torch.Tensor
            assert torch.equal(after[name], shards.gather()), name
    found = deviations(SMALL, case.params, got, got)
    assert all(value == 0.0 for value, _ in found.values()), found


def test_replicated_kv_heads_count_once_in_a_norm_and_every_copy_in_a_maximum():
    """HeadReplicated: two ranks hold each KV head. The norm sums each global row once (the
    last copy, as gather keeps it), so it is the gathered norm; a maximum reads every copy,
    so a fault in the copy gather drops is still found."""
    spec = ShardSpec("qkv.weight", ((8 + 2 * 2) * 4, 8), HeadReplicated(8, 2, 4))
    full = torch.randn(spec.shape, generator=torch.Generator().manual_seed(7))
    start = full - 1e-3
    shards = Shards(tuple(split_tensor(full, spec, 4)), spec)
    assert sum(p.numel() for p, _ in shards.pieces()) > full.numel()  # copies overlap
    moved = Shards(tuple(t + 1e-6 * (1 + i) for i, t in enumerate(shards.tensors)), spec)
    want = update_deviation(moved.gather(), full, start)
    assert update_deviation(moved, full, start) == pytest.approx(want, rel=1e-12, abs=0)
    first = shards.tensors[0].clone()
    first[-1, 0] += 1.0  # rank 0's copy of KV head 0's last V row: rank 1's is gathered
    dropped = Shards((first,) + shards.tensors[1:], spec)
    assert relative_deviation(dropped.gather(), full) == 0.0
    assert relative_deviation(dropped, full) > 0.0


def test_pieces_that_do_not_cover_the_tensor_once_are_refused_for_a_norm(monkeypatch):
    full, held = _sharded(SMALL, 2)
    shards = held["layers.0.o_proj.weight"]
    assert shards.once()  # the twin
    pieces = shards.pieces()
    monkeypatch.setattr(Shards, "pieces", lambda self, rows=None: pieces[:1])
    with pytest.raises(ValueError) as refused:
        update_deviation(shards, full["layers.0.o_proj.weight"], full["layers.0.o_proj.weight"])
    assert str(refused.value) == ("layers.0.o_proj.weight: the declared pieces of "
                                  f"{shards.spec.placement} do not cover the tensor once")


def test_a_norm_of_broadcast_tensors_past_one_block_is_the_plain_expression():
    g = torch.Generator().manual_seed(13)
    row = torch.randn(BLOCK // 4, generator=g)
    got, start = row + 1e-4 * torch.randn(8, BLOCK // 4, generator=g), row - 1e-3
    plain = float((got.double() - row.double()).norm()) / float(
        (row.double() - start.double()).norm())
    scratch = torch.empty(2 * BLOCK, dtype=torch.float64)
    assert update_deviation(got, row, start, scratch) == pytest.approx(plain, rel=1e-12, abs=0)


def test_update_deviation_of_shards_is_the_gathered_one():
    full, held = _sharded(GQA, 2)
    start = {n: x - 1e-3 for n, x in full.items()}
    for name, shards in held.items():
        moved = Shards(tuple(t + 1e-6 for t in shards.tensors), shards.spec)
        want = update_deviation(moved.gather(), full[name], start[name])
        assert update_deviation(moved, full[name], start[name]) == pytest.approx(
            want, rel=1e-12, abs=0)
        assert want > 0.0


def _replicas(config, mesh, shared):
    """DP replicas as ``train_sharded`` builds them (``shared``: views of replica 0's
    storage) or as separate copies, each stepped by its own optimizer."""
    declared = split(init_params(config, 3), layout_for(config), mesh.tp)
    first = [{n: s.detach().clone().requires_grad_(True) for n, s in declared[e].items()}
             for e in range(mesh.tp)]
    make = (lambda p: p.detach()) if shared else (lambda p: p.detach().clone())
    return [first] + [[{n: make(p).requires_grad_(True) for n, p in local.items()}
                       for local in first] for _ in range(mesh.dp - 1)]


def test_shared_replicas_step_once_and_train_to_the_bits_of_separate_ones():
    case = TrainingCase(GQA, Mesh(2, 2), steps=3)
    mesh = case.mesh
    runs = {}
    for shared in (True, False):
        replicas = _replicas(GQA, mesh, shared)
        step = TrainStep(GQA, replicas, mesh, CORRECT, AdamW(),
                         groups=lambda: mesh_groups(mesh), dp=mesh_groups(Mesh(1, 2))[0])
        stepped = {id(o) for o in step.stepping}
        assert stepped == {id(o) for o in (step.optims[0] if shared else
                                           [o for g in step.optims for o in g])}
        for batch in case.batches:
            step(batch, range(mesh.dp))
        runs[shared] = replicas
    for e in range(mesh.tp):
        for name, p in runs[False][0][e].items():
            assert torch.equal(runs[True][0][e][name], p), name
            assert torch.equal(runs[False][1][e][name], p), name  # separate ones agree
            assert runs[True][1][e][name].data_ptr() == runs[True][0][e][name].data_ptr()


def test_the_twin_stepping_a_shared_replica_again_moves_its_parameters_twice(monkeypatch):
    """Were every optimizer to step the shared storage, the update would be applied dp
    times: the check fails on the parameters (the sharing is not hiding a step)."""
    case = TrainingCase(GQA, Mesh(2, 2), steps=1)
    ref = case.reference()
    thresholds = dict.fromkeys(QUANTITIES, 1e-3)
    assert case.check(thresholds, reference=ref).passed
    original = TrainStep.__init__

    def every_optimizer_steps(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.stepping = [o for group in self.optims for o in group]

    monkeypatch.setattr(TrainStep, "__init__", every_optimizer_steps)
    report = case.check(thresholds, reference=ref)
    assert not report.passed and report["params_step1"].deviation > 0.5


class StaleDP:
    """A DP all-reduce whose replicas past the first receive the previous step's sum for the
    same tag (a stale bucket buffer): replica 0 steps right, the others with old gradients."""

    def __init__(self, degree):
        self.inner = InProcessCollective(degree)
        self.degree, self.ranks = degree, tuple(range(degree))
        self.previous = {}

    def all_reduce(self, xs, *, tag):
        out = self.inner.all_reduce(xs, tag=tag)
        if self.degree == 1 or torch.is_grad_enabled():  # the TP forward's, not DP's
            return out
        stale = self.previous.get(tag, out[0])
        self.previous[tag] = out[0].clone()
        return [out[0]] + [stale.clone() for _ in range(self.degree - 1)]

    def all_gather(self, xs, dim, *, tag):
        return self.inner.all_gather(xs, dim, tag=tag)


def test_a_dp_replica_handed_another_gradient_is_found_though_the_replicas_share_storage():
    """The in-process DP replicas share their parameters, so a replica stepping with another
    gradient cannot diverge from replica 0: its gradient is compared at every step instead
    (from step 2 here, where the stale sum first differs); the twin, one-tensor-per-rank
    collectives that sum right, passes."""
    from tests.training.test_step import PerRankCollective

    case = TrainingCase(SMALL, Mesh(2, 1), steps=2)
    ref = case.reference()
    thresholds = dict.fromkeys(QUANTITIES, 1e-2)
    assert case.check(thresholds, reference=ref).passed
    assert case.check(thresholds, reference=ref, collective=PerRankCollective).passed
    stale = case.check(thresholds, reference=ref, collective=StaleDP)
    assert not stale.passed and stale["replicas"].deviation > 0.0


class FirstStepDP(StaleDP):
    """A DP all-reduce that hands the replicas past the first a sum one ulp off at the first
    step only, and the right sum after: the replicas' gradients differ at step 1 alone."""

    def all_reduce(self, xs, *, tag):
        out = self.inner.all_reduce(xs, tag=tag)
        if self.degree == 1 or torch.is_grad_enabled() or tag in self.previous:
            return out
        self.previous[tag] = True
        return [out[0]] + [torch.nextafter(out[0], torch.full_like(out[0], math.inf))
                           for _ in range(self.degree - 1)]


def test_a_replica_spread_at_an_early_step_is_kept_to_the_verdict():
    case = TrainingCase(SMALL, Mesh(2, 1), steps=2)
    ref = case.reference()
    report = case.check(dict.fromkeys(QUANTITIES, math.inf), reference=ref,
                        collective=FirstStepDP)
    assert not report.passed and report["replicas"].deviation > 0.0


def test_tp_copies_that_step_apart_are_replicas_that_differ(monkeypatch):
    """A TP rank whose optimizer does not step: its copy of every replicated parameter
    stays where it started while rank 0's moves. The gradients agree, the parameters do
    not: 'replicas' reads the parameters too."""
    original = TrainStep.__init__

    def rank_1_never_steps(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.stepping = [o for o in self.stepping if o is not self.optims[0][1]]

    case = TrainingCase(SMALL, Mesh(1, 2), steps=1)
    ref = case.reference()
    assert case.check(dict.fromkeys(QUANTITIES, math.inf), reference=ref).passed  # the twin
    monkeypatch.setattr(TrainStep, "__init__", rank_1_never_steps)
    report = case.check(dict.fromkeys(QUANTITIES, math.inf), reference=ref)
    assert report["replicas"].deviation > 0.0 and not report.passed

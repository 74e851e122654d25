"""Training over gloo read exactly, in process (the mutation pass over ``training/gloo.py``):
the mesh arithmetic (``coordinates``, ``mesh_ranks``, ``all_groups``), the groups a rank
makes and picks (``groups_task``, ``_group``), the count over every DP rank, the parent's
assembly (``_input_grad``, ``_spread``) on hand-made results, and whole runs of
``train_gloo`` / ``train_rank_task`` with every rank a thread: a stand-in pool runs the
tasks on threads, ``new_group`` makes a group of threads, and ``GlooCollective``'s
``dist.all_reduce`` / ``dist.all_gather`` are exchanges among a group's threads (sums in
rank order, as ``InProcessCollective``): the run must then equal the in-process mesh's
(``TrainingCase.sharded``). The real pool: ``test_gloo.py``, ``test_mesh_gloo.py``."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from weight_sync_bench.collectives.gloo import collective as C
from weight_sync_bench.collectives.gloo.breadcrumbs import Tracer
from weight_sync_bench.collectives.gloo.rank import RankContext
from weight_sync_bench.errors import InvalidMesh
from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.training import gloo as G
from weight_sync_bench.training.compare import gathered
from weight_sync_bench.training.floor import PACKED_WITH_EMPTY_ROW, SMALL
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import TRAINING_MUTATIONS
from weight_sync_bench.training.step import CORRECT, TrainingCase

ME = threading.local()  # the global rank of the thread playing it


class Group:
    """A process group over threads: ``ranks`` (global), exchanging in group-rank order."""

    def __init__(self, ranks) -> None:
        self.ranks = tuple(ranks)
        self.slots: list = [None] * len(self.ranks)
        self.barrier = threading.Barrier(len(self.ranks), timeout=30)

    def exchange(self, x):
        self.slots[self.ranks.index(ME.rank)] = x
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()
        return every


def _all_reduce(out, group=None):
    every = group.exchange(out.clone())
    total = every[0]
    for x in every[1:]:
        total = total + x
    out.copy_(total)


def _all_gather(parts, x, group=None):
    for part, y in zip(parts, group.exchange(x.clone())):
        part.copy_(y)


class Pool:
    """A rank pool whose ranks are threads; ``runs``: each task's name, degree and kwargs;
    ``results``: each run's per-rank results."""

    def __init__(self, size: int) -> None:
        self.size, self.runs, self.results = size, [], []
        self.groups: list[Group] = []

    def run(self, task, degree, *, kwargs=None, rank_kwargs=None):
        self.runs.append((task.__name__, degree, kwargs, rank_kwargs))
        world = Group(range(degree))
        self.groups.append(world)
        out, errors = [None] * degree, []

        def go(g):
            ME.rank = g
            try:
                ctx = RankContext(g, degree, world, Tracer(g))
                out[g] = task(ctx, **(kwargs or {}), **(rank_kwargs[g] if rank_kwargs else {}))
            except BaseException as exc:  # noqa: BLE001 - raised below, the barriers broken
                errors.append(exc)
                for group in [world, *G._GROUPS.values()]:
                    if isinstance(group, Group):
                        group.barrier.abort()

        threads = [threading.Thread(target=go, args=(g,), daemon=True) for g in range(degree)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        self.results.append(out)
        return out


@pytest.fixture
def threads(monkeypatch):
    """Groups of threads for ``new_group`` and the collectives; ``_GROUPS`` emptied."""
    made: list[tuple[int, ...]] = []

    def new_group(ranks):
        made.append(tuple(ranks))
        return Group(ranks)

    monkeypatch.setattr(G, "dist", SimpleNamespace(new_group=new_group))
    monkeypatch.setattr(C, "dist", SimpleNamespace(all_reduce=_all_reduce,
                                                   all_gather=_all_gather))
    saved = dict(G._GROUPS)
    G._GROUPS.clear()
    yield made
    G._GROUPS.clear()
    G._GROUPS.update(saved)


# ---- the mesh's ranks --------------------------------------------------------------------------


def test_coordinates_are_dp_then_cp_then_tp_major_to_minor():
    mesh = Mesh(2, 2, cp=3)
    assert [G.coordinates(g, mesh) for g in range(12)] == [
        (d, j, r) for d in range(2) for j in range(3) for r in range(2)]
    assert G.coordinates(11, mesh) == (1, 2, 1) and G.coordinates(7, Mesh(3, 4)) == (1, 0, 3)


def test_mesh_ranks_are_the_tp_cp_and_dp_groups_in_group_rank_order():
    mesh = Mesh(2, 2, cp=3)  # rank 9: d 1, j 1, r 1
    assert G.mesh_ranks(9, mesh) == ([8, 9], [7, 9, 11], [3, 9])
    assert G.mesh_ranks(0, mesh) == ([0, 1], [0, 2, 4], [0, 6])
    assert G.mesh_ranks(4, Mesh(3, 2)) == ([4, 5], [4], [0, 2, 4])


def test_all_groups_lists_each_group_of_two_or_more_once_leaving_out_the_world():
    assert G.all_groups(Mesh(2, 2)) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert G.all_groups(Mesh(2, 2, cp=2)) == [
        (0, 1), (0, 2), (0, 4), (1, 3), (1, 5), (2, 3), (2, 6), (3, 7), (4, 5), (4, 6),
        (5, 7), (6, 7)]
    assert G.all_groups(Mesh(1, 4)) == [] and G.all_groups(Mesh(3, 1)) == []
    assert G.all_groups(Mesh(1, 1)) == []


def test_groups_task_makes_each_group_once_per_process_and_counts_them(threads):
    ctx = RankContext(0, 4, "world", Tracer(0))
    assert G.groups_task(ctx, mesh=Mesh(2, 2)) == 4
    assert threads == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert all(G._GROUPS[k].ranks == k for k in threads) and set(G._GROUPS) == set(threads)
    assert G.groups_task(ctx, mesh=Mesh(2, 2)) == 0 and len(threads) == 4  # made already
    assert G.groups_task(RankContext(5, 6, "world", Tracer(5)), mesh=Mesh(3, 2)) == 3
    assert threads[4:] == [(0, 2, 4), (1, 3, 5), (4, 5)]  # (0, 1) and (2, 3) are kept


def test_group_is_the_tasks_own_for_every_rank_and_a_made_group_for_fewer(threads):
    tracer = Tracer(3)
    ctx = RankContext(3, 4, "world", tracer)
    G._GROUPS[(1, 3)], G._GROUPS[(0, 1, 2, 3)] = "odd", "not this"
    assert G._group(ctx, [0, 1, 2, 3]) == RankContext(3, 4, "world", tracer)
    assert G._group(ctx, [1, 3]) == RankContext(1, 2, "odd", tracer)
    G._GROUPS[(2, 3)] = "tail"
    assert G._group(RankContext(3, 4, "world", tracer), [2, 3]) == RankContext(1, 2, "tail",
                                                                               tracer)
    with pytest.raises(KeyError):  # a group nobody made
        G._group(ctx, [0, 3])


def test_the_count_reads_every_dp_ranks_targets_whatever_rows_it_is_given():
    seen = []
    every = [torch.tensor([1]), torch.tensor([2])]
    count = G._CountEveryDPRank(lambda targets, mesh: seen.append((targets, mesh)) or 7, every)
    assert count([torch.tensor([9])], "mesh") == 7
    assert seen == [(every, "mesh")] and count.targets is every


# ---- the parent's assembly ---------------------------------------------------------------------


def _share(d, start, stop, fill, rows=1, width=3):
    return {"coordinates": (d, 0, 0), "rows": rows, "positions": (start, stop),
            "input_grad": torch.full((rows, stop - start, width), float(fill))}


def test_input_grad_adds_each_share_at_its_positions_and_stacks_the_dp_rows():
    results = [_share(0, 0, 2, 1.0, rows=2), _share(0, 2, 5, 2.0, rows=2),
               _share(0, 0, 5, 4.0, rows=2), _share(1, 0, 5, 8.0, rows=1)]
    got = G._input_grad(results, Mesh(2, 1))
    want = torch.cat([torch.tensor([5.0, 5.0, 6.0, 6.0, 6.0])[None, :, None].expand(2, 5, 3),
                      torch.full((1, 5, 3), 8.0)])
    assert torch.equal(got, want) and got.dtype == torch.float32
    half = [dict(r, input_grad=r["input_grad"].double()) for r in results]
    assert G._input_grad(half, Mesh(2, 1)).dtype == torch.float64


def _copies(mesh, tweak=None):
    """Identical results for every rank of ``mesh``: a gradient and two steps' parameters of
    "w" (sharded) and "b" (replicated); ``tweak(coordinates, name, which)``: an addend."""
    out = []
    for g in range(mesh.dp * mesh.replica_size):
        at = G.coordinates(g, mesh)

        def value(name, which, at=at):
            return torch.ones(2) + (tweak(at, name, which) if tweak else 0.0)
        out.append({"coordinates": at, "grads": {n: value(n, "grad") for n in "wb"},
                    "params": [{n: value(n, k) for n in "wb"} for k in range(2)]})
    return out


LAYOUT = [SimpleNamespace(name="w", placement=object()),
          SimpleNamespace(name="b", placement=Replicate())]


def _only(where, name, which, by):
    return lambda at, n, w: by if (at, n, w) == (where, name, which) else 0.0


@pytest.mark.parametrize("mesh, where, name, which, by, spread", [
    (Mesh(2, 2), (1, 0, 1), "w", "grad", 0.5, 0.5),  # a DP replica's copy
    (Mesh(2, 2), (1, 0, 0), "w", 1, 0.125, 0.125),  # the second step's parameters
    (Mesh(2, 2), (0, 0, 1), "b", 0, 0.25, 0.25),  # a replicated tensor across TP
    (Mesh(1, 2), (0, 0, 1), "b", 0, 0.25, 0.25),  # ... against TP rank 0 alone
    (Mesh(1, 4), (0, 0, 2), "b", "grad", 0.5, 0.5),
    (Mesh(1, 2), (0, 0, 1), "w", "grad", 0.5, 0.0),  # a TP shard: its own values
    (Mesh(1, 2, cp=2), (0, 1, 1), "w", "grad", 0.75, 0.75),  # a CP rank's copy
    (Mesh(2, 1, cp=2), (1, 1, 0), "b", 1, 0.375, 0.375),  # against DP 0 and CP 0
    (Mesh(2, 2), (1, 0, 0), "b", "grad", float("nan"), float("inf")),
    # a NaN in a tensor no other rank holds a copy of is no spread (the comparison with the
    # reference sees it): a copy is never compared with itself
    (Mesh(1, 2), (0, 0, 1), "w", "grad", float("nan"), 0.0),
    (Mesh(1, 1), (0, 0, 0), "b", "grad", float("nan"), 0.0)])
def test_spread_is_the_largest_difference_between_copies_that_must_be_equal(
        mesh, where, name, which, by, spread):
    assert G._spread(_copies(mesh), LAYOUT, mesh) == 0.0
    assert G._spread(_copies(mesh, _only(where, name, which, by)), LAYOUT, mesh) == spread


def test_spread_takes_the_largest_of_several():
    mesh = Mesh(2, 2)

    def tweak(at, name, which):
        return {((1, 0, 1), "w", "grad"): 0.5, ((0, 0, 1), "b", 0): -2.0,
                ((1, 0, 0), "w", 1): 1.0}.get((at, name, which), 0.0)
    assert G._spread(_copies(mesh, tweak), LAYOUT, mesh) == 2.0


# ---- whole runs on threads ---------------------------------------------------------------------


def _case(mesh, steps=2):
    return TrainingCase(SMALL, mesh, seed=3, steps=steps, spec=PACKED_WITH_EMPTY_ROW)


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def _same_trace(got, want):
    got, want = gathered(got), gathered(want)
    assert got.losses == pytest.approx(want.losses, rel=1e-5)
    assert got.input_grad.shape == want.input_grad.shape
    assert _close(got.input_grad, want.input_grad)
    for mine, theirs in [(got.grads, want.grads), *zip(got.params, want.params),
                         *zip(got.exp_avg, want.exp_avg), *zip(got.exp_avg_sq, want.exp_avg_sq)]:
        assert set(mine) == set(theirs)
        assert all(_close(mine[n], theirs[n]) for n in mine), [
            n for n in mine if not _close(mine[n], theirs[n])]
    assert len(got.params) == len(want.params) == len(got.exp_avg) == len(got.exp_avg_sq)


@pytest.mark.parametrize("mesh", [Mesh(2, 2), Mesh(2, 1), Mesh(1, 2, sp=True, cp=2)])
def test_train_gloo_on_threads_trains_as_the_in_process_mesh(threads, mesh):
    case = _case(mesh)
    world = mesh.dp * mesh.replica_size
    pool = Pool(world + 1)
    trace = G.train_gloo(case, pool)
    _same_trace(trace, case.sharded())
    assert trace.replica_spread == 0.0
    assert len(trace.hyperparameters) == world
    assert trace.hyperparameters[0] == trace.hyperparameters[-1]
    assert set(trace.hyperparameters[0]) >= {"lr", "weight_decay"}
    (groups, train) = pool.runs
    assert groups == ("groups_task", world + 1, {"mesh": mesh}, None)
    name, degree, kwargs, rank_kwargs = train
    assert (name, degree) == ("train_rank_task", world)
    assert kwargs == {"config": SMALL, "batches": case.batches, "adamw": case.adamw,
                      "recipe": CORRECT, "mesh": mesh}
    assert len(rank_kwargs) == world and all(set(k) == {"shards"} for k in rank_kwargs)
    results = pool.results[1]
    assert [r["coordinates"] for r in results] == [G.coordinates(g, mesh) for g in range(world)]
    # the moments on DP replica 0's CP rank 0 only; every rank the losses and parameters
    assert [len(r["moments"]) for r in results] == [
        2 if G.coordinates(g, mesh)[:2] == (0, 0) else 0 for g in range(world)]
    assert all(len(r["params"]) == 2 and len(r["losses"]) == 2 for r in results)


def test_train_gloo_of_a_mutation_is_the_in_process_mesh_of_the_mutation(threads):
    from weight_sync_bench.training.mutations import training_mutation
    case = _case(Mesh(2, 2), steps=1)
    recipe = training_mutation("tp_ranks_as_examples").recipe
    trace = G.train_gloo(case, Pool(4), recipe)
    _same_trace(trace, case.sharded(recipe))
    assert not torch.allclose(gathered(trace).input_grad, gathered(case.sharded()).input_grad)


@pytest.mark.parametrize("name, mesh", [("doc_mask_offset", Mesh(2, 1)),
                                        ("norm_grad_unreduced", Mesh(1, 2, sp=True))])
def test_mutations_that_shift_the_mask_or_split_the_copies_train_as_in_process(threads, name,
                                                                             mesh):
    from weight_sync_bench.training.mutations import training_mutation
    case = _case(mesh, steps=1)
    recipe = training_mutation(name).recipe
    trace, want = G.train_gloo(case, Pool(2), recipe), case.sharded(recipe)
    _same_trace(trace, want)
    assert trace.replica_spread == pytest.approx(want.replica_spread, rel=1e-4, abs=1e-7)
    # the unreduced norm gradients differ across the TP ranks, which must hold copies
    assert (trace.replica_spread > 0) == (name == "norm_grad_unreduced")


def test_train_rank_task_defaults_to_one_tp_group_of_the_tasks_degree(threads):
    case = _case(Mesh(1, 2, sp=True), steps=1)
    shards = G.split(case.params, G.layout_for(SMALL), 2)
    kw = {"config": SMALL, "batches": case.batches, "adamw": case.adamw, "recipe": CORRECT}
    pool = Pool(2)
    explicit = pool.run(G.train_rank_task, 2, kwargs={**kw, "mesh": Mesh(1, 2, sp=True)},
                        rank_kwargs=[{"shards": s} for s in shards])
    default = pool.run(G.train_rank_task, 2, kwargs={**kw, "sp": True},
                       rank_kwargs=[{"shards": s} for s in shards])
    plain = pool.run(G.train_rank_task, 2, kwargs=kw, rank_kwargs=[{"shards": s} for s in shards])
    for a, b, c in zip(explicit, default, plain):
        assert a["positions"] == b["positions"] != c["positions"]  # SP: its own slice
        assert a["rows"] == b["rows"] == c["rows"] == len(case.batches[0].tokens)
        assert a["losses"] == b["losses"] and a["coordinates"] == b["coordinates"]
        assert torch.equal(a["input_grad"], b["input_grad"])
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


def test_train_rank_task_refuses_a_mesh_of_another_size_than_the_task(threads):
    case = _case(Mesh(2, 2), steps=1)
    ctx = RankContext(0, 2, "world", Tracer(0))
    with pytest.raises(InvalidMesh) as e:
        G.train_rank_task(ctx, config=SMALL, shards={}, batches=case.batches,
                          adamw=case.adamw, recipe=CORRECT, mesh=Mesh(2, 2))
    assert str(e.value) == f"{SMALL.name}: mesh {Mesh(2, 2)} has 4 ranks, the task 2"


def test_train_gloo_refuses_a_mesh_larger_than_the_pool_and_runs_nothing(threads):
    case = _case(Mesh(2, 2), steps=1)
    pool = Pool(3)
    with pytest.raises(InvalidMesh) as e:
        G.train_gloo(case, pool)
    assert str(e.value) == (f"{SMALL.name}: mesh {Mesh(2, 2)} needs 4 ranks over gloo, the "
                            "rank pool has 3")
    assert pool.runs == []


def test_the_gloo_mutation_matrix_trains_each_case_on_the_pool(monkeypatch):
    seen, trained = [], []
    monkeypatch.setattr(G, "mutation_matrix", lambda cases, thresholds, mutations, *, train:
                        seen.append((cases, thresholds, mutations, train)) or ["rows"])
    monkeypatch.setattr(G, "train_gloo", lambda case, pool, recipe:
                        trained.append((case, pool, recipe)) or "trace")
    pool = object()
    assert G.gloo_mutation_matrix(["case"], {"loss": 1.0}, pool) == ["rows"]
    ((cases, thresholds, mutations, train),) = seen
    assert (cases, thresholds, mutations) == (["case"], {"loss": 1.0}, TRAINING_MUTATIONS)
    assert train("a case", "a recipe") == "trace" and trained == [("a case", pool, "a recipe")]
    G.gloo_mutation_matrix([], {}, pool, mutations=TRAINING_MUTATIONS[:1])
    assert seen[1][2] == TRAINING_MUTATIONS[:1]

"""Exact pins on ``training/step.py``: what each piece of a training step hands to the next,
written against the mutants that survived the behavioural tests (mutation/report.md). The
behavioural tests judge a whole run within its thresholds; these say what the recipe's
hooks receive, which batch each step draws, what the case validates and what a step keeps.
All on SMALL (d_model 32, 2 layers): well under a second each."""

import pytest
import torch

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import InvalidMesh, UnevenSequence
from weight_sync_bench.layout.placements import Replicate
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.training.batches import BatchSpec, default_spec, make_batch
from weight_sync_bench.training.floor import SMALL
from weight_sync_bench.training.mesh import Mesh, mesh_groups
from weight_sync_bench.training.optimizer import AdamW
from weight_sync_bench.training.step import (
    BATCH_SEED_OFFSET,
    CORRECT,
    Recipe,
    TrainingCase,
    TrainStep,
    batches_for,
    count_valid,
    global_mean_share,
    no_shift,
    sum_over_group,
    train_sharded,
)


def same_batch(a, b):
    return (a.spec == b.spec and torch.equal(a.tokens, b.tokens)
            and torch.equal(a.targets, b.targets) and torch.equal(a.segments, b.segments))


def test_step_k_of_seed_s_draws_batch_1000_plus_100s_plus_k_in_the_first_steps_layout():
    spec = default_spec(SMALL, packed=True)
    batches = batches_for(SMALL, spec, 3, 3)
    first = BATCH_SEED_OFFSET + 300
    assert BATCH_SEED_OFFSET == 1000 and len(batches) == 3
    for k, batch in enumerate(batches):
        assert same_batch(batch, make_batch(SMALL, spec, first + k, layout_seed=first))
    assert not torch.equal(batches[0].tokens, batches[1].tokens)
    assert torch.equal(batches[0].targets == -100, batches[2].targets == -100)


def recorded():
    """A collective factory keeping every collective it makes, so a test can read what each
    was asked for (``InProcessCollective.calls``), and those calls as (degree, op, tag)."""
    made = []

    def factory(degree):
        made.append(InProcessCollective(degree))
        return made[-1]

    return factory, lambda: [(c.degree, op, tag) for c in made for op, tag in c.calls]


REPLICATED = [s.name for s in layout_for(SMALL) if isinstance(s.placement, Replicate)]


def test_the_tp_reduction_passes_the_parameter_name_as_its_tag():
    coll = InProcessCollective(2)
    grads = [torch.ones(3), 2 * torch.ones(3)]
    out = sum_over_group(grads, coll, "layers.0.attn_norm.weight")
    assert all(torch.equal(o, 3 * torch.ones(3)) for o in out)
    assert coll.calls == [("all_reduce", "layers.0.attn_norm.weight")]


def test_every_hook_of_the_recipe_receives_the_mesh_and_the_global_count():
    mesh = Mesh(2, 2)
    seen = {"count": [], "objective": [], "shift": []}

    def count(targets, m):
        seen["count"].append((len(targets), m))
        return count_valid(targets, m)

    def objective(losses, targets, total, m):
        seen["objective"].append((total, m))
        return global_mean_share(losses, targets, total, m)

    def shift(d, m):
        seen["shift"].append((d, m))
        return no_shift(d, m)

    case = TrainingCase(SMALL, mesh, steps=1)
    recipe = Recipe(count=count, objective=objective, mask_shift=shift)
    case.sharded(recipe)
    total = sum(int((b.targets != -100).sum()) for b in case.batches)
    assert seen["count"] == [(2, mesh)]
    assert seen["objective"] == [(total, mesh)] * 4  # 2 DP replicas x 2 TP ranks
    assert seen["shift"] == [(0, mesh), (1, mesh)]


def test_a_step_keeps_gradients_only_when_asked():
    mesh = Mesh(1, 2)
    case = TrainingCase(SMALL, mesh, steps=1)
    layout = layout_for(SMALL)
    declared = split(case.params, layout, 2)
    replicas = [[{n: s.clone().requires_grad_(True) for n, s in declared[r].items()}
                 for r in range(2)]]
    step = TrainStep(SMALL, replicas, mesh, CORRECT, AdamW(),
                     groups=lambda: mesh_groups(mesh), dp=InProcessCollective(1))
    result = step(case.batches[0], [0])
    assert result.grads == []
    kept = step(case.batches[0], [0], keep_grads=True)
    assert len(kept.grads) == 1 and len(kept.grads[0]) == 2
    assert kept.grads[0][0].keys() == declared[0].keys()


def _never_built(*args, **kwargs):
    raise AssertionError("the mesh was not validated before the model was built")


def test_train_sharded_validates_the_sequence_split_itself():
    spec = BatchSpec(((5,), (6,)), seq_len=7)  # 7 tokens cannot split into 2 CP chunks
    batches = [make_batch(SMALL, spec, 1)]
    never = Recipe(model=_never_built)  # refused before a model is built
    with pytest.raises(UnevenSequence, match=r"seq_len % cp == 0 \(seq_len=7, cp=2\)"):
        train_sharded(SMALL, init_params(SMALL, 0), batches, Mesh(1, 1, cp=2), never)
    batches = [make_batch(SMALL, BatchSpec(((5,),), seq_len=8), 1),
               make_batch(SMALL, BatchSpec(((5,), (3,)), seq_len=8), 1)]
    with pytest.raises(InvalidMesh, match=r"dp\(2\) > batch rows\(1\)"):
        train_sharded(SMALL, init_params(SMALL, 0), batches, Mesh(2, 1))


def test_a_training_case_validates_its_steps_and_sequence_and_names_the_numbers():
    with pytest.raises(InvalidMesh) as err:
        TrainingCase(SMALL, Mesh(1, 1), steps=0)
    assert str(err.value) == "small: steps must be >= 1, got 0"
    with pytest.raises(UnevenSequence, match=r"\(seq_len=7, cp=2\)"):
        TrainingCase(SMALL, Mesh(1, 1, cp=2), spec=BatchSpec(((5,), (6,)), seq_len=7))


def test_a_training_case_uses_the_unpacked_default_batch_its_params_and_its_optimizer():
    case = TrainingCase(SMALL, Mesh(1, 1), seed=2, steps=1)
    assert case.spec == default_spec(SMALL, packed=False)
    drawn = init_params(SMALL, 2)
    assert all(torch.equal(case.params[n], drawn[n]) for n in drawn)
    mine = {n: torch.zeros_like(p) for n, p in drawn.items()}
    assert TrainingCase(SMALL, Mesh(1, 1), steps=1, params=mine).params is mine
    adamw = AdamW(lr=0.25, betas=(0.5, 0.75), eps=1e-3, weight_decay=0.0)
    case = TrainingCase(SMALL, Mesh(1, 1), steps=1, adamw=adamw)
    for trace in (case.reference(), case.sharded()):
        assert trace.hyperparameters[0] == {"lr": 0.25, "beta1": 0.5, "beta2": 0.75,
                                            "eps": 1e-3, "weight_decay": 0.0}


# ---- the replica spread: every copy that must be identical is compared ----

def mesh_of_copies(dp, cp, tp):
    """replicas[d][e] with two parameters, "norm" (replicated) and "w" (TP-sharded): every
    copy equal to its peers, so the spread is 0 until one is moved."""
    return [[{"norm": torch.ones(3), "w": torch.full((2,), float(e % tp))}
             for e in range(cp * tp)] for _ in range(dp)]


@pytest.mark.parametrize(("dp", "cp", "d", "e", "name", "why"), [
    (2, 1, 1, 0, "w", "a DP replica against replica 0"),
    (2, 1, 1, 1, "norm", "a DP replica's TP rank 1 against replica 0's"),
    (1, 1, 0, 1, "norm", "a replicated parameter on TP rank 1 against TP rank 0"),
    (1, 2, 0, 2, "w", "CP rank 1 against CP rank 0 (e == tp)"),
    (1, 2, 0, 3, "w", "CP rank 1, TP rank 1 against CP rank 0, TP rank 1"),
    (1, 2, 0, 3, "norm", "a replicated parameter on CP rank 1, TP rank 1"),
])
def test_the_spread_compares_each_copy_with_its_peers(dp, cp, d, e, name, why):
    """Each case moves one copy that exactly one kind of peer sees (the others are alone)."""
    from weight_sync_bench.training.step import _spread

    replicas = mesh_of_copies(dp=dp, cp=cp, tp=2)
    assert _spread(replicas, ["norm"], 2, lambda p: p) == 0.0
    replicas[d][e][name] = replicas[d][e][name] + 0.375
    assert _spread(replicas, ["norm"], 2, lambda p: p) == 0.375, why


def test_the_spread_leaves_sharded_parameters_across_tp_ranks_alone_and_counts_nan_as_inf():
    from weight_sync_bench.training.step import _spread

    replicas = mesh_of_copies(dp=1, cp=1, tp=2)  # "w" differs across TP ranks: it is sharded
    assert _spread(replicas, ["norm"], 2, lambda p: p) == 0.0
    assert _spread(replicas, ["norm", "w"], 2, lambda p: p) == 1.0
    replicas[0][1]["norm"] = torch.full((3,), float("nan"))
    assert _spread(replicas, ["norm"], 2, lambda p: p) == float("inf")
    assert _spread(replicas, ["norm"], 2, torch.ones_like) == 0.0  # ``get`` is applied


def test_the_input_gradient_is_assembled_at_its_positions_in_its_dtype_with_zeros_for_none():
    from weight_sync_bench.training.step import _assemble, _grad

    a = torch.zeros(1, 2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, 2, 3, dtype=torch.float64, requires_grad=True)
    (a * 2).sum().backward()
    out = _assemble([a, a, b], [(0, 2), (0, 2), (2, 4)], torch.Size([1, 4]))
    assert out.dtype == torch.float64 and out.shape == (1, 4, 3)
    assert torch.equal(out[:, :2], torch.full((1, 2, 3), 2.0, dtype=torch.float64))
    assert torch.equal(out[:, 2:], torch.zeros(1, 2, 3, dtype=torch.float64))  # b has no grad
    assert torch.equal(_grad(b), torch.zeros(1, 2, 3, dtype=torch.float64))
    assert _grad(a) is a.grad


def test_the_tp_and_dp_reductions_tag_each_gradient_with_its_parameter_name():
    layout = layout_for(SMALL)
    factory, calls = recorded()
    TrainingCase(SMALL, Mesh(1, 2), steps=1).sharded(collective=factory)
    tp_tags = [tag for n, op, tag in calls() if (n, op) == (2, "all_reduce")]
    assert REPLICATED and set(REPLICATED) <= set(tp_tags) and None not in tp_tags
    factory, calls = recorded()
    TrainingCase(SMALL, Mesh(2, 1), steps=1).sharded(collective=factory)
    dp_tags = [tag for n, op, tag in calls() if (n, op) == (2, "all_reduce")]  # tp = 1: DP only
    assert dp_tags == layout.names


def test_a_check_compares_the_traces_it_is_given_and_reports_its_case():
    from weight_sync_bench.tolerance.training import QUANTITIES
    from weight_sync_bench.training.compare import EXACT, deviations

    case = TrainingCase(SMALL, Mesh(2, 2), seed=1, steps=1)
    trained = case.sharded()
    thresholds = dict.fromkeys(QUANTITIES, 1.0)
    same = case.check(thresholds, reference=trained, trained=trained, mutation="m")
    assert [c.quantity for c in same.comparisons] == list(QUANTITIES) + list(EXACT)
    assert all(c.deviation == 0.0 for c in same.comparisons)
    assert [c.threshold for c in same.comparisons] == [1.0] * len(QUANTITIES) + [0.0] * len(EXACT)
    assert (same.config, same.mesh, same.steps, same.packed, same.mutation) == (
        "small", Mesh(2, 2), 1, False, "m")
    assert same.losses == (trained.losses[0], trained.losses[0])
    reference = case.reference()
    report = case.check(thresholds)
    assert report.passed and report.mutation is None
    devs = deviations(SMALL, case.params, reference, trained)
    assert [(c.deviation, c.where) for c in report.comparisons] == [
        devs[q] for q in QUANTITIES + EXACT]  # each with the parameter where it is worst
    assert {c.quantity: c.where for c in report.comparisons}["param_grad"]
    moved = case.sharded()
    moved.losses[0] += 0.5  # the trace given is the trace judged, not a fresh run
    judged = case.check(thresholds, reference=reference, trained=moved)
    assert judged.losses == (moved.losses[0], reference.losses[0])
    assert {c.quantity: c.deviation for c in judged.comparisons}["loss"] > 0.01
    factory, calls = recorded()
    case.check(thresholds, reference=trained, collective=factory)
    assert calls()  # the sharded side ran over the collective it was given


def test_with_spec_replaces_the_batch_and_keeps_the_rest():
    case = TrainingCase(SMALL, Mesh(2, 1), seed=4, steps=2)
    spec = default_spec(SMALL, packed=True)
    other = case.with_spec(spec)
    assert other.spec == spec and other.spec != case.spec
    assert (other.config, other.mesh, other.seed, other.steps) == (SMALL, Mesh(2, 1), 4, 2)
    assert all(same_batch(a, b) for a, b in zip(other.batches, batches_for(SMALL, spec, 4, 2)))


def test_the_cp_and_tp_reductions_get_every_ranks_gradient_and_the_parameter_name():
    layout = layout_for(SMALL)
    seen = {"tp": [], "cp": []}

    def spy(kind):
        def reduce(grads, group, tag):
            seen[kind].append((len(grads), tag))
            return sum_over_group(grads, group, tag)
        return reduce

    mesh = Mesh(1, 2, sp=True, cp=2)
    TrainingCase(SMALL, mesh, steps=1).sharded(Recipe(tp_reduce=spy("tp"), cp_reduce=spy("cp")))
    assert seen["cp"] == [(4, name) for name in layout.names]  # every parameter, all 4 ranks
    assert seen["tp"] == [(4, name) for name in REPLICATED]


def test_the_moments_are_zeros_before_a_step_and_copies_only_when_asked():
    from weight_sync_bench.training.optimizer import moments

    w = torch.nn.Parameter(torch.ones(3))
    optim = torch.optim.AdamW([w], lr=0.1)
    first, second = moments(optim, {"w": w})  # never stepped: no state yet
    assert torch.equal(first["w"], torch.zeros(3)) and torch.equal(second["w"], torch.zeros(3))
    w.grad = torch.tensor([1.0, -2.0, 3.0])
    optim.step()
    state = optim.state[w]
    kept, views = moments(optim, {"w": w}), moments(optim, {"w": w}, copy=False)
    assert views[0]["w"].data_ptr() == state["exp_avg"].data_ptr()
    assert views[1]["w"].data_ptr() == state["exp_avg_sq"].data_ptr()
    assert kept[0]["w"].data_ptr() != state["exp_avg"].data_ptr()
    assert kept[1]["w"].data_ptr() != state["exp_avg_sq"].data_ptr()
    assert torch.equal(kept[0]["w"], views[0]["w"]) and torch.equal(kept[1]["w"], views[1]["w"])
    assert not torch.equal(kept[0]["w"], kept[1]["w"])  # each its own moment

"""Exact pins on ``training/adversarial.py``: which shards ``cancelling`` copies and negates
(at every pair of ranks, every layer, with its margin), which biases ``loud_biases`` sets
(zero counted positive), which rank ``owner`` names, and where ``max_elsewhere`` moves each
valid label (the first real class of another rank than the reference's maximum), written
against the mutants the behavioural tests (tests/training/test_step.py) left alive."""

import pytest
import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.training import adversarial
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.floor import SMALL, SMALL_VARIANTS
from weight_sync_bench.training.loss import IGNORE_INDEX
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.step import TrainingCase

BIASED = SMALL_VARIANTS[1]  # tied embeddings, biases
COPIED = ("qkv.weight", "gate_up.weight")
NEGATED = ("o_proj.weight", "down.weight")


def _snapshot(params):
    return {n: p.clone() for n, p in params.items()}


@pytest.mark.parametrize(("config", "degree"), [(SMALL, 2), (SMALL, 4), (BIASED, 2),
                                                 (SMALL.replace(qkv_bias=True), 2)],
                         ids=["small-t2", "small-t4", "biased-t2", "qkv-bias-t2"])
def test_cancelling_copies_and_negates_every_pair_in_every_layer(config, degree):
    params = init_params(config, 1)
    before = _snapshot(params)
    out = adversarial.cancelling(config, params, degree, margin=0.25)
    assert all(torch.equal(params[n], before[n]) for n in params)  # input not modified
    layout = layout_for(config)
    given, got = split(params, layout, degree), split(out, layout, degree)
    copied = COPIED + (("qkv.bias",) if config.has_qkv_bias else ())
    for i in range(config.n_layers):
        for even in range(0, degree, 2):
            src, dst = got[even], got[even + 1]
            for suffix in copied:
                name = f"layers.{i}.{suffix}"
                assert torch.equal(src[name], given[even][name]), name
                assert torch.equal(dst[name], src[name]), name
            for suffix in NEGATED:
                name = f"layers.{i}.{suffix}"
                assert torch.equal(src[name], given[even][name]), name
                assert torch.equal(dst[name], -0.75 * src[name]), name
    touched = {f"layers.{i}.{s}" for i in range(config.n_layers) for s in copied + NEGATED}
    assert out.keys() == params.keys()
    for name in params.keys() - touched:  # norms, embeddings, row biases: as given
        assert torch.equal(out[name], params[name]), name


def test_cancelling_pairs_really_cancel_to_the_margin():
    params = adversarial.cancelling(SMALL, init_params(SMALL, 2), 2)  # default margin 1e-3
    shards = split(params, layout_for(SMALL), 2)
    torch.testing.assert_close(shards[1]["layers.1.down.weight"],
                               -(1 - 1e-3) * shards[0]["layers.1.down.weight"], rtol=0, atol=0)
    assert not torch.equal(shards[0]["layers.1.down.weight"], torch.zeros_like(
        shards[0]["layers.1.down.weight"]))


@pytest.mark.parametrize("degree", [0, 1, 3])
def test_cancelling_needs_an_even_degree_of_at_least_two(degree):
    with pytest.raises(InvalidConfig) as err:
        adversarial.cancelling(SMALL, init_params(SMALL, 0), degree)
    assert str(err.value) == (f"small: cancelling pairs ranks, needs an even degree >= 2 "
                              f"(t={degree})")


def test_loud_biases_sets_row_parallel_biases_to_signed_scale_and_zero_counts_positive():
    params = init_params(BIASED, 3)
    params["layers.0.o_proj.bias"][0] = 0.0
    before = _snapshot(params)
    out = adversarial.loud_biases(BIASED, params, scale=0.375)
    assert all(torch.equal(params[n], before[n]) for n in params)  # input not modified
    loud = {n for n in params if n.endswith(("o_proj.bias", "down.bias"))}
    assert len(loud) == 2 * BIASED.n_layers
    for name in loud:
        sign = torch.where(params[name] >= 0, 1.0, -1.0)
        assert torch.equal(out[name], 0.375 * sign), name
        assert (out[name] < 0).any() and (out[name] > 0).any(), name
    assert out["layers.0.o_proj.bias"][0].item() == 0.375
    for name in params.keys() - loud:  # the qkv and gate_up biases too: as given
        assert out[name] is params[name], name
    default = adversarial.loud_biases(BIASED, params)
    assert default["layers.1.down.bias"].abs().unique().tolist() == [0.5]


def test_loud_biases_needs_a_row_parallel_bias():
    for config in (SMALL, SMALL.replace(qkv_bias=True)):  # no bias, or q/k/v's only
        with pytest.raises(InvalidConfig) as err:
            adversarial.loud_biases(config, init_params(config, 0))
        assert str(err.value) == ("small: loud_biases needs a row-parallel bias (bias=True or "
                                  "o_bias=True)")
    o_bias = SMALL.replace(qkv_bias=True, o_bias=True)  # the twin: o_proj's bias alone
    out = adversarial.loud_biases(o_bias, init_params(o_bias, 0), scale=0.5)
    assert out["layers.0.o_proj.bias"].abs().eq(0.5).all()


def test_owner_is_the_integer_rank_of_each_class():
    classes = torch.tensor([0, 12, 13, 25, 26, 51])
    got = adversarial.owner(classes, SMALL, 4)  # padded vocab 52: 13 classes a rank
    assert got.dtype == torch.int64 and got.tolist() == [0, 0, 1, 1, 2, 3]
    assert adversarial.owner(classes, SMALL, 2).tolist() == [0, 0, 0, 0, 1, 1]


def _expected_targets(case, degree):
    """Per batch: the first real class (``starts``) of the first rank, in rank order, that
    does not own the reference's largest logit."""
    width = case.config.padded_vocab // degree
    starts = [r * width for r in range(degree) if r * width < case.config.vocab]
    out = []
    for batch in case.batches:
        with torch.no_grad():
            top = ReferenceModel(case.config, case.params)(batch.tokens, batch.model_segments)
        ranks = top.argmax(-1) // width
        moved = [[next(s for s in starts if s // width != r) for r in row]
                 for row in ranks.tolist()]
        out.append(torch.where(batch.targets == IGNORE_INDEX, batch.targets,
                               torch.tensor(moved)))
    return out


@pytest.mark.parametrize(("degree", "packed"), [(2, True), (4, False)])
def test_max_elsewhere_moves_each_valid_label_to_another_ranks_first_class(degree, packed):
    case = TrainingCase(SMALL, Mesh(1, degree), seed=4, steps=2,
                        spec=default_spec(SMALL, packed=packed))
    given = [b.targets.clone() for b in case.batches]
    out = adversarial.max_elsewhere(case, degree)
    assert out is not case and out.params is case.params and out.config is SMALL
    assert len(out.batches) == 2
    for b, old, want in zip(out.batches, given, _expected_targets(case, degree)):
        assert b.targets.dtype == torch.int64 and torch.equal(b.targets, want)
        assert torch.equal((b.targets == IGNORE_INDEX), (old == IGNORE_INDEX))
    for b, orig, old in zip(out.batches, case.batches, given):
        assert torch.equal(orig.targets, old)  # the input case keeps its labels
        assert torch.equal(b.tokens, orig.tokens) and torch.equal(b.segments, orig.segments)
    width = SMALL.padded_vocab // degree
    top = ReferenceModel(SMALL, case.params)(out.batches[0].tokens,
                                             out.batches[0].model_segments).argmax(-1)
    valid = out.batches[0].targets != IGNORE_INDEX
    assert ((top // width) != (out.batches[0].targets // width))[valid].all()


def test_max_elsewhere_never_targets_a_rank_of_padding_classes():
    # vocab 48 padded to 64 over 4 ranks: rank 3's classes 48..63 are all padding
    config = SMALL.replace(vocab=48, vocab_multiple=64)
    case = TrainingCase(config, Mesh(1, 4), seed=1, steps=1)
    out = adversarial.max_elsewhere(case, 4)
    valid = out.batches[0].targets[out.batches[0].targets != IGNORE_INDEX]
    assert set(valid.tolist()) <= {0, 16, 32} and len(set(valid.tolist())) >= 2


def test_max_elsewhere_needs_two_ranks_holding_real_classes():
    case = TrainingCase(SMALL, Mesh(1, 1), steps=1)
    with pytest.raises(InvalidConfig) as err:
        adversarial.max_elsewhere(case, 1)
    assert str(err.value) == "small: the maximum and the target need two ranks (t=1)"
    for vocab in (10, 32):  # padded to 64: rank 1's classes 32..63 are all padding
        tiny = SMALL.replace(vocab=vocab, vocab_multiple=64)
        with pytest.raises(InvalidConfig) as err:
            adversarial.max_elsewhere(TrainingCase(tiny, Mesh(1, 1), steps=1), 2)
        assert str(err.value) == "small: only one rank holds real classes at t=2"
    holds_33 = SMALL.replace(vocab=33, vocab_multiple=64)  # the twin: class 32 is real
    out = adversarial.max_elsewhere(TrainingCase(holds_33, Mesh(1, 1), steps=1), 2)
    assert set(out.batches[0].targets.unique().tolist()) <= {IGNORE_INDEX, 0, 32}

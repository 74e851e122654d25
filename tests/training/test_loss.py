"""The vocab-parallel cross-entropy and the global valid-token mean, including the seed's
worked examples: losses [1, 3] and [8] give 4 (not 5); [2, 4, 6] and [8] give 5 (not 6)."""

import pytest
import torch
import torch.nn.functional as F

from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.training.loss import (
    IGNORE_INDEX,
    local_objective,
    valid_count,
    vocab_parallel_token_losses,
)
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import training_mutation
from weight_sync_bench.training.step import global_mean_share

EQUAL_AVERAGE = training_mutation("equal_average_local_means").recipe.objective


def _ranks(losses_per_rank: list[list[float]], pad: int = 2):
    """Each DP rank's token losses as leaves, with ``pad`` ignored positions appended."""
    out = []
    for losses in losses_per_rank:
        values = torch.tensor(losses + [0.0] * pad, requires_grad=True)
        targets = torch.tensor([1] * len(losses) + [IGNORE_INDEX] * pad)
        out.append((values, targets))
    return out


def _objective(share, losses_per_rank):
    ranks = _ranks(losses_per_rank)
    mesh = Mesh(dp=len(ranks), tp=1)
    total = sum(valid_count(t) for _, t in ranks)
    loss = sum(share(v, t, total, mesh) for v, t in ranks)
    loss.backward()
    return loss.item(), [v.grad[: len(ls)].tolist() for (v, _), ls in zip(ranks, losses_per_rank)]


@pytest.mark.parametrize(("losses", "mean", "equal_average"), [
    ([[1.0, 3.0], [8.0]], 4.0, 5.0),
    ([[2.0, 4.0, 6.0], [8.0]], 5.0, 6.0),
])
def test_worked_examples_give_the_global_valid_token_mean_not_the_average_of_local_means(
        losses, mean, equal_average):
    loss, grads = _objective(global_mean_share, losses)
    assert loss == pytest.approx(mean)
    n = sum(len(ls) for ls in losses)
    # every valid token weighs 1/n in the gradient, whichever rank holds it
    assert grads == [[pytest.approx(1 / n)] * len(ls) for ls in losses]
    wrong, wrong_grads = _objective(EQUAL_AVERAGE, losses)
    assert wrong == pytest.approx(equal_average)
    # the equal average weighs a token by 1 / (dp * its rank's count): not the same objective
    assert wrong_grads == [[pytest.approx(1 / (len(losses) * len(ls)))] * len(ls) for ls in losses]


def test_local_objective_shares_add_up_to_the_mean_and_padding_adds_nothing():
    ranks = _ranks([[1.0, 3.0], [8.0]], pad=5)
    assert sum(local_objective(v, 3).item() for v, _ in ranks) == pytest.approx(4.0)


def _dense_and_sharded(logits: torch.Tensor, targets: torch.Tensor, degree: int, vocab: int,
                       mask_padding: bool = True):
    """Token losses and d(loss)/d(logits) of the dense F.cross_entropy and of the vocab-parallel
    one over ``degree`` in-process ranks (logits carry the padded columns)."""
    dense_in = logits.detach().clone().requires_grad_(True)
    dense = F.cross_entropy(dense_in[..., :vocab].reshape(-1, vocab), targets.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
    dense.sum().backward()
    shards = [s.detach().clone().requires_grad_(True) for s in logits.chunk(degree, dim=-1)]
    sharded = vocab_parallel_token_losses(shards, targets, InProcessCollective(degree),
                                          vocab=vocab, mask_padding=mask_padding)
    sharded[0].sum().backward()
    return dense, dense_in.grad, sharded[0], torch.cat([s.grad for s in shards], dim=-1)


@pytest.mark.parametrize(("vocab", "padded", "degree"), [
    (12, 12, 1), (12, 12, 2), (12, 12, 4),
    (10, 12, 2), (10, 12, 4),  # vocab not divisible: 2 padded columns on the last rank
    (5, 8, 4),  # the last rank holds only padding
])
def test_vocab_parallel_cross_entropy_matches_the_dense_one(vocab, padded, degree):
    gen = torch.Generator().manual_seed(vocab * 31 + degree)
    logits = torch.randn(3, 5, padded, generator=gen) * 4
    targets = torch.randint(0, vocab, (3, 5), generator=gen)
    targets[0, 1] = targets[2, 4] = IGNORE_INDEX
    dense, dense_grad, sharded, sharded_grad = _dense_and_sharded(logits, targets, degree, vocab)
    torch.testing.assert_close(sharded, dense, rtol=0, atol=1e-5)
    assert sharded[0, 1].item() == 0.0 and sharded[2, 4].item() == 0.0  # ignored: exactly 0
    torch.testing.assert_close(sharded_grad[..., :vocab], dense_grad[..., :vocab], rtol=0,
                               atol=1e-6)
    assert torch.count_nonzero(sharded_grad[..., vocab:]) == 0  # padding is never a class


def test_maximum_and_target_on_different_ranks():
    logits = torch.zeros(1, 2, 8)
    logits[0, :, 1] = 60.0  # the maximum, on rank 0 (columns 0-3)
    targets = torch.tensor([[6, 5]])  # targets on rank 1 (columns 4-7)
    dense, _, sharded, _ = _dense_and_sharded(logits, targets, 2, 8)
    assert dense[0, 0].item() > 59  # a large loss, computed stably from the global max
    torch.testing.assert_close(sharded, dense, rtol=0, atol=1e-5)


@pytest.mark.parametrize("owner", [1, 2, 3], ids=["middle-rank-1", "middle-rank-2", "last-rank"])
def test_a_large_logit_on_a_rank_other_than_0_is_the_global_maximum(owner):
    """A loss that took rank 0's maximum instead of the global one would overflow: with 100
    on another rank, exp(100 - max_0) is inf in fp32 and the loss infinite."""
    degree, width = 4, 3
    logits = torch.zeros(2, 3, degree * width)
    logits[:, :, owner * width + 1] = 100.0  # the maximum, on rank `owner` only
    targets = torch.tensor([[0, owner * width + 1, 11], [5, 7, owner * width]])
    dense, dense_grad, sharded, sharded_grad = _dense_and_sharded(logits, targets, degree,
                                                                  degree * width)
    assert torch.isfinite(sharded).all() and dense.max().item() > 99
    torch.testing.assert_close(sharded, dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(sharded_grad, dense_grad, rtol=0, atol=1e-6)


def test_unmasked_padded_vocab_changes_the_loss_and_masked_does_not():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 12, generator=gen)
    logits[..., 10:] = 5.0  # padded columns with large logits
    targets = torch.randint(0, 10, (2, 4), generator=gen)
    dense, _, masked, _ = _dense_and_sharded(logits, targets, 2, 10)
    _, _, unmasked, _ = _dense_and_sharded(logits, targets, 2, 10, mask_padding=False)
    torch.testing.assert_close(masked, dense, rtol=0, atol=1e-5)
    assert (unmasked - dense).abs().min().item() > 0.1

"""Vocab-parallel loss claims that mutation testing found unpinned (mutation/report.md): the
padding mask is on by default, the stabilising maximum is per token (not per sequence, per
batch or global), per-rank labels are honoured, and the three collectives carry their tags."""

import torch
import torch.nn.functional as F

from weight_sync_bench.collectives.inprocess import InProcessCollective, InProcessGroups
from weight_sync_bench.training.loss import IGNORE_INDEX, vocab_parallel_token_losses


def _dense(logits, targets, vocab):
    return F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)


def test_padded_columns_are_masked_without_being_asked():
    logits = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(3))
    logits[..., 10:] = 5.0  # padded columns (vocab 10 of 12) with large logits
    targets = torch.tensor([[0, 9, 3, IGNORE_INDEX], [4, 5, 6, 7]])
    (losses, _) = vocab_parallel_token_losses(list(logits.chunk(2, dim=-1)), targets,
                                              InProcessCollective(2), vocab=10)
    torch.testing.assert_close(losses, _dense(logits, targets, 10), rtol=0, atol=1e-5)


def test_each_token_is_stabilised_by_its_own_maximum():
    """Logits 200 above or below the rest between tokens of one sequence and of the batch: a maximum taken over
    more than one token's vocabulary would make exp underflow to 0 for the lower token, and
    its loss infinite."""
    degree, width = 2, 4
    logits = torch.randn(2, 3, degree * width, generator=torch.Generator().manual_seed(0))
    logits[0, 0] += 200.0  # one high token in batch row 0
    logits[1, 2] -= 200.0  # one low token in batch row 1
    targets = torch.tensor([[1, 6, 3], [7, 0, 5]])
    (losses, _) = vocab_parallel_token_losses(list(logits.chunk(degree, dim=-1)), targets,
                                              InProcessCollective(degree), vocab=degree * width)
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, _dense(logits, targets, degree * width), rtol=0,
                               atol=1e-4)


def test_one_label_tensor_per_local_rank_is_used_rank_by_rank():
    """Two context-parallel chunks side by side, each a TP group of 2 with its own labels:
    positions 0, 1 hold chunk A's vocab halves, positions 2, 3 chunk B's."""
    gen = torch.Generator().manual_seed(1)
    chunk_a, chunk_b = torch.randn(1, 3, 8, generator=gen), torch.randn(1, 3, 8, generator=gen)
    labels_a, labels_b = torch.tensor([[0, 5, IGNORE_INDEX]]), torch.tensor([[7, 2, 3]])
    local = [*chunk_a.chunk(2, dim=-1), *chunk_b.chunk(2, dim=-1)]
    out = vocab_parallel_token_losses(local, [labels_a, labels_a, labels_b, labels_b],
                                      InProcessGroups([[0, 1], [2, 3]]), vocab=8)
    for position, (logits, labels) in enumerate([(chunk_a, labels_a)] * 2
                                                + [(chunk_b, labels_b)] * 2):
        torch.testing.assert_close(out[position], _dense(logits, labels, 8), rtol=0, atol=1e-5)


def test_the_loss_runs_three_tagged_collectives_in_order():
    """The tags are what breadcrumbs and collective counts name (a gloo rank stalled in the
    loss is reported by them)."""
    collective = InProcessCollective(2)
    vocab_parallel_token_losses(list(torch.zeros(1, 2, 8).chunk(2, dim=-1)),
                                torch.tensor([[1, 6]]), collective, vocab=8)
    assert collective.calls == [("all_gather", "loss.max"), ("all_reduce", "loss.sum_exp"),
                                ("all_reduce", "loss.target_logit")]

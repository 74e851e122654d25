"""Data movement has no tolerance: one flipped bit in a reshard fails the sweep behind
``make run`` and ``wsb check``, even though it cannot move the logits past the threshold."""

import pytest
import torch

from weight_sync_bench import TOY, sweep
from weight_sync_bench.check import checker as checker_module
from weight_sync_bench.cli.main import main
from weight_sync_bench.layout.reshard import reshard as harness_reshard
from weight_sync_bench.layout.reshard import reshard_tensor as harness_reshard_tensor

VICTIM = "layers.1.down.weight"


def _flip_low_bit(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with the lowest mantissa bit of its first element flipped."""
    out = x.clone()
    flat = out.view(-1).view(torch.int32)
    flat[0] ^= 1
    return out


@pytest.fixture
def one_flipped_bit(monkeypatch):
    """The harness's reshard, but rank 0's copy of one parameter has one bit flipped, on
    both paths the sweep takes (per parameter, and the whole model for a diagnosis)."""
    def reshard_tensor(shards, spec, dst):
        out = harness_reshard_tensor(shards, spec, dst)
        return [_flip_low_bit(out[0]), *out[1:]] if spec.name == VICTIM else out

    def reshard(shards, layout, dst):
        out = harness_reshard(shards, layout, dst)
        out[0] = {**out[0], VICTIM: _flip_low_bit(out[0][VICTIM])}
        return out

    monkeypatch.setattr(checker_module, "reshard_tensor", reshard_tensor)
    monkeypatch.setattr(checker_module, "reshard", reshard)


def test_a_reshard_with_one_flipped_bit_fails_every_pair_of_the_sweep(one_flipped_bit):
    verdicts = sweep(TOY)
    assert verdicts and not any(v.passed for v in verdicts)
    for v in verdicts:
        assert v.first_mismatch == VICTIM and v.mismatches == (VICTIM,), str(v)
        assert v.max_abs_error <= v.threshold  # the logits alone would have passed


def test_the_twin_the_same_sweep_without_the_flipped_bit_passes():
    assert all(v.passed for v in sweep(TOY))


def test_wsb_check_exits_non_zero_on_one_flipped_bit(one_flipped_bit, capsys):
    assert main(["check", "--config", "toy"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "PASS" not in out.split("\n", 1)[1]


def test_wsb_check_twin_passes_without_it(capsys):
    assert main(["check", "--config", "toy"]) == 0

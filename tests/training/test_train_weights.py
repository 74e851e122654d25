"""Training equivalence on the user's own weights (``wsb train-check --weights DIR``,
``training.floor.thresholds_on``): the thresholds are measured on those weights (other
batches, the meshes the committed floor measures), never read from a floor of the seed's;
the correct sharded training passes them and every training mutation that changes the run
is detected under them."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.cli.main import main
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.checkpoint import write_checkpoint, write_megatron_dist
from weight_sync_bench.model.config import TOY, init_params
from weight_sync_bench.training.batches import default_spec
from weight_sync_bench.training.floor import thresholds_on
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.mutations import mutation_matrix
from weight_sync_bench.training.step import TrainingCase


# TOY's heads and widths with a vocabulary of 512, not 32000, and one layer of its four: the
# command's path on a user's HF directory (thresholds measured on the weights over four
# trainings, then the check) is the same at any vocabulary and depth, and TOY's embedding and
# head made it 10 s, its four layers 2.5 s, this about 1 s. (At a width of 64 the trainings
# agree bit for bit and no threshold can be measured: the width stays TOY's.)
TOY_SMALL_VOCAB = TOY.replace(name="toy_small_vocab", vocab=512, n_layers=1)


def weights(config=TOY):
    """Weights no seed draws: seed 9's, tripled, through bfloat16 (as a trainer saves them),
    in fp32 as AdamW trains them."""
    return {n: (x * 3).to(torch.bfloat16).float() for n, x in init_params(config, 9).items()}


# 19 s: the long run; by default thresholds are measured on a user's weights and judge a
# correct run in test_train_check_on_an_hf_directory_and_what_it_refuses
@pytest.mark.slow
def test_thresholds_measured_on_the_weights_judge_the_correct_run_and_the_mutations(
        monkeypatch):
    from weight_sync_bench.training import floor

    w = weights()
    spec = default_spec(TOY, packed=False)
    mesh = Mesh(1, 2)
    measured = []
    real = floor.measure

    def spy(**kwargs):
        measured.extend(c for _, _, cases in kwargs["groups"] for c in cases)
        return real(**kwargs)

    monkeypatch.setattr(floor, "measure", spy)
    limits = thresholds_on(TOY, w, [mesh, Mesh(2, 2)], spec, 2, (1, 2))
    assert len(measured) == 4 and all(c.params is w and c.seed in (1, 2) for c in measured)
    case = TrainingCase(TOY, mesh, 0, 2, spec, w)
    assert torch.equal(case.params["layers.0.qkv.weight"], w["layers.0.qkv.weight"])
    report = case.check(limits)
    assert report.passed, report
    rows = mutation_matrix([case], limits)
    ran = [r for r in rows if r.report is not None]
    assert ran and all(r.detected for r in ran), [(r.mutation, r.detected) for r in ran]


def test_train_check_on_an_hf_directory_and_what_it_refuses(tmp_path, capsys):
    w = weights(TOY_SMALL_VOCAB)
    hf = endpoint("hf")
    bf16 = {n: x.to(torch.bfloat16) for n, x in w.items()}
    write_checkpoint(tmp_path / "w", materialize(hf.pieces(TOY_SMALL_VOCAB), bf16), hf,
                     TOY_SMALL_VOCAB)
    base = ["train-check", "--weights", str(tmp_path / "w"), "--dp", "1", "--tp", "2",
            "--batch", "unpacked"]
    assert main(base) == 0
    captured = capsys.readouterr()
    assert "1 passed, 0 failed" in captured.out
    assert "thresholds measured on them" in captured.out
    assert main([*base, "--sp"]) == 2
    assert "--sp / --cp on your weights is not built" in capsys.readouterr().err
    write_megatron_dist(tmp_path / "m", bf16, endpoint("megatron:2"), TOY_SMALL_VOCAB)
    assert main(["train-check", "--weights", str(tmp_path / "m")]) == 2
    assert "give --config NAME" in capsys.readouterr().err

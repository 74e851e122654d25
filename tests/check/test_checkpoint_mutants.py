"""``verify_checkpoint`` at its seams (issue 30, the mutation pass over
``check/checkpoint.py``): what it reads, with which rules, what judges it (the conversion
checker, or the FP8 check for a quantized destination), and the file a wrong dtype is named
by. Reading, judging and the FP8 check stand in here: what they do is
``tests/conventions/test_checkpoint.py``'s and ``test_fp8_checkpoint.py``'s."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.check import checkpoint
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import Checkpoint
from weight_sync_bench.errors import (
    CheckpointError,
    InvalidNumber,
    UnsupportedLayout,
    WrongShardShape,
)
from weight_sync_bench.model.config import init_params

CONFIG = tiny(2, n_layers=1)
DIRECTORY = Path("/nowhere/ckpt")


@pytest.fixture
def seams(monkeypatch):
    """Reading, the checker, the validation and the FP8 check standing in: each records what
    it is asked; ``seams.refuse`` makes the validation raise."""
    seams = SimpleNamespace(asked=[], refuse=None)
    shards = [{"a": torch.zeros(2)}, {"a": torch.ones(2, dtype=torch.bfloat16)}]
    files = [{"a": DIRECTORY / "rank0.safetensors"}, {"a": DIRECTORY / "rank1.safetensors"}]
    seams.checkpoint = Checkpoint(DIRECTORY, shards, files)

    def read_checkpoint(directory, where, config, *, roots):
        seams.asked.append(("read", directory, where, config, roots))
        return seams.checkpoint

    full = {"x": torch.zeros(1, dtype=torch.float16), "y": torch.zeros(1)}

    def conversion_checker(config, **kwargs):
        seams.asked.append(("checker", config, kwargs))
        return SimpleNamespace(
            checker=SimpleNamespace(full=full),
            verdict=lambda out, *, src, dst: seams.asked.append(("verdict", out, src, dst))
            or "verdict")

    def validate(shards, where, config, dtypes):
        seams.asked.append(("validate", shards, where, config, dtypes))
        if seams.refuse is not None:
            raise seams.refuse

    monkeypatch.setattr(checkpoint, "read_checkpoint", read_checkpoint)
    monkeypatch.setattr(checkpoint, "conversion_checker", conversion_checker)
    monkeypatch.setattr(checkpoint, "validate_convention_shards", validate)
    return seams


def test_a_checkpoint_is_read_as_its_destination_and_judged_by_the_conversion_checker(seams):
    target = endpoint("vllm:2")
    assert checkpoint.verify_checkpoint(DIRECTORY, CONFIG, "vllm:2") == "verdict"
    shards = seams.checkpoint.shards
    assert seams.asked == [
        ("read", DIRECTORY, target, CONFIG, ()),
        ("checker", CONFIG, dict(seed=0, backend="inprocess", threshold=None,
                                 measure_floor=False)),
        ("validate", shards, target, CONFIG, {"x": torch.float16, "y": torch.float32}),
        ("verdict", shards, target, target)]  # the source named as the destination


def test_what_verify_is_given_reaches_the_reading_and_the_checker(seams):
    roots = ("/cache/hub",)
    checkpoint.verify_checkpoint("rel/dir", CONFIG, "vllm:2", src="megatron:2", seed=3,
                                 backend="gloo", threshold=0.5, measure_floor=True,
                                 roots=roots)
    assert seams.asked[0] == ("read", "rel/dir", endpoint("vllm:2"), CONFIG, roots)
    assert seams.asked[1] == ("checker", CONFIG, dict(seed=3, backend="gloo", threshold=0.5,
                                                      measure_floor=True))
    assert seams.asked[-1][2:] == (endpoint("megatron:2"), endpoint("vllm:2"))


def test_what_no_checkpoint_could_pass_is_refused_before_a_file_is_read(seams):
    with pytest.raises(InvalidNumber, match=r"^seed must be an int in 0\.\.2\^63-1, got -1$"):
        checkpoint.verify_checkpoint(DIRECTORY, CONFIG, "vllm:2", seed=-1)
    with pytest.raises(UnsupportedLayout):
        checkpoint.verify_checkpoint(DIRECTORY, CONFIG, "vllm:3")
    with pytest.raises(UnsupportedLayout):  # an FP8 destination's rules are its cut's
        checkpoint.verify_checkpoint(DIRECTORY, CONFIG, "vllm:tp=3,fp8=block128")
    assert not seams.asked


@pytest.mark.parametrize("rank,name,file", [
    (1, "a", "rank1.safetensors"),  # the file that tensor came from
    (0, "missing", None),           # a tensor no file held: the directory
    (None, None, None)])            # no rank, no name: the directory
def test_a_wrong_dtype_is_a_checkpoint_error_naming_the_file(seams, rank, name, file):
    seams.refuse = WrongShardShape("rank 1 a: dtype bfloat16, declared float32", rank=rank,
                                   name=name)
    path = DIRECTORY / file if file else DIRECTORY
    with pytest.raises(CheckpointError) as raised:
        checkpoint.verify_checkpoint(DIRECTORY, CONFIG, "vllm:2")
    assert str(raised.value) == f"{path}: rank 1 a: dtype bfloat16, declared float32"
    assert raised.value.path == str(path) and raised.value.__cause__ is None
    assert raised.value.__suppress_context__
    assert seams.asked[-1][0] == "validate"  # never judged


def test_an_fp8_checkpoint_is_judged_by_the_fp8_check_on_the_seeds_weights_in_its_dtype(
        seams, monkeypatch):
    from weight_sync_bench.conventions.fp8 import FP8

    asked = []
    monkeypatch.setattr("weight_sync_bench.check.fp8.check_fp8_convert",
                        lambda *a, **k: asked.append((a, k)) or "fp8 verdict")
    written = [{"q": torch.zeros(2, dtype=FP8), "q_scale": torch.ones(1),
                "norm": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(1)}]
    seams.checkpoint = Checkpoint(DIRECTORY, written, [{}])
    at = "vllm:tp=2,fp8=block128"
    assert checkpoint.verify_checkpoint(DIRECTORY, CONFIG, at, src="megatron:2", seed=4,
                                        threshold=0.5) == "fp8 verdict"
    assert seams.asked == [("read", DIRECTORY, endpoint(at), CONFIG, ())]
    (args, kwargs), = asked
    assert args[0]([], 2) is written  # the files' tensors, as the converter's output
    assert args[1:4] == (CONFIG, endpoint("megatron:2"), endpoint(at))
    assert kwargs == dict(threshold=0.5, seed=4)
    # the weights of the seed, in the dtype of the first tensor neither FP8 nor a scale
    drawn = init_params(CONFIG, 4, dtype=torch.bfloat16)
    assert all(torch.equal(args[4][n], x) and args[4][n].dtype == torch.bfloat16
               for n, x in drawn.items())
    checkpoint.verify_checkpoint(DIRECTORY, CONFIG, at)  # its source: the unquantized cut
    assert asked[-1][0][2] == endpoint("vllm:2") and asked[-1][1] == dict(threshold=None,
                                                                           seed=0)

"""FP8 checkpoints on disk: ``wsb emit --convention hf:fp8=block128`` writes an HF FP8
directory (``quantization_config`` in ``config.json`` as the public FP8 checkpoints state
it, each weight beside its ``weight_scale_inv``), vLLM's per-rank files at
``vllm:tp=2,fp8=block128``; ``wsb verify`` reads either back against the reference
quantizer, weights and scales bit for bit. Each round trip has its twin: a scale changed in
the file, or a config.json that does not say FP8, fails naming it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.breadth import breadth
from tests.check.test_fp8_convert import TOY_FP8
from weight_sync_bench.check.checkpoint import verify_checkpoint
from weight_sync_bench.cli.main import main
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import write_checkpoint
from weight_sync_bench.conventions.fp8 import FP8, fp8_shards
from weight_sync_bench.errors import CheckpointError
from weight_sync_bench.model.config import init_params


# Each endpoint in one dtype by default, both dtypes on each endpoint in the long run: the
# kept cells reach each endpoint (HF and vLLM, block and per-tensor) and each dtype twice; a
# moved cell's equivalent is its endpoint's kept cell in the other dtype (the dtype changes
# only the unquantized tensors, which both dtypes' kept cells round-trip).
@pytest.mark.parametrize("where, dtype", breadth(
    [pytest.param(where, dtype, id=f"{where}-{name}")
     for where in ("hf:fp8=block128", "vllm:tp=2,fp8=block128", "hf:fp8=tensor",
                   "vllm:tp=2,fp8=tensor")
     for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))],
    keep={"hf:fp8=block128-fp32", "vllm:tp=2,fp8=block128-bf16", "hf:fp8=tensor-bf16",
          "vllm:tp=2,fp8=tensor-fp32"}, name=lambda p: p.id))
def test_an_fp8_checkpoint_round_trips_and_a_changed_scale_fails(tmp_path, where, dtype):
    """In the trainer's dtype (bf16 norms and embeddings beside float32 scales: the
    unquantized tensors' dtype is the weights'). A per-tensor checkpoint states no block
    size and names its scales ``weight_scale``."""
    at = endpoint(where)
    files = write_checkpoint(tmp_path / "c", fp8_shards(TOY_FP8, at, init_params(
        TOY_FP8, 3, dtype=dtype)), at, TOY_FP8)
    stated = json.loads((tmp_path / "c" / "config.json").read_text())
    block = where.endswith("block128")
    assert stated["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3",
                                             "quant_method": "fp8",
                                             **({"weight_block_size": [128, 128]} if block
                                                else {})}
    verdict = verify_checkpoint(tmp_path / "c", TOY_FP8, where, seed=3)
    assert verdict.passed, verdict
    # the twin: one scale doubled in its file
    scale = "o_proj.weight_scale_inv" if block else "o_proj.weight_scale"
    path = next(p for p in files if p.suffix == ".safetensors"
                and any(n.endswith(scale) for n in load_file(p)))
    tensors = load_file(path)
    name = next(n for n in tensors if n.endswith(scale))
    assert any(x.dtype == FP8 for x in tensors.values())
    tensors[name].view(-1)[0] *= 2
    save_file(tensors, path, metadata={"format": "pt"})
    failed = verify_checkpoint(tmp_path / "c", TOY_FP8, where, seed=3)
    assert not failed.passed and failed.first_mismatch == name


def test_a_config_that_does_not_say_fp8_is_named(tmp_path):
    at = endpoint("hf:fp8=block128")
    write_checkpoint(tmp_path / "c", fp8_shards(TOY_FP8, at, init_params(TOY_FP8, 0)), at,
                     TOY_FP8)
    path = tmp_path / "c" / "config.json"
    stated = json.loads(path.read_text())
    del stated["quantization_config"]
    path.write_text(json.dumps(stated))
    with pytest.raises(CheckpointError, match=r"config.json: hf:fp8=block128 expects "
                                              r"quantization_config .* states None"):
        verify_checkpoint(tmp_path / "c", TOY_FP8, "hf:fp8=block128")


def test_a_block_checkpoint_read_as_per_tensor_is_named(tmp_path):
    """The two schemes' configs differ only by ``weight_block_size``: a block checkpoint
    verified as ``fp8=tensor`` is refused naming the config, not read as per-tensor."""
    at = endpoint("hf:fp8=block128")
    write_checkpoint(tmp_path / "c", fp8_shards(TOY_FP8, at, init_params(TOY_FP8, 0)), at,
                     TOY_FP8)
    with pytest.raises(CheckpointError, match=r"config.json: hf:fp8=tensor expects "
                                              r"quantization_config .*weight_block_size"):
        verify_checkpoint(tmp_path / "c", TOY_FP8, "hf:fp8=tensor")


def test_wsb_emit_and_verify_an_hf_fp8_directory(tmp_path, capsys):
    """The built-in toy: at HF each tensor is its own part, so widths that are not whole
    blocks quantize with ceil grids (vLLM would refuse toy's merged qkv at any degree)."""
    d = tmp_path / "fp8"
    assert main(["emit", "--config", "toy", "--convention", "hf:fp8=block128", "--seed", "2",
                 "-q", str(d)]) == 0
    capsys.readouterr()
    assert main(["verify", "--convention", "hf:fp8=block128", "--seed", "2", str(d)]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main(["verify", "--convention", "hf:fp8=block128", "--seed", "3", str(d)]) == 1
    assert main(["emit", "--config", "toy", "--convention", "vllm:tp=2,fp8=block128",
                 "-q", str(tmp_path / "v")]) == 2
    assert "128-blocks" in capsys.readouterr().err
    # per tensor, vLLM holds toy at TP 2: nothing is cut but the weights
    assert main(["emit", "--config", "toy", "--convention", "vllm:tp=2,fp8=tensor", "-q",
                 str(tmp_path / "t")]) == 0
    assert main(["verify", "--convention", "vllm:tp=2,fp8=tensor", str(tmp_path / "t")]) == 0

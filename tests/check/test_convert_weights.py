"""``check_convert(..., weights=)``: a converter checked on real weights instead of a seed's:
a mapping of canonical parameters, or a Hugging Face directory (read with the file checks of
``wsb verify``). The converter gets those weights' cuts; bytes are compared in their dtype;
the threshold is measured on them (never a floor of other weights) and the verdict says so.
The twin of each failure is the correct converter passing on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench import check_convert, convert
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.checkpoint import checkpoint_geometry, write_checkpoint
from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import init_params

CONFIG = tiny(2, n_layers=2)


def real_weights():
    """Weights no seed draws: seed 5's, scaled, in bfloat16 (as a trainer saves them)."""
    return {n: (x * 1.5 + 0.01).to(torch.bfloat16) for n, x in init_params(CONFIG, 5).items()}


def megatron_to_vllm(shards, degree, *, config):
    return convert(shards, f"megatron:{len(shards)}", f"vllm:{degree}", config)


def gate_up_swapped(shards, degree, *, config):
    out = megatron_to_vllm(shards, degree, config=config)
    for rank in out:
        for name, x in rank.items():
            if name.endswith("gate_up_proj.weight"):
                rank[name] = torch.cat(x.chunk(2)[::-1])
    return out


def test_a_converter_is_checked_on_the_weights_given():
    weights = real_weights()
    seen = []

    def recording(shards, degree, *, config):
        seen.append(shards)
        return megatron_to_vllm(shards, degree, config=config)

    verdict = check_convert(recording, CONFIG, "megatron:2", "vllm:2", weights=weights)
    assert verdict.passed and verdict.dtype == "bf16", verdict
    declared = materialize(endpoint("megatron:2").pieces(CONFIG), weights)
    assert all(torch.equal(seen[0][r][n], x) for r in range(2) for n, x in declared[r].items())
    assert any(n.startswith("your weights: the threshold ") and "measured on them" in n
               for n in verdict.notes), verdict.notes
    failed = check_convert(gate_up_swapped, CONFIG, "megatron:2", "vllm:2", weights=weights)
    assert not failed.passed and failed.first_mismatch.endswith("gate_up_proj.weight")
    assert failed.threshold == verdict.threshold  # measured on the same weights


def test_the_weights_as_a_hugging_face_directory(tmp_path):
    weights = real_weights()
    hf = endpoint("hf")
    write_checkpoint(tmp_path / "w", materialize(hf.pieces(CONFIG), weights), hf, CONFIG)
    config = checkpoint_geometry(tmp_path / "w", hf)  # the geometry the directory states
    assert config.geometry() == CONFIG.geometry()
    verdict = check_convert(megatron_to_vllm, config, "megatron:2", "vllm:2",
                            weights=tmp_path / "w")
    assert verdict.passed and verdict.dtype == "bf16", verdict


def test_weights_that_are_not_the_geometrys_are_refused_naming_the_parameter():
    weights = real_weights()
    with pytest.raises(InvalidConfig, match=r"weights: tiny_kv2 has layers.1.qkv.weight, the "
                                            r"weights do not \(1 missing\)"):
        check_convert(megatron_to_vllm, CONFIG, "megatron:2", "vllm:2",
                      weights={n: x for n, x in weights.items() if n != "layers.1.qkv.weight"})
    with pytest.raises(InvalidConfig, match=r"weights: norm.weight is torch.int8, not a "
                                            r"floating-point parameter"):
        check_convert(megatron_to_vllm, CONFIG, "megatron:2", "vllm:2",
                      weights={**weights, "norm.weight": weights["norm.weight"].to(torch.int8)})
    with pytest.raises(InvalidConfig, match=r"weights: norm.weight is \[3\]"):
        check_convert(megatron_to_vllm, CONFIG, "megatron:2", "vllm:2",
                      weights={**weights, "norm.weight": torch.zeros(3, dtype=torch.bfloat16)})


def test_the_threshold_is_measured_on_the_weights_not_on_a_seeds():
    """Weights 2^8 times larger (exact in bfloat16) deviate more under the same layout: a
    threshold measured on them is larger; one read from a floor of the seed's weights would
    be the same for both."""
    weights = real_weights()
    large = {n: x * 256 for n, x in weights.items()}
    small = check_convert(megatron_to_vllm, CONFIG, "megatron:2", "vllm:2", weights=weights)
    big = check_convert(megatron_to_vllm, CONFIG, "megatron:2", "vllm:2", weights=large)
    assert small.passed and big.passed
    assert big.threshold > small.threshold, (big.threshold, small.threshold)


def test_two_one_rank_ends_are_judged_by_a_floor_of_a_sharded_forward():
    """hf -> vllm:1 computes exactly the reference's sums on any weights: the threshold is
    measured with the plain layout at 2 ranks beside them (a floor of zero sets none); the
    twin fails; dtype= beside weights= is refused (the weights' own dtype is the check's)."""
    weights = real_weights()

    def hf_to_vllm(shards, degree, *, config):
        return convert(shards, "hf", f"vllm:{degree}", config)

    verdict = check_convert(hf_to_vllm, CONFIG, "hf", "vllm:1", weights=weights)
    assert verdict.passed and verdict.max_abs_error == 0.0 and verdict.threshold > 0
    with pytest.raises(ValueError, match="drop dtype="):
        check_convert(hf_to_vllm, CONFIG, "hf", "vllm:1", weights=weights, dtype="bf16")


def test_a_converter_on_an_hf_directory_at_llama_3_8bs_shape_reduced(tmp_path):
    """Llama-3-8B's geometry reduced (its head counts, GQA grouping and head_dim ratio kept,
    widths / 16, one layer): bf16 weights written as an HF directory, the converter checked
    on them, and its twin failing."""
    from weight_sync_bench.model.config import shipped_hf_config

    config = shipped_hf_config("llama3_8b", shrink=16, n_layers=1, vocab=520)
    weights = {n: x.to(torch.bfloat16) for n, x in init_params(config, 3).items()}
    hf = endpoint("hf")
    write_checkpoint(tmp_path / "llama", materialize(hf.pieces(config), weights), hf, config)
    stated = checkpoint_geometry(tmp_path / "llama", hf)
    assert stated.geometry() == config.geometry() and stated.n_kv_heads == 8
    good = check_convert(megatron_to_vllm, stated, "megatron:4", "vllm:8",
                         weights=tmp_path / "llama")
    bad = check_convert(gate_up_swapped, stated, "megatron:4", "vllm:8",
                        weights=tmp_path / "llama")
    assert good.passed and good.dtype == "bf16" and not bad.passed, (good, bad)


def test_a_splitter_and_a_resharder_are_checked_on_the_weights_given(tmp_path):
    """``check_split`` / ``check_reshard`` with ``weights=`` (a mapping, or an HF directory):
    the user's function gets those weights (bf16), the threshold is measured on them and
    said; the twin of each, a function that swaps two ranks' o_proj columns, fails naming
    the tensor."""
    from weight_sync_bench import check_reshard, check_split
    from weight_sync_bench.layout.reshard import reshard, split
    from weight_sync_bench.model.plan import layout_for

    weights = real_weights()
    hf = endpoint("hf")
    write_checkpoint(tmp_path / "w", materialize(hf.pieces(CONFIG), weights), hf, CONFIG)
    layout = layout_for(CONFIG)
    got = []

    def splitter(full, degree):
        got.append(full)
        return split(full, layout, degree)

    def swapped(out):
        out[0]["layers.0.o_proj.weight"], out[1]["layers.0.o_proj.weight"] = (
            out[1]["layers.0.o_proj.weight"], out[0]["layers.0.o_proj.weight"])
        return out

    for source in (weights, tmp_path / "w"):
        verdict = check_split(splitter, CONFIG, 2, weights=source)
        assert verdict.passed and verdict.dtype == "bf16", verdict
        assert all(torch.equal(got[-1][n], x) for n, x in weights.items())
        assert any("measured on them" in n for n in verdict.notes), verdict.notes
        failed = check_split(lambda full, d: swapped(split(full, layout, d)), CONFIG, 2,
                             weights=source)
        assert not failed.passed and failed.first_mismatch == "layers.0.o_proj.weight"
        verdict = check_reshard(lambda shards, d: reshard(shards, layout, d), CONFIG, 1, 2,
                                weights=source)
        assert verdict.passed and verdict.dtype == "bf16", verdict
        failed = check_reshard(lambda shards, d: swapped(reshard(shards, layout, d)), CONFIG,
                               1, 2, weights=source)
        assert not failed.passed and failed.first_mismatch == "layers.0.o_proj.weight"
    with pytest.raises(ValueError, match="drop dtype="):
        check_split(splitter, CONFIG, 2, weights=weights, dtype="bf16")


def mixed_weights():
    """bf16 matrices beside fp32 norms, as trainers save them (an MoE model's router bias
    too)."""
    return {n: x.float() if n.endswith("norm.weight") else x for n, x in real_weights().items()}


def test_weights_of_several_dtypes_are_compared_each_in_its_own():
    """A converter that keeps every tensor's dtype passes, the verdict noting the dtypes;
    its twin, casting the fp32 norms to bf16 as a one-dtype sync would, is refused naming
    the tensor and both dtypes."""
    from weight_sync_bench.errors import WrongShardShape

    weights = mixed_weights()
    verdict = check_convert(megatron_to_vllm, CONFIG, "megatron:2", "vllm:2", weights=weights)
    assert verdict.passed and verdict.dtype == "bf16", verdict
    assert any("several dtypes: bfloat16, beside layers.0.attn_norm.weight float32" in n
               for n in verdict.notes), verdict.notes

    def all_bf16(shards, degree, *, config):
        return [{n: x.to(torch.bfloat16) for n, x in rank.items()}
                for rank in megatron_to_vllm(shards, degree, config=config)]

    with pytest.raises(WrongShardShape, match=r"input_layernorm.weight: dtype torch.bfloat16, "
                                              r"declared torch.float32"):
        check_convert(all_bf16, CONFIG, "megatron:2", "vllm:2", weights=weights)
    failed = check_convert(gate_up_swapped, CONFIG, "megatron:2", "vllm:2", weights=weights)
    assert not failed.passed and failed.first_mismatch.endswith("gate_up_proj.weight")

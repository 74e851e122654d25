"""Megatron endpoints with pipeline stages: what each rank stores (local layer indices, the
embedding first, the output layer last, ``model{v}.`` chunks), exact conversions to and from
them, ``check_convert`` over them, and the stage bugs of the field found and named."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.check.convert import check_convert
from weight_sync_bench.conventions import convert, endpoint, shards_for
from weight_sync_bench.errors import UnknownConvention, Uncovered, UnsupportedConvention
from weight_sync_bench.model.config import TOY, TOY_MOE, init_params

STAGED = ["megatron:tp=2,pp=2", "megatron:tp=2,pp=2,vpp=2", "megatron:pp=4",
          "megatron:tp=1,pp=2,pp_account=both", "megatron:tp=2,pp=3,pp_first=1,pp_last=1"]


def test_the_endpoint_grammar():
    at = endpoint("megatron:tp=2,pp=2,vpp=2")
    assert (at.degree, at.pp, at.vpp, at.world) == (2, 2, 2, 4)
    assert str(at) == "megatron:tp=2,pp=2,vpp=2"
    assert str(endpoint("megatron:pp=2")) == "megatron:tp=1,pp=2"
    assert str(endpoint("megatron:4")) == "megatron:4" and not endpoint("megatron:4").staged
    assert endpoint("megatron:tp=2,pp=2,ep=2").unstaged() == endpoint("megatron:tp=2,ep=2")
    with pytest.raises(UnknownConvention, match="pp must be a positive integer"):
        endpoint("megatron:tp=2,pp=0")
    with pytest.raises(UnknownConvention, match=r"vllm has no option 'pp'; known: tp, ep, etp,"):
        shards_for(TOY, "vllm:tp=2,pp=2")
    vllm = endpoint("vllm:2")  # built in Python: refused by the rules, before any tensor
    with pytest.raises(UnsupportedConvention, match=r"vllm: the layers needs pp=1"):
        shards_for(TOY, type(vllm)(vllm.convention, 2, pp=2))
    with pytest.raises(UnsupportedConvention, match="#1304"):
        shards_for(TOY, "megatron:tp=2,pp=3")


def test_each_stage_stores_its_layers_under_local_indices():
    shards = shards_for(TOY, "megatron:tp=2,pp=2,vpp=2")  # 4 layers: one per chunk
    full = init_params(TOY, 0)
    first, last = set(shards[0]), set(shards[2])
    assert "model0.embedding.word_embeddings.weight" in first
    assert not any("embedding" in n for n in last)
    assert {"model1.decoder.final_layernorm.weight", "model1.output_layer.weight"} <= last
    assert not any("output_layer" in n or "final_layernorm" in n for n in first)
    assert {n.split(".layers.")[1].split(".")[0] for n in first | last if ".layers." in n} == {"0"}
    # stage 1's chunk 1 holds global layer 3 (8 layers would interleave [0] [2] / [1] [3])
    norm = shards[2]["model1.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    assert torch.equal(norm, full["layers.3.attn_norm.weight"])
    assert shards[0].keys() == shards[1].keys() and shards[2].keys() == shards[3].keys()


def test_tied_embeddings_leave_a_copy_on_the_last_stage():
    tied = TOY.replace(tie_embeddings=True)
    shards = shards_for(tied, "megatron:tp=2,pp=2")
    for r in (0, 1):
        assert torch.equal(shards[r + 2]["output_layer.weight"],
                           shards[r]["embedding.word_embeddings.weight"])
    assert "output_layer.weight" not in shards_for(tied, "megatron:2")[0]


# TOY's layers and heads with a vocabulary of 1000 (Megatron pads it to 1024 at tp 2, where
# 32000 needs no padding): the stage maps depend on the layers, the TP maps on the heads;
# TOY's 32000-row embedding and head made these 2.8 s, this 0.4.
TOY_V1000 = TOY.replace(name="toy_v1000", vocab=1000)


@pytest.mark.parametrize("text", STAGED)
def test_conversions_to_and_from_stages_are_exact(text):
    config = TOY_V1000
    staged = shards_for(config, text)
    assert len(staged) == endpoint(text).world
    hf = convert(staged, text, "hf", config)[0]
    assert all(torch.equal(hf[n], x) for n, x in shards_for(config, "hf")[0].items())
    back = convert(shards_for(config, "vllm:4"), "vllm:4", text, config)
    assert all(back[r].keys() == staged[r].keys() for r in range(len(staged)))
    assert all(torch.equal(back[r][n], staged[r][n]) for r in range(len(staged)) for n in staged[r])


def test_experts_and_stages_together():
    text = "megatron:tp=2,pp=2,ep=2"
    staged = shards_for(TOY_MOE, text)
    assert endpoint(text).world == 8
    names = [n for n in staged[4] if "experts.linear_fc1" in n]
    assert names and all(n.startswith("decoder.layers.") for n in names)
    hf = convert(staged, text, "hf", TOY_MOE)[0]
    assert all(torch.equal(hf[n], x) for n, x in shards_for(TOY_MOE, "hf")[0].items())


@pytest.mark.parametrize(("src", "dst"), [("megatron:tp=2,pp=2", "vllm:4"),
                                          ("vllm:2", "megatron:tp=2,pp=2,vpp=2")])
def test_check_convert_over_stages_passes_a_correct_converter(src, dst, tolerance):
    verdict = check_convert(lambda shards, degree: convert(shards, src, dst, TOY), TOY, src, dst)
    assert verdict.passed, verdict


def local_as_global(shards, degree):
    """Megatron TP1 PP2 -> HF naming each stage's layers by their local index, stage 1
    written last: both stages publish layers 0-1 (NVIDIA-NeMo/RL PR #3259)."""
    out = {}
    full = convert(shards, "megatron:tp=1,pp=2", "hf", TOY)[0]
    for name, x in full.items():
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            local = name.replace(f".layers.{layer}.", f".layers.{layer % 2}.")
            if layer >= 2 or local not in out:
                out[local] = x
        else:
            out[name] = x
    return [out]


def test_two_stages_publishing_local_indices_is_a_coverage_failure(tolerance):
    with pytest.raises(Uncovered, match=r"coverage: never written on rank 0: layers 2, 3 "
                                        r"\(18 declared tensors\).*rank 0 layer 0 holds layer "
                                        r"2's, rank 0 layer 1 holds layer 3's") as caught:
        check_convert(local_as_global, TOY, "megatron:tp=1,pp=2", "hf")
    assert caught.value.missing[0][0] == "model.layers.2.input_layernorm.weight"


def last_stage_without(*names):
    """HF -> Megatron TP1 PP2 whose last stage never writes ``names``."""
    def convert_dropping(shards, degree):
        out = convert(shards, "hf", "megatron:tp=1,pp=2", TOY)
        for name in names:
            del out[1][name]
        return out
    return convert_dropping


@pytest.mark.parametrize("names, told", [
    (("output_layer.weight",), "output_layer.weight (1 declared tensor)"),
    (("output_layer.weight", "decoder.final_layernorm.weight"),
     "decoder.final_layernorm.weight, output_layer.weight (2 declared tensors)"),
])
def test_a_stage_missing_only_tensors_outside_the_layers_names_them_and_no_layer(tolerance,
                                                                               names, told):
    """The coverage line tells a missing tensor by its layer where it has one; a stage that
    lacks only the head (and the final norm) names them, with no empty "layer" beside."""
    with pytest.raises(Uncovered) as caught:
        check_convert(last_stage_without(*names), TOY, "hf", "megatron:tp=1,pp=2")
    assert (f"coverage: never written on rank 1: {told}; rank 1 is pipeline stage 1 of 2: "
            "global layers 2-3 as local 0-1") in str(caught.value)


def contiguous_chunks(shards, degree):
    """HF -> Megatron TP1 PP2 VPP2 placing each rank's chunks as if contiguous (rank 0:
    layers 0-1, rank 1: 2-3) instead of interleaved (Megatron-LM #1584)."""
    out = convert(shards, "hf", "megatron:tp=1,pp=2,vpp=2", TOY)
    flat = convert(shards, "hf", "megatron:1", TOY)[0]
    for p in range(2):
        for v in range(2):
            layer = 2 * p + v
            for name in [n for n in out[p] if n.startswith(f"model{v}.decoder.layers.0.")]:
                tail = name[len(f"model{v}.decoder.layers.0."):]
                out[p][name] = flat[f"decoder.layers.{layer}.{tail}"].clone()
    return out


def test_a_stage_offset_computed_as_if_contiguous_is_named(tolerance):
    verdict = check_convert(contiguous_chunks, TOY, "hf", "megatron:tp=1,pp=2,vpp=2")
    assert not verdict.passed
    text = "\n".join(verdict.diagnosis)
    # rank 1's chunk 0 is global layer 1 (interleaved); the bug put layer 2 there
    assert verdict.first_mismatch.startswith("model0.decoder.layers.0."), verdict
    assert "rank 1 model0.decoder.layers.0." in text and "holds layer 2's" in text
    assert "declared layer 1's" in text
    assert "rank 1 is pipeline stage 1 of 2: chunk 0 (model0.) global layer 1 as local 0; " \
           "chunk 1 (model1.) global layer 3 as local 0" in text
    assert verdict.named_mutation == "pp_chunks_contiguous"  # the catalogue knows the bug


def test_the_unstaged_forward_reads_every_stage(tolerance):
    # a wrong value on the last stage's output layer moves the logits: the forward reads it
    def wrong_head(shards, degree):
        out = convert(shards, "vllm:4", "megatron:tp=2,pp=2", TOY)
        out[3]["output_layer.weight"] = out[3]["output_layer.weight"] * 2
        return out

    verdict = check_convert(wrong_head, TOY, "vllm:4", "megatron:tp=2,pp=2")
    assert not verdict.passed and verdict.max_abs_error > 100 * verdict.threshold


def test_a_staged_checkpoint_is_written_and_verified(tmp_path, tolerance):
    from weight_sync_bench.check.checkpoint import verify_checkpoint
    from weight_sync_bench.conventions.checkpoint import write_checkpoint
    from weight_sync_bench.errors import CheckpointError

    text = "megatron:tp=2,pp=2,vpp=2"
    shards = shards_for(TOY, text)
    write_checkpoint(tmp_path / "ok", shards, endpoint(text), TOY)
    assert verify_checkpoint(tmp_path / "ok", TOY, text).passed
    # the twin: stage 1 written with its chunks exchanged (model0 <-> model1): same names,
    # another layer's weights in each
    wrong = [dict(r) for r in shards]
    for r in (2, 3):
        for name in [n for n in wrong[r] if n.startswith("model0.decoder.layers.")]:
            other = "model1." + name[len("model0."):]
            wrong[r][name], wrong[r][other] = shards[r][other], shards[r][name]
    write_checkpoint(tmp_path / "bad", wrong, endpoint(text), TOY)
    verdict = verify_checkpoint(tmp_path / "bad", TOY, text)
    assert not verdict.passed and "holds layer 3's" in "\n".join(verdict.diagnosis)
    with pytest.raises(CheckpointError, match="megatron:tp=2,pp=2 rank 0 is missing"):
        verify_checkpoint(tmp_path / "ok", TOY, "megatron:tp=2,pp=2")


def test_a_converter_gets_both_endpoints_and_each_ranks_coordinates(tolerance):
    from tests.fuzz.user_functions import convert_staged_megatron_to_hf
    from weight_sync_bench.conventions import rank_coordinates

    seen = {}

    def fn(shards, degree, *, config, source, target):
        seen["ends"] = (str(source), str(target))
        return convert_staged_megatron_to_hf(shards, degree, config=config, source=source)

    text = "megatron:tp=2,pp=2,vpp=2"
    verdict = check_convert(fn, TOY, text, "hf")
    assert verdict.passed, verdict
    assert seen["ends"] == (text, "hf:1")
    at = rank_coordinates(TOY, endpoint(text), 3)
    assert (at.pp, at.tp, at.dp, at.layers) == (1, 1, 0, ((1,), (3,)))
    with pytest.raises(ValueError, match="has ranks 0..3, not 4"):
        rank_coordinates(TOY, endpoint(text), 4)

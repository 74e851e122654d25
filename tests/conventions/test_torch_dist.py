"""Megatron-Core's ``torch_dist`` checkpoint as the weights a sync sends: PyTorch Distributed
Checkpoint underneath, read on CPU in this process. Megatron-LM d98e8a64 (core 0.20.0) keys:
a homogeneous decoder's layers stacked on a leading axis (``decoder.layers.<rest>``), the
experts on the next (``decoder.layers.mlp.experts.experts.linear_fc1.weight``), per-layer
keys where the layers differ, every tensor whole, the vocabulary padded as the saving run
padded it, the common state (``args``) a ``common_state`` object.

The reader is checked against a checkpoint built here by hand with DCP under those literal
keys (not through the harness's own key mapping), and against the harness's writer. Its
untrusted parts, DCP's ``.metadata`` pickle (torch's own reader runs ``pickle.load``), the
common state's pickle and the data files the metadata names, are refused before anything in
them runs or is opened outside the directory; each refusal has a twin that reads."""

from __future__ import annotations

import argparse
import io
import os
import pickle
import warnings

import pytest
import torch

from tests.check.test_convert_weights import gate_up_swapped, megatron_to_vllm
from tests.sync.conftest import tiny
from weight_sync_bench import check_convert
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.checkpoint import (
    DIST_COMMON,
    DIST_CONFIG,
    MEGATRON_TRACKER,
    dist_key,
    is_megatron_checkpoint,
    megatron_weights,
    read_weights,
    write_megatron_dist,
)
from weight_sync_bench.conventions.maps import gate_rows, up_rows
from weight_sync_bench.errors import CheckpointError, UnsafeFile
from weight_sync_bench.model.config import init_params

# 2 KV groups; vocab 200: Megatron pads it to 256 rows at TP 2, 128 x 2
DENSE = tiny(2, n_layers=3, vocab=200).replace(name="tiny_dist")
MOE = tiny(4, n_layers=2, n_experts=4, top_k=2, expert_ffn=16).replace(name="tiny_dist_moe")


def dcp_save(directory, state, args=None):
    """``state`` saved as Megatron saves a torch_dist iteration: DCP's files, the common
    state object, ``metadata.json``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    directory.mkdir(parents=True)
    common = io.BytesIO()
    torch.save([{"args": args or argparse.Namespace(), "iteration": 7}], common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**state, DIST_COMMON: common}, storage_writer=FileSystemWriter(str(directory)),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    (directory / DIST_CONFIG).write_text('{"sharded_backend": "torch_dist", '
                                         '"sharded_backend_version": 1}')
    return directory


def grouped_qkv(config, w):
    """Megatron's ``linear_qkv`` rows from the canonical ``[Q | K | V]``: per KV group g,
    its query heads, then k_g, then v_g (``get_query_key_value_tensors``), written out here
    head by head."""
    hd, per = config.head_dim, config.n_heads // config.n_kv_heads
    q, k, v = w.split([config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd])
    out = []
    for g in range(config.n_kv_heads):
        out += [q[(g * per + h) * hd:(g * per + h + 1) * hd] for h in range(per)]
        out += [k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    return torch.cat(out)


def by_hand(config, p, *, padded_rows):
    """The keys Megatron-Core d98e8a64 saves a dense TE-spec GPT under, built from the
    canonical parameters without the harness's key mapping."""
    layers = range(config.n_layers)

    def stack(f):
        return torch.stack([f(i) for i in layers])

    emb = torch.cat([p["tok_embeddings.weight"],
                     torch.full((padded_rows - config.vocab, config.d_model), 3.0)])
    state = {
        "embedding.word_embeddings.weight": emb,
        "decoder.final_layernorm.weight": p["norm.weight"],
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight":
            stack(lambda i: p[f"layers.{i}.attn_norm.weight"]),
        "decoder.layers.self_attention.linear_qkv.weight":
            stack(lambda i: grouped_qkv(config, p[f"layers.{i}.qkv.weight"])),
        "decoder.layers.self_attention.linear_proj.weight":
            stack(lambda i: p[f"layers.{i}.o_proj.weight"]),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight":
            stack(lambda i: p[f"layers.{i}.ffn_norm.weight"]),
        # apply_swiglu_sharded_factory: every TP rank's gate chunk, then every up chunk
        "decoder.layers.mlp.linear_fc1.weight": stack(lambda i: torch.cat([
            p[f"layers.{i}.gate_up.weight"][gate_rows(config)],
            p[f"layers.{i}.gate_up.weight"][up_rows(config)]])),
        "decoder.layers.mlp.linear_fc2.weight": stack(lambda i: p[f"layers.{i}.down.weight"]),
    }
    if not config.tie_embeddings:
        state["output_layer.weight"] = torch.cat([
            p["lm_head.weight"], torch.full((padded_rows - config.vocab, config.d_model), 3.0)])
    return state


def test_a_checkpoint_saved_under_megatrons_keys_reads_back_exactly(tmp_path):
    """Built here with DCP under the literal keys, the vocabulary padded to 256 rows (TP 2's
    128 x 2), the padding rows nonzero: the canonical parameters, bit for bit."""
    p = init_params(DENSE, 3)
    args = argparse.Namespace(num_layers=3, hidden_size=DENSE.d_model,
                              num_attention_heads=DENSE.n_heads, group_query_attention=True,
                              num_query_groups=2)
    step = dcp_save(tmp_path / "ckpt" / "iter_0000007", by_hand(DENSE, p, padded_rows=256),
                    args)
    (tmp_path / "ckpt" / MEGATRON_TRACKER).write_text("7\n")
    assert is_megatron_checkpoint(tmp_path / "ckpt") and is_megatron_checkpoint(step)
    for where in (tmp_path / "ckpt", step):
        back = megatron_weights(where, None, DENSE)
        assert set(back) == set(p)
        assert all(torch.equal(back[n], p[n]) for n in p), [n for n in p
                                                            if not torch.equal(back[n], p[n])]


def test_qkv_or_gate_up_in_another_order_reads_back_different(tmp_path):
    """The twin: a checkpoint whose qkv rows are plain [Q | K | V] (not grouped), or whose fc1
    is [up; gate], does not read back to the parameters."""
    p = init_params(DENSE, 3)
    state = by_hand(DENSE, p, padded_rows=256)
    plain = dict(state, **{"decoder.layers.self_attention.linear_qkv.weight": torch.stack(
        [p[f"layers.{i}.qkv.weight"] for i in range(3)])})
    back = megatron_weights(dcp_save(tmp_path / "a", plain), None, DENSE)
    assert not torch.equal(back["layers.0.qkv.weight"], p["layers.0.qkv.weight"])
    fc1 = state["decoder.layers.mlp.linear_fc1.weight"]
    swapped = dict(state, **{"decoder.layers.mlp.linear_fc1.weight":
                             torch.cat(fc1.chunk(2, dim=1)[::-1], dim=1)})
    back = megatron_weights(dcp_save(tmp_path / "b", swapped), None, DENSE)
    assert not torch.equal(back["layers.0.gate_up.weight"], p["layers.0.gate_up.weight"])
    assert torch.equal(back["layers.0.qkv.weight"], p["layers.0.qkv.weight"])


def test_experts_stack_on_the_axis_after_the_layers():
    """TEGroupedMLP's weight{j} and SequentialMLP's local_experts.{j} name the same key,
    indexed (layer, global expert); per-layer keys drop the layer axis."""
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert dist_key("decoder.layers.1.mlp.experts.linear_fc1.weight3") == (fc1, (1, 3))
    assert dist_key("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == (
        fc1, (1, 3))
    assert dist_key("decoder.layers.1.mlp.experts.linear_fc2.weight0", stacked=False) == (
        "decoder.layers.1.mlp.experts.experts.linear_fc2.weight", (0,))
    assert dist_key("decoder.layers.2.self_attention.linear_qkv.weight") == (
        "decoder.layers.self_attention.linear_qkv.weight", (2,))
    assert dist_key("embedding.word_embeddings.weight") == ("embedding.word_embeddings.weight", ())


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize(("config", "where", "dtype"), [
    (DENSE, "megatron:2", torch.float32), (DENSE, "megatron:tp=1,vocab=unpadded", torch.bfloat16),
    (MOE, "megatron:tp=2,ep=2", torch.float32), (MOE, "megatron:tp=1,pp=2,ep=2", torch.bfloat16),
], ids=lambda v: getattr(v, "name", str(v)))
def test_the_writer_and_the_reader_agree_byte_for_byte(tmp_path, config, where, dtype, stacked):
    p = {n: x.to(dtype) for n, x in init_params(config, 1).items()}
    step = write_megatron_dist(tmp_path / "ckpt", p, endpoint(where), config, iteration=3,
                               stacked=stacked)
    assert step.name == "iter_0000003"
    assert sorted(x.name for x in step.iterdir()) == [".metadata", "__0_0.distcp", DIST_CONFIG]
    back = read_weights(tmp_path / "ckpt", config)  # found to be Megatron's, its format too
    assert all(back[n].dtype == dtype and torch.equal(back[n], p[n]) for n in p)


def test_a_legacy_checkpoint_of_other_sizes_is_named_by_its_args(tmp_path):
    """The legacy format's ``args`` are checked too, before any shape: the field, both
    values; the twin, the same checkpoint read with its own geometry."""
    from weight_sync_bench.conventions.checkpoint import write_megatron_legacy

    at = endpoint("megatron:2")
    write_megatron_legacy(tmp_path / "l", materialize(at.pieces(DENSE), init_params(DENSE, 0)),
                          at, DENSE)
    assert megatron_weights(tmp_path / "l", None, DENSE)
    other = DENSE.replace(ffn=DENSE.ffn * 2)
    with pytest.raises(CheckpointError, match=r"args say ffn_hidden_size=\d+, the config "):
        megatron_weights(tmp_path / "l", None, other)


def test_a_missing_key_a_wrong_shape_or_other_args_are_named(tmp_path):
    p = init_params(DENSE, 3)
    state = by_hand(DENSE, p, padded_rows=256)
    del state["decoder.layers.mlp.linear_fc2.weight"]
    with pytest.raises(CheckpointError, match=r"no decoder\.layers\.mlp\.linear_fc2\.weight"):
        megatron_weights(dcp_save(tmp_path / "a", state), None, DENSE)
    state = by_hand(DENSE, p, padded_rows=256)
    state["decoder.layers.mlp.linear_fc2.weight"] = state[
        "decoder.layers.mlp.linear_fc2.weight"][:2]  # two layers saved of three
    with pytest.raises(CheckpointError, match=r"linear_fc2\.weight has shape \[2, .*on leading "
                                              r"axes of \[3\] \(the layers"):
        megatron_weights(dcp_save(tmp_path / "b", state), None, DENSE)
    state = by_hand(DENSE, p, padded_rows=256)
    args = argparse.Namespace(num_layers=3, hidden_size=DENSE.d_model * 2)
    with pytest.raises(CheckpointError, match=r"args say hidden_size=\d+, the config checked"):
        megatron_weights(dcp_save(tmp_path / "c", state, args), None, DENSE)
    state["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"][:10]
    with pytest.raises(CheckpointError, match=r"word_embeddings\.weight has shape \[10, "):
        megatron_weights(dcp_save(tmp_path / "d", state), None, DENSE)


class Evil:
    """What a hostile pickle calls: it would write a marker file."""

    def __reduce__(self):
        return (os.system, (f"touch {os.environ['WSB_MARKER']}",))


def test_a_hostile_metadata_pickle_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("WSB_MARKER", str(marker))
    step = write_megatron_dist(tmp_path / "ckpt", init_params(DENSE, 0), endpoint("megatron"),
                               DENSE)
    assert megatron_weights(tmp_path / "ckpt", None, DENSE)  # the twin: it reads
    (step / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused.*GLOBAL posix\.system"):
        megatron_weights(tmp_path / "ckpt", None, DENSE)
    assert not marker.exists()


def test_a_hostile_common_state_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("WSB_MARKER", str(marker))
    state = by_hand(DENSE, init_params(DENSE, 3), padded_rows=256)
    step = dcp_save(tmp_path / "ckpt", state, argparse.Namespace(evil=Evil()))
    with pytest.raises(CheckpointError, match=r"common_state/shard_0_1: refused.*posix\.system"):
        megatron_weights(step, None, DENSE)
    assert not marker.exists()


def test_data_files_outside_the_directory_are_refused_before_opening(tmp_path):
    step = write_megatron_dist(tmp_path / "ckpt", init_params(DENSE, 0), endpoint("megatron"),
                               DENSE)
    metadata = (step / ".metadata").read_bytes()
    (step / ".metadata").write_bytes(metadata.replace(b"__0_0.distcp", b"../00.distcp"))
    with pytest.raises(CheckpointError, match=r"names the data file '\.\./00\.distcp'"):
        megatron_weights(step, None, DENSE)
    (step / ".metadata").write_bytes(metadata)
    outside = tmp_path / "elsewhere.distcp"
    (step / "__0_0.distcp").rename(outside)
    (step / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(UnsafeFile, match=r"__0_0\.distcp: a symlink .*outside"):
        megatron_weights(step, None, DENSE)
    (step / "__0_0.distcp").unlink()
    outside.rename(step / "__0_0.distcp")
    assert megatron_weights(step, None, DENSE)  # the twin: the same files in place read


def test_a_truncated_data_file_is_named(tmp_path):
    step = write_megatron_dist(tmp_path / "ckpt", init_params(DENSE, 0), endpoint("megatron"),
                               DENSE)
    data = step / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"not a readable torch_dist checkpoint"):
        megatron_weights(step, None, DENSE)


def test_a_converter_is_checked_on_a_torch_dist_and_a_legacy_checkpoint(tmp_path):
    """The issue's "done when": a user's converter checked on the trainer's own checkpoint in
    both of Megatron's formats (bf16 weights no seed draws), the wrong one failing on each."""
    from weight_sync_bench.conventions.checkpoint import write_megatron_legacy

    weights = {n: (x * 1.5 + 0.01).to(torch.bfloat16) for n, x in init_params(DENSE, 5).items()}
    write_megatron_dist(tmp_path / "dist", weights, endpoint("megatron:2"), DENSE)
    at = endpoint("megatron:tp=2,pp=3")
    write_megatron_legacy(tmp_path / "legacy", materialize(at.pieces(DENSE), weights), at, DENSE)
    for directory in ("dist", "legacy"):
        verdict = check_convert(megatron_to_vllm, DENSE, "megatron:2", "vllm:2",
                                weights=tmp_path / directory)
        assert verdict.passed and verdict.dtype == "bf16", (directory, verdict)
        failed = check_convert(gate_up_swapped, DENSE, "megatron:2", "vllm:2",
                               weights=tmp_path / directory)
        assert not failed.passed and failed.first_mismatch.endswith("gate_up_proj.weight")


def _huge(md):
    """A tensor's size made 2^40 rows, one chunk covering it (so only the size is wrong)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    md.size = torch.Size([2 ** 40, md.size[1]])
    md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=md.size)]


def _metadata_edit(step, edit):
    """``.metadata`` rewritten after ``edit(metadata)``: a crafted index of the same data."""
    from weight_sync_bench.conventions.checkpoint import _DIST_GLOBALS  # noqa: F401 (allowlist)

    metadata = pickle.loads((step / ".metadata").read_bytes())
    edit(metadata)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_crafted_index_is_refused_before_it_is_read(tmp_path):
    """Chunks that do not tile a tensor (DCP fills only those it is told of: a gap would be
    the allocator's memory), a size no model has (an allocation of terabytes), data stored
    through a decompressing transform (unbounded), another sharded backend: each refused
    naming the key or the file. The twin: the untouched checkpoint reads."""
    from dataclasses import replace as dc_replace

    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    emb = "embedding.word_embeddings.weight"
    cases = [
        (lambda m: setattr(m.state_dict_metadata[qkv], "chunks", []),
         r"linear_qkv.weight: its chunks hold 0 elements of"),
        (lambda m: setattr(m.state_dict_metadata[qkv], "chunks",
                           m.state_dict_metadata[qkv].chunks * 2),
         r"linear_qkv.weight: its chunks hold \d+ elements of|overlap"),
        (lambda m: _huge(m.state_dict_metadata[emb]),
         r"word_embeddings.weight has shape \[1099511627776"),
        (lambda m: [m.storage_data.__setitem__(k, dc_replace(v, transform_descriptors=["zstd"]))
                    for k, v in list(m.storage_data.items())],
         r"stored through \['zstd'\]"),
    ]
    for i, (edit, refusal) in enumerate(cases):
        step = write_megatron_dist(tmp_path / f"c{i}", init_params(DENSE, 0),
                                   endpoint("megatron"), DENSE)
        assert megatron_weights(step, None, DENSE)  # the twin
        _metadata_edit(step, edit)
        with pytest.raises(CheckpointError, match=refusal):
            megatron_weights(step, None, DENSE)
    step = write_megatron_dist(tmp_path / "zarr", init_params(DENSE, 0), endpoint("megatron"),
                               DENSE)
    (step / DIST_CONFIG).write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    with pytest.raises(CheckpointError, match=r"sharded_backend 'zarr'"):
        megatron_weights(step, None, DENSE)

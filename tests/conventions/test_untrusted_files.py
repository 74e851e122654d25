"""A checkpoint's files stay in its directory (``files.inside``, ``read_checkpoint``): an
index entry naming ``../`` or an absolute path, a symlink out, a FIFO or a device are refused
before anything is opened, and the Hugging Face cache's own layout (snapshot files linked into
the repository's ``blobs/``) still reads.

Each refusal is tested with a file that would verify if it were read (the checkpoint's own
shard, moved or linked out of the directory), and each has its twin: the same file inside
the directory, or under an allowed root, verifies. Which files were opened is recorded at
safetensors' ``load_file``, so "refused before opening" is observed, not assumed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from weight_sync_bench import CheckpointError, ModelConfig, shards_for, verify_checkpoint
from weight_sync_bench.check.convert import measure_threshold
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import HF_INDEX, write_checkpoint
from weight_sync_bench.errors import UnsafeFile
from weight_sync_bench.files import inside, read_bounded

SMALL = ModelConfig(name="small", vocab=128, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, ffn=48)
RANK1 = "model-rank-1-part-0.safetensors"


@pytest.fixture(scope="module")
def threshold() -> float:
    return measure_threshold(SMALL, ["hf", "vllm:2"], seeds=range(2))


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The paths safetensors' ``load_file`` is asked to open, in order."""
    seen: list[str] = []
    real = safetensors.torch.load_file

    def recording(path, *args, **kwargs):
        seen.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", recording)
    return seen


def emit(directory: Path, where: str) -> Path:
    ep = endpoint(where)
    write_checkpoint(directory, shards_for(SMALL, ep.convention, ep.degree), ep, SMALL)
    return directory


def index_of(directory: Path) -> dict:
    return json.loads((directory / HF_INDEX).read_text())


def remap(directory: Path, old: str, new: str) -> None:
    """Point every index entry of the file ``old`` at ``new``."""
    index = index_of(directory)
    index["weight_map"] = {t: (new if f == old else f) for t, f in index["weight_map"].items()}
    (directory / HF_INDEX).write_text(json.dumps(index))


def first_shard(directory: Path) -> str:
    return sorted(set(index_of(directory)["weight_map"].values()))[0]


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_an_index_entry_outside_the_directory_is_refused_before_it_is_opened(
        tmp_path, threshold, opened, how):
    ckpt = emit(tmp_path / "ckpt", "hf")
    shard = first_shard(ckpt)
    outside = tmp_path / "outside.safetensors"
    shutil.move(ckpt / shard, outside)  # the real shard: it would verify if read
    remap(ckpt, shard, "../outside.safetensors" if how == "relative" else str(outside))
    with pytest.raises(UnsafeFile, match="outside") as info:
        verify_checkpoint(ckpt, SMALL, "hf", threshold=threshold)
    assert info.value.entry in ("../outside.safetensors", str(outside))
    assert isinstance(info.value, CheckpointError)  # exit 2 on the command line
    assert opened == []  # refused before any shard was opened, not after


def test_twin_the_same_shard_inside_the_directory_verifies(tmp_path, threshold, opened):
    ckpt = emit(tmp_path / "ckpt", "hf")
    shard = first_shard(ckpt)
    shutil.move(ckpt / shard, ckpt / "renamed.safetensors")
    remap(ckpt, shard, "renamed.safetensors")
    assert verify_checkpoint(ckpt, SMALL, "hf", threshold=threshold).passed
    assert any(p.endswith("renamed.safetensors") for p in opened)


def test_an_index_entry_naming_a_system_file_is_refused_unopened(tmp_path, threshold, opened):
    ckpt = emit(tmp_path / "ckpt", "hf")
    remap(ckpt, first_shard(ckpt), "/etc/passwd")
    with pytest.raises(UnsafeFile, match="/etc/passwd"):
        verify_checkpoint(ckpt, SMALL, "hf", threshold=threshold)
    assert opened == []


def test_a_symlink_out_of_the_directory_is_refused_and_allowed_under_an_allowed_root(
        tmp_path, threshold, opened):
    ckpt = emit(tmp_path / "ckpt", "vllm:2")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(ckpt / RANK1, elsewhere / RANK1)
    (ckpt / RANK1).symlink_to(elsewhere / RANK1)
    with pytest.raises(UnsafeFile, match=f"symlink.*{elsewhere}") as info:
        verify_checkpoint(ckpt, SMALL, "vllm:2", threshold=threshold)
    assert info.value.path == str(ckpt / RANK1)
    assert not any(RANK1 in p for p in opened)
    # twin: the caller names the other root; the same link then verifies
    assert verify_checkpoint(ckpt, SMALL, "vllm:2", threshold=threshold,
                             roots=[elsewhere]).passed


def test_twin_a_symlink_within_the_directory_verifies(tmp_path, threshold):
    ckpt = emit(tmp_path / "ckpt", "vllm:2")
    (ckpt / "store").mkdir()
    shutil.move(ckpt / RANK1, ckpt / "store" / "rank1.bin")
    (ckpt / RANK1).symlink_to(Path("store") / "rank1.bin")
    assert verify_checkpoint(ckpt, SMALL, "vllm:2", threshold=threshold).passed


def hf_cache(tmp_path: Path, repo: str = "models--org--small") -> Path:
    """An HF checkpoint laid out as huggingface_hub's cache stores it: every file of
    ``snapshots/<rev>/`` a relative symlink to ``../../blobs/<hash>``."""
    snapshot = tmp_path / repo / "snapshots" / "0123abcd"
    emit(snapshot, "hf")
    blobs = tmp_path / repo / "blobs"
    blobs.mkdir()
    for i, path in enumerate(sorted(snapshot.iterdir())):
        blob = blobs / f"{i:040x}"
        shutil.move(path, blob)
        path.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


def test_the_hugging_face_cache_layout_verifies(tmp_path, threshold):
    snapshot = hf_cache(tmp_path)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    assert verify_checkpoint(snapshot, SMALL, "hf", threshold=threshold).passed


def test_a_cache_snapshot_linking_into_another_repositorys_blobs_is_refused(tmp_path, threshold):
    snapshot = hf_cache(tmp_path)
    other = hf_cache(tmp_path, "models--other--repo")
    shard = first_shard(snapshot)
    (snapshot / shard).unlink()  # now a link to the other repository's identical shard
    (snapshot / shard).symlink_to(os.path.realpath(other / shard))
    with pytest.raises(UnsafeFile, match="Hugging Face cache blobs"):
        verify_checkpoint(snapshot, SMALL, "hf", threshold=threshold)


@pytest.mark.parametrize("entry", ["absolute", "dotdot"])
def test_an_entry_is_a_relative_name_even_where_it_resolves_inside(tmp_path, threshold, entry):
    ckpt = emit(tmp_path / "ckpt", "hf")
    shard = first_shard(ckpt)
    remap(ckpt, shard, str(ckpt / shard) if entry == "absolute" else f"../ckpt/{shard}")
    with pytest.raises(UnsafeFile, match="a checkpoint's files are relative names"):
        verify_checkpoint(ckpt, SMALL, "hf", threshold=threshold)


UNBLOCK = """
import os, sys, time
while True:
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # ENXIO: no reader has opened it
    time.sleep(0.05)
"""


def unblock(path: Path) -> subprocess.Popen:
    """A process that opens the FIFO ``path`` for writing whenever a reader waits on it, so a
    reader blocked in its open (in native code that holds the GIL, beyond any signal or
    thread of this process) gets end-of-file and the test fails instead of hanging."""
    return subprocess.Popen([sys.executable, "-c", UNBLOCK, str(path)])


@pytest.mark.parametrize("which", ["index entry", "rank file", "config.json"])
def test_a_fifo_is_refused_not_opened(tmp_path, threshold, which):
    if which == "rank file":
        ckpt, where = emit(tmp_path / "ckpt", "vllm:2"), "vllm:2"
        (ckpt / RANK1).unlink()
        os.mkfifo(ckpt / RANK1)
    elif which == "index entry":
        ckpt, where = emit(tmp_path / "ckpt", "hf"), "hf"
        shard = first_shard(ckpt)
        os.mkfifo(ckpt / "pipe.safetensors")
        remap(ckpt, shard, "pipe.safetensors")
        (ckpt / shard).unlink()
    else:
        ckpt, where = emit(tmp_path / "ckpt", "hf"), "hf"
        (ckpt / "config.json").unlink()
        os.mkfifo(ckpt / "config.json")
    fifo = next(p for p in ckpt.iterdir() if p.is_fifo())
    writer = unblock(fifo)
    try:
        with pytest.raises(UnsafeFile, match=r"a FIFO \(named pipe\), not a regular file"):
            verify_checkpoint(ckpt, SMALL, where, threshold=threshold)
    finally:
        writer.kill()
        writer.wait()


def test_a_directory_where_a_file_is_named_is_refused(tmp_path, threshold):
    ckpt = emit(tmp_path / "ckpt", "hf")
    shard = first_shard(ckpt)
    (ckpt / shard).unlink()
    (ckpt / shard).mkdir()
    with pytest.raises(UnsafeFile, match="a directory, not a regular file"):
        verify_checkpoint(ckpt, SMALL, "hf", threshold=threshold)


def test_reads_are_bounded(tmp_path, monkeypatch, threshold):
    ckpt = emit(tmp_path / "ckpt", "hf")
    size = (ckpt / HF_INDEX).stat().st_size
    monkeypatch.setattr("weight_sync_bench.files.JSON_LIMIT", size - 1)
    with pytest.raises(UnsafeFile, match=f"larger than {size - 1:,} bytes"):
        verify_checkpoint(ckpt, SMALL, "hf", threshold=threshold)
    monkeypatch.setattr("weight_sync_bench.files.JSON_LIMIT", size)  # twin: at the limit
    assert verify_checkpoint(ckpt, SMALL, "hf", threshold=threshold).passed


def test_read_bounded_does_not_follow_a_last_symlink_and_inside_resolves_it(tmp_path):
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to("real.json")
    with pytest.raises(UnsafeFile, match="a symlink, read through its resolved path only"):
        read_bounded(tmp_path / "link.json")
    assert read_bounded(inside(tmp_path, "link.json")) == b"{}"
    with pytest.raises(FileNotFoundError):
        inside(tmp_path, "absent.json")


def test_a_refused_pickle_is_named_without_advice_to_disable_weights_only(tmp_path, threshold):
    ckpt = emit(tmp_path / "ckpt", "meta:2")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    shard = torch.load(ckpt / "consolidated.00.pth", weights_only=True)
    torch.save({**shard, "payload": Payload()}, ckpt / "consolidated.00.pth")
    with pytest.raises(CheckpointError, match="refused, its pickle holds more than tensors") \
            as info:
        verify_checkpoint(ckpt, SMALL, "meta:2", threshold=threshold)
    assert "GLOBAL" in str(info.value)  # what the pickle calls is named
    assert "weights_only" not in str(info.value) and "likely succeed" not in str(info.value)
    assert "can still be loaded" not in str(info.value) and "trust" not in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("declared", [2**62, 100_000_001])
def test_a_safetensors_header_over_safetensors_limit_is_refused_unread(tmp_path, threshold,
                                                                       declared):
    """safetensors refuses a header longer than its MAX_HEADER_SIZE (100,000,000 bytes)
    before reading it; the file here is sparse, so a reader that did read it would take
    seconds and the memory, not fail at once."""
    ckpt = emit(tmp_path / "ckpt", "vllm:2")
    with open(ckpt / RANK1, "r+b") as f:
        f.write(declared.to_bytes(8, "little"))
        f.truncate(8 + 100_000_001)
    with pytest.raises(CheckpointError, match="header too large"):
        verify_checkpoint(ckpt, SMALL, "vllm:2", threshold=threshold)

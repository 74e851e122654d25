"""``write_checkpoint`` (``wsb emit``) is atomic as a whole: a write that fails (disk full,
read-only file system) or is killed leaves no checkpoint directory and no partial file, the
error names the path, and a rerun works; every file gets the mode the umask gives."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
from safetensors import SafetensorError

from weight_sync_bench import CheckpointError, ModelConfig, shards_for
from weight_sync_bench.cli.main import main
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import write_checkpoint

SMALL = ModelConfig(name="small", vocab=128, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, ffn=48)


def write(directory: Path, where: str = "hf") -> list[Path]:
    ep = endpoint(where)
    return write_checkpoint(directory, shards_for(SMALL, ep.convention, ep.degree), ep, SMALL)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def disk_full_on_third_file(monkeypatch):
    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:
            real(tensors, path, *args, **kwargs)  # a partial file is on disk when it fails
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                                  "StorageFull, message: \"No space left on device\" })")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def read_only_at_rename(monkeypatch):
    def rename(src, dst):
        raise OSError(errno.EROFS, "Read-only file system", str(dst))

    monkeypatch.setattr(os, "rename", rename)


def no_permission_for_the_stage(monkeypatch):
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if ".wsb-partial-" in self.name:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)


@pytest.mark.parametrize("fault", [disk_full_on_third_file, read_only_at_rename,
                                   no_permission_for_the_stage], ids=lambda f: f.__name__)
def test_a_failed_write_leaves_nothing_and_a_rerun_works(tmp_path, monkeypatch, fault):
    out = tmp_path / "parent" / "ckpt"
    with monkeypatch.context() as patch:
        fault(patch)
        with pytest.raises(CheckpointError, match=f"{out}: not written, .*nothing was left "
                                                  "behind") as info:
            write(out)
    assert info.value.path == str(out)
    assert not out.exists()
    assert leftovers(out.parent) == []  # no stage, no partial file
    files = write(out)  # the twin: the same write, with the fault gone
    assert [p.parent for p in files] == [out] * len(files) and len(files) > 3
    assert leftovers(out.parent) == ["ckpt"]


def test_a_failed_emit_is_exit_2_naming_the_path(tmp_path, monkeypatch, capsys):
    disk_full_on_third_file(monkeypatch)
    out = tmp_path / "ckpt"
    assert main(["emit", "--convention", "hf", "--config", "toy", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"wsb emit: {out}: not written, ") and "No space left" in err
    assert "Traceback" not in err and not out.exists()


def test_an_existing_empty_directory_is_filled(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    write(out, "vllm:2")
    assert leftovers(out) == ["config.json", "model-rank-0-part-0.safetensors",
                              "model-rank-1-part-0.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
@pytest.mark.parametrize("where", ["hf", "meta:2", "vllm:2"])
def test_every_file_gets_the_mode_the_umask_gives(tmp_path, umask, where):
    old = os.umask(umask)
    try:
        files = write(tmp_path / "ckpt", where)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o777 & ~umask


KILLED = """
import sys, time
from pathlib import Path
import safetensors.torch
from weight_sync_bench import ModelConfig, shards_for
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.checkpoint import write_checkpoint

real = safetensors.torch.save_file
def save_file(tensors, path, *args, **kwargs):
    real(tensors, path, *args, **kwargs)
    Path(sys.argv[2]).write_text(path)  # a file is half-way into the checkpoint: kill me
    time.sleep(600)
safetensors.torch.save_file = save_file
config = ModelConfig(name="small", vocab=128, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                     head_dim=8, ffn=48)
ep = endpoint("vllm:2")
write_checkpoint(sys.argv[1], shards_for(config, ep.convention, ep.degree), ep, config)
"""


def test_a_writer_killed_mid_write_leaves_no_checkpoint_and_the_rerun_cleans_up(tmp_path):
    out, ready = tmp_path / "ckpt", tmp_path / "ready"
    writer = subprocess.Popen([sys.executable, "-c", KILLED, str(out), str(ready)])
    try:
        deadline = time.monotonic() + 120  # a hang detector only
        while not ready.exists():
            assert writer.poll() is None, "the writer ended before it was killed"
            assert time.monotonic() < deadline, "the writer never wrote a file"
            time.sleep(0.05)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert not out.exists()  # killed before the rename: no checkpoint, not a partial one
    stale = [p for p in tmp_path.iterdir() if ".wsb-partial-" in p.name]
    assert len(stale) == 1 and any(stale[0].iterdir())  # what SIGKILL left, in the stage
    write(out, "vllm:2")  # the rerun works and removes the killed writer's stage
    assert leftovers(tmp_path) == ["ckpt", "ready"]

"""``files``: the checks before an untrusted file is opened, called directly and read whole.
``test_untrusted_files.py`` drives them through ``wsb verify``; here each refusal's text and
the ``path`` and ``entry`` it carries are pinned, with a twin that is allowed: what the
kinds of file are called, which directory is the Hugging Face cache, and how much of a file
is read at most."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from weight_sync_bench import files
from weight_sync_bench.errors import UnsafeFile
from weight_sync_bench.files import hf_cache_blobs, inside, kind, read_bounded


@pytest.mark.parametrize("mode, what", [
    (stat.S_IFREG | 0o644, "a regular file"), (stat.S_IFDIR, "a directory"),
    (stat.S_IFIFO, "a FIFO (named pipe)"), (stat.S_IFSOCK, "a socket"),
    (stat.S_IFCHR, "a character device"), (stat.S_IFBLK, "a block device"),
    (stat.S_IFLNK, "not a regular file")])  # none of the above (os.stat never says it)
def test_each_kind_of_file_is_named(mode, what):
    assert kind(mode) == what


def refused(directory, entry, **kwargs) -> UnsafeFile:
    with pytest.raises(UnsafeFile) as err:
        inside(directory, entry, **kwargs)
    return err.value


def test_an_entry_naming_a_file_outside_is_refused_with_what_names_it(tmp_path):
    err = refused(tmp_path, "../x.safetensors")
    assert str(err) == (f"{tmp_path}/../x.safetensors: the entry '../x.safetensors' names a "
                        f"file outside {tmp_path}; a checkpoint's files are relative names "
                        "inside its directory")
    assert (err.path, err.entry) == (f"{tmp_path}/../x.safetensors", "../x.safetensors")
    err = refused(tmp_path, "/etc/passwd", what="the index maps 3 tensors to it")
    assert str(err) == ("/etc/passwd: the entry '/etc/passwd' (the index maps 3 tensors to it) "
                        f"names a file outside {tmp_path}; a checkpoint's files are relative "
                        "names inside its directory")
    assert (err.path, err.entry) == ("/etc/passwd", "/etc/passwd")


def test_a_symlink_out_is_refused_naming_where_it_leads_and_the_flag(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "out.bin").write_bytes(b"x")
    (tmp_path / "d" / "link.bin").symlink_to(tmp_path / "out.bin")
    err = refused(tmp_path / "d", "link.bin")
    assert str(err) == (f"{tmp_path}/d/link.bin: a symlink to {tmp_path}/out.bin, outside "
                        f"{tmp_path}/d; refused before opening it (wsb verify --allow-root DIR "
                        "allows another root)")
    assert (err.path, err.entry) == (f"{tmp_path}/d/link.bin", "link.bin")
    # the twin: allowed under a root the caller names
    assert inside(tmp_path / "d", "link.bin", roots=[tmp_path]) == tmp_path / "out.bin"


def cache(tmp_path, parent="snapshots"):
    """A Hugging Face cache repository: ``<repo>/<parent>/rev`` beside ``<repo>/blobs``."""
    repo = tmp_path / "models--x"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "etag").write_bytes(b"x")
    snapshot = repo / parent / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/etag")
    return repo, snapshot


def test_a_cache_snapshot_reads_its_blobs_and_its_refusal_says_so(tmp_path):
    repo, snapshot = cache(tmp_path)
    assert hf_cache_blobs(snapshot) == repo / "blobs"
    assert inside(snapshot, "model.safetensors") == repo / "blobs" / "etag"
    (tmp_path / "out.bin").write_bytes(b"x")
    (snapshot / "other.bin").symlink_to(tmp_path / "out.bin")
    err = refused(snapshot, "other.bin")
    assert str(err) == (f"{snapshot}/other.bin: a symlink to {tmp_path}/out.bin, outside "
                        f"{snapshot} or its Hugging Face cache blobs/; refused before opening "
                        "it (wsb verify --allow-root DIR allows another root)")


def test_only_a_snapshot_under_snapshots_beside_blobs_is_a_cache(tmp_path):
    # blobs/ beside a directory not called snapshots: not a cache, its links are refused
    repo, other = cache(tmp_path, parent="revisions")
    assert hf_cache_blobs(other) is None
    assert "outside" in str(refused(other, "model.safetensors"))
    # snapshots/ without blobs/ beside it: not a cache either
    (tmp_path / "bare" / "snapshots" / "rev").mkdir(parents=True)
    assert hf_cache_blobs(tmp_path / "bare" / "snapshots" / "rev") is None


def test_what_is_not_a_regular_file_is_refused_by_its_kind(tmp_path):
    (tmp_path / "sub").mkdir()
    err = refused(tmp_path, "sub", what="named by the index")
    assert str(err) == (f"{tmp_path}/sub: a directory, not a regular file (named by the "
                        "index); refused before opening it")
    assert (err.path, err.entry) == (f"{tmp_path}/sub", "sub")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        assert str(refused(tmp_path, "sock")) == (
            f"{tmp_path}/sock: a socket, not a regular file; refused before opening it")
    (tmp_path / "f.bin").write_bytes(b"x")
    assert inside(tmp_path, "f.bin") == tmp_path / "f.bin"  # the twin


def unsafe_read(path, *args, **kwargs) -> UnsafeFile:
    with pytest.raises(UnsafeFile) as err:
        read_bounded(path, *args, **kwargs)
    return err.value


def test_read_bounded_names_the_path_it_was_given_or_the_one_shown(tmp_path):
    (tmp_path / "sub").mkdir()
    err = unsafe_read(tmp_path / "sub")
    assert (str(err), err.path) == (f"{tmp_path}/sub: a directory, not a regular file",
                                    f"{tmp_path}/sub")
    err = unsafe_read(tmp_path / "sub", shown="config.json")
    assert (str(err), err.path) == ("config.json: a directory, not a regular file",
                                    "config.json")
    (tmp_path / "f.bin").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "f.bin")
    err = unsafe_read(tmp_path / "link")
    assert (str(err), err.path) == (f"{tmp_path}/link: a symlink, read through its resolved "
                                    "path only", f"{tmp_path}/link")


def test_read_bounded_reads_the_limit_and_one_byte_more_at_most(tmp_path, monkeypatch):
    asked = []
    fdopen = os.fdopen

    class Recording:
        """The opened file, each ``read``'s size recorded."""

        def __init__(self, fd, mode):
            self.file = fdopen(fd, mode)

        def read(self, n=-1):
            asked.append(n)
            return self.file.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(files.os, "fdopen", Recording)
    (tmp_path / "f.bin").write_bytes(b"x" * 12)
    assert read_bounded(tmp_path / "f.bin", 12) == b"x" * 12
    err = unsafe_read(tmp_path / "f.bin", 11)
    assert (str(err), err.path) == (f"{tmp_path}/f.bin: larger than 11 bytes (1.04904e-05 MiB), "
                                    "the most the harness reads of such a file",
                                    f"{tmp_path}/f.bin")
    assert asked == [13, 12]


def test_read_bounded_defaults_to_the_json_limit_read_when_called(tmp_path, monkeypatch):
    (tmp_path / "f.json").write_bytes(b"{}   ")
    assert read_bounded(tmp_path / "f.json") == b"{}   "
    monkeypatch.setattr(files, "JSON_LIMIT", 4)
    assert str(unsafe_read(tmp_path / "f.json")).startswith(
        f"{tmp_path}/f.json: larger than 4 bytes")

"""Files a user hands the harness, opened only after they are checked.

A checkpoint directory names its files: by pattern (``model-rank-{r}-part-{p}.safetensors``)
or by an index (``model.safetensors.index.json``'s ``weight_map``), and any entry may be a
symlink. ``inside`` resolves one entry and allows it only when it is a regular file within
the directory after every symlink is resolved, so an index cannot point the reader at
``../outside.safetensors``, ``/etc/passwd`` or a FIFO (whose open would block in native
code with no timeout). Two roots besides the directory are allowed:

- the Hugging Face cache's layout: a directory ``<repo>/snapshots/<revision>`` whose files
  are symlinks into the same repository's ``<repo>/blobs/`` (``huggingface_hub``'s
  ``file_download._create_symlink`` links ``snapshots/<rev>/<name>`` to
  ``../../blobs/<etag>``; huggingface_hub 0.26, ``_snapshot_download``), and only those;
- any directory the caller names (``wsb verify --allow-root DIR``).

Checked before opening: the entry is a relative name (no absolute path, no ``..`` that
leaves the directory), it resolves into an allowed root, and ``stat`` says it is a regular
file (not a directory, FIFO, socket or device). ``read_bounded`` then opens the resolved
path non-blocking and not following a last symlink, re-checks the open descriptor with
``fstat`` and reads at most its limit, so a file swapped for a FIFO after the check fails
the same way rather than blocking. Readers that open a path themselves (safetensors,
``torch.load``) get the checked, resolved path; a swap between the check and their open is
the one window left, and only the directory's owner can make it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from weight_sync_bench.errors import UnsafeFile

# A JSON file a checkpoint or a user names (config.json, params.json, an index, a corpus
# entry) is read whole; this bounds the read. The largest such file in the field is the index
# of a large MoE: DeepSeek-V3 stores about 94k tensors (58 MoE layers x 256 experts x 3
# weights and their 3 FP8 scales, plus the rest), at about 100 bytes an index entry: under
# 10 MB. 64 MiB leaves six times that.
JSON_LIMIT = 64 * 2**20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind(mode: int) -> str:
    """What a ``st_mode`` is, in words (``a FIFO``, ``a regular file``)."""
    return next((what for test, what in _KINDS if test(mode)), "a regular file"
                if stat.S_ISREG(mode) else "not a regular file")


def hf_cache_blobs(directory: Path) -> Path | None:
    """The ``blobs/`` of the Hugging Face cache repository ``directory`` is a snapshot of
    (``<repo>/snapshots/<revision>``), None where it is not one."""
    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" and (resolved.parent.parent / "blobs").is_dir():
        return resolved.parent.parent / "blobs"
    return None


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def inside(directory: str | Path, entry: str | Path, *, roots: Sequence[str | Path] = (),
           what: str = "") -> Path:
    """The resolved path of ``entry``, a file ``directory`` names, once it is known to be a
    regular file inside ``directory`` (or inside its Hugging Face cache ``blobs/``, or inside
    one of ``roots``) after every symlink is resolved. Raises ``UnsafeFile`` naming the entry,
    where it leads and why, before anything is opened; ``FileNotFoundError`` where it does
    not exist (the caller names what is missing). ``what`` says who names the entry
    (``"model.safetensors.index.json maps 3 tensors to it"``)."""
    base = Path(directory)
    named = Path(entry)
    by = f" ({what})" if what else ""
    shown = base / named
    if named.is_absolute() or os.path.normpath(named).split(os.sep)[0] == os.pardir:
        raise UnsafeFile(f"{shown}: the entry {str(entry)!r}{by} names a file outside "
                         f"{base}; a checkpoint's files are relative names inside its directory",
                         path=str(shown), entry=str(entry))
    target = Path(os.path.realpath(shown))
    allowed = [base.resolve(), *(Path(r).resolve() for r in roots)]
    blobs = hf_cache_blobs(base)
    if blobs is not None:
        allowed.append(blobs)
    if not any(_within(target, root) for root in allowed):
        extra = " or its Hugging Face cache blobs/" if blobs is not None else ""
        raise UnsafeFile(f"{shown}: a symlink{by} to {target}, outside {base.resolve()}{extra}; "
                         "refused before opening it (wsb verify --allow-root DIR allows another "
                         "root)", path=str(shown), entry=str(entry))
    mode = os.stat(target).st_mode  # FileNotFoundError: the caller's "missing"
    if not stat.S_ISREG(mode):
        raise UnsafeFile(f"{shown}: {kind(mode)}, not a regular file{by}; refused before "
                         "opening it", path=str(shown), entry=str(entry))
    return target


def read_bounded(path: str | Path, limit: int | None = None, *,
                 shown: str | Path | None = None) -> bytes:
    """The bytes of the regular file ``path`` (already resolved: a symlink as its last
    component is refused), at most ``limit`` of them (default ``JSON_LIMIT``, read when
    called): a longer file, or anything that is not
    a regular file once opened (a FIFO swapped in after a check), raises ``UnsafeFile``
    naming ``shown`` (default ``path``). Opened non-blocking, so a FIFO never blocks the
    open; ``FileNotFoundError`` where there is no file."""
    label = str(shown if shown is not None else path)
    limit = JSON_LIMIT if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{label}: a symlink, read through its resolved path only",
                             path=label) from None
        raise  # permissions, a directory in the way: the caller names it
    mode = os.fstat(fd).st_mode  # of what was opened, before Python's file refuses a directory
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeFile(f"{label}: {kind(mode)}, not a regular file", path=label)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(f"{label}: larger than {limit:,} bytes ({limit / 2**20:g} MiB), the "
                         "most the harness reads of such a file", path=label)
    return data

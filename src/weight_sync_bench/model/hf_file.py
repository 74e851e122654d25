"""Reading a Hugging Face ``config.json`` that a user names, bounded: the file is untrusted.

``read_hf_config(path)`` returns the parsed JSON object or raises ``InvalidConfig`` naming
the path and what is wrong with it. It reads only a regular file (a directory, a FIFO, a
device or a socket is refused from ``stat`` before anything is opened, and the file is
opened non-blocking and checked again, so a FIFO swapped in between never blocks), at most
``MAX_HF_CONFIG_BYTES`` of it (``--hf-config /dev/zero`` is refused, never read for
gigabytes), as strict UTF-8 and as strict JSON (``NaN`` and ``Infinity`` are not JSON).
What its fields mean is ``ModelConfig.from_hf_config``'s to check.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from weight_sync_bench.errors import InvalidConfig

# A real config.json is under a few KB (the shipped ones: 571-964 bytes, Llama-3-8B's 654);
# 16 MiB is thousands of times that and still reads in milliseconds.
MAX_HF_CONFIG_BYTES = 16 * 2**20  # 16,777,216

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    """What a non-regular file is, in words (``"a directory"``)."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (only finite numbers are)")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in the config.json at ``path``, read bounded (module docstring);
    ``InvalidConfig`` naming the path otherwise: no such file, not a regular file, not
    readable, over ``MAX_HF_CONFIG_BYTES``, empty, not UTF-8 (the byte offset named), not
    JSON (the line and column), or JSON that is not an object."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InvalidConfig(f"{path}: no such HF config.json") from None
    except OSError as exc:
        raise InvalidConfig(f"{path}: cannot read the HF config.json ({exc.strerror})") from None
    except ValueError as exc:  # a NUL byte in the path
        raise InvalidConfig(f"{path!r}: not a path ({exc})") from None
    if not stat.S_ISREG(mode):
        raise InvalidConfig(f"{path}: {_kind(mode)}, not a regular file (an HF config.json)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidConfig(f"{path}: cannot read the HF config.json ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode  # what was opened, should the path have changed
        if not stat.S_ISREG(mode):
            raise InvalidConfig(f"{path}: {_kind(mode)}, not a regular file (an HF "
                                "config.json)")
        try:
            raw = f.read(MAX_HF_CONFIG_BYTES + 1)
        except OSError as exc:
            raise InvalidConfig(f"{path}: cannot read the HF config.json "
                                f"({exc.strerror})") from None
    if len(raw) > MAX_HF_CONFIG_BYTES:
        raise InvalidConfig(f"{path}: larger than {MAX_HF_CONFIG_BYTES:,} bytes (16 MiB), "
                            "the most read of an HF config.json (a real one is a few KB)")
    if not raw.strip():
        raise InvalidConfig(f"{path}: empty, not an HF config.json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfig(f"{path}: not UTF-8 (byte {exc.start}: "
                            f"{raw[exc.start:exc.start + 1]!r})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise InvalidConfig(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise InvalidConfig(f"{path}: JSON nested too deeply to be an HF "
                            "config.json") from None
    except ValueError as exc:  # NaN / Infinity, an integer of more than 4300 digits
        raise InvalidConfig(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidConfig(f"{path}: an HF config is a JSON object, got "
                            f"{type(data).__name__}")
    return data

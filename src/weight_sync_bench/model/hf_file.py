"""Reading a Hugging Face ``config.json`` that a user names, bounded: the file is untrusted.

``read_hf_config(path)`` returns the parsed JSON object or raises ``InvalidConfig`` naming
the path and what is wrong with it. It reads only a regular file (``files.read_bounded``:
opened non-blocking, so a FIFO never blocks, and a directory, FIFO, device or socket is
refused by ``fstat`` before anything is read), at most
``MAX_HF_CONFIG_BYTES`` of it (``--hf-config /dev/zero`` is refused, never read for
gigabytes), as strict UTF-8 and as strict JSON (``NaN`` and ``Infinity`` are not JSON).
What its fields mean is ``ModelConfig.from_hf_config``'s to check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from weight_sync_bench.errors import InvalidConfig, UnsafeFile
from weight_sync_bench.files import read_bounded

# A real config.json is under a few KB (the shipped ones: 571-964 bytes, Llama-3-8B's 654);
# 16 MiB is thousands of times that and still reads in milliseconds.
MAX_HF_CONFIG_BYTES = 16 * 2**20  # 16,777,216


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (only finite numbers are)")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in the config.json at ``path``, read bounded (module docstring,
    ``files.read_bounded``; a symlink is read through its resolved path); ``InvalidConfig``
    naming the path otherwise: no such file, not a regular file, not readable, over
    ``MAX_HF_CONFIG_BYTES``, empty, not UTF-8 (the byte offset named), not JSON (the line
    and column), or JSON that is not an object."""
    path = Path(path)
    try:
        raw = read_bounded(os.path.realpath(path), MAX_HF_CONFIG_BYTES, shown=path)
    except FileNotFoundError:
        raise InvalidConfig(f"{path}: no such HF config.json") from None
    except UnsafeFile as exc:
        raise InvalidConfig(f"{exc} (an HF config.json)") from None
    except OSError as exc:
        raise InvalidConfig(f"{path}: cannot read the HF config.json ({exc.strerror})") from None
    except ValueError as exc:  # a NUL byte in the path
        raise InvalidConfig(f"{str(path)!r}: not a path ({exc})") from None
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

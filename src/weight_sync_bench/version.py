"""``wsb --version``'s line, made without importing torch: the installed distributions'
metadata (``importlib.metadata``), not the modules themselves."""

from __future__ import annotations

import importlib.metadata
import platform


def _installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def version() -> str:
    """``wsb 0.1.0 (torch 2.13.0+cpu, python 3.11.7, x86_64)``."""
    return (f"wsb {_installed('weight-sync-bench')} (torch {_installed('torch')}, python "
            f"{platform.python_version()}, {platform.machine()})")

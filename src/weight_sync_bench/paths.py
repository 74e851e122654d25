"""Where the harness's files live: one place decides, for every module.

Each location is an environment variable, else the checkout this package was imported from
(the editable install, the one ``make`` sets up). In a non-editable install there is no
checkout: ``checkout()`` raises ``MissingArtifacts`` naming the variable to set, rather than
pointing into site-packages where nothing was ever measured.

- ``WSB_TOLERANCE_DIR``: the measured floors (``tolerance/*.json``) thresholds are read from;
- ``WSB_CORPUS_DIR``: saved counterexamples (``corpus/*.json``);
- ``WSB_FUZZ_DIR``: the fuzz runner's example database and campaign outputs (else
  ``.hypothesis/`` in the current directory);
- a user's own function's counterexamples: ``WSB_CORPUS_DIR``, else ``wsb-corpus/`` in the
  current directory (``user_corpus_dir``);
- floors a user measures (``--measure-floor``, ``wsb floor geometry``): ``WSB_FLOOR_CACHE``,
  else ``$XDG_CACHE_HOME/weight-sync-bench``, else ``~/.cache/weight-sync-bench``
  (``floor_cache_dir``): never the checkout's tracked ``tolerance/``.
"""

from __future__ import annotations

import os
from pathlib import Path

from weight_sync_bench.errors import MissingArtifacts

_PACKAGE = Path(__file__).resolve().parent


def checkout() -> Path | None:
    """The repository root this package runs from, or None outside a checkout (``src/``
    layout: the package's grandparent holds ``pyproject.toml``)."""
    root = _PACKAGE.parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "src").is_dir() else None


def _located(variable: str, folder: str) -> Path:
    env = os.environ.get(variable)
    if env:
        return Path(env)
    root = checkout()
    if root is None:
        raise MissingArtifacts(f"no checkout of weight-sync-bench around {_PACKAGE} to find "
                               f"{folder}/ in: set {variable} to the directory that holds it")
    return root / folder


def tolerance_dir() -> Path:
    """$WSB_TOLERANCE_DIR, else the checkout's ``tolerance/``."""
    return _located("WSB_TOLERANCE_DIR", "tolerance")


def corpus_dir() -> Path:
    """$WSB_CORPUS_DIR, else the checkout's ``corpus/``."""
    return _located("WSB_CORPUS_DIR", "corpus")


def fuzz_dir() -> Path:
    """$WSB_FUZZ_DIR, else ``.hypothesis/`` in the current directory, where Hypothesis keeps
    its own database: a run's summaries land in the project it was started from, never in
    this package's checkout (the same folder when run from there, git-ignored)."""
    env = os.environ.get("WSB_FUZZ_DIR")
    return Path(env) if env else Path.cwd() / ".hypothesis"


def user_corpus_dir() -> Path:
    """$WSB_CORPUS_DIR, else ``wsb-corpus/`` in the current directory: the counterexamples of
    a user's own function (``wsb fuzz --converter``, ``testing.*_property``) are theirs, kept
    in their project, not in the harness's ``corpus/``."""
    env = os.environ.get("WSB_CORPUS_DIR")
    return Path(env) if env else Path.cwd() / USER_CORPUS


USER_CORPUS = "wsb-corpus"


FLOOR_CACHE = "weight-sync-bench"


def floor_cache_dir() -> Path:
    """$WSB_FLOOR_CACHE, else ``weight-sync-bench/`` under ``$XDG_CACHE_HOME`` (else
    ``~/.cache``, the XDG base directory default): where a floor a user measures is kept,
    read after the committed ones (``tolerance.rules.floor_for``)."""
    env = os.environ.get("WSB_FLOOR_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / FLOOR_CACHE

"""``wsb --help`` and ``wsb SUB [SUB] --help`` without importing torch.

Building the command line's parsers imports torch (their choices come from the model, the
conventions and the mutations), seconds before any help is printed. So every help text is
kept, as the parsers print it at a fixed width, in ``help.json`` beside this module (outside
``cli``, whose package imports the command line), and a request that is help and nothing
else (subcommand words, then ``-h`` or ``--help``) is answered from it (``answer``). Anything else goes to the parsers, which print the same
text for the same request (``tests/cli/test_help.py`` compares every one of them with the
parsers' own; ``python -m weight_sync_bench.help --write`` writes the file anew after
a change to the command line).

This module imports nothing of the harness at import time: ``answer`` reads a JSON file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HELP_FILE = Path(__file__).with_name("help.json")
WIDTH = 100  # the columns every kept text is formatted at
HELP_FLAGS = ("-h", "--help")


def request(argv: Sequence[str]) -> str | None:
    """The subcommand path (``""``, ``"check"``, ``"floor phase"``) when ``argv`` asks for
    help and nothing else: words without a dash, then one help flag, last; else None."""
    if not argv or argv[-1] not in HELP_FLAGS:
        return None
    words = list(argv[:-1])
    if any(w.startswith("-") or not w.replace("-", "").isalnum() for w in words):
        return None
    return " ".join(words)


def answer(argv: Sequence[str]) -> str | None:
    """The kept help text for ``argv``, or None (not a plain help request, or one the file
    does not hold: the parsers then answer, and say what is wrong)."""
    path = request(argv)
    if path is None or not HELP_FILE.is_file():
        return None
    texts = json.loads(HELP_FILE.read_text(encoding="utf-8"))
    return texts.get(path)


def _walk(parser: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    import argparse

    yield " ".join(path), parser
    for action in parser._actions:  # argparse keeps its subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def texts() -> dict[str, str]:
    """Every parser's help, as ``wsb ... --help`` prints it at ``WIDTH`` columns (imports
    the command line, and so torch)."""
    from weight_sync_bench.cli.main import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        return {path: parser.format_help() for path, parser in _walk(build_parser())}
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


# The documentation's command reference, in a checkout (src/weight_sync_bench/../../docs)
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"


def reference(kept: dict[str, str]) -> str:
    """The documentation's command reference: every command's help, as ``--help`` prints it."""
    lines = ["# Command reference", "",
             "Every command's `--help`, as it prints it (written from the parsers by `python -m "
             "weight_sync_bench.help --write`; `tests/cli/test_help.py` keeps it equal to "
             "them). The exit codes and the JSON records: [exit codes and JSON]"
             "(exit-codes.md).", ""]
    for path in sorted(kept, key=lambda p: (p != "", p)):
        lines += [f"## wsb {path}".rstrip(), "", "```text", kept[path].rstrip("\n"), "```", ""]
    return "\n".join(lines)


def write(path: Path = HELP_FILE) -> None:
    """Write ``texts()`` to ``path``, atomically, and in a checkout the command reference
    of the documentation (``REFERENCE``)."""
    from weight_sync_bench.tolerance.artifacts import write_artifact

    kept = texts()
    write_artifact(kept, path)
    if REFERENCE.parent.is_dir():
        tmp = REFERENCE.with_name(f".{REFERENCE.name}.tmp")
        tmp.write_text(reference(kept), encoding="utf-8")
        os.replace(tmp, REFERENCE)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m weight_sync_bench.help --write")
    write()

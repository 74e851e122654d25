"""``help``'s pieces called directly: which requests are plain help, the answer where the
kept file is missing, the environment ``texts`` leaves as it found it, the command
reference's text, and what ``write`` writes where. ``test_help.py`` compares the kept texts
with the parsers'; here the code that keeps them is pinned."""

from __future__ import annotations

import importlib
import json
import os

import pytest

from weight_sync_bench import help as H


@pytest.mark.parametrize("argv, path", [
    (["--help"], ""), (["train-check", "-h"], "train-check"),
    (["floor", "phase", "--help"], "floor phase"),
    (["check", "--layers", "--help"], None), (["check"], None), ([], None),
    (["check", "--help", "x"], None), (["che/ck", "--help"], None)])
def test_a_plain_help_request_is_words_then_one_flag(argv, path):
    assert H.request(argv) == path


def test_without_the_kept_file_the_parsers_answer(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "HELP_FILE", tmp_path / "none.json")
    assert H.answer(["check", "--help"]) is None
    (tmp_path / "help.json").write_text(json.dumps({"check": "usage: wsb check\n"}))
    monkeypatch.setattr(H, "HELP_FILE", tmp_path / "help.json")  # the twin
    assert H.answer(["check", "--help"]) == "usage: wsb check\n"
    assert H.answer(["check", "--layers", "1"]) is None


@pytest.mark.parametrize("columns", [None, "77"])
def test_texts_formats_at_100_columns_and_leaves_columns_as_it_was(monkeypatch, columns):
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    seen = []

    class Parser:
        _actions = ()

        def format_help(self):
            seen.append(os.environ.get("COLUMNS"))
            return "usage: wsb\n"

    cli_main = importlib.import_module("weight_sync_bench.cli.main")  # the module, not main()
    monkeypatch.setattr(cli_main, "build_parser", lambda: Parser())
    assert H.texts() == {"": "usage: wsb\n"} and seen == ["100"]
    assert os.environ.get("COLUMNS") == columns


# newlines trimmed at the end, nothing else: a trailing space and a trailing X stay
KEPT = {"check": "usage: wsb check \n\n", "": "usage: wsb\n", "floor phase": "usage: fX\n"}
REFERENCE = """# Command reference

Every command's `--help`, as it prints it (written from the parsers by `python -m \
weight_sync_bench.help --write`; `tests/cli/test_help.py` keeps it equal to them). The exit \
codes and the JSON records: [exit codes and JSON](exit-codes.md).

## wsb

```text
usage: wsb
```

## wsb check

```text
usage: wsb check<SP>
```

## wsb floor phase

```text
usage: fX
```
""".replace("<SP>", " ")  # the trailing space kept, written so that no editor strips it


def test_the_reference_lists_wsb_first_then_each_command_in_order():
    assert H.reference(KEPT) == REFERENCE


def test_write_keeps_the_texts_and_the_reference_in_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "texts", lambda: KEPT)
    (tmp_path / "docs").mkdir()
    monkeypatch.setattr(H, "REFERENCE", tmp_path / "docs" / "cli.md")
    H.write(tmp_path / "help.json")
    assert json.loads((tmp_path / "help.json").read_text()) == KEPT
    assert (tmp_path / "docs" / "cli.md").read_text(encoding="utf-8") == REFERENCE
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["cli.md"]  # no .tmp left
    # outside a checkout (no docs/): the texts only
    monkeypatch.setattr(H, "REFERENCE", tmp_path / "none" / "cli.md")
    H.write(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == KEPT
    assert not (tmp_path / "none").exists()


def test_walk_yields_every_parser_by_its_subcommand_path():
    import argparse

    top = argparse.ArgumentParser(prog="wsb")
    subs = top.add_subparsers()
    floor = subs.add_parser("floor")
    subs.add_parser("check")
    inner = floor.add_subparsers()
    phase = inner.add_parser("phase")
    walked = list(H._walk(top))
    assert [path for path, _ in walked] == ["", "floor", "floor phase", "check"]
    assert walked[0][1] is top and walked[1][1] is floor and walked[2][1] is phase

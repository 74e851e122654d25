"""``wsb [SUB] --help`` answered without torch (``help``): the kept texts are every
parser's own help, word for word (a change to the command line that is not written to
``help.json`` fails here, naming the command that writes it); a plain help request is
answered from them in a process that never imports torch; anything else goes to the
parsers."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest

from weight_sync_bench.__main__ import main
from weight_sync_bench.help import HELP_FILE, REFERENCE, answer, reference, request, texts


def test_the_kept_help_is_every_parsers_own():
    kept = json.loads(HELP_FILE.read_text(encoding="utf-8"))
    live = texts()
    stale = sorted(k for k in set(kept) | set(live) if kept.get(k) != live.get(k))
    assert not stale, (f"cli/help.json is stale for {stale[:5]}: run `python -m "
                       "weight_sync_bench.help --write`")
    assert {"", "check", "fuzz", "floor phase", "verify", "sync"} <= set(kept)


def test_the_documentations_command_reference_is_the_kept_help():
    kept = json.loads(HELP_FILE.read_text(encoding="utf-8"))
    assert REFERENCE.read_text(encoding="utf-8") == reference(kept), (
        "docs/reference/cli.md is stale: run `python -m weight_sync_bench.help --write`")
    assert "## wsb floor phase" in REFERENCE.read_text(encoding="utf-8")


@pytest.mark.parametrize(("argv", "path"), [
    (["--help"], ""), (["-h"], ""), (["check", "--help"], "check"),
    (["floor", "phase", "-h"], "floor phase"), (["check"], None), ([], None),
    (["check", "--src", "2", "--help"], None), (["--help", "check"], None),
    (["check", "-q", "--help"], None), (["../x", "--help"], None)])
def test_only_a_plain_help_request_is_answered_from_the_kept_texts(argv, path):
    assert request(argv) == path


def test_an_unknown_subcommand_goes_to_the_parsers(capsys):
    assert answer(["nonesuch", "--help"]) is None
    with pytest.raises(SystemExit) as info:
        main(["nonesuch", "--help"])
    assert info.value.code == 2 and "invalid choice: 'nonesuch'" in capsys.readouterr().err


def test_help_is_answered_without_importing_torch():
    """In a fresh process: the text the parsers print, and torch never imported."""
    code = ("import sys; from weight_sync_bench.__main__ import main; "
            "rc = main(['floor', 'phase', '--help']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "40"}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == texts()["floor phase"]  # at the kept width, whatever the terminal's
    assert "fp8_block128" in run.stdout


def test_the_layout_legend_explains_every_placement_a_table_prints():
    """Every placement short name ``wsb layout`` prints, over a dense and an MoE geometry
    and a Megatron endpoint whose experts spread past its TP group, is in the legend."""
    from weight_sync_bench.cli.main import LAYOUT_LEGEND, PLACEMENT_LEGEND
    from weight_sync_bench.conventions import endpoint, render
    from weight_sync_bench.model.config import TOY, TOY_KV4, TOY_MOE
    from weight_sync_bench.model.plan import layout_for

    tables = [layout_for(c).render([1, 2, 4, 8]) for c in (TOY, TOY_KV4, TOY_MOE)]
    at = endpoint("megatron:tp=2,ep=4")
    tables.append(render(TOY_MOE, at.convention, [at]))
    tables.append(render(TOY_KV4, endpoint("vllm:8").convention, [8]))
    printed = set()
    for table in tables:
        printed |= set(re.findall(r"\b([A-Z]{1,2})\(", table))
        printed |= {"R"} if re.search(r"\sR(\s|$)", table, re.M) else set()
        printed |= {"@tp"} if "@tp" in table else set()
    assert {"R", "S", "HP", "HR", "FP", "EX", "@tp"} <= printed, printed
    for name in printed:
        assert (f" {name}(" in PLACEMENT_LEGEND or f"{name} replicated" in PLACEMENT_LEGEND
                or name in PLACEMENT_LEGEND and name == "@tp"), name
    assert PLACEMENT_LEGEND in LAYOUT_LEGEND

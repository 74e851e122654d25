"""Measuring commands never silently replace a committed artifact: without ``--out PATH``
they need ``--write``; a smaller sample than the committed one needs ``--force``; the old
and new figures are printed side by side. Every test works on a copy under ``tmp_path``
(``WSB_TOLERANCE_DIR``): none writes into the checkout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from weight_sync_bench.cli import main
from weight_sync_bench.cli.floor import as_floor_argv
from weight_sync_bench.cli.main import main as wsb_main

CHECKOUT = Path(__file__).resolve().parents[2] / "tolerance"


@pytest.fixture
def tolerance(tmp_path, monkeypatch):
    copy = tmp_path / "tolerance"
    shutil.copytree(CHECKOUT, copy)
    monkeypatch.setenv("WSB_TOLERANCE_DIR", str(copy))
    return copy


def _stamp(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


@pytest.mark.parametrize("argv", [["floor", "--random", "3"],
                                  ["floor", "--random", "3", "--phase", "1b"]])
def test_floor_without_out_or_write_is_refused_before_measuring(tolerance, capsys, argv):
    phase = argv[-1] if "--phase" in argv else "1a"
    target = tolerance / f"random_floor_{phase}.json"
    before, committed = _stamp(target), _stamp(CHECKOUT / target.name)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (f"would replace the committed {target}: pass --write to replace it, or --out "
            "PATH to write the measurement elsewhere") in err
    assert _stamp(target) == before and _stamp(CHECKOUT / target.name) == committed


def test_a_smaller_sample_needs_force_and_the_figures_are_printed_side_by_side(tolerance,
                                                                               capsys):
    target = tolerance / "random_floor_1a.json"
    old = json.loads(target.read_text())
    before = _stamp(target)
    assert main(["floor", "--random", "2", "--write", "--seed", "1"]) == 2
    committed = old["geometries"] + old["searched"]
    assert (f"{target} holds {committed} geometries (random + searched); this measurement "
            "would have 2: pass --force") in capsys.readouterr().err
    assert _stamp(target) == before
    # the twin: with --force it is replaced, and says what it replaced
    assert main(["floor", "--random", "2", "--write", "--force", "--seed", "1", "-q",
                 "--kernel-sets", "current"]) == 0
    out = capsys.readouterr().out
    header, geometries, samples, rule = out.split("\n\n")[1].splitlines()[:4]
    assert header.split() == ["replaced", "(random_floor_1a.json)", "new"]
    assert geometries.split()[:2] == ["geometries", str(old["geometries"])]
    assert "2 (+0 searched of 0)" in geometries
    assert samples.split()[:2] == ["samples", str(len(old["samples"]))]
    assert rule.startswith("rule ")
    assert json.loads(target.read_text())["geometries"] == 2


def test_the_tolerance_command_needs_write_and_force_too(tolerance, tmp_path, capsys):
    target = tolerance / "phase1a.json"
    before = _stamp(target)
    assert wsb_main(as_floor_argv([])) == 2
    assert f"would replace the committed {target}: pass --write" in capsys.readouterr().err
    assert wsb_main(as_floor_argv(["--write", "--repetitions", "1"])) == 2
    assert f"{target} holds 20 repetitions; this measurement would have 1: pass --force" in (
        capsys.readouterr().err)
    assert _stamp(target) == before
    out_path = tmp_path / "mine.json"
    shutil.copy(target, out_path)  # --out onto an existing file: compared, then replaced
    assert wsb_main(as_floor_argv(["--out", str(out_path), "--repetitions", "1", "--force",
                         "--kernel-sets", "current"])) == 0
    out = capsys.readouterr().out
    assert "replaced (mine.json)" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("repetitions", "threshold"))}
    assert rows["repetitions"] == ["20", "1"] and len(rows["threshold"]) == 2
    assert json.loads(out_path.read_text())["repetitions"] == 1
    assert _stamp(target) == before

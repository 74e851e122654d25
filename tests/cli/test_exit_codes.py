"""One exit-code contract for every subcommand, written in ``wsb --help`` and the README;
every number validated (zero, negative, NaN, infinite, out-of-range seeds are typed errors,
never a run at 1 and never a pass for work not done)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.documentation import documentation
from weight_sync_bench.check.checker import check_split, sweep
from weight_sync_bench.cli import main
from weight_sync_bench.cli.floor import as_floor_argv
from weight_sync_bench.cli.main import build_parser, exit_code
from weight_sync_bench.cli.main import main as wsb_main
from weight_sync_bench.cli.output import EXIT_CODES, Terminated
from weight_sync_bench.errors import (
    CorruptCorpusEntry,
    GeometryTooLarge,
    InvalidMesh,
    InvalidNumber,
    InvalidShards,
    InvalidUserShards,
    LauncherCrash,
    MissingArtifacts,
    RankCrash,
    RankStopped,
    ToleranceMismatch,
    TooManyRanks,
    UnsupportedLayout,
    UserCodeError,
    WsbError,
)
from weight_sync_bench.fuzz.runner import fuzz
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import TOY
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.training.mesh import Mesh

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(("error", "code"), [
    (InvalidNumber("x"), 2), (UnsupportedLayout("x"), 2), (CorruptCorpusEntry("x"), 2),
    # a tolerance artifact that does not cover the check: the input asks for what was
    # never measured (the message names the command that measures it)
    (ToleranceMismatch("x"), 2), (WsbError("x"), 2),
    # a geometry or a world too large to run here: the input's size, refused before it runs
    (GeometryTooLarge("x"), 2), (TooManyRanks("x"), 2),
    (RankCrash("x", signal_name="SIGKILL"), 3), (RankStopped("x"), 3),
    # the process that starts the ranks died: a fault of the harness, not of the input
    (LauncherCrash("x", launcher="forkserver", launcher_pid=1,
                   launcher_end="killed by SIGKILL"), 3),
    (MissingArtifacts("x"), 3),  # the harness cannot find its own files
    (RuntimeError("a bug of the harness"), 3),
    (UserCodeError("x"), 4), (InvalidUserShards("x"), 4),
    (InvalidShards("x"), 4),  # only the user's functions hand the CLI shards
    (KeyboardInterrupt(), 130), (Terminated(), 143),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_every_error_class_maps_to_one_exit_code(error, code):
    assert exit_code(error) == code


def test_help_and_readme_state_the_same_exit_codes_and_environment(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert EXIT_CODES in text
    for variable in ("WSB_CORPUS_DIR", "WSB_TOLERANCE_DIR", "WSB_FUZZ_DIR", "WSB_PROFILE",
                     "WSB_MAX_RANKS"):
        assert variable in text
    readme = documentation()
    section = readme[readme.index("## Exit codes and machine-readable output"):]
    section = section[:section.find("\n## ", 4)]
    codes = re.findall(r"^\| `(\d+)` \|", section, re.M)
    assert codes == ["0", "1", "2", "3", "4", "130", "143"]
    assert codes == re.findall(r"^    (\d+) ", EXIT_CODES, re.M)[:5] + ["130", "143"]
    for variable in ("WSB_CORPUS_DIR", "WSB_TOLERANCE_DIR", "WSB_FUZZ_DIR", "WSB_PROFILE",
                     "WSB_MAX_RANKS"):
        assert variable in readme


def test_version_names_the_package_and_torch(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert re.match(r"wsb \S+ \(torch \S+, python 3\.", capsys.readouterr().out)


@pytest.mark.parametrize(("argv", "names"), [
    (["train-check", "--dp", "0"], "--dp: must be > 0, got 0"),
    (["train-check", "--tp", "0"], "--tp: must be > 0, got 0"),
    (["train-check", "--cp", "0", "--sp"], "--cp: must be > 0, got 0"),
    (["train-check", "--steps", "-1"], "--steps: must be > 0, got -1"),
    (["fuzz", "--minutes", "nan"], "--minutes: must be > 0 and finite, got nan"),
    (["fuzz", "--minutes", "inf"], "--minutes: must be > 0 and finite, got inf"),
    (["fuzz", "--minutes", "-1"], "--minutes: must be > 0 and finite, got -1"),
    (["fuzz", "--minutes", "0"], "--minutes: must be > 0 and finite, got 0"),
    (["fuzz", "--examples", "0"], "--examples: must be > 0, got 0"),
    (["fuzz", "--chunk", "0"], "--chunk: must be > 0, got 0"),
    (["fuzz", "--seed", "-1"], "--seed: must be an int in 0..2^63-1, got -1"),
    (["check", "--seed", str(2**63)], f"--seed: must be an int in 0..2^63-1, got {2**63}"),
    (["check", "--backend", "gloo", "--deadline", "0"], "--deadline: must be > 0"),
    (["floor", "--random", "0"], "--random: must be > 0, got 0"),
    (["floor", "--random", "3", "--search", "-5"], "--search: must be > 0, got -5"),
    (["floor", "--random", "3", "--keep", "-1"], "--keep: must be > 0, got -1"),
    (["replay", "--max-gib", "nan"], "--max-gib: must be > 0 and finite, got nan"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_number_is_a_usage_error_naming_the_argument(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and names in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--repetitions", "0"], ["training", "--steps", "0"]])
def test_the_measuring_command_validates_its_numbers_too(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        wsb_main(as_floor_argv(argv))
    assert exit_.value.code == 2 and "must be > 0, got 0" in capsys.readouterr().err


def test_the_api_behind_the_cli_refuses_the_same_numbers():
    for budget, what in (({"minutes": math.nan}, "minutes"), ({"minutes": math.inf}, "minutes"),
                         ({"minutes": -1.0}, "minutes"), ({"examples": 0}, "examples")):
        with pytest.raises(InvalidNumber, match=f"{what} must be"):
            next(fuzz(**budget))
    with pytest.raises(InvalidNumber, match="chunk must be an int >= 1, got 0"):
        next(fuzz(examples=1, chunk=0))
    for mesh, field in ((Mesh(0, 1), "dp=0"), (Mesh(1, 0), "tp=0"), (Mesh(1, 1, True, 0), "cp=0"),
                        (Mesh(True, 1), "dp=True")):
        with pytest.raises(InvalidMesh, match=f"must be a positive int, got {field}"):
            mesh.validate(TOY, rows=2, seq_len=16)
    for seed in (-1, 2**63, True):
        with pytest.raises(InvalidNumber, match=r"seed must be an int in 0\.\.2\^63-1"):
            check_split(lambda full, t: split(full, layout_for(TOY), t), TOY, 2, seed=seed)
        with pytest.raises(InvalidNumber, match=r"seed must be an int in 0\.\.2\^63-1"):
            sweep(TOY, seed=seed, pairs=[(1, 1)])


def test_the_largest_seed_is_accepted_so_the_range_check_is_not_vacuous():
    (verdict,) = sweep(TOY, seed=2**63 - 1, pairs=[(1, 1)])
    assert verdict.passed


def test_a_fuzz_run_that_tried_no_example_exits_2_and_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path))
    assert main(["fuzz", "--minutes", "1e-9", "--seed", "1"]) == 2
    assert "tried no example: nothing was checked" in capsys.readouterr().out
    # the replay profile generates nothing, and no corpus entry feeds this mutation here
    assert main(["fuzz", "--examples", "5", "--profile", "wsb-replay",
                 "--mutation", "gate_up_swapped"]) == 2
    assert "0 examples in" in capsys.readouterr().out
    # the twin: one example is work done, and a pass
    assert main(["fuzz", "--examples", "1", "--seed", "1", "--mutation", "kv_swapped"]) == 0
    assert "tried no example" not in capsys.readouterr().out


def test_every_subcommand_takes_quiet_and_the_checking_ones_take_json():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("check", "layout", "fuzz", "mutants", "floor", "replay", "train-check"):
        parser = sub.choices[name]
        options = {o for a in parser._actions for o in a.option_strings}
        assert "-q" in options, name
        if name in ("check", "fuzz", "mutants", "replay", "train-check"):
            assert "--json" in options, name
        if name in ("check", "fuzz", "mutants", "replay", "train-check", "floor"):
            assert "--deadline" in options, name

"""Every code block of the documentation runs (the README and the pages under ``docs/``), so
no page can drift from the code it describes:

- a section whose blocks a test elsewhere runs, comparing what they print, is named in
  ``RUN_BY`` (the worked examples: ``tests/test_readme.py``; the pytest quickstart:
  ``tests/test_plugin.py``'s fresh project);
- every other ``python`` block runs here, the blocks of a section in order in one namespace
  (one holding ``if __name__ == "__main__":`` as a script of its own, in a fresh
  interpreter, as the ranks it starts must import it), and an output block after one is what
  it prints (``assert_prints``);
- every command line of a ``sh`` or ``console`` block (``wsb``, ``python -m
  weight_sync_bench[.tolerance]``, ``torchrun ... -m weight_sync_bench``, ``make``, ``python
  bench/...``) is parsed by the command it names in the default run (an option that does not
  exist, a value it refuses, a target the Makefile lacks, a file that is not there fail it),
  and, but for ``make`` (whose targets set up ``.venv`` in the checkout), run: in a scratch
  directory, the tolerance directory a copy where it writes
  (``--write``), its exit code the one its comment says (``exit 1``) or 0, a ``console``
  block's output lines printed in order. The long ones (a real width, minutes of fuzzing, a
  floor measurement, the whole mutation matrix, torchrun, a benchmark) run in the long run
  (``make nightly``); a line that names a module of your own no page defines is parsed only;
- an output block no run produces is an illustration, listed in ``SHOWN`` with what keeps it
  true; ``test_every_block_is_run_or_shown`` fails on any block none of these claims.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.documentation import ROOT, Block, blocks, converter_module
from tests.test_readme import assert_prints

CODE = ("python", "sh", "console")

# (page, section, language) -> the test that runs those blocks, comparing what they print
RUN_BY = {
    ("README.md", "Check your own resharding code", "python"):
        "tests/test_readme.py::test_the_worked_example_prints_the_report_shown",
    ("README.md", "Quickstart: your pytest suite", "python"):
        "tests/test_plugin.py::test_the_readme_pytest_example_runs_as_documented_in_a_fresh_project",
    ("docs/guides/checkpoints.md", "Checkpoints on disk: converters that are command-line tools",
     "python"): "tests/test_readme.py::test_the_checkpoint_example_runs_as_its_console_block_shows",
    ("docs/guides/checkpoints.md", "Checkpoints on disk: converters that are command-line tools",
     "console"): "tests/test_readme.py::test_the_checkpoint_example_runs_as_its_console_block_shows",
    ("docs/guides/checkpoints.md", "After a sync: what the engine holds, tensor by tensor",
     "python"):
        "tests/test_readme.py::test_the_engine_state_example_and_the_sentinel_recipe_run_as_shown",
    ("docs/guides/converters.md", "Check a converter between frameworks", "python"):
        "tests/test_readme.py::test_the_converter_example_prints_the_verdicts_shown",
    ("docs/guides/fuzzing.md", "Fuzz your own code", "python"):
        "tests/test_readme.py::test_the_fuzz_your_own_code_example_finds_the_bug_from_the_cli_and_from_pytest",
    ("docs/guides/fuzzing.md", "Fuzz your own code", "sh"):
        "tests/test_readme.py::test_the_fuzz_your_own_code_example_finds_the_bug_from_the_cli_and_from_pytest",
    ("docs/guides/moe.md", "Mixture-of-Experts: experts over EP and expert-TP ranks", "python"):
        "tests/test_readme.py::test_the_moe_example_prints_its_per_rank_output_and_the_verdicts_shown",
}

# Output blocks no run here produces: (page, the block's first characters) -> what keeps it true
SHOWN = {
    ("README.md", "config   src -> dst  phase"):
        "make run's table: its figures are tests/test_readme_figures.py's",
    ("docs/guides/checkpoints.md", "wsb verify: vllm-toy/model-rank-1"):
        "the refusal of a truncated file: tests/cli/test_checkpoint_cli.py",
    ("docs/guides/converters.md", "megatron: decoder.layers.0"):
        "the three conventions' qkv rows: tests/conventions/test_maps.py",
    ("docs/guides/converters.md", "model.layers.0.self_attn.qkv_proj.weight  layers.0"):
        "wsb layout's table: tests/cli/test_convert_cli.py",
    ("docs/guides/distributed.md", "fn(ctx: SyncContext"):
        "the functions' signatures: test_the_documented_signatures_are_the_codes, below",
    ("docs/guides/distributed.md", "PASS toy_kv4 megatron:4 -> vllm:2 (phase 2, weight_sync"):
        "wsb sync's report (its times vary run to run): tests/sync/test_cli.py",
    ("docs/guides/moe.md", "rank  tp  dp  ep  etp"):
        "the expert-parallel ranks' table: tests/conventions/test_moe_conventions.py",
    ("docs/guides/pipeline.md", "FAIL toy hf:1 -> megatron:tp=1,pp=2,vpp=2"):
        "pp_chunks_contiguous's diagnosis: tests/sync/test_stages.py",
    ("docs/guides/real-widths.md", "llama3_8b: no measured floor covers"):
        "FloorNotMeasured's message: tests/cli/test_real_width_cli.py",
    ("docs/internals/modules.md", "src/weight_sync_bench/"):
        "the module map: tests/test_layering.py's packages",
    ("docs/reference/cli.md", ""): "generated from the parsers: tests/cli/test_help.py",
}

# The commands the default run runs (a second or two each); every other one runs in the long
# run (a real width, minutes of fuzzing, a floor's measurement, a mutation matrix, torchrun,
# the rank pool's syncs and trainings, a benchmark), and is parsed by default.
QUICK = re.compile(r"^(\.venv/bin/)?wsb (layout |emit |check --config toy$|"
                   r"check --converter my_converters:megatron_to_vllm --from megatron:4 |"
                   r"sync --config toy_kv4 --from megatron:4 --to vllm:2 --(mutation|into) |"
                   r"train-check --config small --tp 2 --cp 2 )")
# A section holding a script (the rank pool's examples: ``if __name__ == "__main__":``) runs
# in the long run: by default the pool runs such a script in tests/collectives/
# test_unguarded_main.py, and check_distributed_reshard in tests/sync/test_verify.py.
SCRIPT = 'if __name__ == "__main__":'


def _page(block: Block) -> str:
    return block.page.relative_to(ROOT).as_posix()


def _run_by(block: Block) -> str | None:
    return RUN_BY.get((_page(block), block.section, block.lang))


def _shown(block: Block) -> str | None:
    for (page, start), why in SHOWN.items():
        if page == _page(block) and block.body.startswith(start):
            return why
    return None


def _sections() -> dict[tuple[str, str], list[Block]]:
    """The blocks of every section, in order."""
    found: dict[tuple[str, str], list[Block]] = {}
    for b in blocks():
        found.setdefault((_page(b), b.section), []).append(b)
    return found


def _python_here() -> list:
    """The sections whose python blocks run here, each with its blocks (outputs included)."""
    return [pytest.param(f"{page}: {section}", found, id=f"{page}: {section}",
                         marks=pytest.mark.slow if any(SCRIPT in b.body for b in found) else ())
            for (page, section), found in _sections().items()
            if any(b.lang == "python" and _run_by(b) is None for b in found)]


# -- the inventory ------------------------------------------------------------------------

def test_every_block_is_run_or_shown():
    """A block is run (here or by the test ``RUN_BY`` names), or is the output of the code
    block just before it (nothing but blank lines between), or an illustration ``SHOWN``
    lists; anything else fails, naming it."""
    unclaimed = []
    every = blocks()
    for i, b in enumerate(every):
        if b.lang in CODE:
            continue  # run here unless RUN_BY names its test
        previous = every[i - 1] if i else None
        follows_code = (b.lang == "" and b.adjacent and previous is not None
                        and previous.lang in CODE)
        if not follows_code and _shown(b) is None:
            unclaimed.append(f"{b.where} ({b.lang or 'output'}): {b.body[:60]!r}")
    assert not unclaimed, "\n".join(unclaimed)
    assert sum(b.lang in CODE for b in every) >= 25


def test_the_tests_named_exist_and_the_illustrations_are_there():
    for test in set(RUN_BY.values()):
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), test
    every = blocks()
    for key in RUN_BY:
        assert any((_page(b), b.section, b.lang) == key for b in every), key
    for page, start in SHOWN:
        assert any(_page(b) == page and b.body.startswith(start) for b in every), (page, start)


# -- the python blocks ----------------------------------------------------------------------

@pytest.mark.parametrize("section, found", _python_here())
def test_the_python_blocks_run(section, found, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs"}
    ran = 0
    for b, after in zip(found, [*found[1:], None]):
        if b.lang != "python" or _run_by(b) is not None:
            continue
        ran += 1
        if SCRIPT in b.body:
            script = tmp_path / f"example_{b.line}.py"
            script.write_text(b.body)
            done = subprocess.run([sys.executable, str(script)], capture_output=True,
                                  text=True, timeout=600, cwd=tmp_path,
                                  env={**os.environ, "PYTHONPATH": str(tmp_path)})
            assert done.returncode == 0, f"{b.where}:\n{done.stdout}{done.stderr}"
            printed = done.stdout
        else:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(b.body, b.where, "exec"), namespace)
            printed = out.getvalue()
        if after is not None and after.lang == "" and after.adjacent:
            assert_prints(printed, after.body)
        elif SCRIPT in b.body:
            assert printed.startswith("PASS "), f"{b.where}: {printed}"
    assert ran


def _signature(fn) -> str:
    """``fn``'s parameters as the guide writes them: names, ``*``, defaults; no annotations."""
    words, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            words.append("*")
            star = True
        words.append(p.name if p.default is inspect.Parameter.empty
                     else f"{p.name}={p.default!r}")
    return ", ".join(words)


def test_the_documented_signatures_are_the_codes():
    """The text block of the distributed guide gives the Python functions' signatures as the
    code has them, defaults included."""
    from weight_sync_bench.sync import check_distributed_reshard, run_distributed_reshard

    (block,) = [b for b in blocks()
                if b.lang == "text" and "check_distributed_reshard(fn" in b.body]
    text = re.sub(r"\s+", " ", block.body).replace("4 << 20", str(4 << 20)).replace('"', "'")
    for fn in (check_distributed_reshard, run_distributed_reshard):
        shown = re.search(rf"{fn.__name__}\((.*?)\) ->", text)
        assert shown is not None, fn.__name__
        assert shown[1] == _signature(fn), (shown[1], _signature(fn))


# -- the command lines ---------------------------------------------------------------------

@dataclass(frozen=True)
class Line:
    """One command of a block: where it is, its words (optional ``[...]`` parts left out),
    the options those parts name, the exit code its comment states, what a console block
    shows under it."""

    block: Block
    text: str
    argv: tuple[str, ...]
    optional: tuple[str, ...]
    code: int
    shown: str
    then: tuple[Line, ...] = ()  # what ``&&`` runs after it, in the same directory

    @property
    def id(self) -> str:
        return f"{self.block.where} {self.text[:70]}"


def _lines(block: Block) -> list[Line]:
    if block.lang == "console":
        steps: list[list[str]] = []
        for raw in block.body.splitlines(keepends=True):
            if raw.startswith("$ "):
                steps.append([raw[2:].strip(), ""])
            elif steps:
                steps[-1][1] += raw
    else:
        joined = re.sub(r"\\\n\s*", " ", block.body)
        steps = [[raw.strip(), ""] for raw in joined.splitlines() if raw.strip()]
    found = []
    for text, shown in steps:
        command, _, comment = (part.strip() for part in text.partition(" #"))
        stated = re.search(r"exit (\d)", comment)
        chain = []
        for part in command.split("&&"):
            optional = tuple(re.findall(r"--[\w-]+", " ".join(re.findall(r"\[[^\]]*\]", part))))
            argv = tuple(shlex.split(re.sub(r"\[[^\]]*\]", "", part)))
            chain.append(Line(block, part.strip(), argv, optional,
                              int(stated[1]) if stated else 0, shown))
        found.append(replace(chain[0], text=command, then=tuple(chain[1:])))
    return found


def _command_lines() -> list[Line]:
    """Every command of the blocks run here; a ``sh`` block's last command shows the output
    block right after it."""
    every, found = blocks(), []
    for b, after in zip(every, [*every[1:], None]):
        if b.lang not in ("sh", "console") or _run_by(b) is not None:
            continue
        lines = _lines(b)
        if b.lang == "sh" and after is not None and after.lang == "" and after.adjacent:
            lines[-1] = replace(lines[-1], shown=after.body)
        found.extend(lines)
    return found


def _wsb_argv(argv: tuple[str, ...]) -> list[str] | None:
    """The ``wsb`` arguments a command line runs, or None where it is not a wsb command."""
    from weight_sync_bench.cli.floor import as_floor_argv

    words = list(argv)
    if words[0] in ("wsb", ".venv/bin/wsb"):
        return words[1:]
    if words[:3] == ["python", "-m", "weight_sync_bench"]:
        return words[3:]
    if words[:3] == ["python", "-m", "weight_sync_bench.tolerance"]:
        return as_floor_argv(words[3:])
    if words[0] == "torchrun":
        return words[words.index("weight_sync_bench") + 1:]
    return None


def _subparser(wsb: list[str]):
    """The parser of the (sub)command ``wsb`` names (``floor phase``: two words deep), and
    how many of its words name it."""
    from weight_sync_bench.cli.main import build_parser

    parser, depth = build_parser(), 0
    for word in wsb:
        commands = [a.choices for a in parser._actions if isinstance(a.choices, dict)]
        if not commands or word not in commands[0]:
            break
        parser, depth = commands[0][word], depth + 1
    return parser, depth


# The options that name a function of your own (MODULE:FUNCTION), and the modules of your
# own a page defines (the converter guide's)
FUNCTION_OPTIONS = ("--converter", "--resharder", "--splitter")
OWN_MODULES = {"my_converters": converter_module}


def _own_module(line: Line) -> str | None:
    """The module of your own a line names (``--converter my_converters:megatron_to_vllm``)."""
    for option, value in zip(line.argv, line.argv[1:]):
        if option in FUNCTION_OPTIONS:
            return value.split(":")[0]
    return None


@pytest.mark.parametrize("line", [part for line in _command_lines() for part in (line, *line.then)],
                         ids=lambda line: line.id)
def test_every_command_line_parses(line):
    words = list(line.argv)
    wsb = _wsb_argv(line.argv)
    if wsb is not None:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                parser, depth = _subparser(wsb)
                parser.parse_args(wsb[depth:])
            except SystemExit as exit_:
                pytest.fail(f"{line.id}: {err.getvalue()} (exit {exit_.code})")
        # spelled out: argparse would take an abbreviation, which a later option can break
        known = {o for a in parser._actions for o in a.option_strings}
        spelled = {w.split("=")[0] for w in wsb if w.startswith("--")} | set(line.optional)
        assert spelled <= known, (line.id, spelled - known)
    elif words[0] == "make":
        done = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, f"{line.id}: {done.stderr}"
    elif words[0] == "python":
        assert (ROOT / words[1]).is_file(), line.id
    else:
        pytest.fail(f"{line.id}: a command this test does not know")


def _runnable(line: Line) -> bool:
    module = _own_module(line)
    # make's targets are expanded (make -n) by the parse test, never run: they set up .venv
    # in the checkout first (make test is what CI itself runs; make run and make fuzz run
    # wsb check and wsb fuzz, whose lines run here)
    return (_wsb_argv(line.argv) is not None or line.argv[0] == "python") and (
        module is None or module in OWN_MODULES)


@pytest.mark.parametrize("line", [
    pytest.param(line, id=line.id, marks=() if QUICK.search(line.text) else pytest.mark.slow)
    for line in _command_lines() if _runnable(line)])
def test_every_command_runs(line, tmp_path, monkeypatch, capfd, request):
    """Run as a user would, from a scratch directory (the corpus the suite's copy; where the
    line writes a floor, the committed tolerance a copy there, else read in place): its exit
    code is the one its comment states, else 0; a console block's lines are printed, in
    order, a ``...`` line standing for any."""
    if "--write" in line.text:
        request.getfixturevalue("tolerance")
    monkeypatch.chdir(tmp_path)
    module = _own_module(line)
    if module is not None:
        (tmp_path / f"{module}.py").write_text(OWN_MODULES[module]())
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, module, raising=False)
    for part in (line, *line.then):
        code, printed = _run(part, tmp_path, capfd)
        assert code == part.code, f"{part.id}: exit {code}\n{printed}"
    _assert_shown(printed, line.shown)


def _run(line: Line, here: Path, capfd) -> tuple[int, str]:
    """Run one command from ``here``: wsb in process, torchrun and python as processes."""
    from weight_sync_bench.cli.main import main

    wsb = _wsb_argv(line.argv)
    if wsb is not None and line.argv[0] != "torchrun":
        code = main(wsb)
        return code, capfd.readouterr().out
    words = list(line.argv)
    if words[0] == "python":
        words[0] = sys.executable
        if words[1] != "-m":
            words[1] = str(ROOT / words[1])
    elif words[0] == "torchrun":
        words[0] = str(Path(sys.executable).parent / "torchrun")
    done = subprocess.run(words, cwd=here, capture_output=True, text=True, timeout=3600)
    return done.returncode, done.stdout + ("\n" + done.stderr[-4000:] if done.returncode else "")


def _assert_shown(printed: str, shown: str) -> None:
    """Each line of ``shown`` is printed, in order (a ``...`` line stands for any lines)."""
    lines, at = printed.splitlines(), 0
    for want in shown.splitlines():
        if want.strip() in ("", "..."):
            continue
        while at < len(lines) and lines[at].rstrip() != want.rstrip():
            at += 1
        assert at < len(lines), f"not printed (in order): {want!r}\n{printed}"
        at += 1

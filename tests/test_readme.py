"""The README's worked example runs and prints what the README says it prints."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title):
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_worked_example_prints_the_report_shown():
    blocks = re.findall(r"```(\w*)\n(.*?)```", _section("Check your own resharding code"), re.S)
    code = [body for lang, body in blocks if lang == "python"]
    shown = next(body for lang, body in blocks if lang == "")
    namespace = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for body in code:
            exec(compile(body, str(README), "exec"), namespace)
    assert out.getvalue() == shown


def test_the_converter_example_prints_the_verdicts_shown():
    """Each python block of the conversion section, run in order, prints exactly the block
    that follows it."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", _section("Check a converter between frameworks"),
                        re.S)
    namespace: dict = {}
    checked = 0
    for (lang, body), (next_lang, shown) in zip(blocks, blocks[1:]):
        if lang != "python":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(body, str(README), "exec"), namespace)
        if next_lang == "":
            assert out.getvalue() == shown
            checked += 1
    assert checked == 2


def test_the_checkpoint_example_runs_as_its_console_block_shows(tmp_path, monkeypatch):
    """The converter tool of the checkpoints section, saved as the file its console block
    runs, and every command of that block (``wsb`` through ``main``, ``python`` through
    ``runpy``), in a scratch directory: each prints exactly the lines shown under it."""
    import runpy
    import shlex
    import sys

    from weight_sync_bench.cli.main import main

    blocks = re.findall(r"```(\w*)\n(.*?)```", _section("Checkpoints on disk"), re.S)
    (tool,) = [body for lang, body in blocks if lang == "python"]
    (console,) = [body for lang, body in blocks if lang == "console"]
    (tmp_path / "hf_to_vllm.py").write_text(tool)
    monkeypatch.chdir(tmp_path)
    steps: list[list[str]] = []  # [command, the output shown under it]
    for line in console.splitlines(keepends=True):
        if line.startswith("$ "):
            steps.append([line[2:].strip(), ""])
        else:
            steps[-1][1] += line
    assert [s[0].split()[:2] for s in steps] == [["wsb", "emit"], ["python", "hf_to_vllm.py"],
                                                 ["wsb", "verify"]]
    for command, shown in steps:
        argv = shlex.split(command)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if argv[0] == "wsb":
                assert main(argv[1:]) == 0, command
            else:
                monkeypatch.setattr(sys, "argv", argv[1:])
                runpy.run_path(argv[1], run_name="__main__")
        assert out.getvalue() == shown, command


def test_the_fuzz_your_own_code_example_finds_the_bug_from_the_cli_and_from_pytest(
        tmp_path, monkeypatch, capsys):
    """The resharder of "Fuzz your own code", saved as its module: the shell command exits 1
    printing every line shown; the pytest block prints exactly the block that follows it."""
    import importlib
    import shlex
    import sys

    from weight_sync_bench.cli import main

    blocks = re.findall(r"```(\w*)\n(.*?)```", _section("Fuzz your own code"), re.S)
    (_, module), (_, command), (_, shown), (_, pytest_block), (_, pytest_shown) = blocks
    (tmp_path / "my_resharders.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_resharders", raising=False)
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path / "corpus"))
    argv = shlex.split(command.split("#")[0])
    assert argv[0] == "wsb" and main(argv[1:]) == 1
    printed = capsys.readouterr().out.splitlines()
    for line in shown.splitlines():
        assert line in printed, line
    namespace = {"my_reshard": importlib.import_module("my_resharders").my_reshard}
    exec(compile(pytest_block, str(README), "exec"), namespace)
    assert capsys.readouterr().out == pytest_shown

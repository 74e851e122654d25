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

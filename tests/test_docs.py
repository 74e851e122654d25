"""The documentation: a README of quickstarts that fits on a screen or two, and the pages
under ``docs/``, built as a site by ``mkdocs build --strict`` (a broken link, or a page the
navigation leaves out, fails it); every link of the README to a page reaches one. Every code
block of the pages runs: the worked examples in ``test_readme.py`` (found wherever they live:
``tests.documentation``), every other block in ``test_docs_run.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.documentation import DOCS, README, ROOT


def test_the_readme_is_quickstarts_and_links():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) < 12_000, len(text.encode())
    for heading in ("## Two commands", "## Check your own resharding code",
                    "## Quickstart: the command line", "## Quickstart: your pytest suite",
                    "## Documentation"):
        assert heading in text
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), link


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages == listed, (pages - listed, listed - pages)


def test_the_site_builds_strict(tmp_path):
    """Into a scratch directory: the checkout is left as it was."""
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "guides" / "fp8" / "index.html").is_file()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "check_convert" in api and "convert_property" in api  # rendered from docstrings

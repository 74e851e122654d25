"""The harness's documentation, as the tests read it: the README and the pages under
``docs/`` (the site ``mkdocs.yml`` builds), in that order, one text. A section a test runs or
quotes is found wherever it lives (``section``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """The README, then every page under docs/, sorted."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def documentation() -> str:
    """Every page's text, joined."""
    return "\n\n".join(p.read_text(encoding="utf-8") for p in pages())


def section(title: str) -> str:
    """The ``## title`` section (to the next ``## `` heading or the end of its page)."""
    for page in pages():
        text = page.read_text(encoding="utf-8")
        start = text.find(f"## {title}")
        if start != -1:
            end = text.find("\n## ", start + 1)
            return text[start:end if end != -1 else None]
    raise KeyError(f"no page has a section '## {title}'")

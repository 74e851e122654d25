"""The harness's documentation, as the tests read it: the README and the pages under
``docs/`` (the site ``mkdocs.yml`` builds), in that order, one text. A section a test runs or
quotes is found wherever it lives (``section``)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
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


FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, first line, language tag ("" for an output), text, the
    ``## `` section it lies in (``""`` before the first), and whether it follows the page's
    previous block with nothing but blank lines between (the output of that block)."""

    page: Path
    line: int
    lang: str
    body: str
    section: str
    adjacent: bool = False

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@functools.cache
def blocks() -> tuple[Block, ...]:
    """Every fenced block of every page, in order (read once a run: the pages do not change
    under it)."""
    found = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        end = None
        for match in FENCE.finditer(text):
            before = text[:match.start()]
            titles = re.findall(r"^## (.*)$", before, re.M)
            found.append(Block(page, before.count("\n") + 1, match[1], match[2],
                               titles[-1] if titles else "",
                               end is not None and not text[end:match.start()].strip()))
            end = match.end()
    return tuple(found)


# The converter guide's worked converter, as the module its commands name
# (``--converter my_converters:megatron_to_vllm``): the guide's first python block, up to
# the statements that run it.
CONVERTER_SECTION = "Check a converter between frameworks"


def converter_module() -> str:
    """``my_converters.py`` as the converter guide writes it."""
    (code,) = [b.body for b in blocks()
               if b.section == CONVERTER_SECTION and b.lang == "python"][:1]
    return code.split("\nverdict")[0].split("\nfor ")[0]

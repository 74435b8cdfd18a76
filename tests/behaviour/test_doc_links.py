"""Every relative link in README.md and docs/ points at a file or folder that exists, and a
link to a heading (``page.md#heading``) at a heading that page has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CODE = re.compile(r"`[^`]*`")


def pages(root: Path) -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def links(page: Path) -> list[str]:
    """The link targets of a page, outside code blocks and code spans."""
    targets, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            targets += LINK.findall(CODE.sub("", line))
    return targets


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them (lower case, punctuation
    dropped, spaces to hyphens, a repeated heading numbered)."""
    seen: dict[str, int] = {}
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(root: Path) -> list[str]:
    """Every relative link of the pages that does not resolve, as 'page: target'."""
    broken = []
    for page in pages(root):
        for target in links(page):
            if re.match(r"^[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(root)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    assert len(pages(ROOT)) > 10
    assert sum(len(links(page)) for page in pages(ROOT)) > 50  # the links were read
    assert broken_links(ROOT) == []


def test_a_broken_link_is_found(tmp_path):
    """The check itself: a missing file, a missing heading, and links it must leave alone."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Its part, one\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md) [ok](docs/page.md#its-part-one) [ok](#top) [web](https://x.y/z)\n"
        "[gone](docs/gone.md) [no heading](docs/page.md#nowhere) `[code](not/a/link.md)`\n"
        "```\n[fenced](not/a/link.md)\n```\n# Top\n"
    )
    assert broken_links(tmp_path) == [
        "README.md: docs/gone.md",
        "README.md: docs/page.md#nowhere (no such heading)",
    ]

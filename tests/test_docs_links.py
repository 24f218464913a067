"""The user's manual holds together: every relative link in README.md, docs/*.md and
benchmarks/README.md names a file that exists, and every ``#anchor`` a heading of that file
(GitHub's slugs), so text moved between pages leaves no dead link; the README stays a manual
of at most 350 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped but ``-`` and ``_``, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, counts = set(), {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    dead = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not dead, f"{page.relative_to(ROOT)} has dead links:\n" + "\n".join(dead)


def test_the_readme_is_a_manual_not_a_notebook():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 350, f"README.md has {lines} lines; move details to docs/ (at most 350)"

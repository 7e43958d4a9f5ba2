"""The docs' links hold (issue 47): every relative link of README.md, CHANGELOG.md and docs/*.md names a file that
exists and, for a Markdown file, an anchor that one of its headings makes, as GitHub makes them (lowercase, spaces
to ``-``, punctuation other than ``-`` and ``_`` dropped, ``-1``, ``-2`` ... for repeated headings). When a
section moves (docs/benchmarks.md keeps today's figures, docs/benchmarks-history.md the rest), a link left behind
fails here. And docs/benchmarks.md stays a page of today's figures: at most 600 lines."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors of a Markdown page's headings (outside code blocks)."""
    made, count = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.*)$", line)
        if m:
            s = slug(m.group(1))
            made.add(s if s not in count else f"{s}-{count[s]}")
            count[s] = count.get(s, 0) + 1
    return frozenset(made)


def test_slug_matches_github() -> None:
    assert slug("Is compression worth it on this link? (`lightning-gradcomp bench`)") == (
        "is-compression-worth-it-on-this-link-lightning-gradcomp-bench"
    )
    assert slug("Aggregation at W = 2") == "aggregation-at-w--2"
    assert slug("Async SwarmSGD under `max_time`") == "async-swarmsgd-under-max_time"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_exists(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_benchmarks_page_holds_todays_figures_in_at_most_600_lines() -> None:
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= 600, f"docs/benchmarks.md: {len(lines)} lines; move earlier figures to benchmarks-history.md"
    history = (ROOT / "docs" / "benchmarks-history.md").read_text()
    assert "benchmarks.md" in history and len(history.splitlines()) > len(lines)

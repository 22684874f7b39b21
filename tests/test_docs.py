"""The README is one screen of what matters, and the docs hold together: the README stays short and has its
sections in order, and every relative link in the README and under docs/ points at a file or directory that
exists (and, for a link into a markdown file with #anchor, at a heading of that file)."""

from __future__ import annotations

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
README_MAX_CHARS = 12_000
README_SECTIONS = ("## Set up", "## What the first command prints", "## Drafters and trees", "## Python API",
                   "## Serve", "## Tests", "## Docs")

LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[str]:
    docs = sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
    return [README] + docs


def prose(text: str) -> str:
    """The text outside code fences and inline code, where a [text](path) is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    """Targets of markdown links and images, without web links, mail links and links within the page."""
    targets = LINK.findall(prose(text)) + IMAGE.findall(prose(text))
    return [t for t in targets if not re.match(r"(?i)(https?:|mailto:|#)", t)]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    found, seen = set(), {}
    for line in FENCE.sub("", open(path).read()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            found.add(anchor if count == 0 else f"{anchor}-{count}")
            seen[anchor] = count + 1
    return found


def broken_links(path: str) -> list[str]:
    """Each relative link of the markdown file ``path`` that does not resolve, with why."""
    broken = []
    for target in relative_links(open(path).read()):
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
        if not os.path.exists(resolved):
            broken.append(f"{target}: no such file or directory {os.path.relpath(resolved, REPO)}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {os.path.relpath(resolved, REPO)}")
    return broken


def test_readme_fits_one_screen_of_what_matters():
    size = len(open(README).read())
    assert size <= README_MAX_CHARS, f"README.md has {size} characters, more than {README_MAX_CHARS}: move detail to docs/"


def test_readme_has_its_sections_in_order():
    headings = [line.rstrip() for line in open(README).read().splitlines() if line.startswith("## ")]
    missing = [s for s in README_SECTIONS if s not in headings]
    assert not missing, f"README.md lacks {missing}; its sections are {headings}"
    positions = [headings.index(s) for s in README_SECTIONS]
    assert positions == sorted(positions), f"README.md's sections are out of order: {headings}"


def test_readme_cites_no_dated_runs_or_issues():
    text = prose(open(README).read())
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated measurements belong in docs/benchmarks.md"
    assert not re.search(r"(?i)\bissue\s+#?\d+|#\d{2,}\b", text), "issue numbers do not belong in the README"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve(path):
    broken = broken_links(path)
    assert not broken, f"{os.path.relpath(path, REPO)} has broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# There\n\n## A section\n")
    page.write_text("[ok](there.md) [ok](there.md#a-section) [web](https://example.com/x) [self](#top) "
                    "[mail](mailto:a@b.c) `[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
                    "[gone](missing.md) [bad anchor](there.md#no-such-section) ![img](missing.png)\n")
    assert [b.split(":")[0] for b in broken_links(str(page))] == ["missing.md", "there.md#no-such-section",
                                                                  "missing.png"]

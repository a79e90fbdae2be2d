"""The user docs (README.md and docs/*.md): the key reference is the one the schema generates, every relative link
reaches a file (and a heading, for an anchor), and the whole stays short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vitrain.config.reference import REGENERATE, markdown

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_WORDS = 19_000

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file has: one per heading (repeats numbered as GitHub does) and HTML ids."""
    text = FENCE.sub("", path.read_text())
    found, seen = set(HTML_ANCHOR.findall(text)), {}
    for heading in HEADING.findall(text):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file, or heading within a .md file, does not exist."""
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # https:, mailto: and other schemes leave the repository
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{path.name}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{path.name}: {target} (no heading with that anchor in {linked.name})")
    return broken


def test_the_key_reference_is_the_one_the_schema_generates():
    page = ROOT / "docs" / "reference.md"
    assert page.read_text() == markdown(), (
        f"docs/reference.md is out of date with the schema; regenerate it: {REGENERATE}"
    )


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_heading(path):
    assert broken_links(path) == []


def test_readme_and_docs_stay_under_the_word_limit():
    words = {path.relative_to(ROOT).as_posix(): len(path.read_text().split()) for path in DOCS}
    total = sum(words.values())
    largest = ", ".join(f"{name} {count}" for name, count in sorted(words.items(), key=lambda item: -item[1])[:5])
    assert total <= MAX_WORDS, f"README.md and docs/*.md hold {total} words, over {MAX_WORDS}; largest: {largest}"


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# Run `vitrain train`: the basics\n\n## Same\n\n## Same\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#run-vitrain-train-the-basics) [ok](b.md#same-1) [web](https://x.org/y) `[code](none.md)`\n"
        "[gone](c.md) [no heading](b.md#other)\n"
    )
    assert broken_links(page) == ["a.md: c.md (no such file)", "a.md: b.md#other (no heading with that anchor in b.md)"]

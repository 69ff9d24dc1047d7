"""The documentation cannot drift from the code: API reference, quoted error messages, links."""

import ast
import builtins
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import transformers

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE_FOLDERS = [ROOT / "dflash2_hf", ROOT / "modeling"]
TRANSFORMERS = Path(transformers.__file__).parent
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
TYPED = re.compile(r"^([A-Z]\w*(?:Error|Exit|Exception)): (.*)$", re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def code_spans(line: str) -> list[str]:
    """The contents of the Markdown code spans on a line (one space is stripped from both ends when both have one)."""
    spans = []
    for match in CODE_SPAN.finditer(line):
        text = match.group(2)
        if len(text) > 2 and text.startswith(" ") and text.endswith(" "):
            text = text[1:-1]
        spans.append(text)
    return spans


@cache
def source_strings() -> tuple[str, ...]:
    """Every string literal of the package, with implicitly concatenated pieces joined (``ast`` does that)."""
    found = []
    for folder in SOURCE_FOLDERS:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.append(node.value)
    return tuple(found)


@cache
def source_classes() -> frozenset[str]:
    names = set()
    for folder in SOURCE_FOLDERS:
        for path in folder.rglob("*.py"):
            names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return frozenset(names)


@cache
def transformers_text() -> str:
    """The transformers modules that raise the messages quoted as "(raised by transformers)"."""
    paths = [*TRANSFORMERS.glob("*.py"), *(TRANSFORMERS / "generation").rglob("*.py"),
             *(TRANSFORMERS / "pipelines").rglob("*.py")]
    return "\n".join(path.read_text() for path in paths)


def quoted_messages() -> list[tuple[int, str, bool]]:
    """``(line number, message, raised by transformers)`` for every code span on a ``>`` line of troubleshooting.md.

    The convention of that page: each error is quoted in a blockquote as ``Type: fixed text … fixed text`` (the type
    optional), ``…`` standing for the parts that depend on the call; "(raised by transformers)" after the quote marks
    a message that transformers raises.
    """
    messages = []
    for number, line in enumerate((DOCS / "troubleshooting.md").read_text().splitlines(), start=1):
        if line.startswith(">"):
            by_transformers = "raised by transformers" in CODE_SPAN.sub("", line)
            messages += [(number, span, by_transformers) for span in code_spans(line)]
    return messages


def test_api_reference_is_up_to_date(tmp_path):
    fresh = tmp_path / "api.md"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_api_docs.py"), "--out", str(fresh)],
                   cwd=ROOT, check=True, capture_output=True)
    assert fresh.read_text() == (DOCS / "api.md").read_text(), (
        "docs/api.md is out of date with the docstrings; run `python scripts/make_api_docs.py` and commit the result."
    )


def test_troubleshooting_quotes_many_messages_and_every_section_has_one():
    assert len(quoted_messages()) >= 40
    for number, line in enumerate((DOCS / "troubleshooting.md").read_text().splitlines(), start=1):
        if line.startswith(">"):
            rest = CODE_SPAN.sub("", line[1:]).replace("(raised by transformers)", "")
            rest = rest.replace("·", "").replace("…", "")
            assert not rest.strip(), f"troubleshooting.md:{number}: text outside the quoted messages: {rest.strip()!r}"
    sections = re.split(r"^### ", (DOCS / "troubleshooting.md").read_text(), flags=re.MULTILINE)[1:]
    for section in sections:
        assert any(line.startswith(">") and code_spans(line) for line in section.splitlines()), (
            f"troubleshooting.md section {section.splitlines()[0]!r} quotes no message"
        )


@pytest.mark.parametrize(("line", "message", "by_transformers"), quoted_messages(),
                         ids=[f"line{n}" for n, _, _ in quoted_messages()])
def test_quoted_error_message_occurs_in_the_code(line, message, by_transformers):
    typed = TYPED.match(message)
    if typed:
        kind, message = typed.groups()
        assert hasattr(builtins, kind) or kind in source_classes(), f"troubleshooting.md:{line}: no exception {kind}"
    fragments = [part.strip() for part in message.split("…") if part.strip()]
    assert fragments, f"troubleshooting.md:{line}: nothing fixed to check in {message!r}"
    for fragment in fragments:
        if by_transformers:
            found = fragment in transformers_text()
        else:
            found = any(fragment in text for text in source_strings())
        where = "transformers" if by_transformers else "dflash2_hf/ or modeling/"
        assert found, f"troubleshooting.md:{line}: {fragment!r} is not in any string of {where}; update the page"


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    anchors, seen = set(), {}
    for line in strip_code(markdown).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def strip_code(markdown: str) -> str:
    """The Markdown without fenced code blocks (a link-like text in code is not a link)."""
    return re.sub(r"^(```|~~~).*?^\1\s*$", "", markdown, flags=re.MULTILINE | re.DOTALL)


def relative_links() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = CODE_SPAN.sub("", strip_code(page.read_text()))
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, ...
                continue
            found.append((str(page.relative_to(ROOT)), target))
    return found


@pytest.mark.parametrize(("page", "target"), relative_links())
def test_relative_link_points_to_an_existing_file_and_heading(page, target):
    path_part, _, fragment = target.partition("#")
    linked = (ROOT / page).parent / path_part if path_part else ROOT / page
    assert linked.exists(), f"{page} links {target!r}, but {os.path.relpath(linked, ROOT)} does not exist"
    if fragment and linked.suffix == ".md":
        assert fragment in github_anchors(linked.read_text()), f"{page} links {target!r}: no such heading"

"""Design citations stay inside the project: no tracked file cites a design document outside the
repository, and every ``docs/design.md §N`` citation (``§N.M``, lists ``§N, §M`` and ranges
``§N–M`` included) names a section that exists as ``## N.`` in docs/design.md; a bare ``§N``
elsewhere must say which document it cites. A failure lists each offending ``file:line``."""

from __future__ import annotations

import os
import re
import subprocess

from tests.conftest import REPO

DESIGN = "docs/design.md"
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".txt")
S = "\u00a7"  # the section sign, spelled so that this file's own strings cite nothing

# a citation of the project's design: the path, then one or more section numbers; a line break
# (with a comment's `#` or a split string's quotes) may come between the path and the sign
_NUMBER = rf"{S}\s*\d+(?:\.\d+)*(?:\s*[–-]\s*{S}?\s*\d+(?:\.\d+)*)?"
CITATION = re.compile(
    rf"docs/design\.md(?:[\s#\"'>*]|\\n)*{_NUMBER}(?:\s*(?:,|and|&)\s*{_NUMBER})*"
)
SECTION_NUMBERS = re.compile(rf"{S}\s*(\d+)(?:\.\d+)*(?:\s*[–-]\s*{S}?\s*(\d+))?")
BARE_SECTION = re.compile(rf"{S}\s*\d")
HEADING = re.compile(r"^## (\d+)\. \S", re.M)
# what points at a design document that lives outside the repository
OUTSIDE = [
    re.compile(r"\bDESIGN(?:[\s#\"']|\\n)*" + S),  # the old citation form, also split over lines
    re.compile(r"\bDESIGN\.md\b"),
    re.compile(r"shared/DESIG[N]"),  # (brackets: this file matches nothing)
    re.compile(r"\.\./shared/"),
    re.compile(r"/work/share[d]\b"),
]


def tracked_text_files() -> list[str]:
    """Paths (relative to REPO) of the text files git tracks that exist in the working tree;
    outside a git checkout, every such file below REPO but virtual environments and caches."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30
        ).stdout.decode("utf-8", "replace")
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = []
        for root, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            paths += [os.path.relpath(os.path.join(root, f), REPO) for f in files]
    return sorted(
        p for p in paths if p.endswith(TEXT_SUFFIXES) and os.path.isfile(os.path.join(REPO, p))
    )


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as f:
        return f.read()


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def design_sections(text: str) -> list[int]:
    """The numbers of docs/design.md's ``## N.`` headings, in document order."""
    return [int(n) for n in HEADING.findall(text)]


def outside_citations(path: str, text: str) -> list[str]:
    """``path:line: ...`` for each reference to a design document outside the repository."""
    found = []
    for pattern in OUTSIDE:
        for m in pattern.finditer(text):
            snippet = " ".join(m.group(0).split())
            found.append(f"{path}:{line_of(text, m.start())}: {snippet!r} (cite {DESIGN} {S}N)")
    return found


def cited_sections(citation: str) -> list[int]:
    """Every section number one citation names (a range names each section in it)."""
    numbers = []
    for m in SECTION_NUMBERS.finditer(citation):
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else first
        numbers += range(first, max(first, last) + 1)
    return numbers


def bad_citations(path: str, text: str, sections: set[int]) -> list[str]:
    """``path:line: ...`` for each citation of a section docs/design.md lacks, and (outside
    docs/design.md, whose own ``§N`` cross-references are checked too) for each bare ``§N``
    that does not say which document it cites."""
    found = []
    spans = []
    for m in CITATION.finditer(text):
        spans.append(m.span())
        missing = [n for n in cited_sections(m.group(0)) if n not in sections]
        if missing:
            snippet = " ".join(m.group(0).split())
            found.append(
                f"{path}:{line_of(text, m.start())}: {snippet!r} names section(s) {missing}, "
                f"which {DESIGN} does not have"
            )
    for m in BARE_SECTION.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue
        line = line_of(text, m.start())
        if path == DESIGN:
            numbers = cited_sections(SECTION_NUMBERS.match(text, m.start()).group(0))
            missing = [n for n in numbers if n not in sections]
            if missing:
                found.append(f"{path}:{line}: cross-reference to missing section(s) {missing}")
        else:
            found.append(f"{path}:{line}: a bare {S}N: write it as {DESIGN} {S}N")
    return found


def test_design_has_numbered_sections_one_to_sixteen_at_least():
    numbers = design_sections(read(DESIGN))
    assert numbers == list(range(1, len(numbers) + 1)), (
        f"{DESIGN}'s sections must be numbered 1, 2, 3, ... in order (citations rely on the "
        f"numbers; add new sections at the end): {numbers}"
    )
    assert len(numbers) >= 16, f"{DESIGN} lost sections: {numbers}"


def test_no_file_cites_a_design_document_outside_the_repository():
    found = [hit for p in tracked_text_files() for hit in outside_citations(p, read(p))]
    assert not found, "citations of a document outside the repository:\n" + "\n".join(found)


def test_every_design_citation_names_an_existing_section():
    sections = set(design_sections(read(DESIGN)))
    files = tracked_text_files()
    assert DESIGN in files and len(files) > 50, files[:10]
    found = [hit for p in files for hit in bad_citations(p, read(p), sections)]
    assert not found, "design citations that lead nowhere:\n" + "\n".join(found)


def test_the_checks_catch_what_they_are_for():
    """Each check reports a planted fault with its file and line (a check that never fails
    would pass an unfollowable citation)."""
    sections = {1, 2, 3}
    text = (
        f"ok (docs/design.md {S}2, {S}3) and docs/design.md {S}1.2\n"
        f"# split over lines (docs/design.md\n# {S}3)\n"
        f"bad docs/design.md {S}4\n"
        f"range docs/design.md {S}2–4\n"
        f"bare ({S}2)\n"
    )
    assert bad_citations("x.py", text, sections) == [
        f"x.py:4: 'docs/design.md {S}4' names section(s) [4], which {DESIGN} does not have",
        f"x.py:5: 'docs/design.md {S}2–4' names section(s) [4], which {DESIGN} does not have",
        f"x.py:6: a bare {S}N: write it as {DESIGN} {S}N",
    ]
    assert bad_citations(DESIGN, f"see {S}3 and {S}9\n", sections) == [
        f"{DESIGN}:1: cross-reference to missing section(s) [9]"
    ]
    old = "DESIGN"
    outside = f"one\n(see {old}\n# {S}6) and ..{'/'}shared/{old}.md"
    assert [h.split(":")[:2] for h in outside_citations("y.md", outside)] == [
        ["y.md", "2"],
        ["y.md", "3"],
        ["y.md", "3"],
        ["y.md", "3"],
    ]
    assert outside_citations("z.py", 'DESIGNER = r"\\p{L}"; allowed = {"DESIGN"}') == []

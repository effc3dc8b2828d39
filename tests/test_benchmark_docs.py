"""docs/benchmarks.md and its notebook, docs/notes/benchmark-history.md, stay consistent with what points at them:
a section that code, tests or docs cite by name (`docs/benchmarks.md, "Batch limits"`) is a heading of that page,
benchmarks/report.py finds the one table per machine that it rewrites, every results file a figure names is in
docs/results/, and the reference names every module in benchmarks/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "benchmarks.md"
NOTEBOOK = ROOT / "docs" / "notes" / "benchmark-history.md"
RESULTS = ROOT / "docs" / "results"
SKIPPED = {".git", ".venv", "node_modules", "results", "__pycache__"}

# `docs/benchmarks.md, "Section"`, `docs/benchmarks.md "Section"`, `docs/benchmarks.md` ("Section"); the section's
# name may run onto the next line of a comment or docstring.
CITATION = re.compile(r"docs/(benchmarks\.md|notes/benchmark-history\.md)`?,?\s*\(?\"([^\"]+)\"")


def text_files() -> list[Path]:
    return [
        path
        for path in ROOT.rglob("*")
        if path.suffix in {".py", ".md", ".sh"}
        and not SKIPPED & set(path.relative_to(ROOT).parts)
        and path != Path(__file__).resolve()  # its examples
    ]


def joined(text: str) -> str:
    """The text with its line breaks, and the comment markers that open lines, read as one space."""
    return re.sub(r"\s*\n\s*(#\s*)?", " ", text)


def headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]


def test_every_section_cited_by_name_is_a_heading_of_its_page():
    pages = {"benchmarks.md": headings(REFERENCE), "notes/benchmark-history.md": headings(NOTEBOOK)}
    citations = [
        (path.relative_to(ROOT), page, name)
        for path in text_files()
        for page, name in CITATION.findall(joined(path.read_text(errors="replace")))
    ]
    assert citations  # the pattern still finds the citations it is for
    missing = [c for c in citations if not any(h.startswith(c[2]) for h in pages[c[1]])]
    assert missing == [], "cited by name but no heading of the page starts with it"


def test_the_reference_holds_one_table_for_each_machine_that_the_report_rewrites():
    text = REFERENCE.read_text()
    for machine in ("gpu", "cpu"):
        # benchmarks/report.py's pattern: the table between the markers, each on a line of its own
        tables = re.findall(rf"(<!-- report:{machine} -->\n).*?(\n<!-- /report -->)", text, re.S)
        assert len(tables) == 1, machine
    assert text.count("<!-- /report -->") == 2


def test_every_results_file_the_reference_names_is_in_docs_results():
    text = REFERENCE.read_text()
    named = set(re.findall(r"docs/results/([\w./<>-]+[\w/>])", text))
    named |= set(re.findall(r"\]\(results/([\w./-]+)\)", text))
    named |= set(re.findall(r"`([\w.-]+(?:/[\w.-]+)?(?:\.json|\.log|\.png|/))`", text))
    outputs = {"summary.json", "sweep.json", "base_sweep.json", ".whl/"}  # what the commands write, where told to
    unknown = {
        name
        for name in named - outputs
        if not (RESULTS / name).exists() and not (ROOT / name).exists() and "<" not in name  # <commit>: a slot
    }
    assert unknown == set()


def test_the_reference_names_every_benchmark_module():
    text = REFERENCE.read_text()
    modules = [path for path in (ROOT / "benchmarks").iterdir() if path.suffix in {".py", ".sh"}]
    unnamed = [
        path.name
        for path in modules
        if path.stem != "__init__"
        and not re.search(rf"`{path.stem}`|benchmarks\.{path.stem}\b|\b{path.stem}\.(py|sh)\b", text)
    ]
    assert unnamed == []

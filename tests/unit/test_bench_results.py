"""The benchmark docs and their raw results (docs/benchmarks.md, docs/benchmarks-log.md,
bench/results/): every link resolves, every result file is linked, and nothing writes results into
docs/ again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import RESULTS

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "benchmarks-log.md")
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTPUT = re.compile(r"--(?:json|plot)[ =](\S+)")


def prose(path: Path) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in prose(path).splitlines() if line.startswith("#")}


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(path)) if not re.match(r"[a-z]+://", m.group(1))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_resolves(doc: Path) -> None:
    broken = []
    for link in links(doc):
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(link)
    assert not broken


def test_every_result_file_is_linked_from_the_docs() -> None:
    linked = {(doc.parent / link.partition("#")[0]).resolve() for doc in DOCS for link in links(doc)}
    unlinked = [p.relative_to(ROOT) for p in sorted(RESULTS.rglob("*")) if p.is_file() and p not in linked]
    assert not unlinked


def test_results_are_kept_by_benchmark_and_not_in_docs() -> None:
    assert not [p.name for p in (ROOT / "docs").iterdir() if p.suffix in (".json", ".png")]
    assert all(p.parent.parent == RESULTS for p in RESULTS.rglob("*") if p.is_file())


def outputs(path: Path) -> list[str]:
    """The paths given to --json and --plot in a file (placeholders such as out.json have no /)."""
    return [m.group(1).strip("`'\")],") for m in OUTPUT.finditer(path.read_text()) if "/" in m.group(1)]


@pytest.mark.parametrize(
    "path",
    [*DOCS, *sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "bench").glob("*.sh"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_commands_write_results_to_bench_results(path: Path) -> None:
    assert [p for p in outputs(path) if not p.startswith("bench/results/")] == []


def test_the_makefile_writes_results_to_bench_results() -> None:
    paths = outputs(ROOT / "Makefile")
    assert paths
    assert [p for p in paths if not p.startswith("bench/results/")] == []

"""The house stays walkable: no Python module over 400 lines, and docs/benchmarks.md a page, not a diary."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "messages", "replicas", "transport", "tests")
MAX_MODULE_LINES = 400
MAX_BENCHMARK_PAGE_LINES = 300


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"


def test_the_benchmark_page_is_short() -> None:
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines < MAX_BENCHMARK_PAGE_LINES, f"docs/benchmarks.md has {lines} lines"

"""docs/benchmarks.md stays a page, not a diary (the structure's own tests: tests/test_structure.py)."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_BENCHMARK_PAGE_LINES = 300


def test_the_benchmark_page_is_short() -> None:
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines < MAX_BENCHMARK_PAGE_LINES, f"docs/benchmarks.md has {lines} lines"

"""The row every benchmark prints, and the measurement helpers they share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Literal

import msgspec


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One measured figure: zigzag (`project`) beside its pinned baseline, `ratio` = project / baseline."""

    bench: str
    case: str
    metric: str
    better: Literal["higher", "lower"]
    project: float
    baseline: float | None
    baseline_name: str | None
    ratio: float | None
    unit: str | None = None
    note: str | None = None


def row(
    bench: str,
    case: str,
    metric: str,
    better: Literal["higher", "lower"],
    project: float,
    baseline: float | None = None,
    baseline_name: str | None = None,
    *,
    unit: str | None = None,
    note: str | None = None,
) -> Row:
    ratio = None if baseline is None or baseline == 0 else project / baseline
    return Row(
        bench=bench,
        case=case,
        metric=metric,
        better=better,
        project=project,
        baseline=baseline,
        baseline_name=baseline_name if baseline is not None else None,
        ratio=ratio,
        unit=unit,
        note=note,
    )


def alternate(
    project: Callable[[], float], baseline: Callable[[], float], repeats: int, warmup: int = 1
) -> tuple[float, float]:
    """Median of `repeats` alternating runs of each callable (each returns its own figure)."""
    for _ in range(warmup):
        project()
        baseline()
    project_figures: list[float] = []
    baseline_figures: list[float] = []
    for _ in range(repeats):
        project_figures.append(project())
        baseline_figures.append(baseline())
    return statistics.median(project_figures), statistics.median(baseline_figures)


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took, by the monotonic high-resolution clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def warmed(measure: Callable[[], float]) -> Callable[[], float]:
    """`measure`, run once unrecorded first. zigzag's readers poll for a moment after their last bytes
    (`transport.protocol.link.POLL_SECONDS`), which would slow a baseline run right after them in the same
    processes; with this each side's recorded run follows a run of its own."""

    def run_twice() -> float:
        measure()
        return measure()

    return run_twice

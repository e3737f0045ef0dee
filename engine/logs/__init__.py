"""Structured log analysis: ``python -m engine.logs`` (docs/logs.md), and the aggregation the node's
`metrics` op shares with it.

Public API:

- `Aggregator` (`engine.logs.aggregate`): ``add(event)`` one typed event at a time.
- `metrics_result(aggregator, *, id, uptime_s=None, replicas=None) -> MetricsResult` (`engine.logs.metrics`).
- `LogSet(paths, label_logs=False)` / `read_entries(paths)` (`engine.logs.reader`): typed events of log
  files, merged by time, with warnings about damaged lines.
- `summarize(aggregator, logs=..., warnings=...) -> Summary`, `build_timeline(aggregator) -> Timeline`,
  `request_report(entries, request_id) -> RequestReport`.
"""

from engine.logs.aggregate import Aggregator
from engine.logs.metrics import metrics_result
from engine.logs.reader import Entry, LogError, LogSet, read_entries
from engine.logs.request import RequestNotFound, find_request, request_report
from engine.logs.summary import Summary, summarize
from engine.logs.timeline import Timeline, build_timeline

__all__ = [
    "Aggregator",
    "Entry",
    "LogError",
    "LogSet",
    "RequestNotFound",
    "Summary",
    "Timeline",
    "build_timeline",
    "find_request",
    "metrics_result",
    "read_entries",
    "request_report",
    "summarize",
]

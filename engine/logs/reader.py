"""Reading node logs: typed events from one or many JSON-lines files, merged by time.

Each file is read lazily, line by line (`LogFile.entries`), and decoded into the `messages.log.events.LogEvent`
union. A line that is not an event (not JSON, unknown event, missing field) is counted and skipped; the
first few are kept as examples. A last line without its newline that does not decode is the mark of a
writer that stopped mid-line (a crash): it is dropped with a warning and everything before it is used.

Several files (several nodes) merge by `ts` with `heapq.merge`: each file keeps its own order (the order the
node wrote), the merged stream interleaves files by time. With `label_logs`, replica names, request ids and
transfer ids get the file's label as a prefix (``a/decode-0``) so that independent nodes that use the same
names stay apart; without it, equal names are the same replica (a cluster's nodes log one request each on
their side).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple, final

import msgspec

from messages.log.events import LogEvent, NodeStarted, event_decoder

BAD_LINE_EXAMPLES: Final = 3
# Fields holding a name that `label_logs` qualifies, wherever they appear in an event (nested included).
# `replicas` is a list of names in `node_started` and a list of objects in `blocks_report`.
_NAME_FIELDS: Final = frozenset({"replica", "replicas", "request_id", "transfer_id", "source", "destination"})


class Entry(NamedTuple):
    """One event and where it was read: `log` indexes the files given, `line` is 1-based."""

    event: LogEvent
    log: int
    line: int


@final
class LogError(Exception):
    """A log cannot be read at all (missing, unreadable); the message names the path."""


@final
class LogStats(msgspec.Struct, kw_only=True):
    """What reading one file found; complete once its entries were consumed."""

    path: str
    label: str
    events: int = 0
    skipped_lines: int = 0
    bad_line_examples: list[str] = msgspec.field(default_factory=list)
    truncated_bytes: int = 0
    first_ts: float | None = None
    last_ts: float | None = None

    def warnings(self) -> list[str]:
        """Readable warnings about this file (empty when every line was an event)."""
        found: list[str] = []
        if self.truncated_bytes:
            found.append(
                f"{self.path}: the last line is cut off after {self.truncated_bytes} bytes (the writer "
                f"stopped mid-line, e.g. a crash); read the {self.events} events before it"
            )
        if self.skipped_lines:
            examples = "; ".join(self.bad_line_examples)
            found.append(
                f"{self.path}: skipped {self.skipped_lines} line(s) that are not events (e.g. {examples})"
            )
        if not self.events:
            found.append(f"{self.path}: no events found")
        return found


@final
class LogFile:
    """One log file, read lazily. Iterate `entries()` once; `stats` is filled as it goes."""

    def __init__(self, path: str | Path, index: int, label: str | None = None) -> None:
        self.path = Path(path)
        self.index = index
        self.stats = LogStats(path=str(path), label=label or self.path.stem)
        self._label_names = label is not None
        self._decoder = event_decoder()
        try:
            self._handle = self.path.open("rb")
        except OSError as exc:
            raise LogError(f"cannot read log {str(path)!r}: {exc.strerror or exc}") from exc

    def entries(self) -> Iterator[Entry]:
        """The file's events in file order; closes the file at the end (or when the iterator is closed)."""
        stats = self.stats
        with self._handle as handle:
            for number, raw in enumerate(handle, start=1):
                complete = raw.endswith(b"\n")
                line = raw.strip()
                if not line:
                    continue
                try:
                    event = self._decoder.decode(line)
                except msgspec.DecodeError as exc:
                    if not complete:
                        stats.truncated_bytes = len(raw)
                        return
                    stats.skipped_lines += 1
                    if len(stats.bad_line_examples) < BAD_LINE_EXAMPLES:
                        stats.bad_line_examples.append(f"line {number}: {exc}")
                    continue
                if self._label_names:
                    event = relabel(event, stats.label)
                stats.events += 1
                if stats.first_ts is None:
                    stats.first_ts = event.ts
                stats.last_ts = event.ts if stats.last_ts is None else max(stats.last_ts, event.ts)
                yield Entry(event, self.index, number)

    def close(self) -> None:
        self._handle.close()


def relabel(event: LogEvent, label: str) -> LogEvent:
    """`event` with every replica name, request id and transfer id prefixed by ``label/``."""
    fields = msgspec.to_builtins(event)
    qualified = _qualify(fields, label)
    return msgspec.convert(qualified, LogEvent)


def _qualify(value: Any, label: str, is_name: bool = False) -> Any:
    if isinstance(value, dict):
        return {key: _qualify(item, label, key in _NAME_FIELDS) for key, item in value.items()}
    if isinstance(value, list):
        return [_qualify(item, label, is_name) for item in value]
    if is_name and isinstance(value, str):
        return f"{label}/{value}"
    return value


@final
class LogSet:
    """Several log files read as one stream of entries merged by time.

    `entries()` may be iterated once. `stats` (one per file) and `warnings()` are complete after that.
    """

    def __init__(self, paths: Sequence[str | Path], *, label_logs: bool = False) -> None:
        if not paths:
            raise LogError("no log files given")
        labels = _labels(paths) if label_logs else [None] * len(paths)
        self.files: list[LogFile] = []
        try:
            for index, (path, label) in enumerate(zip(paths, labels, strict=True)):
                self.files.append(LogFile(path, index, label))
        except LogError:
            self.close()
            raise
        self._replica_logs: dict[str, set[int]] = {}

    @property
    def stats(self) -> list[LogStats]:
        return [file.stats for file in self.files]

    def entries(self) -> Iterator[Entry]:
        streams = [file.entries() for file in self.files]
        merged = heapq.merge(*streams, key=lambda entry: entry.event.ts) if len(streams) > 1 else streams[0]
        for entry in merged:
            if isinstance(entry.event, NodeStarted):
                for replica in entry.event.replicas:
                    self._replica_logs.setdefault(replica, set()).add(entry.log)
            yield entry

    def warnings(self) -> list[str]:
        """Per-file warnings, and replica names started by several logs (pass `label_logs` to split)."""
        found = [warning for file in self.files for warning in file.stats.warnings()]
        shared = sorted(name for name, logs in self._replica_logs.items() if len(logs) > 1)
        if shared:
            found.append(
                f"replica name(s) {', '.join(shared)} were started by several logs: they are analysed as one "
                "replica; pass --label-logs when the logs come from independent nodes"
            )
        return found

    def close(self) -> None:
        for file in self.files:
            file.close()


def _labels(paths: Sequence[str | Path]) -> list[str]:
    """File stems, made unique with ``#N`` where two files share a stem."""
    stems = [Path(path).stem for path in paths]
    return [stem if stems.count(stem) == 1 else f"{stem}#{index}" for index, stem in enumerate(stems)]


def read_entries(paths: Iterable[str | Path], *, label_logs: bool = False) -> tuple[list[Entry], LogSet]:
    """Every entry of `paths`, merged by time, and the `LogSet` that read them (for stats and warnings)."""
    logs = LogSet(list(paths), label_logs=label_logs)
    return list(logs.entries()), logs

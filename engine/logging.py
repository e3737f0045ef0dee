"""Structured logging: typed events (`messages.log.events`) as JSON lines to a file, readable lines to stderr.

`open_event_log(...)` builds an `EventLog`; the node calls `log.emit(event)`. `log.bind(request_id=...,
replica=...)` returns a log that fills those fields of the events it emits (where the event has them and
they are unset). Both sinks are structlog loggers: the file gets exactly `msgspec.json.encode(event)` and
a newline per event, flushed at once (so a crash loses nothing and a reader may follow the file); the
console gets structlog's `ConsoleRenderer` output. Events below the configured level go nowhere. The
console may have a level of its own (`console_level`), higher than the file's: the node's console shows
warnings and errors only (`node_console_level`), except at `debug`, and always the events of
`CONSOLE_ALWAYS` — the start and stop lines, the periodic serving summary and one access line per HTTP
request (unless `--disable-log-requests`), and the progress diagnostics of `CONSOLE_PROGRESS` (a GGUF
conversion, a weight load) — so it stays readable
while the file holds every request's events.

Writes are synchronous and small (one line each); emitting from worker threads is safe (structlog's
loggers lock their file). `close()` flushes and closes the file; emitting afterwards raises
`EventLogClosed`.

Observers (`open_event_log(observers=[...])`) get every emitted event, with its context, whatever the
level: the node feeds its `engine.logs.Aggregator` this way, so its `metrics` op counts what the
control server logs too. They are called one at a time (under a lock, so a thread-unsafe observer is
fine) and must not block or emit.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, BinaryIO, Final, TextIO, final

import msgspec
import structlog

from messages.log.events import Diagnostic, Event, Level, LogEvent, level_of

LEVELS: Final[dict[Level, int]] = {"debug": 10, "info": 20, "warning": 30, "error": 40}
CONTEXT_KEYS: Final = ("request_id", "replica")
# Shown on a console whatever its level: what a person at the node's terminal always wants to see.
CONSOLE_ALWAYS: Final = frozenset(
    {"node_started", "node_stopping", "node_stopped", "serving_summary", "http_access"}
)
# Diagnostics shown on a console whatever its level: the progress of what makes a start take seconds.
CONSOLE_PROGRESS: Final = frozenset({"model.converting", "model.converted", "weights.loaded"})


def node_console_level(level: Level) -> Level:
    """The node's console level for `--log-level` `level`: warnings and errors (with `CONSOLE_ALWAYS`),
    every event at `debug` — the per-request events go to `--log-file`."""
    return "debug" if level == "debug" else max(level, "warning", key=LEVELS.__getitem__)


class EventLogError(Exception):
    """Base class of logging errors."""


@final
class EventLogClosed(EventLogError):
    """`emit` after `close`."""


@final
class MissingContext(EventLogError):
    """An event lacks the context it requires (e.g. a request event without `request_id`)."""


@final
class LogFileError(EventLogError):
    """The log file cannot be opened."""


def _encode_event(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> bytes:
    return msgspec.json.encode(event_dict["typed"])


def _console_fields(_logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    event: Event = event_dict["typed"]
    fields = msgspec.to_builtins(event)  # JSON names ("from", not "from_state"), as in the file
    del fields["event"]
    ts = fields.pop("ts")
    rendered: dict[str, Any] = {
        "timestamp": datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3],
        "level": method,
        "event": event.__struct_config__.tag,
    }
    if isinstance(event, Diagnostic):  # read as the diagnostic it carries
        rendered["event"] = event.name
        fields = event.fields
    rendered.update((key, value) for key, value in fields.items() if value is not None)
    return rendered


@final
class _Sinks:
    """What every bound `EventLog` of one `open_event_log` call shares."""

    def __init__(
        self,
        file: BinaryIO | None,
        console: TextIO | None,
        level: Level,
        observers: Sequence[Callable[[LogEvent], None]] = (),
        console_level: Level | None = None,
    ) -> None:
        self.file = file
        self.observers = tuple(observers)
        self.observers_lock = threading.Lock()
        self.file_threshold = LEVELS[level]
        self.console_threshold = LEVELS[console_level or level]
        self.threshold = min(self.file_threshold, self.console_threshold)  # `EventLog.enabled`
        self.closed = False
        self.file_logger = (
            structlog.wrap_logger(
                structlog.BytesLogger(file),
                processors=[_encode_event],
                wrapper_class=structlog.make_filtering_bound_logger(self.file_threshold),
            )
            if file is not None
            else None
        )
        # Every level passes the console's wrapper: `EventLog.emit` filters, `CONSOLE_ALWAYS` aside.
        wrapper = structlog.make_filtering_bound_logger(LEVELS["debug"])
        self.console_logger = (
            structlog.wrap_logger(
                structlog.PrintLogger(console),
                processors=[
                    _console_fields,
                    structlog.dev.ConsoleRenderer(colors=console.isatty(), sort_keys=False),
                ],
                wrapper_class=wrapper,
            )
            if console is not None
            else None
        )


@final
class EventLog:
    """Emits typed events to the sinks of `open_event_log`, filling the bound context."""

    def __init__(self, sinks: _Sinks, context: dict[str, str]) -> None:
        self._sinks = sinks
        self.context = context

    def bind(self, *, request_id: str | None = None, replica: str | None = None) -> EventLog:
        """A log sharing these sinks whose events get `request_id` / `replica` where unset."""
        context = dict(self.context)
        if request_id is not None:
            context["request_id"] = request_id
        if replica is not None:
            context["replica"] = replica
        return EventLog(self._sinks, context)

    def enabled(self, level: Level) -> bool:
        """Whether events of `level` are written anywhere (skip building costly events otherwise)."""
        return LEVELS[level] >= self._sinks.threshold

    def emit(self, event: LogEvent) -> None:
        """Write `event` with the bound context. Raises `MissingContext`, `EventLogClosed`."""
        if self._sinks.closed:
            raise EventLogClosed(f"event {event.__struct_config__.tag!r} emitted after the log was closed")
        event = self._with_context(event)
        if self._sinks.observers:
            with self._sinks.observers_lock:
                for observer in self._sinks.observers:
                    observer(event)
        sinks, level, tag = self._sinks, level_of(event), event.__struct_config__.tag
        if sinks.file_logger is not None:
            getattr(sinks.file_logger, level)(tag, typed=event)
        if sinks.console_logger is not None and (
            LEVELS[level] >= sinks.console_threshold
            or tag in CONSOLE_ALWAYS
            or (isinstance(event, Diagnostic) and event.name in CONSOLE_PROGRESS)
        ):
            getattr(sinks.console_logger, level)(tag, typed=event)

    def flush(self) -> None:
        if self._sinks.file is not None and not self._sinks.closed:
            self._sinks.file.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent). The console stream is not closed."""
        if self._sinks.closed:
            return
        self._sinks.closed = True
        if self._sinks.file is not None:
            self._sinks.file.flush()
            self._sinks.file.close()

    def _with_context(self, event: LogEvent) -> LogEvent:
        fields = event.__struct_fields__
        updates = {
            key: value for key, value in self.context.items() if key in fields and getattr(event, key) is None
        }
        if updates:
            event = msgspec.structs.replace(event, **updates)
        missing = [key for key in event.required_context if getattr(event, key) is None]
        if missing:
            raise MissingContext(
                f"event {event.__struct_config__.tag!r} needs {', '.join(missing)}: pass it or bind it"
            )
        return event


def open_event_log(
    *,
    file: str | None,
    level: Level = "info",
    console: TextIO | None = sys.stderr,
    observers: Sequence[Callable[[LogEvent], None]] = (),
    console_level: Level | None = None,
) -> EventLog:
    """Open the node's event log: JSON lines appended to `file` (if any) from `level` up, readable lines
    to `console` (if any) from `console_level` (default: `level`) up and the events of `CONSOLE_ALWAYS`,
    every event to each of `observers`. Raises `LogFileError` naming the path when the file cannot be
    opened."""
    handle: BinaryIO | None = None
    if file is not None:
        try:
            handle = open(file, "ab")  # noqa: SIM115 -- closed by EventLog.close
        except OSError as exc:
            raise LogFileError(f"log file {file!r}: {exc.strerror or exc}") from exc
    return EventLog(_Sinks(handle, console, level, observers, console_level), {})


@final
class _DiagnosticsRoute:
    """The event log diagnostics go to while one is open (`route_diagnostics`); None: `stream`."""

    log: EventLog | None = None


_route = _DiagnosticsRoute()
_DIAGNOSTIC_LEVELS: Final[dict[str, Level]] = {
    "debug": "debug",
    "info": "info",
    "msg": "info",
    "warning": "warning",
    "warn": "warning",
    "error": "error",
    "exception": "error",
    "critical": "error",
}


def route_diagnostics(log: EventLog | None) -> None:
    """Send the untyped diagnostics to `log` as `diagnostic` events — into its file and onto its console
    (so `--no-log-console` quiets them too) — until called with None, before `log` closes."""
    _route.log = log


def _into_event_log(_logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
    log = _route.log
    if log is None:
        return event_dict
    name = str(event_dict.pop("event", ""))
    fields = {key: str(value) for key, value in event_dict.items()}
    try:
        log.emit(Diagnostic(severity=_DIAGNOSTIC_LEVELS.get(method, "warning"), name=name, fields=fields))
    except EventLogClosed:  # a worker thread's diagnostic as the node stops: `stream` still gets it
        event_dict["event"] = name
        return event_dict
    raise structlog.DropEvent


@final
class _CurrentStderr:
    """`sys.stderr` as it is at each write, not as it was when diagnostics were configured: an entry
    point run in-process (a test's, while its output is captured) must not leave the diagnostics of
    later code writing to a stream that has been closed since."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_diagnostics(
    level: Level = "info", stream: TextIO | None = None, *, stream_level: Level | None = None
) -> None:
    """Route the untyped diagnostics of library code (`structlog.get_logger(...)` in `transport/` and
    the controller: a link closed, a handshake refused) at `level` and above to the event log
    `route_diagnostics` names (which writes each to its sinks at their levels), or, while none is, to
    `stream` (default: standard error, as it is at each write) at `stream_level` (default: `level`) and
    above. Entry points call this once; without it
    structlog's default prints them on stdout, where the node's `listening` line and the benchmarks'
    JSON rows go."""
    threshold = LEVELS[stream_level or level]

    def quiet_stream(_logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        shown = LEVELS[_DIAGNOSTIC_LEVELS.get(method, "warning")] >= threshold
        if not shown and event_dict.get("event") not in CONSOLE_PROGRESS:
            raise structlog.DropEvent
        return event_dict

    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(stream or _CurrentStderr()),  # type: ignore[arg-type]
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        processors=[
            _into_event_log,
            quiet_stream,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        cache_logger_on_first_use=True,
    )

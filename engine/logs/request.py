"""The `request` report: one request's events in time order, with the time between them and the
duration of each phase an event closes, then its latency breakdown.

`find_request(entries, wanted)` resolves an id or a unique prefix of one (request ids are often uuids);
`request_report(entries, request_id)` builds the `RequestReport` that ``request --json`` prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, final

import msgspec

from engine.logs.aggregate import Aggregator
from engine.logs.reader import Entry
from messages.control_replies import Timings
from messages.log.events import (
    EncodeFinished,
    EncodeStarted,
    FirstToken,
    LogEvent,
    PrefillFinished,
    PrefillStarted,
    RequestArrived,
    RequestCancelled,
    RequestEvent,
    RequestFailed,
    RequestFinished,
    TransferFinished,
    TransferStarted,
)

SUGGESTIONS: Final = 5
_COMMON_FIELDS: Final = frozenset({"event", "ts", "request_id", "replica"})


@final
class RequestNotFound(Exception):
    """No request, or several, match the id asked for; the message says which exist."""


class EventRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One event: `at` seconds since the request's first event, `since_previous` since the one before,
    `took` the duration of the phase this event closes (null for other events)."""

    at: float
    since_previous: float
    took: float | None
    event: str
    replica: str | None
    log: int
    line: int
    fields: dict[str, Any]


class RequestReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    request_id: str
    start_ts: float
    outcome: str | None
    timings: Timings
    transfers: list[str]
    events: list[EventRow]


def _request_id(event: LogEvent) -> str | None:
    return event.request_id if isinstance(event, RequestEvent) else None


def find_request(entries: Sequence[Entry], wanted: str) -> str:
    """The request id equal to `wanted`, else the only one starting with it. Raises `RequestNotFound`."""
    ids = list(dict.fromkeys(rid for entry in entries if (rid := _request_id(entry.event)) is not None))
    if wanted in ids:
        return wanted
    matches = [rid for rid in ids if rid.startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown = ", ".join(matches[:SUGGESTIONS]) + (", ..." if len(matches) > SUGGESTIONS else "")
        raise RequestNotFound(
            f"request id prefix {wanted!r} matches {len(matches)} requests ({shown}); give more of it"
        )
    if not ids:
        raise RequestNotFound(f"no request {wanted!r}: the logs hold no request events")
    shown = ", ".join(ids[:SUGGESTIONS]) + (", ..." if len(ids) > SUGGESTIONS else "")
    raise RequestNotFound(f"no request {wanted!r} in the logs ({len(ids)} requests, e.g. {shown})")


def _phase_key(event: LogEvent) -> tuple[str, bool] | None:
    """(what the event starts or ends, whether it starts it); None for other events."""
    match event:
        case RequestArrived():
            return "request", True
        case EncodeStarted() | PrefillStarted():
            return type(event).__name__.removesuffix("Started"), True
        case EncodeFinished() | PrefillFinished():
            return type(event).__name__.removesuffix("Finished"), False
        case TransferStarted():
            return f"transfer {event.transfer_id}", True
        case TransferFinished():
            return f"transfer {event.transfer_id}", False
        case FirstToken() | RequestFinished() | RequestCancelled() | RequestFailed():
            return "request", False
        case _:
            return None


def request_report(entries: Sequence[Entry], request_id: str) -> RequestReport:
    """Every event of `request_id` in `entries` (already in time order). Raises `RequestNotFound`."""
    mine = [entry for entry in entries if _request_id(entry.event) == request_id]
    if not mine:
        raise RequestNotFound(f"no request {request_id!r} in the logs")
    aggregator = Aggregator()
    starts: dict[str, float] = {}
    origin = previous = mine[0].event.ts
    rows = []
    for entry in mine:
        event = entry.event
        aggregator.add(event)
        took = None
        key = _phase_key(event)
        if key is not None:
            name, starting = key
            if starting:
                starts.setdefault(name, event.ts)
            elif name in starts:
                took = event.ts - starts[name]
        fields = {k: v for k, v in msgspec.to_builtins(event).items() if k not in _COMMON_FIELDS}
        rows.append(
            EventRow(
                at=event.ts - origin,
                since_previous=event.ts - previous,
                took=took,
                event=str(event.__struct_config__.tag),
                replica=getattr(event, "replica", None),
                log=entry.log,
                line=entry.line,
                fields=fields,
            )
        )
        previous = event.ts
    record = aggregator.requests[request_id]
    return RequestReport(
        request_id=request_id,
        start_ts=origin,
        outcome=record.outcome,
        timings=record.timings(),
        transfers=record.transfer_ids,
        events=rows,
    )

"""The `timeline` data: one lane per replica (its states over time, lock periods, failures) and the
requests' spans beneath, in seconds from the first event.

`build_timeline(aggregator)` gives a `Timeline`, which ``timeline --json`` prints and
`engine.logs.plot.draw_timeline` draws. Requests are packed into rows first-fit (a request goes to the
first row whose previous request ended before it arrived), so overlapping requests sit on separate rows.
"""

from __future__ import annotations

from typing import Final

import msgspec

from engine.logs.aggregate import Aggregator
from engine.logs.counts import CountPoint, count_series
from engine.logs.records import RequestRecord, replica_order

DEFAULT_MAX_ROWS: Final = 48


class Data(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the timeline's values; times are seconds from `Timeline.start_ts`."""


class Segment(Data, frozen=True, kw_only=True):
    state: str
    start: float
    end: float
    # The state still held when the log ended (the segment is cut at the log's end).
    open: bool


class LockPeriod(Data, frozen=True, kw_only=True):
    start: float
    end: float
    reasons: list[str]
    open: bool


class Failure(Data, frozen=True, kw_only=True):
    at: float
    error: str


class Lane(Data, frozen=True, kw_only=True):
    replica: str
    segments: list[Segment]
    locks: list[LockPeriod]
    failures: list[Failure]


class Phase(Data, frozen=True, kw_only=True):
    """A part of a request: queued, encode, embedding_transfer, prefill, kv_transfer, decode."""

    name: str
    start: float
    end: float
    replica: str | None


class RequestSpan(Data, frozen=True, kw_only=True):
    request_id: str
    start: float
    end: float
    # stop, length, cancelled, failed; null when the log ended first.
    outcome: str | None
    row: int
    phases: list[Phase]


class RelayMark(Data, frozen=True, kw_only=True):
    """A ZigZag relay: `new_prefill` handed a batch to `old_prefill` after `layer` layers."""

    at: float
    new_prefill: str
    old_prefill: str
    layer: int


class Timeline(Data, frozen=True, kw_only=True):
    start_ts: float
    end: float
    lanes: list[Lane]
    requests: list[RequestSpan]
    rows: int
    relays: list[RelayMark] = msgspec.field(default_factory=list)
    # Replicas per role (not Inactive) and requests in flight over time (`engine.logs.counts`).
    counts: list[CountPoint] = msgspec.field(default_factory=list)


def _phases(request: RequestRecord, end: float) -> list[tuple[str, float, float, str | None]]:
    found: list[tuple[str, float, float, str | None]] = []
    if request.arrived is not None and request.first_work is not None:
        found.append(("queued", request.arrived, request.first_work, None))
    spans = (
        ("encode", request.encode),
        ("embedding_transfer", request.transfers["embedding"]),
        ("prefill", request.prefill),
        ("kv_transfer", request.transfers["kv"]),
    )
    for name, span in spans:
        if span.start is not None:
            found.append((name, span.start, span.end if span.end is not None else end, span.replica))
    kv_end = request.transfers["kv"].end
    decode_start = kv_end if kv_end is not None else request.first_token
    if decode_start is not None and request.outcome != "failed":
        # Decode follows the KV migration (prefill sampled the first token before it).
        stop = request.ended if request.ended is not None else end
        found.append(("decode", decode_start, stop, request.replicas[-1] if request.replicas else None))
    return found


def build_timeline(aggregator: Aggregator, *, max_rows: int = DEFAULT_MAX_ROWS) -> Timeline:
    """Lanes and request spans of everything `aggregator` was fed. Beyond `max_rows` rows of requests,
    further requests share rows (row = index modulo `max_rows`) rather than growing the picture."""
    if aggregator.first_ts is None or aggregator.last_ts is None:
        raise ValueError("the timeline of a log without events is empty")
    origin, last = aggregator.first_ts, aggregator.last_ts
    lanes = []
    for name in sorted(aggregator.replicas, key=replica_order):
        replica = aggregator.replicas[name]
        lanes.append(
            Lane(
                replica=name,
                segments=[
                    Segment(
                        state=state,
                        start=start - origin,
                        end=(last if stop is None else stop) - origin,
                        open=stop is None,
                    )
                    for state, start, stop in replica.segments
                ],
                locks=[
                    LockPeriod(
                        start=start - origin,
                        end=(last if stop is None else stop) - origin,
                        reasons=sorted(reasons),
                        open=stop is None,
                    )
                    for start, stop, reasons in replica.locks
                ],
                failures=[Failure(at=ts - origin, error=error) for ts, error in replica.failures],
            )
        )
    spans: list[RequestSpan] = []
    row_ends: list[float] = []
    requests = sorted(
        (request for request in aggregator.requests.values() if _first_seen(request) is not None),
        key=lambda request: _first_seen(request) or 0.0,
    )
    for request in requests:
        phases = _phases(request, last)
        begin = _first_seen(request) or origin
        finish = max([request.ended or begin, *(stop for _, _, stop, _ in phases)])
        row = next((index for index, row_end in enumerate(row_ends) if row_end <= begin), len(row_ends))
        if row == len(row_ends):
            if row < max_rows:
                row_ends.append(finish)
            else:
                row = len(spans) % max_rows
        row_ends[row] = max(row_ends[row], finish)
        spans.append(
            RequestSpan(
                request_id=request.request_id,
                start=begin - origin,
                end=finish - origin,
                outcome=request.outcome,
                row=row,
                phases=[
                    Phase(name=name, start=start - origin, end=stop - origin, replica=replica)
                    for name, start, stop, replica in phases
                ],
            )
        )
    relays = [
        RelayMark(at=ts - origin, new_prefill=new, old_prefill=old, layer=layer)
        for ts, new, old, layer in aggregator.relays
    ]
    counts = count_series(
        [
            (lane.replica, [(s.state, s.start, None if s.open else s.end) for s in lane.segments])
            for lane in lanes
        ],
        [(span.start, None if span.outcome is None else span.end) for span in spans],
    )
    return Timeline(
        start_ts=origin,
        end=last - origin,
        lanes=lanes,
        requests=spans,
        rows=len(row_ends),
        relays=relays,
        counts=counts,
    )


def _first_seen(request: RequestRecord) -> float | None:
    candidates = [
        ts
        for ts in (request.arrived, request.first_work, request.encode.start, request.prefill.start)
        if ts is not None
    ]
    return min(candidates) if candidates else None

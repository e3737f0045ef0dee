"""A node's cumulative load, counted from its event log (what the planner and `/metrics` read).

`LoadCounters` is an event-log observer of one node: requests and prompt tokens admitted (and the output
tokens they asked for), prompt tokens prefilled and the busy seconds of the prefill batches that did it
(a batch counted once: its requests share its start), and the bytes and seconds of finished KV
transfers, and — with a TTFT SLO — the first tokens and those that missed it; it also feeds the
provisioning lead times (`engine.logs.lead`). The planner turns its totals into rates
(`engine.planner.signals`); the HTTP API exports them (`engine.http.metrics`).
"""

from __future__ import annotations

from collections import deque
from typing import final

import msgspec

from engine.logs.lead import LeadTimes
from messages.cluster import LoadTotals
from messages.log.events import (
    FirstToken,
    LogEvent,
    PrefillFinished,
    RequestArrived,
    RequestCancelled,
    RequestFailed,
    TransferFinished,
)


@final
class LoadCounters:
    """An event-log observer (called under the log's lock; never blocks, never emits)."""

    def __init__(self) -> None:
        self.totals = LoadTotals()
        self._batches: deque[tuple[str | None, float]] = deque(maxlen=256)
        # The TTFT SLO (seconds, and seconds per prompt token; 0: off), set by the planner.
        self.slo: tuple[float, float] = (0.0, 0.0)
        self._prompts: dict[str, int] = {}  # request id -> prompt tokens, until its first token or end
        self.lead = LeadTimes()  # the provisioning lead time per weight source (`engine.logs.lead`)

    def observe(self, event: LogEvent) -> None:
        self.lead.observe(event)
        t = self.totals
        match event:
            case RequestArrived(prompt_tokens=tokens, max_tokens=asked) if tokens:
                self.totals = msgspec.structs.replace(
                    t,
                    arrived_tokens=t.arrived_tokens + tokens,
                    arrived_requests=t.arrived_requests + 1,
                    arrived_output_tokens=t.arrived_output_tokens + asked,
                )
                if self.slo[0] > 0 and event.request_id is not None:
                    self._prompts[event.request_id] = tokens
            case FirstToken(ttft_s=ttft) if self.slo[0] > 0:
                floor, per_token = self.slo
                limit = max(floor, per_token * self._prompts.pop(event.request_id or "", 0))
                self.totals = msgspec.structs.replace(
                    t, first_tokens=t.first_tokens + 1, slo_misses=t.slo_misses + (ttft > limit)
                )
            case PrefillFinished(tokens=tokens, seconds=seconds):
                batch = (event.replica, round(event.ts - seconds, 3))
                busy = t.prefill_busy_s
                if batch not in self._batches:
                    self._batches.append(batch)
                    busy += seconds
                self.totals = msgspec.structs.replace(
                    t, prefilled_tokens=t.prefilled_tokens + tokens, prefill_busy_s=busy
                )
            case TransferFinished(kind="kv", status="success", bytes=nbytes, seconds=seconds):
                self.totals = msgspec.structs.replace(
                    t, kv_bytes=t.kv_bytes + nbytes, kv_seconds=t.kv_seconds + seconds
                )
            case RequestFailed() | RequestCancelled():  # ended before its first token: forget it
                self._prompts.pop(event.request_id or "", None)
            case _:
                pass

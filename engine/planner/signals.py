"""What the planner reads: cumulative load counters from the event log, and rates over a window.

`LoadCounters` is an event-log observer of one node: requests and prompt tokens admitted (and the output
tokens they asked for), prompt tokens prefilled and the busy seconds of the prefill batches that did it
(a batch counted once: its requests share its start), and the bytes and seconds of finished KV
transfers, and — with a TTFT SLO — the first tokens and those that missed it; it also feeds the
provisioning lead times (`engine.planner.lead`). Every node reports its counters to the others
(`messages.cluster.Report.load`), so the cluster's leader sums them. `RateWindow` turns successive
totals into per-second rates over the last `window` seconds (arrivals: the higher of that and the rate
over the window's last quarter, so a burst shows at once).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import final

import msgspec

from engine.planner.lead import LeadTimes
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
        self.lead = LeadTimes()  # the provisioning lead time per weight source (`engine.planner.lead`)

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


def add(a: LoadTotals, b: LoadTotals) -> LoadTotals:
    return LoadTotals(
        arrived_tokens=a.arrived_tokens + b.arrived_tokens,
        prefilled_tokens=a.prefilled_tokens + b.prefilled_tokens,
        prefill_busy_s=a.prefill_busy_s + b.prefill_busy_s,
        kv_bytes=a.kv_bytes + b.kv_bytes,
        kv_seconds=a.kv_seconds + b.kv_seconds,
        first_tokens=a.first_tokens + b.first_tokens,
        slo_misses=a.slo_misses + b.slo_misses,
        arrived_requests=a.arrived_requests + b.arrived_requests,
        arrived_output_tokens=a.arrived_output_tokens + b.arrived_output_tokens,
    )


@final
@dataclass(frozen=True, slots=True)
class Rates:
    """Per second over the window; the capacities are what one replica did while busy (0: unmeasured)."""

    arriving_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0  # of one prefill replica while it computes
    migration_bytes_per_s: float = 0.0  # KV bytes moved per second, all replicas
    migration_bytes_per_s_per_replica: float = 0.0  # of one transfer while it moves
    slo_miss_fraction: float = 0.0  # of the first tokens in the window, those past the TTFT SLO


@final
class RateWindow:
    """Rates from totals sampled at each planner pass (see the module docstring)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: deque[tuple[float, LoadTotals]] = deque()

    def sample(self, now: float, totals: LoadTotals) -> Rates:
        self._samples.append((now, totals))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        then, old = self._samples[0]
        span = now - then
        if span <= 0:
            return Rates()
        busy = totals.prefill_busy_s - old.prefill_busy_s
        moved = totals.kv_seconds - old.kv_seconds
        kv = totals.kv_bytes - old.kv_bytes
        firsts = totals.first_tokens - old.first_tokens
        # Arrivals also over the window's last quarter: a burst shows at once, a lull only after a window.
        recent_at, recent = next(
            ((t, x) for t, x in self._samples if now - t <= self.window / 4), (now, totals)
        )
        recent_span = now - recent_at
        arriving = (totals.arrived_tokens - old.arrived_tokens) / span
        if recent_span > 0:
            arriving = max(arriving, (totals.arrived_tokens - recent.arrived_tokens) / recent_span)
        return Rates(
            arriving_tokens_per_s=arriving,
            prefill_tokens_per_s=(totals.prefilled_tokens - old.prefilled_tokens) / busy if busy > 0 else 0.0,
            migration_bytes_per_s=kv / span,
            migration_bytes_per_s_per_replica=kv / moved if moved > 0 else 0.0,
            slo_miss_fraction=(totals.slo_misses - old.slo_misses) / firsts if firsts > 0 else 0.0,
        )


def with_capacity(rates: Rates, *, prefill_tokens_per_s: float, migration_bytes_per_s: float) -> Rates:
    """`rates` with a configured capacity in place of the measured one (0 in the config: measured)."""
    if prefill_tokens_per_s > 0:
        rates = replace(rates, prefill_tokens_per_s=prefill_tokens_per_s)
    if migration_bytes_per_s > 0:
        rates = replace(rates, migration_bytes_per_s_per_replica=migration_bytes_per_s)
    return rates

"""What the planner reads: the nodes' cumulative load counters (`engine.logs.load.LoadCounters`, which
every node reports to the others in `messages.cluster.Report.load`, so the cluster's leader sums them
with `add`), and rates over a window. `RateWindow` turns successive totals into per-second rates over
the last `window` seconds (arrivals: the higher of that and the rate over the window's last quarter, so
a burst shows at once).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import final

from messages.cluster import LoadTotals


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
    arriving_requests_per_s: float = 0.0  # over the same span as the tokens
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
        requests = (totals.arrived_requests - old.arrived_requests) / span
        if recent_span > 0:
            lately = (totals.arrived_tokens - recent.arrived_tokens) / recent_span
            if lately > arriving:
                arriving = lately
                requests = (totals.arrived_requests - recent.arrived_requests) / recent_span
        return Rates(
            arriving_tokens_per_s=arriving,
            arriving_requests_per_s=requests,
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

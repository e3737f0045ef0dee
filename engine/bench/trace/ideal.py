"""The bound beside static provisioning's figures: the same arrivals on ideal replicas.

`ideal_static(trace, replicas, tokens_per_s, slo)`: every request, in arrival order, starts on the
replica that frees first (at its arrival if one is idle) and computes its prompt at exactly the
emulated speed, `prompt tokens / tokens_per_s` seconds — no batching with others, no host, no
decode, no transfer, no scheduling delay. Its TTFT is its wait plus that time: what the router's first
come, first served dispatch to the least busy replica would reach on perfect replicas. The measured
static way is judged against it: what is lost beyond it is the node's (queueing inside a replica,
batching, the host's cores that emulate several accelerators, the decode replica's share of them).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from engine.bench.trace.gen import TraceRequest
from engine.bench.trace.slo import Slo, quantile


def ideal_static(
    trace: Sequence[TraceRequest], replicas: int, tokens_per_s: float, slo: Slo
) -> tuple[float, float, float]:
    """(SLO attainment, TTFT p50, TTFT p99) of `trace` on `replicas` ideal replicas (module docstring)."""
    if replicas < 1 or tokens_per_s <= 0:
        raise ValueError("the ideal model needs at least one replica and a positive speed")
    free = [0.0] * replicas
    ttfts: list[float] = []
    met = 0
    for request in sorted(trace, key=lambda r: r.at):
        start = max(request.at, heapq.heappop(free))
        end = start + request.prompt_tokens / tokens_per_s
        heapq.heappush(free, end)
        ttft = end - request.at
        ttfts.append(ttft)
        met += ttft <= slo.limit(request.prompt_tokens)
    if not ttfts:
        return float("nan"), float("nan"), float("nan")
    return met / len(ttfts), quantile(ttfts, 0.5), quantile(ttfts, 0.99)

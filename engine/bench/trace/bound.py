"""The feasible bound: the fewest prefill replica-seconds of any schedule that meets the SLO as often as
static provisioning does — for the trace's own arrivals, under the queueing model of the node
(`engine.bench.trace.queueing`).

A schedule is a prefill count per `window` seconds, between 1 and the cap. Its cost is its replica-seconds
over the trace's span, plus `lead` replica-seconds for every replica it adds (the copy and start-up of a
replica asked for `lead` seconds before it serves; the node starts with the first window's count loaded,
as static's does). It is feasible when its modelled attainment is at least static's modelled attainment
(`target`).

Method. The cost of a schedule is a sum over windows and its misses are nearly one: requests arriving in a
window are served mostly by that window's replicas. So, for a price `price` per missed request, a dynamic
program over (window, count) finds the schedule minimising `cost + price × misses`, each window's misses
counted by the model with that window's requests alone on that window's count, from an empty queue. Each
schedule found is then played whole through the model — queues carried from window to window — and
repaired until feasible there (a replica added to the window whose arrivals miss most, again and again).
The cheapest repaired schedule over `PRICES` prices, or a constant count if one is cheaper (static's
count is one of them, so the bound is never above static's cost), is the bound. It is the cheapest feasible
schedule the method finds, not a proof that none is cheaper; the trace bench checks it against every way's
measured replica-seconds and attainment and says when a way beat it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from engine.bench.trace.gen import TraceRequest
from engine.bench.trace.queueing import ReplicaModel, attainment, first_tokens
from engine.bench.trace.slo import Slo

PRICES = 24  # prices of a miss tried, halving from one above any schedule's cost


@final
@dataclass(frozen=True, slots=True)
class Bound:
    """The schedule found (`counts`, a step function from 0 s), its cost and its modelled attainment."""

    counts: tuple[tuple[float, int], ...]
    replica_seconds: float  # prefill replicas over the span, loading included
    loading_seconds: float  # of which: `lead` per replica added
    attainment: float
    target: float
    span: float


def cost(counts: Sequence[tuple[float, int]], span: float, lead: float) -> tuple[float, float]:
    """(replica-seconds over [0, span] including loading, the loading's share) of a step function."""
    total = 0.0
    loading = 0.0
    for index, (start, replicas) in enumerate(counts):
        end = counts[index + 1][0] if index + 1 < len(counts) else span
        total += replicas * max(0.0, min(end, span) - start)
        if index:
            loading += lead * max(0, replicas - counts[index - 1][1])
    return total + loading, loading


def feasible_bound(
    trace: Sequence[TraceRequest],
    replica: ReplicaModel,
    slo: Slo,
    *,
    target: float,
    span: float,
    window: float,
    lead: float,
    cap: int,
) -> Bound:
    """See the module docstring. `target` is the attainment to reach (static's, modelled); when no
    schedule within the cap reaches it, the bound is the cap everywhere."""
    if window <= 0 or cap < 1 or span <= 0:
        raise ValueError("the bound needs a positive window and span and a cap of at least one replica")
    windows = max(1, math.ceil(span / window))
    members: list[list[TraceRequest]] = [[] for _ in range(windows)]
    for request in trace:
        members[min(windows - 1, int(request.at // window))].append(request)
    misses = [[_window_misses(group, k, replica, slo) for k in range(1, cap + 1)] for group in members]

    def schedule(price: float) -> list[int]:
        best = [window * k + price * misses[0][k - 1] for k in range(1, cap + 1)]
        back: list[list[int]] = []
        for w in range(1, windows):
            row, links = [], []
            for k in range(1, cap + 1):
                step = window * k + price * misses[w][k - 1]
                options = [best[j - 1] + lead * max(0, k - j) for j in range(1, cap + 1)]
                j = min(range(cap), key=options.__getitem__) + 1
                row.append(options[j - 1] + step)
                links.append(j)
            best = row
            back.append(links)
        k = min(range(cap), key=best.__getitem__) + 1
        picked = [k]
        for links in reversed(back):
            k = links[k - 1]
            picked.append(k)
        picked.reverse()
        return picked

    def steps(picked: Sequence[int]) -> tuple[tuple[float, int], ...]:
        found: list[tuple[float, int]] = []
        for w, k in enumerate(picked):
            if not found or found[-1][1] != k:
                found.append((w * window, k))
        return tuple(found)

    def repaired(picked: list[int]) -> tuple[tuple[float, int], ...] | None:
        """`picked` with a replica added, one at a time, to the window whose arrivals miss most when the
        whole schedule is played (queues carried over); None when the cap everywhere cannot reach it."""
        while True:
            ttfts = first_tokens(trace, steps(picked), replica)
            if attainment(trace, ttfts, slo) >= target - 1e-9:
                return steps(picked)
            missed = [0] * windows
            for request, ttft in zip(trace, ttfts, strict=True):
                if ttft > slo.limit(request.prompt_tokens) + 1e-9:
                    missed[min(windows - 1, int(request.at // window))] += 1
            open_windows = [w for w in range(windows) if picked[w] < cap and missed[w]]
            if not open_windows:
                return None
            picked[max(open_windows, key=missed.__getitem__)] += 1

    def played(counts: tuple[tuple[float, int], ...]) -> float:
        return attainment(trace, first_tokens(trace, counts, replica), slo)

    # The constant counts are schedules too (static's among them): the bound is never above the cheapest
    # of them that is feasible.
    constants: list[tuple[tuple[float, int], ...]] = [((0.0, k),) for k in range(1, cap + 1)]
    feasible = [c for c in constants if played(c) >= target - 1e-9]
    top = float(window * cap * (len(trace) + 1))  # a miss priced above any schedule's cost
    for index in range(PRICES):
        found = repaired(schedule(top * 2.0 ** (index - PRICES + 1)))
        if found is not None:
            feasible.append(found)
    chosen = min(feasible, key=lambda c: cost(c, span, lead)[0], default=((0.0, cap),))
    total, loading = cost(chosen, span, lead)
    return Bound(chosen, total, loading, played(chosen), target, span)


def _window_misses(group: Sequence[TraceRequest], replicas: int, replica: ReplicaModel, slo: Slo) -> int:
    if not group:
        return 0
    origin = group[0].at
    shifted = [TraceRequest(r.at - origin, r.prompt_tokens, r.output_tokens) for r in group]
    ttfts = first_tokens(shifted, ((0.0, replicas),), replica)
    return sum(t > slo.limit(r.prompt_tokens) + 1e-9 for r, t in zip(shifted, ttfts, strict=True))

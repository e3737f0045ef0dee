"""The `trace` benchmark's figures: SLO attainment, TTFT and TPOT quantiles, replica-seconds.

A request meets its SLO when it succeeded and its TTFT (the node's `timings.ttft_s`) is at most
`max(floor, per_token × prompt tokens)` (`--slo-ttft-floor` 0.3 s, `--slo-ttft-per-token` 0.000375 s); a
failed request misses it. Attainment is the fraction that meet it. Quantiles are of the requests that
succeeded. Replica-seconds are the integral, from the trace's start to the last request's end, of the
number of replicas in any state but `Inactive` (loading and `ShuttingNull` replicas count), read as a step
function from `status` replies polled during the run (`ReplicaSample`s); `spent` splits them by role and
into those loading and draining.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import final


@final
@dataclass(frozen=True, slots=True)
class Outcome:
    """One replayed request."""

    at: float  # its arrival, seconds from the trace's start
    prompt_tokens: int
    output_tokens: int
    ttft: float | None  # None: failed
    tpot: float | None
    end: float  # when its result (or error) came, seconds from the trace's start
    error: str | None = None


@final
@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """One `status` reply: when (seconds from the trace's start) and how many replicas were not Inactive."""

    at: float
    active: int
    prefill: int
    decode: int
    loading: int = 0  # of the active: copying weights (`Loading*`, `NewPrefill`)
    draining: int = 0  # of the active: `Shutting*` (finishing their work, or idle keeping weights)


@final
@dataclass(frozen=True, slots=True)
class Slo:
    floor: float = 0.3
    per_token: float = 0.000375

    def limit(self, prompt_tokens: int) -> float:
        return max(self.floor, self.per_token * prompt_tokens)

    def met(self, outcome: Outcome) -> bool:
        return outcome.ttft is not None and outcome.ttft <= self.limit(outcome.prompt_tokens)


@final
@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    failed: int
    attainment: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    replica_seconds: float
    span: float  # seconds from the trace's start to the last request's end
    spent: Spent

    @property
    def mean_replicas(self) -> float:
        return self.replica_seconds / self.span if self.span > 0 else math.nan


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (nan when empty)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def attainment(outcomes: Sequence[Outcome], slo: Slo) -> float:
    return sum(slo.met(o) for o in outcomes) / len(outcomes) if outcomes else math.nan


def replica_seconds(
    samples: Sequence[ReplicaSample],
    start: float,
    end: float,
    count: Callable[[ReplicaSample], int] = lambda s: s.active,
) -> float:
    """The integral over [start, end] of `count` (the active replicas), each sample holding until the next."""
    ordered = sorted(samples, key=lambda s: s.at)
    total = 0.0
    for index, sample in enumerate(ordered):
        following = ordered[index + 1].at if index + 1 < len(ordered) else end
        lo, hi = max(sample.at, start), min(following, end)
        if hi > lo:
            total += count(sample) * (hi - lo)
    return total


@final
@dataclass(frozen=True, slots=True)
class Spent:
    """Where the replica-seconds went: per role, and those of replicas loading or draining (of both)."""

    prefill: float
    decode: float
    loading: float
    draining: float


def spent(samples: Sequence[ReplicaSample], start: float, end: float) -> Spent:
    return Spent(
        prefill=replica_seconds(samples, start, end, lambda s: s.prefill),
        decode=replica_seconds(samples, start, end, lambda s: s.decode),
        loading=replica_seconds(samples, start, end, lambda s: s.loading),
        draining=replica_seconds(samples, start, end, lambda s: s.draining),
    )


def summarize(outcomes: Sequence[Outcome], samples: Sequence[ReplicaSample], slo: Slo) -> Summary:
    served = [o for o in outcomes if o.ttft is not None]
    span = max((o.end for o in outcomes), default=0.0)
    return Summary(
        requests=len(outcomes),
        failed=len(outcomes) - len(served),
        attainment=attainment(outcomes, slo),
        ttft_p50=quantile([o.ttft for o in served if o.ttft is not None], 0.5),
        ttft_p99=quantile([o.ttft for o in served if o.ttft is not None], 0.99),
        tpot_p50=quantile([o.tpot for o in served if o.tpot is not None], 0.5),
        tpot_p99=quantile([o.tpot for o in served if o.tpot is not None], 0.99),
        replica_seconds=replica_seconds(samples, 0.0, span),
        span=span,
        spent=spent(samples, 0.0, span),
    )

"""The `summary` report: an `Aggregator`'s contents as plain typed tables (what ``--json`` prints).

`summarize(aggregator, logs=..., warnings=...)` builds a `Summary`; `engine.logs.tables` renders it as text.
Every table is a list of rows with stable field names (docs/logs.md explains each), so scripts can read
``python -m engine.logs summary --json`` without parsing text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from engine.logs.aggregate import Aggregator, FlowKey
from engine.logs.reader import LogStats
from engine.logs.records import replica_order
from messages.control_replies import Timings

PHASES: Final = tuple(Timings.__struct_fields__)


class Report(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the summary's rows."""


class LatencyRow(Report, frozen=True, kw_only=True):
    """One phase over the requests that finished (stop or length) and went through it; seconds."""

    phase: str
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


class RequestRow(Report, frozen=True, kw_only=True):
    arrived: int
    seen: int
    finished_stop: int
    finished_length: int
    cancelled: int
    failed: int
    queued: int
    running: int
    prompt_tokens: int
    generated_tokens: int
    cancel_reasons: dict[str, int]


class TransferRow(Report, frozen=True, kw_only=True):
    """Finished transfers of one kind over one transport; `rounds` maps rounds → transfers."""

    kind: str
    transport: str
    count: int
    succeeded: int
    failed: int
    rounds: dict[int, int]
    bytes: int
    tokens: int
    seconds: float
    gb_per_s: float | None


class StateRow(Report, frozen=True, kw_only=True):
    """Time one replica spent in one state; `share` of the replica's logged time."""

    replica: str
    state: str
    seconds: float
    share: float
    entered: int


class LockRow(Report, frozen=True, kw_only=True):
    replica: str
    periods: int
    seconds: float
    reasons: list[str]


class FlowRow(Report, frozen=True, kw_only=True):
    source: str
    destination: str
    kind: str
    bytes: int


class ErrorRow(Report, frozen=True, kw_only=True):
    code: str
    count: int
    example: str


class PrefixRow(Report, frozen=True, kw_only=True):
    """One replica's prefix cache: the prompts that started prefill there, their tokens, those whose KV
    came from the cache (`hit_tokens`; `hit_rate` = hit_tokens / prompt_tokens), and the blocks cached
    and evicted as the controller last reported them (`cached_blocks` None: never reported)."""

    replica: str
    prompts: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    cached_blocks: int | None
    evicted_blocks: int


class LogRow(Report, frozen=True, kw_only=True):
    path: str
    events: int
    skipped_lines: int
    truncated_bytes: int
    first_ts: float | None
    last_ts: float | None


class Summary(Report, frozen=True, kw_only=True):
    logs: list[LogRow]
    warnings: list[str]
    start_ts: float | None
    span_s: float
    requests: RequestRow
    latency: list[LatencyRow]
    transfers: list[TransferRow]
    unfinished_transfers: int
    transfer_failures: dict[str, int]
    states: list[StateRow]
    locks: list[LockRow]
    flows: list[FlowRow]
    reported_flows: list[FlowRow]
    errors: list[ErrorRow]
    problems: list[str]
    events: dict[str, int]
    prefix: list[PrefixRow] = []


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of non-empty ascending values: the smallest value with at least p% of the
    values at or below it (always a value that occurred)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 < p <= 100:
        raise ValueError(f"percentile {p} is outside (0, 100]")
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def latency_rows(aggregator: Aggregator) -> list[LatencyRow]:
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for request in aggregator.requests.values():
        if request.outcome not in ("stop", "length"):
            continue
        timings = request.timings()
        for phase in PHASES:
            value = getattr(timings, phase)
            if value is not None:
                samples[phase].append(value)
    rows = []
    for phase, values in samples.items():
        if not values:
            continue
        values.sort()
        rows.append(
            LatencyRow(
                phase=phase.removesuffix("_s"),
                count=len(values),
                mean=sum(values) / len(values),
                p50=percentile(values, 50),
                p90=percentile(values, 90),
                p99=percentile(values, 99),
                max=values[-1],
            )
        )
    return rows


def state_rows(aggregator: Aggregator, end: float) -> tuple[list[StateRow], list[LockRow]]:
    """Per replica: seconds in each state (open segments end at `end`), and its lock periods."""
    states: list[StateRow] = []
    locks: list[LockRow] = []
    for name in sorted(aggregator.replicas, key=replica_order):
        replica = aggregator.replicas[name]
        seconds: dict[str, float] = {}
        entered: dict[str, int] = {}
        for state, start, stop in replica.segments:
            seconds[state] = seconds.get(state, 0.0) + max(0.0, (end if stop is None else stop) - start)
            entered[state] = entered.get(state, 0) + 1
        total = sum(seconds.values())
        states.extend(
            StateRow(
                replica=name,
                state=state,
                seconds=value,
                share=value / total if total > 0 else 0.0,
                entered=entered[state],
            )
            for state, value in seconds.items()
        )
        if replica.locks:
            reasons: list[str] = sorted({reason for _, _, held in replica.locks for reason in held})
            locked_s = sum(
                max(0.0, (end if stop is None else stop) - start) for start, stop, _ in replica.locks
            )
            locks.append(LockRow(replica=name, periods=len(replica.locks), seconds=locked_s, reasons=reasons))
    return states, locks


def _flow_rows(flows: Mapping[FlowKey, int]) -> list[FlowRow]:
    return [
        FlowRow(source=source, destination=destination, kind=kind, bytes=count)
        for (source, destination, kind), count in sorted(flows.items())
    ]


def _problems(aggregator: Aggregator) -> list[str]:
    found: list[str] = []
    for name, replica in sorted(aggregator.replicas.items()):
        found.extend(f"replica {name} failed: {error}" for _, error in replica.failures)
    found.extend(
        f"{leak.replica}: {leak.leaked_blocks} block(s) of pool {leak.pool} leaked (owners {leak.owners})"
        for leak in aggregator.leaks
    )
    found.extend(
        f"fault {fault} injected {count} time(s)" for fault, count in sorted(aggregator.faults.items())
    )
    for (level, name), count in sorted(aggregator.diagnostics.items()):
        example = " ".join(
            f"{key}={value}" for key, value in aggregator.diagnostic_examples[(level, name)].items()
        )
        found.append(f"{level} {name} {count} time(s), first: {example}")
    if aggregator.slow_clients:
        found.append(f"{aggregator.slow_clients} client(s) too slow: their requests were cancelled")
    stopped = aggregator.node_stopped
    if stopped is not None and (stopped.exit_code != 0 or stopped.leaked_blocks):
        found.append(
            f"the node exited with code {stopped.exit_code}, {stopped.leaked_blocks} block(s) leaked"
        )
    return found


def summarize(
    aggregator: Aggregator, *, logs: Sequence[LogStats] = (), warnings: Sequence[str] = ()
) -> Summary:
    """The summary of everything `aggregator` was fed; `logs` and `warnings` come from the reader."""
    start = aggregator.first_ts
    end = aggregator.last_ts if aggregator.last_ts is not None else 0.0
    queued, running = aggregator.live_requests()
    outcomes = aggregator.outcomes
    states, locks = state_rows(aggregator, end)
    transfers = [
        TransferRow(
            kind=kind,
            transport=transport,
            count=totals.succeeded + totals.failed,
            succeeded=totals.succeeded,
            failed=totals.failed,
            rounds=dict(sorted(totals.rounds.items())),
            bytes=totals.bytes,
            tokens=totals.tokens,
            seconds=totals.seconds,
            gb_per_s=totals.bytes / totals.seconds / 1e9 if totals.seconds > 0 else None,
        )
        for (kind, transport), totals in sorted(aggregator.transfer_totals.items())
    ]
    return Summary(
        logs=[
            LogRow(
                path=log.path,
                events=log.events,
                skipped_lines=log.skipped_lines,
                truncated_bytes=log.truncated_bytes,
                first_ts=log.first_ts,
                last_ts=log.last_ts,
            )
            for log in logs
        ],
        warnings=list(warnings),
        start_ts=start,
        span_s=end - start if start is not None else 0.0,
        requests=RequestRow(
            arrived=aggregator.arrived,
            seen=len(aggregator.requests),
            finished_stop=outcomes["stop"],
            finished_length=outcomes["length"],
            cancelled=outcomes["cancelled"],
            failed=outcomes["failed"],
            queued=queued,
            running=running,
            prompt_tokens=aggregator.prompt_tokens,
            generated_tokens=aggregator.generated_tokens,
            cancel_reasons=dict(sorted(aggregator.cancel_reasons.items())),
        ),
        latency=latency_rows(aggregator),
        transfers=transfers,
        unfinished_transfers=aggregator.unfinished_transfers(),
        transfer_failures=dict(sorted(aggregator.transfer_failures.items())),
        states=states,
        locks=locks,
        flows=_flow_rows(aggregator.flows),
        reported_flows=_flow_rows(aggregator.reported_flows),
        errors=[
            ErrorRow(code=code, count=count, example=aggregator.error_examples[code])
            for code, count in sorted(aggregator.errors.items())
        ],
        problems=_problems(aggregator),
        events=dict(sorted(aggregator.events.items())),
        prefix=prefix_rows(aggregator),
    )


def prefix_rows(aggregator: Aggregator) -> list[PrefixRow]:
    """Per replica where prompts started prefill: its prefix cache's hits and blocks."""
    return [
        PrefixRow(
            replica=name,
            prompts=replica.prompts,
            prompt_tokens=replica.prompt_tokens,
            hit_tokens=replica.cached_tokens,
            hit_rate=replica.cached_tokens / replica.prompt_tokens if replica.prompt_tokens else 0.0,
            cached_blocks=replica.prefix_blocks,
            evicted_blocks=replica.prefix_evicted,
        )
        for name, replica in sorted(aggregator.replicas.items(), key=lambda item: replica_order(item[0]))
        if replica.prompts
    ]

"""The node's `metrics` reply built from an `Aggregator`: the counters `python -m engine.logs summary`
shows, live.

The node keeps one ``Aggregator(keep_requests=False)``, feeds it every event it emits, and answers the
`metrics` op with `metrics_result(aggregator, id=..., uptime_s=..., replicas=...)`. Replica gauges are
best taken from the replicas themselves (`replicas=`); without them they come from the last state,
lock and block figures the log showed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

from engine.logs.aggregate import Aggregator
from messages.control_replies import (
    MetricsResult,
    ReplicaGauge,
    RequestCounters,
    TokenCounters,
    TransferCounters,
)
from messages.log.events import Transfer


def transfer_counters(aggregator: Aggregator) -> list[TransferCounters]:
    """Finished transfers per kind (all transports together), kinds in a fixed order, absent when none."""
    counters = []
    for kind in get_args(Transfer):
        rows = [totals for (row_kind, _), totals in aggregator.transfer_totals.items() if row_kind == kind]
        if not rows:
            continue
        rounds: dict[int, int] = {}
        for totals in rows:
            for count, transfers in totals.rounds.items():
                rounds[count] = rounds.get(count, 0) + transfers
        counters.append(
            TransferCounters(
                kind=kind,
                succeeded=sum(totals.succeeded for totals in rows),
                failed=sum(totals.failed for totals in rows),
                rounds=dict(sorted(rounds.items())),
                bytes=sum(totals.bytes for totals in rows),
                seconds=sum(totals.seconds for totals in rows),
            )
        )
    return counters


def replica_gauges(aggregator: Aggregator) -> list[ReplicaGauge]:
    """The last state, used blocks and lock the events showed, for each replica whose state is known."""
    return [
        ReplicaGauge(
            name=replica.name,
            state=replica.state,
            used_blocks=replica.used_blocks,
            total_blocks=replica.total_blocks,
            locked=replica.locked,
        )
        for replica in aggregator.replicas.values()
        if replica.state is not None
    ]


def metrics_result(
    aggregator: Aggregator,
    *,
    id: str,
    uptime_s: float | None = None,
    replicas: Sequence[ReplicaGauge] | None = None,
) -> MetricsResult:
    """The `metrics` reply for client id `id`. `uptime_s` defaults to the time from `node_started` (or the
    first event) to the last event; `replicas` to `replica_gauges(aggregator)`."""
    queued, running = aggregator.live_requests()
    outcomes = aggregator.outcomes
    if uptime_s is None:
        start = aggregator.node_started if aggregator.node_started is not None else aggregator.first_ts
        uptime_s = 0.0 if start is None or aggregator.last_ts is None else aggregator.last_ts - start
    return MetricsResult(
        id=id,
        uptime_s=max(0.0, uptime_s),
        requests=RequestCounters(
            arrived=aggregator.arrived,
            queued=queued,
            running=running,
            finished_stop=outcomes["stop"],
            finished_length=outcomes["length"],
            cancelled=outcomes["cancelled"],
            failed=outcomes["failed"],
        ),
        tokens=TokenCounters(prompt=aggregator.prompt_tokens, generated=aggregator.generated_tokens),
        transfers=transfer_counters(aggregator),
        errors=dict(sorted(aggregator.errors.items())),
        replicas=list(replicas) if replicas is not None else replica_gauges(aggregator),
    )

"""The provisioning lead time: how long a replica takes from the start of its weight copy until it serves,
measured per weight source from the node's own event log (docs/planner.md).

`LeadTimes` is fed the log's events (through `engine.logs.load.LoadCounters`, under the log's
lock; it never blocks, never emits). A replica's `WeightsCopyStarted` names the sources its copy will
try, the first being the one it copies from (`auto` picks peer, then host, then disk); when that
replica next reaches `Prefill` or `Decode` the seconds since the copy started — the copy, the
executor's start-up, a ZigZag episode's end — are that source's latest lead time. A copy that fails or
is aborted is forgotten. `seconds(source)` is the latest measured (None: no copy from it seen yet).
"""

from __future__ import annotations

from typing import Final, final

from messages.log.events import LogEvent, ReplicaStateChanged
from messages.log.scaling import WeightsCopyFinished, WeightsCopyStarted, WeightsSourceName

SERVING: Final = frozenset({"Prefill", "Decode"})


@final
class LeadTimes:
    """See the module docstring."""

    def __init__(self) -> None:
        self._copying: dict[str, tuple[WeightsSourceName, float]] = {}  # replica → (source, copy start)
        self.measured: dict[WeightsSourceName, float] = {}

    def observe(self, event: LogEvent) -> None:
        match event:
            case WeightsCopyStarted(sources=[first, *_], replica=str(replica)):
                self._copying[replica] = (first, event.ts)
            case WeightsCopyFinished(status="failed" | "aborted", replica=str(replica)):
                self._copying.pop(replica, None)
            case ReplicaStateChanged(to_state=state, replica=str(replica)) if state in SERVING:
                copying = self._copying.pop(replica, None)
                if copying is not None:
                    source, started = copying
                    self.measured[source] = max(0.0, event.ts - started)
            case _:
                pass

    def seconds(self, source: WeightsSourceName) -> float | None:
        return self.measured.get(source)

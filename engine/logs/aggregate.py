"""The counters of a node's life, fed one typed event at a time: `Aggregator.add(event)`.

The same object serves `python -m engine.logs` (fed from files) and the node's `metrics` op (fed each event
as it is emitted, see `engine.logs.metrics.metrics_result`). It is pure and synchronous: no I/O, no clock
(time comes from the events' `ts`), not thread-safe (feed it from one task).

Memory: with ``keep_requests=True`` (the analyser) every request and transfer is kept for the latency
tables and the timeline. With ``keep_requests=False`` (a long-running node) a request or transfer is
forgotten once it ended and was counted; the ids of the last `RECENT_IDS` ended ones are remembered so that
a late event about them (the other side of a transfer, a second terminal event) is not counted twice.

Counting rules (docs/logs.md): a request's outcome is its first terminal event (`request_finished`,
`request_cancelled`, `request_failed`); a transfer is counted by its first `transfer_finished`, its bytes
in the flow matrix by round (rounds deduplicated by number); errors by code count every error reply the
log shows: `request_failed` by its code, `control_bad_line` as `bad_request`, `control_handler_error` as
`internal`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Final, assert_never, final

from engine.logs.records import Outcome, ReplicaRecord, RequestRecord, TransferRecord
from messages.control import ErrorCode
from messages.log import scaling
from messages.log.events import (
    BlocksReport,
    ClientConnected,
    ClientDisconnected,
    ControlBadLine,
    ControlHandlerError,
    Diagnostic,
    EncodeFinished,
    EncodeStarted,
    FaultInjected,
    FirstToken,
    FlowReport,
    GpuReport,
    HttpAccess,
    LogEvent,
    NodeConfigured,
    NodeStarted,
    NodeStopped,
    NodeStopping,
    PoolLeak,
    PrefillFinished,
    PrefillStarted,
    ReplicaFailed,
    ReplicaLocked,
    ReplicaStateChanged,
    ReplicaUnlocked,
    RequestArrived,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    ServingSummary,
    SlowClient,
    Transfer,
    TransferFinished,
    TransferRound,
    TransferStarted,
    WeightsProgress,
)

RECENT_IDS: Final = 65536
FlowKey = tuple[str, str, Transfer]  # source, destination, kind


@final
class TransferTotals:
    """Finished transfers of one kind over one transport."""

    __slots__ = ("bytes", "failed", "rounds", "seconds", "succeeded", "tokens")

    def __init__(self) -> None:
        self.succeeded = 0
        self.failed = 0
        self.rounds: Counter[int] = Counter()
        self.bytes = 0
        self.tokens = 0
        self.seconds = 0.0


@final
class _Recent:
    """The last `limit` keys seen (insertion order), for ignoring late duplicates in bounded memory."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        if len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


@final
class Aggregator:
    """Counters, per-request and per-transfer records, replica lanes. Feed it with `add`."""

    def __init__(self, *, keep_requests: bool = True) -> None:
        self.keep_requests = keep_requests
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.node_started: float | None = None
        self.node_stopped: NodeStopped | None = None
        self.stopping: NodeStopping | None = None
        self.events: Counter[str] = Counter()
        self.requests: dict[str, RequestRecord] = {}
        self.transfers: dict[str, TransferRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        # ZigZag relays: (ts, new_prefill, old_prefill, layer), as the OldPrefill replica received them.
        self.relays: list[tuple[float, str, str, int]] = []
        self.arrived = 0
        self.outcomes: Counter[Outcome] = Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cancel_reasons: Counter[str] = Counter()
        self.transfer_totals: dict[tuple[Transfer, str], TransferTotals] = {}
        self.transfer_failures: Counter[str] = Counter()
        self.flows: Counter[FlowKey] = Counter()
        self.reported_flows: Counter[FlowKey] = Counter()
        self.errors: Counter[ErrorCode] = Counter()
        self.error_examples: dict[ErrorCode, str] = {}
        self.disconnects: Counter[str] = Counter()
        self.connections = 0
        self.slow_clients = 0
        self.faults: Counter[str] = Counter()
        self.leaks: list[PoolLeak] = []
        # Diagnostics at warning or error, by (level, name), with the fields of the first of each.
        self.diagnostics: Counter[tuple[str, str]] = Counter()
        self.diagnostic_examples: dict[tuple[str, str], dict[str, str]] = {}
        self._ended_requests = _Recent(RECENT_IDS)
        self._reused: Counter[str] = Counter()
        self._ended_transfers = _Recent(RECENT_IDS)

    # ------------------------------------------------------------------ feeding
    def add(self, event: LogEvent) -> None:
        """Account for one event. Events may come slightly out of time order (several writers)."""
        ts = event.ts
        self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
        self.events[str(event.__struct_config__.tag)] += 1
        match event:
            case NodeStarted():
                if self.node_started is None:
                    self.node_started = ts
                for name in event.replicas:
                    self._replica(name)
            case NodeStopping():
                self.stopping = event
            case NodeStopped():
                self.node_stopped = event
            case ClientConnected():
                self.connections += 1
            case ClientDisconnected():
                self.disconnects[event.reason] += 1
            case ControlBadLine():
                self._error("bad_request", event.message)
            case SlowClient():
                self.slow_clients += 1
            case ControlHandlerError():
                self._error("internal", f"{event.op}: {event.error}")
            case (
                RequestArrived()
                | RequestQueued()
                | EncodeStarted()
                | EncodeFinished()
                | PrefillStarted()
                | PrefillFinished()
                | FirstToken()
                | RequestFinished()
                | RequestCancelled()
                | RequestFailed()
            ):
                self._request_event(event)
            case TransferStarted() | TransferRound() | TransferFinished():
                self._transfer_event(event)
            case ReplicaStateChanged():
                replica = self._replica(event.replica)
                if replica.state is None and self.node_started is not None and self.node_started <= ts:
                    replica.enter(event.from_state, self.node_started)
                replica.enter(event.to_state, ts)
                replica.transitions += 1
            case ReplicaLocked():
                replica = self._replica(event.replica)
                replica.lock(event.reason, ts)
                replica.used_blocks, replica.total_blocks = event.used_blocks, event.total_blocks
            case ReplicaUnlocked():
                self._replica(event.replica).unlock(event.reason, event.still_locked, ts)
            case ReplicaFailed():
                self._replica(event.replica).failures.append((ts, event.error))
            case FaultInjected():
                self.faults[event.fault] += 1
            case PoolLeak():
                self.leaks.append(event)
            case BlocksReport():
                for report in event.replicas:
                    replica = self._replica(report.replica)
                    if replica.state is None:
                        replica.enter(report.state, ts)
                    replica.used_blocks, replica.total_blocks = report.used_blocks, report.total_blocks
                    replica.locked = report.locked
                    replica.prefix_reported(report.prefix_blocks, report.prefix_evicted)
            case FlowReport():
                for flow in event.flows:
                    self.reported_flows[(flow.source, flow.destination, flow.kind)] += flow.bytes
            case Diagnostic():
                if event.severity in ("warning", "error"):
                    key = (event.severity, event.name)
                    self.diagnostics[key] += 1
                    self.diagnostic_examples.setdefault(key, event.fields)
            case NodeConfigured() | WeightsProgress() | GpuReport() | ServingSummary() | HttpAccess():
                pass
            case scaling.WeightsCopyStarted() | scaling.WeightsCopyFinished() | scaling.ExecutorReady():
                pass
            case scaling.RelayReceived():
                self.relays.append((event.ts, event.new_prefill, event.old_prefill, event.layer))
            case scaling.ReplicasPaired() | scaling.RelayHandedOver() | scaling.PlannerDecision():
                pass
            case _:
                assert_never(event)

    def _replica(self, name: str | None) -> ReplicaRecord:
        key = name or "?"
        replica = self.replicas.get(key)
        if replica is None:
            replica = self.replicas[key] = ReplicaRecord(key)
        return replica

    def _error(self, code: ErrorCode, message: str) -> None:
        self.errors[code] += 1
        self.error_examples.setdefault(code, message)

    # ------------------------------------------------------------------ requests
    def _request_event(
        self,
        event: RequestArrived
        | RequestQueued
        | EncodeStarted
        | EncodeFinished
        | PrefillStarted
        | PrefillFinished
        | FirstToken
        | RequestFinished
        | RequestCancelled
        | RequestFailed,
    ) -> None:
        if isinstance(event, RequestFailed):
            self._error(event.code, event.message)
        request_id = event.request_id or "?"
        if isinstance(event, RequestArrived):
            self._new_arrival(request_id)
        elif request_id in self._ended_requests:
            return
        request = self.requests.get(request_id)
        if request is None:
            request = self.requests[request_id] = RequestRecord(request_id)
        request.saw_replica(event.replica)
        ts = event.ts
        match event:
            case RequestArrived():
                if request.arrived is None:
                    self.arrived += 1
                request.arrived = ts
                request.prompt_tokens = event.prompt_tokens
                request.images = event.images
            case RequestQueued():
                if event.queue == "migration":
                    request.start_work(ts)
            case EncodeStarted():
                request.start_work(ts)
                request.encode.open(ts, event.replica)
            case EncodeFinished():
                request.encode.close(ts)
            case PrefillStarted():
                if event.replica is not None:  # each start, as Prometheus counts prefix-cache queries
                    self._replica(event.replica).prompt_started(event.tokens, event.cached_tokens)
                request.start_work(ts)
                request.prefill.open(ts, event.replica)
                request.prompt_tokens = request.prompt_tokens or event.tokens
            case PrefillFinished():
                request.prefill.close(ts)
            case FirstToken():
                if request.first_token is None or ts < request.first_token:
                    request.first_token = ts
                    request.reported_ttft = event.ttft_s
            case RequestFinished():
                request.finished = request.finished or event
                request.prompt_tokens = event.prompt_tokens
                request.output_tokens = event.output_tokens
                self._end(request, event.finish_reason, ts)
            case RequestCancelled():
                self.cancel_reasons[event.reason] += 1
                request.output_tokens = event.output_tokens
                self._end(request, "cancelled", ts)
            case RequestFailed():
                request.error_code = request.error_code or event.code
                self._end(request, "failed", ts)
            case _:
                assert_never(event)

    def _new_arrival(self, request_id: str) -> None:
        """A client may use a request id again once its request ended (ids are unique among live
        requests only): the arrival starts a new request, and the ended one keeps its record under
        `{id}#{n}` (n = 1, 2, ...), so neither request's counts or times mix with the other's."""
        self._ended_requests.discard(request_id)
        earlier = self.requests.get(request_id)
        if earlier is None or earlier.outcome is None:
            return
        self._reused[request_id] += 1
        self.requests[f"{request_id}#{self._reused[request_id]}"] = self.requests.pop(request_id)

    def _end(self, request: RequestRecord, outcome: Outcome, ts: float) -> None:
        if request.outcome is not None:
            return
        request.outcome = outcome
        request.ended = ts
        self.outcomes[outcome] += 1
        self.generated_tokens += request.output_tokens or 0
        self.prompt_tokens += request.prompt_tokens or 0
        if not self.keep_requests:
            del self.requests[request.request_id]
            self._ended_requests.add(request.request_id)

    # ------------------------------------------------------------------ transfers
    def _transfer_event(self, event: TransferStarted | TransferRound | TransferFinished) -> None:
        if event.transfer_id in self._ended_transfers:
            return
        transfer = self.transfers.get(event.transfer_id)
        if transfer is None:
            transfer = self.transfers[event.transfer_id] = TransferRecord(
                event.transfer_id, event.kind, event.source, event.destination, event.transport
            )
        transfer.request_id = transfer.request_id or event.request_id
        request = self.requests.get(event.request_id or "?")
        if request is not None and event.transfer_id not in request.transfer_ids:
            request.transfer_ids.append(event.transfer_id)
        span = request.transfers[event.kind] if request is not None else None
        ts = event.ts
        flow: FlowKey = (event.source, event.destination, event.kind)
        match event:
            case TransferStarted():
                transfer.started = ts if transfer.started is None else min(transfer.started, ts)
                if span is not None:
                    span.open(ts, event.source)
            case TransferRound():
                if event.round not in transfer.round_bytes:
                    transfer.round_bytes[event.round] = event.bytes
                    if not transfer.flow_from_finish:
                        self.flows[flow] += event.bytes
            case TransferFinished():
                if span is not None:
                    span.open(ts - event.seconds, event.source)
                    span.close(ts)
                if transfer.finished is not None:
                    return
                transfer.finished, transfer.finished_ts = event, ts
                if not transfer.round_bytes:
                    transfer.flow_from_finish = True
                    if event.bytes:
                        self.flows[flow] += event.bytes
                totals = self.transfer_totals.get((event.kind, event.transport))
                if totals is None:
                    totals = self.transfer_totals[(event.kind, event.transport)] = TransferTotals()
                if event.status == "success":
                    totals.succeeded += 1
                else:
                    totals.failed += 1
                    self.transfer_failures[event.reason or "no reason given"] += 1
                totals.rounds[event.rounds] += 1
                totals.bytes += event.bytes
                totals.tokens += event.tokens
                totals.seconds += event.seconds
                if not self.keep_requests:
                    del self.transfers[event.transfer_id]
                    self._ended_transfers.add(event.transfer_id)
            case _:
                assert_never(event)

    # ------------------------------------------------------------------ gauges
    def live_requests(self) -> tuple[int, int]:
        """(queued, running): requests not ended, split by whether any work started on them."""
        queued = running = 0
        for request in self.requests.values():
            if request.outcome is None:
                if request.started:
                    running += 1
                else:
                    queued += 1
        return queued, running

    def unfinished_transfers(self) -> int:
        return sum(1 for transfer in self.transfers.values() if transfer.finished is None)

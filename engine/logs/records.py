"""What the aggregator remembers about one request, one transfer and one replica, as events arrive.

These are mutable accumulators owned by one `engine.logs.aggregate.Aggregator`; nothing here reads files
or renders. Times are the events' `ts` (float seconds since the epoch). A `Span` widens to cover every
start and end it is given, so a phase logged by two replicas (both sides of a transfer) or repeated
(several images) counts from its first start to its last end.
"""

from __future__ import annotations

from typing import Literal, final

from messages.control import ErrorCode, LockReason, ReplicaStateName
from messages.control_replies import Timings
from messages.log.events import RequestFinished, Transfer, TransferFinished

Outcome = Literal["stop", "length", "cancelled", "failed"]


@final
class Span:
    """A phase from its earliest start to its latest end; `replica` is where it started."""

    __slots__ = ("end", "replica", "start")

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.replica: str | None = None

    def open(self, ts: float, replica: str | None) -> None:
        if self.start is None or ts < self.start:
            self.start = ts
            self.replica = replica

    def close(self, ts: float) -> None:
        if self.end is None or ts > self.end:
            self.end = ts

    @property
    def seconds(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start


@final
class RequestRecord:
    """One request's timestamps and outcome. `outcome` is set by its first terminal event."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.arrived: float | None = None
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.images = 0
        self.first_work: float | None = None
        self.encode = Span()
        self.prefill = Span()
        self.transfers: dict[Transfer, Span] = {"embedding": Span(), "kv": Span(), "pull": Span()}
        self.transfer_ids: list[str] = []
        self.first_token: float | None = None
        self.reported_ttft: float | None = None
        self.ended: float | None = None
        self.outcome: Outcome | None = None
        self.error_code: ErrorCode | None = None
        self.finished: RequestFinished | None = None
        self.replicas: list[str] = []

    def saw_replica(self, replica: str | None) -> None:
        if replica is not None and replica not in self.replicas:
            self.replicas.append(replica)

    def start_work(self, ts: float) -> None:
        if self.first_work is None or ts < self.first_work:
            self.first_work = ts

    @property
    def started(self) -> bool:
        return self.first_work is not None

    def timings(self) -> Timings:
        """The latency breakdown from event timestamps; the node's own figures where a timestamp is
        missing (a log that begins after the request arrived)."""
        finished = self.finished
        ttft = tpot = e2e = None
        if self.arrived is not None and self.first_token is not None:
            ttft = self.first_token - self.arrived
        elif self.reported_ttft is not None:
            ttft = self.reported_ttft
        elif finished is not None:
            ttft = finished.ttft_s
        if self.ended is not None and self.first_token is not None and (self.output_tokens or 0) > 1:
            tpot = (self.ended - self.first_token) / ((self.output_tokens or 0) - 1)
        elif finished is not None:
            tpot = finished.tpot_s
        if self.arrived is not None and self.ended is not None:
            e2e = self.ended - self.arrived
        elif finished is not None:
            e2e = finished.e2e_s
        queued = None
        if self.arrived is not None and self.first_work is not None:
            queued = self.first_work - self.arrived
        return Timings(
            queued_s=queued,
            encode_s=self.encode.seconds,
            embedding_transfer_s=self.transfers["embedding"].seconds,
            prefill_s=self.prefill.seconds,
            kv_transfer_s=self.transfers["kv"].seconds,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=e2e,
        )


@final
class TransferRecord:
    """One transfer, possibly logged by both sides: rounds are deduplicated by number, and the first
    `transfer_finished` is the one counted."""

    def __init__(
        self, transfer_id: str, kind: Transfer, source: str, destination: str, transport: str
    ) -> None:
        self.transfer_id = transfer_id
        self.kind: Transfer = kind
        self.source = source
        self.destination = destination
        self.transport = transport
        self.request_id: str | None = None
        self.started: float | None = None
        self.round_bytes: dict[int, int] = {}
        self.finished: TransferFinished | None = None
        self.finished_ts: float | None = None
        # Set when the finish event brought the bytes to the flow matrix (no round was logged before it):
        # rounds logged afterwards must not add them again.
        self.flow_from_finish = False


@final
class ReplicaRecord:
    """One replica's state segments, lock periods, failures and latest gauges."""

    def __init__(self, name: str) -> None:
        self.name = name
        # (state, start, end); end None while the state holds. A state entered before the log began has
        # no segment.
        self.segments: list[tuple[ReplicaStateName, float, float | None]] = []
        self.state: ReplicaStateName | None = None
        self.transitions = 0
        self.lock_reasons: set[LockReason] = set()
        self.locks: list[tuple[float, float | None, set[LockReason]]] = []
        self.failures: list[tuple[float, str]] = []
        self.used_blocks = 0
        self.total_blocks = 0
        # The latest word on the lock, from lock events or the controller's reports (which also show the
        # standing lock of non-decode replicas, for which no event is logged).
        self.locked = False
        # Its prefix cache (docs/prefix-cache.md): the prompts that started prefill here, their tokens
        # and those found cached (`prefill_started`); the blocks cached and evicted, as last reported.
        self.prompts = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefix_blocks: int | None = None
        self.prefix_evicted = 0
        self._evicted_before = 0  # evictions counted by caches the replica had before (its count fell)
        self._evicted_last = 0

    def prompt_started(self, tokens: int, cached_tokens: int) -> None:
        self.prompts += 1
        self.prompt_tokens += tokens
        self.cached_tokens += cached_tokens

    def prefix_reported(self, blocks: int, evicted: int) -> None:
        """A report of its prefix cache: `evicted` counts since the cache began, so a count lower than
        the last one is a new cache's (the replica's pools were made again), added to the earlier."""
        if evicted < self._evicted_last:
            self._evicted_before += self._evicted_last
        self._evicted_last = evicted
        self.prefix_blocks = blocks
        self.prefix_evicted = self._evicted_before + evicted

    def enter(self, state: ReplicaStateName, ts: float) -> None:
        if self.segments and self.segments[-1][2] is None:
            previous, start, _ = self.segments[-1]
            self.segments[-1] = (previous, start, ts)
        self.segments.append((state, ts, None))
        self.state = state

    def lock(self, reason: LockReason, ts: float) -> None:
        if not self.lock_reasons:
            self.locks.append((ts, None, set()))
        self.lock_reasons.add(reason)
        self.locks[-1][2].add(reason)
        self.locked = True

    def unlock(self, reason: LockReason, still_locked: bool, ts: float) -> None:
        self.lock_reasons.discard(reason)
        self.locked = still_locked
        if still_locked:
            return
        # An unlock that says nothing holds any more closes the period even if a lock event was missed.
        self.lock_reasons.clear()
        if self.locks and self.locks[-1][1] is None:
            start, _, reasons = self.locks[-1]
            self.locks[-1] = (start, ts, reasons)


_ROLE_ORDER: dict[str, int] = {"encode": 0, "prefill": 1, "decode": 2}


def replica_order(name: str) -> tuple[str, int, int, str]:
    """Sort key putting replicas in pipeline order (encode, prefill, decode; then by index), grouped by the
    ``label/`` prefix `--label-logs` adds; unknown names last, alphabetically."""
    label, _, replica = name.rpartition("/")
    role, _, index = replica.partition("-")
    if role in _ROLE_ORDER and index.isdigit():
        return label, _ROLE_ORDER[role], int(index), ""
    return label, len(_ROLE_ORDER), 0, replica

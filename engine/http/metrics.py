"""Prometheus metrics of one node (`GET /metrics`), in a registry of its own so several nodes in one
process (tests) do not collide.

Two sources:
- counters and histograms follow the node's typed events (`observe`, an event-log observer): the serving
  metrics users know from vLLM under the `zigzag:` prefix — prompt and generation tokens, requests by
  outcome, time to first token, time per output token, end-to-end latency, queue time — and what only a
  disaggregated node has: transfer seconds and bytes per kind (`kv`, `embedding`, `relay`, `weights`),
  ZigZag relays by layer, rounds per transfer,
  failed transfers, lock events; prefix-cache queries and hits in prompt tokens (as vLLM's);
- gauges are read from the live replicas at each scrape (`NodeGauges`): requests running and waiting,
  KV cache usage per replica, blocks used and total, the replica's state and lock, the layers of weights
  it has loaded (every replica, whether it loaded its weights itself or shares the node's copy).

One more source: a request body the HTTP API refuses before admission (it does not decode, names
another model, asks for what the node does not support) ends no admitted request and logs no event;
`refused(code)` counts it as arrived and failed, so `requests_failed_total` holds every 4xx a client got.

Inter-token latency is observed where tokens are relayed to a client, socket or HTTP
(`engine.generate.generation.Generation` calls `token_gap`): the gaps between token arrivals after the first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.logs.load import LoadCounters
from engine.summary import ServingTally
from messages.control import ErrorCode
from messages.log.events import (
    EncodeStarted,
    LogEvent,
    PrefillStarted,
    ReplicaLocked,
    RequestArrived,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    TransferFinished,
)
from messages.log.scaling import RelayReceived, WeightsCopyFinished
from replicas.ports import Directory
from replicas.states import ReplicaState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
BYTES_BUCKETS = tuple(float(4**power) for power in range(5, 17))  # 1 KiB … 4 GiB
ROUND_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


@final
class NodeMetrics:
    """The node's registry and its event-fed metrics (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        # The planner's load counters (`engine.planner.signals`) and the serving summary's tally
        # (`engine.summary`), fed by the same observer.
        self.load = LoadCounters()
        self.tally = ServingTally()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"zigzag:{name}", doc, labels, registry=registry)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
        ) -> Histogram:
            return Histogram(f"zigzag:{name}", doc, labels, buckets=buckets, registry=registry)

        self.arrived = counter("requests_arrived", "Requests that arrived (socket and HTTP).")
        self.success = counter(
            "request_success", "Requests that ended normally, by finish reason.", ("finished_reason",)
        )
        self.cancelled = counter("requests_cancelled", "Requests cancelled, by reason.", ("reason",))
        self.failed = counter("requests_failed", "Requests that failed, by error code.", ("code",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that ended normally.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (finished and cancelled).")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Mean time per output token of a request.", TOKEN_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Gap between tokens as relayed.", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to the start of encode or prefill.", LATENCY_BUCKETS
        )
        self.transfer_seconds = histogram(
            "transfer_seconds", "Transfer duration by kind and status.", LATENCY_BUCKETS, ("kind", "status")
        )
        self.transfer_bytes = histogram(
            "transfer_bytes", "Bytes moved per transfer.", BYTES_BUCKETS, ("kind",)
        )
        self.transfer_rounds = histogram("transfer_rounds", "Rounds per transfer.", ROUND_BUCKETS, ("kind",))
        self.relays = counter("relays", "ZigZag batches relayed, by the layer handed over at.", ("layer",))
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix caches of this node's replicas."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in a prefix cache (their KV was not computed)."
        )
        self.kv_pulled = counter(
            "kv_pulled_bytes", "KV bytes of cached prefixes pulled from other replicas' prefix caches."
        )
        self.locks = counter("replica_locks", "Times a replica was locked, by reason.", ("replica", "reason"))
        self._arrivals: dict[str, float] = {}

    def attach(self, directory: Directory, live: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read the gauges from the replicas of `directory` (once the node made it: the log, and so this
        observer, exists before the replicas do); `live` and `waiting` count the node's requests."""
        self.registry.register(NodeGauges(directory, live, waiting))

    def observe(self, event: LogEvent) -> None:
        """An event-log observer: never blocks, never emits."""
        self.load.observe(event)
        self.tally.observe(event)
        match event:
            case RequestArrived(request_id=request_id, ts=ts):
                self.arrived.inc()
                if request_id is not None:
                    self._arrivals[request_id] = ts
            case PrefillStarted(request_id=request_id, ts=ts, tokens=tokens, cached_tokens=cached):
                self.prefix_queries.inc(tokens)
                self.prefix_hits.inc(cached)
                arrived = self._arrivals.pop(request_id or "", None)
                if arrived is not None:
                    self.queue.observe(max(0.0, ts - arrived))
            case EncodeStarted(request_id=request_id, ts=ts):
                arrived = self._arrivals.pop(request_id or "", None)
                if arrived is not None:
                    self.queue.observe(max(0.0, ts - arrived))
            case RequestFinished():
                self._end(event.request_id)
                self.success.labels(event.finish_reason).inc()
                self.prompt_tokens.inc(event.prompt_tokens)
                self.generation_tokens.inc(event.output_tokens)
                self.e2e.observe(event.e2e_s)
                if event.ttft_s is not None:
                    self.ttft.observe(event.ttft_s)
                if event.tpot_s is not None:
                    self.tpot.observe(event.tpot_s)
            case RequestCancelled():
                self._end(event.request_id)
                self.cancelled.labels(event.reason).inc()
                self.generation_tokens.inc(event.output_tokens)
            case RequestFailed():
                self._end(event.request_id)
                self.failed.labels(event.code).inc()
            case TransferFinished():
                self.transfer_seconds.labels(event.kind, event.status).observe(event.seconds)
                if event.status == "success":
                    self.transfer_bytes.labels(event.kind).observe(event.bytes)
                    self.transfer_rounds.labels(event.kind).observe(event.rounds)
                    if event.kind == "pull":
                        self.kv_pulled.inc(event.bytes)
            case ReplicaLocked():
                self.locks.labels(event.replica or "", event.reason).inc()
            case RelayReceived():
                self.relays.labels(str(event.layer)).inc()
                self.transfer_seconds.labels("relay", "success").observe(event.seconds)
                self.transfer_bytes.labels("relay").observe(event.bytes)
            case WeightsCopyFinished():
                status = "success" if event.status == "success" else "failed"
                self.transfer_seconds.labels("weights", status).observe(event.seconds)
                if event.status == "success":
                    self.transfer_bytes.labels("weights").observe(event.bytes)
            case _:
                pass

    def refused(self, code: ErrorCode) -> None:
        """A request the HTTP API refused before admission (no event was logged for it)."""
        self.arrived.inc()
        self.failed.labels(code).inc()

    def token_gap(self, seconds: float, tokens: int) -> None:
        """`tokens` tokens arrived `seconds` after the previous ones: one gap per token."""
        if tokens > 0:
            gap = seconds / tokens
            for _ in range(tokens):
                self.itl.observe(gap)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _end(self, request_id: str | None) -> None:
        self._arrivals.pop(request_id or "", None)


@final
class NodeGauges(Collector):
    """Gauges read from the replicas at scrape time (the allocators, never a separate counter)."""

    def __init__(self, directory: Directory, live: Callable[[], int], waiting: Callable[[], int]) -> None:
        self._directory = directory
        self._live = live
        self._waiting = waiting

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = self._waiting()
        yield GaugeMetricFamily(
            "zigzag:num_requests_running", "Requests admitted and not ended.", value=self._live() - waiting
        )
        yield GaugeMetricFamily(
            "zigzag:num_requests_waiting", "Requests waiting for a replica.", value=waiting
        )
        usage = GaugeMetricFamily(
            "zigzag:kv_cache_usage_perc", "KV blocks in use, 0-1, per replica.", labels=["replica"]
        )
        used = GaugeMetricFamily(
            "zigzag:blocks_used", "Blocks in use per replica and pool kind.", labels=["replica"]
        )
        total = GaugeMetricFamily(
            "zigzag:blocks_total", "Blocks per replica (all pools).", labels=["replica"]
        )
        state = GaugeMetricFamily(
            "zigzag:replica_state", "1 for the state each replica is in.", labels=["replica", "state"]
        )
        locked = GaugeMetricFamily(
            "zigzag:replica_locked", "1 while a replica is locked.", labels=["replica"]
        )
        layers = GaugeMetricFamily(
            "zigzag:weights_layers_loaded",
            "Layers of weights a replica has loaded, of its model's total.",
            labels=["replica", "of"],
        )
        prefix = GaugeMetricFamily(
            "zigzag:prefix_cache_blocks", "KV blocks a replica's prefix cache holds.", labels=["replica"]
        )
        for snap in (replica.snapshot() for replica in self._directory.local()):
            prefix.add_metric([snap.name], snap.prefix_blocks)
            kv_used, kv_total = snap.cached_blocks, snap.kv_blocks
            usage.add_metric([snap.name], kv_used / kv_total if kv_total else 0.0)
            used.add_metric([snap.name], snap.used_blocks)
            total.add_metric([snap.name], snap.total_blocks)
            for name in ReplicaState:
                state.add_metric([snap.name, name.value], 1.0 if snap.state is name else 0.0)
            locked.add_metric([snap.name], 1.0 if snap.locked else 0.0)
            layers.add_metric([snap.name, str(snap.total_layers)], snap.loaded_layers)
        yield from (usage, used, total, state, locked, layers, prefix)

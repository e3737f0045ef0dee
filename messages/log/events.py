"""Typed log events (architecture §3): one JSON object per line of the node's log file.

The line *is* the msgspec JSON encoding of one `LogEvent`: the tag field ``event`` names it, ``ts`` is the
wall-clock time in float seconds (Unix epoch), and the other keys are the fields below, always present
(null where not applicable). `python -m engine.logs` decodes lines with `event_decoder()`; the schema is
documented in docs/logging.md and is a contract: add fields with defaults, never rename. Decoding
ignores fields it does not know, so an older reader reads a newer node's log.

Context: request events carry `request_id` (never null once emitted) and `replica` (the replica that
emits it, null before one is chosen); replica events carry `replica` (never null). The logger fills both
from its bound context (`engine.logging.EventLog.bind`), so call sites need not repeat them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

import msgspec

from messages.control import ErrorCode, FinishReason, LockReason, ReplicaStateName
from messages.log.base import Event, Level, ReplicaEvent, RequestEvent, Transfer
from messages.log.scaling import (
    ExecutorReady,
    PlannerDecision,
    RelayHandedOver,
    RelayReceived,
    ReplicasPaired,
    WeightsCopyFinished,
    WeightsCopyStarted,
)
from messages.log.serving import ServingSummary

__all__ = ["Event", "Level", "ReplicaEvent", "RequestEvent", "ServingSummary", "Transfer"]


# ---------------------------------------------------------------------------------------------- node
class NodeStarted(Event, frozen=True, kw_only=True, tag="node_started"):
    listen: str
    http: str | None = None  # the HTTP API's URL; None when it is off
    model: str
    device: str
    transport: str
    replicas: list[str]
    pid: int
    version: str


class NodeConfigured(Event, frozen=True, kw_only=True, tag="node_config"):
    """The whole `engine.config.NodeConfig` as JSON (decode it with that type)."""

    config: dict[str, Any]


class NodeStopping(Event, frozen=True, kw_only=True, tag="node_stopping"):
    reason: Literal["signal", "shutdown_op", "fatal"]
    detail: str
    in_flight: int


class NodeStopped(Event, frozen=True, kw_only=True, tag="node_stopped"):
    exit_code: int
    leaked_blocks: int
    uptime_s: float


# ---------------------------------------------------------------------------------------------- control
ClientCloseReason = Literal[
    "eof", "broken", "line_too_long", "write_timeout", "server_closing", "unauthorized"
]


class ClientConnected(Event, frozen=True, kw_only=True, tag="client_connected"):
    connection: str
    peer: str


class ClientDisconnected(Event, frozen=True, kw_only=True, tag="client_disconnected"):
    connection: str
    peer: str
    reason: ClientCloseReason
    cancelled_requests: int


class HttpAccess(Event, frozen=True, kw_only=True, tag="http_access"):
    """One HTTP request answered (the access line; none with `--disable-log-requests`). `status` is the
    response's (499: the client left before one was sent); `seconds` from the request's arrival to its
    last byte; `request_id`, `prompt_tokens` and `completion_tokens` where it generated."""

    method: str
    path: str
    status: int
    seconds: float
    peer: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class ControlBadLine(Event, frozen=True, kw_only=True, tag="control_bad_line"):
    """A request line that got a `bad_request` error; `id` is the client's id when it could be read."""

    level: ClassVar[Level] = "warning"

    connection: str
    peer: str
    id: str | None
    message: str


class SlowClient(Event, frozen=True, kw_only=True, tag="slow_client"):
    """The client's outbound queue filled: its in-flight requests were cancelled."""

    level: ClassVar[Level] = "warning"

    connection: str
    peer: str
    queued_replies: int
    cancelled_requests: int


class ControlHandlerError(Event, frozen=True, kw_only=True, tag="control_handler_error"):
    """The node's handler raised an unexpected exception; the client got an `internal` error."""

    level: ClassVar[Level] = "error"

    connection: str
    peer: str
    id: str
    op: str
    error: str
    traceback: str


# ---------------------------------------------------------------------------------------------- requests
class RequestArrived(RequestEvent, frozen=True, kw_only=True, tag="request_arrived"):
    connection: str | None
    prompt_tokens: int | None
    images: int
    max_tokens: int
    stream: bool


class RequestQueued(RequestEvent, frozen=True, kw_only=True, tag="request_queued"):
    queue: Literal["work", "migration"]
    position: int


class EncodeStarted(RequestEvent, frozen=True, kw_only=True, tag="encode_started"):
    images: int


class EncodeFinished(RequestEvent, frozen=True, kw_only=True, tag="encode_finished"):
    tokens: int
    seconds: float


class PrefillStarted(RequestEvent, frozen=True, kw_only=True, tag="prefill_started"):
    tokens: int  # the prompt's
    batch_size: int
    cached_tokens: int = 0  # of `tokens`, those whose KV came from the prefix cache (not computed)
    # Where they came from: "local" (this replica's cache), or the replica they were pulled from (and
    # the blocks this replica held already); None when no token was cached.
    cached_from: str | None = None


class PrefillFinished(RequestEvent, frozen=True, kw_only=True, tag="prefill_finished"):
    tokens: int
    seconds: float


class TransferStarted(RequestEvent, frozen=True, kw_only=True, tag="transfer_started"):
    kind: Transfer
    transfer_id: str
    source: str
    destination: str
    transport: str
    total_tokens: int | None
    granted_blocks: int


class TransferRound(RequestEvent, frozen=True, kw_only=True, tag="transfer_round"):
    """One round that carried data: `tokens` from `offset`, `bytes` over the wire or copied."""

    kind: Transfer
    transfer_id: str
    round: int
    offset: int
    tokens: int
    total_tokens: int
    bytes: int
    source: str
    destination: str
    transport: str


class TransferFinished(RequestEvent, frozen=True, kw_only=True, tag="transfer_finished"):
    kind: Transfer
    transfer_id: str
    status: Literal["success", "failed"]
    reason: str | None
    rounds: int
    tokens: int
    bytes: int
    seconds: float
    source: str
    destination: str
    transport: str


class FirstToken(RequestEvent, frozen=True, kw_only=True, tag="first_token"):
    token_id: int
    ttft_s: float


class RequestFinished(RequestEvent, frozen=True, kw_only=True, tag="request_finished"):
    finish_reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    e2e_s: float
    ttft_s: float | None
    tpot_s: float | None


class RequestCancelled(RequestEvent, frozen=True, kw_only=True, tag="request_cancelled"):
    reason: Literal["cancel_op", "client_disconnected", "client_too_slow", "shutdown"]
    output_tokens: int


class RequestFailed(RequestEvent, frozen=True, kw_only=True, tag="request_failed"):
    level: ClassVar[Level] = "error"

    code: ErrorCode
    message: str


# ---------------------------------------------------------------------------------------------- replicas
class ReplicaStateChanged(ReplicaEvent, frozen=True, kw_only=True, tag="replica_state"):
    """`from`/`to` are the architecture §6 state names (Python attributes `from_state` / `to_state`)."""

    from_state: ReplicaStateName = msgspec.field(name="from")
    to_state: ReplicaStateName = msgspec.field(name="to")
    trigger: Literal["command", "automatic"]
    reason: str


class ReplicaLocked(ReplicaEvent, frozen=True, kw_only=True, tag="replica_locked"):
    reason: LockReason
    used_blocks: int
    total_blocks: int


class ReplicaUnlocked(ReplicaEvent, frozen=True, kw_only=True, tag="replica_unlocked"):
    """One lock reason cleared; `still_locked` when the other reason still holds."""

    reason: LockReason
    still_locked: bool


class ReplicaFailed(ReplicaEvent, frozen=True, kw_only=True, tag="replica_failed"):
    level: ClassVar[Level] = "error"

    error: str
    failed_requests: int


class WeightsProgress(ReplicaEvent, frozen=True, kw_only=True, tag="weights_progress"):
    """A piece of the weights landed (`seconds`: since the load began). The piece fields are null in logs
    of older nodes: `piece` (`embeddings`, `layer`, `norm`, `head`), `layer` (its index), `bytes` (the
    piece's), `piece_seconds`, `weights_source` (`peer`, `host`, `disk`), `bytes_loaded` (the model's so far)."""

    layers_loaded: int
    layers_total: int
    seconds: float
    piece: Literal["embeddings", "layer", "norm", "head"] | None = None
    layer: int | None = None
    bytes: int | None = None
    piece_seconds: float | None = None
    weights_source: Literal["peer", "host", "disk"] | None = None
    bytes_loaded: int | None = None


class FaultInjected(ReplicaEvent, frozen=True, kw_only=True, tag="fault_injected"):
    level: ClassVar[Level] = "warning"

    fault: str
    detail: str


class PoolLeak(ReplicaEvent, frozen=True, kw_only=True, tag="pool_leak"):
    """Blocks still owned at shutdown (`owners`: owner → blocks)."""

    level: ClassVar[Level] = "error"

    pool: str
    leaked_blocks: int
    owners: dict[str, int]


# ---------------------------------------------------------------------------------------------- controller
class ReplicaBlocks(msgspec.Struct, frozen=True, kw_only=True):
    replica: str
    state: ReplicaStateName
    used_blocks: int
    cached_blocks: int
    total_blocks: int
    locked: bool
    prefix_blocks: int = 0  # KV blocks its prefix cache holds (docs/prefix-cache.md)
    prefix_evicted: int = 0  # KV blocks its prefix cache evicted since it started


class BlocksReport(Event, frozen=True, kw_only=True, tag="blocks_report"):
    """The controller's periodic report of every replica's state and used blocks."""

    replicas: list[ReplicaBlocks]


class Flow(msgspec.Struct, frozen=True, kw_only=True):
    source: str
    destination: str
    kind: Transfer
    bytes: int


class FlowReport(Event, frozen=True, kw_only=True, tag="flow_report"):
    """Bytes moved between replicas during the last `interval_s` (the non-zero cells of the flow matrix)."""

    interval_s: float
    flows: list[Flow]


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    name: str
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float | None
    power_w: float | None


class GpuReport(Event, frozen=True, kw_only=True, tag="gpu_report"):
    """GPU metrics through NVML; only emitted when a GPU is present."""

    gpus: list[GpuSample]


# ---------------------------------------------------------------------------------------------- diagnostics
class Diagnostic(Event, frozen=True, kw_only=True, tag="diagnostic"):
    """An untyped diagnostic of library code (`structlog.get_logger(...)` in `transport/` and the
    controller): a link closed, a handshake refused, the transport `auto` chose, a GPU NVML cannot read.
    `name` is the diagnostic's own (`transfer.link_closed`), `fields` its key/values as text. Its level
    is `severity`, not a class constant: the same code may say a thing at `info` or `warning`."""

    severity: Level
    name: str
    fields: dict[str, str]


# Codes that say the client sent something to fix (HTTP 4xx): the node is fine, the line is not an error.
CLIENT_MISTAKES: Final[frozenset[ErrorCode]] = frozenset(
    {"bad_request", "not_found", "not_supported", "unauthorized"}
)


def level_of(event: Event) -> Level:
    """The level `event` is written at: a request refused for the client's mistake at `info`."""
    if isinstance(event, Diagnostic):
        return event.severity
    if isinstance(event, RequestFailed) and event.code in CLIENT_MISTAKES:
        return "info"
    return event.level


LogEvent = (
    NodeStarted
    | NodeConfigured
    | NodeStopping
    | NodeStopped
    | ClientConnected
    | ClientDisconnected
    | HttpAccess
    | ControlBadLine
    | SlowClient
    | ControlHandlerError
    | RequestArrived
    | RequestQueued
    | EncodeStarted
    | EncodeFinished
    | PrefillStarted
    | PrefillFinished
    | TransferStarted
    | TransferRound
    | TransferFinished
    | FirstToken
    | RequestFinished
    | RequestCancelled
    | RequestFailed
    | ReplicaStateChanged
    | ReplicaLocked
    | ReplicaUnlocked
    | ReplicaFailed
    | WeightsProgress
    | ExecutorReady
    | WeightsCopyStarted
    | WeightsCopyFinished
    | ReplicasPaired
    | RelayHandedOver
    | RelayReceived
    | PlannerDecision
    | FaultInjected
    | PoolLeak
    | BlocksReport
    | FlowReport
    | ServingSummary
    | GpuReport
    | Diagnostic
)


def event_decoder() -> msgspec.json.Decoder[LogEvent]:
    """A decoder of one log line into its typed event."""
    return msgspec.json.Decoder(LogEvent)

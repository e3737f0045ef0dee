"""Control-socket replies (architecture §7): ``token`` (streamed), ``result`` (final, one struct per op) and
``error`` (final, a `code` from `messages.control.ErrorCode`).

Every reply carries the request's `id`. Each op has its own reply decoder (`reply_decoder(op)`), so the
three tags are distinct within each union although every op's final struct is tagged ``result``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from messages.base import Message, Record
from messages.control import (
    ClientId,
    Count,
    ErrorCode,
    FinishReason,
    LockReason,
    Op,
    ReplicaRole,
    ReplicaStateName,
    RequestId,
    ScaleMode,
    Seconds,
    TokenId,
    TransferKind,
    WeightsSource,
)


class TopLogprob(Record, frozen=True):
    token_id: TokenId
    logprob: float


class TokenLogprob(Record, frozen=True):
    """A token's log-probability under the model's raw distribution (log-softmax of its logits, before
    temperature and top-p) and the most likely alternatives at its place, most likely first."""

    token_id: TokenId
    logprob: float
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class TokenReply(Message, frozen=True, tag="token"):
    """Streamed tokens of a generate (only when `stream` was set).

    `index` is the position of `token_ids[0]` among the generated tokens. `text` is the decoded text that
    these tokens complete: the node holds back bytes of an unfinished UTF-8 character until a later token
    completes it, so `text` may be empty and the concatenation of every `text` equals the result's `text`.
    `logprobs`: one per token when the generate asked for them.
    """

    id: ClientId
    request_id: RequestId
    index: Count
    token_ids: list[TokenId]
    text: str
    logprobs: list[TokenLogprob] | None = None


class ErrorReply(Message, frozen=True, tag="error"):
    """The final reply of a failed request. `id` is null when the line could not be read."""

    id: ClientId | None
    code: ErrorCode
    message: str
    request_id: RequestId | None = None


class Timings(Record, frozen=True):
    """Seconds spent in each phase of one generate; null where the phase did not happen."""

    queued_s: Seconds | None = None
    encode_s: Seconds | None = None
    embedding_transfer_s: Seconds | None = None
    prefill_s: Seconds | None = None
    kv_transfer_s: Seconds | None = None
    ttft_s: Seconds | None = None
    tpot_s: Seconds | None = None
    e2e_s: Seconds | None = None


class TransferSummary(Record, frozen=True):
    """One transfer of a request: `rounds` counts the rounds that carried data, round 0 included."""

    kind: TransferKind
    transfer_id: str
    source: str
    destination: str
    rounds: Count
    bytes: Count
    seconds: Seconds
    transport: str
    # A KV transfer's layers `[start, stop)` (every layer, or one ZigZag half); null for the other kinds.
    layers: list[int] | None = None


class RelayInfo(Record, frozen=True):
    """A request whose prefill was relayed (ZigZag): `new_prefill` ran layers `[0, layer)`,
    `old_prefill` the rest and the head."""

    new_prefill: str
    old_prefill: str
    layer: Count


class GenerateResult(Message, frozen=True, tag="result"):
    id: ClientId
    request_id: RequestId
    prompt_tokens: Count
    token_ids: list[TokenId]
    text: str
    finish_reason: FinishReason
    timings: Timings
    transfers: list[TransferSummary]
    relay: RelayInfo | None = None
    # When asked for: one per generated token; one per prompt token (the first null).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: Count = 0  # prompt tokens whose KV came from a prefix cache (docs/prefix-cache.md)
    # Their source: "local" (the prefill replica's own cache) or the replica they were pulled from; null
    # when no token was cached.
    cached_from: str | None = None


class ReplicaStatus(Record, frozen=True):
    """One replica in `status`. `used_blocks` comes from the allocators, summed over the replica's pools."""

    name: str
    role: ReplicaRole
    state: ReplicaStateName
    used_blocks: Count
    cached_blocks: Count
    total_blocks: Count
    locked: bool
    lock_reasons: list[LockReason]
    work_queue: Count
    migration_queue: Count
    last_error: str | None
    transport: str
    loaded_layers: Count = 0
    total_layers: Count = 0
    weights_source: WeightsSource | None = None
    weights_bytes_loaded: Count = 0
    paired_with: list[str] = msgspec.field(default_factory=list)
    # In a cluster: the node the replica runs on and that node's process id.
    node: str | None = None
    pid: int | None = None
    # How it runs the model: decode from CUDA graphs, the kernels launched eagerly, or torch's path
    # (None without an executor: not loaded, or an encode replica); why a faster path was given up.
    executor: Literal["graphs", "kernels", "eager"] | None = None
    executor_fallbacks: list[str] = msgspec.field(default_factory=list)
    prefix_blocks: Count = 0  # KV blocks its prefix cache holds (docs/prefix-cache.md)


class ClusterView(Record, frozen=True):
    """The cluster as the node asked sees it: `state` `ok`, or `degraded` while it cannot reach etcd
    (it serves what it holds and starts no cross-node work), or `rejoining` after its lease expired."""

    node: str
    state: Literal["ok", "degraded", "rejoining"]
    leader: str | None
    nodes: list[str]
    lease: int


class StatusResult(Message, frozen=True, tag="result"):
    id: ClientId
    accepting: bool
    replicas: list[ReplicaStatus]
    cluster: ClusterView | None = None


class CancelResult(Message, frozen=True, tag="result"):
    """The request was found and is being cancelled; its generate ends with finish_reason `cancelled`."""

    id: ClientId
    request_id: RequestId


class TransitionResult(Message, frozen=True, tag="result"):
    """`replica` moved from `previous` to `state`; automatic moves may follow (watch `status`)."""

    id: ClientId
    replica: str
    previous: ReplicaStateName
    state: ReplicaStateName


class LockResult(Message, frozen=True, tag="result"):
    """The reply to both `lock` and `unlock`: the lock as it stands afterwards."""

    id: ClientId
    replica: str
    locked: bool
    lock_reasons: list[LockReason]


class StartedReplica(Record, frozen=True):
    """A replica a `scale` brought up: how (`zigzag` or `stop_the_world`) and where its weights come from
    (`resident` for a revived replica, which loads nothing)."""

    replica: str
    mode: ScaleMode
    source: WeightsSource


class ScaleResult(Message, frozen=True, tag="result"):
    """`replicas` names the replicas of `role` that serve or are starting after the command."""

    id: ClientId
    role: ReplicaRole
    target: Count
    replicas: list[str]
    started: list[StartedReplica] = msgspec.field(default_factory=list)


class RequestCounters(Record, frozen=True):
    """Requests since start, by outcome (`queued` and `running` are gauges)."""

    arrived: Count
    queued: Count
    running: Count
    finished_stop: Count
    finished_length: Count
    cancelled: Count
    failed: Count


class TokenCounters(Record, frozen=True):
    prompt: Count
    generated: Count


class TransferCounters(Record, frozen=True):
    """Finished transfers of one kind; `rounds` maps a round count to how many transfers took it."""

    kind: TransferKind
    succeeded: Count
    failed: Count
    rounds: dict[int, int]
    bytes: Count
    seconds: Seconds


class ReplicaGauge(Record, frozen=True):
    name: str
    state: ReplicaStateName
    used_blocks: Count
    total_blocks: Count
    locked: bool


class ClusterTotals(Record, frozen=True):
    """The leader's `metrics` in a cluster: the counters of `nodes` (itself and every member that
    answered) summed; `missing` lists members that did not answer."""

    nodes: list[str]
    missing: list[str]
    requests: RequestCounters
    tokens: TokenCounters
    errors: dict[ErrorCode, int]


class MetricsResult(Message, frozen=True, tag="result"):
    id: ClientId
    uptime_s: Seconds
    requests: RequestCounters
    tokens: TokenCounters
    transfers: list[TransferCounters]
    errors: dict[ErrorCode, int]
    replicas: list[ReplicaGauge]
    cluster: ClusterTotals | None = None


class ShutdownResult(Message, frozen=True, tag="result"):
    """Shutdown began: no new connections or requests; `in_flight` requests drain within the deadline."""

    id: ClientId
    drain_deadline_s: Seconds
    in_flight: Count


class ReleaseResult(Message, frozen=True, tag="result"):
    """`released` holds of fault hook `fault` were in progress and ended."""

    id: ClientId
    fault: Literal["hold_weights"]
    released: Count


ControlResult = (
    GenerateResult
    | StatusResult
    | CancelResult
    | TransitionResult
    | LockResult
    | ScaleResult
    | MetricsResult
    | ShutdownResult
    | ReleaseResult
)
# For annotations only: every result is tagged "result", so decode with `reply_decoder(op)`.
ControlReply = TokenReply | ErrorReply | ControlResult

RESULT_TYPES: dict[Op, type[ControlResult]] = {
    "generate": GenerateResult,
    "status": StatusResult,
    "cancel": CancelResult,
    "transition": TransitionResult,
    "lock": LockResult,
    "unlock": LockResult,
    "scale": ScaleResult,
    "metrics": MetricsResult,
    "shutdown": ShutdownResult,
    "release": ReleaseResult,
}

GenerateReply = TokenReply | ErrorReply | GenerateResult

_REPLY_DECODERS: dict[Op, msgspec.json.Decoder[ControlReply]] = {
    op: msgspec.json.Decoder(GenerateReply if op == "generate" else ErrorReply | result_type)
    for op, result_type in RESULT_TYPES.items()
}


def reply_decoder(op: Op) -> msgspec.json.Decoder[ControlReply]:
    """The decoder of the replies to `op`: `TokenReply | ErrorReply | GenerateResult` for generate,
    `ErrorReply | <op's result>` for the others."""
    return _REPLY_DECODERS[op]

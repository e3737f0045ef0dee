"""What nodes of one cluster say to each other (docs/cluster.md): etcd records and peer-link messages.

Membership lives in etcd: `NodeRecord` under `{prefix}/nodes/{node_id}`, written under the node's lease,
and `ClusterIdentity` under `{prefix}/identity`, written once by the first node. Everything else travels
over peer links as `PeerFrame`s (msgpack, length-prefixed): each frame names its sender and the lease
the sender held when it sent it, and carries one `PeerMessage` — a tagged union, matched exhaustively by
the receiver.

A request that crosses nodes is carried as a `RequestSnapshot`: its *origin* (the node whose client
connection admitted it) keeps the authoritative request; every other node that works on it keeps a
*mirror* built from a snapshot and sends back what the mirror's holder produced (`TokensForward`,
`EndedForward`). The origin ends the request everywhere with `ForgetRequest`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from messages.base import Message, Record
from messages.commands import RelayOffer, ReplicaCommand
from messages.control import ControlRequest, ErrorCode, ReplicaRole
from messages.control_replies import RelayInfo, ReplicaStatus, TokenLogprob, TransferSummary
from messages.grammar import Grammar

PROTOCOL_VERSION = 1
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[a-z0-9][a-z0-9_-]*$")]


# ---------------------------------------------------------------------------------------------- etcd
class ClusterIdentity(Record, frozen=True):
    """What every node of a cluster must serve alike; a node that differs is refused at join."""

    model: str
    dtype: str
    kv_block_size: int
    embedding_block_size: int
    protocol: int = PROTOCOL_VERSION


class NodeCapacity(Record, frozen=True):
    devices: list[str]
    memory_bytes: int
    free_replica_slots: int


class ReplicaEntry(Record, frozen=True):
    name: str
    role: ReplicaRole


class NodeRecord(Record, frozen=True):
    """A member, as it registered (re-written when its replicas change)."""

    node_id: str
    pid: int
    lease: int
    peer_address: str
    control_address: str
    http_url: str | None
    identity: ClusterIdentity
    capacity: NodeCapacity
    replicas: list[ReplicaEntry]
    weights: list[str]
    started: float


# ---------------------------------------------------------------------------------------------- reports
class PrefixDelta(Record, frozen=True):
    """The block keys a replica's prefix cache holds (docs/prefix-cache.md), as a change from the
    `base` version its node last broadcast to `version`: keys `added` and `removed`. `base` None: a
    whole view — `added` is every key it reports (at most the most recently used `MAX_PREFIX_KEYS`). A
    reader whose version is not `base` knows nothing of the replica's cache until the next whole view."""

    version: int
    base: int | None
    added: list[bytes] = msgspec.field(default_factory=list)
    removed: list[bytes] = msgspec.field(default_factory=list)


MAX_PREFIX_KEYS = 1024  # keys in one report: a delta's added + removed, or a whole view


class ReplicaReport(Record, frozen=True):
    """One replica as its node reports it to the others: its `status` (as that node's `status` shows
    it, with `node` and `pid`), its configured `role`, and what routing and the planner read."""

    status: ReplicaStatus
    role: ReplicaRole
    kv_total: int
    queued_prompt_tokens: int
    encode_load: int
    embedding_pool: bool
    takes_work: bool
    serves_weights: bool = (
        False  # holds fully loaded weights another node's replica may copy (docs/weights.md)
    )
    prefix: PrefixDelta | None = None  # a language replica's prefix cache
    # The longest prompt a NewPrefill takes now (with `takes_work`); None: any (docs/zigzag.md).
    prefill_limit: int | None = None
    running_prompt_tokens: int = 0  # the prompt tokens of the batch it computes now


class StampsRecord(Record, frozen=True):
    arrived: float
    dispatched: float | None = None
    encode_started: float | None = None
    encode_finished: float | None = None
    embedding_started: float | None = None
    embedding_finished: float | None = None
    prefill_started: float | None = None
    prefill_finished: float | None = None
    kv_started: float | None = None
    kv_finished: float | None = None
    first_token: float | None = None
    finished: float | None = None


class ImageData(Record, frozen=True):
    """An image as raw array bytes (`numpy.ndarray.tobytes`), with its shape and dtype."""

    shape: list[int]
    dtype: str
    data: bytes


class SamplingRecord(Record, frozen=True):
    temperature: float
    top_p: float
    seed: int
    ignore_eos: bool
    eos_banned_before: int
    eos_token_ids: list[int]
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output's grammar (structured outputs): the spec only; each node rebuilds its matcher from it
    # and the tokens generated so far.
    grammar: Grammar | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()


class RequestSnapshot(Record, frozen=True):
    """A request as far as it got, for the node that works on it next (see the module docstring)."""

    request_id: str
    origin: str
    prompt_ids: list[int]
    images: list[ImageData]
    sampling: SamplingRecord
    max_tokens: int
    eos_token_ids: list[int]
    token_ids: list[int]
    generated: list[int]
    next_position: int
    stop_at: int | None
    cancelled: bool
    stamps: StampsRecord
    transfers: list[TransferSummary]
    relay: RelayInfo | None
    embedding_encoder: str | None = None
    embedding_transfer_id: str | None = None
    # Where the request asked for them: one per generated token; one per prompt token (the first null).
    generated_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = msgspec.field(default_factory=list)
    cached_tokens: int = 0
    cached_from: str | None = None
    # The router's pull hint (docs/prefix-cache.md): replica `pull_from` holds the prompt's first
    # `pull_blocks` blocks in its prefix cache; the prefill replica pulls what it lacks of them.
    pull_from: str | None = None
    pull_blocks: int = 0


class LoadTotals(Record, frozen=True):
    """A node's load since it started (`engine.planner.signals`): prompt tokens admitted, prompt tokens
    prefilled and the seconds its prefill batches computed, KV bytes moved and the transfers' seconds."""

    arrived_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_busy_s: float = 0.0
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    # First tokens seen, and those later than the TTFT SLO (`--autoscale-slo-ttft`; 0 when it is off).
    first_tokens: int = 0
    slo_misses: int = 0
    # Requests admitted and the output tokens they asked for (`max_tokens`): the planner's forecast.
    arrived_requests: int = 0
    arrived_output_tokens: int = 0


# ---------------------------------------------------------------------------------------------- peer messages
class Report(Message, frozen=True, tag="report"):
    """A node's replicas and the addresses of its transfer endpoints (sent on change and periodically),
    the prompt tokens waiting in its router, and its load counters (for the planner)."""

    accepting: bool
    replicas: list[ReplicaReport]
    endpoints: dict[str, str]
    pid: int
    pending_tokens: int = 0
    load: LoadTotals = msgspec.field(default_factory=LoadTotals)


class Submit(Message, frozen=True, tag="submit"):
    """Origin → node: queue the request on `replica` (encode or prefill); `Returned` if it does not take it."""

    replica: str
    request: RequestSnapshot


class Returned(Message, frozen=True, tag="returned"):
    """Node → origin: `replica` did not take the request (or gave it back unstarted): route it again."""

    request_id: str
    replica: str


class RunCommand(Message, frozen=True, tag="run_command"):
    """Run `command` on `replica` and answer with `CommandOutcome` (same `correlation`). A `ReserveKV`
    carries the request it reserves for, so the decode node can hold it."""

    correlation: str
    replica: str
    command: ReplicaCommand
    request: RequestSnapshot | None = None


class CommandOutcome(Message, frozen=True, tag="command_outcome"):
    correlation: str
    result: str | int | list[str] | None = None  # int: `SendCachedKV`'s block count
    error_code: ErrorCode | None = None
    error_message: str | None = None
    # A `Relay` answered across nodes (ZigZag): the offer, and the offered requests, which the asking
    # node adopts as mirrors held by its OldPrefill replica.
    relay: RelayOffer | None = None
    requests: list[RequestSnapshot] = msgspec.field(default_factory=list)


class Holding(Message, frozen=True, tag="holding"):
    """Node → origin: `replica` of this node holds the request now (a decode replica took its KV)."""

    request_id: str
    replica: str


class TokensForward(Message, frozen=True, tag="tokens"):
    """Mirror → origin: generated tokens `[start, start + len(token_ids))`."""

    request_id: str
    start: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)  # where the request asked for them


class EndedForward(Message, frozen=True, tag="ended"):
    """Mirror → origin: the request ended on this node."""

    request_id: str
    outcome: Literal["finished", "failed"]
    finish_reason: Literal["stop", "length", "cancelled"] | None
    code: ErrorCode | None
    message: str | None
    token_ids: list[int]
    generated: list[int]
    stamps: StampsRecord
    transfers: list[TransferSummary]
    relay: RelayInfo | None
    generated_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = msgspec.field(default_factory=list)


class CancelForward(Message, frozen=True, tag="cancel"):
    """Origin → every node: cancel the request's mirror (`stop_at`: a stop string ended it there)."""

    request_id: str
    stop_at: int | None = None


class ForgetRequest(Message, frozen=True, tag="forget"):
    """Origin → every node: the request ended; drop its mirror (cancelling it if it still runs)."""

    request_id: str


class ClientOp(Message, frozen=True, tag="client_op"):
    """Serve a control op on this node (a `cancel` of a request admitted here, a `scale` placed here, a
    cluster `shutdown`) and answer with `ClientOpResult`: the op's final reply as JSON."""

    correlation: str
    request: ControlRequest


class ClientOpResult(Message, frozen=True, tag="client_op_result"):
    correlation: str
    reply: bytes  # the reply as JSON (what the control socket would have written)


PeerMessage = (
    Report
    | Submit
    | Returned
    | RunCommand
    | CommandOutcome
    | Holding
    | TokensForward
    | EndedForward
    | CancelForward
    | ForgetRequest
    | ClientOp
    | ClientOpResult
)


class PeerFrame(Record, frozen=True):
    """One frame of a peer link: `sender` and its `lease` (checked for messages that act on a
    reservation or a lock), the message, and `to_lease`: the lease the sender knows the receiver under
    (0: none yet). A frame meant for an earlier incarnation of the receiver is not acted on."""

    sender: str
    lease: int
    message: PeerMessage
    to_lease: int = 0

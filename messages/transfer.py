"""The resumable transfer protocol's messages (architecture §5), one tagged union per direction.

A *link* joins a receiver endpoint to a sender endpoint; the receiver opened it with `Hello`. Every
transfer message carries `transfer_id`, and those that belong to a round carry `round`. Round 0 is the
`Grant` that opens a transfer; rounds >= 1 are `RequestMoreCache`. Bulk bytes never travel inside these
messages: they land in the receiver's blocks (inproc: a copy; tcp: sub-framed bulk frames read with
`recv_into`), and the `ChunkDone` that describes them follows them on the same ordered link.

`header` fields are opaque to the transport (`msgspec.Raw`): the request id, the total length, image
grids… are whatever the owners put there, encoded in the link's codec (msgpack on peer links;
`messages.peer_codec.encode_header`, `NO_HEADER` when there is nothing to say). msgspec cannot decode an
optional `Raw`, so header fields are required.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from messages.base import Message, Record
from messages.layout import PoolLayout

PROTOCOL_VERSION = 1

# Counts, offsets, rounds and block ids are never negative; a frame saying otherwise is malformed.
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class TransferStatus(enum.Enum):
    """Per-transfer status (architecture §5.6); the transition table lives in `transport.protocol.status`."""

    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class FailureReason(enum.Enum):
    """Why a transfer failed; `transport.errors` maps each to the node's error code."""

    MEMORY_PRESSURE = "memory_pressure"  # no blocks for a grant before the pressure deadline
    NO_PROGRESS = "no_progress"  # no byte or message for this transfer within the progress deadline
    LINK_LOST = "link_lost"  # the peer link closed, broke, missed heartbeats or sent malformed frames
    ABORTED = "aborted"  # an owner gave up (request cancelled, data source failed)
    PROTOCOL_ERROR = "protocol_error"  # the peer broke the protocol (wrong round, offset, blocks…)
    CORRUPTED = "corrupted"  # checksum of a round's bytes did not match
    NO_SENDER = "no_sender"  # a grant found no sending session before the orphan deadline
    TOO_LARGE = "too_large"  # the total can never fit what the receiver may hold


# --------------------------------------------------------------------------- link messages
class Hello(Message, frozen=True, tag="hello"):
    """Receiver → sender, first message on a new link: who I am and what my blocks look like."""

    link_id: str
    protocol_version: int
    endpoint: str
    layout: PoolLayout
    address: str


class HelloAck(Message, frozen=True, tag="hello_ack"):
    """Sender → receiver: handshake accepted."""

    link_id: str
    endpoint: str


class Refusal(Message, frozen=True, tag="refusal"):
    """Sender → receiver: handshake refused; `reason` is a sentence a person can act on."""

    link_id: str
    reason: str


class Heartbeat(Message, frozen=True, tag="heartbeat"):
    """Either way, when the link has been quiet: any received byte counts as liveness."""

    link_id: str
    seq: NonNegative


# --------------------------------------------------------------------------- transfer messages
class Grant(Message, frozen=True, tag="grant"):
    """Receiver → sender, round 0: opens `transfer_id` with landing blocks for stream tokens
    `[stream_offset, stream_offset + tokens)`.

    The first token lands at token `landing_offset` of `blocks` (token `t` of `blocks` is block
    `blocks[t // block_size]`, row `t % block_size`). `landing_key` names this transfer in bulk frames.
    `buffers` selects the layout buffers to move (None: all of them, e.g. a KV layer range otherwise).
    `expected_tokens` is the receiver's exact length when it knows it (KV), else None.
    """

    transfer_id: str
    round: NonNegative
    landing_key: NonNegative
    stream_offset: NonNegative
    tokens: NonNegative
    blocks: tuple[NonNegative, ...]
    header: msgspec.Raw
    landing_offset: NonNegative = 0
    buffers: tuple[str, ...] | None = None
    expected_tokens: NonNegative | None = None


class RequestMoreCache(Message, frozen=True, tag="request_more_cache"):
    """Receiver → sender, rounds >= 1: more landing blocks, for the stream tokens that follow."""

    transfer_id: str
    round: NonNegative
    stream_offset: NonNegative
    tokens: NonNegative
    blocks: tuple[NonNegative, ...]
    landing_offset: NonNegative = 0


class TotalAnnounce(Message, frozen=True, tag="total_announce"):
    """Sender → receiver: the true total, as soon as the sender knows it (before the data is ready)."""

    transfer_id: str
    total_tokens: NonNegative
    header: msgspec.Raw


class ChunkDone(Message, frozen=True, tag="chunk_done"):
    """Sender → receiver, after the round's bytes on the same link: stream tokens
    `[offset, offset + tokens)` of `total_tokens` have landed in round `round`'s blocks.

    `checksum` is the CRC-32 of the round's bytes (buffer by buffer, token order) when the sender's
    configuration asks for it, else None.
    """

    transfer_id: str
    round: NonNegative
    offset: NonNegative
    tokens: NonNegative
    total_tokens: NonNegative
    header: msgspec.Raw
    checksum: int | None = None


class Abort(Message, frozen=True, tag="abort"):
    """Either way: this transfer failed. From the sender it also fences: no bytes follow it."""

    transfer_id: str
    reason: FailureReason
    detail: str
    round: NonNegative | None = None


class AbortAck(Message, frozen=True, tag="abort_ack"):
    """Sender → receiver, after its last write for `transfer_id`: the receiver may reuse the blocks."""

    transfer_id: str


class StatusUpdate(Message, frozen=True, tag="status"):
    """Either way: "still here, waiting on my side" (sender queued behind work, receiver waiting for
    blocks or its consumer). Counts as progress for the peer's deadline."""

    transfer_id: str
    status: TransferStatus
    detail: str = ""


# Receiver → sender.
SenderBound = Grant | RequestMoreCache | Abort | StatusUpdate
# Sender → receiver.
ReceiverBound = TotalAnnounce | ChunkDone | Abort | AbortAck | StatusUpdate
PeerMessage = (
    Hello
    | HelloAck
    | Refusal
    | Heartbeat
    | Grant
    | RequestMoreCache
    | TotalAnnounce
    | ChunkDone
    | Abort
    | AbortAck
    | StatusUpdate
)


# --------------------------------------------------------------------------- results
class TransferReport(Record, frozen=True):
    """What one side of one transfer did, for request results and logs.

    `rounds` counts rounds that carried data (round 0 included); `grants` counts grants (round 0 and
    every `RequestMoreCache`) issued (receiver) or served (sender); `tokens` and `bytes` count what
    landed (receiver) or was written (sender). Timestamps are Unix seconds; `seconds` is measured on
    the Trio clock.
    """

    transfer_id: str
    role: str
    peer: str
    status: TransferStatus
    rounds: NonNegative
    grants: NonNegative
    tokens: NonNegative
    bytes: NonNegative
    seconds: float
    started_at: float
    ended_at: float
    reason: FailureReason | None = None
    detail: str = ""

"""Commands a replica reads from its command channel, ahead of its work and migration queues (architecture §6).

`ReplicaCommand` is the design card's command set. The transfer protocol's sender-bound messages
(`RequestMoreCache`, `Grant`, `Abort`, `StatusUpdate` — defined in `messages.transfer`) reach a sending
replica through the same channel; the replica hands them to the transfer session it owns.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from messages.base import Message
from messages.control import ReplicaStateName, SourceChoice
from messages.transfer import SenderBound
from messages.weights import WeightPiece

Origin = Literal["manual", "controller", "planner", "node"]


class Transition(Message, frozen=True, tag="transition"):
    """Move to state `to` (a commanded move of the architecture §6 table)."""

    command_id: str
    to: ReplicaStateName
    origin: Origin = "manual"
    # NewPrefill / OldPrefill: the replica it relays with (architecture §8).
    paired_with: str | None = None
    # Loading*: load the replica's own copy of the weights from this source (`replicas.loading`);
    # None: share the node's resident copy.
    source: SourceChoice | None = None
    # Loading* with a peer source, one of several replicas a scale starts at once: the replica loading
    # just before it, whose pieces it copies as each lands (a multicast chain); the source after it.
    chain_from: str | None = None


class Lock(Message, frozen=True, tag="lock"):
    """Accept no new KV migrations while this `reason` holds (reasons are independent)."""

    command_id: str
    reason: Literal["manual", "controller"]


class Unlock(Message, frozen=True, tag="unlock"):
    """Drop lock `reason`; the replica stays locked while another reason holds."""

    command_id: str
    reason: Literal["manual", "controller"]


class Flush(Message, frozen=True, tag="flush"):
    """Adopt this replica's own queued, not-yet-migrated batches as decode work (MutatingToDecode)."""

    command_id: str


class Relay(Message, frozen=True, tag="relay"):
    """ZigZag (architecture §8): OldPrefill replica `old_prefill` asks its paired NewPrefill replica for its
    oldest unfinished batch. Answered with a `RelayOffer` — the batch then streams its hidden states as
    transfer `offer.transfer_id` from the NewPrefill's relay endpoint — or refused with `not_found`
    when the NewPrefill holds no batch it can hand over whose prompts fit in `room_tokens` tokens."""

    command_id: str
    old_prefill: str
    room_tokens: Annotated[int, msgspec.Meta(ge=0)]


class RelayedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request of a relayed batch: its rows are `[offset, offset + prompt_tokens)` of the batch."""

    request_id: str
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1)]
    offset: Annotated[int, msgspec.Meta(ge=0)]


class RelayOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A NewPrefill's answer to `Relay`: batch `batch_id`, computed through layers `[0, layer)`, whose
    hidden states (`hidden`, and the rotary `positions` of each token) stream as transfer `transfer_id`
    from endpoint `source_endpoint`. The NewPrefill keeps each request's KV of layers `[0, layer)` until
    a `SendKVHalf` or `DropKVHalf` names it."""

    batch_id: str
    transfer_id: str
    source_endpoint: str
    new_prefill: str
    layer: Annotated[int, msgspec.Meta(ge=0)]
    total_tokens: Annotated[int, msgspec.Meta(ge=1)]
    requests: list[RelayedRequest]


class SendKVHalf(Message, frozen=True, tag="send_kv_half"):
    """To a NewPrefill: send request `request_id`'s KV of layers `[0, layer)` as transfer `transfer_id`
    (a decode replica reserved its cache and is receiving it); the blocks are freed once sent."""

    command_id: str
    request_id: str
    transfer_id: str


class DropKVHalf(Message, frozen=True, tag="drop_kv_half"):
    """To a NewPrefill: free request `request_id`'s KV half (the request ended without decoding)."""

    command_id: str
    request_id: str


class AddRelayPartner(Message, frozen=True, tag="add_relay_partner"):
    """To a NewPrefill (or RefractoryPrefill): OldPrefill replica `old_prefill` relays its batches too;
    hint it when a batch is ready (`RelayHint`). Sent by the OldPrefill replica when it is paired."""

    command_id: str
    old_prefill: str


class RelayHint(Message, frozen=True, tag="relay_hint"):
    """To an OldPrefill: its partner `new_prefill` holds a batch ready to hand over whose oldest request
    arrived at `oldest` (wall clock), or none (`oldest` null), so its next `Relay` is not a blind one."""

    command_id: str
    new_prefill: str
    oldest: float | None = None


class KVHalf(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The other half of a ZigZag migration: layers `[start, stop)` sent as `transfer_id` from
    endpoint `source_endpoint`."""

    transfer_id: str
    source_endpoint: str
    start: Annotated[int, msgspec.Meta(ge=0)]
    stop: Annotated[int, msgspec.Meta(ge=0)]


class ReserveKV(Message, frozen=True, tag="reserve_kv"):
    """Ask a decode replica to take request `request_id`'s KV: reserve `capacity_tokens` of its cache
    all-or-nothing and receive the prompt's `prompt_tokens` tokens of KV as transfer `transfer_id` from
    the KV endpoint `source_endpoint`. Refused (not an error) when locked, full or not decoding."""

    command_id: str
    request_id: str
    transfer_id: str
    source_endpoint: str
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1)]
    capacity_tokens: Annotated[int, msgspec.Meta(ge=1)]
    # ZigZag: this transfer carries layers `[layers[0], layers[1])` only, and `other_half` the rest; the
    # request decodes once both landed. None: one transfer carries every layer.
    layers: tuple[int, int] | None = None
    other_half: KVHalf | None = None


class SendWeights(Message, frozen=True, tag="send_weights"):
    """To a replica holding a fully loaded model: send bytes from `byte_offset` of checkpoint piece `piece`
    — as many as its weight staging pool holds — as transfer `transfer_id` to the weights endpoint
    `destination_endpoint` (`replicas.loading.peer_send`). Refused with `not_found` when it holds no
    fully loaded weights."""

    command_id: str
    transfer_id: str
    piece: WeightPiece
    destination_endpoint: str
    byte_offset: Annotated[int, msgspec.Meta(ge=0)] = 0


class WithdrawEncode(Message, frozen=True, tag="withdraw_encode"):
    """To an encode replica: drop the job of embedding transfer `transfer_id` (the router could not place
    the request's language side after all); its transfer aborts."""

    command_id: str
    transfer_id: str


class SendCachedKV(Message, frozen=True, tag="send_cached_kv"):
    """To a replica with a prefix cache: send the KV of its cached blocks `keys[start:]` as transfer
    `transfer_id` to the replica that asks (a pull, docs/prefix-cache.md). `keys` are a prompt's block
    keys from its first block: the replica borrows the chain it holds of them (their references keep
    them from eviction while they move) and sends from block `start` on. Answered with the number of
    blocks it sends (those of `keys[start:]` it holds in a row); refused with `not_found` when it holds
    none of them."""

    command_id: str
    transfer_id: str
    keys: list[bytes]
    start: Annotated[int, msgspec.Meta(ge=0)] = 0


ReplicaCommand = (
    Transition
    | Lock
    | Unlock
    | Flush
    | Relay
    | AddRelayPartner
    | RelayHint
    | SendKVHalf
    | DropKVHalf
    | ReserveKV
    | SendWeights
    | WithdrawEncode
    | SenderBound
    | SendCachedKV
)

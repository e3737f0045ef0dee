"""Commands a replica reads from its command channel, ahead of its work and migration queues (DESIGN §6).

`ReplicaCommand` is the design card's command set. The transfer protocol's sender-bound messages
(`RequestMoreCache`, `Grant`, `Abort`, `StatusUpdate` — defined in `messages.transfer`) reach a sending
replica through the same channel; the replica hands them to the transfer session it owns.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from messages.base import Message
from messages.control import ReplicaStateName
from messages.transfer import SenderBound

Origin = Literal["manual", "controller", "planner", "node"]


class Transition(Message, frozen=True, tag="transition"):
    """Move to state `to` (a commanded move of the DESIGN §6 table)."""

    command_id: str
    to: ReplicaStateName
    origin: Origin = "manual"


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
    """ZigZag: run layers `[start_layer, L)` of a batch another replica began (not supported yet)."""

    command_id: str
    batch_id: str
    start_layer: Annotated[int, msgspec.Meta(ge=0)]


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


ReplicaCommand = Transition | Lock | Unlock | Flush | Relay | ReserveKV | SenderBound

"""Log events of live scaling (DESIGN §8): ZigZag pairing and relays (weight copies: `WeightsProgress`
and the copy events in `messages.events`). Part of the `messages.events.LogEvent` union."""

from __future__ import annotations

from messages.event_base import ReplicaEvent


class ReplicasPaired(ReplicaEvent, frozen=True, kw_only=True, tag="replicas_paired"):
    """A scale paired NewPrefill replica `new_prefill` with OldPrefill replica `old_prefill`."""

    new_prefill: str
    old_prefill: str


class RelayHandedOver(ReplicaEvent, frozen=True, kw_only=True, tag="relay_handed_over"):
    """A NewPrefill replica handed batch `batch_id` over after layers `[0, layer)`."""

    batch_id: str
    new_prefill: str
    old_prefill: str
    layer: int
    requests: int
    tokens: int


class RelayReceived(ReplicaEvent, frozen=True, kw_only=True, tag="relay_received"):
    """An OldPrefill replica received the hidden states of batch `batch_id`."""

    batch_id: str
    new_prefill: str
    old_prefill: str
    layer: int
    bytes: int
    seconds: float

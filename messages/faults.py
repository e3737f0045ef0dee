"""Fault-injection hooks (architecture §7): typed descriptions the node hands to its replicas and transports.

Off by default: a node configured with no faults injects nothing. Each fault names the replica (or the
link) it hits, so one configuration can target one replica of many. The node logs a `fault_injected`
event each time a fault fires. The command-line form (``--fault KIND:key=value,...``) is parsed in
`engine.config`; docs/configuration.md lists every kind with an example.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from messages.control import ReplicaName

TransferKindName = Literal["embedding", "kv"]


class FaultBase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    """Every fault is tagged by ``kind``."""


class FailReplica(FaultBase, frozen=True, tag="fail_replica"):
    """`replica`'s task raises `InjectedFault` after `after_steps` steps of its loop (0: on its first)."""

    replica: ReplicaName
    after_steps: Annotated[int, msgspec.Meta(ge=0)] = 0


class DropLink(FaultBase, frozen=True, tag="drop_link"):
    """`source`'s outgoing links are torn down abruptly once `after_bytes` bulk bytes crossed one (the
    receiver sees the link break mid-transfer). `destination` is informational: every link of `source`."""

    source: ReplicaName
    destination: ReplicaName
    after_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0


class StallSender(FaultBase, frozen=True, tag="stall_sender"):
    """`replica`, as a transfer sender, waits `seconds` before writing each chunk (no bytes, no progress)."""

    replica: ReplicaName
    seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]


class CorruptTransfer(FaultBase, frozen=True, tag="corrupt_transfer"):
    """Flip bits in the landed bytes of transfers of `transfer` kind (after the copy, before consumption).

    `nth` selects one transfer of that kind, counting from 0 in the order they finish; null hits every one.
    """

    transfer: TransferKindName
    nth: Annotated[int, msgspec.Meta(ge=0)] | None = None


class HoldWeights(FaultBase, frozen=True, tag="hold_weights"):
    """A replica's own weight copy (`replicas.loading`) waits `seconds` before loading layer `before_layer`
    (the number of layers: before the final norm and head), so a test can see it partly loaded. `replica`:
    only copies into that replica; `nth`: only the node's `nth` weight copy, counting from 1."""

    before_layer: Annotated[int, msgspec.Meta(ge=0)]
    seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
    replica: ReplicaName | None = None
    nth: Annotated[int, msgspec.Meta(ge=1)] | None = None


class BlockKeepalive(FaultBase, frozen=True, tag="block_keepalive"):
    """A cluster node (`engine.cluster`) sends no lease keepalives for `seconds` seconds, starting
    `after_s` seconds after it joined: its lease expires while etcd is reachable, as when it stalls."""

    seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
    after_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0


Fault = FailReplica | DropLink | StallSender | CorruptTransfer | HoldWeights | BlockKeepalive
FAULT_KINDS: dict[str, type[Fault]] = {
    "fail_replica": FailReplica,
    "drop_link": DropLink,
    "stall_sender": StallSender,
    "corrupt_transfer": CorruptTransfer,
    "hold_weights": HoldWeights,
    "block_keepalive": BlockKeepalive,
}

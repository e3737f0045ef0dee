"""What a replica gets from its node: settings, weights, the transfer fabric, the log, its peers.

`replicas/` never imports `engine/`: the node maps its `NodeConfig` into `ReplicaSettings` and hands
each replica one `ReplicaServices`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, final

import msgspec

from messages.commands import ReplicaCommand
from messages.faults import Fault
from messages.log.events import LogEvent, ReplicaBlocks
from replicas.emulation import EmulatedSpeed
from replicas.fabric import Fabric
from replicas.model.gpu.options import AttentionChoice, GraphsChoice
from replicas.request import ServingRequest
from replicas.states import ReplicaState
from replicas.weights import ModelHost
from transport.config import TransferConfig

if TYPE_CHECKING:
    from replicas.actor import Replica


class EventSink(Protocol):
    """Where replicas write typed log events (the node's `engine.logging.EventLog` is one)."""

    def emit(self, event: LogEvent) -> None: ...

    def bind(self, *, request_id: str | None = None, replica: str | None = None) -> EventSink: ...


class PeerReplica(Protocol):
    """A replica of another node of the cluster, as its node last reported it (`engine.cluster`)."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> ReplicaState: ...

    @property
    def lock_reasons(self) -> frozenset[str]: ...

    def kv_usage(self) -> tuple[int, int]: ...

    def blocks(self) -> ReplicaBlocks: ...

    async def ask(self, command: ReplicaCommand, *, timeout: float = 30.0) -> Any: ...


class ReplicaSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-replica sizes and limits (from the node's config)."""

    kv_block_size: int = 16
    kv_pool_blocks: int = 2048
    embedding_block_size: int = 128
    embedding_pool_blocks: int = 256
    embedding_default_blocks: int = 8
    embedding_max_grant_blocks: int | None = None
    max_batch_tokens: int = 4096
    max_batch_size: int = 64
    migration_wait: float = 60.0
    migrations_in_flight: int = 8
    kv_transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    embedding_transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    # A replica's weight staging pool (`replicas.loading.staging`): blocks of 1 MiB, what one peer weight
    # transfer carries at most; and its endpoint's knobs.
    weights_pool_blocks: int = 4
    weights_transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    emulated: EmulatedSpeed = msgspec.field(default_factory=EmulatedSpeed)
    # ZigZag: an OldPrefill replica also serves its own queue between relays (relays first).
    old_prefill_serves_queue: bool = True
    # How executors run the model (`[executor]`, replicas/model/gpu/options.py).
    attention: AttentionChoice = "auto"
    cuda_graphs: GraphsChoice = "auto"


@final
@dataclass(slots=True)
class ReplicaServices:
    """Shared by every replica of one node (one Trio thread: no locks)."""

    settings: ReplicaSettings
    host: ModelHost
    fabric: Fabric
    log: EventSink
    faults: list[Fault] = field(default_factory=list)
    requests: dict[str, ServingRequest] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    # Transfers that finished landing on this node, per kind: the `nth` of the corrupt_transfer fault
    # counts these (node-wide, in finishing order).
    transfers_landed: Counter[str] = field(default_factory=Counter)
    # Own weight copies started on this node (`replicas.loading`): the `nth` of the hold_weights fault.
    weight_copies: int = 0
    # The router's hooks: take back work a replica will not do; a replica's readiness changed.
    return_work: Callable[[ServingRequest], None] = lambda request: None
    readiness_changed: Callable[[], None] = lambda: None
    # The replicas of the other nodes of a cluster that may take this node's work now (empty alone).
    peers: Callable[[], Sequence[PeerReplica]] = lambda: ()

"""The small protocols a replica's parts are given through their constructors (architecture §6).

A part takes only what it uses: the log (`EventSink`), the node's live requests by id (`LiveRequests`),
the other replicas it may command (`Directory`, of `PeerReplica`s: this node's and, in a cluster, the
others' as last reported), and the actor it works in (`Actor`). The node composes the real ones;
nothing here is mutable from outside the part that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from messages.commands import ReplicaCommand
from messages.log.events import LogEvent
from replicas.inbox import CommandRefused, InboxItem
from replicas.request import ServingRequest
from replicas.snapshot import ReplicaSnapshot
from replicas.states import ReplicaState


class EventSink(Protocol):
    """Where replicas write typed log events (the node's `engine.logging.EventLog` is one)."""

    def emit(self, event: LogEvent) -> None: ...

    def bind(self, *, request_id: str | None = None, replica: str | None = None) -> EventSink: ...


class LiveRequests(Protocol):
    """The node's live requests by id (the router registers and forgets them)."""

    def get(self, request_id: str) -> ServingRequest | None: ...

    def values(self) -> Iterable[ServingRequest]: ...


class PeerReplica(Protocol):
    """A replica another part may read and command: this node's, or another node's as its node last
    reported it (`engine.cluster`). `ask` raises `replicas.inbox.CommandRefused`."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> ReplicaState: ...

    @property
    def lock_reasons(self) -> frozenset[str]: ...

    def snapshot(self) -> ReplicaSnapshot: ...

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` (prefix-cache block keys) it holds, as far as this node knows."""
        ...

    async def ask(self, command: ReplicaCommand, *, timeout: float = 30.0) -> Any: ...

    def submit(self, request: ServingRequest) -> bool: ...


class LocalReplica(PeerReplica, Protocol):
    """A replica of this node: besides asking, one may tell it a command, or wake its loop."""

    def tell(self, command: ReplicaCommand) -> None: ...

    def post(self, item: InboxItem = None) -> None: ...


class Directory(Protocol):
    """The replicas a replica may address: this node's by name, the other nodes' that take work now."""

    def get(self, name: str) -> LocalReplica | None: ...

    def local(self) -> Sequence[LocalReplica]: ...

    def remote(self) -> Sequence[PeerReplica]: ...


class NodeSignal(Protocol):
    """The node-wide change signal (`replicas.signals.Changes`): a part `notify`s it when something
    others may wait for changed (its state, lock, room or held blocks), and may `watch` it."""

    def notify(self) -> None: ...

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]: ...


class Actor(Protocol):
    """What a part of a replica may ask of the actor it works in. `post` puts an item in the actor's
    inbox (a completion its main loop applies, or None: look again); `spawn` starts a helper task in
    the actor's nursery (transfers, loading). Both drop what a part of an earlier run — before the
    replica failed and restarted — sends: such a part is stale."""

    @property
    def name(self) -> str: ...

    @property
    def log(self) -> EventSink: ...

    @property
    def state(self) -> ReplicaState: ...

    def post(self, item: InboxItem = None) -> None: ...

    def later(self, apply: Callable[[], None]) -> None:
        """Run `apply` in the main loop (from a helper task)."""
        ...

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None: ...


def peer_named(directory: Directory, name: str) -> PeerReplica | None:
    """Replica `name`: this node's, else another node's as last reported (a ZigZag partner may live on
    another node); None when neither is known now."""
    local = directory.get(name)
    if local is not None:
        return local
    return next((peer for peer in directory.remote() if peer.name == name), None)


def tell_peer(
    actor: Actor, directory: Directory, name: str, command: ReplicaCommand, *, timeout: float = 5.0
) -> bool:
    """Tell replica `name` `command` without waiting for it: this node's through its inbox, another
    node's by an `ask` in a helper task of `actor` whose refusal (the replica or its node gone, no answer
    within `timeout` seconds: a link cut off) is dropped — as a local replica that is gone hears nothing.
    False when no such replica is known."""
    local = directory.get(name)
    if local is not None:
        local.tell(command)
        return True
    peer = peer_named(directory, name)
    if peer is None:
        return False

    async def ask() -> None:
        try:
            await peer.ask(command, timeout=timeout)
        except CommandRefused:
            pass  # see the docstring: a told command has no answer

    actor.spawn(ask)
    return True

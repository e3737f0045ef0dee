"""The node's directory of replicas: this node's by name, and the other nodes' that take work now.

The node adds each replica once it started (`add`); a cluster member registers where the other nodes'
replicas come from (`serve_remote`, a source of `PeerReplica`s as their nodes last reported them) —
alone, there is none. Parts that address replicas (the router, the controller, the migration queue,
ZigZag partners, peer weight copies) read it through `replicas.ports.Directory`; none of them writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import final

from replicas.actor.replica import Replica
from replicas.ports import PeerReplica


@final
class ReplicaDirectory:
    """See the module docstring. Single Trio thread."""

    def __init__(self) -> None:
        self._local: dict[str, Replica] = {}
        self._remote: list[Callable[[], Sequence[PeerReplica]]] = []

    def add(self, replica: Replica) -> None:
        assert replica.name not in self._local, f"replica {replica.name} added twice"
        self._local[replica.name] = replica

    def get(self, name: str) -> Replica | None:
        return self._local.get(name)

    def __getitem__(self, name: str) -> Replica:
        return self._local[name]

    def __contains__(self, name: object) -> bool:
        return name in self._local

    def __iter__(self) -> Iterator[str]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)

    def clear(self) -> None:
        """Forget this node's replicas (the node stopped: their pools' memory may go)."""
        self._local.clear()

    def local(self) -> list[Replica]:
        """This node's replicas, in the order they were added."""
        return list(self._local.values())

    def serve_remote(self, source: Callable[[], Sequence[PeerReplica]]) -> None:
        """Take the other nodes' replicas from `source` too (a cluster member; empty alone)."""
        self._remote.append(source)

    def remote(self) -> list[PeerReplica]:
        """The other nodes' replicas that may take this node's work now."""
        return [peer for source in self._remote for peer in source()]

"""The node's transfer fabric: which endpoint listens where, and the links between them.

Every replica pool that sends or receives blocks has a `TransferEndpoint` named `{replica}/{pool}`
(`prefill-0/kv`, `encode-0/emb`). Endpoints register their address here when they open. A receiver asks
`link(endpoint, sender_name)` for a handshaken link to a sender; links are made once per pair and
reused by every later transfer (receivers connect to senders, architecture §5.1).

The transport (`--transport`, `transport.kinds`): `inproc`, `tcp` (loopback), `ucx` (ucxx; even between
replicas of one process, over UCX's shared memory) or `cuda-ipc` (pools on the CPU — embedding pools —
then listen on tcp). `auto` chooses per link with
`transport.kinds.choose`; every endpoint a fabric knows lives in the node's process, so each link
resolves to inproc, and `kind` (each replica's `transport` in `status`) says so. The choice is logged
(`transfer.transport_chosen`).

In a cluster (`engine.cluster`, `clustered=True`) endpoints are reached from other processes and hosts:
`inproc` and `auto` become `tcp`, every endpoint listens on `host`, and the addresses of the other
nodes' endpoints arrive with their reports (`remote`); when a node leaves, or comes back as another
incarnation, `forget_remote` drops its endpoints' addresses, closes the links to them and stops the
connects in progress to them, so the next transfer dials the new process instead of waiting on a link to
the old one, and a transfer from a node cut off fails at once.
"""

from __future__ import annotations

from typing import final

import structlog
import trio

from transport.endpoint import TransferEndpoint
from transport.errors import LinkClosed, LinkError
from transport.kinds import LinkFacts, TransportChoice, TransportKind, choose
from transport.links.inproc.link import InprocNetwork
from transport.protocol.link import Link

_log = structlog.get_logger("transport.fabric")


@final
class UnknownEndpoint(Exception):
    """A transfer names an endpoint that is not open (its replica is not running)."""


@final
class Fabric:
    """Endpoint directory and link cache for one node. Single Trio thread; no locking beyond per-pair."""

    def __init__(self, kind: TransportChoice, *, clustered: bool = False, host: str = "127.0.0.1") -> None:
        self.requested: TransportChoice = kind
        self.kind: TransportKind
        self.host = host
        # Endpoints of the other nodes of a cluster: name -> address, from their reports.
        self.remote: dict[str, str] = {}
        if clustered and kind in ("auto", "inproc"):
            self.kind = "tcp"
            _log.info("transfer.transport_chosen", requested=kind, transport="tcp", reason="cluster node")
        elif kind == "auto":
            # Every endpoint registers here from this process: each link is a same-process link.
            self.kind, reason = choose(LinkFacts(same_process=True, same_host=True, gpu_pools=False))
            _log.info("transfer.transport_chosen", requested=kind, transport=self.kind, reason=reason)
        else:
            self.kind = kind
        self.inproc = InprocNetwork()
        self._addresses: dict[str, str] = {}
        self._endpoints: dict[str, TransferEndpoint] = {}
        self._connecting: dict[tuple[str, str], trio.Lock] = {}
        # Connects in progress → the sending endpoint each dials (`forget_remote` stops them).
        self._dialing: dict[trio.CancelScope, str] = {}
        self._stopped: dict[trio.CancelScope, str] = {}  # a stopped connect → why
        self.bytes_between: dict[tuple[str, str, str], int] = {}

    async def listen(self, endpoint: TransferEndpoint) -> str:
        """Start `endpoint` listening on this fabric's transport and register its address."""
        kind = self.kind
        if kind == "cuda-ipc" and endpoint.storage.device.type != "cuda":
            kind = "tcp"  # a pool on the CPU (embeddings) cannot be mapped through CUDA IPC
            _log.info(
                "transfer.transport_chosen", endpoint=endpoint.name, transport=kind, reason="pool on cpu"
            )
        if kind == "inproc":
            address = endpoint.listen_inproc()
        elif kind == "tcp":
            address = await endpoint.listen_tcp(self.host, 0)
        else:
            address = await endpoint.listen_on(kind, self.host)
        self._addresses[endpoint.name] = address
        self._endpoints[endpoint.name] = endpoint
        return address

    def forget(self, endpoint_name: str) -> None:
        self._addresses.pop(endpoint_name, None)
        self._endpoints.pop(endpoint_name, None)

    def forget_remote(self, prefix: str, why: str) -> None:
        """The endpoints named `prefix…` (another node's, `{node}/`) are gone: drop their addresses and
        close this node's links to them (`why` goes into the links' error)."""
        for name in [n for n in self.remote if n.startswith(prefix)]:
            del self.remote[name]
        self.close_links(prefix, why)

    def close_links(self, prefix: str, why: str) -> None:
        """Close this node's links to the endpoints named `prefix…` and stop dials to them (`why` goes
        into their error); their addresses stay known. The transfers on them fail at once."""
        for endpoint in self._endpoints.values():
            for link in endpoint.links():
                if link.peer is not None and link.peer.startswith(prefix):
                    link.close(LinkClosed(f"{link.describe()}: {why}"))
        # A connect to a host cut off waits for TCP's connect timeout (minutes): stopped here too.
        for scope, sender in list(self._dialing.items()):
            if sender.startswith(prefix):
                self._stopped[scope] = why
                scope.cancel()

    @property
    def local_addresses(self) -> dict[str, str]:
        return dict(self._addresses)

    def address(self, endpoint_name: str) -> str:
        address = self._addresses.get(endpoint_name) or self.remote.get(endpoint_name)
        if address is None:
            raise UnknownEndpoint(f"transfer endpoint {endpoint_name!r} is not open")
        return address

    async def link(self, endpoint: TransferEndpoint, sender: str) -> Link:
        """An open, handshaken link from receiving `endpoint` to the sending endpoint `sender`.

        Raises `UnknownEndpoint`, `transport.errors.HandshakeRefused` or `LinkError` (with the reason)."""
        key = (endpoint.name, sender)
        lock = self._connecting.setdefault(key, trio.Lock())
        async with lock:
            for link in endpoint.links(sender):
                if link.role == "receiver" and not link.is_closed:
                    return link
            address = self.address(sender)
            with trio.CancelScope() as scope:
                self._dialing[scope] = sender
                try:
                    return await endpoint.connect(address)
                except OSError as exc:
                    raise LinkError(
                        f"{endpoint.name}: cannot connect to {sender} at {address}: {exc}"
                    ) from exc
                finally:
                    del self._dialing[scope]
                    why = self._stopped.pop(scope, "stopped")
            raise LinkError(f"{endpoint.name}: connecting to {sender} at {address} stopped: {why}")

    def count_bytes(self, source: str, destination: str, kind: str, nbytes: int) -> None:
        """Account `nbytes` of `kind` (kv, embedding) moved from replica `source` to `destination`."""
        key = (source, destination, kind)
        self.bytes_between[key] = self.bytes_between.get(key, 0) + nbytes

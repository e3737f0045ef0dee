"""A transfer endpoint: one pool of one replica, its links, and the transfers running over them.

    async with open_endpoint("prefill-0/emb", storage, pool, inproc=network) as endpoint:
        address = endpoint.listen_inproc()            # or: await endpoint.listen_tcp()
        link = await endpoint.connect("inproc://encode-0/emb")     # receivers connect to senders
        result = await endpoint.receive("req-7/emb", peer=link, consume=step)
        async with endpoint.open_send("req-7/emb") as session:     # on the sending endpoint
            result = await session.send(ids, total_tokens=n)

The endpoint's nursery owns every link's reader, fence watchers, small control sends and the one task
that keeps every transfer's deadlines and keep-alives (`transport.protocol.liveness`); transfers run in their
callers' tasks (`receive`, `SendSession.send`). Leaving the context closes the links (which fences every
write) and returns quarantined blocks.

Sender-bound control messages (`Grant`, `RequestMoreCache`, `Abort`, `StatusUpdate`) are delivered to
the sending sessions directly, or — when the owner passes `sender_control` — pushed into that channel as
`SenderDelivery` items; the owner (a replica, through its command channel) then calls
`endpoint.deliver(item)`. Grants for a transfer no session has opened yet wait up to `orphan_timeout`.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal, assert_never, final

import msgspec
import structlog
import trio

from messages.peer_codec import NO_HEADER
from messages.transfer import (
    Abort,
    AbortAck,
    ChunkDone,
    Grant,
    Heartbeat,
    Hello,
    HelloAck,
    PeerMessage,
    Refusal,
    RequestMoreCache,
    SenderBound,
    StatusUpdate,
    TotalAnnounce,
)
from transport.bulk import gpu_copy
from transport.config import TransferConfig
from transport.errors import HandshakeRefused, LinkBroken, LinkClosed, LinkError
from transport.faults import NO_FAULTS, FaultPlan
from transport.links import dial
from transport.links.inproc.link import InprocNetwork
from transport.links.tcp import admission as tcp_admission
from transport.links.tcp import link as tcp
from transport.links.tcp.sockets import LinkSocket
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage
from transport.protocol import handshake
from transport.protocol.fences import Fences
from transport.protocol.landing import Consume, ReceiveResult, check_landing_request
from transport.protocol.link import Landing, Link
from transport.protocol.liveness import KeptAlive, keep_alive_sessions
from transport.protocol.receiver import ReceiveSession
from transport.protocol.scope import describe_exit, open_task_scope
from transport.protocol.sender import SendSession
from transport.protocol.sender_desk import SenderDelivery, SenderDesk, hand_to_owner

_log = structlog.get_logger("transport.endpoint")


@asynccontextmanager
async def open_endpoint(
    name: str,
    storage: PoolStorage,
    pool: BlockPool,
    *,
    config: TransferConfig | None = None,
    faults: FaultPlan = NO_FAULTS,
    inproc: InprocNetwork | None = None,
    sender_control: trio.MemorySendChannel[SenderDelivery] | None = None,
) -> AsyncIterator[TransferEndpoint]:
    """An endpoint serving `pool` (allocator) and `storage` (its bytes) until the context exits."""
    endpoint = TransferEndpoint(
        name, storage, pool, config or TransferConfig(), faults, inproc, sender_control
    )
    async with open_task_scope() as nursery:
        endpoint._nursery = nursery
        nursery.start_soon(gpu_copy.prepare_in_thread, storage.device)  # not in the first round
        nursery.start_soon(endpoint.senders.sweep_orphans)
        nursery.start_soon(keep_alive_sessions, endpoint.kept_alive, endpoint.config.progress_timeout)
        try:
            yield endpoint
        finally:
            with trio.CancelScope(shield=True):
                await endpoint._shut_down()
            nursery.cancel_scope.cancel()


@final
class TransferEndpoint:
    """See the module docstring. Build it with `open_endpoint`."""

    def __init__(
        self,
        name: str,
        storage: PoolStorage,
        pool: BlockPool,
        config: TransferConfig,
        faults: FaultPlan,
        inproc: InprocNetwork | None,
        sender_control: trio.MemorySendChannel[SenderDelivery] | None,
    ) -> None:
        if storage.num_blocks != pool.num_blocks or storage.block_size != pool.block_size:
            raise ValueError(
                f"endpoint {name!r}: storage has {storage.num_blocks} blocks of {storage.block_size} tokens, "
                f"pool has {pool.num_blocks} of {pool.block_size}"
            )
        self.name, self.storage, self.pool, self.config, self.faults = name, storage, pool, config, faults
        self.address, self._inproc, self._sender_control = "", inproc, sender_control
        self._nursery: trio.Nursery | None = None
        self._links: set[Link] = set()
        self._receivers: dict[str, ReceiveSession] = {}
        self._landings: dict[int, ReceiveSession] = {}
        self.senders = SenderDesk(name, config.orphan_timeout, self.send_soon)
        self._fences, self._landing_keys = Fences(pool, config.fence_timeout), itertools.count(1)
        self._listeners: list[trio.CancelScope] = []

    @property
    def nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError(f"endpoint {self.name!r} is not open (use open_endpoint)")
        return self._nursery

    def links(self, peer: str | None = None) -> list[Link]:
        """Open links, optionally only those to endpoint `peer`."""
        return [link for link in self._links if peer is None or link.peer == peer]

    # ------------------------------------------------------------------ listening and connecting
    def listen_inproc(self) -> str:
        if self._inproc is None:
            raise ValueError(f"endpoint {self.name!r} has no inproc network")
        self.address = self._inproc.listen(
            self.name, handler=self, on_accept=self._adopt, config=self.config, faults=self.faults
        )
        return self.address

    async def listen_tcp(self, host: str = "127.0.0.1", port: int = 0) -> str:
        listener = tcp.listen_socket(host, port)
        self.address = f"tcp://{host}:{listener.getsockname()[1]}"
        self.nursery.start_soon(self._accept_tcp, listener)
        await trio.lowlevel.checkpoint()
        return self.address

    async def listen_on(self, kind: Literal["ucx", "cuda-ipc"], host: str = "127.0.0.1") -> str:
        """Accept links over `ucx` or `cuda-ipc` (`transport.links.dial`); returns the address."""
        self.address = await dial.listen(self, kind, self._adopt, host)
        return self.address

    async def _accept_tcp(self, listener: socket.socket) -> None:
        def adopt(sock: LinkSocket) -> None:
            self._adopt(tcp.tcp_link(sock, self, "sender"))

        with trio.CancelScope() as scope, listener:
            self._listeners.append(scope)
            await tcp_admission.accept_all(listener, self.config, self.name, self.nursery, adopt)

    def _adopt(self, link: Link) -> None:
        self._links.add(link)
        self.nursery.start_soon(link.run)

    async def connect(self, address: str) -> Link:
        """A handshaken link to the sending endpoint at `address` (`tcp://host:port`, `inproc://name`).

        Raises `HandshakeRefused` with the peer's reason, `LinkBroken` when it does not answer within
        `handshake_timeout`, `OSError` when nothing listens there."""
        scheme, _, rest = address.partition("://")
        link: Link
        if scheme == "inproc":
            if self._inproc is None:
                raise ValueError(f"endpoint {self.name!r} has no inproc network for {address!r}")
            link = self._inproc.connect(
                rest, local=self.name, handler=self, config=self.config, faults=self.faults
            )
        elif scheme == "tcp":
            host, _, port = rest.rpartition(":")
            with trio.fail_after(self.config.handshake_timeout):
                sock = await tcp_admission.connect(host, int(port), self.config.admission, address)
                link = tcp.tcp_link(sock, self, "receiver")
        else:  # ucx://, cuda-ipc:// (optional dependencies: transport.links.dial imports them when used)
            link = await dial.dial(self, address)
        self._adopt(link)
        await link.send(handshake.hello(link.link_id, self.name, self.storage.layout, self.address))
        with trio.move_on_after(self.config.handshake_timeout):
            await link.ready.wait()
        if link.refusal is not None:
            raise HandshakeRefused(link.refusal)
        if not link.ready.is_set():
            timeout = self.config.handshake_timeout
            link.close(LinkBroken(f"no handshake reply from {address} within {timeout} s"))
        if link.error is not None:
            raise type(link.error)(str(link.error))
        return link

    # ------------------------------------------------------------------ transfers
    async def receive(
        self,
        transfer_id: str,
        *,
        peer: Link | str,
        header: msgspec.Raw = NO_HEADER,
        expected_tokens: int | None = None,
        blocks: Sequence[int] | None = None,
        landing_offset: int = 0,
        buffers: Sequence[str] | None = None,
        consume: Consume | None = None,
        owner: str | None = None,
        into: PoolStorage | None = None,
    ) -> ReceiveResult:
        """Receive transfer `transfer_id` from the sender at the far end of `peer`; see
        `transport.protocol.receiver` for the two landing modes. `peer` is a link from `connect` or the
        sending endpoint's name. `into`: storage of this endpoint's layout the caller owns, where the
        borrowed `blocks` lie (instead of this endpoint's pool): the bytes land straight in it. Only over
        a link that `lands_in_named_storage` (not cuda-ipc, whose sender writes into this pool's shared
        memory). The caller keeps `into` alive and untouched until this returns, as with any borrowed
        landing (a failed receive returns after its fence). Raises `TransferFailed` /
        `TransferTimeout`; `ValueError` for a request that cannot be met."""
        if isinstance(peer, str):
            named = [link for link in self.links(peer) if link.role == "receiver"]
            if not named:
                raise ValueError(f"endpoint {self.name!r} has no link to {peer!r}; connect to it first")
            peer = named[0]
        if peer.role != "receiver" or peer not in self._links:
            raise ValueError(f"endpoint {self.name!r}: {peer.describe()} is not one of its receiving links")
        if transfer_id in self._receivers:
            raise ValueError(f"endpoint {self.name!r}: transfer {transfer_id!r} is already being received")
        if into is not None:
            if blocks is None or into.layout != self.storage.layout:
                raise ValueError(
                    f"endpoint {self.name!r}: transfer {transfer_id!r} lands in storage of its own: it needs "
                    "borrowed blocks in it and this endpoint's layout"
                )
            if not peer.lands_in_named_storage:
                raise ValueError(
                    f"endpoint {self.name!r}: {peer.describe()} writes only into this endpoint's pool; "
                    "receive into the pool and copy out instead"
                )
        layout_names = tuple(spec.name for spec in self.storage.layout.buffers)
        space = self.storage if into is None else into
        names = check_landing_request(transfer_id, layout_names, buffers, space, blocks, landing_offset)
        key = next(self._landing_keys)
        session = ReceiveSession(
            self,
            peer,
            transfer_id,
            landing_key=key,
            header=header,
            expected_tokens=expected_tokens,
            blocks=blocks,
            landing_offset=landing_offset,
            buffers=names,
            all_buffers=names == layout_names,
            consume=consume,
            owner=owner,
            into=into,
        )
        self._receivers[transfer_id] = session
        self._landings[key] = session
        return await session.run()

    def kept_alive(self) -> Iterator[KeptAlive]:  # the sessions `keep_alive_sessions` ticks
        yield from self._receivers.values()
        yield from self.senders.sessions.values()

    def end_receiver(self, session: ReceiveSession) -> None:
        self._landings.pop(session.landing_key, None)
        if self._receivers.get(session.transfer_id) is session:
            del self._receivers[session.transfer_id]

    @asynccontextmanager
    async def open_send(self, transfer_id: str, *, peer: str | None = None) -> AsyncIterator[SendSession]:
        """The sending session of `transfer_id`, open until the context exits. Leaving it before a
        successful `send` aborts the transfer (the receiver learns why)."""
        known = self.links(peer) if peer is not None else []
        session = SendSession(self, transfer_id, known[0] if known else None)
        self.senders.opened(session)
        detail = "sender closed the transfer before sending it"
        try:
            yield session
        except BaseException as exc:
            detail = f"sender failed before sending: {describe_exit(exc)}"
            raise
        finally:
            if not session.status.terminal:
                with trio.CancelScope(shield=True):
                    await session.abort(detail)
            self.senders.closed(session)

    def deliver(self, delivery: SenderDelivery) -> None:
        """Hand a sender-bound message on (owners with a `sender_control` channel call this)."""
        self.senders.deliver(delivery)

    # ------------------------------------------------------------------ LinkHandler
    async def on_message(self, link: Link, message: PeerMessage) -> None:
        if link.peer is None and not isinstance(message, Hello | HelloAck | Refusal | Heartbeat):
            link.close(LinkBroken(f"{link.describe()}: {type(message).__name__} before the handshake"))
            return
        match message:
            case Hello():
                await self._on_hello(link, message)
            case HelloAck():
                link.peer = message.endpoint
                link.ready.set()
            case Refusal():
                link.refusal = message.reason
                link.ready.set()
                link.close(LinkClosed(f"handshake refused: {message.reason}"))
            case Heartbeat():
                pass
            case Grant() | RequestMoreCache():
                await self._to_sender(link, message)
            case TotalAnnounce() | ChunkDone():
                self._to_receiver(link, message)
            case Abort() | StatusUpdate():
                if link.role == "sender":
                    await self._to_sender(link, message)
                else:
                    self._to_receiver(link, message)
            case AbortAck():
                self._fences.acknowledged(link, message.transfer_id)
                self._to_receiver(link, message)
            case _:
                assert_never(message)

    async def _on_hello(self, link: Link, hello: Hello) -> None:
        if link.role != "sender" or link.peer is not None:
            link.close(LinkBroken(f"{link.describe()}: unexpected hello from {hello.endpoint!r}"))
            return
        reason = handshake.refusal(hello, self.storage.layout)
        if reason is not None:
            _log.warning("transfer.handshake_refused", endpoint=self.name, peer=hello.endpoint, reason=reason)
            await link.send(Refusal(link_id=hello.link_id, reason=reason))
            link.close(LinkClosed(f"handshake refused: {reason}"))
            return
        link.peer = hello.endpoint
        await link.send(HelloAck(link_id=hello.link_id, endpoint=self.name))
        link.ready.set()

    async def _to_sender(self, link: Link, message: SenderBound) -> None:
        if link.role != "sender":
            link.close(LinkBroken(f"{link.describe()}: {type(message).__name__} sent to the receiving end"))
        elif self._sender_control is not None:
            delivery, patience = SenderDelivery(link, message), self.config.link_timeout / 2
            await hand_to_owner(self._sender_control, delivery, patience, self.name)
        else:
            self.deliver(SenderDelivery(link, message))

    def _to_receiver(
        self, link: Link, message: TotalAnnounce | ChunkDone | Abort | AbortAck | StatusUpdate
    ) -> None:
        if link.role != "receiver":
            link.close(LinkBroken(f"{link.describe()}: {type(message).__name__} sent to the sending end"))
            return
        session = self._receivers.get(message.transfer_id)
        if session is not None and session.link is link:
            session.handle(message)

    def landing(self, link: Link, landing_key: int) -> Landing | None:
        session = self._landings.get(landing_key)
        return session if session is not None and session.link is link else None

    def on_closed(self, link: Link, error: LinkError) -> None:
        self._links.discard(link)
        log = _log.warning if isinstance(error, LinkBroken) else _log.info
        log("transfer.link_closed", endpoint=self.name, link=link.describe(), reason=str(error))
        for session in list(self._receivers.values()):
            if session.link is link:
                session.link_lost(str(error))
        self.senders.link_closed(link)
        self._fences.link_closed(link)

    # ------------------------------------------------------------------ fences and small sends
    def open_fence(self, link: Link, transfer_id: str, quarantine: list[int], owner: str) -> trio.Event:
        """Quarantine `quarantine` until no write for `transfer_id` can land (see
        `transport.protocol.fences`)."""
        return self._fences.open(self.nursery, link, transfer_id, quarantine, owner)

    def send_soon(self, link: Link, message: PeerMessage) -> None:
        """Send a small control message from synchronous code, in a task of the endpoint's nursery; none on a
        closed link (its close failed what it carried; the endpoint closes them all before its nursery)."""
        if not link.is_closed:
            self.nursery.start_soon(self._send_logged, link, message)

    async def _send_logged(self, link: Link, message: PeerMessage) -> None:
        try:
            await link.send(message)
        except LinkError as exc:  # the link's own close already failed everything that depended on it
            _log.info(
                "transfer.send_failed", endpoint=self.name, message=type(message).__name__, error=str(exc)
            )

    async def _shut_down(self) -> None:
        for listener in self._listeners:
            listener.cancel()
        if self._inproc is not None and self.address.startswith("inproc://"):
            self._inproc.unlisten(self.name)
        for link in list(self._links):
            link.close(LinkClosed(f"endpoint {self.name!r} is closing"))
        await self._fences.drain()

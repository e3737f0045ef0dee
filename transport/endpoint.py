"""A transfer endpoint: one pool of one replica, its links, and the transfers running over them.

    async with open_endpoint("prefill-0/emb", storage, pool, inproc=network) as endpoint:
        address = endpoint.listen_inproc()            # or: await endpoint.listen_tcp()
        link = await endpoint.connect("inproc://encode-0/emb")     # receivers connect to senders
        result = await endpoint.receive("req-7/emb", peer=link, consume=step)
        async with endpoint.open_send("req-7/emb") as session:     # on the sending endpoint
            result = await session.send(ids, total_tokens=n)

The endpoint's nursery owns every link's reader, fence watchers and small control sends; transfers run
in their callers' tasks (`receive`, `SendSession.send`). Leaving the context closes the links (which
fences every write) and returns quarantined blocks.

Sender-bound control messages (`Grant`, `RequestMoreCache`, `Abort`, `StatusUpdate`) are delivered to
the sending sessions directly, or — when the owner passes `sender_control` — pushed into that channel as
`SenderDelivery` items; the owner (a replica, through its command channel) then calls
`endpoint.deliver(item)`. Grants for a transfer no session has opened yet wait up to `orphan_timeout`.
"""

from __future__ import annotations

import itertools
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Final, assert_never, final

import msgspec
import structlog
import trio

from messages.peer_codec import NO_HEADER
from messages.transfer import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    ChunkDone,
    FailureReason,
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
from transport import tcp
from transport.blocks import BlockPool
from transport.config import TransferConfig
from transport.errors import HandshakeRefused, LinkBroken, LinkClosed, LinkError
from transport.faults import NO_FAULTS, FaultPlan
from transport.inproc import InprocNetwork
from transport.link import Landing, Link
from transport.receiver import Consume, ReceiveResult, ReceiveSession
from transport.scope import describe_exit, open_task_scope
from transport.sender import SendSession
from transport.storage import PoolStorage

FINISHED_MEMORY: Final = 4096
PENDING_MESSAGES: Final = 64
_log = structlog.get_logger("transport.endpoint")


@dataclass(frozen=True, slots=True)
class SenderDelivery:
    """A sender-bound control message and the link it came on, for the owner's command channel."""

    link: Link
    message: SenderBound


@dataclass(slots=True)
class _Pending:
    link: Link
    since: float
    messages: list[SenderBound] = field(default_factory=list)


@dataclass(slots=True)
class _Fence:
    link: Link
    transfer_id: str
    key: str
    signal: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)


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
        nursery.start_soon(endpoint._sweep_orphans)
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
        self.address = ""
        self._inproc = inproc
        self._sender_control = sender_control
        self._nursery: trio.Nursery | None = None
        self._links: set[Link] = set()
        self._receivers: dict[str, ReceiveSession] = {}
        self._landings: dict[int, ReceiveSession] = {}
        self._senders: dict[str, SendSession] = {}
        self._pending: dict[str, _Pending] = {}
        self._finished: OrderedDict[str, Abort | None] = OrderedDict()
        self._fences: dict[tuple[str, str], _Fence] = {}
        self._landing_keys = itertools.count(1)
        self._listener: trio.CancelScope | None = None

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

    async def _accept_tcp(self, listener: socket.socket) -> None:
        with trio.CancelScope() as scope, listener:
            self._listener = scope
            while True:
                sock = await tcp.accept(listener)
                link = tcp.TcpLink(
                    sock,
                    link_id=tcp.new_link_id(),
                    local=self.name,
                    role="sender",
                    handler=self,
                    layout=self.storage.layout,
                    config=self.config,
                    faults=self.faults,
                )
                self._adopt(link)

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
                sock = await tcp.connect(host, int(port))
            link = tcp.TcpLink(
                sock,
                link_id=tcp.new_link_id(),
                local=self.name,
                role="receiver",
                handler=self,
                layout=self.storage.layout,
                config=self.config,
                faults=self.faults,
            )
        else:
            raise ValueError(
                f"unknown transport address {address!r} (expected tcp://host:port or inproc://name)"
            )
        self._adopt(link)
        hello = Hello(
            link_id=link.link_id,
            protocol_version=PROTOCOL_VERSION,
            endpoint=self.name,
            layout=self.storage.layout,
            address=self.address,
        )
        await link.send(hello)
        with trio.move_on_after(self.config.handshake_timeout):
            await link.ready.wait()
        if link.refusal is not None:
            raise HandshakeRefused(link.refusal)
        if not link.ready.is_set():
            link.close(
                LinkBroken(f"no handshake reply from {address} within {self.config.handshake_timeout} s")
            )
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
    ) -> ReceiveResult:
        """Receive transfer `transfer_id` from the sender at the far end of `peer`; see
        `transport.receiver` for the two landing modes. `peer` is a link from `connect` or the sending
        endpoint's name. Raises `TransferFailed` / `TransferTimeout`."""
        if isinstance(peer, str):
            named = [link for link in self.links(peer) if link.role == "receiver"]
            if not named:
                raise ValueError(f"endpoint {self.name!r} has no link to {peer!r}; connect to it first")
            peer = named[0]
        if peer.role != "receiver" or peer not in self._links:
            raise ValueError(f"endpoint {self.name!r}: {peer.describe()} is not one of its receiving links")
        if transfer_id in self._receivers:
            raise ValueError(f"endpoint {self.name!r}: transfer {transfer_id!r} is already being received")
        layout_names = tuple(spec.name for spec in self.storage.layout.buffers)
        names = layout_names if buffers is None else tuple(buffers)
        unknown = [name for name in names if name not in layout_names]
        if unknown or not names:
            raise ValueError(
                f"transfer {transfer_id!r}: unknown buffers {unknown}; the layout has {list(layout_names)}"
            )
        if blocks is not None:
            bad = [block for block in blocks if not 0 <= block < self.pool.num_blocks]
            if bad or not 0 <= landing_offset < max(1, len(blocks)) * self.storage.block_size:
                raise ValueError(
                    f"transfer {transfer_id!r}: landing blocks {bad} outside the pool or landing_offset "
                    f"{landing_offset} outside {len(blocks)} blocks"
                )
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
        )
        self._receivers[transfer_id] = session
        self._landings[key] = session
        return await session.run()

    def end_receiver(self, session: ReceiveSession) -> None:
        self._landings.pop(session.landing_key, None)
        if self._receivers.get(session.transfer_id) is session:
            del self._receivers[session.transfer_id]

    @asynccontextmanager
    async def open_send(self, transfer_id: str, *, peer: str | None = None) -> AsyncIterator[SendSession]:
        """The sending session of `transfer_id`, open until the context exits. Leaving it before a
        successful `send` aborts the transfer (the receiver learns why)."""
        if transfer_id in self._senders:
            raise ValueError(f"endpoint {self.name!r}: transfer {transfer_id!r} is already being sent")
        known = self.links(peer) if peer is not None else []
        session = SendSession(self, transfer_id, known[0] if known else None)
        self._senders[transfer_id] = session
        pending = self._pending.pop(transfer_id, None)
        if pending is not None:
            for message in pending.messages:
                session.handle(pending.link, message)
        detail = "sender closed the transfer before sending it"
        try:
            async with open_task_scope() as nursery:
                nursery.start_soon(session.run_ticker)
                try:
                    yield session
                except BaseException as exc:
                    detail = f"sender failed before sending: {describe_exit(exc)}"
                    raise
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if not session.status.terminal:
                with trio.CancelScope(shield=True):
                    await session.abort(detail)
            del self._senders[transfer_id]
            report = session.report()
            abort = None
            if report.reason is not None:
                abort = Abort(transfer_id=transfer_id, reason=report.reason, detail=report.detail)
            self._remember_finished(transfer_id, abort)

    def deliver(self, delivery: SenderDelivery) -> None:
        """Hand a sender-bound message to its session (owners with a `sender_control` channel call this)."""
        link, message = delivery.link, delivery.message
        session = self._senders.get(message.transfer_id)
        if session is not None:
            session.handle(link, message)
            return
        if message.transfer_id in self._finished:
            failure = self._finished[message.transfer_id]
            if isinstance(message, Abort):
                self.send_soon(link, AbortAck(transfer_id=message.transfer_id))
            elif isinstance(message, Grant) and failure is not None:
                self.send_soon(link, failure)
            return
        if isinstance(message, Abort):
            self._pending.pop(message.transfer_id, None)
            self.send_soon(link, AbortAck(transfer_id=message.transfer_id))
            return
        pending = self._pending.setdefault(message.transfer_id, _Pending(link, trio.current_time()))
        if len(pending.messages) >= PENDING_MESSAGES:
            del self._pending[message.transfer_id]
            detail = f"over {PENDING_MESSAGES} messages for unopened transfer {message.transfer_id!r}"
            link.close(LinkBroken(f"{link.describe()}: {detail}"))
            return
        pending.messages.append(message)

    def _remember_finished(self, transfer_id: str, failure: Abort | None) -> None:
        self._finished[transfer_id] = failure
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    async def _sweep_orphans(self) -> None:
        timeout = self.config.orphan_timeout
        while True:
            await trio.sleep(timeout / 4)
            now = trio.current_time()
            for transfer_id, pending in list(self._pending.items()):
                if now - pending.since >= timeout:
                    del self._pending[transfer_id]
                    detail = f"no sending session for {transfer_id!r} on {self.name!r} within {timeout} s"
                    self.send_soon(
                        pending.link,
                        Abort(transfer_id=transfer_id, reason=FailureReason.NO_SENDER, detail=detail),
                    )

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
                fence = self._fences.get((link.link_id, message.transfer_id))
                if fence is not None:
                    fence.signal.set()
                self._to_receiver(link, message)
            case _:
                assert_never(message)

    async def _on_hello(self, link: Link, hello: Hello) -> None:
        if link.role != "sender" or link.peer is not None:
            link.close(LinkBroken(f"{link.describe()}: unexpected hello from {hello.endpoint!r}"))
            return
        reason = None
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (
                f"protocol_version mismatch: sender {PROTOCOL_VERSION}, receiver {hello.protocol_version}"
            )
        else:
            reason = self.storage.layout.mismatch(hello.layout)
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
            await self._sender_control.send(SenderDelivery(link, message))
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
        for sender in self._senders.values():
            if sender.link is link:
                sender.link_lost(str(error))
        for fence in self._fences.values():
            if fence.link is link:
                fence.signal.set()
        for transfer_id, pending in list(self._pending.items()):
            if pending.link is link:
                del self._pending[transfer_id]

    # ------------------------------------------------------------------ fences and small sends
    def open_fence(self, link: Link, transfer_id: str, quarantine: list[int], owner: str) -> trio.Event:
        """Hold `quarantine` (owned by `owner`) until no write for `transfer_id` can land; returns an
        event set when that is so and the blocks are back in the pool."""
        fence = _Fence(link, transfer_id, f"{transfer_id}@{link.link_id}")
        if quarantine:
            self.pool.quarantine(quarantine, owner, fence.key)
        self._fences[(link.link_id, transfer_id)] = fence
        if link.is_closed:
            fence.signal.set()
        self.nursery.start_soon(self._watch_fence, fence)
        return fence.done

    async def _watch_fence(self, fence: _Fence) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.config.fence_timeout):
                await fence.signal.wait()
            if not fence.signal.is_set():
                fence.link.close(
                    LinkBroken(f"no AbortAck for {fence.transfer_id!r} within {self.config.fence_timeout} s")
                )
            if fence.link.is_closed:
                await fence.link.quiesce()
            self.pool.release_quarantine(fence.key)
            del self._fences[(fence.link.link_id, fence.transfer_id)]
            fence.done.set()

    def send_soon(self, link: Link, message: PeerMessage) -> None:
        """Send a small control message from synchronous code, in a task of the endpoint's nursery."""
        self.nursery.start_soon(self._send_logged, link, message)

    async def _send_logged(self, link: Link, message: PeerMessage) -> None:
        try:
            await link.send(message)
        except LinkError as exc:
            # The link's own close already failed everything that depended on it.
            _log.info(
                "transfer.send_failed", endpoint=self.name, message=type(message).__name__, error=str(exc)
            )

    async def _shut_down(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        if self._inproc is not None and self.address.startswith("inproc://"):
            self._inproc.unlisten(self.name)
        for link in list(self._links):
            link.close(LinkClosed(f"endpoint {self.name!r} is closing"))
        with trio.move_on_after(self.config.fence_timeout + 1):
            for fence in list(self._fences.values()):
                await fence.done.wait()

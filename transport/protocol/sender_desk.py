"""Where sender-bound control messages go on a sending endpoint (architecture §3, §5.4).

A message for an open sending session goes to it. A grant for a transfer no session has opened yet (the
encoder is still busy) waits, up to `orphan_timeout`, for `open_send` to claim it; then the receiver is
told `no_sender`. Messages for a recently finished transfer are late or duplicate: ignored, except that
an `Abort` is acknowledged (nothing is in flight for a finished transfer) and a grant for a transfer that
failed here is answered with that failure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, final

import trio

from messages.transfer import Abort, AbortAck, FailureReason, Grant, PeerMessage, SenderBound
from transport.errors import LinkBroken
from transport.protocol.link import Link
from transport.protocol.sender import SendSession

FINISHED_MEMORY: Final = 4096
PENDING_MESSAGES: Final = 64


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


@final
class SenderDesk:
    def __init__(
        self, endpoint: str, orphan_timeout: float, send_soon: Callable[[Link, PeerMessage], None]
    ) -> None:
        self._endpoint = endpoint
        self._orphan_timeout = orphan_timeout
        self._send_soon = send_soon
        self.sessions: dict[str, SendSession] = {}
        self._pending: dict[str, _Pending] = {}
        self._finished: OrderedDict[str, Abort | None] = OrderedDict()

    def opened(self, session: SendSession) -> None:
        """Register a new session and replay what arrived for it before it opened."""
        if session.transfer_id in self.sessions:
            raise ValueError(
                f"endpoint {self._endpoint!r}: transfer {session.transfer_id!r} is already being sent"
            )
        self.sessions[session.transfer_id] = session
        pending = self._pending.pop(session.transfer_id, None)
        if pending is not None:
            for message in pending.messages:
                session.handle(pending.link, message)

    def closed(self, session: SendSession) -> None:
        del self.sessions[session.transfer_id]
        report = session.report()
        failure = None
        if report.reason is not None:
            failure = Abort(transfer_id=session.transfer_id, reason=report.reason, detail=report.detail)
        self._finished[session.transfer_id] = failure
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def deliver(self, delivery: SenderDelivery) -> None:
        link, message = delivery.link, delivery.message
        transfer_id = message.transfer_id
        session = self.sessions.get(transfer_id)
        if session is not None:
            session.handle(link, message)
        elif transfer_id in self._finished:
            failure = self._finished[transfer_id]
            if isinstance(message, Abort):
                self._send_soon(link, AbortAck(transfer_id=transfer_id))
            elif isinstance(message, Grant) and failure is not None:
                self._send_soon(link, failure)
        elif isinstance(message, Abort):
            self._pending.pop(transfer_id, None)
            self._send_soon(link, AbortAck(transfer_id=transfer_id))
        else:
            pending = self._pending.setdefault(transfer_id, _Pending(link, trio.current_time()))
            if len(pending.messages) < PENDING_MESSAGES:
                pending.messages.append(message)
                return
            del self._pending[transfer_id]
            link.close(
                LinkBroken(
                    f"{link.describe()}: over {PENDING_MESSAGES} messages for unopened {transfer_id!r}"
                )
            )

    def link_closed(self, link: Link) -> None:
        for session in self.sessions.values():
            if session.link is link:
                session.link_lost(str(link.error))
        for transfer_id, pending in list(self._pending.items()):
            if pending.link is link:
                del self._pending[transfer_id]

    async def sweep_orphans(self) -> None:
        timeout = self._orphan_timeout
        while True:
            await trio.sleep(timeout / 4)
            now = trio.current_time()
            for transfer_id, pending in list(self._pending.items()):
                if now - pending.since >= timeout:
                    del self._pending[transfer_id]
                    detail = (
                        f"no sending session for {transfer_id!r} on {self._endpoint!r} within {timeout} s"
                    )
                    abort = Abort(transfer_id=transfer_id, reason=FailureReason.NO_SENDER, detail=detail)
                    self._send_soon(pending.link, abort)


async def hand_to_owner(
    channel: trio.MemorySendChannel[SenderDelivery], delivery: SenderDelivery, patience: float, endpoint: str
) -> None:
    """Put `delivery` into the owner's command `channel` — at once when it has room (no Trio turn: one
    fewer task switch per round). A full channel stalls the link's reader, which then reads no heartbeat:
    past `patience` the link is closed, naming the owner, before its liveness check blames the peer."""
    try:
        channel.send_nowait(delivery)
        return
    except trio.WouldBlock:
        pass
    with trio.move_on_after(patience):
        await channel.send(delivery)
        return
    message = delivery.message
    delivery.link.close(
        LinkBroken(
            f"{delivery.link.describe()}: the owner of endpoint {endpoint!r} read no sender-bound message "
            f"for {patience} s (its sender_control channel is full); {type(message).__name__} for "
            f"{message.transfer_id!r} undelivered"
        )
    )

"""A connection's bounded outbound queue, and the `ReplySink` through which a handler replies."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Final, Literal, final

import msgspec
import trio

from engine.control.errors import ClientDisconnected, ClientTooSlow, ReplyAfterFinal
from messages.control import ControlRequest
from messages.control_replies import ControlReply, TokenReply

# One write carries at most this many bytes of queued replies (more only if one reply is larger).
_WRITE_CHUNK_BYTES: Final = 1 << 20


@final
class ConnectionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Who a request came from: `connection` is the server's id for the connection (``c1``, ``c2``…)."""

    connection: str
    peer: str


@final
class OutboxFull(Exception):
    """A streamed reply found the queue at its bound."""


@final
class OutboxClosed(Exception):
    """The connection no longer sends replies."""


@final
class Outbox:
    """Encoded reply lines waiting for the connection's writer.

    Bound: a streamed (``token``) reply is refused with `OutboxFull` once `max_replies` lines wait.
    Final replies (``result``, ``error``) are always accepted — there is at most one per request, and
    the reader admits no new request while the queue is at its bound — so a slow client never loses the
    final reply of a request that finished. After `close` every put raises `OutboxClosed`; after
    `finish` the writer drains what is queued and stops.
    """

    def __init__(self, max_replies: int) -> None:
        self.max_replies = max_replies
        self._lines: deque[bytes] = deque()
        self._encoder = msgspec.json.Encoder()
        self._changed = trio.Event()
        self._closed = False
        self._finishing = False

    @property
    def queued(self) -> int:
        return len(self._lines)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, reply: ControlReply, *, final: bool) -> None:
        if self._closed or self._finishing:
            raise OutboxClosed("the connection is closed")
        if not final and len(self._lines) >= self.max_replies:
            raise OutboxFull(f"{len(self._lines)} replies are waiting for the client to read them")
        self._lines.append(self._encoder.encode(reply) + b"\n")
        self.notify()

    def close(self) -> None:
        """Drop everything queued; no more replies (the client is gone)."""
        self._closed = True
        self._lines.clear()
        self.notify()

    def finish(self) -> None:
        """No more replies will come: the writer sends what is queued, then stops."""
        self._finishing = True
        self.notify()

    @property
    def accepting(self) -> bool:
        """Replies can still be queued (neither closed nor finishing)."""
        return not (self._closed or self._finishing)

    def has_space(self) -> bool:
        return len(self._lines) < self.max_replies

    async def wait_changed(self) -> None:
        """Until the next put, take, close or finish."""
        await self._changed.wait()

    async def next_chunk(self) -> bytes | None:
        """Queued lines joined for one write, waiting for some; None when finished and drained, or closed."""
        while not self._lines:
            if self._closed or self._finishing:
                return None
            await self._changed.wait()
        if self._closed:
            return None
        parts = [self._lines.popleft()]
        size = len(parts[0])
        while self._lines and size + len(self._lines[0]) <= _WRITE_CHUNK_BYTES:
            size += len(self._lines[0])
            parts.append(self._lines.popleft())
        self.notify()
        return b"".join(parts)

    def notify(self) -> None:
        """Wake whoever waits in `wait_changed` or `next_chunk`."""
        self._changed.set()
        self._changed = trio.Event()


@final
class ReplySink:
    """Where a handler sends the replies of one request. `send` never blocks.

    Exactly one final reply (``result`` or ``error``) ends the request; ``token`` replies may precede
    it. `send` raises `ClientTooSlow` when the client stopped reading (every in-flight request of the
    connection is then being cancelled, this one included), `ClientDisconnected` when the connection is
    gone, `ReplyAfterFinal` after the final reply, and ValueError for a reply whose `id` is not the
    request's.
    """

    def __init__(
        self, request: ControlRequest, outbox: Outbox, info: ConnectionInfo, on_too_slow: Callable[[], None]
    ) -> None:
        self.request = request
        self.connection = info
        self._outbox = outbox
        self._on_too_slow = on_too_slow
        self._finished = False
        # Why the connection is cancelling this request, once it is: the client stopped reading, the
        # client is gone, or the server is closing.
        self.cancelled_because: Literal["client_too_slow", "client_disconnected", "shutdown"] | None = None
        # The request id a generate is served under, once the handler knows it (the node assigns one
        # when the client gave none): an error the connection sends for it names that id.
        self.request_id: str | None = None

    @property
    def finished(self) -> bool:
        """The final reply was sent."""
        return self._finished

    def send(self, reply: ControlReply) -> None:
        if self._finished:
            raise ReplyAfterFinal(
                f"request {self.request.id!r} ({self.request.__struct_config__.tag}) already sent its final "
                f"reply; refusing {type(reply).__name__}"
            )
        if reply.id != self.request.id:
            raise ValueError(f"reply id {reply.id!r} is not the request's id {self.request.id!r}")
        final = not isinstance(reply, TokenReply)
        try:
            self._outbox.put(reply, final=final)
        except OutboxClosed:
            raise ClientDisconnected(
                f"request {self.request.id!r}: the client connection is closed"
            ) from None
        except OutboxFull as exc:
            self._on_too_slow()
            raise ClientTooSlow(
                f"request {self.request.id!r}: {exc}; cancelling the client's requests"
            ) from None
        if final:
            self._finished = True

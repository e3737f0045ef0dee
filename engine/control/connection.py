"""One client connection of the control server (architecture §7).

Three kinds of task share the connection's nursery: the reader (this task: lines in, one request task
per request), the writer (replies out, from the `Outbox`), and the request tasks, each in its own
cancel scope so that cancelling in-flight requests does not stop the connection.

Lifecycle:
- with a token (`--control-token-file`), the first line must be `{"token": "..."}` (at most
  `TOKEN_LINE_BYTES`, within `TOKEN_SECONDS`); anything else gets an `unauthorized` error (id null) and
  the connection closes, before any request is read;
- a bad line gets a `bad_request` error and the connection goes on;
- a line over the size limit gets a `bad_request` error (id null); nothing more is read, the requests
  already in flight finish (the client is still reading), then the connection closes;
- end of stream, a reset, or a write that makes no progress within the write timeout mean the client
  is gone: its in-flight requests are cancelled and the connection closes;
- a streamed reply that finds the outbound queue full means the client stopped reading: its in-flight
  requests are cancelled, each ends with a `cancelled` error, and the connection goes on (if the client
  never reads again, the write timeout closes it).
Closing for any other reason (`close`: the server closing) cancels the in-flight requests, waits for their
(shielded) cleanup, sends what is still queued (each write within the write timeout), and closes the
stream. Cancelling `run` instead drops what is queued.
"""

from __future__ import annotations

import hmac
import traceback
from collections.abc import Callable
from typing import Final, Literal, final

import msgspec
import trio

from engine.config import ControlConfig
from engine.control.errors import ClientGone, RequestFailed
from engine.control.handler import ControlHandler
from engine.control.lines import LineReader, LineTooLong
from engine.control.outbox import ConnectionInfo, Outbox, ReplySink
from engine.control.parse import BadLine, parse_request
from engine.logging import EventLog
from messages.control import ControlRequest, ErrorCode, GenerateRequest
from messages.control_replies import ErrorReply
from messages.log.events import (
    ClientCloseReason,
    ClientDisconnected,
    ControlBadLine,
    ControlHandlerError,
    SlowClient,
)

_CLOSE_MESSAGES: Final[dict[ClientCloseReason, str]] = {
    "eof": "the client closed the connection",
    "broken": "the client connection broke",
    "line_too_long": "the client sent a line over the size limit",
    "write_timeout": "the client did not read its replies within the write timeout",
    "server_closing": "the server is closing",
    "unauthorized": "the client did not send the control token",
}
TOKEN_LINE_BYTES: Final = 4096
TOKEN_SECONDS: Final = 10.0


class _TokenLine(msgspec.Struct, forbid_unknown_fields=True):
    token: str


@final
class _InFlight:
    __slots__ = ("cancel_message", "scope", "sink")

    def __init__(self, sink: ReplySink) -> None:
        self.sink = sink
        self.scope = trio.CancelScope()
        self.cancel_message: str | None = None


@final
class ControlConnection:
    """Serves one client until it leaves (see the module docstring); `run` never raises for client faults."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        handler: ControlHandler,
        limits: ControlConfig,
        log: EventLog,
        info: ConnectionInfo,
        on_request_end: Callable[[], None] = lambda: None,
        token: bytes | None = None,
    ) -> None:
        self.info = info
        self._token = token
        self._on_request_end = on_request_end
        self._stream = stream
        self._handler = handler
        self._limits = limits
        self._log = log
        self._outbox = Outbox(limits.max_outbound_replies)
        self._in_flight: dict[str, _InFlight] = {}
        self._read_scope = trio.CancelScope()
        self._close_reason: ClientCloseReason | None = None
        self._cancelled_requests = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def run(self) -> None:
        """Serve until the client leaves. Cancellation (the server closing) cancels every request task."""
        reason: ClientCloseReason = "server_closing"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop)
                reason = await self._read_loop(nursery)
                self._begin_close(reason)
        finally:
            self._outbox.close()
            with trio.CancelScope(shield=True):
                await self._stream.aclose()
            self._log.emit(
                ClientDisconnected(
                    connection=self.info.connection,
                    peer=self.info.peer,
                    reason=self._close_reason or reason,
                    cancelled_requests=self._cancelled_requests,
                )
            )

    # ------------------------------------------------------------------ reading
    async def _read_loop(self, nursery: trio.Nursery) -> ClientCloseReason:
        reader = LineReader(self._stream, self._limits.max_line_bytes)
        with self._read_scope:
            if self._token is not None and not await self._authenticated(reader, self._token):
                return "unauthorized"
            while True:
                # Backpressure: a client that does not read its replies gets no more requests served.
                while not (self._outbox.has_space() and len(self._in_flight) < self._outbox.max_replies):
                    await self._outbox.wait_changed()
                try:
                    line = await reader.next_line()
                except LineTooLong as exc:
                    self._reply_bad_line(
                        BadLine(
                            id=None, message=f"{exc}; the limit is --max-line-bytes; closing the connection"
                        )
                    )
                    return "line_too_long"
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return "broken"
                if line is None:
                    return "eof"
                if line.strip():
                    self._accept(line, nursery)
        return self._close_reason or "broken"

    async def _authenticated(self, reader: LineReader, token: bytes) -> bool:
        """Whether the first line carries `token` (see the module docstring); if not, the error is queued."""
        line: bytes | None = None
        with trio.move_on_after(TOKEN_SECONDS):
            try:
                line = await reader.next_line(limit=TOKEN_LINE_BYTES)
            except (LineTooLong, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        try:
            sent = msgspec.json.decode(line or b"", type=_TokenLine).token.encode()
        except (msgspec.DecodeError, UnicodeEncodeError):
            sent = b""
        if hmac.compare_digest(sent, token):
            return True
        if self._outbox.accepting:
            message = 'this control socket needs its token: send {"token": "..."} as the first line (--control-token-file)'
            self._outbox.put(ErrorReply(id=None, code="unauthorized", message=message), final=True)
        return False

    def _accept(self, line: bytes, nursery: trio.Nursery) -> None:
        request = parse_request(line)
        if isinstance(request, BadLine):
            self._reply_bad_line(request)
            return
        if request.id in self._in_flight:
            self._reply_bad_line(
                BadLine(id=request.id, message=f"id {request.id!r} is already in flight on this connection")
            )
            return
        entry = _InFlight(ReplySink(request, self._outbox, self.info, self._too_slow))
        self._in_flight[request.id] = entry
        nursery.start_soon(self._serve, request, entry)

    def _reply_bad_line(self, bad: BadLine) -> None:
        self._log.emit(
            ControlBadLine(
                connection=self.info.connection, peer=self.info.peer, id=bad.id, message=bad.message
            )
        )
        self._send_bad_line_error(bad)

    # ------------------------------------------------------------------ requests
    async def _serve(self, request: ControlRequest, entry: _InFlight) -> None:
        sink = entry.sink
        op = str(request.__struct_config__.tag)
        try:
            with entry.scope:
                try:
                    await self._handler.handle(request, sink)
                except RequestFailed as exc:
                    self._finish(sink, exc.code, exc.message, exc.request_id)
                except ClientGone:
                    # The connection is already cancelling this request; its final reply follows below.
                    entry.scope.cancel()
                except Exception as exc:  # noqa: BLE001 -- a handler bug must not take the server down
                    self._handler_crashed(request, exc)
                    self._finish(sink, "internal", f"internal error in {op}: {exc!r}")
            if entry.cancel_message is not None:
                generate = (
                    (sink.request_id or request.request_id) if isinstance(request, GenerateRequest) else None
                )
                self._finish(sink, "cancelled", entry.cancel_message, generate)
            else:
                self._finish(sink, "internal", f"the node sent no reply to {op}")
        finally:
            del self._in_flight[request.id]
            if self._close_reason is not None and not self._in_flight:
                self._outbox.finish()
            self._outbox.notify()
            self._on_request_end()

    def _finish(self, sink: ReplySink, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        """End the request with an error reply, unless it has its final reply or its client is gone."""
        if not sink.finished and self._outbox.accepting:
            sink.send(ErrorReply(id=sink.request.id, code=code, message=message, request_id=request_id))

    def _send_bad_line_error(self, bad: BadLine) -> None:
        if self._outbox.accepting:
            self._outbox.put(ErrorReply(id=bad.id, code="bad_request", message=bad.message), final=True)

    def _handler_crashed(self, request: ControlRequest, exc: Exception) -> None:
        self._log.emit(
            ControlHandlerError(
                connection=self.info.connection,
                peer=self.info.peer,
                id=request.id,
                op=str(request.__struct_config__.tag),
                error=repr(exc),
                traceback="".join(traceback.format_exception(exc)),
            )
        )

    def _too_slow(self) -> None:
        queued = self._outbox.queued
        cancelled = self._cancel_all(
            f"cancelled: the client stopped reading its replies ({queued} were waiting; "
            f"the limit is --max-outbound-replies {self._outbox.max_replies})",
            "client_too_slow",
        )
        if cancelled:  # the first reply to find the queue full; the others' requests are cancelled already
            self._log.emit(
                SlowClient(
                    connection=self.info.connection,
                    peer=self.info.peer,
                    queued_replies=queued,
                    cancelled_requests=cancelled,
                )
            )

    def _cancel_all(
        self, message: str, because: Literal["client_too_slow", "client_disconnected", "shutdown"]
    ) -> int:
        cancelled = 0
        for entry in self._in_flight.values():
            if entry.cancel_message is None and not entry.sink.finished:
                entry.cancel_message = message
                entry.sink.cancelled_because = because
                entry.scope.cancel()
                cancelled += 1
        self._cancelled_requests += cancelled
        return cancelled

    # ------------------------------------------------------------------ writing and closing
    async def _write_loop(self) -> None:
        while (chunk := await self._outbox.next_chunk()) is not None:
            try:
                with trio.fail_after(self._limits.client_write_timeout):
                    await self._stream.send_all(chunk)
            except trio.TooSlowError:
                self._fail("write_timeout")
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._fail("broken")
                return

    def close(self) -> None:
        """The server is closing: cancel the requests in flight (each ends with a `cancelled` error), read
        no more, send what is queued — the writer stops when it is sent — then `run` returns."""
        self._begin_close("server_closing")

    def _fail(self, reason: ClientCloseReason) -> None:
        """The client cannot be written to: drop queued replies and close."""
        self._outbox.close()
        self._begin_close(reason)

    def _begin_close(self, reason: ClientCloseReason) -> None:
        if self._close_reason is not None:
            return
        self._close_reason = reason
        if reason != "line_too_long":
            self._cancel_all(
                f"cancelled: {_CLOSE_MESSAGES[reason]}",
                "shutdown" if reason == "server_closing" else "client_disconnected",
            )
        self._read_scope.cancel()
        if not self._in_flight:
            self._outbox.finish()

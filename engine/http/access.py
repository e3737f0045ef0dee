"""The access line: one `http_access` event per HTTP request, as vLLM's uvicorn prints one.

`AccessLog` is ASGI middleware around the node's app (`engine.http.server.serve_http` puts it there
unless `--disable-log-requests`). It sees the method, path and client address, the status the app sent
(499 when the client left before a response started) and the time from arrival to the last byte; a
route that generated tells it which request through `note_generation`, and the line carries that
request's id and token counts. The event is `info`, and the node's console shows it at any level
(`engine.logging.CONSOLE_ALWAYS`); the log file keeps it beside the request's own events.

Cancellation: the line is emitted in `finally`, synchronously, so a request cancelled by shutdown or a
disconnect still gets its line. Nothing here awaits except the wrapped app and its `send`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, final

from messages.log.events import HttpAccess
from replicas.ports import EventSink
from replicas.request import ServingRequest

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_KEY = "zigzag.access"


@final
class _Record:
    """What a route tells the access line (the request it generated, if any)."""

    __slots__ = ("serving",)

    def __init__(self) -> None:
        self.serving: ServingRequest | None = None


def note_generation(scope: Scope, serving: ServingRequest) -> None:
    """Tell the access line of the request in `scope` (if one is kept) that it generated `serving`."""
    record = scope.get("state", {}).get(_KEY)
    if isinstance(record, _Record):
        record.serving = serving


@final
class AccessLog:
    """ASGI middleware emitting one `HttpAccess` to `log` per HTTP request (see the module docstring)."""

    def __init__(self, app: ASGIApp, log: EventSink) -> None:
        self.app = app
        self._log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        record = _Record()
        scope.setdefault("state", {})[_KEY] = record
        status = 499

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client")
            serving = record.serving
            self._log.emit(
                HttpAccess(
                    method=str(scope.get("method", "")),
                    path=str(scope.get("path", "")),
                    status=status,
                    seconds=round(time.monotonic() - started, 6),
                    peer=f"{client[0]}:{client[1]}" if client else None,
                    request_id=serving.request_id if serving is not None else None,
                    prompt_tokens=len(serving.prompt_ids) if serving is not None else None,
                    completion_tokens=len(serving.generated) if serving is not None else None,
                )
            )

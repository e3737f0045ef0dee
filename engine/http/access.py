"""The access line: one `http_access` event per HTTP request, as vLLM's uvicorn prints one.

`AccessLog` is ASGI middleware around the node's app (`engine.http.server.serve_http` puts it there
unless `--disable-log-requests`). It sees the method, path and client address, the status the app sent
(499 when the client left before a response started) and the time from arrival to the last byte; a
route that generated tells it which requests through `note_generation` (one per choice), and the line
carries the first one's id, the prompt tokens of the distinct prompts and every choice's generated
tokens (what `usage` counts). The event is `info`, and the node's console shows it at any level
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

    __slots__ = ("servings",)

    def __init__(self) -> None:
        self.servings: list[ServingRequest] = []

    def counts(self) -> tuple[str | None, int | None, int | None]:
        """(the first request's id, the distinct prompts' tokens, every request's generated tokens)."""
        if not self.servings:
            return None, None, None
        prompts = {tuple(serving.prompt_ids) for serving in self.servings}
        generated = sum(len(serving.generated) for serving in self.servings)
        return self.servings[0].request_id, sum(len(prompt) for prompt in prompts), generated


def note_generation(scope: Scope, serving: ServingRequest) -> None:
    """Tell the access line of the request in `scope` (if one is kept) that it generated `serving` (one
    call per choice)."""
    record = scope.get("state", {}).get(_KEY)
    if isinstance(record, _Record):
        record.servings.append(serving)


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
            request_id, prompt_tokens, completion_tokens = record.counts()
            self._log.emit(
                HttpAccess(
                    method=str(scope.get("method", "")),
                    path=str(scope.get("path", "")),
                    status=status,
                    seconds=round(time.monotonic() - started, 6),
                    peer=f"{client[0]}:{client[1]}" if client else None,
                    request_id=request_id,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                )
            )

"""A streamed HTTP response that ends the connection when the client asked it to (`Connection: close`).

Starlette's `StreamingResponse`, under a server speaking ASGI before 2.4 (hypercorn: 2.1), listens for
`http.disconnect` beside the body and cancels the body's task when it comes. Hypercorn handles the last
body message inside the app's `send`: it ends the response and, when the client sent `Connection:
close`, closes the socket — and delivers `http.disconnect` on the way, which cancelled that very `send`
between its two steps (EOF sent, socket not yet closed): the connection stayed open after the last
chunk, and a client reading to the end waited until its own timeout. Here the last message is sent
shielded, so the server's close runs to its end; a client that goes away mid-stream still cancels the
body at once, as before.

`beside`, when given, is a task run beside the body (what produces its chunks): it starts before the
first chunk and is cancelled once the body ended, or with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, final

import trio
from starlette.responses import StreamingResponse
from starlette.types import Send


@final
class ClosingStreamingResponse(StreamingResponse):
    """`StreamingResponse` whose last message is sent shielded from the disconnect it triggers."""

    def __init__(
        self, *args: Any, beside: Callable[[], Awaitable[None]] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.beside = beside

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with trio.open_nursery() as nursery:
            if self.beside is not None:
                nursery.start_soon(self.beside)
            async for chunk in self.body_iterator:
                body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": body, "more_body": True})
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):  # the server closes the connection within this send
            await send({"type": "http.response.body", "body": b"", "more_body": False})

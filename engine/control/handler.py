"""The seam between the control server and the node: a `ControlHandler` serves one request at a time."""

from __future__ import annotations

from typing import Protocol

from engine.control.outbox import ReplySink
from messages.control import ControlRequest


class ControlHandler(Protocol):
    """What the node implements. The server calls `handle` once per request, in the request's own task.

    Contract:
    - Reply through `replies.send` (non-blocking): any ``token`` replies, then exactly one final
      ``result`` or ``error``. Instead of sending an ``error`` the handler may raise
      `engine.control.errors.RequestFailed(code, message)`. Returning without a final reply is a bug
      reported to the client as ``internal``; so is any other exception (the server stays up).
    - Cancellation: the task is cancelled when the client disconnects, stops reading (its outbound
      queue fills), sends a line over the size limit, or the server closes. The handler frees what the
      request holds in shielded cleanup (``with trio.CancelScope(shield=True):``). A `ReplySink.send`
      that raises `ClientGone` means the same cancellation is under way: let it propagate.
    - Requests of one connection run concurrently; the handler must not assume an order between them.
    """

    async def handle(self, request: ControlRequest, replies: ReplySink) -> None: ...

"""Exceptions of the control plane: what a handler raises, and what a `ReplySink` raises at a handler."""

from __future__ import annotations

from typing import final

from messages.control import ErrorCode


@final
class RequestFailed(Exception):
    """Raised by a handler to end its request with an ``error`` reply of `code` (architecture §7's closed set).

    Raise it outside the handler's own nurseries (or unwrap it): an `ExceptionGroup` that reaches the
    connection is reported as `internal`. `request_id` names the generate it ends (the reply's
    ``request_id``), when there is one.
    """

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message
        self.request_id = request_id


class ClientGone(Exception):
    """The client can no longer receive this request's replies; the request is being cancelled."""


@final
class ClientDisconnected(ClientGone):
    """The connection closed (EOF, reset, write timeout, oversized line, or the server is closing)."""


@final
class ClientTooSlow(ClientGone):
    """The client's outbound queue is full (it stopped reading); its in-flight requests are cancelled."""


@final
class ReplyAfterFinal(Exception):
    """A handler sent a reply after its request's final reply (a bug in the handler)."""

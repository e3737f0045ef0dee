"""Errors of the HTTP API in the shape vLLM uses: `{"error": {"message", "type", "param", "code"}}`.

The node's error codes (architecture §7) map to HTTP statuses: a request the node refuses is a 4xx naming
what to change, a node that cannot serve now is a 503, a failure inside the node a 500. A bad body is
always a 400 naming the field (msgspec's validation path, `$.messages[0].role` → `messages[0].role`).
"""

from __future__ import annotations

import re
from typing import Final

import msgspec
from starlette.responses import Response

from engine.control.errors import RequestFailed
from messages.control import ErrorCode
from messages.openai import ErrorBody, ErrorDetail

STATUS: Final[dict[ErrorCode, int]] = {
    "bad_request": 400,
    "not_found": 404,
    "invalid_transition": 409,
    "not_supported": 400,
    "overloaded": 503,
    "transfer_failed": 500,
    "transfer_timeout": 504,
    "replica_failed": 500,
    "cancelled": 499,
    "shutting_down": 503,
    "stale_lease": 409,
    "unauthorized": 401,
    "internal": 500,
}
TYPES: Final[dict[int, str]] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "BadRequestError",
    499: "CancelledError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def error_body(status: int, message: str, param: str | None) -> bytes:
    detail = ErrorDetail(message=message, type=TYPES.get(status, "Error"), param=param, code=status)
    return msgspec.json.encode(ErrorBody(error=detail))


def error_response(status: int, message: str, param: str | None) -> Response:
    return Response(error_body(status, message, param), status_code=status, media_type="application/json")


def validation_response(exc: msgspec.ValidationError) -> Response:
    """A body msgspec refused: 400, `param` the field's path without the leading `$.`."""
    text = str(exc)
    match = _PATH.search(text)
    param = match.group("path") or None if match else None
    return error_response(400, text, param)


def failed_response(exc: RequestFailed) -> Response:
    return error_response(STATUS[exc.code], exc.message, None)


def sse_error(exc: RequestFailed) -> bytes:
    """An error after a stream began: one `data:` event with the error body (then `[DONE]` follows)."""
    return b"data: " + error_body(STATUS[exc.code], exc.message, None) + b"\n\n"

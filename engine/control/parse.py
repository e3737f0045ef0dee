"""Turning one request line into a `ControlRequest`, or into a `bad_request` message a person can act on."""

from __future__ import annotations

import re
from typing import Any, Final, final, get_args

import msgspec

from messages.control import (
    MAX_ID_CHARS,
    OPS,
    ControlRequest,
    ReplicaRole,
    ReplicaStateName,
    request_decoder,
)

_DECODER: Final = request_decoder()
TOO_DEEP: Final = (
    "the line nests JSON arrays or objects too deeply to decode (no request needs more than a few levels)"
)
_AT_PATH = re.compile(r" - at `(?P<path>[^`]*)`$")
# What a person needs to know to fix a bad value at these paths.
_CHOICES: Final[dict[str, str]] = {
    "$.to": "valid states: " + ", ".join(get_args(ReplicaStateName)),
    "$.role": "valid roles: " + ", ".join(get_args(ReplicaRole)),
}


@final
class BadLine(msgspec.Struct, frozen=True, kw_only=True):
    """A line that is not a valid request: `id` is the client's id when it could be read."""

    id: str | None
    message: str


class _IdProbe(msgspec.Struct):
    id: Any = None
    op: Any = None


def parse_request(line: bytes) -> ControlRequest | BadLine:
    """Decode `line` (one JSON object, UTF-8) into a request, or describe what is wrong with it.

    The line's UTF-8 is checked here, before msgspec sees it, so the message (the first bad byte and its
    offset) and the id it answers with do not depend on how a msgspec release words its own error.
    """
    bad_utf8 = _first_bad_utf8(line)
    if bad_utf8 is not None:
        return BadLine(id=_probe_id_despite(line, bad_utf8), message=_utf8_message(line, bad_utf8))
    try:
        return _DECODER.decode(line)
    except msgspec.ValidationError as exc:
        return BadLine(id=_probe_id(line), message=_validation_message(str(exc), line))
    except UnicodeDecodeError:  # Python accepted the bytes; msgspec refused a string within them
        return BadLine(id=_probe_id(line), message="the line is not valid UTF-8")
    except msgspec.DecodeError as exc:
        return BadLine(id=None, message=f"the line is not valid JSON: {exc}")
    except RecursionError:  # msgspec's own depth guard: a line of `[[[[...` must not take the node down
        return BadLine(id=None, message=TOO_DEEP)


def _probe_id(line: bytes) -> str | None:
    probe = _probe(line)
    if probe is not None and isinstance(probe.id, str) and 1 <= len(probe.id) <= MAX_ID_CHARS:
        return probe.id
    return None


def _probe(line: bytes) -> _IdProbe | None:
    try:
        return msgspec.json.decode(line, type=_IdProbe)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # no id to answer with: the caller's message stands on its own


def _validation_message(text: str, line: bytes) -> str:
    if text.startswith("Expected `object`, got") and _AT_PATH.search(text) is None:  # the line itself
        kind = text.removeprefix("Expected `object`, got ").strip("`")
        return f'a request must be a JSON object with "op" and "id"; got a JSON {kind}'
    if text == "Object missing required field `op`":
        return 'the request has no "op"; known ops: ' + ", ".join(OPS)
    match = _AT_PATH.search(text)
    path = match.group("path") if match else "$"
    if path == "$.op":
        probe = _probe(line)
        op = probe.op if probe is not None else None
        return f"unknown op {op!r}; known ops: " + ", ".join(OPS)
    message = f"invalid request: {text}"
    if path in _CHOICES and text.startswith("Invalid enum value"):
        message += f"; {_CHOICES[path]}"
    return message


def _first_bad_utf8(line: bytes) -> int | None:
    """The offset of the first byte that is not part of valid UTF-8 (Python's strict codec), or None."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return None


def _probe_id_despite(line: bytes, bad: int) -> str | None:
    """The id of a line with invalid UTF-8 from `bad` on, when the id itself is intact.

    Every invalid byte becomes `?` (ASCII, valid inside a JSON string) so the rest of the line can be
    read; the id found counts only when its bytes stand in the original line as written — an id that
    held a bad byte is not the client's id, and the answer goes out without one.
    """
    repaired = line[:bad] + line[bad:].decode("utf-8", errors="replace").replace("\ufffd", "?").encode()
    found = _probe_id(repaired)
    if found is None or f'"{found}"'.encode() not in line:
        return None
    return found


def _utf8_message(line: bytes, bad: int) -> str:
    return f"the line is not valid UTF-8: byte 0x{line[bad]:02x} at offset {bad}"

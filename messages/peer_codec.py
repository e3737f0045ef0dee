"""The codec of peer links: msgpack control frames, each prefixed by its length (architecture §3).

On TCP the length prefix is part of the link's fixed frame header (`transport.links.tcp.frames`), which also
sub-frames bulk bytes; this module turns one control message into its msgpack body and back, with a size
limit and an error that says what was wrong.
"""

from __future__ import annotations

from typing import Final, TypeVar, final

import msgspec

from messages.transfer import PeerMessage

MAX_CONTROL_BYTES: Final = 16 * 1024 * 1024

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)


@final
class PeerCodecError(Exception):
    """A control frame that is not a valid peer message."""


def encode_peer(message: PeerMessage) -> bytes:
    body = _encoder.encode(message)
    if len(body) > MAX_CONTROL_BYTES:
        raise PeerCodecError(
            f"{type(message).__name__} encodes to {len(body)} bytes, over the {MAX_CONTROL_BYTES} limit"
        )
    return body


def decode_peer(body: bytes | bytearray | memoryview) -> PeerMessage:
    if len(body) > MAX_CONTROL_BYTES:
        raise PeerCodecError(f"control frame of {len(body)} bytes, over the {MAX_CONTROL_BYTES} limit")
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise PeerCodecError(f"malformed control frame ({len(body)} bytes): {exc}") from exc


def encode_header(value: object) -> msgspec.Raw:
    """An owner's header object as the opaque `msgspec.Raw` that transfer messages carry."""
    return msgspec.Raw(_encoder.encode(value))


def decode_header(header: msgspec.Raw, type_: type[T]) -> T:
    """The owner's header back, typed; raises `PeerCodecError` naming the problem."""
    try:
        return msgspec.msgpack.decode(header, type=type_)
    except msgspec.DecodeError as exc:
        raise PeerCodecError(f"transfer header is not a valid {type_.__name__}: {exc}") from exc


NO_HEADER: Final = encode_header(None)

"""The TCP link's frame header: one fixed 32-byte header before every frame.

    magic u16 | kind u8 | flags u8 | length u32 | landing_key u64 | round u32 | buffer u16 | pad u16 | dst_row u64

- `CONTROL` frames: `length` bytes of msgpack (`messages.peer_codec`); the bulk fields are zero.
- `BULK` frames: `length` bytes of buffer `buffer` (index in the pool layout) for flat rows starting at
  `dst_row` of the receiver's storage, belonging to round `round` of the transfer with `landing_key`.
  The reader `recv_into`s them straight into that memory, or into a scratch buffer when the round is
  gone (aborted) — the link stays in step either way.
Little-endian throughout. A bad magic or kind or an oversized control frame is a malformed frame: the
reader closes the link with that reason.
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple, final

from messages.peer_codec import MAX_CONTROL_BYTES

HEADER: Final = struct.Struct("<HBBIQIHHQ")
HEADER_BYTES: Final = HEADER.size
MAGIC: Final = 0x5A7A
CONTROL: Final = 1
BULK: Final = 2
MAX_BULK_FRAME_BYTES: Final = 8 * 1024 * 1024


@final
class FrameError(Exception):
    """A frame header that no zigzag peer writes."""


class FrameHeader(NamedTuple):
    kind: int
    length: int
    landing_key: int
    round: int
    buffer: int
    dst_row: int


def control_header(length: int) -> bytes:
    return HEADER.pack(MAGIC, CONTROL, 0, length, 0, 0, 0, 0, 0)


def bulk_header(length: int, landing_key: int, round: int, buffer: int, dst_row: int) -> bytes:
    return HEADER.pack(MAGIC, BULK, 0, length, landing_key, round, buffer, 0, dst_row)


def parse_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    magic, kind, _flags, length, landing_key, round, buffer, _pad, dst_row = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic 0x{magic:04x} (expected 0x{MAGIC:04x})")
    if kind == CONTROL:
        if length > MAX_CONTROL_BYTES:
            raise FrameError(f"control frame of {length} bytes, over the {MAX_CONTROL_BYTES} limit")
    elif kind == BULK:
        if length == 0 or length > MAX_BULK_FRAME_BYTES:
            raise FrameError(f"bulk frame of {length} bytes (allowed 1 to {MAX_BULK_FRAME_BYTES})")
    else:
        raise FrameError(f"unknown frame kind {kind}")
    return FrameHeader(kind, length, landing_key, round, buffer, dst_row)

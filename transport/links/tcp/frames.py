"""The TCP link's frames: a fixed 32-byte header, then (bulk only) a segment table, then the payload.

    header   magic u16 | kind u8 | flags u8 | length u32 | landing_key u64 | round u32 | buffer u16
             | pad u16 | segments u64
    segment  dst_row u64 | rows u64                          (bulk frames: `segments` of them)

- `CONTROL` frames: `length` bytes of msgpack (`messages.peer_codec`); the bulk fields are zero.
- `BULK` frames: rows of one buffer (`buffer`, its index in the pool layout) for round `round` of the
  transfer with `landing_key`. Each segment is a run of consecutive flat rows of the receiver's storage;
  the payload is the segments' bytes back to back (`length` = rows × bytes per row). The reader checks
  every segment against the grant and scatter-reads the payload straight into those rows with one
  `recvmsg_into` per kernel read (or into a scratch buffer when the round is gone). Many small blocks
  (KV: 16-token blocks) thus cost one frame, not one frame per block.
Little-endian throughout. A bad magic, kind, segment count or length is a malformed frame: the reader
closes the link with that reason.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final, NamedTuple, final

from messages.peer_codec import MAX_CONTROL_BYTES
from transport.bulk.frame_plan import (
    MAX_FRAME_BYTES,
    MAX_SEGMENTS,
    Buffer,
    Frame,
    packed_only,
    plan_frames,
    unpack_segments,
)
from transport.bulk.staging import HostChunk, pack
from transport.bulk.write import BulkWrite

HEADER: Final = struct.Struct("<HBBIQIHHQ")
HEADER_BYTES: Final = HEADER.size
MAGIC: Final = 0x5A7A
CONTROL: Final = 1
BULK: Final = 2
MAX_BULK_FRAME_BYTES: Final = MAX_FRAME_BYTES  # frames are planned by `transport.bulk.frame_plan`


@final
class FrameError(Exception):
    """A frame that no zigzag peer writes."""


class FrameHeader(NamedTuple):
    kind: int
    length: int
    landing_key: int
    round: int
    buffer: int
    segments: int


def control_header(length: int) -> bytes:
    return HEADER.pack(MAGIC, CONTROL, 0, length, 0, 0, 0, 0, 0)


def parse_header(data: Buffer) -> FrameHeader:
    magic, kind, _flags, length, landing_key, round, buffer, _pad, segments = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic 0x{magic:04x} (expected 0x{MAGIC:04x})")
    if kind == CONTROL:
        if length > MAX_CONTROL_BYTES:
            raise FrameError(f"control frame of {length} bytes, over the {MAX_CONTROL_BYTES} limit")
    elif kind == BULK:
        if length == 0 or length > MAX_BULK_FRAME_BYTES:
            raise FrameError(f"bulk frame of {length} bytes (allowed 1 to {MAX_BULK_FRAME_BYTES})")
        if not 1 <= segments <= MAX_SEGMENTS:
            raise FrameError(f"bulk frame with {segments} segments (allowed 1 to {MAX_SEGMENTS})")
    else:
        raise FrameError(f"unknown frame kind {kind}")
    return FrameHeader(kind, length, landing_key, round, buffer, segments)


def parse_segments(table: Buffer, count: int, row_bytes: int, length: int) -> list[tuple[int, int]]:
    """The (dst_row, rows) segments of a bulk frame, checked to add up to its payload length."""
    segments, rows = unpack_segments(table, count)
    if rows is None or rows * row_bytes != length:
        raise FrameError(
            f"bulk frame segments {segments[:4]}{'…' if count > 4 else ''} do not add up to its "
            f"{length} bytes of {row_bytes}-byte rows"
        )
    return segments


def bulk_frame(bulk: BulkWrite, frame: Frame, corrupt: bool) -> list[Buffer]:
    """Frame `frame` of `bulk` (`transport.bulk.frame_plan.buffer_frames` with `packed_only`) as its parts:
    header, segment table, payload views of the sender's blocks (no copy). `corrupt` flips the first
    payload byte."""
    memory = bulk.source.buffer_bytes(frame.name)
    views: list[Buffer] = [memory[start:end] for start, end in frame.source_bytes()]
    if corrupt:
        flipped = bytearray(views[0])
        flipped[0] ^= 0xFF
        views[0] = flipped
    count = len(views)
    header = HEADER.pack(MAGIC, BULK, 0, frame.length, bulk.landing_key, bulk.round, frame.buffer, 0, count)
    return [header, frame.segment_table(), *views]


def staged_tcp_frames(
    bulk: BulkWrite, buffer: int, name: str, row_bytes: int, chunk: HostChunk, corrupt: bool
) -> Iterator[tuple[list[Buffer], int]]:
    """TCP bulk frames (`transport.links.tcp.frames` layout) of buffer `name` of a pool off the CPU: each
    frame's rows are packed into `chunk` just before it is yielded, so send each frame before taking the
    next. `corrupt` flips the first payload byte."""
    for frame in plan_frames(bulk, buffer, name, row_bytes, packed_only):
        length = pack(bulk.source, name, frame.sources(), chunk)
        if corrupt:
            chunk.view[0] ^= 0xFF
            corrupt = False
        header = HEADER.pack(
            MAGIC, BULK, 0, length, bulk.landing_key, bulk.round, buffer, 0, len(frame.pieces)
        )
        yield [header, frame.segment_table(), chunk.view[:length]], length

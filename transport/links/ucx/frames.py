"""The UCX link's control bodies: each is one UCX message on the link's control tag, and its first byte
says what it is.

    M  a peer message (msgpack, `messages.peer_codec`)
    B  a bulk frame descriptor (below); its bytes follow on the link's bulk tag
    C  connect, receiver → listener: the receiver's link number (u64) and worker address
    A  accept, listener → receiver: the sender's link number (u64), its pid (u64), the address of its
       cross-memory probe (u64, `transport.links.ucx.cma`) and host key (`transport.links.ucx.peer_process`)
    R  reads, receiver → sender, before the handshake: the receiver reads the sender's host pieces itself
       (`transport.links.ucx.reads`), so the sender describes them in read frames and sends no bytes for them
    K  receipt, receiver → sender: the read frames of its oldest unanswered read descriptor (u32 count)
       were read or skipped; the sender's rows are its own again
    G  goodbye: the far end closed the link; UTF-8 reason

Bulk descriptor: one or more frame descriptors back to back, each `B` | flavour u8 (1 direct, 2 packed,
3 read) | buffer u16 | round u32 | landing_key u64 | length u64 | segments u32, then `segments` ×
(dst_row u64, rows u64), little-endian; a *read* frame has the sender's address of the buffer's row 0
(u64) between header and table, and `segments` × src_row (u64) after it. A *direct* frame comes alone,
its bytes following as one bulk message per segment, in order, each straight from the sender's block
memory. Packed frames come in bundles (`transport.bulk.frame_plan.bundle_frames`: one round, at most
`MAX_PACKED_BYTES`), whose bytes follow as one message: each frame's segments back to back, each frame
from a 16-byte aligned offset (`bundle_starts`; the gaps are zeros). UCX matches messages of one tag in
the order they were sent, so the receiver, reading descriptors in order, posts each receive where its
bytes belong. Read frames come in groups of one round (up to `READ_GROUP_BYTES`) with no bulk message:
the receiver reads the rows itself, then answers with a receipt. A body that breaks these rules is a
malformed frame: the reader closes the link.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple, final

import torch

from messages.peer_codec import decode_peer, encode_peer
from messages.transfer import PeerMessage
from transport.bulk.device_bundles import bundles_on_device, is_direct_on_device
from transport.bulk.frame_plan import (
    DEVICE_SIZES,
    HOST_SIZES,
    MAX_BUNDLE_FRAMES,
    MAX_DIRECT_FRAME_BYTES,
    MAX_PACKED_BYTES,
    MAX_SEGMENTS,
    SEGMENT,
    Frame,
    FrameSizes,
    bundle_starts,
    packed_only,
    unpack_segments,
)
from transport.bulk.runs import run_bytes
from transport.memory.storage import PoolStorage

# A host pool's piece of at least this many bytes goes as its own message: a ucxx message costs about
# what a 64 KiB memcpy does (`transport.bulk.frame_plan`).
DIRECT_MIN_BYTES: Final = 64 * 1024
MESSAGE: Final = ord("M")
DESCRIPTOR: Final = ord("B")
CONNECT: Final = ord("C")
ACCEPT: Final = ord("A")
GOODBYE: Final = ord("G")
READS: Final = ord("R")
RECEIPT: Final = ord("K")
AUTH: Final = ord("H")  # a message of the cluster secret's exchange (`transport.links.ucx.admission`)
DIRECT: Final = 1
PACKED: Final = 2
READ: Final = 3
# The most bytes one read descriptor describes: a group the receiver reads before it answers.
READ_GROUP_BYTES: Final = MAX_DIRECT_FRAME_BYTES

_HEADER: Final = struct.Struct("<BBHIQQI")
_NUMBER: Final = struct.Struct("<BQ")
_PROCESS: Final = struct.Struct("<QQ")
_BASE: Final = struct.Struct("<Q")
_RECEIPT: Final = struct.Struct("<BI")
_ADDRESS_END: Final = 1 << 64


@final
class UcxFrameError(Exception):
    """A control body that no zigzag peer sends."""


class Descriptor(NamedTuple):
    packed: bool
    buffer: int
    round: int
    landing_key: int
    length: int
    segments: list[tuple[int, int]]
    source_base: int = 0  # a read frame's: the sender's address of the buffer's row 0
    source_rows: Sequence[int] = ()  # a read frame's: the sender's first row of each segment
    # A read frame's segment table then source rows, as they came (u64 little-endian): its reader's I/O
    # vectors are computed from these bytes (`transport.links.ucx.reads`), not from the tuples above.
    read_table: bytes = b""

    @property
    def read(self) -> bool:
        return bool(self.source_rows)


def message_body(message: PeerMessage) -> bytes:
    return bytes((MESSAGE,)) + encode_peer(message)


def descriptor_body(
    frames: Sequence[Frame], landing_key: int, round: int, read_bases: Sequence[int] | None = None
) -> bytes:
    """The descriptor of a direct frame, of a bundle of packed frames (`bundle_frames`), or — with
    `read_bases`, each frame's address of its buffer's row 0 — of a group of read frames."""
    parts = []
    for index, frame in enumerate(frames):
        flavour = READ if read_bases is not None else PACKED if frame.packed else DIRECT
        parts.append(
            _HEADER.pack(
                DESCRIPTOR, flavour, frame.buffer, round, landing_key, frame.length, len(frame.pieces)
            )
        )
        if read_bases is not None:
            parts.append(_BASE.pack(read_bases[index]))
        parts.append(frame.segment_table())
        if read_bases is not None:
            parts.append(frame.source_row_table())
    return b"".join(parts)


def reads_body() -> bytes:
    return bytes((READS,))


def receipt_body(frames: int) -> bytes:
    return _RECEIPT.pack(RECEIPT, frames)


def parse_receipt(body: bytes | bytearray) -> int:
    """The count of read frames a receipt answers."""
    if len(body) != _RECEIPT.size:
        raise UcxFrameError(f"a receipt body has {_RECEIPT.size} bytes, got {len(body)}")
    return int(_RECEIPT.unpack(body)[1])


def connect_body(number: int, address: bytes) -> bytes:
    return _NUMBER.pack(CONNECT, number) + address


def accept_body(number: int, pid: int, probe: int, host_key: bytes) -> bytes:
    return _NUMBER.pack(ACCEPT, number) + _PROCESS.pack(pid, probe) + host_key


def parse_accept(body: bytes | bytearray) -> tuple[int, int, int, bytes]:
    """The sender's link number, pid, cross-memory probe address and host key from an accept body."""
    number, rest = parse_number(body, ACCEPT)
    if len(rest) < _PROCESS.size:
        raise UcxFrameError(
            f"an accept body needs a pid and a probe address ({_PROCESS.size} bytes) after the link number"
        )
    pid, probe = _PROCESS.unpack_from(rest)
    return number, pid, probe, rest[_PROCESS.size :]


def auth_body(data: bytes) -> bytes:
    return bytes((AUTH,)) + data


def goodbye_body(reason: str) -> bytes:
    return bytes((GOODBYE,)) + reason.encode()


def kind_of(body: bytes | bytearray, expected: tuple[int, ...]) -> int:
    """The body's kind, one of `expected`; `UcxFrameError` otherwise."""
    if body[0] not in expected:
        raise UcxFrameError(f"control body of unknown kind 0x{body[0]:02x}")
    return body[0]


def parse_message(body: bytes | bytearray) -> PeerMessage:
    """Raises `messages.peer_codec.PeerCodecError` for an undecodable message."""
    return decode_peer(memoryview(body)[1:])


def parse_number(body: bytes | bytearray, kind: int) -> tuple[int, bytes]:
    """The link number of a connect or accept body, and what follows it (a connect's worker address)."""
    if len(body) < _NUMBER.size or body[0] != kind:
        raise UcxFrameError(
            f"expected a {chr(kind)!r} body of at least {_NUMBER.size} bytes, got {len(body)}"
        )
    _kind, number = _NUMBER.unpack_from(body)
    return number, bytes(body[_NUMBER.size :])


def parse_goodbye(body: bytes | bytearray) -> str:
    return bytes(body[1:]).decode(errors="replace")


def parse_descriptors(body: bytes | bytearray, row_bytes: Sequence[int]) -> list[Descriptor]:
    """A bulk descriptor's frames, checked: each frame as `_parse_one` checks it; several only when all
    are packed (read), of one round and landing, at most `MAX_BUNDLE_FRAMES` of them within
    `MAX_PACKED_BYTES` (`READ_GROUP_BYTES`)."""
    frames: list[Descriptor] = []
    tables = _Tables()
    at = 0
    while at < len(body) or not frames:
        frame, at = _parse_one(body, at, row_bytes, tables)
        frames.append(frame)
    reads = [frame.read for frame in frames]
    if any(reads) and not all(reads):
        raise UcxFrameError(f"bulk descriptor of {len(frames)} frames, some read and some not")
    if len(frames) > 1:
        if reads[0]:
            kind, total, limit = "read", sum(frame.length for frame in frames), READ_GROUP_BYTES
        else:
            kind, total, limit = (
                "packed",
                bundle_starts([frame.length for frame in frames])[1],
                MAX_PACKED_BYTES,
            )
            if not all(frame.packed for frame in frames):
                raise UcxFrameError(f"bulk descriptor of {len(frames)} frames, not all of them packed")
        if len({(frame.round, frame.landing_key) for frame in frames}) > 1:
            raise UcxFrameError(f"bulk descriptor of {len(frames)} frames of different rounds")
        if len(frames) > MAX_BUNDLE_FRAMES or total > limit:
            raise UcxFrameError(
                f"bulk descriptor of {len(frames)} {kind} frames and {total} bytes, over the limit of "
                f"{MAX_BUNDLE_FRAMES} frames and {limit} bytes"
            )
    return frames


@final
class _Tables:
    """The tables one descriptor's frames carry, each unpacked once, by their bytes: a KV round's frames
    (a layer's `k` and `v`, each a frame) have the same rows on both sides, so every frame after the
    first shares its lists (a read group of 16 frames of 120 segments: parsed in 55 µs instead of 227).
    Parsed lists are never changed, so they can be shared."""

    __slots__ = ("reads", "segments")

    def __init__(self) -> None:
        self.segments: dict[bytes, tuple[list[tuple[int, int]], int | None]] = {}
        # a read frame's segments, their rows, its source rows and the largest of them
        self.reads: dict[bytes, tuple[list[tuple[int, int]], int | None, tuple[int, ...], int]] = {}


def _parse_one(
    body: bytes | bytearray, at: int, row_bytes: Sequence[int], tables: _Tables
) -> tuple[Descriptor, int]:
    """The frame described from byte `at`, and where the next begins: known flavour and buffer, 1 to
    `MAX_SEGMENTS` non-empty segments adding up to `length`, and no more than one frame's bytes."""
    left = len(body) - at
    if left < _HEADER.size:
        raise UcxFrameError(f"bulk descriptor of {left} bytes, shorter than its {_HEADER.size}-byte header")
    kind, flavour, buffer, round, landing_key, length, count = _HEADER.unpack_from(body, at)
    if kind != DESCRIPTOR:
        raise UcxFrameError(f"bulk descriptor with a frame of unknown kind 0x{kind:02x}")
    if flavour not in (DIRECT, PACKED, READ):
        raise UcxFrameError(f"bulk descriptor of unknown flavour {flavour}")
    if buffer >= len(row_bytes):
        raise UcxFrameError(f"bulk descriptor for buffer {buffer}; the layout has {len(row_bytes)} buffers")
    if not 1 <= count <= MAX_SEGMENTS:
        raise UcxFrameError(f"bulk descriptor with {count} segments (allowed 1 to {MAX_SEGMENTS})")
    table = at + _HEADER.size + (_BASE.size if flavour == READ else 0)
    end = table + count * SEGMENT.size + (count * _BASE.size if flavour == READ else 0)
    if len(body) < end:
        raise UcxFrameError(f"bulk descriptor of {left} bytes does not hold its {count} segments")
    width = row_bytes[buffer]
    table_bytes = bytes(body[table:end])
    if flavour == READ:
        read = tables.reads.get(table_bytes)
        if read is None:
            segments, rows = unpack_segments(table_bytes, count)
            sources = struct.unpack_from(f"<{count}Q", table_bytes, count * SEGMENT.size)
            read = tables.reads[table_bytes] = (segments, rows, sources, max(sources))
        segments, rows, sources, last_source = read
    else:
        unpacked = tables.segments.get(table_bytes)
        if unpacked is None:
            unpacked = tables.segments[table_bytes] = unpack_segments(table_bytes, count)
        segments, rows = unpacked
    if rows is None or rows * width != length:
        raise UcxFrameError(
            f"bulk descriptor segments {segments[:4]}{'…' if count > 4 else ''} do not add up to its "
            f"{length} bytes of {width}-byte rows"
        )
    limit = MAX_PACKED_BYTES if flavour == PACKED else MAX_DIRECT_FRAME_BYTES
    if length > max(limit, width):
        kind_name = "packed" if flavour == PACKED else "direct"
        raise UcxFrameError(
            f"bulk descriptor of {length} bytes, over the {limit}-byte limit of a {kind_name} frame"
        )
    if flavour != READ:
        return Descriptor(flavour == PACKED, buffer, round, landing_key, length, segments), end
    (base,) = _BASE.unpack_from(body, at + _HEADER.size)
    if base + (last_source + rows) * width >= _ADDRESS_END:  # a bound on the last row's end: cheap
        raise UcxFrameError(f"read frame of rows beyond the address space (row 0 at 0x{base:x})")
    return Descriptor(False, buffer, round, landing_key, length, segments, base, sources, table_bytes), end


def payload_rows(storage: PoolStorage, name: str, row: int, rows: int) -> memoryview | torch.Tensor:
    """Rows of a buffer as UCX sees them: bytes of CPU storage, a CUDA tensor slice of GPU storage."""
    if storage.device.type == "cpu":
        return run_bytes(storage, name, row, rows)
    # As bytes: torch's CUDA array interface has no bfloat16.
    return storage.flat(name)[row : row + rows].view(-1).view(torch.uint8)


def flipped_copy(payload: memoryview | torch.Tensor) -> bytearray | torch.Tensor:
    """A copy of `payload` with its first byte flipped (fault injection never touches the sender's blocks)."""
    if isinstance(payload, memoryview):
        copy = bytearray(payload)
        copy[0] ^= 0xFF
        return copy
    flipped = payload.clone()
    first = flipped.view(-1).view(torch.uint8)[:1]
    first.bitwise_xor_(0xFF)
    return flipped


def framing(device: torch.device, cuda_capable: bool) -> tuple[Callable[[int], bool], FrameSizes]:
    """How a UCX link frames a pool on `device` (`cuda_capable`: its UCX moves CUDA memory itself):
    which pieces go as their own message, and the sizes of packed frames and bundles. Host pools: pieces
    from `DIRECT_MIN_BYTES`; GPU pools UCX reaches: device bundles (`transport.bulk.device_bundles`), or
    where those are off every piece as its own message; other GPU pools: every piece packed, staged
    through host chunks."""
    if bundles_on_device(device, cuda_capable):
        return is_direct_on_device, DEVICE_SIZES
    if device.type == "cpu":
        return _host_direct, HOST_SIZES
    return (_every_piece if cuda_capable else packed_only), HOST_SIZES


def _every_piece(_piece_bytes: int) -> bool:
    return True


def _host_direct(piece_bytes: int) -> bool:
    return piece_bytes >= DIRECT_MIN_BYTES

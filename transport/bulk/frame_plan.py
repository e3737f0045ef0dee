"""A bulk write cut into frames of one buffer, each of at most `MAX_SEGMENTS` pieces.

A *piece* is a stretch of rows consecutive on both sides: a run (`transport.bulk.runs`), or a slice of one
that would not fit a frame. Frames are what the ucx transport describes in one control message, and what a
pool on a GPU is staged through host memory by (tcp, ucx without CUDA transports).

`direct(piece_bytes)` sorts the pieces: *direct* frames send each piece as its own message, straight
from the sender's block memory into the receiver's; *packed* frames carry their pieces' bytes back to
back in one host chunk (`transport.bulk.staging`). A ucxx message costs about what a 64 KiB memcpy does on
this class of machine, so small pieces travel packed and large ones direct.

A packed frame holds at most `MAX_FRAME_BYTES`, the size of a host chunk; `bundle_frames` lets packed
frames of several buffers share a chunk (and one message), up to `BUNDLE_BYTES`. A direct frame needs no
chunk, so it may hold up to `MAX_DIRECT_FRAME_BYTES`: every frame costs a descriptor message and its
handling at both ends, and 64 MiB of 2 MiB blocks in 8 MiB frames was 12 frames where 6 do (ucx_64MiB +3 %).
Those are the `HOST_SIZES`; a pool on a GPU that UCX reaches packs on the device instead, in frames and
bundles of up to `DEVICE_BUNDLE_BYTES` (`DEVICE_SIZES`, `transport.bulk.device_bundles`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Final, NamedTuple, final

from transport.bulk.write import BulkWrite

# One entry of a frame's segment table on the wire (tcp and ucx): `dst_row u64 | rows u64`, little-endian.
SEGMENT: Final = struct.Struct("<QQ")
MAX_FRAME_BYTES: Final = 8 * 1024 * 1024
MAX_SEGMENTS: Final = 256
MAX_DIRECT_FRAME_BYTES: Final = 64 * 1024 * 1024
# Packed frames in one bundle: bounds a bundle's descriptor (at most 64 × 4 KiB of segment table).
MAX_BUNDLE_FRAMES: Final = 64
# A bundle grows to this many bytes only: the sender packs the next bundle while the receiver copies the
# last one, and 8 MiB bundles left both sides idle longer at each round's start and end (ucx_kv -4 %).
BUNDLE_BYTES: Final = 1024 * 1024
# Where a bundle's frames start in its chunk: a multiple of this, so any dtype can view its rows there
# (staging a GPU pool's rows views the chunk as the buffer's dtype).
BUNDLE_ALIGN: Final = 16
# A packed frame, and a bundle, gathered on a GPU: UCX moves a message between GPU buffers by a CUDA IPC
# rendezvous of about 23 µs however small (raw ucxx on an H100 80GB HBM3: 128 × 2 MiB in 3.0 ms,
# 1 × 256 MiB in 0.35 ms), so fewer, larger messages; 4 in flight per link (`PACKED_WINDOW`) hold 128 MiB
# of the GPU.
DEVICE_BUNDLE_BYTES: Final = 32 * 1024 * 1024
# The largest packed frame, or bundle, a descriptor may announce: what a receiver accepts.
MAX_PACKED_BYTES: Final = max(MAX_FRAME_BYTES, DEVICE_BUNDLE_BYTES)


class FrameSizes(NamedTuple):
    """The most bytes of a packed frame and of a bundle of packed frames, as a sender plans them."""

    packed: int
    bundle: int


HOST_SIZES: Final = FrameSizes(MAX_FRAME_BYTES, BUNDLE_BYTES)
DEVICE_SIZES: Final = FrameSizes(DEVICE_BUNDLE_BYTES, DEVICE_BUNDLE_BYTES)

Buffer = bytes | bytearray | memoryview


def unpack_segments(data: Buffer, count: int, at: int = 0) -> tuple[list[tuple[int, int]], int | None]:
    """The `count` `(dst_row, rows)` segments of a table starting at byte `at` of `data` (one `struct`
    call: a KV frame has 256), and their rows in all — None when a segment is empty."""
    values = struct.unpack_from(f"<{2 * count}Q", data, at)
    rows = values[1::2]
    return list(zip(values[::2], rows, strict=True)), None if 0 in rows else sum(rows)


class Piece(NamedTuple):
    """Rows `[src_row, +rows)` of the sender's buffer go to rows `[dst_row, +rows)` of the receiver's
    (a tuple: a KV round has a piece per block and buffer, hundreds, and a dataclass costs more to make)."""

    src_row: int
    dst_row: int
    rows: int


_SOURCE: Final = itemgetter(0, 2)  # (src_row, rows) of a Piece
_DESTINATION: Final = itemgetter(1, 2)  # (dst_row, rows)


@final
@dataclass(slots=True)
class PieceTables:
    """What a planned frame's pieces derive to, made once: buffers of one row width share a plan
    (`plan_bundles`), so a KV round's eight buffers would otherwise build the same tables eight times."""

    segment_table: bytes | None = None
    source_row_table: bytes | None = None
    sources: list[tuple[int, int]] | None = None
    source_bytes: list[tuple[int, int]] | None = None


@final
@dataclass(slots=True)
class Frame:
    """Pieces of buffer `name` (index `buffer` in the layout); `packed`: one message, bytes back to back.
    `tables` caches what the pieces derive to: ask for it only once the frame is planned."""

    packed: bool
    buffer: int
    name: str
    row_bytes: int
    pieces: list[Piece] = field(default_factory=list)
    rows: int = 0
    tables: PieceTables = field(default_factory=PieceTables)

    @property
    def length(self) -> int:
        return self.rows * self.row_bytes

    def segments(self) -> list[tuple[int, int]]:
        """The receiver's side: `(dst_row, rows)` per piece."""
        return [(piece.dst_row, piece.rows) for piece in self.pieces]

    def segment_table(self) -> bytes:
        """`segments` as the wire's table of little-endian u64 pairs (`SEGMENT`)."""
        if self.tables.segment_table is None:
            pairs = chain.from_iterable(map(_DESTINATION, self.pieces))
            self.tables.segment_table = struct.pack(f"<{2 * len(self.pieces)}Q", *pairs)
        return self.tables.segment_table

    def source_row_table(self) -> bytes:
        """The sender's first row of each piece as little-endian u64s (a read frame's source rows)."""
        if self.tables.source_row_table is None:
            rows = [piece.src_row for piece in self.pieces]
            self.tables.source_row_table = struct.pack(f"<{len(rows)}Q", *rows)
        return self.tables.source_row_table

    def sources(self) -> list[tuple[int, int]]:
        """The sender's side: `(src_row, rows)` per piece."""
        if self.tables.sources is None:
            self.tables.sources = list(map(_SOURCE, self.pieces))
        return self.tables.sources

    def source_bytes(self) -> list[tuple[int, int]]:
        """The sender's side in bytes of the buffer: `[start, end)` per piece."""
        if self.tables.source_bytes is None:
            width = self.row_bytes
            self.tables.source_bytes = [(row * width, (row + rows) * width) for row, rows in self.sources()]
        return self.tables.source_bytes


def frame_bytes(packed: bool, sizes: FrameSizes = HOST_SIZES) -> int:
    """The most bytes a packed or a direct frame holds (unless a single row is wider)."""
    return sizes.packed if packed else MAX_DIRECT_FRAME_BYTES


def frame_rows(row_bytes: int, packed: bool, sizes: FrameSizes = HOST_SIZES) -> int:
    """Rows one packed or direct frame may hold (at least one, however wide a row)."""
    return max(1, frame_bytes(packed, sizes) // row_bytes)


def plan_frames(
    bulk: BulkWrite,
    buffer: int,
    name: str,
    row_bytes: int,
    direct: Callable[[int], bool],
    sizes: FrameSizes = HOST_SIZES,
) -> Iterator[Frame]:
    """The frames moving buffer `name` of `bulk`, in the order their pieces appear in its runs (direct
    and packed frames interleave; each frame's pieces keep that order)."""
    limits = (frame_rows(row_bytes, False, sizes), frame_rows(row_bytes, True, sizes))
    filling: list[Frame | None] = [None, None]  # the direct frame and the packed frame being filled
    packed_for: dict[int, bool] = {}  # piece rows -> packed: asked once per length (pieces share a few)
    piece = tuple.__new__  # a Piece without NamedTuple's Python-level __new__: half the cost per piece
    for run in bulk.runs:
        src_row, dst_row, left = run.src_row, run.dst_row, run.rows
        while left:
            rows = left if left < limits[False] else limits[False]
            packed = packed_for.get(rows)
            if packed is None:
                packed = packed_for[rows] = not direct(rows * row_bytes)
            if packed and rows > limits[True]:  # a smaller slice of a piece too small to go direct stays so
                rows = limits[True]
            frame = filling[packed]
            if frame is not None and (
                frame.rows + rows > limits[packed] or len(frame.pieces) == MAX_SEGMENTS
            ):
                yield frame
                frame = None
            if frame is None:
                frame = filling[packed] = Frame(packed, buffer, name, row_bytes)
            frame.pieces.append(piece(Piece, (src_row, dst_row, rows)))
            frame.rows += rows
            src_row, dst_row, left = src_row + rows, dst_row + rows, left - rows
    for frame in filling:
        if frame is not None:
            yield frame


def bundle_frames(frames: Iterable[Frame], bundle_bytes: int = BUNDLE_BYTES) -> Iterator[list[Frame]]:
    """`frames` grouped as one descriptor each describes them: a direct frame alone; packed frames,
    whatever their buffers, together while their bytes (each frame's start aligned, `bundle_starts`)
    stay within `bundle_bytes` (a bigger frame alone) and they number at most `MAX_BUNDLE_FRAMES`.
    A KV layout has two buffers per layer, so a small round costs a descriptor and a message per
    bundle instead of per buffer (`ucx_kv_small_us`). Packed frames may follow direct frames that came
    after them."""
    bundle: list[Frame] = []
    size = 0
    for frame in frames:
        if not frame.packed:
            yield [frame]
            continue
        start = _aligned(size)
        if bundle and (start + frame.length > bundle_bytes or len(bundle) == MAX_BUNDLE_FRAMES):
            yield bundle
            bundle, start = [], 0
        bundle.append(frame)
        size = start + frame.length
    if bundle:
        yield bundle


def bundle_starts(lengths: Sequence[int]) -> tuple[list[int], int]:
    """Where each frame of a bundle starts in its chunk (`BUNDLE_ALIGN`ed), and the bundle's bytes."""
    starts, end = [], 0
    for length in lengths:
        start = _aligned(end)
        starts.append(start)
        end = start + length
    return starts, end


def _aligned(at: int) -> int:
    return -(-at // BUNDLE_ALIGN) * BUNDLE_ALIGN


def buffer_frames(
    bulk: BulkWrite,
    index: Mapping[str, int],
    row_bytes: Sequence[int],
    direct: Callable[[int], bool],
    sizes: FrameSizes = HOST_SIZES,
) -> Iterator[Frame]:
    """The frames of every buffer of `bulk`, buffer after buffer (`index`: a buffer's place in the
    layout, `row_bytes` by that place). Buffers share the write's runs, so buffers of one row width (a
    KV layout's two per layer) share one plan: planning costs about a microsecond per piece."""
    plans: dict[int, list[Frame]] = {}
    for name in bulk.buffers:
        place = index[name]
        width = row_bytes[place]
        plan = plans.get(width)
        if plan is None:
            plan = plans[width] = list(plan_frames(bulk, place, name, width, direct, sizes))
        for frame in plan:
            yield Frame(frame.packed, place, name, width, frame.pieces, frame.rows, frame.tables)


def plan_bundles(
    bulk: BulkWrite,
    index: Mapping[str, int],
    row_bytes: Sequence[int],
    direct: Callable[[int], bool],
    sizes: FrameSizes = HOST_SIZES,
) -> Iterator[list[Frame]]:
    """`bundle_frames` of `buffer_frames`, within `sizes`."""
    return bundle_frames(buffer_frames(bulk, index, row_bytes, direct, sizes), sizes.bundle)


def packed_only(_piece_bytes: int) -> bool:
    """The `direct` of a transport whose frames all carry their pieces back to back (tcp)."""
    return False

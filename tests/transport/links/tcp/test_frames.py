"""The TCP frame format: what the sender builds is what the reader parses; malformed frames are named."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.layout import PoolLayout
from tests.transport.harness import embedding_layout, kv_layout, random_storage
from transport.bulk.frame_plan import MAX_SEGMENTS, SEGMENT, buffer_frames, packed_only
from transport.bulk.staging import HostChunks
from transport.bulk.write import BulkWrite
from transport.links.tcp.frames import (
    BULK,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_BULK_FRAME_BYTES,
    FrameError,
    bulk_frame,
    parse_header,
    parse_segments,
    staged_tcp_frames,
)


def check_frames(layout: PoolLayout, blocks: int, offset: int, seed: int) -> int:
    """Frames of a write of `blocks` shuffled blocks of the layout's first buffer carry every run once,
    in order, with the source's bytes; returns how many frames there were."""
    name = layout.buffers[0].name
    storage = random_storage(layout, 2 * blocks + 1, seed=1)
    rng = random.Random(seed)
    src, dst = rng.sample(range(2 * blocks + 1), blocks), rng.sample(range(2 * blocks + 1), blocks + 1)
    bulk = BulkWrite(
        source=storage,
        source_ids=src,
        source_offset=offset,
        dest_ids=dst,
        dest_offset=offset,
        count=blocks * layout.block_size - offset,
        buffers=(name,),
        landing_key=7,
        round=3,
    )
    row_bytes = layout.buffers[0].bytes_per_token
    landed: list[tuple[int, int]] = []
    payload, frames = b"", 0
    for planned in buffer_frames(bulk, {name: 0}, [row_bytes], packed_only):
        parts, length = bulk_frame(bulk, planned, corrupt=False), planned.length
        frame = parse_header(parts[0])
        assert (frame.kind, frame.landing_key, frame.round, frame.buffer, frame.length) == (
            BULK,
            7,
            3,
            0,
            length,
        )
        assert frame.segments <= MAX_SEGMENTS and len(parts) == 2 + frame.segments
        assert length <= max(MAX_BULK_FRAME_BYTES, row_bytes)
        landed += parse_segments(parts[1], frame.segments, row_bytes, frame.length)
        payload += b"".join(bytes(part) for part in parts[2:])
        frames += 1

    def each_row(stretches: list[tuple[int, int]]) -> list[int]:  # a run split across frames too
        return [row + i for row, rows in stretches for i in range(rows)]

    assert each_row(landed) == each_row([(run.dst_row, run.rows) for run in bulk.runs])
    expected = b"".join(
        bytes(storage.buffer_bytes(name)[run.src_row * row_bytes : (run.src_row + run.rows) * row_bytes])
        for run in bulk.runs
    )
    assert payload == expected
    return frames


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 40), offset=st.integers(0, 15), seed=st.integers(0, 1000))
def test_bulk_frames_carry_every_run_once(blocks: int, offset: int, seed: int) -> None:
    check_frames(kv_layout(block_size=16), blocks, offset, seed)


@pytest.mark.parametrize(
    ("layout", "blocks", "frames"),
    [
        (kv_layout(block_size=16), 300, 2),  # more runs than one frame's segments
        (embedding_layout(block_size=128, hidden=40_000), 3, 3),  # more bytes than one frame holds
    ],
)
def test_bulk_frames_split_at_the_segment_and_byte_limits(
    layout: PoolLayout, blocks: int, frames: int
) -> None:
    assert check_frames(layout, blocks, offset=5, seed=9) >= frames


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((0xBEEF, BULK, 0, 10, 0, 0, 0, 0, 1), r"^bad frame magic 0xbeef \(expected 0x5a7a\)$"),
        ((MAGIC, 9, 0, 10, 0, 0, 0, 0, 1), r"^unknown frame kind 9$"),
        ((MAGIC, BULK, 0, 0, 0, 0, 0, 0, 1), r"^bulk frame of 0 bytes \(allowed 1 to 8388608\)$"),
        ((MAGIC, BULK, 0, 10, 0, 0, 0, 0, 0), r"^bulk frame with 0 segments \(allowed 1 to 256\)$"),
        (
            (MAGIC, 1, 0, 2**31, 0, 0, 0, 0, 0),
            r"^control frame of 2147483648 bytes, over the 16777216 limit$",
        ),
    ],
)
def test_malformed_headers_are_named(fields: tuple[int, ...], message: str) -> None:
    assert HEADER.size == HEADER_BYTES == 32
    with pytest.raises(FrameError, match=message):
        parse_header(HEADER.pack(*fields))


def test_segments_must_add_up_to_the_payload() -> None:
    table = SEGMENT.pack(0, 2) + SEGMENT.pack(10, 1)
    assert parse_segments(table, 2, 4, 12) == [(0, 2), (10, 1)]
    with pytest.raises(FrameError, match=r"do not add up to its 16 bytes of 4-byte rows"):
        parse_segments(table, 2, 4, 16)
    with pytest.raises(FrameError, match=r"do not add up"):
        parse_segments(SEGMENT.pack(5, 0), 1, 4, 0)


@pytest.mark.parametrize("corrupt", [False, True])
def test_staged_tcp_frames_parse_back_to_the_rows(corrupt: bool) -> None:
    layout = embedding_layout(block_size=16, hidden=64)
    source = random_storage(layout, 32, seed=5)
    src, dst = random.Random(6).sample(range(32), 20), random.Random(7).sample(range(32), 20)
    bulk = BulkWrite(
        source=source,
        source_ids=src,
        source_offset=3,
        dest_ids=dst,
        dest_offset=9,
        count=300,
        buffers=("embeds", "token_ids"),
        landing_key=11,
        round=2,
        corrupt=corrupt,
    )
    chunk = HostChunks(pinned=False).take()
    rows_seen = 0
    for index, name in ((0, "embeds"), (1, "token_ids")):
        width = source.row_bytes[name]
        for parts, length in staged_tcp_frames(bulk, index, name, width, chunk, corrupt and index == 0):
            header, table, payload = parts
            frame = parse_header(header[:HEADER_BYTES])
            assert (frame.kind, frame.landing_key, frame.round, frame.buffer) == (BULK, 11, 2, index)
            segments = parse_segments(table, len(table) // SEGMENT.size, width, length)
            expected = bytearray()
            memory = source.buffer_bytes(name)
            by_destination = {run.dst_row: run for run in bulk.runs}
            for dst_row, rows in segments:
                run = next(r for start, r in by_destination.items() if start <= dst_row < start + r.rows)
                src_row = run.src_row + dst_row - run.dst_row
                expected += memory[src_row * width : (src_row + rows) * width]
                rows_seen += rows
            if corrupt and index == 0 and rows_seen == sum(rows for _row, rows in segments):
                expected[0] ^= 0xFF
            assert bytes(payload) == bytes(expected)
    assert rows_seen == 2 * 300

"""The UCX link's frames (`transport.frame_plan`, `transport.ucx_frames`): planning covers every row once
within the limits, descriptors parse back, and malformed bodies are named. No UCX needed."""

from __future__ import annotations

import random
import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transport.harness import embedding_layout, random_storage
from transport.frame_plan import (
    MAX_DIRECT_FRAME_BYTES,
    MAX_FRAME_BYTES,
    MAX_SEGMENTS,
    frame_bytes,
    frame_rows,
    plan_frames,
)
from transport.link import BulkWrite
from transport.ucx import DIRECT_MIN_BYTES
from transport.ucx_connect import parse_address
from transport.ucx_frames import (
    ACCEPT,
    CONNECT,
    DESCRIPTOR,
    MESSAGE,
    UcxFrameError,
    accept_body,
    connect_body,
    descriptor_body,
    kind_of,
    parse_descriptor,
    parse_number,
)
from transport.ucx_worker import cuda_transports_allowed

LAYOUT = embedding_layout(block_size=16, hidden=1024)  # 4 KiB rows: a block is 64 KiB
ROW_BYTES = [spec.bytes_per_token for spec in LAYOUT.buffers]
STORAGE = random_storage(LAYOUT, 64, seed=1)


def bulk_write(seed: int, count: int, src_offset: int, dst_offset: int) -> BulkWrite:
    rng = random.Random(seed)
    need = -(-(max(src_offset, dst_offset) + count) // 16)
    src, dst = rng.sample(range(64), need), rng.sample(range(64), need)
    if rng.random() < 0.5:  # some consecutive blocks: runs longer than a block
        src, dst = sorted(src), sorted(dst)
    names = ("embeds", "token_ids", "positions")
    return BulkWrite(
        source=STORAGE,
        source_ids=src,
        source_offset=src_offset,
        dest_ids=dst,
        dest_offset=dst_offset,
        count=count,
        buffers=names,
        landing_key=7,
        round=3,
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    count=st.integers(1, 400),
    src_offset=st.integers(0, 15),
    dst_offset=st.integers(0, 15),
    threshold=st.sampled_from([0, DIRECT_MIN_BYTES, 1 << 62]),
)
def test_frames_cover_every_row_once_within_the_limits(
    seed: int, count: int, src_offset: int, dst_offset: int, threshold: int
) -> None:
    bulk = bulk_write(seed, count, src_offset, dst_offset)
    for index, name in enumerate(bulk.buffers):
        width = ROW_BYTES[index]
        frames = list(plan_frames(bulk, index, name, width, lambda nbytes: nbytes >= threshold))
        expected = {(run.src_row + i, run.dst_row + i) for run in bulk.runs for i in range(run.rows)}
        covered = [
            (piece.src_row + i, piece.dst_row + i)
            for frame in frames
            for piece in frame.pieces
            for i in range(piece.rows)
        ]
        assert sorted(covered) == sorted(expected) and len(covered) == len(expected)
        for frame in frames:
            assert 1 <= len(frame.pieces) <= MAX_SEGMENTS
            assert frame.rows == sum(piece.rows for piece in frame.pieces) <= frame_rows(width, frame.packed)
            assert frame.length <= max(frame_bytes(frame.packed), width)
            assert all((piece.rows * width >= threshold) != frame.packed for piece in frame.pieces)
            descriptor = parse_descriptor(descriptor_body(frame, 7, 3), ROW_BYTES)
            assert descriptor == (frame.packed, index, 3, 7, frame.length, frame.segments())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    count=st.integers(1, 400),
    row_bytes=st.sampled_from([256 * 1024, 1024 * 1024, 3 * 1024 * 1024 + 8, 80 * 1024 * 1024]),
    threshold=st.sampled_from([0, DIRECT_MIN_BYTES, 1 << 62]),
)
def test_wide_rows_are_cut_at_each_flavours_limit(
    seed: int, count: int, row_bytes: int, threshold: int
) -> None:
    """Rows this wide make runs longer than a frame: packed frames stop at 8 MiB, direct ones at 64 MiB,
    and a row wider than both still travels, alone."""
    bulk = bulk_write(seed, count, 0, 0)
    frames = list(plan_frames(bulk, 0, "embeds", row_bytes, lambda nbytes: nbytes >= threshold))
    covered = [
        (p.src_row + i, p.dst_row + i) for frame in frames for p in frame.pieces for i in range(p.rows)
    ]
    assert covered == [(run.src_row + i, run.dst_row + i) for run in bulk.runs for i in range(run.rows)]
    for frame in frames:
        assert frame.rows <= frame_rows(row_bytes, frame.packed)
        assert frame.length <= max(frame_bytes(frame.packed), row_bytes)
        assert all((piece.rows * row_bytes >= threshold) != frame.packed for piece in frame.pieces)


def descriptor(
    flavour: int = 1,
    buffer: int = 0,
    count: int = 1,
    segments: list[tuple[int, int]] | None = None,
    length: int | None = None,
) -> bytes:
    """A descriptor body built by hand, so it can be wrong."""
    segments = segments if segments is not None else [(5, 2)]
    length = length if length is not None else sum(rows for _row, rows in segments) * ROW_BYTES[0]
    header = struct.pack("<BBHIQQI", DESCRIPTOR, flavour, buffer, 1, 2, length, count)
    return header + b"".join(struct.pack("<QQ", row, rows) for row, rows in segments)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (descriptor()[:20], "bulk descriptor of 20 bytes, shorter than its 28-byte header"),
        (descriptor(flavour=3), "bulk descriptor of unknown flavour 3"),
        (descriptor(buffer=3), "bulk descriptor for buffer 3; the layout has 3 buffers"),
        (descriptor(count=0, segments=[], length=0), "bulk descriptor with 0 segments (allowed 1 to 256)"),
        (descriptor(count=2), "bulk descriptor of 44 bytes does not hold its 2 segments"),
        (
            descriptor(segments=[(5, 0)], length=0),
            "bulk descriptor segments [(5, 0)] do not add up to its 0 bytes of 4096-byte rows",
        ),
        (
            descriptor(length=5),
            "bulk descriptor segments [(5, 2)] do not add up to its 5 bytes of 4096-byte rows",
        ),
        (
            descriptor(flavour=2, segments=[(0, 4096)]),
            f"bulk descriptor of {4096 * 4096} bytes, over the {MAX_FRAME_BYTES}-byte limit of a packed frame",
        ),
        (
            descriptor(segments=[(0, 16385)]),
            f"bulk descriptor of {16385 * 4096} bytes, over the {MAX_DIRECT_FRAME_BYTES}-byte limit of a "
            "direct frame",
        ),
    ],
    ids=[
        "short",
        "flavour",
        "buffer",
        "no-segments",
        "table",
        "empty-segment",
        "sum",
        "too-big-packed",
        "too-big-direct",
    ],
)
def test_malformed_descriptors_are_named(body: bytes, message: str) -> None:
    with pytest.raises(UcxFrameError, match=f"^{re.escape(message)}$"):
        parse_descriptor(body, ROW_BYTES)


def test_connect_accept_and_unknown_bodies() -> None:
    assert parse_number(connect_body(9, b"worker-address"), CONNECT) == (9, b"worker-address")
    assert parse_number(accept_body(4), ACCEPT) == (4, b"")
    with pytest.raises(UcxFrameError, match=r"^expected a 'A' body of at least 9 bytes, got 9$"):
        parse_number(connect_body(9, b""), ACCEPT)
    with pytest.raises(UcxFrameError, match=r"^control body of unknown kind 0xde$"):
        kind_of(b"\xde\xad", (MESSAGE, DESCRIPTOR))


@pytest.mark.parametrize(
    ("tls", "allowed"),
    [
        ("all", True),
        ("sm,tcp", False),
        ("sm,cuda_copy", True),
        ("cuda", True),
        ("^tcp", True),
        ("^cuda", False),
    ],
)
def test_which_ucx_tls_values_move_cuda_memory(tls: str, allowed: bool) -> None:
    assert cuda_transports_allowed(tls) is allowed


def test_ucx_addresses() -> None:
    assert parse_address("ucx://00ff10") == b"\x00\xff\x10"
    for bad in ("ucx://", "ucx://xyz", "tcp://1.2.3.4:5"):
        with pytest.raises(ValueError, match=r"^bad ucx address .*: expected ucx://<hex worker address>$"):
            parse_address(bad)

"""The UCX link's frames (`transport.bulk.frame_plan`, `transport.links.ucx.frames`): planning covers every row once
within the limits, descriptors parse back, and malformed bodies are named. No UCX needed."""

from __future__ import annotations

import itertools
import random
import re
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transport.harness import embedding_layout, random_storage
from transport.bulk.frame_plan import (
    DEVICE_SIZES,
    HOST_SIZES,
    MAX_BUNDLE_FRAMES,
    MAX_DIRECT_FRAME_BYTES,
    MAX_PACKED_BYTES,
    MAX_SEGMENTS,
    FrameSizes,
    bundle_frames,
    bundle_starts,
    frame_bytes,
    frame_rows,
    plan_bundles,
    plan_frames,
)
from transport.bulk.write import BulkWrite
from transport.links.ucx.connect import parse_address
from transport.links.ucx.frames import (
    ACCEPT,
    CONNECT,
    DESCRIPTOR,
    DIRECT_MIN_BYTES,
    MESSAGE,
    READ,
    READ_GROUP_BYTES,
    READS,
    RECEIPT,
    UcxFrameError,
    accept_body,
    connect_body,
    descriptor_body,
    kind_of,
    parse_accept,
    parse_descriptors,
    parse_number,
    parse_receipt,
    reads_body,
    receipt_body,
)
from transport.links.ucx.library import cuda_transports_allowed
from transport.links.ucx.reads import read_groups, reads_piece

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
    count=st.integers(1, 1000),
    row_bytes=st.sampled_from([ROW_BYTES, [4096, 8, 8 << 20]]),
)
def test_read_groups_hold_each_direct_frame_once_and_parse_back_with_their_sources(
    seed: int, count: int, row_bytes: list[int]
) -> None:
    """A reading peer's plan: the direct frames gathered in groups within `READ_GROUP_BYTES` and
    `MAX_BUNDLE_FRAMES`, in order, then the bundles as they were; a group's descriptor parses back to its frames
    with the sender's base address and source rows."""
    bulk = bulk_write(seed, count, 0, 0)
    index = {name: place for place, name in enumerate(bulk.buffers)}
    bundles = list(plan_bundles(bulk, index, row_bytes, reads_piece, HOST_SIZES))
    groups = list(read_groups(bundles))
    assert [bundle for reads, bundle in groups if not reads] == [b for b in bundles if b[0].packed]
    direct = [bundle[0] for bundle in bundles if not bundle[0].packed]
    assert [frame for reads, group in groups if reads for frame in group] == direct
    kinds = [reads for reads, _group in groups]
    assert kinds == sorted(kinds, reverse=True)  # every read group ahead of every bundle
    for reads, group in groups:
        if not reads:
            continue
        assert len(group) <= MAX_BUNDLE_FRAMES
        assert len(group) == 1 or sum(frame.length for frame in group) <= READ_GROUP_BYTES
        bases = [0x7F0000000000 + 0x1000 * place for place in range(len(group))]
        parsed = parse_descriptors(descriptor_body(group, 7, 3, bases), row_bytes)
        assert [tuple(descriptor)[:8] for descriptor in parsed] == [
            (False, f.buffer, 3, 7, f.length, f.segments(), base, tuple(p.src_row for p in f.pieces))
            for f, base in zip(group, bases, strict=True)
        ]
        assert all(frame.read for frame in parsed)
        for descriptor in parsed:  # the tables as they came, which the reader computes its vectors from
            flat = [value for segment in descriptor.segments for value in segment]
            assert descriptor.read_table == struct.pack(
                f"<{len(flat) + len(descriptor.source_rows)}Q", *flat, *descriptor.source_rows
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
            descriptors = parse_descriptors(descriptor_body([frame], 7, 3), ROW_BYTES)
            assert descriptors == [(frame.packed, index, 3, 7, frame.length, frame.segments(), 0, (), b"")]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    count=st.integers(1, 1000),
    threshold=st.sampled_from([0, DIRECT_MIN_BYTES, 1 << 62]),
    row_bytes=st.sampled_from([ROW_BYTES, [8, 24, 4096], [64 * 1024, 8, 8]]),
    sizes=st.sampled_from([HOST_SIZES, DEVICE_SIZES]),
)
def test_bundles_hold_each_frame_once_and_parse_back(
    seed: int, count: int, threshold: int, row_bytes: list[int], sizes: FrameSizes
) -> None:
    """Packed frames of all buffers share bundles within `sizes.bundle` and `MAX_BUNDLE_FRAMES`; a
    direct frame stays alone; each bundle's descriptor parses back to its frames, in order (the host's
    sizes and the larger ones of a GPU pool's device bundles alike)."""
    bulk = bulk_write(seed, count, 0, 0)

    def direct(nbytes: int) -> bool:
        return nbytes >= threshold

    frames = [
        frame
        for index, name in enumerate(bulk.buffers)
        for frame in plan_frames(bulk, index, name, row_bytes[index], direct, sizes)
    ]
    index = {name: place for place, name in enumerate(bulk.buffers)}
    bundles = list(bundle_frames(frames, sizes.bundle))
    assert list(plan_bundles(bulk, index, row_bytes, direct, sizes)) == bundles
    assert sorted(id(f) for bundle in bundles for f in bundle) == sorted(id(f) for f in frames)
    for packed in (True, False):  # each flavour keeps its order
        assert [f for b in bundles for f in b if f.packed == packed] == [
            f for f in frames if f.packed == packed
        ]
    for bundle in bundles:
        assert [frame.packed for frame in bundle] in ([True] * len(bundle), [False])
        assert len(bundle) <= MAX_BUNDLE_FRAMES
        assert len(bundle) == 1 or bundle_starts([frame.length for frame in bundle])[1] <= sizes.bundle
        parsed = parse_descriptors(descriptor_body(bundle, 7, 3), row_bytes)
        assert parsed == [(f.packed, f.buffer, 3, 7, f.length, f.segments(), 0, (), b"") for f in bundle]
    packed_bundles = [bundle for bundle in bundles if bundle[0].packed]
    for bundle, after in itertools.pairwise(packed_bundles):  # closed only when the next is too big
        full = len(bundle) == MAX_BUNDLE_FRAMES
        assert full or bundle_starts([f.length for f in [*bundle, after[0]]])[1] > sizes.bundle


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    count=st.integers(1, 400),
    row_bytes=st.sampled_from([256 * 1024, 1024 * 1024, 3 * 1024 * 1024 + 8, 80 * 1024 * 1024]),
    threshold=st.sampled_from([0, DIRECT_MIN_BYTES, 1 << 62]),
    sizes=st.sampled_from([HOST_SIZES, DEVICE_SIZES]),
)
def test_wide_rows_are_cut_at_each_flavours_limit(
    seed: int, count: int, row_bytes: int, threshold: int, sizes: FrameSizes
) -> None:
    """Rows this wide make runs longer than a frame: packed frames stop at `sizes.packed` (8 MiB on the
    host, 32 MiB on a GPU), direct ones at 64 MiB, and a row wider than both still travels, alone."""
    bulk = bulk_write(seed, count, 0, 0)
    frames = list(plan_frames(bulk, 0, "embeds", row_bytes, lambda nbytes: nbytes >= threshold, sizes))
    covered = [
        (p.src_row + i, p.dst_row + i) for frame in frames for p in frame.pieces for i in range(p.rows)
    ]
    assert covered == [(run.src_row + i, run.dst_row + i) for run in bulk.runs for i in range(run.rows)]
    for frame in frames:
        assert frame.rows <= frame_rows(row_bytes, frame.packed, sizes)
        assert frame.length <= max(frame_bytes(frame.packed, sizes), row_bytes)
        assert all((piece.rows * row_bytes >= threshold) != frame.packed for piece in frame.pieces)


def descriptor(
    flavour: int = 1,
    buffer: int = 0,
    count: int = 1,
    segments: list[tuple[int, int]] | None = None,
    length: int | None = None,
    round: int = 1,
    kind: int = DESCRIPTOR,
    source: tuple[int, list[int]] | None = None,
) -> bytes:
    """A descriptor body built by hand, so it can be wrong; `source`: a read frame's base and rows."""
    segments = segments if segments is not None else [(5, 2)]
    length = length if length is not None else sum(rows for _row, rows in segments) * ROW_BYTES[0]
    header = struct.pack("<BBHIQQI", kind, flavour, buffer, round, 2, length, count)
    table = b"".join(struct.pack("<QQ", row, rows) for row, rows in segments)
    if source is None:
        return header + table
    base, rows = source
    return header + struct.pack("<Q", base) + table + struct.pack(f"<{len(rows)}Q", *rows)


def read_descriptor(**fields: Any) -> bytes:
    return descriptor(flavour=READ, source=(0x10000, [40]), **fields)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (descriptor(flavour=2) + descriptor(), "bulk descriptor of 2 frames, not all of them packed"),
        (
            descriptor(flavour=2) + descriptor(flavour=2, round=2),
            "bulk descriptor of 2 frames of different rounds",
        ),
        (
            descriptor(flavour=2, segments=[(0, 4500)]) * 2,
            f"bulk descriptor of 2 packed frames and {2 * 4500 * 4096} bytes, over the limit of "
            f"{MAX_BUNDLE_FRAMES} frames and {MAX_PACKED_BYTES} bytes",
        ),
        (
            descriptor(flavour=2) * (MAX_BUNDLE_FRAMES + 1),
            f"bulk descriptor of {MAX_BUNDLE_FRAMES + 1} packed frames and {(MAX_BUNDLE_FRAMES + 1) * 8192} "
            f"bytes, over the limit of {MAX_BUNDLE_FRAMES} frames and {MAX_PACKED_BYTES} bytes",
        ),
        (descriptor(flavour=2) + b"\x00" * 5, "bulk descriptor of 5 bytes, shorter than its 28-byte header"),
        (
            descriptor(flavour=2) + descriptor(flavour=2, kind=ord("M")),
            "bulk descriptor with a frame of unknown kind 0x4d",
        ),
        (descriptor()[:20], "bulk descriptor of 20 bytes, shorter than its 28-byte header"),
        (descriptor(flavour=4), "bulk descriptor of unknown flavour 4"),
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
            descriptor(flavour=2, segments=[(0, 8193)]),
            f"bulk descriptor of {8193 * 4096} bytes, over the {MAX_PACKED_BYTES}-byte limit of a packed frame",
        ),
        (
            descriptor(segments=[(0, 16385)]),
            f"bulk descriptor of {16385 * 4096} bytes, over the {MAX_DIRECT_FRAME_BYTES}-byte limit of a "
            "direct frame",
        ),
        (read_descriptor() + descriptor(), "bulk descriptor of 2 frames, some read and some not"),
        (
            descriptor(flavour=READ, segments=[(0, 16384)], source=(0, [0])) * 2,
            f"bulk descriptor of 2 read frames and {2 * 16384 * 4096} bytes, over the limit of "
            f"{MAX_BUNDLE_FRAMES} frames and {READ_GROUP_BYTES} bytes",
        ),
        (read_descriptor() + read_descriptor(round=2), "bulk descriptor of 2 frames of different rounds"),
        (read_descriptor()[:-1], "bulk descriptor of 59 bytes does not hold its 1 segments"),
        (
            descriptor(flavour=READ, source=(2**64 - 4096, [0])),
            f"read frame of rows beyond the address space (row 0 at 0x{2**64 - 4096:x})",
        ),
        (  # a table already unpacked for the first frame is checked against the second's own length
            descriptor(flavour=2) + descriptor(flavour=2, length=5),
            "bulk descriptor segments [(5, 2)] do not add up to its 5 bytes of 4096-byte rows",
        ),
        (  # and its rows against the second's own base
            read_descriptor() + descriptor(flavour=READ, source=(2**64 - 4096, [40])),
            f"read frame of rows beyond the address space (row 0 at 0x{2**64 - 4096:x})",
        ),
    ],
    ids=[
        "bundle-mixed",
        "bundle-rounds",
        "bundle-too-big",
        "bundle-too-many",
        "bundle-trailing",
        "bundle-kind",
        "short",
        "flavour",
        "buffer",
        "no-segments",
        "table",
        "empty-segment",
        "sum",
        "too-big-packed",
        "too-big-direct",
        "read-mixed",
        "read-too-big",
        "read-rounds",
        "read-table",
        "read-beyond",
        "shared-table-sum",
        "shared-table-beyond",
    ],
)
def test_malformed_descriptors_are_named(body: bytes, message: str) -> None:
    with pytest.raises(UcxFrameError, match=f"^{re.escape(message)}$"):
        parse_descriptors(body, ROW_BYTES)


def test_frames_with_the_same_tables_share_their_parsed_lists() -> None:
    """A KV round's frames carry the same rows for every buffer: parsed once per descriptor."""
    same = read_descriptor(buffer=0) + read_descriptor(buffer=1, length=2 * ROW_BYTES[1])
    other = descriptor(flavour=READ, buffer=2, length=2 * ROW_BYTES[2], source=(0x10000, [41]))
    first, second, third = parse_descriptors(same + other, ROW_BYTES)
    assert first.segments is second.segments and first.source_rows is second.source_rows
    assert (first.buffer, second.buffer, third.buffer) == (0, 1, 2)
    assert third.segments == first.segments and third.source_rows == (41,) != first.source_rows
    assert third.read_table != first.read_table == second.read_table


def test_connect_accept_and_unknown_bodies() -> None:
    assert parse_number(connect_body(9, b"worker-address"), CONNECT) == (9, b"worker-address")
    assert parse_number(accept_body(4, 77, 0x7F00, b"key"), ACCEPT)[0] == 4
    assert parse_accept(accept_body(4, 77, 0x7F00, b"boot/pid:[1]")) == (4, 77, 0x7F00, b"boot/pid:[1]")
    with pytest.raises(
        UcxFrameError,
        match=r"^an accept body needs a pid and a probe address \(16 bytes\) after the link number$",
    ):
        parse_accept(bytes((ACCEPT,)) + bytes(16))
    assert kind_of(reads_body(), (READS,)) == READS
    assert kind_of(receipt_body(3), (RECEIPT,)) == RECEIPT and parse_receipt(receipt_body(3)) == 3
    with pytest.raises(UcxFrameError, match=r"^a receipt body has 5 bytes, got 4$"):
        parse_receipt(receipt_body(3)[:4])
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

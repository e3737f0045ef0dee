"""Packing rows into host chunks and back (`transport.bulk.staging`): the CPU path, the device path's index
arithmetic run on CPU tensors (`gather_rows` / `scatter_rows`), and TCP frames built through a chunk."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.layout import BufferSpec, PoolLayout
from tests.transport.harness import kv_layout, poisoned_storage, random_storage
from transport.bulk.frame_plan import MAX_FRAME_BYTES, MAX_PACKED_BYTES, bundle_starts, plan_bundles
from transport.bulk.staging import (
    HostChunks,
    gather_rows,
    pack,
    pack_bundle,
    row_groups,
    scatter_rows,
    unpack,
)
from transport.bulk.write import BulkWrite


def stretches(seed: int, total_rows: int, count: int) -> list[tuple[int, int]]:
    """`count` disjoint stretches of rows in random order."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total_rows), 2 * count))
    pairs = [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(0, 2 * count, 2)]
    rng.shuffle(pairs)
    return pairs


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), count=st.integers(1, 12), device_path=st.booleans())
def test_packed_rows_come_back_where_they_were(seed: int, count: int, device_path: bool) -> None:
    """Both buffers' rows share one chunk, back to back (a bundle), and land back in their rows."""
    layout = kv_layout(layers=1)
    source, target = random_storage(layout, 16, seed), poisoned_storage(layout, 16)
    rows = stretches(seed, 16 * 16, count)
    chunks = HostChunks(pinned=False)
    chunk, starts, at = chunks.take(), {}, 0
    for name in ("k0", "v0"):
        starts[name] = at
        length = (gather_rows if device_path else pack)(source, name, rows, chunk, at)
        assert length == sum(n for _row, n in rows) * source.row_bytes[name]
        flat = source.flat(name).view(torch.uint8).reshape(16 * 16, -1)
        packed = torch.cat([flat[row : row + n] for row, n in rows]).reshape(-1)
        assert torch.equal(chunk.tensor[at : at + length], packed)
        at += length
    for name in ("v0", "k0"):
        length = (scatter_rows if device_path else unpack)(target, name, rows, chunk, starts[name])
        assert length == sum(n for _row, n in rows) * source.row_bytes[name]
        flat = source.flat(name).view(torch.uint8).reshape(16 * 16, -1)
        landed = target.flat(name).view(torch.uint8).reshape(16 * 16, -1)
        touched = torch.zeros(16 * 16, dtype=torch.bool)
        for row, n in rows:
            assert torch.equal(landed[row : row + n], flat[row : row + n])
            touched[row : row + n] = True
        assert bool((landed[~touched] == 0x5A).all())
    chunks.give(chunk)


def test_host_chunks_are_reused_by_size_and_wider_frames_get_their_own() -> None:
    """Frame-sized and bundle-sized chunks are kept and handed out again; one wider than a bundle is not."""
    chunks = HostChunks(pinned=False)
    first = chunks.take()
    chunks.give(first)
    assert chunks.take() is first
    bundle = chunks.take(MAX_FRAME_BYTES + 1)
    assert len(bundle.view) == MAX_PACKED_BYTES
    chunks.give(bundle)
    assert chunks.take() is not bundle
    assert chunks.take(MAX_PACKED_BYTES) is bundle
    wide = chunks.take(MAX_PACKED_BYTES + 1)
    assert len(wide.view) == MAX_PACKED_BYTES + 1
    chunks.give(wide)
    assert chunks.take(MAX_PACKED_BYTES + 1) is not wide


def test_a_bundle_packs_frames_of_any_dtype_at_aligned_starts() -> None:
    """Rows of 6, 8 and 20 bytes share one chunk; each frame starts 16-byte aligned (the gaps zeroed,
    whatever the chunk held before), so the device path can view every frame as its dtype."""
    layout = PoolLayout(
        block_size=4,
        buffers=(
            BufferSpec(name="a", shape=(3,), dtype="bfloat16"),
            BufferSpec(name="b", shape=(), dtype="int64"),
            BufferSpec(name="c", shape=(5,), dtype="float32"),
        ),
    )
    source, target = random_storage(layout, 8, seed=3), poisoned_storage(layout, 8)
    bulk = BulkWrite(
        source=source,
        source_ids=[5, 1, 6],
        source_offset=1,
        dest_ids=[2, 7, 0],
        dest_offset=3,
        count=9,
        buffers=("a", "b", "c"),
        landing_key=1,
        round=0,
    )
    (bundle,) = plan_bundles(bulk, {"a": 0, "b": 1, "c": 2}, [6, 8, 20], lambda _nbytes: False)
    chunks = HostChunks(pinned=False)
    dirty = chunks.take()
    dirty.tensor.fill_(0xFF)
    chunks.give(dirty)
    chunk, length = pack_bundle(source, bundle, chunks)
    starts, total = bundle_starts([frame.length for frame in bundle])
    assert chunk is dirty and length == total and starts == [0, 64, 144]
    assert [frame.length for frame in bundle] == [54, 72, 180]
    assert bool((chunk.tensor[54:64] == 0).all()) and bool((chunk.tensor[136:144] == 0).all())
    for frame, start in zip(bundle, starts, strict=True):
        assert scatter_rows(target, frame.name, frame.segments(), chunk, start) == frame.length
        landed, sent = target.flat(frame.name), source.flat(frame.name)
        for piece in frame.pieces:
            rows = slice(piece.dst_row, piece.dst_row + piece.rows)
            sources = slice(piece.src_row, piece.src_row + piece.rows)
            assert torch.equal(landed[rows].view(torch.uint8), sent[sources].view(torch.uint8))


@settings(max_examples=100, deadline=None)
@given(
    block=st.sampled_from([1, 2, 16, 128]),
    blocks=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 4)), max_size=12),
    offset=st.integers(0, 3),
)
def test_row_groups_take_whole_blocks_at_once_and_list_exactly_the_stretches_rows(
    block: int, blocks: list[tuple[int, int]], offset: int
) -> None:
    """Stretches of whole blocks are indexed a block or more at a time; a stretch off a block boundary
    makes the groups smaller. Either way the groups listed hold exactly the stretches' rows, in order."""
    flat = torch.arange(16 * block * 3, dtype=torch.int32).view(16 * block, 3)
    total = flat.shape[0]
    starts = [(min(first * block + offset * (first % 2), total), count * block) for first, count in blocks]
    rows = [(row, min(count, total - row)) for row, count in starts]
    groups, index = row_groups(flat, rows)
    listed = groups.index_select(0, index).reshape(-1, 3)
    expected = torch.cat([flat[row : row + count] for row, count in rows] or [flat[:0]])
    assert torch.equal(listed, expected)
    if offset == 0 and all(count % block == 0 for _row, count in rows):
        assert index.numel() <= sum(count for _row, count in rows) // block

"""Device bundles (`transport.bulk.device_bundles`): how a UCX link that reaches GPU memory packs a
GPU pool's rows. The gather and scatter are torch index operations on whatever device the pool is on, so
their layout and index arithmetic run here on CPU tensors, checked against the host path
(`staging.pack_bundle`); the GPU tests (skipped without CUDA) check the same on the device and the
stream order, and the UCX link end to end is `test_gpu_pools` with CUDA in `UCX_TLS` (`.ci/gpu`)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.layout import BufferSpec, PoolLayout
from tests.transport.harness import (
    check_kv_in_borrowed_blocks_and_an_aborted_round,
    device_bundles_on_cpu,
    on_device,
    poisoned_storage,
    random_storage,
)
from tests.waiting import deadline
from transport.bulk.device_bundles import (
    DEVICE_DIRECT_MIN_BYTES,
    gather,
    is_direct_on_device,
    landing_buffer,
    launch_gather,
    scatter,
    written,
)
from transport.bulk.frame_plan import (
    DEVICE_SIZES,
    HOST_SIZES,
    Frame,
    bundle_starts,
    packed_only,
    plan_bundles,
)
from transport.bulk.runs import transfer_stream
from transport.bulk.staging import HostChunks, pack_bundle
from transport.bulk.write import BulkWrite
from transport.links.ucx.frames import DIRECT_MIN_BYTES, framing
from transport.memory.storage import PoolStorage

# Rows of 6, 8, 20 and 4 096 bytes: frames of the first three leave alignment gaps in a bundle.
LAYOUT = PoolLayout(
    block_size=4,
    buffers=(
        BufferSpec(name="a", shape=(3,), dtype="bfloat16"),
        BufferSpec(name="b", shape=(), dtype="int64"),
        BufferSpec(name="c", shape=(5,), dtype="float32"),
        BufferSpec(name="d", shape=(1024,), dtype="float32"),
    ),
)
BLOCKS = 64
NAMES = tuple(spec.name for spec in LAYOUT.buffers)
INDEX = {name: place for place, name in enumerate(NAMES)}
ROW_BYTES = [spec.bytes_per_token for spec in LAYOUT.buffers]


def shuffled_write(source: PoolStorage, seed: int, count: int) -> BulkWrite:
    """`count` tokens from shuffled source blocks to shuffled destination blocks, at random offsets."""
    rng = random.Random(seed)
    blocks = -(-(count + 3) // LAYOUT.block_size)
    return BulkWrite(
        source=source,
        source_ids=rng.sample(range(BLOCKS), blocks),
        source_offset=rng.randrange(4),
        dest_ids=rng.sample(range(BLOCKS), blocks),
        dest_offset=rng.randrange(4),
        count=count,
        buffers=NAMES,
        landing_key=1,
        round=0,
    )


def device_bundles(bulk: BulkWrite) -> list[list[Frame]]:
    """The packed bundles of `bulk` as a link that packs on the device plans them."""
    bundles = plan_bundles(bulk, INDEX, ROW_BYTES, is_direct_on_device, DEVICE_SIZES)
    return [bundle for bundle in bundles if bundle[0].packed]


def rows_written(bundles: list[list[Frame]]) -> dict[str, set[int]]:
    return {
        name: {
            piece.dst_row + i
            for bundle in bundles
            for frame in bundle
            if frame.name == name
            for piece in frame.pieces
            for i in range(piece.rows)
        }
        for name in NAMES
    }


def assert_landed(source: PoolStorage, target: PoolStorage, bulk: BulkWrite) -> None:
    """Every row `bulk` moves holds the source's bytes in `target`; every other row is still poisoned."""
    bundles = device_bundles(bulk)
    written_rows = rows_written(bundles)
    poison = poisoned_storage(LAYOUT, BLOCKS)
    for name in NAMES:
        landed = target.flat(name).cpu().view(torch.uint8).reshape(BLOCKS * LAYOUT.block_size, -1)
        sent = source.flat(name).cpu().view(torch.uint8).reshape(BLOCKS * LAYOUT.block_size, -1)
        untouched = poison.flat(name).view(torch.uint8).reshape(BLOCKS * LAYOUT.block_size, -1)
        for frame in (f for bundle in bundles for f in bundle if f.name == name):
            for piece in frame.pieces:
                rows, sources = piece.dst_row, piece.src_row
                assert torch.equal(landed[rows : rows + piece.rows], sent[sources : sources + piece.rows])
        others = sorted(set(range(BLOCKS * LAYOUT.block_size)) - written_rows[name])
        assert torch.equal(landed[others], untouched[others])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), count=st.integers(1, BLOCKS * 4 - 8))
def test_a_device_bundle_holds_the_host_layout_and_lands_every_row_in_place(seed: int, count: int) -> None:
    """A bundle gathered by `launch_gather` holds the bytes `pack_bundle` (the host path) lays out —
    frames from aligned starts, gaps zeroed — and `scatter` puts each row where the bulk write sends
    it, touching no other row."""
    source, target = random_storage(LAYOUT, BLOCKS, seed), poisoned_storage(LAYOUT, BLOCKS)
    bulk = shuffled_write(source, seed, count)
    bundles = device_bundles(bulk)
    assert [len(bundle) for bundle in bundles] == [len(NAMES)]  # one bundle: under 32 MiB, none direct
    for bundle in bundles:
        gathered, event = launch_gather(source, bundle)
        assert event is None  # CPU: written on return
        chunk, length = pack_bundle(source, bundle, HostChunks(pinned=False))
        assert gathered.dtype == torch.uint8 and gathered.numel() == length
        assert torch.equal(gathered, chunk.tensor[:length])
        starts, _length = bundle_starts([frame.length for frame in bundle])
        ends = [start + frame.length for start, frame in zip(starts, bundle, strict=True)]
        for end, start in zip(ends, starts[1:], strict=False):
            assert bool((gathered[end:start] == 0).all())
        targets = [
            (target, frame.name, frame.segments(), start) for frame, start in zip(bundle, starts, strict=True)
        ]
        assert scatter(gathered, targets) is None
    assert_landed(source, target, bulk)


def test_a_corrupted_bundle_differs_in_its_first_byte_only_and_the_rows_stay() -> None:
    source = random_storage(LAYOUT, BLOCKS, seed=4)
    before = {name: tensor.view(torch.uint8).clone() for name, tensor in source.tensors.items()}
    (bundle,) = device_bundles(shuffled_write(source, seed=4, count=100))
    clean, _event = launch_gather(source, bundle)
    flipped, _event = launch_gather(source, bundle, corrupt=True)
    assert int(flipped[0]) == int(clean[0]) ^ 0xFF and torch.equal(flipped[1:], clean[1:])
    assert all(torch.equal(source.tensors[name].view(torch.uint8), raw) for name, raw in before.items())


async def test_gather_and_written_on_cpu_return_the_bundle_without_waiting() -> None:
    source = random_storage(LAYOUT, BLOCKS, seed=5)
    (bundle,) = device_bundles(shuffled_write(source, seed=5, count=60))
    with deadline("a CPU bundle gathered and written without waiting", 1):
        gathered = await gather(source, bundle)
        await written(None, gathered.numel())
    assert torch.equal(gathered, launch_gather(source, bundle)[0])


def test_how_a_ucx_link_frames_each_kind_of_pool() -> None:
    """Host pools: pieces from 64 KiB go direct, host sizes. A GPU pool UCX reaches: device bundles, and
    only pieces that fill one go direct. A GPU pool UCX does not reach: everything packed, through host
    chunks."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for capable in (False, True):
        direct, sizes = framing(cpu, capable)
        assert sizes == HOST_SIZES
        assert (direct(DIRECT_MIN_BYTES - 1), direct(DIRECT_MIN_BYTES)) == (False, True)
    direct, sizes = framing(gpu, True)
    assert sizes == DEVICE_SIZES
    assert (direct(DEVICE_DIRECT_MIN_BYTES - 1), direct(DEVICE_DIRECT_MIN_BYTES)) == (False, True)
    assert framing(gpu, False) == (packed_only, HOST_SIZES)


@pytest.mark.gpu
async def test_a_gpu_bundle_follows_the_work_queued_before_it(cuda: torch.device) -> None:
    """On a GPU: the gather runs after what the current stream queued before it (a long sleep, then a
    kernel rewriting the source rows), `gather` returns once the bundle is written, and the scatter of
    that bundle, copied into a landing buffer, lands the same rows as on the CPU and waits for nothing
    queued after it (a longer sleep). `cuda` and `cuda:0` share one transfer stream."""
    assert transfer_stream(torch.device("cuda")) is transfer_stream(torch.device("cuda", 0))
    host_source = random_storage(LAYOUT, BLOCKS, seed=6)
    source, target = on_device(host_source, "cuda"), on_device(poisoned_storage(LAYOUT, BLOCKS), "cuda")
    bulk = shuffled_write(source, seed=6, count=200)
    (bundle,) = device_bundles(bulk)
    await gather(source, bundle)  # index upload and kernels warmed
    torch.cuda._sleep(200_000_000)
    for name, tensor in source.tensors.items():
        tensor.view(torch.uint8).bitwise_not_()
        host_source.tensors[name].view(torch.uint8).bitwise_not_()
    gathered = await gather(source, bundle)
    expected, _event = launch_gather(host_source, bundle)
    assert torch.equal(gathered.cpu(), expected)
    starts, _length = bundle_starts([frame.length for frame in bundle])
    targets = [(target, f.name, f.segments(), start) for f, start in zip(bundle, starts, strict=True)]
    landed = landing_buffer(cuda, gathered.numel())
    landed.copy_(gathered)  # as UCX would have written it
    torch.cuda.synchronize()
    event = scatter(landed, targets)
    assert event is not None
    torch.cuda._sleep(2_000_000_000)
    later = torch.cuda.Event()
    later.record()
    await written(event, gathered.numel())
    assert not later.query()
    assert_landed(host_source, target, bulk)


@pytest.mark.usefixtures("ucx_env")
async def test_kv_in_device_bundles_lands_in_a_borrowed_allocation_and_an_aborted_round_is_fenced() -> None:
    """The receiver copies the bytes itself (`ucx-receiver-copies`): each bundle lands in one buffer it
    scatters. (The protocol's random transfers run in device bundles too: `test_transfer_ucx`.)"""
    with device_bundles_on_cpu():
        await check_kv_in_borrowed_blocks_and_an_aborted_round("ucx-receiver-copies")

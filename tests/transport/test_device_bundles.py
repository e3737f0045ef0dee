"""Device bundles (`transport.device_bundles`, issue 7): how a UCX link that reaches GPU memory packs a
GPU pool's rows. The gather and scatter are torch index operations on whatever device the pool is on, so
their layout and index arithmetic run here on CPU tensors, checked against the host path
(`staging.pack_bundle`); the GPU tests (skipped without CUDA) check the same on the device and the
stream order, and the UCX link end to end is `test_gpu_pools` with CUDA in `UCX_TLS` (`.ci/gpu`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.layout import BufferSpec, PoolLayout
from tests.transport.harness import (
    Collector,
    Source,
    as_bytes,
    assert_same_bytes,
    embedding_layout,
    endpoint_pair,
    kv_layout,
    on_device,
    poisoned_storage,
    random_storage,
    send_all,
    settle,
    shuffled_pool,
)
from tests.transport.test_transfer import check_random_transfer
from transport.config import TransferConfig
from transport.device_bundles import (
    DEVICE_DIRECT_MIN_BYTES,
    gather,
    is_direct_on_device,
    landing_buffer,
    launch_gather,
    scatter,
    written,
)
from transport.frame_plan import DEVICE_SIZES, HOST_SIZES, Frame, bundle_starts, packed_only, plan_bundles
from transport.link import BulkWrite
from transport.runs import transfer_stream
from transport.staging import HostChunks, pack_bundle
from transport.storage import PoolStorage
from transport.ucx_frames import DIRECT_MIN_BYTES, framing

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
    with trio.fail_after(1):
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


def _always(_device: torch.device, _cuda_capable: bool) -> bool:
    return True


@contextmanager
def device_bundles_on_cpu() -> Iterator[None]:
    """UCX links pack CPU pools as they pack GPU pools their UCX reaches: the policy that picks the path
    (`bundles_on_device`, true only for CUDA pools) switched on, so the path itself — one gathered
    bundle per message, received into one buffer and scattered — runs here over real UCX, all but its
    streams and events."""
    with pytest.MonkeyPatch.context() as patch:
        for module in ("transport.ucx", "transport.ucx_frames"):
            patch.setattr(f"{module}.bundles_on_device", _always)
        yield


@pytest.mark.usefixtures("ucx_env")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 16, 64]),
    hidden=st.sampled_from([3, 4096]),
    total=st.integers(0, 300),
    window=st.integers(1, 4),
    cap=st.none() | st.integers(1, 5),
    mode=st.sampled_from(["keep", "consume", "borrowed"]),
    fragmentation=st.lists(st.tuples(st.integers(1, 4), st.booleans()), max_size=8),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["ucx", "ucx-receiver-copies"]),
)
def test_random_transfers_in_device_bundles_land_identical_data_and_nothing_else(
    block_size: int,
    hidden: int,
    total: int,
    window: int,
    cap: int | None,
    mode: str,
    fragmentation: list[tuple[int, bool]],
    seed: int,
    kind: str,
) -> None:
    """The protocol's random transfers with the sender packing device bundles; the receiver lands them
    in one buffer it scatters (`ucx-receiver-copies`) or, from a sender process it watches, straight
    into the rows by an I/O-vector receive (`ucx`)."""
    with device_bundles_on_cpu():
        check_random_transfer(
            kind,
            embedding_layout(block_size=block_size, hidden=hidden),
            total=total,
            window=window,
            default_grant=3,
            cap=cap,
            mode=mode,
            fragmentation=fragmentation,
            seed=seed,
        )


@pytest.mark.usefixtures("ucx_env")
async def test_kv_in_device_bundles_lands_in_a_borrowed_allocation_and_an_aborted_round_is_fenced() -> None:
    layout = kv_layout(layers=2)
    source = Source(layout, 200, seed=9)
    storage, pool = poisoned_storage(layout, 40), shuffled_pool(40, 16, seed=11)
    blocks = pool.allocate(13, "request:1")
    config = TransferConfig(default_grant_blocks=2, round_cap_blocks=2, window=2, ucx_sender_writes=False)
    with device_bundles_on_cpu():
        async with endpoint_pair("ucx", source, storage, pool, config=config) as pair:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, pair.sender, "kv", source)
                await pair.receiver.receive("kv", peer=pair.link, blocks=blocks, expected_tokens=200)
            assert_same_bytes(as_bytes(storage.gather(blocks, 0, 200)), source.expected())
            pool.free(blocks, "request:1")

            async def stalled_sender() -> None:
                async with pair.sender.open_send("aborted") as session:
                    session.announce_total(200)
                    await trio.sleep_forever()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stalled_sender)
                with trio.move_on_after(0.3):
                    await pair.receiver.receive("aborted", peer=pair.link, consume=Collector())
                await settle()
                nursery.cancel_scope.cancel()
            await settle()
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)

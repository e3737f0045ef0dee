"""Pools on a GPU: every transport moves them, and the protocol's fences hold — inproc device
to device, tcp and ucx through pinned host chunks (ucx packs on the device instead when its `UCX_TLS`
has CUDA transports: `.ci/gpu` runs the ucx cases a second time so), cuda-ipc by device copies into the
receiver's pool mapped through CUDA IPC.

Needs a CUDA device (the `cuda` fixture skips without one, as in CI); `.ci/gpu` runs them, the ucx
cases with `UCX_TLS=all` too (device bundles and the two-process cases).
"""

from __future__ import annotations

import importlib.util
import math
import random
import signal
from typing import Any

import pytest
import torch
import trio

from messages.transfer import FailureReason, Grant
from tests.transport.harness import (
    Collector,
    Source,
    as_bytes,
    assert_same_bytes,
    check_kv_in_borrowed_blocks_and_an_aborted_round,
    embedding_layout,
    endpoint_pair,
    on_device,
    random_storage,
    send_all,
    sender_process,
    settle,
    shuffled_pool,
)
from tests.transport.protocol.test_transfer import SEED_SCENARIOS
from tests.waiting import wait_until
from transport.bulk import gpu_copy
from transport.bulk.runs import group_index, launch_copy_runs, plan_runs
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, open_endpoint
from transport.errors import LinkBroken, TransferFailed

pytestmark = pytest.mark.gpu
KINDS = ["inproc", "tcp", "ucx", "cuda-ipc"]


@pytest.fixture
def kind(request: pytest.FixtureRequest, cuda: object) -> str:
    name: str = request.param
    if name == "ucx":
        request.getfixturevalue("ucx_env")
    return name


@pytest.mark.parametrize("kind", KINDS, indirect=True)
@pytest.mark.parametrize(("total", "cap", "rounds"), SEED_SCENARIOS)
async def test_seed_scenarios_with_gpu_pools(kind: str, total: int, cap: int | None, rounds: int) -> None:
    layout = embedding_layout()
    source = Source(layout, total, seed=total, device="cuda")
    storage, pool = on_device(random_storage(layout, 100, seed=1), "cuda"), shuffled_pool(100, 128, seed=2)
    config = TransferConfig(default_grant_blocks=8, round_cap_blocks=cap)
    collector = Collector()
    async with (
        endpoint_pair(kind, source, storage, pool, config=config) as pair,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(send_all, pair.sender, "t", source)
        result = await pair.receiver.receive("t", peer=pair.link, consume=collector)
    assert (result.report.rounds, result.report.grants) == (rounds, rounds)
    assert_same_bytes(collector.data(), source.expected())
    assert pool.used_blocks == 0


@pytest.mark.parametrize("kind", KINDS, indirect=True)
async def test_gpu_kv_lands_in_a_borrowed_allocation_and_an_aborted_round_is_fenced(kind: str) -> None:
    await check_kv_in_borrowed_blocks_and_an_aborted_round(kind, device="cuda")


def test_a_device_copy_follows_the_work_before_it_and_waits_for_none_after(cuda: torch.device) -> None:
    """`launch_copy_runs` between GPU pools: the copy follows what was queued on the current stream before
    it (a long GPU sleep, then the kernel rewriting the source rows), and its event waits for nothing
    queued after it (a longer sleep): a stream `synchronize` used to hold the calling thread — a node's
    event loop — until the model steps queued meanwhile were done."""
    layout = embedding_layout()
    source = Source(layout, 300, seed=5, device="cuda")
    target = on_device(random_storage(layout, 8, seed=6), "cuda")
    runs = plan_runs(source.ids, 0, [5, 1, 7], 0, 300, layout.block_size)
    launch_copy_runs(source.storage, target, runs, list(target.tensors))  # the kernel built, as endpoints do
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second
    for tensor in source.storage.tensors.values():
        tensor.view(torch.uint8).bitwise_not_()
    copied, done = launch_copy_runs(source.storage, target, runs, list(target.tensors))
    assert done is not None
    torch.cuda._sleep(2_000_000_000)
    later = torch.cuda.Event()
    later.record()
    done.synchronize()
    assert not later.query()
    assert copied == 300 * layout.bytes_per_token
    assert_same_bytes(as_bytes(target.gather([5, 1, 7], 0, 300)), source.expected())


async def test_an_inproc_gpu_round_lands_what_was_queued_before_it(cuda: torch.device) -> None:
    """Over inproc, the bytes that land are the source rows as the work queued before the write left
    them (the copy runs on another stream, after that work), in small rounds (awaited in the event loop)
    and in rounds large enough for the copy lane's thread."""
    for cap, hidden in ((1, 8), (None, 4096)):  # 8 KiB rounds; one round of 48 MiB
        layout = embedding_layout(hidden=hidden)
        source = Source(layout, 3000, seed=hidden, device="cuda")
        storage, pool = on_device(random_storage(layout, 40, seed=6), "cuda"), shuffled_pool(40, 128, seed=7)
        config = TransferConfig(default_grant_blocks=30, round_cap_blocks=cap)
        collector = Collector()
        async with endpoint_pair("inproc", source, storage, pool, config=config) as pair:
            torch.cuda._sleep(100_000_000)
            for tensor in source.storage.tensors.values():
                tensor.view(torch.uint8).bitwise_not_()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, pair.sender, "t", source)
                await pair.receiver.receive("t", peer=pair.link, consume=collector)
        assert_same_bytes(collector.data(), source.expected())
        assert pool.used_blocks == 0


@pytest.mark.slow  # a child process importing torch and initialising CUDA
@pytest.mark.parametrize("kind", ["cuda-ipc", "ucx"], indirect=True)
async def test_gpu_pools_between_two_processes_and_a_killed_sender(kind: str) -> None:
    """GPU pool to GPU pool across processes (the child inherits `UCX_TLS`: with CUDA transports in it,
    ucx moves device bundles, `transport.bulk.device_bundles`), then a sender killed mid-transfer."""
    layout = embedding_layout(block_size=128, hidden=8)
    seeds = {"t2000": 2000, "t10000-cap8": 10_000, "doomed": 10_000}
    lively: dict[str, Any] = {"heartbeat_interval": 0.2, "link_timeout": 1.0}
    params = {
        "block_size": 128,
        "hidden": 8,
        "seed": 41,
        "transfers": seeds,
        "transport": kind,
        "device": "cuda",
        "faults": {"transfer_id": "doomed", "stall_before_round": 2},
        "config": lively,
    }
    source = Source(layout, max(seeds.values()), seed=41)  # the child's bytes, rebuilt here on the CPU
    async with sender_process(params) as child:
        for transfer_id, rounds in (("t2000", 2), ("t10000-cap8", 10)):
            cap = 8 if "cap8" in transfer_id else None
            config = TransferConfig(default_grant_blocks=8, round_cap_blocks=cap)
            storage, pool = on_device(random_storage(layout, 100, 42), "cuda"), shuffled_pool(100, 128, 43)
            async with open_endpoint(f"receiver-{transfer_id}", storage, pool, config=config) as receiver:
                collector = Collector()
                link = await receiver.connect(child.address)
                result = await receiver.receive(transfer_id, peer=link, consume=collector)
            assert result.report.rounds == rounds
            landed = {name: tensor.cpu() for name, tensor in collector.data().items()}
            assert_same_bytes(landed, source.expected(tokens=seeds[transfer_id]))
            assert await child.line() == {"sent": transfer_id, "rounds": rounds}
        config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=3, **lively)
        storage, pool = on_device(random_storage(layout, 16, 45), "cuda"), shuffled_pool(16, 128, 46)
        async with open_endpoint("receiver", storage, pool, config=config) as receiver:
            link = await receiver.connect(child.address)
            collector = Collector()

            async def kill_when_stalled() -> None:
                await collector.wait_rounds(2)
                child.process.send_signal(signal.SIGKILL)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_when_stalled)
                with pytest.raises(TransferFailed) as raised:
                    await receiver.receive("doomed", peer=link, consume=collector)
            assert raised.value.reason is FailureReason.LINK_LOST
            await settle()
        assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)


@pytest.mark.parametrize(
    ("width", "dtype", "in_step"),
    [
        (4096, torch.float32, True),
        (3, torch.bfloat16, True),
        (3, torch.bfloat16, False),
        (5, torch.uint8, False),
    ],
    ids=["2MiB-blocks-int64", "bf16-blocks-int64", "bf16-rows-int16", "odd-rows-uint8"],
)
def test_the_one_pass_gpu_copy_moves_exactly_the_runs_bytes(
    cuda: torch.device, width: int, dtype: torch.dtype, in_step: bool
) -> None:
    """`GroupIndex.copy` on one GPU: one Triton kernel (where torch brought Triton) through integer views
    of 8, 2 or 1 bytes, landing what a copy per run would, byte for byte (random bfloat16 bits include
    NaN payloads), and nothing else."""
    if importlib.util.find_spec("triton") is not None:
        assert gpu_copy.prepare(cuda) is not None, "Triton is installed but the one-pass kernel is not used"
    block_size, rng = 128 if width == 4096 else 16, random.Random(width)
    src_ids, dst_ids = rng.sample(range(40), 24), rng.sample(range(40), 24)
    dst_offset = 0 if in_step else 5
    runs = plan_runs(src_ids, 0, dst_ids, dst_offset, 24 * block_size - dst_offset, block_size)
    source = torch.randint(0, 256, (40 * block_size, width * dtype.itemsize), dtype=torch.uint8, device=cuda)
    source = source.view(dtype)
    target = torch.zeros_like(source)
    index = group_index(runs, (source.shape[0], target.shape[0]), (cuda, cuda))
    index.copy(source, target)
    expected = torch.zeros_like(target)
    for run in runs:
        expected[run.dst_row : run.dst_row + run.rows] = source[run.src_row : run.src_row + run.rows]
    assert torch.equal(target.view(torch.uint8), expected.view(torch.uint8))
    assert (index.group % block_size == 0) == in_step


async def test_a_cuda_ipc_link_the_receiver_closes_keeps_its_blocks_until_the_senders_copy_ran(
    cuda: torch.device,
) -> None:
    """The sender's copy waits behind a gate on its current stream when the receiver closes the link:
    the round's blocks stay quarantined until that copy has run — the sender ends the connection only
    then (`transport.links.cuda_ipc.socket_fence`) — and come back after. The gate is queued as the
    sender's owner hands it the grant, so the copy is launched behind it, and it opens only after the
    test saw the blocks quarantined: the copy cannot have run before (`tests/transport/gpu_gate.py`)."""
    from tests.transport.gpu_gate import GpuGate

    layout = embedding_layout(hidden=1024)
    source = Source(layout, 2048, seed=3, device="cuda")
    storage, pool = on_device(random_storage(layout, 40, seed=4), "cuda"), shuffled_pool(40, 128, seed=5)
    control_send, control = trio.open_memory_channel[SenderDelivery](math.inf)
    gate = GpuGate(cuda)
    behind = torch.cuda.Event()
    async with endpoint_pair("cuda-ipc", source, storage, pool, sender_control=control_send) as pair:

        async def owner() -> None:
            async for delivery in control:
                if isinstance(delivery.message, Grant):
                    gate.close_on(torch.cuda.current_stream(cuda))
                    behind.record()
                pair.sender.deliver(delivery)
                if isinstance(delivery.message, Grant):
                    await trio.sleep(0.1)  # the sender launches its copy, then waits for it
                    pair.link.close(LinkBroken("closed by the test's receiver"))

        async def sender() -> None:
            with pytest.raises(TransferFailed):
                await send_all(pair.sender, "t", source)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            nursery.start_soon(sender)
            with pytest.raises(TransferFailed) as raised:
                await pair.receiver.receive("t", peer=pair.link, consume=Collector())
            assert raised.value.reason is FailureReason.LINK_LOST
            await trio.sleep(0.2)  # the fence would have released the blocks by now had the copy run
            assert not behind.query() and pool.quarantined_blocks > 0
            gate.open()
            await wait_until(lambda: not pool.quarantined_blocks, "the fenced blocks leaving quarantine", 30)
            assert behind.query()  # released only after the copy that waited behind the gate
            assert gate.spins() < 1 << 26  # opened by the test, not ended by its safety cap
            nursery.cancel_scope.cancel()
    assert pool.used_blocks == 0

"""The parts of the cuda-ipc transport that run without a GPU: its setup exchange over a real socket
(refusals name their reason; garbage is dropped), the device copy's row arithmetic on CPU tensors, and
the receiver's precondition. The transfers themselves are in `test_gpu_pools.py` (they need a GPU)."""

from __future__ import annotations

import os
import random

import pytest
import structlog.testing
import torch

from messages.cuda_ipc import PoolShare, SharedBuffer
from tests.transport.harness import Source, embedding_layout, random_storage, settle, shuffled_pool
from tests.waiting import deadline, wait_until
from transport.auth.credentials import LinkAdmission
from transport.bulk.runs import plan_runs
from transport.config import TransferConfig
from transport.endpoint import open_endpoint
from transport.links.cuda_ipc.share import (
    FEW_RUNS,
    RowIndices,
    ShareRefused,
    copy_rows,
    decode_verdict,
    host_id,
    open_share,
    receive_setup,
    send_setup,
)
from transport.links.tcp import admission as tcp_admission
from transport.links.tcp import link as tcp

LAYOUT = embedding_layout(block_size=16)


@pytest.mark.parametrize("blocks", [1, 10])  # a copy_ per run; one gather and one scatter
def test_copy_rows_moves_exactly_the_runs_byte_for_byte(blocks: int) -> None:
    rng = random.Random(3)
    # Random bfloat16 bits: NaN payloads included, which a copy through float would change.
    source = torch.randint(-(2**15), 2**15, (64 * 16, 8), dtype=torch.int16).view(torch.bfloat16)
    target = torch.zeros(64 * 16, 8, dtype=torch.bfloat16)
    src_ids, dst_ids = rng.sample(range(64), blocks), rng.sample(range(64), blocks)
    runs = plan_runs(src_ids, 5, dst_ids, 11, 16 * blocks - 11, 16)
    assert (len(runs) <= FEW_RUNS) == (blocks == 1)
    copy_rows(source, target, RowIndices(lambda: runs))
    expected = torch.zeros_like(target)
    for run in runs:
        expected[run.dst_row : run.dst_row + run.rows] = source[run.src_row : run.src_row + run.rows]
    assert torch.equal(target.view(torch.int16), expected.view(torch.int16))


def test_copy_rows_by_whole_block_ids_moves_what_the_runs_name() -> None:
    """A round of whole blocks indexes its groups by the block ids (`BulkWrite.whole_blocks`), not by
    its runs: the same rows land, and nothing else."""
    rng = random.Random(4)
    source = torch.randint(-(2**15), 2**15, (64 * 16, 8), dtype=torch.int16).view(torch.bfloat16)
    target = torch.zeros(64 * 16, 8, dtype=torch.bfloat16)
    src_ids, dst_ids = rng.sample(range(64), 12), rng.sample(range(64), 12)
    runs = plan_runs(src_ids, 0, dst_ids, 0, 16 * 12, 16)
    copy_rows(source, target, RowIndices(lambda: runs, (src_ids, dst_ids), 16))
    expected = torch.zeros_like(target)
    for run in runs:
        expected[run.dst_row : run.dst_row + run.rows] = source[run.src_row : run.src_row + run.rows]
    assert torch.equal(target.view(torch.int16), expected.view(torch.int16))


def share(host: str) -> PoolShare:
    buffer = SharedBuffer(
        name="embeds",
        dtype="float32",
        shape=(4, 16, 8),
        stride=(128, 8, 1),
        offset=0,
        device=0,
        handle=b"\x00" * 64,
        storage_bytes=2048,
        storage_offset=0,
        ref_counter_handle=b"",
        ref_counter_offset=0,
        event_handle=None,
        event_sync_required=False,
    )
    return PoolShare(host=host, pid=os.getpid() + 1, buffers=(buffer,))


@pytest.mark.parametrize(
    ("host", "refusal"),
    [
        (
            "elsewhere/boot",
            f"cuda-ipc needs one host: the receiver is on elsewhere/boot, the sender on {host_id()}",
        ),
        (host_id(), "cuda-ipc needs the sender's pool on a GPU; it is on cpu"),
    ],
    ids=["other-host", "sender-on-cpu"],
)
async def test_a_share_the_sender_cannot_map_is_refused_naming_why(host: str, refusal: str) -> None:
    source = Source(LAYOUT, 16, seed=1)
    with pytest.raises(ShareRefused, match=f"^{refusal}$"):
        open_share(share(host), source.storage)
    async with open_endpoint("sender", source.storage, source.pool) as sender:
        address = await sender.listen_on("cuda-ipc")
        host_name, _, port = address.removeprefix("cuda-ipc://").rpartition(":")
        sock = await tcp.connect(host_name, int(port))
        with sock:
            await send_setup(sock, share(host))
            with deadline("the sender's verdict on the share", 5):
                verdict = decode_verdict(await receive_setup(sock))
        assert verdict.refusal == refusal
        await settle()
        assert sender.links() == []


async def test_garbage_instead_of_a_share_is_dropped_with_a_log_line() -> None:
    source = Source(LAYOUT, 16, seed=2)
    with structlog.testing.capture_logs() as logs:
        async with open_endpoint("sender", source.storage, source.pool) as sender:
            address = await sender.listen_on("cuda-ipc")
            host_name, _, port = address.removeprefix("cuda-ipc://").rpartition(":")
            sock = await tcp.connect(host_name, int(port))
            with sock:
                sock.sendall(b"\x05\x00\x00\x00hello")
                await wait_until(
                    lambda: any(e["event"] == "transfer.cuda_ipc_setup_failed" for e in logs),
                    "a transfer.cuda_ipc_setup_failed log line",
                    5,
                )
            assert sender.links() == []


async def test_a_receiver_pool_on_the_cpu_cannot_dial_cuda_ipc() -> None:
    storage, pool = random_storage(LAYOUT, 4, seed=3), shuffled_pool(4, 16, seed=4)
    async with open_endpoint("receiver", storage, pool) as receiver:
        with pytest.raises(
            ValueError, match=r"^endpoint 'receiver': cuda-ipc needs its pool on a GPU, not cpu$"
        ):
            await receiver.connect("cuda-ipc://127.0.0.1:9")


async def test_with_the_cluster_secret_only_a_receiver_that_proves_it_gets_a_verdict() -> None:
    """The control connection is admitted as a tcp link's is: a share sent without the secret's exchange
    is refused before it is read (logged); after it, the share gets its verdict."""
    admission = LinkAdmission("pre", b"cuda-ipc-secret-0123456789")
    config = TransferConfig(admission=admission)
    source = Source(LAYOUT, 16, seed=5)
    with structlog.testing.capture_logs() as logs:
        async with open_endpoint("sender", source.storage, source.pool, config=config) as sender:
            address = await sender.listen_on("cuda-ipc")
            host_name, _, port = address.removeprefix("cuda-ipc://").rpartition(":")
            with await tcp.connect(host_name, int(port)) as sock:
                await send_setup(sock, share(host_id()))
                await wait_until(
                    lambda: any(e["event"] == "transfer.link_refused" for e in logs), "the refusal", 5
                )
            with await tcp.connect(host_name, int(port)) as sock:
                await tcp_admission.admit(sock, LinkAdmission("dec", admission.secret), address)
                await send_setup(sock, share(host_id()))
                with deadline("the sender's verdict on the share", 5):
                    verdict = decode_verdict(await receive_setup(sock))
            assert verdict.refusal == "cuda-ipc needs the sender's pool on a GPU; it is on cpu"
            assert sender.links() == []

"""Scattered receives and length-checked ones (`transport.links.ucx.scatter`) on a real UCX worker:
where the bytes land, the errors UCX reports, cancellation, and the fence for a sender process that dies
before writing. Over `UCX_TLS=sm,tcp` on CPU (the `ucx_env` fixture); real time, as the UCX progress task
waits on a file descriptor."""

from __future__ import annotations

import array
import os
import subprocess
import sys
from collections import deque
from typing import Any

import numpy as np
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import transport.links.ucx.worker
from tests.transport.harness import embedding_layout, two_workers
from tests.waiting import deadline, wait_until, wait_until_blocking
from transport.links.ucx.frames import Descriptor
from transport.links.ucx.landing import VECTORISED_STRETCHES, Landing, direct, settle, stretch_entries
from transport.links.ucx.library import UcxFailed
from transport.links.ucx.peer_process import host_key, local_pid, process_gone
from transport.links.ucx.scatter import ContiguousReceive, ContiguousSend, UcpFailed, io_vector
from transport.links.ucx.worker import UcxWorker
from transport.memory.storage import PoolStorage

pytestmark = pytest.mark.usefixtures("ucx_env")
TAG = (5 << 8) | 2


def address_of(memory: np.ndarray, at: int) -> int:
    return int(memory.ctypes.data) + at


def all_of(memory: np.ndarray) -> array.array[int]:
    """An I/O vector of one segment: the whole of `memory`."""
    return io_vector([(address_of(memory, 0), memory.nbytes)])


async def test_a_scattered_receive_lands_each_piece_where_its_segment_points() -> None:
    message = bytes(range(256)) * 8  # 2048 bytes: pieces of 700, 48, 1000 and 300
    memory = np.zeros(4096, dtype=np.uint8)
    segments = [(address_of(memory, 3000), 700), (address_of(memory, 10), 48)]
    segments += [(address_of(memory, 1024), 1000), (address_of(memory, 3750), 300)]
    with deadline("the scattered receive landing", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            request = receiver.receive_scattered(to_sender, TAG, io_vector(segments), memory)
            await sender.wait([sender.send(to_receiver, TAG, message)])
            await receiver.wait([request])
    assert bytes(memory[3000:3700]) == message[:700]
    assert bytes(memory[10:58]) == message[700:748]
    assert bytes(memory[1024:2024]) == message[748:1748]
    assert bytes(memory[3750:4050]) == message[1748:]
    untouched = np.ones(4096, dtype=bool)
    for start, end in ((3000, 3700), (10, 58), (1024, 2024), (3750, 4050)):
        untouched[start:end] = False
    assert not memory[untouched].any()


async def test_a_gathered_send_sends_its_segments_back_to_back_as_one_message() -> None:
    source = np.frombuffer(bytes(range(256)) * 16, dtype=np.uint8).copy()
    segments = [(address_of(source, 4000), 96), (address_of(source, 7), 1000), (address_of(source, 2048), 1)]
    landed = bytearray(1097)
    with deadline("the gathered send landing", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            request = receiver.receive(to_sender, TAG, landed)
            await sender.wait([sender.send_gathered(to_receiver, TAG, io_vector(segments), source)])
            await receiver.wait([request])
    assert bytes(landed) == bytes(source[4000:4096]) + bytes(source[7:1007]) + bytes(source[2048:2049])


async def test_a_message_longer_than_its_segments_fails_the_receive_as_truncated() -> None:
    memory = np.zeros(64, dtype=np.uint8)
    with deadline("the truncated receive failing", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            request = receiver.receive_scattered(to_sender, TAG, all_of(memory), memory)
            await sender.wait([sender.send(to_receiver, TAG, bytes(100))])
            with pytest.raises(UcxFailed, match=r"^UcpFailed: Message truncated \(-9\)$"):
                await receiver.wait([request])


async def test_a_message_shorter_than_its_segments_fails_the_receive_instead_of_leaving_stale_rows() -> None:
    memory = np.full(64, 7, dtype=np.uint8)
    with deadline("the short message failing its receive", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            vector = io_vector([(address_of(memory, 0), 32), (address_of(memory, 40), 24)])
            request = receiver.receive_scattered(to_sender, TAG, vector, memory)
            await sender.wait([sender.send(to_receiver, TAG, bytes(50))])
            with pytest.raises(UcxFailed, match=r"^UcpFailed: a message of 50 bytes for a receive of 56$"):
                await receiver.wait([request])


@settings(max_examples=25, deadline=None)
@given(size=st.integers(1, 1 << 20), sent=st.integers(0, 1 << 20), seed=st.integers(0, 2**32 - 1))
async def test_a_receive_into_host_memory_completes_only_for_a_message_of_its_exact_length(
    size: int, sent: int, seed: int
) -> None:
    landed, message = bytearray(size), np.random.default_rng(seed).bytes(sent)
    with deadline("the receives into host memory ending", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            request = receiver.receive(to_sender, TAG, landed)
            await sender.wait([sender.send(to_receiver, TAG, message)], check=False)
            if sent == size:
                await receiver.wait([request])
            else:
                expected = (
                    rf"a message of {sent} bytes for a receive of {size}"
                    if sent < size
                    else r"Message truncated \(-9\)"
                )
                with pytest.raises(UcxFailed, match=rf"^UcpFailed: {expected}$"):
                    await receiver.wait([request])
    if sent == size:
        assert bytes(landed) == message


@pytest.mark.gpu
async def test_a_length_checked_ucx_receive_into_gpu_memory_lands_an_exact_message_and_fails_a_short_one(
    cuda: torch.device,
) -> None:
    """The UCP call `UcxWorker.receive` makes for host memory, into GPU memory through UCX's CUDA
    transports (`.ci/gpu` runs this with `UCX_TLS=all`). The worker still receives into GPU memory
    through ucxx, unchecked, until this has passed on a GPU (docs/transports.md, *Known limits*)."""
    size = 1 << 20
    landed = torch.zeros(size, dtype=torch.uint8, device=cuda)
    message = torch.randint(0, 256, (size,), dtype=torch.uint8, device=cuda)
    with deadline("the receives into GPU memory ending", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            if not receiver.cuda_capable:
                pytest.skip("this UCX_TLS gives UCX no CUDA transport")

            def checked() -> Any:
                posted: list[Any] = []
                receiver.receive_host(to_sender, TAG, [(landed.data_ptr(), size)], landed, posted)
                return posted[0]

            request = checked()
            await sender.wait([sender.send(to_receiver, TAG, message)])
            await receiver.wait([request])
            assert torch.equal(landed, message)
            short = checked()
            await sender.wait([sender.send(to_receiver, TAG, message[:-1])], check=False)
            with pytest.raises(
                UcxFailed, match=rf"^UcpFailed: a message of {size - 1} bytes for a receive of {size}$"
            ):
                await receiver.wait([short])


async def test_disconnecting_cancels_a_pending_receive_into_host_memory() -> None:
    with deadline("the pending receive cancelled by the disconnect", 10):
        async with two_workers() as (_sender, _to_receiver, receiver, to_sender):
            request = receiver.receive(to_sender, TAG, bytearray(64))
            receiver.disconnect(to_sender)
            with pytest.raises(UcxFailed, match=r"^UcpFailed: Request canceled \(-16\)$"):
                await receiver.wait([request])
            with pytest.raises(UcxFailed, match=r"^the UCX endpoint is closed \(worker 'receiver'\)$"):
                receiver.receive(to_sender, TAG, bytearray(64))


@pytest.mark.parametrize("size", [64, 1 << 20])  # an eager message, done inside the call; a rendezvous
async def test_a_send_from_host_rows_goes_straight_through_ucp_and_no_send_follows_a_disconnect(
    size: int,
) -> None:
    rows = torch.arange(size, dtype=torch.uint8).view(-1, 16)
    landed = bytearray(size)
    with deadline("the send from host rows landing", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            request = receiver.receive(to_sender, TAG, landed)
            sent = sender.send(to_receiver, TAG, rows.numpy().data.cast("B"))
            assert isinstance(sent, ContiguousSend)
            await sender.wait([sent])
            await receiver.wait([request])
            sender.disconnect(to_receiver)
            with pytest.raises(UcxFailed, match=r"^the UCX endpoint is closed \(worker 'sender'\)$"):
                sender.send(to_receiver, TAG, b"late")
    assert bytes(landed) == rows.numpy().tobytes()


async def test_a_direct_frame_whose_second_receive_fails_to_post_leaves_the_first_where_quiesce_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = embedding_layout(block_size=16)
    storage = PoolStorage(layout, 4)
    frame = Descriptor(packed=False, buffer=0, round=0, landing_key=1, length=0, segments=[(0, 16), (32, 16)])
    landings: deque[Landing] = deque()
    with deadline("the failed direct frame's receive settling", 10):
        async with two_workers() as (_sender, _to_receiver, receiver, to_sender):

            def first_then_fail(worker: Any, on: int, address: int, length: int, keep: object) -> Any:
                if landings[0].requests:  # what UCP's error pointer on the second post raises
                    raise UcpFailed("receive not posted: No memory (-4)")
                return ContiguousReceive(worker, on, address, length, keep)

            monkeypatch.setattr(transport.links.ucx.worker, "ContiguousReceive", first_then_fail)
            with pytest.raises(UcxFailed, match=r"^receive not posted: No memory \(-4\)$"):
                direct(receiver, to_sender, TAG, storage, frame, "embeds", landings)
            assert [len(landing.requests) for landing in landings] == [1]
            (posted,) = landings[0].requests
            assert not posted.completed  # UCX may still write into row 0: the link's fence must wait
            receiver.disconnect(to_sender)
            assert await settle(receiver, landings, lambda: False) is True
            assert posted.completed


async def test_disconnecting_cancels_a_pending_scattered_receive_and_no_more_can_be_posted() -> None:
    memory = np.zeros(64, dtype=np.uint8)
    with deadline("the pending scattered receive cancelled by the disconnect", 10):
        async with two_workers() as (_sender, _to_receiver, receiver, to_sender):
            request = receiver.receive_scattered(to_sender, TAG, all_of(memory), memory)
            receiver.disconnect(to_sender)
            with pytest.raises(UcxFailed, match=r"^UcpFailed: Request canceled \(-16\)$"):
                await receiver.wait([request])
            with pytest.raises(UcxFailed, match=r"^the UCX endpoint is closed \(worker 'receiver'\)$"):
                receiver.receive_scattered(to_sender, TAG, all_of(memory), memory)


# Posts a 1 MiB send to the worker at argv[1] on tag argv[2], progresses 0.3 s (its rendezvous request
# reaches the receiver), prints its own address, then never progresses again: it owes a write it never
# makes.
SILENT_SENDER = """
import sys, time
import ucxx._lib.libucxx as lib
from ucxx._lib.arr import Array
worker = lib.UCXWorker(lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP)))
address = lib.UCXAddress.create_from_buffer(bytes.fromhex(sys.argv[1]))
endpoint = lib.UCXEndpoint.create_from_worker_address(worker, address, False)
request = endpoint.tag_send(Array(bytearray(1 << 20)), lib.UCXXTag(int(sys.argv[2])))
end = time.monotonic() + 0.3
while time.monotonic() < end:
    worker.progress()
print(worker.address.tobytes().hex(), flush=True)
sys.stdin.read()
"""


async def test_a_matched_receive_holds_its_fence_until_its_writer_process_is_gone(
    ucx_env: dict[str, str],
) -> None:
    """A receive UCX has matched cannot be cancelled, and only its sender writes it: `settle` waits while
    that process lives, and returns False once it has died."""
    memory = np.zeros(1 << 20, dtype=np.uint8)
    async with trio.open_nursery() as nursery:
        worker = UcxWorker("receiver")
        await nursery.start(worker.run)
        child = subprocess.Popen(
            [sys.executable, "-c", SILENT_SENDER, worker.address.hex(), str(TAG)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**ucx_env, "UCX_LOG_FILE": "stderr", "UCX_WARN_UNUSED_ENV_VARS": "n"},  # stdout: the address
        )
        try:
            assert child.stdout is not None
            with deadline("the silent sender's worker address", 60):
                # Abandoned at the deadline: the `finally` kills the child, which ends the read.
                line = await trio.to_thread.run_sync(child.stdout.readline, abandon_on_cancel=True)
            endpoint = worker.connect(bytes.fromhex(line.decode()))
            lib = worker._lib
            await wait_until(
                lambda: worker._worker.tag_probe(lib.UCXXTag(TAG), lib.UCXXTagMaskFull, False).matched,
                "the silent sender's rendezvous request waiting, unexpected, in this worker",
            )
            request = worker.receive_scattered(endpoint, TAG, all_of(memory), memory)
            request.cancel()  # matched at once: cancelling does nothing
            landing = Landing([request])
            with trio.move_on_after(0.5) as waited:
                await settle(worker, [landing], lambda: process_gone(child.pid))
            assert waited.cancelled_caught and not request.completed
            child.kill()
            with deadline("settle returning once the writer process is gone", 10):
                assert await settle(worker, [landing], lambda: process_gone(child.pid)) is False
            assert not request.completed and not memory.any()
        finally:
            child.kill()
            child.wait()
            nursery.cancel_scope.cancel()


async def test_a_landing_whose_receives_complete_settles_true_without_asking_about_the_writer() -> None:
    memory = np.zeros(16, dtype=np.uint8)
    asked: list[bool] = []

    def writer_gone() -> bool:
        asked.append(True)
        return True

    with deadline("the completed landing settling", 10):
        async with two_workers() as (sender, to_receiver, receiver, to_sender):
            request = receiver.receive_scattered(to_sender, TAG, all_of(memory), memory)
            await sender.wait([sender.send(to_receiver, TAG, bytes(range(16)))])
            assert await settle(receiver, [Landing([request])], writer_gone) is True
    assert asked == [] and bytes(memory) == bytes(range(16))


def test_a_pid_counts_only_with_this_hosts_key_and_a_dead_child_is_gone() -> None:
    assert host_key()  # Linux with /proc: boot id and pid namespace
    assert local_pid(os.getpid(), host_key()) == os.getpid()
    assert local_pid(os.getpid(), b"another-host/pid:[1]") is None
    assert local_pid(os.getpid(), b"") is None
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Exited but not yet reaped is a zombie: gone already.
    wait_until_blocking(
        lambda: child.poll() is not None or process_gone(child.pid),
        "the child process exiting",
        interval=0.001,
    )
    assert process_gone(child.pid)
    child.wait()
    assert process_gone(child.pid)


@pytest.mark.parametrize("count", [0, 1, VECTORISED_STRETCHES - 1, VECTORISED_STRETCHES, 300])
@given(base=st.integers(0, 2**47), width=st.integers(1, 1 << 16), data=st.data())
def test_stretch_entries_scale_every_stretch_alike_on_both_sides_of_the_vectorised_size(
    count: int, base: int, width: int, data: st.DataObject
) -> None:
    stretch = st.tuples(st.integers(0, 1 << 20), st.integers(1, 1 << 10))
    stretches = data.draw(st.lists(stretch, min_size=count, max_size=count))
    expected = [value for row, rows in stretches for value in (base + row * width, rows * width)]
    assert stretch_entries(base, width, stretches).tolist() == expected

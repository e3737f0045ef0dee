"""`transport.links.cuda_ipc.socket_fence` on real TCP connections: a closed link's connection ends only when the
sender's fence is released, the receiver's stop is read as the end of the stream, and a reset or data
still arriving counts as what it is; and a cuda-ipc link's receiving end (which needs no GPU) quiesces
only once the sender has ended the connection, also when its task was cancelled first."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio

from tests.transport.harness import embedding_layout, random_storage, shuffled_pool
from tests.waiting import deadline
from transport.endpoint import open_endpoint
from transport.errors import LinkClosed
from transport.links.cuda_ipc.link import CudaIpcLink
from transport.links.cuda_ipc.socket_fence import SocketFence


@contextmanager
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on loopback: (sender's end, receiver's end), non-blocking."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _address = listener.accept()
    for end in (sender, receiver):
        end.setblocking(False)
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()


async def test_a_closed_link_ends_its_connection_only_when_the_sender_releases_the_fence() -> None:
    with connection() as (sender, receiver):
        sender_fence, receiver_fence = SocketFence(sender), SocketFence(receiver)
        sender.close()  # the link's own socket, as a closing link closes it
        with trio.move_on_after(0.2) as waited:
            await receiver_fence.peer_released()
        assert waited.cancelled_caught  # the fence still holds the connection open
        sender_fence.release()  # the copies are done
        with deadline("the receiver's fence seeing the sender's release", 5):
            await receiver_fence.peer_released()
        receiver_fence.release()


async def test_the_receiver_stopping_is_read_by_the_sender_as_the_end_of_the_stream() -> None:
    with connection() as (sender, receiver):
        receiver_fence = SocketFence(receiver)
        receiver.close()
        receiver_fence.stop_writing()
        with deadline("the end of the stream reaching the sender", 5):
            await trio.lowlevel.wait_readable(sender)
        assert sender.recv(16) == b""
        receiver_fence.stop_writing()  # again, and after the peer's end: harmless
        receiver_fence.release()


async def test_what_still_arrives_is_discarded_and_a_reset_counts_as_released() -> None:
    with connection() as (sender, receiver):
        sender_fence, receiver_fence = SocketFence(sender), SocketFence(receiver)
        sender.sendall(b"heartbeat" * 1000)  # arrives while the receiver waits: discarded
        receiver.sendall(b"unread")  # the sender never reads it, so its close resets the connection
        await trio.sleep(0.05)
        sender.close()

        async def release_later() -> None:
            await trio.sleep(0.1)
            sender_fence.release()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_later)
            with deadline("the receiver's fence seeing the sender's release", 5):
                await receiver_fence.peer_released()
        receiver_fence.release()
        receiver_fence.release()  # again: harmless


@pytest.mark.parametrize("released_first", [False, True])
async def test_releasing_closes_only_the_fences_descriptor(released_first: bool) -> None:
    """The link's own socket stays usable until it is closed itself; the connection ends after both."""
    with connection() as (sender, receiver):
        fence = SocketFence(sender)
        if released_first:
            fence.release()
        sender.sendall(b"still open")
        with deadline("bytes over the link's own socket", 5):
            await trio.lowlevel.wait_readable(receiver)
        assert receiver.recv(16) == b"still open"
        sender.close()
        if not released_first:
            fence.release()
        with deadline("the end of the connection once socket and fence are closed", 5):
            await trio.lowlevel.wait_readable(receiver)
        assert receiver.recv(16) == b""


@pytest.mark.parametrize("cancelled_first", [False, True])
async def test_a_cuda_ipc_receiver_quiesces_once_the_sender_ends_the_connection(
    cancelled_first: bool,
) -> None:
    """The receiving end of a cuda-ipc link (on a CPU pool: it makes no GPU call) is closed, or its task
    cancelled as an enclosing scope is: either way it tells the sender (the end of the stream), and its
    `quiesce` — the fence — returns only once the sender has ended the connection, 0.2 s later."""
    layout = embedding_layout(block_size=16)
    storage, pool = random_storage(layout, 4, seed=1), shuffled_pool(4, 16, seed=2)
    with connection() as (sender, receiver):
        async with open_endpoint("receiver", storage, pool) as endpoint:
            link = CudaIpcLink(receiver, endpoint, role="receiver", remote=None)
            ended_at: list[float] = []

            async def sender_ends_after_its_copies() -> None:
                with deadline("the receiver's end of the stream reaching the sender", 5):
                    await trio.lowlevel.wait_readable(sender)
                assert sender.recv(16) == b""  # told: the receiver stopped
                await trio.sleep(0.2)
                ended_at.append(trio.current_time())
                sender.close()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender_ends_after_its_copies)
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as link_tasks:
                        link_tasks.start_soon(link.run)
                        await trio.sleep(0.05)
                        if cancelled_first:
                            scope.cancel()
                        else:
                            link.close(LinkClosed("closed by the test"))
                with deadline("the receiving link's quiesce", 5):
                    await link.quiesce()
                assert ended_at and trio.current_time() >= ended_at[0]

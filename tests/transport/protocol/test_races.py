"""Races at a transfer's edges: a message that arrives as a session or its endpoint ends — a receive
given up just as the total arrives, an abort during the last write, a small send after the endpoint
closed. Each of these once failed the endpoint, the link or the fence (docs/transfer.md)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from messages.transfer import FailureReason, StatusUpdate, TransferStatus
from tests.transport.harness import (
    Collector,
    Source,
    assert_same_bytes,
    embedding_layout,
    endpoint_pair,
    random_storage,
    send_all,
    settle,
    shuffled_pool,
)
from tests.transport.protocol.test_failures import expect_sender_failure, parts
from tests.waiting import deadline, wait_until
from transport.config import TransferConfig
from transport.errors import TransferError


@pytest.mark.usefixtures("ucx_env")
async def test_a_receive_cancelled_as_the_total_arrives_leaves_the_endpoint_serving() -> None:
    """The receive's owner gives up just as the sender's `TotalAnnounce` arrives. The link's reader may
    hand the announcement over while the session's task nursery is closing: it must not start a granter
    there (it did: `RuntimeError: Nursery is closed to new arrivals`, raised in the reader, took the
    endpoint down). The attempts sweep the moment of giving up across the message's flight; the
    endpoints serve on after all of them, and every block comes back."""
    layout = embedding_layout(block_size=16)
    source = Source(layout, 16 * 6, seed=7)
    storage, pool = random_storage(layout, 30, seed=8), shuffled_pool(30, 16, seed=9)
    config = TransferConfig(default_grant_blocks=1, fence_timeout=1.0)
    async with endpoint_pair("ucx", source, storage, pool, config=config) as pair:
        for attempt in range(120):
            announced = trio.Event()

            async def announce_and_wait(transfer_id: str, announced: trio.Event) -> None:
                async with pair.sender.open_send(transfer_id) as session:
                    await wait_until(  # granted: the announcement goes out now
                        lambda: session.link is not None, f"the grant of {transfer_id}", interval=0.0002
                    )
                    session.announce_total(16 * 6)
                    announced.set()
                    await trio.sleep_forever()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(announce_and_wait, f"t{attempt}", announced)
                with trio.CancelScope() as owner:
                    nursery.start_soon(cancel_after, announced, 0.00002 * (attempt % 60), owner)
                    await pair.receiver.receive(f"t{attempt}", peer=pair.link, consume=Collector())
                nursery.cancel_scope.cancel()
        collector = Collector()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, pair.sender, "after", source)
            await pair.receiver.receive("after", peer=pair.link, consume=collector)
        assert_same_bytes(collector.data(), source.expected())
        await settle()
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)


async def cancel_after(event: trio.Event, delay: float, scope: trio.CancelScope) -> None:
    with deadline("the moment the receive's owner gives up after"):
        await event.wait()
    await trio.sleep(delay)
    scope.cancel()


async def test_a_control_message_for_a_closed_endpoint_is_dropped() -> None:
    """A link's reader that was already past its last checkpoint as its endpoint closed may still hand
    a message over, and a session answer it with a small send: the endpoint, closed, drops it (it used
    to start a task in its closed nursery and raise `RuntimeError` in that reader)."""
    source, storage, pool = parts(16, seed=8)
    async with endpoint_pair("inproc", source, storage, pool) as pair:
        receiver, link = pair.receiver, pair.link
    assert link.is_closed
    receiver.send_soon(link, StatusUpdate(transfer_id="late", status=TransferStatus.WAITING_FOR_INPUT))


@pytest.mark.parametrize("kind", ["inproc", "inproc-threads", "tcp", "ucx"])
async def test_an_abort_that_arrives_during_the_last_write_is_acknowledged(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The receiver gives up while the sender writes the transfer's last round. The sender must still
    acknowledge the abort once that write is done (the fence), and end failed with the receiver's reason:
    it returned success and never acknowledged, so the receiver kept the round's blocks quarantined until
    `fence_timeout` and then tore the whole link down."""
    if kind == "ucx":
        request.getfixturevalue("ucx_env")
    source, storage, pool = parts(16 * 4, seed=9, blocks=8)
    config = TransferConfig(default_grant_blocks=8, fence_timeout=30.0)
    async with endpoint_pair(kind, source, storage, pool, config=config) as pair:
        (sender_link,) = pair.sender.links()
        write, writing, written = sender_link.write, trio.Event(), trio.Event()

        async def write_once_aborted(bulk: Any, trailer: Any = None) -> int:
            writing.set()
            await written.wait()  # the write takes until the receiver's Abort has reached the sender
            return await write(bulk, trailer)

        sender_link.write = write_once_aborted  # type: ignore[method-assign]
        failures: dict[str, TransferError] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_sender_failure, pair.sender, "t", source, failures)
            with trio.CancelScope() as owner:
                nursery.start_soon(cancel_after, writing, 0.0, owner)
                await pair.receiver.receive("t", peer=pair.link, consume=Collector())
            await settle()  # the Abort reaches the sender, still in its write
            written.set()
        assert failures["t"].reason is FailureReason.ABORTED
        assert failures["t"].report.detail == "receiver aborted: receiver gave up: cancelled"
        await wait_until(  # well before fence_timeout (30 s)
            lambda: not pool.quarantined_blocks, "the AbortAck releasing the aborted round's blocks", 5
        )
        sender_link.write = write  # type: ignore[method-assign]
        collector = Collector()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, pair.sender, "after", source)
            await pair.receiver.receive("after", peer=pair.link, consume=collector)
        assert not pair.link.is_closed
        assert_same_bytes(collector.data(), source.expected())
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)

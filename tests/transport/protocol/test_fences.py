"""The write fence when the sender never acknowledges an abort (architecture §5.7): the receiver gave up on a
transfer, its `Abort` is never answered, so its blocks wait in quarantine — until the link closes, which
is a fence too. Either the endpoints close (the node stops), or `fence_timeout` passes and the receiver
closes the link itself, naming it in the error the link's other transfers then fail with."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from messages.layout import PoolLayout
from tests.transport.harness import (
    Collector,
    Source,
    embedding_layout,
    endpoint_pair,
    random_storage,
    settle,
    shuffled_pool,
)
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery
from transport.memory.blocks import BlockPool
from transport.protocol.link import Link

LAYOUT: PoolLayout = embedding_layout(block_size=16)


@asynccontextmanager
async def an_unanswered_abort(fence_timeout: float) -> AsyncIterator[tuple[BlockPool, Link, trio.Nursery]]:
    """A receiver that gave up on transfer 't' after two granted rounds, whose `Abort` the sender's
    replica never delivers; yields its pool (two blocks quarantined), its link and a nursery to cancel
    when done."""
    source = Source(LAYOUT, 16 * 4, seed=11)
    storage, pool = random_storage(LAYOUT, 16, 12), shuffled_pool(16, 16, 13)
    control_send, control = trio.open_memory_channel[SenderDelivery](64)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2, fence_timeout=fence_timeout)
    async with (
        trio.open_nursery() as outer,
        endpoint_pair("inproc", source, storage, pool, config=config, sender_control=control_send) as pair,
    ):
        sending, receiving, link = pair.sender, pair.receiver, pair.link

        async def replica() -> None:  # never delivers the Abort: no AbortAck will come
            async for delivery in control:
                if type(delivery.message).__name__ != "Abort":
                    sending.deliver(delivery)

        async def sender() -> None:
            async with sending.open_send("t") as session:
                session.announce_total(source.tokens)
                await trio.sleep_forever()

        outer.start_soon(replica)
        outer.start_soon(sender)
        with trio.move_on_after(0.2):
            await receiving.receive("t", peer=link, consume=Collector())
        await settle()
        assert pool.quarantined_blocks == 2
        yield pool, link, outer


async def test_closing_the_endpoints_is_a_fence_and_returns_quarantined_blocks_at_once() -> None:
    with trio.move_on_after(5) as watchdog:
        async with an_unanswered_abort(fence_timeout=30.0) as (pool, _link, outer):
            outer.cancel_scope.cancel()  # the whole node stops: the links close, which is a fence
    assert not watchdog.cancelled_caught
    assert pool.used_blocks == 0


async def test_a_fence_no_abort_ack_reaches_closes_the_link_naming_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Transfers that started on the link meanwhile fail with its error, so it says which link it was
    (it used to name only the transfer whose `AbortAck` never came)."""
    async with an_unanswered_abort(fence_timeout=1.0) as (pool, link, outer):
        await trio.sleep(2.0)
        assert str(link.error) == (
            f"link {link.describe()}: no AbortAck for 't' within 1.0 s (closed, so its writes stop)"
        )
        assert pool.used_blocks == 0
        outer.cancel_scope.cancel()

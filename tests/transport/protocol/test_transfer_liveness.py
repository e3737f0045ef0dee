"""Keep-alives: a side that holds a transfer up itself says so (`StatusUpdate`), so the peer's progress
deadline does not fail a slow but healthy transfer (inproc, `autojump_clock`)."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from tests.transport.harness import (
    Collector,
    Source,
    as_bytes,
    assert_same_bytes,
    embedding_layout,
    endpoint_pair,
    random_storage,
    send_all,
    settle,
    shuffled_pool,
)
from transport.config import TransferConfig
from transport.protocol.landing import LandedRound

LAYOUT = embedding_layout(block_size=16)
CONFIG = TransferConfig(
    default_grant_blocks=1, round_cap_blocks=1, window=1, progress_timeout=20.0, pressure_timeout=600.0
)


async def test_a_consumer_slower_than_the_deadline_keeps_the_waiting_sender_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = Source(LAYOUT, 16 * 3, seed=31)
    storage, pool = random_storage(LAYOUT, 2, seed=32), shuffled_pool(2, 16, seed=33)
    collector = Collector()

    async def slow_consumer(landed: LandedRound) -> None:
        await trio.sleep(65.0)  # over three progress timeouts, while the sender waits for a grant
        await collector(landed)

    sent: list[float] = []
    async with endpoint_pair("inproc", source, storage, pool, config=CONFIG) as pair:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                async with pair.sender.open_send("slow") as session:
                    report = await session.send(source.ids, total_tokens=source.tokens)
                sent.append(report.seconds)

            nursery.start_soon(send)
            result = await pair.receiver.receive("slow", peer=pair.link, consume=slow_consumer)
        assert trio.current_time() - start >= 3 * 65.0
        await settle()
    assert result.report.rounds == 3
    assert sent and sent[0] >= 65.0  # it waited for a grant over three of its own progress timeouts
    assert_same_bytes(collector.data(), source.expected())
    assert pool.used_blocks == 0


async def test_a_sender_preparing_longer_than_the_deadline_keeps_the_receiver_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = Source(LAYOUT, 16 * 2, seed=34)
    storage, pool = random_storage(LAYOUT, 4, seed=35), shuffled_pool(4, 16, seed=36)
    async with endpoint_pair("inproc", source, storage, pool, config=CONFIG) as pair:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def prepare_then_send() -> None:
                async with pair.sender.open_send("late") as session:
                    await trio.sleep(70.0)  # the owner is still producing the data
                    await session.send(source.ids, total_tokens=source.tokens)

            nursery.start_soon(prepare_then_send)
            result = await pair.receiver.receive("late", peer=pair.link, owner="request")
        assert trio.current_time() - start >= 70.0
        assert_same_bytes(as_bytes(storage.gather(result.blocks, 0, source.tokens)), source.expected())
        pool.free(result.blocks, "request")
        await settle()
    assert pool.used_blocks == 0


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
async def test_links_polling_after_a_transfer_let_a_mock_clock_jump(
    autojump_clock: trio.testing.MockClock, kind: str
) -> None:
    """Readers poll for a moment after their last bytes; that moment is real time, so a Trio clock that
    only moves when every task sleeps still moves (a poll measured on the Trio clock would spin forever)."""
    if kind == "ucx":
        pytest.importorskip("ucxx")
    source = Source(LAYOUT, 16 * 2, seed=37)
    storage, pool = random_storage(LAYOUT, 4, seed=38), shuffled_pool(4, 16, seed=39)
    async with endpoint_pair(kind, source, storage, pool, config=CONFIG) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, pair.sender, "poll", source)
            result = await pair.receiver.receive("poll", peer=pair.link, owner="request")
        pool.free(result.blocks, "request")
        stuck: list[bool] = []
        async with trio.open_nursery() as guard:

            async def real_time_limit() -> None:
                await trio.to_thread.run_sync(time.sleep, 5.0, abandon_on_cancel=True)
                stuck.append(True)
                guard.cancel_scope.cancel()

            guard.start_soon(real_time_limit)
            await trio.sleep(60.0)  # returns at once if the mock clock can jump
            guard.cancel_scope.cancel()
        assert not stuck

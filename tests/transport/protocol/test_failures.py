"""Failures of the transfer: deadlines, aborts both ways, duplicates, refusals, corruption (inproc)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from messages.layout import PoolLayout
from messages.peer_codec import NO_HEADER
from messages.transfer import FailureReason, Grant, RequestMoreCache, TransferStatus
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
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.errors import HandshakeRefused, TransferError, TransferFailed, TransferTimeout
from transport.faults import FaultPlan
from transport.links.inproc.link import InprocNetwork
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage

LAYOUT = embedding_layout(block_size=16)


def parts(total: int, seed: int, blocks: int = 16) -> tuple[Source, PoolStorage, BlockPool]:
    return (
        Source(LAYOUT, total, seed=seed),
        random_storage(LAYOUT, blocks, seed + 1),
        shuffled_pool(blocks, 16, seed + 2),
    )


async def expect_sender_failure(
    sender: TransferEndpoint, transfer_id: str, source: Source, into: dict[str, TransferError]
) -> None:
    try:
        await send_all(sender, transfer_id, source)
    except (TransferFailed, TransferTimeout) as exc:
        into[transfer_id] = exc


@pytest.mark.parametrize("freed_in_time", [False, True], ids=["times-out", "blocks-freed-in-time"])
async def test_memory_pressure_fails_at_the_deadline_not_before(
    autojump_clock: trio.testing.MockClock, freed_in_time: bool
) -> None:
    source, storage, pool = parts(16 * 6, seed=1, blocks=8)
    config = TransferConfig(default_grant_blocks=2, pressure_timeout=10.0, progress_timeout=60.0)
    hog = pool.allocate(6, "hog")  # round 0 fits (2 blocks); the rest, kept, must wait for the hog
    failures: dict[str, TransferError] = {}
    async with endpoint_pair("inproc", source, storage, pool, config=config) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_sender_failure, pair.sender, "t", source, failures)
            if freed_in_time:
                start = trio.current_time()

                async def free_later() -> None:
                    await trio.sleep(9.9)
                    pool.free(hog, "hog")

                nursery.start_soon(free_later)
                result = await pair.receiver.receive("t", peer=pair.link, owner="request")
                assert trio.current_time() - start == pytest.approx(9.9)
                assert_same_bytes(
                    as_bytes(storage.gather(result.blocks, 0, source.tokens)), source.expected()
                )
                pool.free(result.blocks, "request")
            else:
                start = trio.current_time()
                with pytest.raises(TransferTimeout) as raised:
                    await pair.receiver.receive("t", peer=pair.link, owner="request")
                assert trio.current_time() - start == pytest.approx(10.0)
                assert raised.value.code == "transfer_timeout"
                assert raised.value.report.status is TransferStatus.FAILED
                assert raised.value.reason is FailureReason.MEMORY_PRESSURE
                assert raised.value.report.rounds == 1
        await settle()
    if not freed_in_time:
        assert type(failures["t"]) is TransferTimeout
        assert failures["t"].reason is FailureReason.MEMORY_PRESSURE
        pool.free(hog, "hog")
    assert pool.used_blocks == 0


async def test_a_stalled_sender_fails_at_the_progress_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, storage, pool = parts(16 * 4, seed=2)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, progress_timeout=20.0)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair(
        "inproc", source, storage, pool, config=config, faults=FaultPlan(stall_before_round=2)
    ) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_sender_failure, pair.sender, "t", source, failures)
            with pytest.raises(
                TransferFailed, match=r"\(no_progress\): nothing from the sender for 20.0 s in transferring"
            ):
                await pair.receiver.receive("t", peer=pair.link, consume=Collector())
            assert 20.0 <= trio.current_time() < 21.0
        await settle()
        assert failures["t"].reason is FailureReason.NO_PROGRESS
        assert pool.used_blocks == 0


async def test_a_sender_left_without_grants_fails_at_the_progress_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, storage, pool = parts(16 * 4, seed=2)
    config = TransferConfig(progress_timeout=20.0)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair("inproc", source, storage, pool, config=config) as pair:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_sender_failure, pair.sender, "t", source, failures)
            # A receiver that grants round 0 (one block, landing nowhere) and then falls silent.
            grant = Grant(
                transfer_id="t",
                round=0,
                landing_key=999,
                stream_offset=0,
                tokens=16,
                blocks=(0,),
                header=NO_HEADER,
                landing_offset=0,
                buffers=None,
                expected_tokens=None,
            )
            await pair.link.send(grant)
        assert 20.0 <= trio.current_time() - start < 21.0
        assert failures["t"].reason is FailureReason.NO_PROGRESS
        assert "no grant from the receiver for 20.0 s" in str(failures["t"])
        assert failures["t"].report.tokens == 16


@pytest.mark.parametrize("kind", ["inproc", "inproc-threads"])
async def test_aborts_from_either_side_fail_both_sides_and_spare_other_transfers(kind: str) -> None:
    source, storage, pool = parts(16 * 6, seed=3, blocks=30)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2)
    faults = FaultPlan(transfer_id="victim", stall_before_round=2)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair(kind, source, storage, pool, config=config, faults=faults) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_sender_failure, pair.sender, "victim", source, failures)
            nursery.start_soon(send_all, pair.sender, "bystander", source)
            bystander = Collector()
            nursery.start_soon(lambda: pair.receiver.receive("bystander", peer=pair.link, consume=bystander))
            with trio.move_on_after(0.3):  # the receiver's owner gives up (e.g. the request was cancelled)
                await pair.receiver.receive("victim", peer=pair.link, consume=Collector())
        assert_same_bytes(bystander.data(), source.expected())
        assert failures["victim"].reason is FailureReason.ABORTED
        assert failures["victim"].report.detail == "receiver aborted: receiver gave up: cancelled"

        async def failing_encoder() -> None:
            async with pair.sender.open_send("broken"):
                await trio.sleep(0.05)
                raise RuntimeError("vision encoder crashed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_expect_runtime_error, failing_encoder)
            with pytest.raises(TransferFailed) as raised:
                await pair.receiver.receive("broken", peer=pair.link, consume=Collector())
        assert raised.value.reason is FailureReason.ABORTED
        assert raised.value.report.detail == (
            "sender aborted: sender failed before sending: RuntimeError('vision encoder crashed')"
        )
        await settle()
    assert pool.used_blocks == 0
    assert pool.quarantined_blocks == 0


async def _expect_runtime_error(fn: Callable[[], Awaitable[None]]) -> None:
    with pytest.raises(RuntimeError, match="vision encoder crashed"):
        await fn()


async def test_blocks_stay_quarantined_until_the_sender_acknowledges_the_abort() -> None:
    source, storage, pool = parts(16 * 4, seed=4)
    control_send, control = trio.open_memory_channel[SenderDelivery](64)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=3)
    held: list[SenderDelivery] = []
    async with endpoint_pair(
        "inproc", source, storage, pool, config=config, sender_control=control_send
    ) as pair:
        enc, lang, link = pair.sender, pair.receiver, pair.link

        async def replica() -> None:  # a busy owner: it holds the Abort in its command queue
            async for delivery in control:
                if type(delivery.message).__name__ == "Abort":
                    held.append(delivery)
                else:
                    enc.deliver(delivery)

        async def sender() -> None:
            async with enc.open_send("t") as session:
                session.announce_total(source.tokens)
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(replica)
            nursery.start_soon(sender)
            with trio.move_on_after(0.2):
                await lang.receive("t", peer=link, consume=Collector())
            await settle()
            assert pool.quarantined_blocks == 3  # three granted rounds a write may still be heading for
            enc.deliver(held.pop())
            await settle()
            assert pool.used_blocks == 0
            nursery.cancel_scope.cancel()


async def test_duplicate_and_late_request_more_cache_are_ignored() -> None:
    source, storage, pool = parts(16 * 5, seed=5)
    control_send, control = trio.open_memory_channel[SenderDelivery](64)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=1)
    async with endpoint_pair(
        "inproc", source, storage, pool, config=config, sender_control=control_send
    ) as pair:
        enc, lang, link = pair.sender, pair.receiver, pair.link

        async def replica() -> None:  # every message delivered twice: duplicates
            async for delivery in control:
                enc.deliver(delivery)
                enc.deliver(delivery)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(replica)
            for transfer_id in ("first", "second"):
                nursery.start_soon(send_all, enc, transfer_id, source)
                collector = Collector()
                result = await lang.receive(transfer_id, peer=link, consume=collector)
                assert result.report.rounds == 5
                assert_same_bytes(collector.data(), source.expected())
                late = RequestMoreCache(
                    transfer_id="first", round=2, stream_offset=32, tokens=16, blocks=(0,)
                )
                await link.send(late)  # late: for a finished transfer
            nursery.cancel_scope.cancel()
    assert pool.used_blocks == 0


async def test_a_grant_nobody_sends_for_fails_with_no_sender(autojump_clock: trio.testing.MockClock) -> None:
    source, storage, pool = parts(16, seed=6)
    config = TransferConfig(orphan_timeout=8.0)
    async with endpoint_pair("inproc", source, storage, pool, config=config) as pair:
        with pytest.raises(
            TransferFailed, match=r"\(no_sender\): sender aborted: no sending session for 'ghost'"
        ):
            await pair.receiver.receive("ghost", peer=pair.link)
        assert trio.current_time() <= 8.0 + 2.0
        await settle()
    assert pool.used_blocks == 0


@pytest.mark.parametrize("kind", ["inproc", "inproc-threads"])
@pytest.mark.parametrize("checksums", [True, False])
async def test_a_corrupted_round_is_caught_by_checksums(kind: str, checksums: bool) -> None:
    source, storage, pool = parts(16 * 3, seed=7)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=1, checksums=checksums)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair(
        kind, source, storage, pool, config=config, faults=FaultPlan(corrupt_round=0)
    ) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_sender_failure, pair.sender, "t", source, failures)
            if checksums:
                with pytest.raises(
                    TransferFailed, match=r"\(corrupted\): round 0: checksum 0x[0-9a-f]{8}, sender sent"
                ):
                    await pair.receiver.receive("t", peer=pair.link, consume=Collector())
            else:
                collector = Collector()
                await pair.receiver.receive("t", peer=pair.link, consume=collector)
                assert as_bytes(collector.data())["embeds"][0, 0] != source.expected()["embeds"][0, 0]
        await settle()
    if checksums:
        assert failures["t"].reason is FailureReason.CORRUPTED
    assert pool.used_blocks == 0


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
@pytest.mark.parametrize(
    ("receiver_layout", "message"),
    [
        (embedding_layout(block_size=64), "block_size mismatch: sender 128, receiver 64"),
        (embedding_layout(hidden=16), "buffer 'embeds' shape mismatch: sender [8], receiver [16]"),
    ],
    ids=["block-size", "layout"],
)
async def test_a_mismatched_handshake_is_refused_naming_both_values(
    kind: str, receiver_layout: PoolLayout, message: str
) -> None:
    source = Source(embedding_layout(), 10, seed=8)
    network = InprocNetwork()
    storage, pool = (
        random_storage(receiver_layout, 4, seed=9),
        shuffled_pool(4, receiver_layout.block_size, seed=9),
    )
    async with (
        open_endpoint("sender", source.storage, source.pool, inproc=network) as sender,
        open_endpoint("receiver", storage, pool, inproc=network) as receiver,
    ):
        address = sender.listen_inproc() if kind == "inproc" else await sender.listen_tcp()
        with pytest.raises(HandshakeRefused, match=f"^{re.escape(message)}$"):
            await receiver.connect(address)
        await settle()
        assert receiver.links() == [] and sender.links() == []


async def test_a_link_dropped_behind_queued_copies_fails_both_sides_without_leaks() -> None:
    """Rounds queued on the copy lane (their writes returned), then the link dropped after the first
    copy: the rounds behind it never send their `ChunkDone`, both sides fail `link_lost`, every block
    comes back."""
    source, storage, pool = parts(16 * 6, seed=13)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=4)
    faults = FaultPlan(drop_link_after_bytes=1)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair("inproc-threads", source, storage, pool, config=config, faults=faults) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_sender_failure, pair.sender, "t", source, failures)
            collector = Collector()
            with pytest.raises(TransferFailed) as raised:
                await pair.receiver.receive("t", peer=pair.link, consume=collector)
        await settle()
    assert raised.value.reason is FailureReason.LINK_LOST
    assert failures["t"].reason is FailureReason.LINK_LOST
    assert "dropped by fault injection after 1 bytes" in failures["t"].report.detail
    assert collector.rounds == []
    assert pool.used_blocks == 0
    assert pool.quarantined_blocks == 0


async def test_an_owner_that_reads_no_sender_bound_message_has_the_link_closed_naming_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A sending endpoint's owner whose command channel stays full stalls the link's reader: past half
    of `link_timeout` the link is closed with a reason naming the owner, and nothing leaks."""
    source, storage, pool = parts(16, seed=7)
    control_send, _control = trio.open_memory_channel[SenderDelivery](0)  # never read
    config = TransferConfig(link_timeout=4.0, heartbeat_interval=1.0)
    async with endpoint_pair(
        "inproc", source, storage, pool, config=config, sender_control=control_send
    ) as pair:
        expected = (
            "the owner of endpoint 'sender' read no sender-bound message for 2.0 s (its sender_control "
            "channel is full); Grant for 't' undelivered"
        )
        with pytest.raises(TransferFailed, match=re.escape(expected)) as raised:
            await pair.receiver.receive("t", peer=pair.link, consume=Collector())
        assert trio.current_time() == pytest.approx(2.0)
    assert raised.value.reason is FailureReason.LINK_LOST
    assert pool.used_blocks == 0

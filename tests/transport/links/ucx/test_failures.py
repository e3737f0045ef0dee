"""Failures of the resumable transfer over UCX: deadlines, aborts, quarantine, corruption, lost
peers and links, malformed frames, refused handshakes, cancellation — on CPU over `UCX_TLS=sm,tcp` (the
`ucx_env` fixture); a sender in another process: test_transfer_ucx_processes.py. Real time throughout,
as in test_transfer_ucx.py.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import trio

import transport.links.ucx.link
from messages.layout import PoolLayout
from messages.transfer import FailureReason
from tests.transport.harness import (
    Collector,
    Pair,
    Source,
    assert_same_bytes,
    embedding_layout,
    endpoint_pair,
    random_storage,
    send_all,
    settle,
    shuffled_pool,
)
from tests.waiting import deadline
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig, UcxCopies
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.errors import HandshakeRefused, LinkBroken, TransferError, TransferFailed
from transport.faults import FaultPlan
from transport.memory.blocks import BlockPool

pytestmark = pytest.mark.usefixtures("ucx_env")

LAYOUT = embedding_layout(block_size=16)
# Quick liveness, so a vanished peer is noticed in about a second.
LIVELY: dict[str, Any] = {"heartbeat_interval": 0.2, "link_timeout": 1.0}


async def _expect_sender_failure(
    sender: TransferEndpoint, transfer_id: str, source: Source, into: dict[str, TransferError]
) -> None:
    try:
        await send_all(sender, transfer_id, source)
    except TransferError as exc:
        into[transfer_id] = exc


async def _expect_receiver_failure(pair: Pair, collector: Collector, into: dict[str, TransferError]) -> None:
    try:
        await pair.receiver.receive("t", peer=pair.link, consume=collector)
    except TransferError as exc:
        into["receiver"] = exc


async def test_a_stalled_ucx_sender_fails_at_the_progress_deadline() -> None:
    source, storage, pool = (
        Source(LAYOUT, 64, seed=2),
        random_storage(LAYOUT, 16, 3),
        shuffled_pool(16, 16, 4),
    )
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, progress_timeout=1.0)
    failures: dict[str, TransferError] = {}
    faults = FaultPlan(stall_before_round=2)
    async with endpoint_pair("ucx", source, storage, pool, config=config, faults=faults) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_expect_sender_failure, pair.sender, "t", source, failures)
            start = trio.current_time()
            with pytest.raises(TransferFailed, match=r"\(no_progress\): nothing from the sender for 1.0 s"):
                await pair.receiver.receive("t", peer=pair.link, consume=Collector())
            assert 1.0 <= trio.current_time() - start < 3.0
        await settle()
    assert failures["t"].reason is FailureReason.NO_PROGRESS
    assert pool.used_blocks == 0


async def test_ucx_aborts_from_either_side_fail_both_sides_and_spare_other_transfers() -> None:
    source, storage, pool = (
        Source(LAYOUT, 96, seed=3),
        random_storage(LAYOUT, 30, 4),
        shuffled_pool(30, 16, 5),
    )
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2)
    faults = FaultPlan(transfer_id="victim", stall_before_round=2)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair("ucx", source, storage, pool, config=config, faults=faults) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_expect_sender_failure, pair.sender, "victim", source, failures)
            nursery.start_soon(send_all, pair.sender, "bystander", source)
            bystander = Collector()
            nursery.start_soon(lambda: pair.receiver.receive("bystander", peer=pair.link, consume=bystander))
            with trio.move_on_after(0.5):
                await pair.receiver.receive("victim", peer=pair.link, consume=Collector())
        assert_same_bytes(bystander.data(), source.expected())
        assert failures["victim"].report.detail == "receiver aborted: receiver gave up: cancelled"

        async def failing_encoder() -> None:
            with pytest.raises(RuntimeError, match="vision encoder crashed"):
                async with pair.sender.open_send("broken"):
                    await trio.sleep(0.05)
                    raise RuntimeError("vision encoder crashed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(failing_encoder)
            with pytest.raises(TransferFailed) as raised:
                await pair.receiver.receive("broken", peer=pair.link, consume=Collector())
        assert raised.value.report.detail == (
            "sender aborted: sender failed before sending: RuntimeError('vision encoder crashed')"
        )
        await settle()
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)


async def test_ucx_blocks_stay_quarantined_until_the_sender_acknowledges_the_abort() -> None:
    source, storage, pool = (
        Source(LAYOUT, 64, seed=4),
        random_storage(LAYOUT, 16, 5),
        shuffled_pool(16, 16, 6),
    )
    control_send, control = trio.open_memory_channel[SenderDelivery](64)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=3)
    held: list[SenderDelivery] = []
    async with (
        open_endpoint("enc", source.storage, source.pool, config=config, sender_control=control_send) as enc,
        open_endpoint("lang", storage, pool, config=config) as lang,
    ):
        link = await lang.connect(await enc.listen_on("ucx"))

        async def replica() -> None:  # a busy owner: it holds the Abort in its command queue
            async for delivery in control:
                (held.append if type(delivery.message).__name__ == "Abort" else enc.deliver)(delivery)

        async def sender() -> None:
            async with enc.open_send("t") as session:
                session.announce_total(source.tokens)
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(replica)
            nursery.start_soon(sender)
            with trio.move_on_after(0.3):
                await lang.receive("t", peer=link, consume=Collector())
            await settle()
            assert pool.quarantined_blocks == 3
            enc.deliver(held.pop())
            await settle()
            assert pool.used_blocks == 0
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["ucx", "ucx-sender-copies"])
@pytest.mark.parametrize("hidden", [8, 4096], ids=["packed", "direct"])
async def test_a_corrupted_ucx_round_is_caught_by_checksums(kind: str, hidden: int) -> None:
    layout = embedding_layout(block_size=16, hidden=hidden)
    source, storage, pool = (
        Source(layout, 48, seed=7),
        random_storage(layout, 16, 8),
        shuffled_pool(16, 16, 9),
    )
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=1, checksums=True)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair(
        kind, source, storage, pool, config=config, faults=FaultPlan(corrupt_round=0)
    ) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_expect_sender_failure, pair.sender, "t", source, failures)
            with pytest.raises(
                TransferFailed, match=r"\(corrupted\): round 0: checksum 0x[0-9a-f]{8}, sender sent"
            ):
                await pair.receiver.receive("t", peer=pair.link, consume=Collector())
        await settle()
    assert failures["t"].reason is FailureReason.CORRUPTED
    assert_same_bytes(Source(layout, 48, seed=7).expected(), source.expected())  # the sender's blocks intact
    assert pool.used_blocks == 0


@pytest.mark.parametrize("how", ["receiver-gone", "link-dropped"])
async def test_a_lost_ucx_receiver_or_link_fails_both_sides_within_the_deadline(how: str) -> None:
    source, storage, pool = (
        Source(LAYOUT, 96, seed=47),
        random_storage(LAYOUT, 16, 48),
        shuffled_pool(16, 16, 49),
    )
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2, **LIVELY)
    faults = FaultPlan(stall_before_round=2) if how == "receiver-gone" else FaultPlan(drop_link_after_bytes=1)
    failures: dict[str, TransferError] = {}
    async with endpoint_pair("ucx", source, storage, pool, config=config, faults=faults) as pair:
        collector = Collector()

        async def receiver_goes_away() -> None:
            await collector.wait_rounds(2)
            pair.link.close(LinkBroken("receiver gone"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_expect_sender_failure, pair.sender, "t", source, failures)
            if how == "receiver-gone":
                nursery.start_soon(receiver_goes_away)
            start = trio.current_time()
            with pytest.raises(TransferFailed) as raised:
                await pair.receiver.receive("t", peer=pair.link, consume=collector)
            assert trio.current_time() - start < 3.0
        assert raised.value.reason is FailureReason.LINK_LOST
        assert failures["t"].reason is FailureReason.LINK_LOST
        if how == "link-dropped":  # torn down mid-frame, no goodbye: the heartbeats notice
            assert "nothing received for" in raised.value.report.detail
        await settle()
    assert pool.used_blocks == 0


async def _one_bad_sender(
    faults: FaultPlan, config: TransferConfig, seed: int, layout: PoolLayout = LAYOUT
) -> str:
    """A receiver with a good sender and one whose link carries `faults`: the good transfer lands whole,
    only the bad link closes, both ends of the bad transfer fail `link_lost`, no block stays used.
    Returns why the bad link closed."""
    good, bad = Source(layout, 80, seed=seed), Source(layout, 80, seed=seed + 1)
    storage, pool = random_storage(layout, 30, seed=seed + 2), shuffled_pool(30, 16, seed=seed + 3)
    async with (
        open_endpoint("good", good.storage, good.pool, config=config) as good_sender,
        open_endpoint("bad", bad.storage, bad.pool, config=config, faults=faults) as bad_sender,
        open_endpoint("receiver", storage, pool, config=config) as receiver,
    ):
        good_link = await receiver.connect(await good_sender.listen_on("ucx"))
        bad_link = await receiver.connect(await bad_sender.listen_on("ucx"))
        good_data = Collector()
        failures: dict[str, TransferError] = {}

        async def receive_bad() -> None:
            try:
                await receiver.receive("b", peer=bad_link, consume=Collector())
            except TransferFailed as exc:
                failures["receiver"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, good_sender, "g", good)
            nursery.start_soon(_expect_sender_failure, bad_sender, "b", bad, failures)
            nursery.start_soon(receive_bad)
            await receiver.receive("g", peer=good_link, consume=good_data)
        await settle()
        assert receiver.links() == [good_link]
        assert bad_link.error is not None
    assert_same_bytes(good_data.data(), good.expected())
    assert [failures[side].reason for side in ("receiver", "b")] == [FailureReason.LINK_LOST] * 2
    assert pool.used_blocks == 0
    return str(bad_link.error)


async def test_a_malformed_ucx_frame_closes_only_that_peers_link() -> None:
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2)
    why = await _one_bad_sender(FaultPlan(malformed_frame_after_bytes=1), config, seed=50)
    assert "malformed frame from the peer: control body of unknown kind 0xde" in why


async def test_a_read_of_rows_the_sender_does_not_have_closes_only_that_peers_link_naming_why() -> None:
    """A receiver that reads the sender's rows itself (`ucx_copies` "cma", 64 KiB blocks: read groups)
    is told an address no process maps: the kernel refuses the read, and that link closes saying so."""
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2, ucx_copies="cma")
    layout = embedding_layout(block_size=16, hidden=1024)
    why = await _one_bad_sender(FaultPlan(misaddressed_read_after_bytes=1), config, seed=70, layout=layout)
    assert why.endswith(
        f"cannot read the sender's rows: reading process {os.getpid()}'s memory: EFAULT: Bad address"
    )


@pytest.mark.parametrize("copies", ["sender", "receiver"], ids=["scattered", "received-by-copy"])
async def test_a_short_ucx_message_closes_only_that_peers_link_naming_both_lengths(
    copies: UcxCopies,
) -> None:
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2, ucx_copies=copies)
    why = await _one_bad_sender(FaultPlan(short_message_after_bytes=1), config, seed=60)
    lengths = re.search(r"receive failed: UcpFailed: a message of (\d+) bytes for a receive of (\d+)$", why)
    assert lengths is not None, why
    assert int(lengths[1]) + 1 == int(lengths[2])


async def test_a_mismatched_ucx_handshake_is_refused_naming_both_values() -> None:
    source = Source(embedding_layout(), 10, seed=8)
    layout = embedding_layout(block_size=64)
    storage, pool = random_storage(layout, 4, seed=9), shuffled_pool(4, 64, seed=9)
    async with (
        open_endpoint("sender", source.storage, source.pool) as sender,
        open_endpoint("receiver", storage, pool) as receiver,
    ):
        address = await sender.listen_on("ucx")
        with pytest.raises(
            HandshakeRefused, match=f"^{re.escape('block_size mismatch: sender 128, receiver 64')}$"
        ):
            await receiver.connect(address)
        await settle()
        assert receiver.links() == [] and sender.links() == []


async def test_nobody_listening_at_a_ucx_address_fails_within_the_handshake_timeout() -> None:
    source = Source(LAYOUT, 16, seed=1)
    config = TransferConfig(handshake_timeout=0.5)
    async with (
        open_endpoint("gone", source.storage, source.pool, config=config) as gone,
        open_endpoint(
            "receiver", random_storage(LAYOUT, 4, 2), shuffled_pool(4, 16, 3), config=config
        ) as receiver,
    ):
        # A live worker whose endpoint never listened: the connect message finds no listener.
        from transport.links.ucx.connect import worker_for

        address = f"ucx://{(await worker_for(gone)).address.hex()}"
        start = trio.current_time()
        with pytest.raises(LinkBroken, match=r"no answer from ucx://.* within 0.5 s"):
            await receiver.connect(address)
        assert trio.current_time() - start < 2.0
        with pytest.raises(
            ValueError, match=r"bad ucx address 'ucx://zz': expected ucx://<hex worker address>"
        ):
            await receiver.connect("ucx://zz")


async def test_cancelling_everything_mid_transfer_tears_ucx_down_cleanly() -> None:
    """A node's shutdown cancels its endpoints' tasks all at once: link readers, progress tasks and the
    transfers, in any order (ucxx crashed the process when a closing link posted its goodbye on an
    endpoint its worker had already closed)."""
    for attempt in range(4):
        source, storage, pool = (
            Source(LAYOUT, 160, seed=60),
            random_storage(LAYOUT, 16, 61),
            BlockPool(16, 16),
        )
        config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2)
        with trio.move_on_after(5) as watchdog:
            with trio.CancelScope() as everything:
                async with (
                    endpoint_pair("ucx", source, storage, pool, config=config) as pair,
                    trio.open_nursery() as nursery,
                ):
                    collector, failures = Collector(), dict[str, TransferError]()
                    # Either side may see its link close before its own cancellation: link_lost.
                    nursery.start_soon(_expect_sender_failure, pair.sender, "t", source, failures)
                    nursery.start_soon(_expect_receiver_failure, pair, collector, failures)
                    await collector.wait_rounds(1 + attempt)
                    everything.cancel()
        assert not watchdog.cancelled_caught, (
            f"attempt {attempt}: the transfer and its teardown took over 5 s"
        )
        assert pool.used_blocks == 0


async def test_a_frame_whose_bytes_cannot_be_made_fails_its_transfer_and_spares_the_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Making a frame's bytes ready fails on the sender (as when no pinned chunk can be allocated):
    nothing of that frame goes out, so the link carries on — the sender's `Abort` reaches the receiver
    at once, and the next transfer on the link lands. (The descriptor used to go first: the receiver's
    reader then waited for bytes that never came, and read nothing more until the link was closed.)"""
    real = transport.links.ucx.link.frame_payloads
    failed: list[int] = []

    def frame_payloads(bulk: BulkWrite, *args: Any) -> Any:
        if bulk.round == 1 and not failed:
            failed.append(bulk.round)
            raise MemoryError("no pinned memory for a chunk")
        return real(bulk, *args)

    monkeypatch.setattr(transport.links.ucx.link, "frame_payloads", frame_payloads)
    layout = embedding_layout(block_size=16)
    source = Source(layout, 16 * 6, seed=12)
    storage, pool = random_storage(layout, 30, seed=13), shuffled_pool(30, 16, seed=14)
    config = TransferConfig(default_grant_blocks=2, round_cap_blocks=2, progress_timeout=60.0)
    async with endpoint_pair("ucx-receiver-copies", source, storage, pool, config=config) as pair:
        with deadline("the failed transfer and the next one on the link", 5):  # under the deadlines
            async with trio.open_nursery() as nursery:

                async def sender() -> None:
                    with pytest.raises(MemoryError, match="no pinned memory"):
                        await send_all(pair.sender, "doomed", source)

                nursery.start_soon(sender)
                with pytest.raises(TransferFailed) as raised:
                    await pair.receiver.receive("doomed", peer=pair.link, consume=Collector())
            assert raised.value.reason is FailureReason.ABORTED
            assert "MemoryError('no pinned memory for a chunk')" in raised.value.report.detail
            collector = Collector()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, pair.sender, "after", source)
                await pair.receiver.receive("after", peer=pair.link, consume=collector)
        assert not pair.link.is_closed and failed == [1]
        assert_same_bytes(collector.data(), source.expected())
        await settle()
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)

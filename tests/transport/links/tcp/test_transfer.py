"""The transfer over TCP: between two processes, and between endpoints of one process over loopback."""

from __future__ import annotations

import signal

import pytest
import structlog.testing
import trio

from messages.transfer import FailureReason
from tests.transport.harness import (
    Collector,
    Source,
    assert_same_bytes,
    embedding_layout,
    endpoint_pair,
    random_storage,
    send_all,
    sender_process,
    settle,
    shuffled_pool,
)
from transport.config import TransferConfig
from transport.endpoint import open_endpoint
from transport.errors import LinkBroken, TransferFailed
from transport.faults import FaultPlan

SEEDS = {"t500": 500, "t2000": 2000, "t10000": 10_000, "t10000-cap8": 10_000}


@pytest.mark.slow  # a child process: importing torch there takes seconds
async def test_seed_scenarios_between_two_processes() -> None:
    layout = embedding_layout(block_size=128, hidden=8)
    source = Source(layout, max(SEEDS.values()), seed=41)
    params = {"block_size": 128, "hidden": 8, "seed": 41, "transfers": SEEDS}
    expected_rounds = {"t500": 1, "t2000": 2, "t10000": 2, "t10000-cap8": 10}
    async with sender_process(params) as child:
        for transfer_id, tokens in SEEDS.items():
            config = TransferConfig(
                default_grant_blocks=8, round_cap_blocks=8 if "cap8" in transfer_id else None
            )
            storage, pool = random_storage(layout, 100, seed=42), shuffled_pool(100, 128, seed=43)
            async with open_endpoint(f"receiver-{transfer_id}", storage, pool, config=config) as receiver:
                link = await receiver.connect(child.address)
                collector = Collector()
                result = await receiver.receive(transfer_id, peer=link, consume=collector)
            assert (result.report.rounds, result.report.grants) == (expected_rounds[transfer_id],) * 2
            assert_same_bytes(collector.data(), source.expected(tokens=tokens))
            assert pool.used_blocks == 0
            assert await child.line() == {"sent": transfer_id, "rounds": expected_rounds[transfer_id]}


@pytest.mark.slow  # a child process: importing torch there takes seconds
async def test_sender_process_killed_mid_transfer() -> None:
    layout = embedding_layout(block_size=16, hidden=8)
    params = {
        "block_size": 16,
        "hidden": 8,
        "seed": 44,
        "transfers": {"doomed": 16 * 8},
        "faults": {"stall_before_round": 2},
        "config": {"default_grant_blocks": 1, "round_cap_blocks": 1, "window": 3},
    }
    storage, pool = random_storage(layout, 16, seed=45), shuffled_pool(16, 16, seed=46)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=3)
    async with (
        sender_process(params) as child,
        open_endpoint("receiver", storage, pool, config=config) as receiver,
    ):
        link = await receiver.connect(child.address)
        collector = Collector()

        async def kill_when_stalled() -> None:
            await collector.wait_rounds(2)  # rounds 0 and 1 landed, round 2 granted and in flight
            child.process.send_signal(signal.SIGKILL)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_when_stalled)
            with pytest.raises(TransferFailed) as raised:
                await receiver.receive("doomed", peer=link, consume=collector)
        assert raised.value.reason is FailureReason.LINK_LOST
        # FIN or, when the killed process left unread bytes behind, RST: either way the link is lost.
        detail = raised.value.report.detail
        assert "the peer closed the connection" in detail or "ConnectionResetError" in detail
        await settle()
    assert pool.used_blocks == 0


@pytest.mark.parametrize("how", ["receiver-gone", "link-dropped"])
async def test_a_lost_receiver_or_link_fails_both_sides_without_leaks(how: str) -> None:
    layout = embedding_layout(block_size=16)
    source = Source(layout, 16 * 6, seed=47)
    storage, pool = random_storage(layout, 16, seed=48), shuffled_pool(16, 16, seed=49)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2)
    faults = FaultPlan(stall_before_round=2) if how == "receiver-gone" else FaultPlan(drop_link_after_bytes=1)
    sender_failure: list[TransferFailed] = []

    async def send() -> None:
        try:
            await send_all(pair.sender, "t", source)
        except TransferFailed as exc:
            sender_failure.append(exc)

    async with endpoint_pair("tcp", source, storage, pool, config=config, faults=faults) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            collector = Collector()

            async def receiver_goes_away() -> None:
                await collector.wait_rounds(2)
                pair.link.close(LinkBroken("receiver gone"))

            if how == "receiver-gone":
                nursery.start_soon(receiver_goes_away)
            with pytest.raises(TransferFailed) as raised:
                await pair.receiver.receive("t", peer=pair.link, consume=collector)
        assert raised.value.reason is FailureReason.LINK_LOST
        assert sender_failure[0].reason is FailureReason.LINK_LOST
        await settle()
    assert pool.used_blocks == 0


async def test_malformed_frames_close_only_that_peers_link() -> None:
    layout = embedding_layout(block_size=16)
    good, bad = Source(layout, 16 * 5, seed=50), Source(layout, 16 * 5, seed=51)
    storage, pool = random_storage(layout, 30, seed=52), shuffled_pool(30, 16, seed=53)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=2)
    with structlog.testing.capture_logs() as logs:
        async with (
            open_endpoint("good", good.storage, good.pool, config=config) as good_sender,
            open_endpoint(
                "bad", bad.storage, bad.pool, config=config, faults=FaultPlan(malformed_frame_after_bytes=1)
            ) as bad_sender,
            open_endpoint("receiver", storage, pool, config=config) as receiver,
        ):
            good_link = await receiver.connect(await good_sender.listen_tcp())
            bad_link = await receiver.connect(await bad_sender.listen_tcp())
            good_data = Collector()
            failures: list[TransferFailed] = []

            async def receive_bad() -> None:
                try:
                    await receiver.receive("b", peer=bad_link, consume=Collector())
                except TransferFailed as exc:
                    failures.append(exc)

            async def send_bad() -> None:
                try:
                    await send_all(bad_sender, "b", bad)
                except TransferFailed as exc:
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, good_sender, "g", good)
                nursery.start_soon(send_bad)
                nursery.start_soon(receive_bad)
                await receiver.receive("g", peer=good_link, consume=good_data)
            await settle()
            assert receiver.links() == [good_link]
    assert_same_bytes(good_data.data(), good.expected())
    assert [f.reason for f in failures] == [FailureReason.LINK_LOST] * 2
    closed = [
        entry
        for entry in logs
        if entry["event"] == "transfer.link_closed" and entry["endpoint"] == "receiver"
    ]
    assert any("malformed frame from the peer: bad frame magic 0xadde" in entry["reason"] for entry in closed)
    assert pool.used_blocks == 0

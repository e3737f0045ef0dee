"""The UCX transfer with the sender in another process: the seeds' transfers, a killed sender,
and a sender that gives up while its round is still going out. On CPU over `UCX_TLS=sm,tcp` (the
`ucx_env` fixture); real time throughout, as in test_transfer_ucx.py.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from messages.transfer import FailureReason
from tests.transport.harness import (
    Collector,
    SenderProcess,
    Source,
    as_bytes,
    assert_same_bytes,
    embedding_layout,
    random_storage,
    sender_process,
    settle,
    shuffled_pool,
)
from tests.transport.links.ucx.test_failures import LIVELY
from tests.waiting import deadline, wait_until
from transport.config import TransferConfig, UcxCopies
from transport.endpoint import open_endpoint
from transport.errors import TransferFailed
from transport.links.ucx import cma
from transport.links.ucx.frames import Descriptor
from transport.links.ucx.link import UcxLink
from transport.memory.blocks import BlockPool

pytestmark = pytest.mark.usefixtures("ucx_env")


@pytest.mark.slow  # a child process: importing torch there takes seconds
async def test_seed_scenarios_and_a_killed_sender_between_two_processes_over_ucx(
    ucx_env: dict[str, str],
) -> None:
    """The seeds' transfers from a sender in another process, then that process killed mid-round: the
    receiver fails `link_lost` within the link deadline and every block is back."""
    layout = embedding_layout(block_size=128, hidden=8)
    # t11000-wide: 86 scattered blocks in one round, so each buffer's frame has 86 pieces (an I/O vector
    # built by `stretch_entries`' vectorised path on both sides).
    seeds = {"t500": 500, "t2000": 2000, "t10000-cap8": 10_000, "t11000-wide": 11_000, "doomed": 10_000}
    params = {
        "block_size": 128,
        "hidden": 8,
        "seed": 41,
        "transfers": seeds,
        "transport": "ucx",
        "faults": {"transfer_id": "doomed", "stall_before_round": 2},
        "config": LIVELY,
    }
    source = Source(layout, max(seeds.values()), seed=41)
    expected_rounds = {"t500": 1, "t2000": 2, "t10000-cap8": 10, "t11000-wide": 1}
    async with sender_process(params, env=ucx_env) as child:
        for transfer_id, rounds in expected_rounds.items():
            cap = 8 if "cap8" in transfer_id else None
            grant = 96 if "wide" in transfer_id else 8
            config = TransferConfig(default_grant_blocks=grant, round_cap_blocks=cap)
            storage, pool = random_storage(layout, 100, seed=42), shuffled_pool(100, 128, seed=43)
            async with open_endpoint(f"receiver-{transfer_id}", storage, pool, config=config) as receiver:
                collector = Collector()
                link = await receiver.connect(child.address)
                result = await receiver.receive(transfer_id, peer=link, consume=collector)
            assert (result.report.rounds, result.report.grants) == (rounds, rounds)
            assert_same_bytes(collector.data(), source.expected(tokens=seeds[transfer_id]))
            assert pool.used_blocks == 0
            assert await child.line() == {"sent": transfer_id, "rounds": rounds}

        config = TransferConfig(default_grant_blocks=1, round_cap_blocks=1, window=3, **LIVELY)
        storage, pool = random_storage(layout, 16, seed=45), shuffled_pool(16, 128, seed=46)
        async with open_endpoint("receiver", storage, pool, config=config) as receiver:
            link = await receiver.connect(child.address)
            collector = Collector()
            killed_at: list[float] = []

            async def kill_when_stalled() -> None:
                await collector.wait_rounds(2)  # rounds 0 and 1 landed, round 2 granted
                child.process.send_signal(signal.SIGKILL)
                killed_at.append(trio.current_time())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_when_stalled)
                with pytest.raises(TransferFailed) as raised:
                    await receiver.receive("doomed", peer=link, consume=collector)
            assert raised.value.reason is FailureReason.LINK_LOST
            assert "nothing received for" in raised.value.report.detail
            assert trio.current_time() - killed_at[0] < LIVELY["link_timeout"] + 1.0
            await settle()
        assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)


@pytest.mark.slow  # a child process: importing torch there takes seconds
async def test_a_sender_that_gives_up_keeps_its_rows_until_the_receiver_has_read_them(
    ucx_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's sends may still be in flight when its `write` returns (ucx). Here the receiver's link
    reader is held before it takes in any of the sender's frames (it neither reads them itself nor posts
    UCX's receives for them); the sender's owner gives up once round 0 was written and overwrites its
    source the moment `send` returns. `send` must not return before the receiver has read round 0,
    which then lands intact in the caller's blocks, ahead of the sender's `Abort`."""
    layout = embedding_layout(block_size=16, hidden=4096)  # 16 KiB rows: whole blocks go direct
    params = {"block_size": 16, "hidden": 4096, "seed": 51, "transfers": {"t": 64}, "transport": "ucx"}
    source = Source(layout, 64, seed=51)
    # Two rounds of 32 tokens, and round 1 granted only once round 0 landed (window 1): the sender's
    # owner gives up while it waits for that grant.
    config = TransferConfig(default_grant_blocks=2, round_cap_blocks=2, window=1)
    storage, pool = random_storage(layout, 8, seed=52), shuffled_pool(8, 16, seed=53)
    reader_released, held = trio.Event(), trio.Event()
    take_in = UcxLink._receive_frames

    async def held_until_released(link: UcxLink, frames: list[Descriptor]) -> None:
        held.set()
        await reader_released.wait()
        await take_in(link, frames)

    monkeypatch.setattr(UcxLink, "_receive_frames", held_until_released)
    async with (
        sender_process({**params, "give_up_after_round": 0}, env=ucx_env) as child,
        open_endpoint("receiver", storage, pool, config=config) as receiver,
    ):
        link = await receiver.connect(child.address)
        blocks = pool.allocate(4, "caller")
        with deadline("the receive ending with the sender's Abort", 60):
            async with trio.open_nursery() as nursery:

                async def receive() -> None:
                    with pytest.raises(TransferFailed, match="sender gave up"):
                        await receiver.receive("t", peer=link, expected_tokens=64, blocks=blocks)

                nursery.start_soon(receive)
                with deadline("round 0's first frame reaching the receiver's link reader"):
                    await held.wait()
                assert await child.line() == {"giving_up": "t"}  # round 0 written, its owner cancels
                # While the reader is held the sender's `send` must not return: a second, bounded look that
                # expects no line (the process reports `gave_up` the moment `send` returns). A second is
                # far more than a `send` that did not wait would need; the link deadline (5 s) is further.
                with trio.move_on_after(1.0):
                    early = await child.line()
                    pytest.fail(f"the sender's send returned before the receiver read round 0: {early}")
                reader_released.set()
        assert await child.line() == {"gave_up": "t"}
        landed = as_bytes(storage.gather(blocks, 0, 32))
        pool.free(blocks, "caller")
    assert_same_bytes(landed, source.expected(tokens=32))
    assert pool.used_blocks == 0


@asynccontextmanager
async def _stopped_sender(
    ucx_env: dict[str, str], seed: int, copies: UcxCopies
) -> AsyncIterator[tuple[SenderProcess, BlockPool, TransferConfig]]:
    """A sender process with 16 KiB rows (whole blocks go direct) that stops itself right after posting
    round 1's first frame: the receive fails `link_lost` within the link deadline plus `fence_timeout`.
    Yields the stopped process, the receiving pool and the receiver's config, the receiver still open."""
    layout = embedding_layout(block_size=16, hidden=4096)
    params = {"block_size": 16, "hidden": 4096, "seed": seed, "transfers": {"t": 64}, "transport": "ucx"}
    config = TransferConfig(
        default_grant_blocks=2, round_cap_blocks=2, fence_timeout=0.5, ucx_copies=copies, **LIVELY
    )
    storage, pool = random_storage(layout, 8, seed=seed), shuffled_pool(8, 16, seed=seed)
    async with (
        sender_process({**params, "stop_after_posting_round": 1}, env=ucx_env) as child,
        open_endpoint("receiver", storage, pool, config=config) as receiver,
    ):
        link = await receiver.connect(child.address)
        started = trio.current_time()
        with (
            pytest.raises(TransferFailed) as raised,
            deadline("the receive from a stopped sender failing", 20),
        ):
            await receiver.receive("t", peer=link, consume=Collector())
        assert raised.value.reason is FailureReason.LINK_LOST
        assert trio.current_time() - started < LIVELY["link_timeout"] + config.fence_timeout + 2.0
        yield child, pool, config


async def _stop_a_sender_owing_a_write(ucx_env: dict[str, str], seed: int) -> bool:
    """One run of the scenario below; whether the stopped process owed a write when it stopped."""
    async with _stopped_sender(ucx_env, seed, "sender") as (child, pool, _config):
        await trio.sleep(0.5)
        owed = pool.quarantined_blocks
        # Round 1's two blocks, while the stopped process may still write them; round 0's two as well
        # when the process stopped before progressing round 0's writes (it writes them, and lazily).
        assert owed in (0, 2, 4)
        child.process.kill()
        await wait_until(
            lambda: not pool.quarantined_blocks,
            "the killed sender's owed blocks leaving quarantine",
            detail=lambda: f"{pool.quarantined_blocks} still quarantined",
        )
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)
    return owed > 0


@pytest.mark.slow  # a child process: importing torch there takes seconds
async def test_blocks_a_stopped_sender_owes_writes_to_stay_quarantined_until_that_process_is_gone(
    ucx_env: dict[str, str],
) -> None:
    """A sender process stops right after posting a round's first frame: the receiver's scattered
    receive for it is matched and cannot be cancelled, and only that process could complete it. The
    transfer fails `link_lost` within the link deadline plus `fence_timeout`, the blocks of the rounds it
    had not written stay quarantined while the process exists, and come back once it is killed.

    Whether UCX has matched the receive when the sender stops is up to the scheduler (now and then the
    sender is preempted long enough for the receiver to answer, and writes; then no block is owed and
    all come back at once), so the scenario runs until it has seen the owed case, at most three times."""
    for seed in (61, 62, 63):
        if await _stop_a_sender_owing_a_write(ucx_env, seed):
            return
    pytest.fail("in three runs the stopped sender never owed a write")


async def _every_block_back(pool: BlockPool, *, within: float) -> None:
    """Until no block of `pool` is used or quarantined: `within` seconds of the failed receive, while
    the stopped sender process still exists."""
    await wait_until(
        lambda: not (pool.quarantined_blocks or pool.used_blocks),
        "every block back from the stopped sender within fence_timeout + 2 s",
        within,
        detail=lambda: f"{pool.used_blocks} used, {pool.quarantined_blocks} quarantined",
    )


@pytest.mark.slow  # a child process: importing torch and starting it take seconds
@pytest.mark.parametrize("copies", ["cma", "mixed", "receiver"])
async def test_a_stopped_sender_holds_no_block_of_a_receiver_that_reads_the_pieces_itself(
    ucx_env: dict[str, str], copies: UcxCopies
) -> None:
    """The same stopped sender over shared memory, to a receiver that reads direct pieces itself (the
    default, "cma", then "mixed" and "receiver"). The frame the sender posted before it stopped is round
    1's first: with "cma" its read group (with so few small rows, every row of the round), which this
    side reads from the stopped process's memory at once; otherwise, if its rendezvous reached the receiver,
    this side reads it too, and if not, the receive is cancelled as the link closes. Either way no block
    waits for the sender process — they all come back within the link deadline and `fence_timeout`,
    while the process still exists."""
    async with _stopped_sender(ucx_env, 65, copies) as (child, pool, config):
        await _every_block_back(pool, within=config.fence_timeout + 2.0)
        assert child.process.returncode is None  # stopped, not gone
        child.process.kill()


@pytest.mark.slow  # a child process: importing torch and starting it take seconds
async def test_blocks_come_back_from_a_stopped_sender_whose_bytes_land_in_host_chunks(
    ucx_env: dict[str, str],
) -> None:
    """The same stopped sender, but rows of 3 KiB (packed frames, a rendezvous each round) over UCX's
    TCP (the receiver cannot read a stopped process's memory there) to a receiver that copies the bytes
    itself (`ucx_copies` "receiver"): the receive it posted for the stopped round lands in a host chunk,
    never in a block, so the blocks come back as soon as the link is gone, while the process still
    exists (they stayed quarantined until it was killed: `quiesce` waited for that receive too)."""
    layout = embedding_layout(block_size=16, hidden=768)
    params = {"block_size": 16, "hidden": 768, "seed": 64, "transfers": {"t": 64}, "transport": "ucx"}
    config = TransferConfig(
        default_grant_blocks=2, round_cap_blocks=2, fence_timeout=0.5, ucx_copies="receiver", **LIVELY
    )
    storage, pool = random_storage(layout, 8, seed=64), shuffled_pool(8, 16, seed=64)
    async with (
        sender_process({**params, "stop_after_posting_round": 1}, env={**ucx_env, "UCX_TLS": "tcp"}) as child,
        open_endpoint("receiver", storage, pool, config=config) as receiver,
    ):
        link = await receiver.connect(child.address)
        with (
            pytest.raises(TransferFailed) as raised,
            deadline("the receive from a stopped sender failing", 20),
        ):
            await receiver.receive("t", peer=link, consume=Collector())
        assert raised.value.reason is FailureReason.LINK_LOST
        await _every_block_back(pool, within=config.fence_timeout + 2.0)
        assert child.process.returncode is None  # stopped, not gone
        child.process.kill()


@pytest.mark.slow  # a child process: importing torch there takes seconds
async def test_rounds_read_on_three_lanes_land_byte_exact_with_checksums(
    ucx_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 MiB in three rounds of 4 MiB from a sender process, each round's read call cut into 1 MiB
    chunks that three lanes share (`transport.links.ucx.cma.read`): every byte lands where it should, the
    senders' checksums agree, no block leaks."""
    shared_reads: list[int] = []
    run = cma._SharedRead.run

    def counted(self: cma._SharedRead) -> None:
        shared_reads.append(1)
        run(self)

    monkeypatch.setattr(cma._SharedRead, "run", counted)
    layout = embedding_layout(block_size=16, hidden=4096)  # 16 KiB rows, 256 KiB blocks
    params = {
        "block_size": 16,
        "hidden": 4096,
        "seed": 71,
        "transfers": {"t": 768},
        "transport": "ucx",
        "config": {"checksums": True},
    }
    source = Source(layout, 768, seed=71)
    config = TransferConfig(default_grant_blocks=16, round_cap_blocks=16, checksums=True, ucx_read_lanes=3)
    storage, pool = random_storage(layout, 64, seed=72), shuffled_pool(64, 16, seed=73)
    async with (
        sender_process(params, env=ucx_env) as child,
        open_endpoint("receiver", storage, pool, config=config) as receiver,
    ):
        collector = Collector()
        link = await receiver.connect(child.address)
        with deadline("12 MiB read on three lanes", 20):
            result = await receiver.receive("t", peer=link, consume=collector)
        assert result.report.rounds == 3
        assert await child.line() == {"sent": "t", "rounds": 3}
    assert_same_bytes(collector.data(), source.expected(tokens=768))
    assert len(shared_reads) >= 3  # at least one shared read a round
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)

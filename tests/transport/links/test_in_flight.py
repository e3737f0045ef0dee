"""`transport.links.in_flight.InFlight`: the count of running copies a link's `quiesce` and `settle` wait for."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.waiting import deadline
from transport.links.in_flight import InFlight


async def test_idle_is_set_only_once_overlapping_pieces_have_all_finished(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A waiter that takes `idle` while a first piece runs is woken when the last of the overlapping
    pieces ends, not before, and not never (cuda-ipc's writes replaced the event per piece, so a waiter
    could hold one nobody would set)."""
    work = InFlight()
    assert work.idle.is_set()
    woken: list[float] = []

    async def piece(seconds: float) -> None:
        with work.running():
            await trio.sleep(seconds)

    async def waiter() -> None:
        await work.idle.wait()
        woken.append(trio.current_time())

    with deadline("both waiters woken", 10):  # virtual seconds (autojump_clock)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(piece, 2.0)
            await trio.sleep(0.5)
            nursery.start_soon(waiter)
            await trio.sleep(0.5)
            nursery.start_soon(piece, 3.0)  # starts at 1.0, ends at 4.0, after the first one (2.0)
            nursery.start_soon(waiter)
    assert woken == [4.0, 4.0]
    assert work.idle.is_set()


async def test_a_piece_that_raises_still_ends() -> None:
    work = InFlight()
    with pytest.raises(RuntimeError, match="copy failed"), work.running():
        assert not work.idle.is_set()
        raise RuntimeError("copy failed")
    assert work.idle.is_set()

"""The endpoint's keep-alive loop (`transport.protocol.liveness.keep_alive_sessions`) under `autojump_clock`."""

from __future__ import annotations

import math

import trio
import trio.testing

from transport.protocol.liveness import TICKS_PER_TIMEOUT, keep_alive_sessions

TIMEOUT = 3.2
GRANULARITY = TIMEOUT / TICKS_PER_TIMEOUT  # 0.1 s


class Staggered:
    """A session that wants a tick every second, at its own phase; records when it was ticked."""

    def __init__(self, phase: float) -> None:
        self.phase = phase
        self.ticks: list[float] = []
        self.wanted: list[float] = []

    def tick(self, now: float) -> float:
        self.ticks.append(now)
        due = self.phase + math.ceil(now - self.phase + 1e-9)  # the next whole second after now, phased
        self.wanted.append(due)
        return due


class Idle:
    def __init__(self) -> None:
        self.ticks: list[float] = []

    def tick(self, now: float) -> float:
        self.ticks.append(now)
        return math.inf


async def test_many_sessions_are_served_in_batches_and_never_late(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sessions = [Staggered(phase=i / 200) for i in range(200)]  # together they want a tick every 5 ms
    with trio.move_on_after(10.0):
        await keep_alive_sessions(lambda: sessions, TIMEOUT)
    end = trio.current_time()
    passes = len(sessions[0].ticks)
    assert passes <= 10.0 / GRANULARITY + 1  # one pass per granule at most, not one per session's time
    for session in sessions:
        for wanted in session.wanted:
            if wanted <= end - GRANULARITY:
                served = min(t for t in session.ticks if t >= wanted)
                assert served <= wanted + GRANULARITY + 1e-9


async def test_sessions_that_need_nothing_are_still_looked_at_every_third_of_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    idle = Idle()
    with trio.move_on_after(10.0):
        await keep_alive_sessions(lambda: [idle], TIMEOUT)
    gaps = [b - a for a, b in zip(idle.ticks, idle.ticks[1:], strict=False)]
    assert gaps and max(gaps) <= TIMEOUT / 3 + 1e-9

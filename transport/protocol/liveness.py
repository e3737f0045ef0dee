"""Progress deadlines of one side of one transfer (architecture §5.7).

The deadline measures lack of progress, not age: every message or byte for the transfer `touch`es it.
While this side itself holds things up (waiting for blocks, for its consumer, for its owner's data) it
is inside `local_wait()`: the deadline does not run against the peer, and `tick` tells the caller to
send the peer a `StatusUpdate` every third of the timeout, so the peer's deadline does not run either.
`keep_alive_sessions` ticks all the sessions of an endpoint from one task.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Final, Protocol, final

import trio


@final
class Liveness:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.last_progress = trio.current_time()
        self.local_waits = 0
        self.next_update = self.last_progress + timeout / 3

    def touch(self) -> None:
        self.last_progress = trio.current_time()

    @property
    def deadline(self) -> float:
        return self.last_progress + self.timeout

    @contextmanager
    def local_wait(self) -> Iterator[None]:
        self.local_waits += 1
        try:
            yield
        finally:
            self.local_waits -= 1
            self.touch()

    def tick(self, now: float, *, busy: bool, overdue: bool = True) -> tuple[bool, bool]:
        """What is due at `now`: (say busy — a third of the timeout passed since the last update and
        `busy`; expired — the deadline passed with no progress, outside `local_wait()`, while
        `overdue`: what this side waits for is the peer's)."""
        say_busy = False
        if now >= self.next_update:
            self.next_update = now + self.timeout / 3
            say_busy = busy
        if self.local_waits:
            self.touch()
            return say_busy, False
        return say_busy, now >= self.deadline and overdue

    def wake_at(self, now: float) -> float:
        """When `tick` next has something to do (always after `now` once `tick(now)` ran). A deadline
        that passed while not overdue is left to its owner, which checks it before it waits."""
        deadline = self.deadline
        return self.next_update if deadline <= now else min(deadline, self.next_update)


# Deadlines and keep-alives are kept to this fraction of the timeout (20 s → 0.625 s late at most).
TICKS_PER_TIMEOUT: Final = 32


class KeptAlive(Protocol):
    def tick(self, now: float) -> float:
        """Send the keep-alive or fail the transfer when due; when to be ticked next (inf: never)."""
        ...


async def keep_alive_sessions(sessions: Callable[[], Iterable[KeptAlive]], timeout: float) -> None:
    """One task per endpoint ticks every transfer session of it (a task per session cost a fifth of the
    Python of a small transfer). Each pass ticks them all and sleeps until the earliest time one asked
    for, but at least `timeout / TICKS_PER_TIMEOUT`: with many sessions a pass serves all that are due
    about then, instead of one pass per session. A new session asks first at a third of the timeout after
    it opened, never earlier than this loop's next pass, and sessions only ever push their times later,
    so a tick is never later than that granularity. Runs until cancelled."""
    while True:
        now = trio.current_time()
        wake = now + timeout / 3
        for session in list(sessions()):
            wake = min(wake, session.tick(now))
        await trio.sleep_until(max(wake, now + timeout / TICKS_PER_TIMEOUT))

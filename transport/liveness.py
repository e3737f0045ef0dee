"""Progress deadlines of one side of one transfer (DESIGN §5.7).

The deadline measures lack of progress, not age: every message or byte for the transfer `touch`es it.
While this side itself holds things up (waiting for blocks, for its consumer, for its owner's data) it
is inside `local_wait()`: the deadline does not run against the peer, and `keep` tells the caller to
send the peer a `StatusUpdate` every third of the timeout, so the peer's deadline does not run either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import final

import trio


@final
class Liveness:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.last_progress = trio.current_time()
        self.local_waits = 0

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

    async def keep(
        self,
        busy: Callable[[], bool],
        say_busy: Callable[[], Awaitable[None]],
        overdue: Callable[[], bool] = lambda: True,
    ) -> None:
        """Both duties of a side in one task (a task per duty cost a third of the Python of a small
        transfer): every third of the timeout, `say_busy()` while `busy()`; return once the deadline
        passed with no progress, outside `local_wait()`, while `overdue()` (what this side waits for is
        the peer's). Runs until then or until cancelled."""
        period = self.timeout / 3
        next_update = trio.current_time() + period
        while True:
            deadline = self.deadline
            wake = next_update if deadline <= trio.current_time() else min(deadline, next_update)
            await trio.sleep_until(wake)
            now = trio.current_time()
            if now >= next_update:
                next_update = now + period
                if busy():
                    await say_busy()
            if self.local_waits:
                self.touch()
            elif now >= self.deadline and overdue():
                return

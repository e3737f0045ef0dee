"""Progress deadlines of one side of one transfer (DESIGN §5.7).

The deadline measures lack of progress, not age: every message or byte for the transfer `touch`es it.
While this side itself holds things up (waiting for blocks, for its consumer, for its owner's data) it
is inside `local_wait()`: the deadline does not run against the peer, and `updates` tells the caller to
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

    async def watch(self) -> None:
        """Return when the peer made no progress for `timeout` while this side was not busy."""
        while True:
            await trio.sleep_until(self.deadline)
            if self.local_waits:
                self.touch()
            elif trio.current_time() >= self.deadline:
                return

    async def updates(self, busy: Callable[[], bool], send: Callable[[], Awaitable[None]]) -> None:
        """Every third of the timeout, `send()` while `busy()` (runs until cancelled)."""
        while True:
            await trio.sleep(self.timeout / 3)
            if busy():
                await send()

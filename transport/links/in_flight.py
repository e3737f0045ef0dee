"""Work a link has started and must see finish before it is quiet: copies into pool memory (inproc's and
cuda-ipc's device copies, a UCX link's unpack or scatter of a landed bundle), counted, with an event set
whenever none runs (what `Link.quiesce` and `Link.settle` wait for)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import final

import trio


@final
class InFlight:
    """A count of running pieces of work and `idle`, set while the count is zero.

    `idle` is replaced only when the first piece starts, so a waiter always holds the event that is set
    once every piece it could see has finished (overlapping pieces included). Single Trio thread."""

    def __init__(self) -> None:
        self._count = 0
        self.idle = trio.Event()
        self.idle.set()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count the block as running until it exits, however it exits."""
        if self._count == 0:
            self.idle = trio.Event()
        self._count += 1
        try:
            yield
        finally:
            self._count -= 1
            if self._count == 0:
                self.idle.set()

"""A copy lane: an inproc link's large rounds, copied in a worker thread one after another while the
event loop goes on.

A round's copy is queued with `submit`; one thread at a time runs the queue in order, going from one
copy straight to the next, and hands each outcome back to the Trio thread (`run_sync_soon`, so in queue
order), where `finished` sends the round's trailer. That is what lets a sender queue its next round
while the previous one is still being copied: the round boundary (the thread's wake-up, the trailer,
planning the next round) no longer stands between two copies.

Invariants: at most one thread runs a lane's queue; `idle` is set exactly when nothing is queued or
running and every `finished` has returned. A copy is never abandoned: whoever owns the memory waits for
`idle` (the link's `run` and `quiesce`, shielded).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import final

import outcome
import trio

Copy = Callable[[], object]
Finished = Callable[[outcome.Outcome[object]], None]


@final
class CopyLane:
    """See the module docstring. Created and fed in the Trio thread."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()  # guards `_queue` and `_running` against the lane's thread
        self._queue: deque[tuple[Copy, Finished]] = deque()
        self._running = False
        self._pending = 0
        self.idle = trio.Event()
        self.idle.set()

    def submit(self, copy: Copy, finished: Finished) -> None:
        """Queue `copy`; `finished(its outcome)` runs in the Trio thread once it ran. Never blocks."""
        self._pending += 1
        if self.idle.is_set():
            self.idle = trio.Event()
        with self._lock:
            self._queue.append((copy, finished))
            start, self._running = not self._running, True
        if start:
            trio.lowlevel.start_thread_soon(self._drain, _report, name="zigzag copy lane")

    def _drain(self) -> None:
        """The lane's thread: run the queue until it is empty."""
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                copy, finished = self._queue.popleft()
            self._token.run_sync_soon(self._finish, finished, outcome.capture(copy))

    def _finish(self, finished: Finished, result: outcome.Outcome[object]) -> None:
        try:
            finished(result)
        finally:
            self._pending -= 1
            if self._pending == 0:
                self.idle.set()


def _report(result: outcome.Outcome[None]) -> None:
    # `_drain` raises only when the Trio run it reports to is gone, which the owners' waits for `idle`
    # rule out; if it ever does, the worker thread prints the error.
    result.unwrap()

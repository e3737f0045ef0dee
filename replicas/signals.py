"""Events between the node's parts: subscriber lists, and the node-wide change signal.

`Subscribers[T]` is an event's list of callbacks, told in the order they subscribed, synchronously: a
part that raises an event never knows who listens, and subscribing never replaces another listener,
so the order in which parts are built does not matter.

`Changes` is the node-wide condition "something a part may be waiting for changed": a replica's state,
lock, queue room or held blocks, a live request's end, another node's report. `notify()` tells the
subscribers at once (the router dispatches its queue) and wakes every task waiting in `wait()` (the
scale op waiting for a ZigZag episode to end, the cluster's report loop, the migration queue waiting for
a decode replica). A waiter checks its condition, then waits: the node is one Trio thread, so no change
can fall between the check and the wait. Waits that can hang take a deadline (`trio.move_on_after`).

Cancellation: `wait` is a plain checkpoint; cancelling it loses nothing (the next change wakes the
next waiter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, final

import trio

T = TypeVar("T")


@final
class Subscribers(Generic[T]):
    """The callbacks of one event (see the module docstring)."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[T], None]] = []

    def subscribe(self, callback: Callable[[T], None]) -> Callable[[], None]:
        """Tell `callback` of every later event; returns the function that unsubscribes it."""
        self._callbacks.append(callback)

        def unsubscribe() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return unsubscribe

    def __call__(self, value: T) -> None:
        """Tell every subscriber of `value`, in subscription order (one that unsubscribes meanwhile is
        still told this once)."""
        for callback in list(self._callbacks):
            callback(value)

    def __len__(self) -> int:
        return len(self._callbacks)


@final
class Changes:
    """The node-wide change signal (see the module docstring). `count` says how many changes so far."""

    def __init__(self) -> None:
        self.subscribers: Subscribers[None] = Subscribers()
        self.count = 0
        self._event = trio.Event()

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` at every later change; returns the function that stops it."""
        return self.subscribers.subscribe(lambda _: callback())

    def notify(self) -> None:
        """Something changed: wake the waiters, then tell the subscribers."""
        self.count += 1
        event, self._event = self._event, trio.Event()
        event.set()
        self.subscribers(None)

    async def wait(self) -> None:
        """Return at the next change."""
        await self._event.wait()

    async def wait_until(self, condition: Callable[[], bool], *, timeout: float) -> bool:
        """Return True once `condition()` holds (checked now and after each change), or False when it
        still does not after `timeout` seconds."""
        with trio.move_on_after(timeout):
            while not condition():
                await self.wait()
            return True
        return condition()

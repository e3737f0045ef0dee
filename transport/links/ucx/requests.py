"""What a UCX worker has posted and not yet seen complete, and who waits for it: the book and
the waiters of `transport.links.ucx.worker`.

Invariant: a request stays here, with what it reads or writes (its buffer, or what owns the memory an
I/O vector points into), until it is seen completed — UCX may touch that memory until then — and a
request posted straight through UCP (`transport.links.ucx.scatter`) is also listed under its endpoint, so
that disconnecting the endpoint can cancel it (ucxx cancels its own). Completed entries are dropped
lazily, when a list has doubled since the last time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, final

import trio

FIRST_PRUNE: Final = 64
# Requests that never completed before their worker went away, with their memory: UCX may still touch
# both (a scattered receive's I/O vector lives in its request).
ABANDONED: Final[list[tuple[Any, object]]] = []


@final
class RequestBook:
    __slots__ = ("_by_endpoint", "_prune_at", "tracked")

    def __init__(self) -> None:
        self.tracked: list[tuple[Any, object]] = []  # (request, what it reads or writes)
        self._by_endpoint: dict[Any, list[Any]] = {}
        self._prune_at = FIRST_PRUNE

    def track(self, request: Any, keep: object) -> None:
        """Keep `keep` alive until `request` completed."""
        self.tracked.append((request, keep))
        if len(self.tracked) >= self._prune_at:
            self.tracked = [entry for entry in self.tracked if not entry[0].completed]
            self._prune_at = max(FIRST_PRUNE, 2 * len(self.tracked))

    def pending(self) -> bool:
        """Whether a tracked request has not completed yet."""
        return any(not request.completed for request, _keep in self.tracked)

    def add(self, endpoint: Any, requests: Sequence[Any], keep: object) -> None:
        """Track `requests` (posted straight through UCP, on `endpoint`), listed for `cancel`."""
        listed = self._by_endpoint.setdefault(endpoint, [])
        if len(listed) >= self._prune_at:
            listed[:] = [request for request in listed if not request.completed]
        listed.extend(requests)
        for request in requests:
            self.track(request, keep)

    def cancel(self, endpoint: Any) -> None:
        """Ask UCX to cancel what is listed for `endpoint` (each completes, maybe in error, on a later
        progress; those whose bytes are already moving go on until they are in), and forget the list."""
        for request in self._by_endpoint.pop(endpoint, []):
            request.cancel()

    def take_all(self) -> list[tuple[Any, object]]:
        """Every tracked entry, no longer tracked here (the worker's teardown waits for them)."""
        tracked, self.tracked = self.tracked, []
        return tracked


@final
class Waiter:
    """A task waiting for `requests` to complete, in order: the progress loop `advance`s it and sets
    `done` once all have."""

    __slots__ = ("done", "index", "requests")

    def __init__(self, requests: list[Any]) -> None:
        self.requests, self.index, self.done = requests, 0, trio.Event()

    def advance(self) -> bool:
        while self.index < len(self.requests) and self.requests[self.index].completed:
            self.index += 1
        return self.index == len(self.requests)

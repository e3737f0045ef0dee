"""A prefill replica's work queue, and the pure choice of its next batch.

`PromptQueue` is the replica's first-come-first-served queue of requests whose prompt has not started;
its `tokens` (the prompt tokens it holds) is summed here and nowhere else — the replica's snapshot
reports it, the router and the planner read it there. An image request counts its tokens once its
embeddings landed (before, it has none laid out).

`schedule` picks the next batch without touching anything: ready requests first come first served,
until `max_batch_size` sequences or `max_batch_tokens` prompt tokens (a longer prompt runs alone) or the
blocks free in the KV pool run out; requests still waiting for their embeddings, or cancelled, are
skipped, and a request that does not fit is not overtaken.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import final

from replicas.request import ServingRequest


@final
class PromptQueue:
    """See the module docstring. Single Trio thread."""

    def __init__(self) -> None:
        self._queue: deque[ServingRequest] = deque()

    def __iter__(self) -> Iterator[ServingRequest]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __contains__(self, request: object) -> bool:
        return request in self._queue

    @property
    def tokens(self) -> int:
        """The prompt tokens queued (the one place they are summed)."""
        return sum(request.prompt_tokens for request in self._queue)

    def append(self, request: ServingRequest) -> None:
        self._queue.append(request)

    def remove(self, request: ServingRequest) -> None:
        self._queue.remove(request)

    def take_all(self) -> list[ServingRequest]:
        """Empty the queue; returns what it held, in order."""
        taken = list(self._queue)
        self._queue.clear()
        return taken

    def first_ready(self) -> ServingRequest | None:
        """The oldest request that could run now (laid out, not cancelled)."""
        return next((r for r in self._queue if r.prompt_ready and not r.cancelled), None)


def schedule(
    queue: Iterable[ServingRequest],
    *,
    free_blocks: int,
    blocks_for: Callable[[int], int],
    max_batch_size: int,
    max_batch_tokens: int,
) -> list[ServingRequest]:
    """The next batch (see the module docstring); empty when no request is ready or the first does not
    fit. Pure: the caller allocates the blocks and takes the requests off the queue."""
    batch: list[ServingRequest] = []
    tokens = 0
    for request in queue:
        if not request.prompt_ready or request.cancelled:
            continue
        if batch and (len(batch) >= max_batch_size or tokens + request.prompt_tokens > max_batch_tokens):
            break
        need = blocks_for(request.prompt_tokens)
        if need > free_blocks:
            break  # first come, first served: no overtaking the one that does not fit
        batch.append(request)
        tokens += request.prompt_tokens
        free_blocks -= need
    return batch

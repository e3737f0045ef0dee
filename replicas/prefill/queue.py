"""A prefill replica's work queue, and the pure choice of its next batch.

`PromptQueue` is the replica's first-come-first-served queue of requests whose prompt has not started;
its `tokens` (the prompt tokens it holds) is summed here and nowhere else — the replica's snapshot
reports it, the router and the planner read it there. An image request counts its tokens once its
embeddings landed (before, it has none laid out).

`schedule` picks the next batch without touching anything: ready requests first come first served,
until `max_batch_size` sequences or `max_batch_tokens` prompt tokens (a longer piece runs alone) or the
blocks free in the KV pool run out; requests still waiting for their embeddings or a pulled prefix,
or cancelled, are skipped, and a request that does not fit is not overtaken.

Chunked prefill (`chunk_tokens`): a prompt longer than that runs as `Chunk`s of at most `chunk_tokens`
tokens, one per batch; a request whose first chunks ran (`ServingRequest.prefilled`) is queued again at
the front (`push_front`), ahead of the requests that came meanwhile, as vLLM schedules a running
prefill first: a started prompt finishes in as many batches as it has chunks, and the budget its last
chunk leaves goes to the prompts behind it. Queued again at the back, a long prompt's chunks each waited
behind every newer arrival, and a trace's long prompts missed their SLO for it (docs/serving.md). Its
blocks (the whole prompt's) are allocated with its first chunk; the queue's `tokens` counts what is left
to prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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
        """The prompt tokens queued and not prefilled yet (the one place they are summed)."""
        return sum(request.prompt_tokens - request.prefilled for request in self._queue)

    def append(self, request: ServingRequest) -> None:
        self._queue.append(request)

    def push_front(self, requests: Iterable[ServingRequest]) -> None:
        """Queue `requests` ahead of every other, in their order (started prompts' next chunks)."""
        self._queue.extendleft(reversed(list(requests)))

    def remove(self, request: ServingRequest) -> None:
        self._queue.remove(request)

    def take_all(self) -> list[ServingRequest]:
        """Empty the queue; returns what it held, in order."""
        taken = list(self._queue)
        self._queue.clear()
        return taken

    def first_ready(self) -> ServingRequest | None:
        """The oldest request that could run now (laid out, not cancelled)."""
        return next((r for r in self._queue if r.prompt_ready and not r.cancelled and not r.pulling), None)


@final
@dataclass(frozen=True, slots=True)
class Chunk:
    """Prompt tokens `[start, stop)` of `request` to prefill in the next batch (the whole prompt, unless
    chunked); `last`: they end the prompt."""

    request: ServingRequest
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start

    @property
    def last(self) -> bool:
        return self.stop == self.request.prompt_tokens


def schedule(
    queue: Iterable[ServingRequest],
    *,
    free_blocks: int,
    blocks_for: Callable[[int], int],
    max_batch_size: int,
    max_batch_tokens: int,
    chunk_tokens: int | None = None,
) -> list[Chunk]:
    """The next batch (see the module docstring); empty when no request is ready or the first does not
    fit. `chunk_tokens` None: whole prompts. Pure: the caller allocates the blocks and takes the
    requests off the queue."""
    batch: list[Chunk] = []
    tokens = 0
    for request in queue:
        if not request.prompt_ready or request.cancelled or request.pulling:
            continue
        start = request.prefilled
        left = request.prompt_tokens - start
        piece = left if chunk_tokens is None else min(left, chunk_tokens)
        if batch and (len(batch) >= max_batch_size or tokens + piece > max_batch_tokens):
            break
        need = 0 if start else blocks_for(request.prompt_tokens)  # a started prompt holds its blocks
        if need > free_blocks:
            break  # first come, first served: no overtaking the one that does not fit
        batch.append(Chunk(request, start, start + piece))
        tokens += piece
        free_blocks -= need
    return batch

"""A prefill replica's work queue.

`PromptQueue` is the replica's first-come-first-served queue of requests whose prompt has not started
or not finished; its `tokens` (the prompt tokens it holds, less those prefilled) is summed here and
nowhere else — the replica's snapshot reports it, the router and the planner read it there. An image
request counts its tokens once its embeddings landed (before, it has none laid out). The next batch is
chosen from it by `replicas.prefill.schedule.plan_batch`, without touching it.

Chunked prefill (`chunk_tokens`): a prompt longer than that runs as chunks of at most `chunk_tokens`
tokens, one per batch; a request whose first chunks ran (`ServingRequest.prefilled`) is queued again at
the front (`push_front`), ahead of the requests that came meanwhile, as vLLM schedules a running
prefill first: a started prompt finishes in as many batches as it has chunks, and the budget its last
chunk leaves goes to the prompts behind it. Queued again at the back, a long prompt's chunks each waited
behind every newer arrival, and a trace's long prompts missed their SLO for it (docs/serving.md). Its
blocks (the whole prompt's) are allocated with its first chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
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

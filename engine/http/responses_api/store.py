"""Stored responses, so a request can continue one by `previous_response_id`.

What is kept of a response is the response itself (`GET /v1/responses/{id}` answers it) and its
conversation — the messages it was given (without `instructions`, which OpenAI does not carry over)
and the assistant message it answered — as chat messages. The store
is in memory, per node, and bounded: at most `MAX_RESPONSES` (1024) responses, each for at most
`TTL_SECONDS` (one hour) after it was stored, the oldest going first; a node that restarts forgets
them all. A response stored with `store: false` is not kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, final

from messages.openai import ChatMessage
from messages.responses_api.replies import ResponseObject

MAX_RESPONSES: Final = 1024
TTL_SECONDS: Final = 3600.0


@final
class ResponseStore:
    """See the module docstring. `clock` is a monotonic clock in seconds."""

    def __init__(
        self,
        *,
        max_responses: int = MAX_RESPONSES,
        ttl: float = TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max_responses
        self._ttl = ttl
        self._clock = clock
        self._kept: OrderedDict[str, tuple[float, tuple[ChatMessage, ...], ResponseObject | None]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        self._expire()
        return len(self._kept)

    def keep(
        self, response_id: str, conversation: list[ChatMessage], response: ResponseObject | None = None
    ) -> None:
        self._expire()
        self._kept[response_id] = (self._clock() + self._ttl, tuple(conversation), response)
        while len(self._kept) > self._max:
            self._kept.popitem(last=False)

    def conversation(self, response_id: str) -> list[ChatMessage] | None:
        """The stored conversation of `response_id`; None when it is unknown, expired or evicted."""
        self._expire()
        kept = self._kept.get(response_id)
        return None if kept is None else list(kept[1])

    def response(self, response_id: str) -> ResponseObject | None:
        """The stored response `response_id`; None when it is unknown, expired or evicted."""
        self._expire()
        kept = self._kept.get(response_id)
        return None if kept is None else kept[2]

    def _expire(self) -> None:
        now = self._clock()
        while self._kept:
            response_id, (deadline, _, _) = next(iter(self._kept.items()))
            if deadline > now:
                return
            del self._kept[response_id]

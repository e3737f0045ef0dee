"""Encode behaviour and the language side of the embedding transfer.

Image requests are refused with `not_supported` by the router until the EPD issue lands; this holds
the seams the prefill role already calls, doing nothing for text-only requests.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, final

from replicas.request import ServingRequest

if TYPE_CHECKING:
    from replicas.roles import RoleWork


@final
class EncodeWork:
    """The encode role of one replica and the embedding receives of a language replica."""

    def __init__(self, work: RoleWork) -> None:
        self.work = work
        self.queue: deque[ServingRequest] = deque()

    @property
    def idle(self) -> bool:
        return not self.queue

    def enqueue(self, request: ServingRequest) -> None:
        request.holder = self.work.replica.name
        self.queue.append(request)

    def start_job(self) -> None:
        while self.queue:
            request = self.queue.popleft()
            request.fail("not_supported", "image requests are not supported yet")

    def start_receiving(self, request: ServingRequest) -> None:
        request.fail("not_supported", "image requests are not supported yet")

    def receiving(self, request: ServingRequest) -> bool:
        return False

    def release(self, request: ServingRequest) -> None:
        """Free what the request holds in the embedding pool (nothing for text)."""

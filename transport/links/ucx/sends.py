"""A UCX link's sends in flight: what each write posted, until it completed.

Each write's frames are listed as they are posted — their UCX requests, the receipts of read groups
(`transport.links.ucx.reads`), the host chunk a packed bundle was copied into — and settled (waited for) when
the write ends its transfer, when it fails, or when too many chunks are out (`settle_oldest_chunk`). A round
that does not end its transfer leaves its sends listed: the next write posts without waiting.

Waits are shielded and bounded: a request that does not complete within `link_timeout` fails the link
("peer took nothing"), and closing the link ends what is left (disconnecting cancels UCX's requests; the
link fails its receipts). A settle that returns has seen every request complete without error;
otherwise the link is closed and it raises the link's error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, final

import trio

from transport.bulk.staging import HostChunk, HostChunks
from transport.errors import LinkBroken
from transport.links.ucx.library import UcxFailed
from transport.links.ucx.payloads import Chunk
from transport.links.ucx.reads import Receipt
from transport.links.ucx.worker import UcxWorker
from transport.protocol.link import Link

Posted = tuple[list[Any], Chunk | None]


@final
class PostedSends:
    """The sends of `link`'s writes not yet settled (see the module docstring)."""

    def __init__(self, link: Link, worker: UcxWorker, chunks: HostChunks, link_timeout: float) -> None:
        self._link, self._worker, self._chunks, self._timeout = link, worker, chunks, link_timeout
        self.posted: list[Posted] = []

    def chunks_out(self) -> int:
        return sum(chunk is not None for _requests, chunk in self.posted)

    async def wait_all(self) -> None:
        """Until every listed request completed or the link failed (`Link.settle`); they stay listed, so
        the write that settles them still hands their chunks back."""
        await self._await([request for requests, _chunk in self.posted for request in requests])

    async def settle(self, requests: list[Any]) -> None:
        """Until `requests` completed; raises the link's error unless each completed without one."""
        await self._await(requests)
        link = self._link
        try:
            for request in requests:
                if not request.completed:
                    link.raise_closed()
                self._worker.check(request)
        except UcxFailed as exc:
            link.close(LinkBroken(f"link {link.describe()}: send failed: {exc}"))
            link.raise_closed()

    async def settle_all(self) -> None:
        sent, self.posted = self.posted, []
        await self.settle([request for requests, _chunk in sent for request in requests])
        self._give_back(chunk for _requests, chunk in sent)

    async def settle_oldest_chunk(self) -> None:
        index = next(i for i, (_requests, chunk) in enumerate(self.posted) if chunk is not None)
        requests, chunk = self.posted.pop(index)
        await self.settle(requests)
        self._give_back([chunk])

    async def _await(self, requests: list[Any]) -> None:
        link = self._link
        with trio.CancelScope(shield=True):
            for request in requests:
                if request.completed or link.error is not None:
                    continue
                with trio.move_on_after(self._timeout) as scope:
                    await self._worker.wait(
                        [request], check=False, patient=isinstance(request, Receipt) and request.patient
                    )
                if scope.cancelled_caught:
                    link.close(LinkBroken(f"link {link.describe()}: peer took nothing for {self._timeout} s"))

    def _give_back(self, chunks: Iterable[Chunk | None]) -> None:
        for chunk in (c for c in chunks if isinstance(c, HostChunk)):  # device bundles: torch's allocator
            self._chunks.give(chunk)

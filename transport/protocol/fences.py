"""Quarantine until the fence (architecture §5.7): a failed transfer's blocks are not reused while a write
into them may still be in flight.

A fence falls when the sender acknowledges the abort (`AbortAck`, sent after its last write on the
ordered link), or when the link is closed and has quiesced. A sender that does not acknowledge within
`fence_timeout` gets its link torn down, which is a fence too, so blocks come back — unless a closed
link cannot quiesce: a UCX sender process that owes a write it has not made and still exists (stopped,
say) could still make it. Its blocks stay quarantined until it writes or exits; if the endpoint stops
first, `drain` gives up on them (they stay quarantined, and UCX keeps their memory referenced).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import final

import structlog
import trio

from transport.errors import LinkBroken
from transport.memory.blocks import BlockPool
from transport.protocol.link import Link

_log = structlog.get_logger("transport.fences")


@dataclass(slots=True)
class _Fence:
    link: Link
    transfer_id: str
    key: str
    signal: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    quiescing: trio.CancelScope = field(default_factory=trio.CancelScope)


@final
class Fences:
    """The open fences of one endpoint; watchers run in the endpoint's nursery."""

    def __init__(self, pool: BlockPool, fence_timeout: float) -> None:
        self._pool = pool
        self._timeout = fence_timeout
        self._open: dict[tuple[str, str], _Fence] = {}

    def open(
        self, nursery: trio.Nursery, link: Link, transfer_id: str, quarantine: list[int], owner: str
    ) -> trio.Event:
        """Hold `quarantine` (owned by `owner`) until the fence; the returned event is set once no write
        for `transfer_id` can land any more and the blocks are back in the pool."""
        fence = _Fence(link, transfer_id, f"{transfer_id}@{link.link_id}")
        if quarantine:
            self._pool.quarantine(quarantine, owner, fence.key)
        self._open[(link.link_id, transfer_id)] = fence
        if link.is_closed:
            fence.signal.set()
        nursery.start_soon(self._watch, fence)
        return fence.done

    def acknowledged(self, link: Link, transfer_id: str) -> None:
        fence = self._open.get((link.link_id, transfer_id))
        if fence is not None:
            fence.signal.set()

    def link_closed(self, link: Link) -> None:
        for fence in self._open.values():
            if fence.link is link:
                fence.signal.set()

    async def _watch(self, fence: _Fence) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self._timeout):
                await fence.signal.wait()
            if not fence.signal.is_set():
                fence.link.close(
                    LinkBroken(
                        f"link {fence.link.describe()}: no AbortAck for {fence.transfer_id!r} within "
                        f"{self._timeout} s (closed, so its writes stop)"
                    )
                )
            if fence.link.is_closed:
                with fence.quiescing:
                    await fence.link.quiesce()
            if fence.quiescing.cancelled_caught:
                _log.warning(
                    "transfer.fence_abandoned", transfer_id=fence.transfer_id, link=fence.link.link_id
                )
            else:
                self._pool.release_quarantine(fence.key)
            del self._open[(fence.link.link_id, fence.transfer_id)]
            fence.done.set()

    async def drain(self) -> None:
        """Wait (bounded) until every open fence has fallen, then give up on those whose link cannot
        quiesce (their blocks stay quarantined); call after closing the links."""
        with trio.move_on_after(self._timeout + 1):
            for fence in list(self._open.values()):
                await fence.done.wait()
        for fence in list(self._open.values()):
            fence.quiescing.cancel()

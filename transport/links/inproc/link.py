"""The in-process transport: replicas in one process, copies straight between the two pools' tensors.

Control messages travel as objects through a bounded Trio memory channel per direction (one reader per link
end). A bulk write copies run by run from the sender's blocks into the receiver's blocks — never a temporary
gather for large runs, never aliasing one tensor — after the receiver's landing has claimed every run, so no
byte lands outside a standing grant. Rounds of at least `TransferConfig.inproc_thread_bytes` are copied in a
worker thread (torch releases the GIL) through the link's copy lane (`transport.links.inproc.copy_lane`), so
the event loop keeps serving other replicas: the write of a round that does not end its transfer returns once
the round is queued, its `ChunkDone` goes out when the copy is done, and every later message of that end waits
for the lane first, which keeps link order. A copy is never abandoned: `settle`, `quiesce` and the link's
`run` wait for the lane. Pools on a GPU: a round's copies are queued on the device's transfer stream after the
work already queued on the current one (`runs.launch_copy_runs`), and a smaller round's write waits for them
with the event loop going on (`gpu_copy.copies_done`, counted for `quiesce` as the lane is) — never for a
whole stream, where the model steps of other replicas in the process are queued.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Final, final

import outcome
import torch
import trio

from messages.transfer import PeerMessage
from transport.bulk import gpu_copy
from transport.bulk.runs import copy_runs, launch_copy_runs
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig
from transport.errors import LinkBroken, LinkClosed, LinkError
from transport.faults import FaultPlan
from transport.links.in_flight import InFlight
from transport.links.inproc.copy_lane import CopyLane
from transport.protocol.link import Landing, Link, LinkHandler, Role, more_rounds_follow

INBOX_MESSAGES: Final = 1024
_link_numbers = itertools.count(1)


@dataclass(slots=True)
class _Round:
    """A round queued on the copy lane; `error` says why it did not land, once `done` is set."""

    bulk: BulkWrite
    landing: Landing
    trailer: PeerMessage | None
    done: trio.Event = field(default_factory=trio.Event)
    error: LinkError | None = None


@dataclass(frozen=True, slots=True)
class _Listener:
    local: str
    handler: LinkHandler
    on_accept: Callable[[InprocLink], None]
    config: TransferConfig
    faults: FaultPlan


@final
class InprocNetwork:
    """The names of the in-process endpoints that accept links (one per node, or per test)."""

    def __init__(self) -> None:
        self._listeners: dict[str, _Listener] = {}

    def listen(
        self,
        name: str,
        *,
        handler: LinkHandler,
        on_accept: Callable[[InprocLink], None],
        config: TransferConfig,
        faults: FaultPlan,
    ) -> str:
        if name in self._listeners:
            raise ValueError(f"inproc endpoint name {name!r} is already listening")
        self._listeners[name] = _Listener(name, handler, on_accept, config, faults)
        return f"inproc://{name}"

    def unlisten(self, name: str) -> None:
        self._listeners.pop(name, None)

    def connect(
        self, name: str, *, local: str, handler: LinkHandler, config: TransferConfig, faults: FaultPlan
    ) -> InprocLink:
        """The connecting (receiver) end of a new link to `name`; the accepting end goes to its listener."""
        listener = self._listeners.get(name)
        if listener is None:
            raise LinkClosed(f"no inproc endpoint named {name!r} is listening")
        link_id = f"inproc-{next(_link_numbers)}"
        mine = InprocLink(
            link_id=link_id, local=local, role="receiver", handler=handler, config=config, faults=faults
        )
        theirs = InprocLink(
            link_id=link_id,
            local=listener.local,
            role="sender",
            handler=listener.handler,
            config=listener.config,
            faults=listener.faults,
        )
        mine.pair(theirs)
        theirs.pair(mine)
        listener.on_accept(theirs)
        return mine


@final
class InprocLink(Link):
    """One end of an in-process link."""

    def __init__(
        self,
        *,
        link_id: str,
        local: str,
        role: Role,
        handler: LinkHandler,
        config: TransferConfig,
        faults: FaultPlan,
    ) -> None:
        super().__init__(link_id=link_id, local=local, role=role, handler=handler)
        self._config = config
        self._writes = faults.writes()
        self._inbox_send, self._inbox = trio.open_memory_channel[PeerMessage](INBOX_MESSAGES)
        self._other: InprocLink | None = None
        self._lane: CopyLane | None = None  # made on the first large write
        self._device_copies = InFlight()  # small rounds' device copies this end's writes still wait for
        self._reader_scope = trio.CancelScope()
        self._peer_error: LinkError | None = None

    def pair(self, other: InprocLink) -> None:
        self._other = other

    def _check_open(self) -> InprocLink:
        if self.error is not None:
            raise type(self.error)(str(self.error))
        assert self._other is not None
        return self._other

    async def send(self, message: PeerMessage) -> None:
        await self._lane_idle()  # behind the trailers of rounds still being copied
        other = self._check_open()
        try:
            await other._inbox_send.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            error = LinkClosed(f"link {self.describe()}: peer end is closed")
            self.close(error)
            raise error from exc

    async def write(self, bulk: BulkWrite, trailer: PeerMessage | None = None) -> int:
        landing = self._claim(bulk)
        if landing is None:  # the round is gone: nothing lands
            if trailer is not None:
                await self.send(trailer)
            return 0
        if bulk.nbytes < self._config.inproc_thread_bytes:
            _, copying = launch_copy_runs(bulk.source, landing.storage, bulk.runs, bulk.buffers)
            if copying is not None:
                await self._device_copy(copying, bulk.nbytes)
            self._landed(bulk, landing)
            if trailer is not None:
                await self.send(trailer)
            return bulk.nbytes
        if self._lane is None:
            self._lane = CopyLane()
        queued = _Round(bulk, landing, trailer)
        copy = partial(copy_runs, bulk.source, landing.storage, bulk.runs, bulk.buffers)
        self._lane.submit(copy, partial(self._copied, queued))
        if more_rounds_follow(trailer):
            return bulk.nbytes  # not the last round: the session plans the next one meanwhile
        with trio.CancelScope(shield=True):  # a copy in a thread cannot be cancelled
            await queued.done.wait()
        if queued.error is not None:
            raise queued.error
        return bulk.nbytes

    async def settle(self) -> None:
        """See `Link.settle`: the rounds still on this end's copy lane or on its device."""
        await self._copies_idle()

    async def _device_copy(self, copying: torch.cuda.Event, nbytes: int) -> None:
        """Wait for a small round's device copy while the event loop goes on; never abandoned (a
        cancellation is raised once the copy is done), and counted until then for `quiesce`."""
        with self._device_copies.running():
            await gpu_copy.copies_done(copying, nbytes)

    def _claim(self, bulk: BulkWrite) -> Landing | None:
        """The receiver's landing of `bulk`, every run claimed; None when the round is gone."""
        other = self._check_open()
        if other.error is not None:
            raise LinkClosed(f"link {self.describe()}: peer end is closed")
        landing = other.handler.landing(other, bulk.landing_key)
        if landing is None:
            return None
        if landing.storage.layout != bulk.source.layout:
            raise LinkBroken(f"link {self.describe()}: sender and receiver storage layouts differ")
        segments = [(run.dst_row, run.rows) for run in bulk.runs]
        if all(landing.claim(bulk.round, name, segments) for name in bulk.buffers):
            return landing
        return None

    def _landed(self, bulk: BulkWrite, landing: Landing) -> None:
        """After a round's copy: fault injection (corrupt byte, dropped link), then the byte count."""
        if bulk.corrupt and bulk.runs:  # through torch: the pool may be on a GPU
            first = landing.storage.flat(bulk.buffers[0])[bulk.runs[0].dst_row]
            first.view(-1).view(torch.uint8)[:1].bitwise_xor_(0xFF)
        if (limit := self._writes.wrote(bulk.nbytes)) is not None:
            error = LinkBroken(f"link {self.describe()} dropped by fault injection after {limit} bytes")
            self.close(error)
            raise error

    def _copied(self, queued: _Round, copied: outcome.Outcome[object]) -> None:
        """A lane copy ran (in the Trio thread, in queue order): send its trailer now, or fail the link."""
        try:
            if isinstance(copied, outcome.Error):
                detail = f"{type(copied.error).__name__}: {copied.error}"
                raise LinkBroken(
                    f"link {self.describe()}: copying round {queued.bulk.round} failed: {detail}"
                )
            self._landed(queued.bulk, queued.landing)
            if queued.trailer is not None:
                self._send_now(queued.trailer)
        except LinkError as exc:
            self.close(exc)
            queued.error = exc
        finally:
            queued.done.set()

    def _send_now(self, message: PeerMessage) -> None:
        other = self._check_open()
        try:
            other._inbox_send.send_nowait(message)
        except trio.WouldBlock:
            raise LinkBroken(
                f"link {self.describe()}: the peer left {INBOX_MESSAGES} messages unread"
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise LinkClosed(f"link {self.describe()}: peer end is closed") from exc

    async def _lane_idle(self) -> None:
        if self._lane is not None and not self._lane.idle.is_set():
            await self._lane.idle.wait()

    async def _copies_idle(self) -> None:
        """Until no copy of this end's writes still writes into pool memory (lane or device)."""
        await self._lane_idle()
        await self._device_copies.idle.wait()

    async def run(self) -> None:
        try:
            with self._reader_scope:
                async for message in self._inbox:
                    await self.handler.on_message(self, message)
                # The far end closed: like TCP, what it sent before closing was still read.
                self._set_error(self._peer_error or LinkClosed(f"link {self.describe()}: peer closed it"))
        finally:
            with trio.CancelScope(shield=True):  # the copies write into pool memory until then
                await self._copies_idle()
            # Also when the endpoint itself is cancelled: the link's transfers and fences must hear it.
            if self.error is None:
                self.close(LinkClosed(f"link {self.describe()}: its endpoint stopped"))
            assert self.error is not None
            self.handler.on_closed(self, self.error)

    def _set_error(self, error: LinkError) -> bool:
        if self.error is not None:
            return False
        self.error = error
        self.closed.set()
        self.ready.set()
        return True

    def close(self, error: LinkError) -> None:
        if not self._set_error(error):
            return
        self._reader_scope.cancel()
        self._inbox_send.close()
        other = self._other
        if other is not None and other.error is None:
            other._peer_error = type(error)(f"peer: {error}")
            other._inbox_send.close()

    async def quiesce(self) -> None:
        await self._copies_idle()
        if self._other is not None:
            await self._other._copies_idle()

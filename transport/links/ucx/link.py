"""The UCX transport: links over ucxx tag messages, driven from Trio (`transport.links.ucx.worker`).

Links are made by `transport.links.ucx.connect`. On a link (docs/transports.md, "UCX, driven from Trio"):

- Control messages: one UCX message each on the far link's control tag (`transport.links.ucx.frames`).
- Bulk writes: frames (`transport.bulk.frame_plan`), each a descriptor on the control tag and its bytes on
  the bulk tag: a *direct* frame one message per piece, from block (or GPU) memory; *packed* frames
  bundled across buffers, one message per bundle (`transport.links.ucx.payloads`). The reader posts each
  frame's receives where its landing claims them (`transport.links.ucx.landing`), or into a scratch chunk
  when the round is gone, and handles a later peer message only once every earlier frame landed. A
  receiver that reads the sender's memory itself gets *read groups* instead (`transport.links.ucx.reads`).
- `write` returns once every send (and read receipt) completed, `transport.links.ucx.sends` (shielded; the
  link fails when the peer takes nothing for `link_timeout`). Cancellation takes effect between frames.
- Liveness as on tcp (heartbeats; UCX's shared-memory transports refuse peer-failure handling); a
  closing peer says `goodbye`.
- `quiesce` returns once nothing can write block memory any more (see its docstring).
"""

from __future__ import annotations

import array
import itertools
import math
from collections import deque
from typing import Any, Final, final

import structlog
import torch
import trio

from messages.layout import PoolLayout
from messages.peer_codec import PeerCodecError
from messages.transfer import PeerMessage
from transport.bulk.device_bundles import RoundWork, bundles_on_device, gather, written
from transport.bulk.frame_plan import Frame
from transport.bulk.staging import HostChunks
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig, UcxCopies
from transport.errors import LinkBroken, LinkClosed, LinkError
from transport.faults import FaultPlan
from transport.links.in_flight import InFlight
from transport.links.ucx.cma import CmaFailed
from transport.links.ucx.frames import (
    DESCRIPTOR,
    GOODBYE,
    MESSAGE,
    READS,
    RECEIPT,
    Descriptor,
    UcxFrameError,
    descriptor_body,
    goodbye_body,
    kind_of,
    message_body,
    parse_descriptors,
    parse_goodbye,
    parse_message,
    parse_receipt,
    receipt_body,
)
from transport.links.ucx.landing import Landing, direct, into_device, land, scattered, settle, through_chunk
from transport.links.ucx.library import UcxFailed
from transport.links.ucx.payloads import Chunk, frame_payloads, shortened
from transport.links.ucx.peer_process import process_gone
from transport.links.ucx.reads import Receipts, read_group, write_plan
from transport.links.ucx.sends import PostedSends
from transport.links.ucx.worker import BULK, CONTROL, LISTENER, Arrival, UcxWorker, tag
from transport.protocol.link import Link, LinkHandler, Role, keep_alive, more_rounds_follow

PACKED_WINDOW: Final = 4
_link_numbers = itertools.count(1)
_log = structlog.get_logger("transport.ucx")


@final
class UcxLink(Link):
    """One end of a UCX link (see the module docstring)."""

    def __init__(
        self,
        worker: UcxWorker,
        *,
        local: str,
        role: Role,
        handler: LinkHandler,
        layout: PoolLayout,
        config: TransferConfig,
        faults: FaultPlan,
    ) -> None:
        super().__init__(link_id=f"ucx-{next(_link_numbers)}", local=local, role=role, handler=handler)
        self._worker, self._layout, self._config, self._faults = worker, layout, config, faults.writes()
        self._buffer_index = {spec.name: index for index, spec in enumerate(layout.buffers)}
        self._row_bytes = [spec.bytes_per_token for spec in layout.buffers]
        self._inbox_send, self._inbox = trio.open_memory_channel[Arrival](math.inf)
        self.number = worker.register(self._arrive)
        self._endpoint: Any = None
        self._peer_number = LISTENER
        self._peer_pid: int | None = None
        self.copies: UcxCopies = "receiver"  # who copies what into host rows (`accepted`)
        self._reads_from: int | None = None  # the sender process this receiving side reads
        self._peer_reads = (
            False  # this sending side's peer reads its host pieces (`transport.links.ucx.reads`)
        )
        self._receipts = Receipts()
        self._scope = trio.CancelScope()
        self._chunks = HostChunks()
        self._landing: deque[Landing] = deque()
        self._landing_now = InFlight()  # a landing being unpacked or scattered
        self._sends = PostedSends(self, worker, self._chunks, config.link_timeout)
        self._last_received = self._last_sent = trio.current_time()
        self._work = RoundWork()  # what a round's direct GPU pieces wait for
        self._silent_close = False

    def attach(self, endpoint: Any, peer_number: int) -> None:
        """Talk to the far link `peer_number` (its listener, `LISTENER`, until accepted) over `endpoint`."""
        self._endpoint, self._peer_number = endpoint, peer_number

    def accepted(self, peer_number: int, peer_pid: int | None, reads: bool = False) -> None:
        """The sender accepted as link `peer_number`; `peer_pid`: its process, when on this host (the
        fence for scattered receives, `quiesce`: only such a sender gets them, as `ucx_copies` says);
        `reads`: this side reads its host pieces (`transport.links.ucx.reads`; "mixed" otherwise)."""
        self._peer_number, self._peer_pid = peer_number, peer_pid
        self._reads_from = peer_pid if reads else None
        copies = self._config.ucx_copies if peer_pid is not None else "receiver"
        self.copies = "mixed" if copies == "cma" and not reads else copies

    def _arrive(self, arrival: Arrival) -> None:
        # Any arrival is liveness, even while the reader waits for bulk bytes.
        self._last_received = trio.current_time()
        if self.error is None:
            self._inbox_send.send_nowait(arrival)

    async def next_body(self) -> bytearray:
        """The next control body, read before `run` starts (the connect handshake)."""
        arrival = await self._inbox.receive()
        await self._worker.wait([arrival.request])
        return arrival.body

    # ------------------------------------------------------------------ closing
    def close(self, error: LinkError) -> None:
        if self.error is not None:
            return
        self.error = error
        self.closed.set()
        self.ready.set()
        self._scope.cancel()
        self._inbox_send.close()
        self._worker.unregister(self.number)
        self._receipts.fail_all(str(error))
        if self._endpoint is None:
            return
        if not self._silent_close:
            try:
                self._worker.send(self._endpoint, tag(self._peer_number, CONTROL), goodbye_body(str(error)))
            except UcxFailed as exc:
                _log.info("transfer.ucx_goodbye_unsent", link=self.describe(), error=str(exc))
        self._worker.disconnect(self._endpoint)

    async def quiesce(self) -> None:
        """Once closed: every receive posted into block memory completed, was cancelled, or was scattered
        for a sender process that has exited (receives into a chunk or a device bundle write no block).
        Cancellable (a stopped sender process keeps it waiting): the caller decides how long."""
        await self.closed.wait()
        await self._landing_now.idle.wait()  # a device bundle's scatter into rows, begun before the close
        peer = self._peer_pid
        into_rows = [landing for landing in self._landing if landing.chunk is None]  # not a chunk's
        if not await settle(self._worker, into_rows, lambda: bool(peer and process_gone(peer))):
            _log.warning("transfer.ucx_writer_gone", link=self.describe(), pid=peer)

    def _ensure_open(self) -> None:
        if self.error is not None:
            self.raise_closed()

    # ------------------------------------------------------------------ sending
    async def send(self, message: PeerMessage) -> None:
        await self.post_control(message_body(message))

    async def post_control(self, body: bytes) -> None:
        """Send one control body to the far link (or its listener, before `accept`)."""
        self._ensure_open()
        await self._sends.settle([self._post(CONTROL, body)])

    async def settle(self) -> None:
        """See `Link.settle`: the sends of rounds whose `write` returned early."""
        await self._sends.wait_all()

    async def write(self, bulk: BulkWrite, trailer: PeerMessage | None = None) -> int:
        """See `Link.write`. The sends of a round that does not end its transfer may still be in flight
        when this returns — UCX reads its rows until they complete, and the sending session keeps its
        allocation until `send` returns — so the next round is posted without a bubble; the round whose
        `ChunkDone` ends the stream (or any write that fails) waits for every send still in flight."""
        self._ensure_open()
        on_device = bundles_on_device(bulk.source.device, self._worker.cuda_capable)
        sends = self._sends
        corrupt, defer = bulk.corrupt, False
        try:
            faulty = bulk.corrupt or self._faults.shortens
            reads = self._peer_reads and not faulty  # a fault corrupts or shortens a message, not a read
            plan = write_plan(bulk, self._buffer_index, self._row_bytes, reads, self._worker.cuda_capable)
            for is_read_group, bundle in plan:
                while sends.chunks_out() >= PACKED_WINDOW:
                    await sends.settle_oldest_chunk()
                short = self._check_faults(sum(frame.length for frame in bundle))
                if is_read_group:
                    sends.posted.append(self._post_reads(bulk, bundle))
                    continue
                gathered = None
                if not bundle[0].packed:  # UCX reads a GPU pool's rows itself: after whatever wrote them
                    await written(self._work.event(bulk.source.device, bulk.landing_key, bulk.round), 0)
                elif on_device:
                    gathered = await gather(bulk.source, bundle, corrupt)
                sends.posted.append(self._post_frames(bulk, bundle, corrupt, gathered, short))
                corrupt = False
                # The worker's progress moves what is posted (a gathered send is copied by this process)
                # while later frames are planned: kv 64 MiB went from 0.60-0.67 to 0.67-0.75 of raw.
                await trio.lowlevel.checkpoint()
            if trailer is not None:
                sends.posted.append(([self._post(CONTROL, message_body(trailer))], None))
            defer = more_rounds_follow(trailer)
        finally:
            if not defer:
                with trio.CancelScope(shield=True):
                    await sends.settle_all()
        return bulk.nbytes

    def _post_reads(self, bulk: BulkWrite, frames: list[Frame]) -> tuple[list[Any], Chunk | None]:
        """A read group's descriptor, and the receipt its rows wait for."""
        wrong = self._faults.misaddressed_due()  # no process maps page 0
        bases = [0 if wrong else bulk.source.tensors[frame.name].data_ptr() for frame in frames]
        nbytes = sum(frame.length for frame in frames)
        receipt = self._receipts.expect(len(frames), nbytes)
        request = self._post(CONTROL, descriptor_body(frames, bulk.landing_key, bulk.round, bases))
        self._faults.written += nbytes
        return [request, receipt], None

    def _post(self, kind: int, body: object, keep: object = None) -> Any:
        """Post `body` on the far link's `kind` tag; with `keep`, `body` is an I/O vector over memory that
        `keep` owns (a gathered send)."""
        to, worker = tag(self._peer_number, kind), self._worker
        try:
            if keep is None:
                request = worker.send(self._endpoint, to, body)
            else:
                assert isinstance(body, array.array)
                request = worker.send_gathered(self._endpoint, to, body, keep)
        except UcxFailed as exc:
            self.close(LinkBroken(f"link {self.describe()}: {exc}"))
            self.raise_closed()
        self._last_sent = trio.current_time()
        return request

    def _post_frames(
        self, bulk: BulkWrite, frames: list[Frame], corrupt: bool, gathered: torch.Tensor | None, short: bool
    ) -> tuple[list[Any], Chunk | None]:
        """Post one direct frame, or a bundle of packed ones (`gathered` on the device already): bytes made
        ready, then descriptor and bytes with no await in between (see `write`); a descriptor whose
        bytes never follow holds the peer's reader, so a failure after it closes the link. `short`: the
        last message goes a byte short (fault injection)."""
        payloads, chunk, length = frame_payloads(bulk, frames, corrupt, gathered, self._chunks)
        if short:
            payloads[-1] = shortened(*payloads[-1])
        requests = [self._post(CONTROL, descriptor_body(frames, bulk.landing_key, bulk.round))]
        try:
            requests.extend(self._post(BULK, body, keep) for body, keep in payloads)
        except BaseException as exc:
            self.close(LinkBroken(f"link {self.describe()}: a frame's bytes not posted: {exc!r}"))
            raise
        self._faults.written += length
        return requests, chunk

    def _check_faults(self, length: int) -> bool:
        """The faults due before a frame of `length` bytes; True: send it short."""
        if self._faults.malformed_due():
            self._post(CONTROL, b"\xde\xad" * 16)
        if (drop_at := self._faults.drop_due(length)) is not None:
            self._silent_close = True  # torn down mid-frame: the peer hears nothing more
            error = LinkBroken(f"link {self.describe()} dropped by fault injection after {drop_at} bytes")
            self.close(error)
            raise error
        return self._faults.short_due()

    # ------------------------------------------------------------------ receiving
    async def run(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        keep_alive, self, self._config, lambda: self._last_received, lambda: self._last_sent
                    )
                    await self._read()
                    nursery.cancel_scope.cancel()
        finally:
            # Also when the endpoint itself is cancelled: the link's transfers and fences must hear it.
            if self.error is None:
                self.close(LinkClosed(f"link {self.describe()}: its endpoint stopped"))
            assert self.error is not None
            self.handler.on_closed(self, self.error)

    async def _read(self) -> None:
        try:
            async for first in self._inbox:
                arrival: Arrival | None = first
                while arrival is not None:  # what already arrived is read without a trio turn each
                    await self._read_one(arrival)
                    arrival = self._arrived()
        except (UcxFrameError, PeerCodecError) as exc:
            self.close(LinkBroken(f"link {self.describe()}: malformed frame from the peer: {exc}"))
        except UcxFailed as exc:
            self.close(LinkBroken(f"link {self.describe()}: receive failed: {exc}"))
        except CmaFailed as exc:
            self.close(LinkBroken(f"link {self.describe()}: cannot read the sender's rows: {exc}"))
        except LinkError as exc:
            self.close(exc)

    def _arrived(self) -> Arrival | None:
        try:
            return self._inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None

    async def _read_one(self, arrival: Arrival) -> None:
        await self._worker.wait([arrival.request])
        body = arrival.body
        kind = kind_of(body, (DESCRIPTOR, MESSAGE, GOODBYE, RECEIPT, READS))
        if kind == RECEIPT:
            self._receipts.answered(parse_receipt(body))
            self._worker.kick()  # a write's settle waits on the worker's waiters
        elif kind == READS:
            self._peer_reads = self.role == "sender"
        elif kind == DESCRIPTOR:
            await self._receive_frames(parse_descriptors(body, self._row_bytes))
        elif kind == MESSAGE:
            message = parse_message(body)
            await self._land_all()
            await self.handler.on_message(self, message)
            await trio.lowlevel.checkpoint()  # let whoever the message woke run first
        else:
            self._silent_close = True
            self.close(LinkClosed(f"link {self.describe()}: the peer closed it ({parse_goodbye(body)})"))

    async def _receive_frames(self, frames: list[Descriptor]) -> None:
        """Post a descriptor's receives (`transport.links.ucx.landing`): scattered or direct into block memory
        when the landing claims every frame, through a host chunk otherwise."""
        first, worker, endpoint = frames[0], self._worker, self._endpoint
        landing = self.handler.landing(self, first.landing_key)
        names = [self._layout.buffers[frame.buffer].name for frame in frames]
        if first.read:
            if self._reads_from is None:
                raise UcxFrameError("read frames to a receiver that does not read")
            lanes = self._config.ucx_read_lanes
            await read_group(self._reads_from, landing, frames, names, self._ensure_open, lanes=lanes)
            self._post(CONTROL, receipt_body(len(frames)))
            return
        claims = [
            landing is not None and landing.claim(f.round, n, f.segments) for f, n in zip(frames, names)
        ]
        on, on_device = tag(self.number, BULK), False
        if landing is not None and all(claims):
            storage = landing.storage
            copies = self.copies  # scattered: bundles unless "receiver", direct frames with "sender"
            if storage.device.type == "cpu" and (
                copies == "sender" or (copies != "receiver" and first.packed)
            ):
                scattered(worker, endpoint, on, storage, frames, names, self._row_bytes, self._landing)
                return
            if not first.packed and (storage.device.type == "cpu" or worker.cuda_capable):
                await written(self._work.event(storage.device, first.landing_key, first.round), 0)
                self._ensure_open()  # GPU rows, which nothing reads any more: not after a close
                direct(worker, endpoint, on, storage, first, names[0], self._landing)
                return
            on_device = bundles_on_device(storage.device, worker.cuda_capable)
        while sum(pending.chunk is not None for pending in self._landing) >= PACKED_WINDOW:
            await self._land_oldest()
        if on_device and landing is not None:
            into_device(worker, endpoint, on, frames, landing.storage, names, self._landing)
            return
        targets = [
            (landing.storage, name) if claimed and landing is not None else None
            for name, claimed in zip(names, claims, strict=True)
        ]
        through_chunk(worker, endpoint, on, self._chunks, frames, targets, self._row_bytes, self._landing)

    async def _land_oldest(self) -> None:
        pending = self._landing[0]
        await self._worker.wait(pending.requests)
        self._ensure_open()  # its wait may have ended as the link closed: `quiesce` has not waited for it
        self._landing.popleft()
        self._last_received = trio.current_time()
        with self._landing_now.running():
            await land(pending, self._chunks)  # a device bundle's scatter is awaited, also if cancelled

    async def _land_all(self) -> None:
        while self._landing:
            await self._land_oldest()

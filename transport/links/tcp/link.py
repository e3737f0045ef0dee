"""The TCP transport: between processes, or between replicas of one process over loopback.

Sockets are plain non-blocking stdlib sockets driven by `trio.lowlevel.wait_readable/wait_writable`: a
`recv_into` or `sendmsg` is tried first and the task waits only when the kernel says EAGAIN, which is
what makes a trio reader keep up with a blocking raw-socket loop.

- One reader per link (`run`), started in the endpoint's nursery and cancelled only when the link
  closes. It reads each frame's header (`transport.links.tcp.frames`); a bulk frame's segments are checked
  against the endpoint's landing and its payload scatter-read straight into the receiver's block memory
  (or into a scratch buffer when that round is gone); control frames are decoded with
  `messages.peer_codec`. Each read also takes up to `AHEAD_BYTES` of what follows, so the small frames
  of a round after its large payload (and its ChunkDone) are parsed without a syscall each.
- Writers (bulk rounds, control messages, heartbeats) share one FIFO lock per batch of frames. A batch
  the kernel takes whole while no one writes goes out at once, without a Trio turn; otherwise the writer
  holds the lock in a shielded scope with a deadline: a frame is never half-written on a link that stays
  open, and a peer that stops reading breaks the link after `link_timeout` instead of hanging the writer.
  Sockets are opened, accepted and connected in `transport.links.tcp.sockets`.
- Heartbeats: a link quiet for `heartbeat_interval` sends one; a link that received nothing for
  `link_timeout` is broken. Any received byte counts as liveness.
- Pools on a GPU: each bulk frame goes through a pinned host chunk (`transport.bulk.staging`): packed from
  the device before it is sent, scattered onto it once read.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Final, NoReturn, final

import structlog
import trio

from messages.layout import PoolLayout
from messages.peer_codec import PeerCodecError, decode_peer, encode_peer
from messages.transfer import PeerMessage
from transport.bulk.frame_plan import MAX_SEGMENTS, SEGMENT, Buffer, buffer_frames, packed_only
from transport.bulk.staging import HostChunk, HostChunks, unpack
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig
from transport.errors import LinkBroken, LinkClosed, LinkError
from transport.faults import FaultPlan
from transport.links.tcp.frames import (
    CONTROL,
    HEADER_BYTES,
    FrameError,
    FrameHeader,
    bulk_frame,
    control_header,
    parse_header,
    parse_segments,
    staged_tcp_frames,
)
from transport.links.tcp.sockets import LinkSocket
from transport.links.tcp.sockets import accept as accept
from transport.links.tcp.sockets import connect as connect
from transport.links.tcp.sockets import listen_socket as listen_socket
from transport.memory.storage import PoolStorage
from transport.protocol.link import POLL_SECONDS, Link, LinkHandler, LinkOwner, Role, keep_alive

IOV_MAX: Final = 1024
BATCH_BYTES: Final = 8 * 1024 * 1024
SCRATCH_BYTES: Final = 1024 * 1024
AHEAD_BYTES: Final = 64 * 1024
YIELD_EVERY_BYTES: Final = 4 * 1024 * 1024
_link_numbers = itertools.count(1)
_log = structlog.get_logger("transport.tcp")


def new_link_id() -> str:
    return f"tcp-{next(_link_numbers)}"


def tcp_link(sock: LinkSocket, owner: LinkOwner, role: Role) -> TcpLink:
    """A link of endpoint `owner` (its layout, settings and faults) over the connected `sock`."""
    return TcpLink(
        sock,
        link_id=new_link_id(),
        local=owner.name,
        role=role,
        handler=owner,
        layout=owner.storage.layout,
        config=owner.config,
        faults=owner.faults,
    )


@final
class TcpLink(Link):
    """One end of a TCP link; owns its socket."""

    def __init__(
        self,
        sock: LinkSocket,
        *,
        link_id: str,
        local: str,
        role: Role,
        handler: LinkHandler,
        layout: PoolLayout,
        config: TransferConfig,
        faults: FaultPlan,
    ) -> None:
        super().__init__(link_id=link_id, local=local, role=role, handler=handler)
        self._sock = sock
        self._layout = layout
        self._buffer_index = {spec.name: index for index, spec in enumerate(layout.buffers)}
        self._row_bytes = [spec.bytes_per_token for spec in layout.buffers]
        self._table = memoryview(bytearray(MAX_SEGMENTS * SEGMENT.size))
        self._config = config
        self._faults = faults.writes()
        self._send_lock = trio.StrictFIFOLock()
        self._scope = trio.CancelScope()
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._ahead = memoryview(bytearray(AHEAD_BYTES))  # bytes read past the current frame
        self._ahead_at = self._ahead_end = 0
        self._last_received, self._bytes_at = trio.current_time(), time.perf_counter()
        self._last_sent = trio.current_time()
        self._read_since_yield = 0
        self._chunks = HostChunks()  # pools on a GPU go through pinned host chunks (transport.bulk.staging)
        self._staged: tuple[PoolStorage, str, list[tuple[int, int]], HostChunk] | None = None

    # ------------------------------------------------------------------ closing
    def close(self, error: LinkError) -> None:
        if self.error is not None:
            return
        self.error = error
        self.closed.set()
        self.ready.set()
        self._scope.cancel()
        trio.lowlevel.notify_closing(self._sock)
        self._sock.close()

    async def quiesce(self) -> None:
        # The reader is the only thing that writes into receiver memory, and it stops when the
        # socket closes: a closed TCP link has nothing in flight.
        await self.closed.wait()

    # ------------------------------------------------------------------ sending
    async def send(self, message: PeerMessage) -> None:
        body = encode_peer(message)
        await self._send_batch([control_header(len(body)), body])

    async def write(self, bulk: BulkWrite, trailer: PeerMessage | None = None) -> int:
        if bulk.source.device.type != "cpu":
            return await self._write_staged(bulk, trailer)
        parts: list[Buffer] = []
        batch_bytes = 0
        corrupt = bulk.corrupt
        for frame in buffer_frames(bulk, self._buffer_index, self._row_bytes, packed_only):
            parts += bulk_frame(bulk, frame, corrupt)
            corrupt = False
            batch_bytes += frame.length
            if batch_bytes >= BATCH_BYTES or len(parts) >= IOV_MAX:
                await self._send_bulk(parts, batch_bytes)
                parts, batch_bytes = [], 0
        if trailer is not None:
            body = encode_peer(trailer)
            parts += (control_header(len(body)), body)
        if parts:
            await self._send_bulk(parts, batch_bytes)
        return bulk.nbytes

    async def _write_staged(self, bulk: BulkWrite, trailer: PeerMessage | None) -> int:
        """A pool on a GPU: each frame is packed into a pinned host chunk, and sent before the next."""
        chunk, corrupt = self._chunks.take(), bulk.corrupt
        for name in bulk.buffers:
            index = self._buffer_index[name]
            for parts, length in staged_tcp_frames(bulk, index, name, self._row_bytes[index], chunk, corrupt):
                corrupt = False
                await self._send_bulk(parts, length)
        self._chunks.give(chunk)
        if trailer is not None:
            await self.send(trailer)
        return bulk.nbytes

    async def _send_bulk(self, parts: list[Buffer], payload_bytes: int) -> None:
        faults = self._faults
        if (drop_at := faults.drop_due(payload_bytes)) is not None:
            await self._send_batch(parts[:1])
            error = LinkBroken(f"link {self.describe()} dropped by fault injection after {drop_at} bytes")
            self.close(error)
            raise error
        if faults.malformed_due():
            parts = [b"\xde\xad" * (HEADER_BYTES // 2), *parts]
        await self._send_batch(parts)
        faults.written += payload_bytes

    async def _send_batch(self, parts: Sequence[Buffer]) -> None:
        if self.error is not None:
            self.raise_closed()
        pending, first = list(parts), 0
        if self._send_lock.locked():
            await self._send_lock.acquire()
        else:
            # Nobody is writing: hand the batch to the kernel now, without a Trio turn (a grant or a
            # ChunkDone costs one syscall); nothing interleaves before it returns or holds the lock.
            first = self._send_ready(pending, 0)
            if first == len(pending):
                return
            self._send_lock.acquire_nowait()  # the socket is full: wait for it holding the lock
        try:
            timeout = self._config.link_timeout
            with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout) as scope:
                while (first := self._send_ready(pending, first)) < len(pending):
                    try:
                        await trio.lowlevel.wait_writable(self._sock)
                    except trio.ClosedResourceError as exc:
                        self._send_failed(exc)
            if scope.cancelled_caught:
                self.close(LinkBroken(f"link {self.describe()}: peer stopped reading for {timeout} s"))
        finally:
            self._send_lock.release()
        if self.error is not None:
            self.raise_closed()

    def _send_ready(self, parts: list[Buffer], first: int) -> int:
        """`sendmsg` `parts[first:]` until all went out or the socket is full; the first unsent index."""
        while first < len(parts):
            try:
                sent = self._sock.sendmsg(parts[first : first + IOV_MAX])
            except BlockingIOError:
                return first
            except OSError as exc:
                self._send_failed(exc)
            self._last_sent = trio.current_time()
            while sent:
                size = len(parts[first])
                if sent >= size:
                    sent -= size
                    first += 1
                else:
                    parts[first] = memoryview(parts[first])[sent:]
                    sent = 0
        return first

    def _send_failed(self, exc: BaseException) -> NoReturn:
        self.close(LinkBroken(f"link {self.describe()}: send failed: {exc!r}"))
        self.raise_closed()

    # ------------------------------------------------------------------ receiving
    async def run(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        keep_alive,
                        self,
                        self._config,
                        lambda: self._last_received,
                        lambda: self._last_sent,
                        lambda: not self._send_lock.locked(),
                    )
                    await self._read_frames()
                    nursery.cancel_scope.cancel()
        finally:
            # Also when the endpoint itself is cancelled: the link's transfers and fences must hear it.
            if self.error is None:
                self.close(LinkClosed(f"link {self.describe()}: its endpoint stopped"))
            self._sock.close()
            assert self.error is not None
            self.handler.on_closed(self, self.error)

    async def _read_frames(self) -> None:
        header = memoryview(bytearray(HEADER_BYTES))
        try:
            while True:
                await self._recv_into([header])
                frame = parse_header(header)
                if frame.kind == CONTROL:
                    body = bytearray(frame.length)
                    await self._recv_into([memoryview(body)])
                    await self.handler.on_message(self, decode_peer(body))
                    # Let whoever the message woke (a granter, a consumer) run before more bulk
                    # bytes: bulk reads rarely block, so without this they would wait megabytes.
                    self._read_since_yield = 0
                    await trio.lowlevel.checkpoint()
                    continue
                table = self._table[: frame.segments * SEGMENT.size]
                await self._recv_into([table])
                targets = self._bulk_targets(frame, table)
                if targets is None:
                    await self._discard(frame.length)
                else:
                    await self._recv_into(targets)
                    self._land_staged()
        except (FrameError, PeerCodecError) as exc:
            self.close(LinkBroken(f"link {self.describe()}: malformed frame from the peer: {exc}"))
        except LinkError as exc:
            self.close(exc)
        except OSError as exc:
            self.close(LinkBroken(f"link {self.describe()}: receive failed: {exc!r}"))
        except trio.ClosedResourceError:
            if self.error is None:
                self.close(LinkClosed(f"link {self.describe()}: socket closed"))

    def _bulk_targets(self, frame: FrameHeader, table: memoryview) -> list[memoryview] | None:
        """The receiver memory of each segment, or None to discard the frame (round gone or refused)."""
        if frame.buffer >= len(self._row_bytes):
            raise FrameError(
                f"bulk frame for buffer {frame.buffer}; the layout has {len(self._row_bytes)} buffers"
            )
        row_bytes = self._row_bytes[frame.buffer]
        segments = parse_segments(table, frame.segments, row_bytes, frame.length)
        landing = self.handler.landing(self, frame.landing_key)
        name = self._layout.buffers[frame.buffer].name
        if landing is None or not landing.claim(frame.round, name, segments):
            return None
        if landing.storage.device.type != "cpu":  # a pool on a GPU: through a pinned host chunk
            chunk = self._chunks.take(frame.length)
            self._staged = (landing.storage, name, segments, chunk)
            return [chunk.view[: frame.length]]
        memory = landing.storage.buffer_bytes(name)
        return [memory[row * row_bytes : (row + rows) * row_bytes] for row, rows in segments]

    def _land_staged(self) -> None:
        if self._staged is not None:
            storage, name, segments, chunk = self._staged
            self._staged = None
            unpack(storage, name, segments, chunk)
            self._chunks.give(chunk)

    async def _discard(self, length: int) -> None:
        while length:
            chunk = min(length, len(self._scratch))
            length -= chunk
            await self._recv_into([self._scratch[:chunk]])

    async def _recv_into(self, views: list[memoryview]) -> None:
        """Fill `views` exactly, in order: first from the bytes read ahead, then from the socket. Each
        `recvmsg_into` scatters one kernel read over the views and then the read-ahead buffer, so the
        frames that follow (the rest of a round: small frames, its ChunkDone) cost no syscall of their
        own, and payloads still land straight in block memory (no copy but the read-ahead bytes)."""
        views, first = self._take_ahead(views), 0
        end = len(views)
        while first < end:
            try:
                count = self._sock.recvmsg_into([*views[first:], self._ahead])[0]
            except BlockingIOError:
                self._read_since_yield = 0
                if time.perf_counter() - self._bytes_at < POLL_SECONDS:
                    await trio.lowlevel.checkpoint()
                else:
                    await trio.lowlevel.wait_readable(self._sock)
                continue
            if count == 0:
                raise LinkClosed(f"link {self.describe()}: the peer closed the connection")
            self._bytes_at = time.perf_counter()
            self._read_since_yield += count
            while first < end and count >= (size := len(views[first])):
                count -= size
                first += 1
            if first < end:
                views[first] = views[first][count:]
            else:
                self._ahead_at, self._ahead_end = 0, count  # it was empty: the views came first
        self._last_received = trio.current_time()
        if self._read_since_yield >= YIELD_EVERY_BYTES:
            self._read_since_yield = 0
            await trio.lowlevel.checkpoint()

    def _take_ahead(self, views: list[memoryview]) -> list[memoryview]:
        """Fill `views` from the read-ahead bytes as far as they go; the (parts of) views still empty."""
        left = [view for view in views if len(view)]  # a 0 from the kernel must mean EOF
        first = 0
        while first < len(left) and self._ahead_at < self._ahead_end:
            size = min(len(left[first]), self._ahead_end - self._ahead_at)
            left[first][:size] = self._ahead[self._ahead_at : self._ahead_at + size]
            self._ahead_at += size
            if size == len(left[first]):
                first += 1
            else:
                left[first] = left[first][size:]
        return left[first:]

"""The cuda-ipc transport: replicas on one host whose pools are on GPUs; the sender copies
straight into the receiver's pool, device to device.

- Address `cuda-ipc://host:port`, a TCP listener. Control messages travel over a `TcpLink` on that
  socket (frames, heartbeats, liveness: everything as on tcp); this link wraps it.
- Connecting: before the first TCP frame the receiver shares its pool (`transport.links.cuda_ipc.share`: one
  CUDA IPC handle per buffer, the host's boot id) and the sender answers with a verdict — it maps the
  pool, or refuses naming why (another host, its own pool not on a GPU, a handle that will not open):
  `HandshakeRefused` on the receiver's side. Then the handshake of architecture §5.1 runs as on any link.
- Bulk writes (sender): per buffer, the round's runs are copied from the sender's pool into the mapped
  receiver pool on the link's own CUDA stream (`copy_rows`), a CUDA event is recorded after them, and
  `write` waits for it in a worker thread — never abandoned, so cancellation waits for the copy — before
  the round's `ChunkDone` goes out. The event is the write fence of architecture §5.7: `ChunkDone` and
  `AbortAck` follow completed copies only, and `quiesce` waits for copies in flight. Once the link is
  closed, the fence is the end of its TCP connection, which the sender ends only after its copies
  (`transport.links.cuda_ipc.socket_fence`).
- The receiver is written from the other process, so its landing cannot refuse bytes before they land:
  the sender writes only rows its grants name (checked against the mapped pool's size), and a failed
  round's blocks stay quarantined until the fence, as on every transport.
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
from collections.abc import Callable
from typing import final

import msgspec
import structlog
import torch
import trio

from messages.cuda_ipc import ShareVerdict
from messages.transfer import PeerMessage
from transport.auth.credentials import LinkAdmission
from transport.bulk import gpu_copy
from transport.bulk.write import BulkWrite
from transport.errors import HandshakeRefused, LinkBroken, LinkClosed, LinkError
from transport.faults import NO_FAULTS
from transport.links.cuda_ipc.share import (
    RowIndices,
    ShareRefused,
    copy_rows,
    decode_share,
    decode_verdict,
    open_share,
    receive_setup,
    send_setup,
    share_pool,
)
from transport.links.cuda_ipc.socket_fence import SocketFence
from transport.links.in_flight import InFlight
from transport.links.tcp import admission as tcp_admission
from transport.links.tcp import link as tcp
from transport.protocol.link import Landing, Link, LinkHandler, LinkOwner, Role

_link_numbers = itertools.count(1)
_log = structlog.get_logger("transport.cuda_ipc")


@final
class _Forward:
    """The inner TCP link's handler: what it reports is about the cuda-ipc link that wraps it."""

    def __init__(self, outer: CudaIpcLink, handler: LinkHandler) -> None:
        self._outer, self._handler = outer, handler

    async def on_message(self, link: Link, message: PeerMessage) -> None:
        await self._handler.on_message(self._outer, message)

    def landing(self, link: Link, landing_key: int) -> Landing | None:
        return self._handler.landing(self._outer, landing_key)

    def on_closed(self, link: Link, error: LinkError) -> None:
        self._outer.closed_with(error)
        self._handler.on_closed(self._outer, error)


@final
class CudaIpcLink(Link):
    """One end of a cuda-ipc link; `remote` (sender end only) is the receiver's pool, mapped."""

    lands_in_named_storage = False  # the sender writes into the receiving pool it mapped

    def __init__(
        self,
        sock: socket.socket,
        endpoint: LinkOwner,
        *,
        role: Role,
        remote: dict[str, torch.Tensor] | None,
    ) -> None:
        link_id = f"cuda-ipc-{next(_link_numbers)}"
        super().__init__(link_id=link_id, local=endpoint.name, role=role, handler=endpoint)
        self._control = tcp.TcpLink(
            sock,
            link_id=link_id,
            local=endpoint.name,
            role=role,
            handler=_Forward(self, endpoint),
            layout=endpoint.storage.layout,
            config=endpoint.config,
            faults=NO_FAULTS,  # the bulk faults act on this link's writes, not on control frames
        )
        self._writes, self._remote = endpoint.faults.writes(), remote
        self._fence_timeout = endpoint.config.fence_timeout
        device = endpoint.storage.device
        self._stream = torch.cuda.Stream(device) if remote is not None else None
        # The sender's work queued before a round's copies: one event, re-recorded each round.
        self._queued = torch.cuda.Event() if remote is not None else None
        self._copies = InFlight()
        self._released = trio.Event()  # receiver: the sender has ended the connection
        self._fence = SocketFence(sock)  # last: nothing after it can fail and leak its descriptor

    @property
    def is_closed(self) -> bool:
        return self.error is not None or self._control.is_closed

    def closed_with(self, error: LinkError) -> None:
        if self.error is None:
            self.error = error
            self.closed.set()
            self.ready.set()

    def close(self, error: LinkError) -> None:
        self.closed_with(error)
        self._control.close(error)

    async def quiesce(self) -> None:
        """Sender: once no copy into the receiver's pool runs. Receiver: once the link is closed and the
        sender has ended the connection, which it does only when its copies are done
        (`transport.links.cuda_ipc.socket_fence`)."""
        await self._copies.idle.wait()
        await self._control.quiesce()
        if self.role == "receiver":
            await self._released.wait()

    async def run(self) -> None:
        """The control link's reader; once it ends, the fence — shielded, so it falls also when the
        endpoint's tasks are cancelled first: the sender releases the connection after its copies (they
        always finish), the receiver stops writing and waits (up to `fence_timeout`) for that."""
        try:
            await self._control.run()
        finally:
            with trio.CancelScope(shield=True):
                if self.role == "sender":
                    await self._copies.idle.wait()
                else:
                    self._fence.stop_writing()
                    with trio.move_on_after(self._fence_timeout):
                        await self._fence.peer_released()
                        self._released.set()
            self._fence.release()

    async def send(self, message: PeerMessage) -> None:
        await self._control.send(message)

    async def write(self, bulk: BulkWrite, trailer: PeerMessage | None = None) -> int:
        if self.is_closed:
            error = self.error or self._control.error
            raise (
                type(error)(str(error)) if error is not None else LinkClosed(f"link {self.describe()} closed")
            )
        if self._remote is None or self._stream is None:
            raise LinkBroken(f"link {self.describe()}: only the sending end of a cuda-ipc link writes")
        self._check_rows(bulk)
        event = self._launch(bulk)
        with self._copies.running():
            await gpu_copy.copies_done(event, bulk.nbytes)  # never abandoned: the copy is the fence
        if (drop_at := self._writes.wrote(bulk.nbytes)) is not None:
            error = LinkBroken(f"link {self.describe()} dropped by fault injection after {drop_at} bytes")
            self.close(error)
            raise error
        if trailer is not None:
            await self._control.send(trailer)
        return bulk.nbytes

    def _check_rows(self, bulk: BulkWrite) -> None:
        """Every block the grant names lies in the receiver's pool (by block ids, not by the runs'
        rows: one C-level `min` and `max` instead of a Python step per run)."""
        assert self._remote is not None
        if not bulk.dest_ids:
            return
        rows = min(int(self._remote[name].shape[0]) for name in bulk.buffers)
        blocks = rows // bulk.source.block_size
        lowest, highest = min(bulk.dest_ids), max(bulk.dest_ids)
        if lowest < 0 or highest >= blocks:
            bad = lowest if lowest < 0 else highest
            raise LinkBroken(
                f"link {self.describe()}: a grant names block {bad}; the receiver's pool has {blocks}"
            )

    def _launch(self, bulk: BulkWrite) -> torch.cuda.Event:
        """Queue the round's copies on the link's stream (after the work already queued on the
        current one) and record the event that says they are done."""
        assert self._remote is not None and self._stream is not None and self._queued is not None
        stream, source = self._stream, bulk.source
        self._queued.record(torch.cuda.current_stream(source.device))
        stream.wait_event(self._queued)
        with torch.cuda.stream(stream):
            indices = RowIndices(lambda: bulk.runs, bulk.whole_blocks(), source.block_size)
            for name in bulk.buffers:
                copy_rows(source.flat(name), self._remote[name], indices)
            if bulk.corrupt and bulk.runs:
                row = self._remote[bulk.buffers[0]][bulk.runs[0].dst_row]
                row.view(-1).view(torch.uint8)[:1].bitwise_xor_(0xFF)
            event = torch.cuda.Event()
            event.record(stream)
        return event


# ---------------------------------------------------------------------- connecting and listening
async def dial(endpoint: LinkOwner, host: str, port: int) -> CudaIpcLink:
    """A cuda-ipc link from receiving `endpoint` (its pool on a GPU) to the sender at `host:port`.
    Raises `HandshakeRefused` (the sender's reason), `LinkBroken` when it does not answer within
    `handshake_timeout`, `OSError` when nothing listens there, `ValueError` for a pool not on a GPU."""
    if endpoint.storage.device.type != "cuda":
        raise ValueError(
            f"endpoint {endpoint.name!r}: cuda-ipc needs its pool on a GPU, not {endpoint.storage.device}"
        )
    share = share_pool(endpoint.storage)
    timeout = endpoint.config.handshake_timeout
    sock: socket.socket | None = None
    try:
        with trio.move_on_after(timeout):
            sock = await tcp.connect(host, port)
            if (admission := _secret_only(endpoint)) is not None:  # the cluster secret first
                await tcp_admission.admit(sock, admission, f"cuda-ipc://{host}:{port}")
            await send_setup(sock, share)
            verdict = decode_verdict(await receive_setup(sock))
            if verdict.refusal is not None:
                raise HandshakeRefused(verdict.refusal)
            link, sock = CudaIpcLink(sock, endpoint, role="receiver", remote=None), None
            return link
        raise LinkBroken(f"no answer from cuda-ipc://{host}:{port} within {timeout} s")
    except (msgspec.DecodeError, LinkClosed) as exc:
        raise LinkBroken(f"cuda-ipc setup with {host}:{port} failed: {exc}") from exc
    finally:
        if sock is not None:
            sock.close()


async def listen(endpoint: LinkOwner, on_accept: Callable[[Link], None], host: str) -> str:
    """Accept cuda-ipc links to `endpoint`; returns `cuda-ipc://host:port`."""
    listener = tcp.listen_socket(host, 0)
    endpoint.nursery.start_soon(_accept_links, endpoint, listener, on_accept)
    await trio.lowlevel.checkpoint()
    return f"cuda-ipc://{host}:{listener.getsockname()[1]}"


async def _accept_links(
    endpoint: LinkOwner, listener: socket.socket, on_accept: Callable[[Link], None]
) -> None:
    with listener:
        while True:
            endpoint.nursery.start_soon(_admit, endpoint, await tcp.accept(listener), on_accept)


async def _admit(endpoint: LinkOwner, sock: socket.socket, on_accept: Callable[[Link], None]) -> None:
    """Map the connecting receiver's pool, or refuse it; bounded by `handshake_timeout`. With the
    cluster secret, the receiver proves it first (`transport.links.tcp.admission`; refused: logged)."""
    timeout = endpoint.config.handshake_timeout
    admission = _secret_only(endpoint)
    if (
        admission is not None
        and await tcp_admission.admitted(sock, admission, endpoint.name, timeout) is None
    ):
        return  # logged, closed
    with trio.move_on_after(timeout):
        try:
            share = decode_share(await receive_setup(sock))
            try:
                remote, refusal = open_share(share, endpoint.storage), None
            except ShareRefused as exc:
                remote, refusal = None, str(exc)
            await send_setup(sock, ShareVerdict(refusal=refusal))
        except (msgspec.DecodeError, LinkClosed, OSError) as exc:
            _log.warning("transfer.cuda_ipc_setup_failed", endpoint=endpoint.name, error=str(exc))
        else:
            if remote is not None:
                on_accept(CudaIpcLink(sock, endpoint, role="sender", remote=remote))
                return
            _log.warning("transfer.handshake_refused", endpoint=endpoint.name, reason=refusal)
    sock.close()


def _secret_only(endpoint: LinkOwner) -> LinkAdmission | None:
    """The endpoint's admission without TLS: a cuda-ipc control connection carries only its setup and
    the fence (no tensor bytes), over the plain socket."""
    admission = endpoint.config.admission
    return None if admission is None else dataclasses.replace(admission, server_tls=None, client_tls=None)

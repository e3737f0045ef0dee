"""Peer links: typed msgpack frames between the nodes of a cluster (docs/cluster.md).

Each node listens on one TCP address (its `NodeRecord.peer_address`). To send to node N a node dials N
once and keeps the connection; every frame is a 4-byte big-endian length and a msgpack `PeerFrame`
(`messages.cluster`). Frames to one peer are sent in order by one task; `send` never blocks (the queue
is unbounded: what waits is bounded by the requests in flight). A peer that cannot be dialled, or whose
connection breaks, loses what was queued for it — membership (its lease in etcd) decides whether it is
gone, and the requests it held end then; the next `send` dials again.

`ask` sends a message that carries a correlation id and waits, with a deadline, for the answer that
carries the same id (`answer` delivers it).

Cancellation: `run` owns the listener, the readers and the senders; cancelling it closes every
connection. An `ask` that is cancelled forgets its correlation id.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable
from typing import Final, final

import msgspec
import structlog
import trio

from messages.cluster import ClientOpResult, CommandOutcome, PeerFrame, PeerMessage

_log = structlog.get_logger("engine.cluster.peers")
MAX_FRAME_BYTES: Final = 512 * 1024 * 1024
DIAL_TIMEOUT: Final = 5.0
_HEADER = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerFrame)
_correlations = itertools.count(1)

Answer = CommandOutcome | ClientOpResult


@final
class PeerUnreachable(Exception):
    """No answer from a peer within the deadline, or it cannot be dialled."""


@final
class PeerListenError(Exception):
    """This node cannot listen for the others on its `--cluster-host` (the message says why)."""


@final
class PeerFrameError(Exception):
    """A peer sent bytes that are not a valid frame; its connection is closed."""


def new_correlation(node_id: str) -> str:
    return f"{node_id}:{next(_correlations)}"


@final
class PeerLinks:
    """See the module docstring. `on_frame(frame)` runs on the Trio thread for every frame received."""

    def __init__(self, node_id: str, lease: Callable[[], int], on_frame: Callable[[PeerFrame], None]) -> None:
        self.node_id = node_id
        self._lease = lease
        self._on_frame = on_frame
        self._addresses: dict[str, str] = {}
        self._queues: dict[str, tuple[trio.MemorySendChannel[bytes], trio.MemoryReceiveChannel[bytes]]] = {}
        # correlation -> (answered, the answer, the node asked)
        self._waiting: dict[str, tuple[trio.Event, list[Answer], str]] = {}
        self._nursery: trio.Nursery | None = None
        self.address: str | None = None

    def set_address(self, node_id: str, address: str) -> None:
        if self._addresses.get(node_id) != address:
            self._addresses[node_id] = address
            self._drop_queue(node_id)  # a new process behind the name: dial it afresh

    def forget(self, node_id: str) -> None:
        """`node_id` left the cluster: drop its queue, and end every `ask` waiting on it at once."""
        self._addresses.pop(node_id, None)
        self._drop_queue(node_id)
        for done, _, asked in self._waiting.values():
            if asked == node_id:
                done.set()

    def _drop_queue(self, node_id: str) -> None:
        queue = self._queues.pop(node_id, None)
        if queue is not None:
            queue[0].close()

    async def run(self, host: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on `host` (a free port) and serve until cancelled; `task_status` gets `host:port`.
        Raises `PeerListenError` before starting when `host` cannot be listened on."""
        try:
            listeners = await trio.open_tcp_listeners(0, host=host)
        except OSError as exc:  # not this host's address, no such host (gaierror), not permitted
            raise PeerListenError(
                f"cannot listen for the other nodes on {host} (--cluster-host): {exc.strerror or exc}; "
                "give an address of this host that the others reach"
            ) from None
        port = listeners[0].socket.getsockname()[1]
        self.address = f"{host}:{port}"
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await nursery.start(trio.serve_listeners, self._serve_connection, listeners)
                task_status.started(self.address)
                await trio.sleep_forever()
            finally:
                self._nursery = None
                for queue, _ in self._queues.values():
                    queue.close()
                self._queues.clear()

    # ------------------------------------------------------------------ sending
    def send(self, node_id: str, message: PeerMessage) -> None:
        """Queue `message` for `node_id` (see the module docstring); a node with no address is skipped."""
        if node_id == self.node_id or self._nursery is None:
            return
        pair = self._queues.get(node_id)
        if pair is None:
            address = self._addresses.get(node_id)
            if address is None:
                _log.info("cluster.peer_unknown", peer=node_id, message=type(message).__name__)
                return
            pair = trio.open_memory_channel[bytes](math.inf)
            self._queues[node_id] = pair
            self._nursery.start_soon(self._sender, node_id, address, pair[1])
        queue = pair[0]
        body = _encoder.encode(PeerFrame(sender=self.node_id, lease=self._lease(), message=message))
        try:
            queue.send_nowait(_HEADER.pack(len(body)) + body)
        except trio.ClosedResourceError:
            self._queues.pop(node_id, None)

    def broadcast(self, nodes: list[str], message: PeerMessage) -> None:
        for node in nodes:
            self.send(node, message)

    async def ask(self, node_id: str, message: PeerMessage, correlation: str, *, timeout: float) -> Answer:
        """Send `message` (carrying `correlation`) and wait for its answer; raises `PeerUnreachable`."""
        done, answers = trio.Event(), list[Answer]()
        self._waiting[correlation] = (done, answers, node_id)
        try:
            self.send(node_id, message)
            with trio.move_on_after(timeout):
                await done.wait()
        finally:
            self._waiting.pop(correlation, None)
        if not answers:
            raise PeerUnreachable(
                f"node {node_id} did not answer {type(message).__name__} within {timeout:g} s"
            )
        return answers[0]

    def answer(self, message: Answer) -> None:
        """Deliver an answer to the `ask` waiting for it (late answers are dropped)."""
        waiting = self._waiting.get(message.correlation)
        if waiting is not None:
            waiting[1].append(message)
            waiting[0].set()

    async def _sender(self, node_id: str, address: str, frames: trio.MemoryReceiveChannel[bytes]) -> None:
        host, _, port = address.rpartition(":")
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                stream = await trio.open_tcp_stream(host, int(port))
        except (OSError, trio.TooSlowError) as exc:
            _log.warning("cluster.peer_dial_failed", peer=node_id, address=address, error=str(exc))
            self._queue_lost(node_id, frames)
            return
        async with stream:
            try:
                async for frame in frames:
                    batch = [frame]
                    while True:
                        try:
                            batch.append(frames.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    await stream.send_all(b"".join(batch))
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                _log.warning("cluster.peer_send_failed", peer=node_id, address=address, error=str(exc))
                self._queue_lost(node_id, frames)

    def _queue_lost(self, node_id: str, frames: trio.MemoryReceiveChannel[bytes]) -> None:
        pair = self._queues.get(node_id)
        if pair is not None and pair[1] is frames:  # not a newer queue made since
            self._queues.pop(node_id, None)
            pair[0].close()
        frames.close()

    # ------------------------------------------------------------------ receiving
    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        buffer = bytearray()
        async with stream:
            try:
                while True:
                    data = await stream.receive_some(1 << 20)
                    if not data:
                        return
                    buffer += data
                    while (frame := _next_frame(buffer)) is not None:
                        self._on_frame(frame)
            except (OSError, trio.BrokenResourceError) as exc:
                _log.info("cluster.peer_connection_closed", error=str(exc))
            except PeerFrameError as exc:
                _log.warning("cluster.peer_frame_refused", error=str(exc))


def _next_frame(buffer: bytearray) -> PeerFrame | None:
    """Take the first whole frame off `buffer` (None: not all of it arrived); raises `PeerFrameError`."""
    if len(buffer) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack_from(buffer)
    if length > MAX_FRAME_BYTES:
        raise PeerFrameError(f"frame of {length} bytes, over {MAX_FRAME_BYTES}")
    if len(buffer) < _HEADER.size + length:
        return None
    body = bytes(buffer[_HEADER.size : _HEADER.size + length])
    del buffer[: _HEADER.size + length]
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise PeerFrameError(f"malformed frame ({length} bytes): {exc}") from exc

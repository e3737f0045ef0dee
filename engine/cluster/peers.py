"""Peer links: typed msgpack frames between the nodes of a cluster (docs/cluster.md).

Each node listens on one TCP address (its `NodeRecord.peer_address`). To send to node N a node dials N
once and keeps the connection; every frame is a 4-byte big-endian length and a msgpack `PeerFrame`
(`messages.cluster`). Frames to one peer are sent in order by one task; `send` never blocks (the queue
is unbounded: what waits is bounded by the requests in flight and by the lease TTL, below). A peer that
cannot be dialled is dialled again (every `REDIAL_SECONDS` at most) with its frames kept, and a broken
connection is replaced by a new one; the frames a broken connection was carrying are lost (logged).
Membership decides whether a peer is gone: `forget` (it left) and `reset` (it came back under a new
lease: another process, or the same one after its lease ended) drop its queue and its connection, so the
next `send` dials it afresh and nothing meant for the old incarnation reaches the new one.

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
REDIAL_SECONDS: Final = (0.1, 2.0)  # the first and the longest wait between dials of an unreachable peer
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
class _Queue:
    """The frames waiting for one peer, the task that sends them, and the scope that ends that task."""

    def __init__(self, node_id: str, address: str) -> None:
        self.node_id = node_id
        self.address = address
        self.frames, self.receive = trio.open_memory_channel[bytes](math.inf)
        self.scope = trio.CancelScope()

    def close(self) -> None:
        """Drop what waits and end the sender (its connection closes)."""
        self.frames.close()
        self.scope.cancel()


@final
class PeerLinks:
    """See the module docstring. `on_frame(frame)` runs on the Trio thread for every frame received."""

    def __init__(self, node_id: str, lease: Callable[[], int], on_frame: Callable[[PeerFrame], None]) -> None:
        self.node_id = node_id
        self._lease = lease
        self._on_frame = on_frame
        self._addresses: dict[str, str] = {}
        self._queues: dict[str, _Queue] = {}
        # correlation -> (answered, the answer, the node asked)
        self._waiting: dict[str, tuple[trio.Event, list[Answer], str]] = {}
        self._nursery: trio.Nursery | None = None
        self.address: str | None = None

    def set_address(self, node_id: str, address: str) -> None:
        if self._addresses.get(node_id) != address:
            self._addresses[node_id] = address
            self._drop_queue(node_id)  # a new process behind the name: dial it afresh

    def reset(self, node_id: str, address: str) -> None:
        """`node_id` is another incarnation now (a new lease): drop what was queued for the old one,
        close its connection, end the `ask`s waiting on it; the next `send` dials `address`."""
        self.forget(node_id)
        self._addresses[node_id] = address

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
            queue.close()

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
                for queue in self._queues.values():
                    queue.close()
                self._queues.clear()

    # ------------------------------------------------------------------ sending
    def send(self, node_id: str, message: PeerMessage) -> None:
        """Queue `message` for `node_id` (see the module docstring); a node with no address is skipped."""
        if node_id == self.node_id or self._nursery is None:
            return
        queue = self._queues.get(node_id)
        if queue is None:
            address = self._addresses.get(node_id)
            if address is None:
                _log.info("cluster.peer_unknown", peer=node_id, message=type(message).__name__)
                return
            queue = self._queues[node_id] = _Queue(node_id, address)
            self._nursery.start_soon(self._sender, queue)
        body = _encoder.encode(PeerFrame(sender=self.node_id, lease=self._lease(), message=message))
        queue.frames.send_nowait(_HEADER.pack(len(body)) + body)

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

    async def _sender(self, queue: _Queue) -> None:
        """Dial the peer (again and again while it cannot be reached) and send its frames in order,
        until the queue is dropped (its scope cancelled)."""
        node_id, address = queue.node_id, queue.address
        host, _, port = address.rpartition(":")
        wait = REDIAL_SECONDS[0]
        failures = 0
        with queue.scope:
            while True:
                try:
                    with trio.fail_after(DIAL_TIMEOUT):
                        stream = await trio.open_tcp_stream(host, int(port))
                except (OSError, trio.TooSlowError) as exc:
                    failures += 1
                    if failures == 1:  # once per outage, not once per dial
                        _log.warning(
                            "cluster.peer_dial_failed", peer=node_id, address=address, error=str(exc)
                        )
                    await trio.sleep(wait)
                    wait = min(REDIAL_SECONDS[1], wait * 2)
                    continue
                if failures:
                    _log.info("cluster.peer_redialled", peer=node_id, address=address, failed_dials=failures)
                failures, wait = 0, REDIAL_SECONDS[0]
                async with stream:
                    batch: list[bytes] = []
                    try:
                        async for frame in queue.receive:
                            batch = [frame]
                            while True:
                                try:
                                    batch.append(queue.receive.receive_nowait())
                                except (trio.WouldBlock, trio.EndOfChannel):
                                    break
                            await stream.send_all(b"".join(batch))
                            batch = []
                        return  # the queue was closed: nothing more to send
                    except (OSError, trio.BrokenResourceError) as exc:
                        _log.warning(
                            "cluster.peer_send_failed",
                            peer=node_id,
                            address=address,
                            error=str(exc),
                            lost_frames=len(batch),
                        )

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

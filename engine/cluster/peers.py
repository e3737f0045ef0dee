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

Authentication (docs/security.md): with credentials (`--cluster-secret-file`, the `--peer-*-file`s) a
connection opens with `transport.auth.streams` — mutual TLS, the secret's challenge–response, or both —
before any frame, within `AUTH_TIMEOUT`; the dialer checks it reached the node it dialled, and every
frame then carries a MAC (`transport.auth.frames`) when a secret is in use. A frame whose `sender` is not
the connection's proven name, whose MAC fails, or that is longer than `MAX_FRAME_BYTES` closes the
connection and is logged (`cluster.peer_frame_refused`); a connection that does not authenticate is
closed and logged (`cluster.peer_refused`). Without credentials anyone who reaches the port is believed.

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
from transport.auth.challenge import AuthFailed
from transport.auth.credentials import NO_CREDENTIALS, Credentials
from transport.auth.frames import TAG_BYTES, FrameOpener, FrameSealer
from transport.auth.streams import admit_dialer, admit_listener

_log = structlog.get_logger("engine.cluster.peers")
# The longest peer frame: commands, reports and request snapshots (a `Submit` carries its request's
# images; bulk bytes — embeddings, KV, weights — go over transfer links). A longer one is not sent.
MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
DIAL_TIMEOUT: Final = 5.0
AUTH_TIMEOUT: Final = 5.0  # a connection that has not authenticated by then is closed
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
    """A peer sent bytes that are not a valid frame, or a frame it may not send; its connection is
    closed."""


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

    def __init__(
        self,
        node_id: str,
        lease: Callable[[], int],
        on_frame: Callable[[PeerFrame], None],
        credentials: Credentials = NO_CREDENTIALS,
        known_lease: Callable[[str], int] = lambda node_id: 0,
    ) -> None:
        """`lease()`: this node's lease now; `known_lease(node)`: the lease `node` is known under here
        (0: none), which every frame to it carries (`PeerFrame.to_lease`)."""
        self.node_id = node_id
        self._credentials = credentials
        self._lease = lease
        self._known_lease = known_lease
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
    def send(self, node_id: str, message: PeerMessage) -> bool:
        """Queue `message` for `node_id` (see the module docstring); a node with no address is skipped.
        False: the frame is longer than `MAX_FRAME_BYTES` and was not sent (logged)."""
        if node_id == self.node_id or self._nursery is None:
            return True
        frame = PeerFrame(
            sender=self.node_id, lease=self._lease(), message=message, to_lease=self._known_lease(node_id)
        )
        body = _encoder.encode(frame)
        if len(body) > MAX_FRAME_BYTES:
            _log.error(
                "cluster.peer_frame_too_long",
                peer=node_id,
                message=type(message).__name__,
                bytes=len(body),
                limit=MAX_FRAME_BYTES,
            )
            return False
        queue = self._queues.get(node_id)
        if queue is None:
            address = self._addresses.get(node_id)
            if address is None:
                _log.info("cluster.peer_unknown", peer=node_id, message=type(message).__name__)
                return True
            queue = self._queues[node_id] = _Queue(node_id, address)
            self._nursery.start_soon(self._sender, queue)
        queue.frames.send_nowait(body)
        return True

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
                try:
                    with trio.fail_after(AUTH_TIMEOUT):
                        admitted = await admit_dialer(
                            stream, self._credentials, purpose="peer", name=self.node_id, expect=node_id
                        )
                except (AuthFailed, trio.TooSlowError, OSError, trio.BrokenResourceError) as exc:
                    await stream.aclose()
                    failures += 1
                    if failures == 1:
                        reason = str(exc) or "no answer within the authentication deadline"
                        _log.warning("cluster.peer_refused", peer=node_id, address=address, reason=reason)
                    await trio.sleep(wait)
                    wait = min(REDIAL_SECONDS[1], wait * 2)
                    continue
                if failures:
                    _log.info("cluster.peer_redialled", peer=node_id, address=address, failed_dials=failures)
                failures, wait = 0, REDIAL_SECONDS[0]
                sealer = None if admitted.key is None else FrameSealer(admitted.key, "dialer")
                async with admitted.stream as connection:
                    batch: list[bytes] = []
                    try:
                        async for body in queue.receive:
                            batch = [_framed(body, sealer)]
                            while True:
                                try:
                                    batch.append(_framed(queue.receive.receive_nowait(), sealer))
                                except (trio.WouldBlock, trio.EndOfChannel):
                                    break
                            await connection.send_all(b"".join(batch))
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
        try:
            remote = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            remote = "?"
        try:
            with trio.fail_after(AUTH_TIMEOUT):
                admitted = await admit_listener(stream, self._credentials, purpose="peer", name=self.node_id)
        except (AuthFailed, trio.TooSlowError, OSError, trio.BrokenResourceError) as exc:
            reason = str(exc) or "it did not authenticate within the deadline"
            _log.warning("cluster.peer_refused", remote=remote, reason=reason)
            await stream.aclose()
            return
        reader = FrameReader(admitted.peer, admitted.key)
        async with admitted.stream as connection:
            try:
                while True:
                    data = await connection.receive_some(1 << 20)
                    if not data:
                        return
                    reader.buffer += data
                    while (frame := reader.next_frame()) is not None:
                        self._on_frame(frame)
            except (OSError, trio.BrokenResourceError) as exc:
                _log.info("cluster.peer_connection_closed", remote=remote, peer=admitted.peer, error=str(exc))
            except PeerFrameError as exc:
                _log.warning("cluster.peer_frame_refused", remote=remote, peer=admitted.peer, reason=str(exc))


def _framed(body: bytes, sealer: FrameSealer | None) -> bytes:
    """A frame on the wire: its body's length, the body, and its MAC when the link has a session key."""
    return _HEADER.pack(len(body)) + body + (b"" if sealer is None else sealer.seal(body))


@final
class FrameReader:
    """The frames of one authenticated connection, taken off its received bytes: each bounded, its MAC
    checked (with a session key), its sender the connection's proven name (when one is proven)."""

    def __init__(self, peer: str | None, key: bytes | None) -> None:
        self.buffer = bytearray()
        self._peer = peer
        self._opener = None if key is None else FrameOpener(key, "dialer")
        self._tag = 0 if key is None else TAG_BYTES

    def next_frame(self) -> PeerFrame | None:
        """The first whole frame (None: not all of it arrived); raises `PeerFrameError`."""
        buffer = self.buffer
        if len(buffer) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(buffer)
        if length > MAX_FRAME_BYTES:
            raise PeerFrameError(f"a frame of {length} bytes, over the {MAX_FRAME_BYTES} limit")
        end = _HEADER.size + length
        if len(buffer) < end + self._tag:
            return None
        body = bytes(buffer[_HEADER.size : end])
        tag = bytes(buffer[end : end + self._tag])
        del buffer[: end + self._tag]
        if self._opener is not None:
            try:
                self._opener.check(body, tag)
            except AuthFailed as exc:
                raise PeerFrameError(str(exc)) from None
        try:
            frame = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise PeerFrameError(f"malformed frame ({length} bytes): {exc}") from exc
        if self._peer is not None and frame.sender != self._peer:
            raise PeerFrameError(
                f"a {type(frame.message).__name__} frame claims sender {frame.sender!r} on {self._peer!r}'s connection"
            )
        return frame

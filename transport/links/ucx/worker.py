"""A ucxx worker driven from Trio: no threads, no asyncio (the UCX transport's engine).

ucxx offers a progress thread or asyncio; zigzag's replicas live in one Trio thread, so this module drives
the worker itself:

- the worker runs in UCX's *blocking progress mode*: `progress()` does the work that is ready, `arm()` says
  whether more is pending, and the worker's epoll file descriptor turns readable when an event arrives.
  `run` (one task per worker, in its endpoint's nursery) loops: progress, hand out what completed, arm,
  and wait on the fd with `trio.lowlevel.wait_readable` (`SAFETY_POLL` at most: UCX's own timers);
- a task that posts a request and awaits it (`wait`) registers a waiter; the loop sets its event once the
  requests completed. Posting kicks the loop out of its fd wait: a message already queued inside UCX
  needs a progress call, not an fd event. After activity the loop polls for `POLL_SECONDS` before it
  sleeps, unless a waiter is *patient* (a sender waiting for a read group's receipt, which comes after
  the peer's milliseconds of reading) and no UCX request is in flight: polling would take the peer's core;
- host memory goes straight through UCP (`scatter`: I/O vectors, which ucxx lacks; length-checked bulk
  receives; cheaper sends); `requests` keeps each request's memory alive until it completed;
- control messages are found by probing (`tag_probe`, a mask on the kind bits) and received into a buffer
  of their exact size, each to the inbox of the link its tag names (`register`);
- bulk messages for a link closed in the last `DRAIN_SECONDS` (its peer may not know yet) are received
  into one byte every `DRAIN_INTERVAL` — truncated: no data moves, the sender's request completes —
  instead of waiting in UCX's unexpected queue for as long as the worker.

Tags: bits 8..63 are the destination's link number on the receiving worker (0: its listener), bits 0..7
the kind (`CONTROL`, `BULK`). Numbers are never reused within a worker, so a stale peer finds no inbox.

Cancellation: `wait` is cancellable, but its requests stay posted; the worker keeps their buffers alive
until they complete (a cancelled request completes too), so UCX never writes into freed memory. `run`,
when cancelled, waits up to `LINKS_CLOSE_SECONDS` for its links to close (each says goodbye; the tasks
closing them may run after this one), closes the endpoints left and progresses (shielded, bounded)
until every tracked request has completed.
"""

from __future__ import annotations

import array
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar, final

import structlog
import trio

from transport.links.ucx.library import UcxFailed, cuda_transports_allowed, libucxx, ucx_context
from transport.links.ucx.requests import ABANDONED, RequestBook, Waiter
from transport.links.ucx.scatter import (
    ContiguousReceive,
    ContiguousSend,
    GatheredSend,
    ScatteredReceive,
    UcpFailed,
)
from transport.protocol.link import POLL_SECONDS

_Posted = TypeVar("_Posted", ScatteredReceive, GatheredSend, ContiguousSend)

KIND_BITS: Final = 8
KIND_MASK: Final = (1 << KIND_BITS) - 1
CONTROL: Final = 1
BULK: Final = 2
LISTENER: Final = 0
SAFETY_POLL: Final = 0.05
# UCX events handled back to back before other tasks run (other tasks wait at most this long during bulk
# copies): one Trio turn per event cost 15 % of ucx_64MiB, 1 ms slices about 5 % more than 2 ms ones.
PROGRESS_SLICE: Final = 0.002
# Between back-to-back events, control messages are looked for at most this often: a probe costs ~3 µs
# and an event (a piece of a rendezvous copy) ~60 µs, so probing after each was 5 % of a bulk copy.
PROBE_INTERVAL: Final = 0.0002
TEARDOWN_SECONDS: Final = 2.0
LINKS_CLOSE_SECONDS: Final = 0.5
DRAIN_SECONDS: Final = 30.0
DRAIN_INTERVAL: Final = 0.05

_log = structlog.get_logger("transport.ucx")


def tag(number: int, kind: int) -> int:
    return (number << KIND_BITS) | kind


@dataclass(frozen=True, slots=True)
class Arrival:
    """A control message on its way in: `request` receives it into `body`."""

    request: Any
    body: bytearray


@final
class UcxWorker:
    """One ucxx worker, its progress task and its endpoints (see the module docstring)."""

    def __init__(self, name: str) -> None:
        lib = libucxx()
        from ucxx._lib.arr import Array

        self.name = name
        self._lib, self._array = lib, Array
        context = ucx_context()
        self._worker = lib.UCXWorker(context)
        self._worker.init_blocking_progress_mode()
        # Receives through UCP itself and through ucxx share the bulk tag, so they must reach UCP in the
        # order they are posted: ucxx's delayed submission would post its own later.
        assert not self._worker.enable_delayed_submission
        self._fd: int = self._worker.epoll_file_descriptor
        self.address: bytes = self._worker.address.tobytes()
        self.cuda_capable: bool = bool(context.cuda_support) and cuda_transports_allowed(
            str(context.config.get("TLS", "all"))
        )
        self._control_tag = lib.UCXXTag(CONTROL)
        self._control_mask = lib.UCXXTagMask(KIND_MASK)
        self._inboxes: dict[int, Callable[[Arrival], None]] = {}
        self._unlinked = trio.Event()  # set when the last link unregisters (only awaited at teardown)
        self._numbers = itertools.count(LISTENER + 1)
        self._waiters: set[Waiter] = set()
        self._book = RequestBook()
        self._endpoints: set[Any] = set()
        self._sleep: trio.CancelScope | None = None
        self._kicked = False
        self._patient = 0  # waits that want no polling (see the module docstring)
        self._running = False
        self._draining: dict[int, float] = {}  # closed link number → until when its bulk tag is drained
        self._drain_at = 0.0

    # ------------------------------------------------------------------ links and endpoints
    def register(self, deliver: Callable[[Arrival], None], number: int | None = None) -> int:
        """A new link number (or `number`, e.g. `LISTENER`) whose control messages go to `deliver`."""
        number = next(self._numbers) if number is None else number
        self._inboxes[number] = deliver
        return number

    def unregister(self, number: int) -> None:
        """Link `number` closed: its control messages are dropped from now on, and bulk messages for it
        drained for `DRAIN_SECONDS`."""
        self._inboxes.pop(number, None)
        if not self._inboxes.keys() - {LISTENER}:
            self._unlinked.set()
        self._draining[number] = time.perf_counter() + DRAIN_SECONDS

    def connect(self, address: bytes) -> Any:
        """A UCX endpoint to the worker at `address` (no peer-failure handling: UCX's shared-memory
        transports refuse it; the links' heartbeats detect a lost peer instead)."""
        lib = self._lib
        try:
            endpoint = lib.UCXEndpoint.create_from_worker_address(
                self._worker, lib.UCXAddress.create_from_buffer(address), False
            )
        except lib.UCXError as exc:
            raise UcxFailed(
                f"cannot reach the UCX worker at that address: {type(exc).__name__}: {exc}"
            ) from exc
        self._endpoints.add(endpoint)
        return endpoint

    def disconnect(self, endpoint: Any) -> None:
        """Close `endpoint`: its posted receives are cancelled (they complete on the next progress)."""
        if endpoint in self._endpoints:
            self._endpoints.discard(endpoint)
            endpoint.close()
            self._book.cancel(endpoint)
            self.kick()

    # ------------------------------------------------------------------ requests
    def _check_endpoint(self, endpoint: Any) -> None:
        # ucxx crashes the process when asked to post on an endpoint it has closed.
        if endpoint not in self._endpoints:
            raise UcxFailed(f"the UCX endpoint is closed (worker {self.name!r})")

    def send(self, endpoint: Any, to: int, buffer: object) -> Any:
        """Post a tag send of `buffer` (anything with the buffer or CUDA array interface); from host memory
        straight through UCP (`ContiguousSend`). Raises `UcxFailed` once `endpoint` is disconnected."""
        if isinstance(buffer, bytes):  # a control message: sent from where it is, not wrapped
            return self._post(
                endpoint, buffer, lambda: ContiguousSend.of_bytes(self._worker, endpoint, to, buffer)
            )
        wrapped = self._array(buffer)
        if wrapped.cuda:
            return self._post_ucxx(
                endpoint, "send", wrapped, lambda: endpoint.tag_send(wrapped, self._lib.UCXXTag(to))
            )
        return self._post(
            endpoint,
            wrapped,
            lambda: ContiguousSend(self._worker, endpoint, to, wrapped.ptr, wrapped.nbytes, wrapped),
        )

    def receive(self, endpoint: Any, on: int, buffer: object) -> Any:
        """Post a tag receive into `buffer` for the next message tagged exactly `on`; in host memory a
        shorter message fails it (`ContiguousReceive`). Raises `UcxFailed` once `endpoint` is disconnected."""
        wrapped = self._array(buffer)
        if not wrapped.cuda:
            posted: list[Any] = []
            self.receive_host(endpoint, on, [(wrapped.ptr, wrapped.nbytes)], wrapped, posted)
            return posted[0]
        return self._post_ucxx(
            endpoint, "receive", wrapped, lambda: endpoint.tag_recv(wrapped, self._lib.UCXXTag(on))
        )

    def _post_ucxx(self, endpoint: Any, what: str, wrapped: object, post: Callable[[], Any]) -> Any:
        """`post()` (a ucxx request) on an open `endpoint`, tracked."""
        self._check_endpoint(endpoint)
        try:
            request = post()
        except self._lib.UCXError as exc:
            raise UcxFailed(f"{what} not posted: {type(exc).__name__}: {exc}") from exc
        self._book.track(request, wrapped)
        self.kick()
        return request

    def receive_scattered(
        self, endpoint: Any, on: int, vector: array.array[int], keep: object
    ) -> ScatteredReceive:
        """Post a tag receive for the next message tagged exactly `on`, landing in the segments of I/O
        vector `vector` (`transport.links.ucx.scatter.io_vector`) of memory that `keep` owns. Cancelled (where
        UCX can) when `endpoint` is disconnected. Raises `UcxFailed` once `endpoint` is disconnected."""
        return self._post(endpoint, keep, lambda: ScatteredReceive(self._worker, on, vector, keep))

    def send_gathered(self, endpoint: Any, to: int, vector: array.array[int], keep: object) -> GatheredSend:
        """Post a tag send of the segments of I/O vector `vector` (memory that `keep` owns), back to back
        as one message. Raises `UcxFailed` once `endpoint` is disconnected."""
        return self._post(endpoint, keep, lambda: GatheredSend(self._worker, endpoint, to, vector, keep))

    def receive_host(
        self, endpoint: Any, on: int, pieces: Iterable[tuple[int, int]], keep: object, into: list[Any]
    ) -> None:
        """As `receive`, into each `(address, length)` of `pieces` in host memory that `keep` owns, in order,
        appended to `into` as it is posted (one that fails leaves those before it listed and tracked), the
        bookkeeping done once: a direct frame's pieces, tens a round."""
        self._check_endpoint(endpoint)
        worker, start = self._worker, len(into)
        try:
            for address, length in pieces:
                into.append(ContiguousReceive(worker, on, address, length, keep))
        except UcpFailed as exc:
            raise UcxFailed(str(exc)) from exc
        finally:
            self._book.add(endpoint, into[start:], keep)
            self.kick()

    def _post(self, endpoint: Any, keep: object, post: Callable[[], _Posted]) -> _Posted:
        """`post()` (a request straight through UCP) on an open `endpoint`, tracked, and listed for
        cancelling when it disconnects."""
        self._check_endpoint(endpoint)
        try:
            request = post()
        except UcpFailed as exc:
            raise UcxFailed(str(exc)) from exc
        if not (isinstance(request, ContiguousSend | GatheredSend) and request.completed):
            self._book.add(endpoint, [request], keep)  # not an eager send, done inside the call
        self.kick()
        return request

    async def wait(self, requests: Sequence[Any], *, check: bool = True, patient: bool = False) -> None:
        """Until every request completed; with `check`, raises `UcxFailed` for the first that failed;
        `patient`: no polling while this waits. Cancellable: the requests stay posted and tracked."""
        waiter = Waiter(list(requests))
        if not waiter.advance():
            self._waiters.add(waiter)
            self._patient += patient
            self.kick()
            try:
                if self._running:
                    await waiter.done.wait()
                else:  # the progress task is gone (teardown): drive the worker here
                    while not waiter.advance():
                        self._worker.progress()
                        await trio.sleep(0.001)
            finally:
                self._waiters.discard(waiter)
                self._patient -= patient
        for request in requests:
            if not request.completed:
                raise UcxFailed(f"UCX worker {self.name!r} stopped with the request pending")
            if check:
                self.check(request)

    def check(self, request: Any) -> None:
        """Raise `UcxFailed` if the completed `request` ended in error."""
        try:
            request.check_error()
        except (self._lib.UCXError, UcpFailed) as exc:
            raise UcxFailed(f"{type(exc).__name__}: {exc}") from exc

    def kick(self) -> None:
        """Make the progress loop run again now (it may be waiting on the fd)."""
        self._kicked = True
        if self._sleep is not None:
            self._sleep.cancel()

    # ------------------------------------------------------------------ the progress task
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        task_status.started()
        try:
            active = time.perf_counter()
            while True:
                busy = self._progress()
                if self._kicked or busy:
                    self._kicked = False
                    active = time.perf_counter()
                    await trio.lowlevel.checkpoint()
                elif time.perf_counter() - active < POLL_SECONDS and not self._resting():
                    await trio.lowlevel.checkpoint()  # more is likely on its way: poll, do not arm yet
                elif self._worker.arm():
                    with trio.move_on_after(SAFETY_POLL) as scope:
                        self._sleep = scope
                        await trio.lowlevel.wait_readable(self._fd)
                    self._sleep = None
                else:
                    await trio.lowlevel.checkpoint()
        finally:
            self._running = False
            self._sleep = None
            with trio.CancelScope(shield=True):
                await self._teardown()

    def _resting(self) -> bool:
        return bool(self._patient) and not self._book.pending()

    def _progress(self) -> bool:
        """One round of UCX progress — transport events (e.g. rendezvous copies) until none is ready, a
        control message arrived (looked for every `PROBE_INTERVAL`) or `PROGRESS_SLICE` has passed, so
        other tasks still run between copies — then hand out what arrived and completed; True when UCX
        did something."""
        worker, busy = self._worker, False
        now = time.perf_counter()
        end, probe_at = now + PROGRESS_SLICE, now + PROBE_INTERVAL
        while worker.progress_once():
            busy = True
            now = time.perf_counter()
            if now >= end:
                break
            if now >= probe_at:
                if self._receive_control():
                    break  # a control message (say a frame descriptor) is served before further copies
                probe_at = now + PROBE_INTERVAL
        self._receive_control()
        if self._draining and now >= self._drain_at:
            self._drain_closed(now)
        if self._waiters:
            for waiter in [w for w in self._waiters if w.advance()]:
                self._waiters.discard(waiter)
                waiter.done.set()
        return busy

    def _receive_control(self) -> int:
        """Receive the control messages that arrived; how many."""
        worker, count = self._worker, 0
        while True:
            probe = worker.tag_probe(self._control_tag, self._control_mask, True)
            if not probe.matched:
                return count
            count += 1
            body = bytearray(max(1, probe.length))  # an empty message reads as one zero byte: malformed
            wrapped = self._array(memoryview(body))
            request = worker.tag_recv_with_handle(wrapped, probe)
            self._book.track(request, wrapped)
            deliver = self._inboxes.get(probe.sender_tag.value >> KIND_BITS)
            if deliver is not None:
                deliver(Arrival(request, body))

    def _drain_closed(self, now: float) -> None:
        """Receive, truncated to one byte, the bulk messages that arrived for recently closed links."""
        self._drain_at = now + DRAIN_INTERVAL
        worker, lib = self._worker, self._lib
        for number, until in list(self._draining.items()):
            if now >= until:
                del self._draining[number]
                continue
            drained = 0
            while (
                probe := worker.tag_probe(lib.UCXXTag(tag(number, BULK)), lib.UCXXTagMaskFull, True)
            ).matched:
                wrapped = self._array(bytearray(1))
                self._book.track(worker.tag_recv_with_handle(wrapped, probe), wrapped)
                drained += 1
            if drained:
                _log.info("transfer.ucx_stale_bulk_drained", worker=self.name, link=number, messages=drained)

    async def _teardown(self) -> None:
        if self._inboxes.keys() - {LISTENER}:  # links still open: their own closing says goodbye first
            self._unlinked = trio.Event()
            with trio.move_on_after(LINKS_CLOSE_SECONDS):
                await self._unlinked.wait()
        for endpoint in list(self._endpoints):
            self.disconnect(endpoint)
        self._worker.cancel_inflight_requests()
        deadline = trio.current_time() + TEARDOWN_SECONDS
        pending = self._book.take_all()
        while pending and trio.current_time() < deadline:
            self._worker.progress()
            pending = [entry for entry in pending if not entry[0].completed]
            if pending:
                await trio.sleep(0.001)
        if pending:
            ABANDONED.extend(pending)
            _log.warning("transfer.ucx_requests_abandoned", worker=self.name, requests=len(pending))
        for waiter in self._waiters:
            waiter.done.set()

"""The sending side of one transfer (architecture §5): wait for grants, write rounds, say `ChunkDone`.

Lifetime: `TransferEndpoint.open_send(transfer_id)` opens the session (an async context manager); the
owner may `announce_total` as soon as it knows the length, and calls `send(...)` once the data sits in
its pool. Grants that arrived before the session opened are replayed into it.

Control messages from the receiver reach the session through `handle(link, message)`: called by the
endpoint directly, or by the owner after they went through the owner's command channel (architecture §3).

Rounds are written strictly in order; a grant for a round already written is a duplicate and ignored. Each
round: bytes first, then `ChunkDone` with the header and total as the write's trailer, on the same ordered
link. An `Abort` from the receiver is answered with `AbortAck` once no write for this transfer is in flight
(the fence the receiver waits for). Deadlines: while waiting on the receiver, a lack of progress for
`progress_timeout` fails the transfer; while the owner prepares the data, the session tells the
receiver so (`StatusUpdate`) instead. Cancellation of `send` aborts the transfer (shielded, bounded).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol, assert_never, final

import msgspec
import trio

from messages.peer_codec import NO_HEADER
from messages.transfer import (
    Abort,
    AbortAck,
    ChunkDone,
    FailureReason,
    Grant,
    RequestMoreCache,
    SenderBound,
    StatusUpdate,
    TotalAnnounce,
    TransferReport,
    TransferStatus,
)
from transport.bulk.runs import checksum_runs
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig
from transport.errors import LinkError, transfer_error
from transport.faults import FaultPlan
from transport.memory.storage import PoolStorage
from transport.protocol.link import Link
from transport.protocol.liveness import Liveness
from transport.protocol.scope import describe_exit
from transport.protocol.status import StatusMachine


class SenderHost(Protocol):
    """What a sender session needs from its endpoint."""

    name: str
    storage: PoolStorage
    config: TransferConfig
    faults: FaultPlan

    def send_soon(self, link: Link, message: Abort | AbortAck | TotalAnnounce | StatusUpdate) -> None: ...


@final
class SendSession:
    """One transfer, sender side."""

    def __init__(self, host: SenderHost, transfer_id: str, link: Link | None) -> None:
        self.host, self.transfer_id, self.link = host, transfer_id, link
        self.status = StatusMachine(transfer_id)
        self._config, self._storage = host.config, host.storage
        self._source = host.storage  # what `send` reads: the pool, or the storage it was given
        self._grants: dict[int, Grant | RequestMoreCache] = {}
        self._next_round = 0
        self._landing_key: int | None = None
        self._buffers: tuple[str, ...] = tuple(spec.name for spec in host.storage.layout.buffers)
        self.receiver_header: msgspec.Raw | None = None
        self.expected_tokens: int | None = None
        self._total: int | None = None
        self._header: msgspec.Raw = NO_HEADER
        self._announced = False
        self._data_ready = False
        self._writing = False
        self._awaiting_grant = False
        self._peer_abort: Abort | None = None
        self._acked = False
        self._failure: tuple[FailureReason, str] | None = None
        self._position = self._rounds = self._bytes = 0
        self._wake = trio.Event()
        self._ended = trio.Event()  # set on an abort from the receiver or a failure
        self.liveness = Liveness(self._config.progress_timeout)
        self._started = trio.current_time()
        self._started_wall = time.time()

    # ------------------------------------------------------------------ from the receiver
    def handle(self, link: Link, message: SenderBound) -> None:
        """A receiver message for this transfer (never blocks)."""
        if self.link is None:
            self.link = link
        elif link is not self.link:
            return
        self.liveness.touch()
        match message:
            case Grant():
                if 0 in self._grants or self._next_round > 0 or self.status.terminal:
                    return
                self._on_first_grant(message)
                self._grants[0] = message
            case RequestMoreCache():
                if message.round >= self._next_round and not self.status.terminal:
                    self._grants.setdefault(message.round, message)
            case Abort():
                if self._peer_abort is None:
                    self._peer_abort = message
                    self._ended.set()
                    if not self._writing:
                        self._ack()
            case StatusUpdate():
                pass
            case _:
                assert_never(message)
        self._wake.set()

    def _on_first_grant(self, grant: Grant) -> None:
        self._landing_key = grant.landing_key
        self.receiver_header = grant.header
        self.expected_tokens = grant.expected_tokens
        if grant.buffers is not None:
            unknown = [name for name in grant.buffers if name not in self._buffers]
            if unknown:
                self._fail(FailureReason.PROTOCOL_ERROR, f"grant selects unknown buffers {unknown}")
            self._buffers = tuple(grant.buffers)
        if not self._data_ready:
            self._advance(TransferStatus.WAITING_FOR_INPUT)
        self._announce_soon()

    def link_lost(self, detail: str) -> None:
        self._fail(FailureReason.LINK_LOST, detail)

    # ------------------------------------------------------------------ from the owner
    def announce_total(self, total_tokens: int, header: msgspec.Raw = NO_HEADER) -> None:
        """Tell the receiver the true length now, before the data is ready (it can grant ahead)."""
        if total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
        if self._total is not None and self._total != total_tokens:
            raise ValueError(f"transfer {self.transfer_id!r}: total already announced as {self._total}")
        self._total, self._header = total_tokens, header
        self._announce_soon()

    def _announce_soon(self) -> None:
        if self._total is not None and self.link is not None and not self._announced:
            self._announced = True
            message = TotalAnnounce(
                transfer_id=self.transfer_id, total_tokens=self._total, header=self._header
            )
            self.host.send_soon(self.link, message)

    async def send(
        self,
        source_ids: Sequence[int],
        *,
        total_tokens: int,
        source_offset: int = 0,
        header: msgspec.Raw = NO_HEADER,
        source: PoolStorage | None = None,
    ) -> TransferReport:
        """Send tokens `[source_offset, +total_tokens)` of the allocation `source_ids` in this endpoint's
        pool — or, with `source`, in that storage (of this endpoint's layout, laid over the owner's own
        tensors: `PoolStorage(over=...)`), sent from where it lies with nothing staged. Returns the
        report on success; raises `TransferFailed` / `TransferTimeout` otherwise. The owner must keep
        `source_ids` allocated (and `source`'s tensors unchanged) until this returns."""
        if source is not None and source.layout != self._storage.layout:
            raise ValueError(f"transfer {self.transfer_id!r}: the source storage has another layout")
        self._source = source if source is not None else self._storage
        capacity = len(source_ids) * self._storage.block_size
        if total_tokens < 0 or source_offset < 0 or source_offset + total_tokens > capacity:
            raise ValueError(
                f"transfer {self.transfer_id!r}: tokens [{source_offset}, {source_offset + total_tokens}) "
                f"outside the {len(source_ids)} source blocks ({capacity} tokens)"
            )
        if self._data_ready:
            raise ValueError(f"transfer {self.transfer_id!r}: send() was already called")
        if self._total is not None and self._total != total_tokens:
            raise ValueError(
                f"transfer {self.transfer_id!r}: announced {self._total} tokens, sending {total_tokens}"
            )
        self._total, self._header, self._data_ready = total_tokens, header, True
        try:
            await self._stream(source_ids, source_offset)
        except BaseException as exc:
            self._fail(FailureReason.ABORTED, f"sender gave up: {describe_exit(exc)}")
            with trio.CancelScope(shield=True):
                await self._give_up()
            raise
        if self._peer_abort is not None:  # it came while the last round was written
            self._fail(self._peer_abort.reason, f"receiver aborted: {self._peer_abort.detail}")
        if self._failure is not None:
            with trio.CancelScope(shield=True):
                await self._give_up()
            raise transfer_error(self.report())
        self.status.move(TransferStatus.SUCCESS)  # no await since the last failure check
        return self.report()

    async def abort(self, detail: str) -> None:
        """Give up (the data source failed, the request was cancelled). Not while `send` runs in
        another task: cancel that task instead."""
        if self._peer_abort is not None:  # the receiver gave up first: its reason is the reason
            self._fail(self._peer_abort.reason, f"receiver aborted: {self._peer_abort.detail}")
        self._fail(FailureReason.ABORTED, detail)
        await self._abort_peer()

    # ------------------------------------------------------------------ streaming
    async def _stream(self, source_ids: Sequence[int], source_offset: int) -> None:
        assert self._total is not None
        faults = self.host.faults
        try:
            while True:
                grant = await self._next_grant()
                if grant is None:
                    return
                assert self.link is not None and self._landing_key is not None
                if not self._announced:
                    # Sent inline, ahead of round 0's bytes, so the receiver can open its window meanwhile;
                    # not when round 0 holds it all (its ChunkDone says the total too).
                    self._announced = True
                    if grant.tokens < self._total - self._position:
                        total = TotalAnnounce(
                            transfer_id=self.transfer_id, total_tokens=self._total, header=self._header
                        )
                        await self.link.send(total)
                if grant.stream_offset != self._position:
                    self._fail(
                        FailureReason.PROTOCOL_ERROR,
                        f"round {grant.round} granted at offset {grant.stream_offset}, expected {self._position}",
                    )
                    return
                count = max(0, min(grant.tokens, self._total - self._position))
                await faults.before_round(self.transfer_id, grant.round, self._ended)
                if not self._advance(TransferStatus.TRANSFERRING):
                    continue  # failed meanwhile: _next_grant acknowledges an abort and returns None
                bulk = BulkWrite(
                    source=self._source,
                    source_ids=source_ids,
                    source_offset=source_offset + self._position,
                    dest_ids=grant.blocks,
                    dest_offset=grant.landing_offset,
                    count=count,
                    buffers=self._buffers,
                    landing_key=self._landing_key,
                    round=grant.round,
                    corrupt=faults.corrupts(self.transfer_id, grant.round),
                )
                checksum = None
                if self._config.checksums:
                    checksum = checksum_runs(self._source, bulk.runs, self._buffers, source=True)
                done = ChunkDone(
                    transfer_id=self.transfer_id,
                    round=grant.round,
                    offset=self._position,
                    tokens=count,
                    total_tokens=self._total,
                    header=self._header,
                    checksum=checksum,
                )
                if self._peer_abort is not None:
                    continue  # _next_grant acknowledges and ends the transfer
                if count:
                    self._writing = True
                    try:
                        await self.link.write(bulk, trailer=done)
                    finally:
                        self._writing = False
                else:
                    await self.link.send(done)
                self._position += count
                self._rounds += count > 0
                self._bytes += bulk.nbytes
                self._next_round += 1
                self.liveness.touch()
                if self._position >= self._total or not self._advance(TransferStatus.WAITING_FOR_INPUT):
                    return
        except LinkError as exc:
            self._fail(FailureReason.LINK_LOST, str(exc))

    def _advance(self, status: TransferStatus) -> bool:
        """Move to `status` unless the transfer failed meanwhile (an abort or a lost link arrives
        between any two awaits); False then."""
        if self._failure is not None:
            return False
        self.status.move(status)
        return True

    async def _next_grant(self) -> Grant | RequestMoreCache | None:
        """The grant for the next round, or None once the transfer failed (peer abort acknowledged)."""
        while True:
            if self._peer_abort is not None:
                self._ack()
                self._fail(self._peer_abort.reason, f"receiver aborted: {self._peer_abort.detail}")
            if self._failure is not None:
                return None
            grant = self._grants.pop(self._next_round, None)
            if grant is not None:
                return grant
            if trio.current_time() >= self.liveness.deadline:
                self._no_grant()
                return None
            self._awaiting_grant = True  # `tick` keeps the deadline: no cancel scope per wait
            try:
                await self._wake.wait()
            finally:
                self._awaiting_grant = False
            self._wake = trio.Event()

    def _no_grant(self) -> None:
        self._fail(FailureReason.NO_PROGRESS, f"no grant from the receiver for {self.liveness.timeout} s")

    def tick(self, now: float) -> float:
        """Called by the endpoint's keep-alive task (`transport.protocol.liveness`): while the owner prepares
        the data, tell the receiver this side is alive and queued; while `send` waits for a grant, fail the
        transfer once the receiver made no progress for `progress_timeout` (`send` checks the deadline itself
        before it waits: no cancel scope per wait)."""
        if self.status.terminal:
            return math.inf
        preparing = self.link is not None and not self._data_ready
        say_preparing, expired = self.liveness.tick(now, busy=preparing, overdue=self._awaiting_grant)
        if say_preparing and self.link is not None:
            update = StatusUpdate(
                transfer_id=self.transfer_id, status=self.status.status, detail="sender preparing data"
            )
            self.host.send_soon(self.link, update)
        if expired:
            self._no_grant()
            return math.inf
        return self.liveness.wake_at(now)

    # ------------------------------------------------------------------ failure
    def _ack(self) -> None:
        if not self._acked and self.link is not None:
            self._acked = True
            self.host.send_soon(self.link, AbortAck(transfer_id=self.transfer_id))

    def _fail(self, reason: FailureReason, detail: str) -> None:
        if self._failure is None and not self.status.terminal:
            self._failure = (reason, detail)
            self.status.move(TransferStatus.FAILED)
            self._wake.set()
            self._ended.set()

    async def _give_up(self) -> None:
        """Tell the receiver, then wait until the link reads none of the source rows any more: the owner
        frees them once `send` returns, and a round written just before the failure may still be going
        out (ucx sends, inproc's copy lane). An abort from the receiver held back while a round was
        written is acknowledged then: after that write, as the fence must be."""
        await self._abort_peer()
        if self.link is not None:
            await self.link.settle()
            if self._peer_abort is not None:
                self._ack()

    async def _abort_peer(self) -> None:
        """Tell the receiver, unless it told us or cannot hear (bounded; the caller shields it)."""
        if self._failure is None or self._peer_abort is not None or self.link is None or self.link.is_closed:
            return
        reason, detail = self._failure
        if reason == FailureReason.LINK_LOST:
            return
        with trio.move_on_after(self._config.fence_timeout):
            try:
                await self.link.send(Abort(transfer_id=self.transfer_id, reason=reason, detail=detail))
            except LinkError:
                self._failure = (reason, f"{detail}; the link closed before the abort went out")

    def report(self) -> TransferReport:
        reason, detail = self._failure if self._failure is not None else (None, "")
        return TransferReport(
            transfer_id=self.transfer_id,
            role="sender",
            peer=(self.link.peer if self.link is not None else None) or "?",
            status=self.status.status,
            rounds=self._rounds,
            grants=self._next_round,
            tokens=self._position,
            bytes=self._bytes,
            seconds=trio.current_time() - self._started,
            started_at=self._started_wall,
            ended_at=time.time(),
            reason=reason,
            detail=detail,
        )

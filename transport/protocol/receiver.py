"""The receiving side of one transfer (architecture §5): grants, landing checks, consumption, failure.

Landing space comes from one of two places:
- *owned* (`blocks=None`): the session allocates each round's blocks from the pool under its own owner
  (`transfer:<id>`), granting `min(remaining, round cap, free)` and waiting (bounded by `pressure_timeout`)
  only when nothing is free. With a `consume` step each landed round is handed to it and then freed, so a
  transfer larger than the whole pool completes; without one they go to the caller's `owner` on success.
- *borrowed* (`blocks=[...]`): the caller reserved the landing allocation (KV: all-or-nothing, exact
  length) and keeps owning it; rounds are slices of it. Several transfers may land in one allocation
  with different `buffers` (a layer range each). The allocation may lie in storage the caller names for
  this receive (`into`: a `PoolStorage` of the endpoint's layout laid over the caller's own tensors,
  e.g. a weight piece's buffer): the bytes land there and nowhere else, and nothing is copied out.

Up to `window` grants stand at once; once the total is known (an early `TotalAnnounce` or round 0's
`ChunkDone`) the session grants ahead, so the sender never waits a round trip.

Failure: the session stops accepting bytes at once, tells the sender (`Abort`) unless the sender told
it, and returns every block: landed ones at once, others after the fence (the sender's `AbortAck`, or
the link torn down and quiesced). Owned blocks wait in quarantine so the failure is reported at once;
borrowed ones are the caller's, so `run` returns only after the fence. The caller's cancellation is a
failure like any other (`aborted`), cleaned up in shielded scopes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol, assert_never, final

import msgspec
import structlog
import trio

from messages.transfer import (
    Abort,
    AbortAck,
    ChunkDone,
    FailureReason,
    Grant,
    ReceiverBound,
    RequestMoreCache,
    StatusUpdate,
    TotalAnnounce,
    TransferReport,
    TransferStatus,
)
from transport.config import TransferConfig
from transport.errors import LinkError, ProtocolViolation, transfer_error
from transport.memory.blocks import AllocationTimeout, BlockPool
from transport.memory.storage import PoolStorage
from transport.protocol.landing import Consume, GrantedRound, LandedRound, Landings, ReceiveResult
from transport.protocol.link import Link
from transport.protocol.liveness import Liveness
from transport.protocol.scope import describe_exit, open_task_scope
from transport.protocol.status import StatusMachine

_log = structlog.get_logger("transport.receiver")


class ReceiverHost(Protocol):
    """What a receiver session needs from its endpoint."""

    name: str
    storage: PoolStorage
    pool: BlockPool
    config: TransferConfig

    def end_receiver(self, session: ReceiveSession) -> None: ...

    def open_fence(self, link: Link, transfer_id: str, quarantine: list[int], owner: str) -> trio.Event: ...

    def send_soon(self, link: Link, message: StatusUpdate) -> None: ...


@final
class ReceiveSession:
    """One transfer, receiver side. Built by `TransferEndpoint.receive`; `run` drives it."""

    def __init__(
        self,
        host: ReceiverHost,
        link: Link,
        transfer_id: str,
        *,
        landing_key: int,
        header: msgspec.Raw,
        expected_tokens: int | None,
        blocks: Sequence[int] | None,
        landing_offset: int,
        buffers: tuple[str, ...],
        all_buffers: bool,
        consume: Consume | None,
        owner: str | None,
        into: PoolStorage | None = None,
    ) -> None:
        self.host, self.link, self.transfer_id, self.landing_key = host, link, transfer_id, landing_key
        # Where this transfer's bytes land (`Landing.storage`): the links write here, checksums read here.
        self.storage, self._config = into if into is not None else host.storage, host.config
        self._header, self._expected, self._buffers = header, expected_tokens, buffers
        self._all_buffers, self._buffer_set = all_buffers, frozenset(buffers)
        self._consume, self._owner = consume, owner
        pool, tag = host.pool, f"transfer:{transfer_id}"
        self._landings = Landings(
            pool, host.config, tag, borrowed=blocks, borrowed_offset=landing_offset, expected=expected_tokens
        )
        self._bytes_per_token = sum(self.storage.spec(name).bytes_per_token for name in buffers)
        self.status = StatusMachine(transfer_id)
        self.liveness = Liveness(self._config.progress_timeout)
        self._received = self._data_rounds = 0
        self._total: int | None = None
        self._sender_header: msgspec.Raw = header
        self._landed_send, self._landed = trio.open_memory_channel[LandedRound](math.inf)
        self._wake_granter = trio.Event()
        self._nursery: trio.Nursery | None = None  # the session's, while it runs: the granter starts there
        self._granter_started = self._peer_fenced = False
        self._failure: tuple[FailureReason, str] | None = None
        self._started, self._started_wall = trio.current_time(), time.time()

    # ------------------------------------------------------------------ the session
    async def run(self) -> ReceiveResult:
        try:
            async with open_task_scope() as nursery:
                self._nursery = nursery
                try:
                    await self._grant_or_fail(self._landings.next_tokens(self._total))  # round 0 opens it
                    self._more_grants()
                    await self._consume_rounds()
                    nursery.cancel_scope.cancel()
                finally:
                    self._nursery = None  # it takes no task from here, even while a cancellation unwinds
        except BaseException as exc:
            if self._failure is None:
                self._failure = (FailureReason.ABORTED, f"receiver gave up: {describe_exit(exc)}")
            with trio.CancelScope(shield=True):
                await self._clean_up_failure()
            raise
        if self._failure is not None:
            with trio.CancelScope(shield=True):
                await self._clean_up_failure()
            raise transfer_error(self._report())
        return self._succeed()

    async def _consume_rounds(self) -> None:
        async for landed in self._landed:  # without a consumer only the end comes (the channel closes)
            assert self._consume is not None
            with self.liveness.local_wait():
                await self._consume(landed)
            self._landings.release(self._landings.rounds[landed.round])
            self._more_grants()

    def _succeed(self) -> ReceiveResult:
        self.status.move(TransferStatus.SUCCESS)
        kept = (
            []
            if self._consume is not None and self._landings.borrowed is None
            else self._landings.kept(self._owner)
        )
        self.host.end_receiver(self)
        assert self._total is not None
        return ReceiveResult(
            report=self._report(), blocks=kept, total_tokens=self._total, header=self._sender_header
        )

    # ------------------------------------------------------------------ granting
    def _more_grants(self) -> None:
        """Wake the granter, or start it once a grant after round 0 is due (most transfers need none)."""
        if self._granter_started:
            self._wake_granter.set()
        elif self._nursery is not None and self._failure is None and self._landings.next_tokens(self._total):
            self._granter_started = True
            self._nursery.start_soon(self._granter)

    async def _granter(self) -> None:
        """Grants every round after round 0 as `Landings.next_tokens` allows; woken by `_more_grants`."""
        while self._failure is None and (self._total is None or self._landings.granted < self._total):
            tokens = self._landings.next_tokens(self._total)
            if tokens == 0:
                await self._wake_granter.wait()
                self._wake_granter = trio.Event()
            else:
                await self._grant_or_fail(tokens)

    async def _grant_or_fail(self, tokens: int) -> None:
        try:
            await self._grant(tokens)
        except LinkError as exc:
            self._fail(FailureReason.LINK_LOST, str(exc))
        except AllocationTimeout as exc:
            self._fail(FailureReason.MEMORY_PRESSURE, str(exc))

    async def _grant(self, tokens: int) -> None:
        granted = await self._landings.take(tokens, self.liveness)
        number, offset, tokens = granted.number, granted.offset, granted.tokens
        blocks, landing = granted.blocks, granted.landing_offset
        if number > 0:
            more = RequestMoreCache(
                transfer_id=self.transfer_id,
                round=number,
                stream_offset=offset,
                tokens=tokens,
                blocks=blocks,
                landing_offset=landing,
            )
            await self.link.send(more)
            return
        # Before the send: the reply may be handled while this task waits in `send`.
        self.status.move(TransferStatus.WAITING_FOR_INPUT)
        grant = Grant(
            transfer_id=self.transfer_id,
            round=0,
            landing_key=self.landing_key,
            stream_offset=0,
            tokens=tokens,
            blocks=blocks,
            header=self._header,
            landing_offset=landing,
            buffers=None if self._all_buffers else self._buffers,
            expected_tokens=self._expected,
        )
        await self.link.send(grant)

    # ------------------------------------------------------------------ incoming
    def handle(self, message: ReceiverBound) -> None:
        """A message from the sender (called by the endpoint's link reader; never blocks)."""
        if self._failure is not None or self.status.terminal:
            return
        self.liveness.touch()
        try:
            match message:
                case ChunkDone():
                    self._on_chunk_done(message)
                case TotalAnnounce():
                    self._set_total(message.total_tokens)
                    self._sender_header = message.header
                    self._more_grants()
                case Abort():
                    self._peer_fenced = True  # the sender's Abort follows its last write
                    self._fail(message.reason, f"sender aborted: {message.detail}")
                case AbortAck() | StatusUpdate():
                    pass
                case _:
                    assert_never(message)
        except ProtocolViolation as exc:
            self._fail(FailureReason.PROTOCOL_ERROR, str(exc))

    def _set_total(self, total: int) -> None:
        if self._total is not None:
            if total != self._total:
                raise ProtocolViolation(f"total changed from {self._total} to {total} tokens")
            return
        if self._expected is not None and total != self._expected:
            raise ProtocolViolation(f"sender total {total} tokens, receiver expected {self._expected}")
        capacity = self._landings.capacity(consuming=self._consume is not None)
        if capacity is not None and total > capacity:
            self._fail(
                FailureReason.TOO_LARGE, f"{total} tokens cannot fit: the receiver can hold {capacity}"
            )
        self._total = total

    def _on_chunk_done(self, message: ChunkDone) -> None:
        granted = self._landings.rounds.get(message.round)
        if granted is None:
            if message.round < self._landings.next_round:
                return
            raise ProtocolViolation(f"ChunkDone for round {message.round}, which was never granted")
        if granted.landed:
            return
        if message.offset != granted.offset:
            raise ProtocolViolation(
                f"round {message.round}: ChunkDone offset {message.offset}, granted offset {granted.offset}"
            )
        self._set_total(message.total_tokens)
        if self._failure is not None:
            return
        assert self._total is not None
        expected = max(0, min(granted.tokens, self._total - granted.offset))
        if message.tokens != expected:
            raise ProtocolViolation(
                f"round {message.round}: ChunkDone says {message.tokens} tokens, the grant needs {expected}"
            )
        if (message.checksum is not None or self._config.checksums) and not self._verify(granted, message):
            return
        self._landings.land(granted, message.tokens)
        self._received += message.tokens
        self._data_rounds += message.tokens > 0
        self._sender_header = message.header
        self.status.move(TransferStatus.TRANSFERRING)
        if self._consume is not None:
            landed = LandedRound(
                round=message.round,
                offset=message.offset,
                tokens=message.tokens,
                total_tokens=self._total,
                blocks=granted.blocks,
                landing_offset=granted.landing_offset,
                header=message.header,
                storage=self.storage,
                buffers=self._buffers,
            )
            self._landed_send.send_nowait(landed)
        if self._received >= self._total:
            self._landed_send.close()
        self._more_grants()

    def _verify(self, granted: GrantedRound, message: ChunkDone) -> bool:
        if message.checksum is None:
            raise ProtocolViolation(f"round {message.round}: checksums are required, ChunkDone has none")
        actual = granted.checksum(self.storage, message.tokens, self._buffers)
        if actual == message.checksum:
            return True
        detail = f"round {message.round}: checksum 0x{actual:08x}, sender sent 0x{message.checksum:08x}"
        self._fail(FailureReason.CORRUPTED, detail)
        return False

    def claim(self, round: int, buffer: str, segments: Sequence[tuple[int, int]]) -> bool:
        """Landing check for bulk bytes (see `transport.protocol.link.Landing`)."""
        if self._failure is not None:
            return False
        granted = self._landings.rounds.get(round)
        if granted is None:
            self._fail(FailureReason.PROTOCOL_ERROR, f"bytes for round {round}, which was never granted")
            return False
        if granted.landed:
            return False
        refusal = None if buffer in self._buffer_set else f"bytes for buffer {buffer!r}, not selected"
        refusal = refusal or granted.refusal_of(segments)
        if refusal is not None:
            self._fail(FailureReason.PROTOCOL_ERROR, refusal)
            return False
        self.liveness.touch()
        return True

    # ------------------------------------------------------------------ liveness
    def tick(self, now: float) -> float:
        """By the endpoint's keep-alive task: `StatusUpdate` while busy, `no_progress` past the deadline."""
        if self._failure is not None or self.status.terminal:
            return math.inf
        say_busy, expired = self.liveness.tick(now, busy=self.liveness.local_waits > 0)
        if say_busy:
            busy = StatusUpdate(
                transfer_id=self.transfer_id, status=self.status.status, detail="receiver busy"
            )
            self.host.send_soon(self.link, busy)
        if expired:
            detail = f"nothing from the sender for {self.liveness.timeout} s in {self.status.status.value}"
            self._fail(FailureReason.NO_PROGRESS, detail)
            return math.inf
        return self.liveness.wake_at(now)

    # ------------------------------------------------------------------ failure
    def link_lost(self, detail: str) -> None:
        self._peer_fenced = True
        self._fail(FailureReason.LINK_LOST, detail)

    def _fail(self, reason: FailureReason, detail: str) -> None:
        if self._failure is not None or self.status.terminal:
            return
        self._failure = (reason, detail)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _clean_up_failure(self) -> None:
        """Shielded by the caller. Ends `Failed`; every block back, or quarantined until the fence."""
        assert self._failure is not None
        reason, detail = self._failure
        self.status.move(TransferStatus.FAILED)
        self.host.end_receiver(self)
        self._landed_send.close()
        if not self._peer_fenced and not self.link.is_closed:
            with trio.move_on_after(self._config.fence_timeout):
                try:
                    await self.link.send(Abort(transfer_id=self.transfer_id, reason=reason, detail=detail))
                except LinkError as exc:
                    # A link that cannot carry the Abort is closed, and a closed link is the fence.
                    _log.info("transfer.abort_undelivered", transfer_id=self.transfer_id, error=str(exc))
        fenced = self._peer_fenced or self.link.is_closed
        if self.link.is_closed:  # a writer that neither finishes nor exits: its fence waits in the background
            with trio.move_on_after(self._config.fence_timeout) as waiting:
                await self.link.quiesce()
            fenced = fenced and not waiting.cancelled_caught
        in_flight, writes_pending = self._landings.settle_failure(fenced=fenced)
        if writes_pending:
            fence = self.host.open_fence(self.link, self.transfer_id, in_flight, self._landings.tag)
            if self._landings.borrowed is not None:
                await fence.wait()  # the caller owns these blocks: it may reuse them once we return

    def _report(self) -> TransferReport:
        reason, detail = self._failure if self._failure is not None else (None, "")
        return TransferReport(
            transfer_id=self.transfer_id,
            role="receiver",
            peer=self.link.peer or "?",
            status=self.status.status,
            rounds=self._data_rounds,
            grants=self._landings.next_round,
            tokens=self._received,
            bytes=self._received * self._bytes_per_token,
            seconds=trio.current_time() - self._started,
            started_at=self._started_wall,
            ended_at=time.time(),
            reason=reason,
            detail=detail,
        )

"""The receiving side of one transfer (DESIGN §5): grants, landing checks, consumption, failure.

Landing space comes from one of two places:
- *owned* (`blocks=None`): the session allocates each round's blocks from the pool under its own owner
  (`transfer:<id>`), granting `min(remaining, round cap, free)` and waiting (bounded by
  `pressure_timeout`) only when nothing is free. With a `consume` step each landed round is handed to it
  and then freed, so a transfer larger than the whole pool completes; without one the blocks are kept
  and handed over to the caller's `owner` on success.
- *borrowed* (`blocks=[...]`): the caller reserved the landing allocation (KV: all-or-nothing, exact
  length) and keeps owning it; rounds are slices of it. Several transfers may land in one allocation
  with different `buffers` (a layer range each).

Up to `window` grants stand at once; once the total is known (an early `TotalAnnounce` or round 0's
`ChunkDone`) the session grants ahead so the sender never waits a round trip.

Failure: the session stops accepting bytes at once, tells the sender (`Abort`) unless the sender told
it, and returns every block: landed ones at once, ones a write may still be heading for only after the
fence (the sender's `AbortAck`, or the link torn down and quiesced). Owned blocks wait in quarantine so
the failure is reported without delay; borrowed blocks are the caller's, so `run` returns only after the
fence. Cancellation of the caller is a failure like any other (`aborted`), cleaned up in shielded scopes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, assert_never, final

import msgspec
import structlog
import torch
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
from transport.blocks import AllocationTimeout, BlockPool
from transport.config import TransferConfig
from transport.errors import LinkError, ProtocolViolation, transfer_error
from transport.link import Link
from transport.runs import checksum_runs, plan_runs
from transport.scope import describe_exit, open_task_scope
from transport.status import StatusMachine
from transport.storage import PoolStorage

_log = structlog.get_logger("transport.receiver")


@dataclass(frozen=True, slots=True, kw_only=True)
class LandedRound:
    """One round's tokens, landed: stream tokens `[offset, offset + tokens)` of `total_tokens`, at token
    `landing_offset` of `blocks` in `storage`. `header` is the sender's header of that round."""

    round: int
    offset: int
    tokens: int
    total_tokens: int
    blocks: tuple[int, ...]
    landing_offset: int
    header: msgspec.Raw
    storage: PoolStorage
    buffers: tuple[str, ...]

    def gather(self) -> dict[str, torch.Tensor]:
        return self.storage.gather(self.blocks, self.landing_offset, self.tokens, self.buffers)


Consume = Callable[[LandedRound], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiveResult:
    """A finished transfer. `blocks`: kept blocks in token order (owned without `consume`: now owned by
    the caller's `owner`; borrowed: the caller's own list), or `[]` when every round was consumed."""

    report: TransferReport
    blocks: list[int]
    total_tokens: int
    header: msgspec.Raw


class ReceiverHost(Protocol):
    """What a receiver session needs from its endpoint."""

    name: str
    storage: PoolStorage
    pool: BlockPool
    config: TransferConfig

    def end_receiver(self, session: ReceiveSession) -> None: ...

    def open_fence(self, link: Link, transfer_id: str, quarantine: list[int], owner: str) -> trio.Event: ...


@dataclass(slots=True)
class _Round:
    number: int
    offset: int
    tokens: int
    blocks: tuple[int, ...]
    landing_offset: int
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # block -> granted [lo, hi) rows
    landed: bool = False
    released: bool = False


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
    ) -> None:
        self.host, self.link, self.transfer_id, self.landing_key = host, link, transfer_id, landing_key
        self.storage = host.storage
        self._pool, self._config, self._bs = host.pool, host.config, host.storage.block_size
        self._header, self._expected, self._buffers = header, expected_tokens, buffers
        self._all_buffers, self._buffer_set = all_buffers, frozenset(buffers)
        self._borrowed = None if blocks is None else tuple(blocks)
        self._borrowed_offset = landing_offset
        self._consume, self._owner = consume, owner
        self._tag = f"transfer:{transfer_id}"
        self._bytes_per_token = sum(self.storage.spec(name).bytes_per_token for name in buffers)
        self.status = StatusMachine(transfer_id)
        self._rounds: dict[int, _Round] = {}
        self._next_round = 0
        self._granted = 0
        self._total: int | None = None
        self._received = 0
        self._data_rounds = 0
        self._sender_header: msgspec.Raw = header
        self._landed_send, self._landed = trio.open_memory_channel[LandedRound](math.inf)
        self._wake_granter = trio.Event()
        self._local_waits = 0
        self._last_progress = trio.current_time()
        self._failure: tuple[FailureReason, str] | None = None
        self._peer_fenced = False
        self._scope: trio.CancelScope | None = None
        self._started = trio.current_time()
        self._started_wall = time.time()

    # ------------------------------------------------------------------ the session
    async def run(self) -> ReceiveResult:
        try:
            async with open_task_scope() as nursery:
                self._scope = nursery.cancel_scope
                nursery.start_soon(self._granter)
                nursery.start_soon(self._watchdog)
                nursery.start_soon(self._ticker)
                await self._consume_rounds()
                nursery.cancel_scope.cancel()
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
        async for landed in self._landed:
            if self._consume is not None:
                self._local_waits += 1
                try:
                    await self._consume(landed)
                finally:
                    self._local_waits -= 1
                    self._touch()
                if self._borrowed is None:
                    self._release(self._rounds[landed.round])
                    self._wake()

    def _succeed(self) -> ReceiveResult:
        self.status.move(TransferStatus.SUCCESS)
        kept: list[int] = []
        if self._borrowed is not None:
            kept = list(self._borrowed)
        elif self._consume is None:
            for number in sorted(self._rounds):
                kept.extend(self._rounds[number].blocks)
            if self._owner is not None and self._owner != self._tag and kept:
                self._pool.hand_over(kept, self._tag, self._owner)
        self.host.end_receiver(self)
        assert self._total is not None
        return ReceiveResult(
            report=self._report(), blocks=kept, total_tokens=self._total, header=self._sender_header
        )

    # ------------------------------------------------------------------ granting
    def _next_grant_tokens(self) -> int:
        """Tokens the next round may grant now; 0 when it must wait (window full, total unknown) or is done."""
        cap = math.inf if self._config.round_cap_blocks is None else self._config.round_cap_blocks * self._bs
        if self._next_round == 0:
            if self._expected is not None:
                want: float = self._expected
            elif self._borrowed is not None:
                want = math.inf
            else:
                want = self._config.default_grant_blocks * self._bs
        else:
            outstanding = sum(1 for r in self._rounds.values() if not r.landed)
            if self._total is None or outstanding >= self._config.window:
                return 0
            want = self._total - self._granted
        if self._borrowed is not None:
            want = min(want, len(self._borrowed) * self._bs - self._borrowed_offset - self._granted)
        return int(max(0, min(want, cap)))

    async def _granter(self) -> None:
        try:
            while self._total is None or self._granted < self._total:
                tokens = self._next_grant_tokens()
                if tokens == 0 and not (self._next_round == 0 and self._total is None):
                    await self._wake_granter.wait()
                    self._wake_granter = trio.Event()
                    continue
                await self._grant(tokens)
        except LinkError as exc:
            self._fail(FailureReason.LINK_LOST, str(exc))
        except AllocationTimeout as exc:
            self._fail(FailureReason.MEMORY_PRESSURE, str(exc))

    async def _grant(self, tokens: int) -> None:
        number, offset = self._next_round, self._granted
        if self._borrowed is None:
            blocks = tuple(await self._allocate(self._pool.blocks_for(tokens)))
            tokens, landing = min(tokens, len(blocks) * self._bs), 0
        else:
            start = self._borrowed_offset + offset
            first, landing = divmod(start, self._bs)
            blocks = self._borrowed[first : -(-(start + tokens) // self._bs)]
        granted = _Round(number, offset, tokens, blocks, landing)
        for index, block in enumerate(blocks):
            lo, hi = max(0, landing - index * self._bs), min(self._bs, landing + tokens - index * self._bs)
            if lo < hi:
                granted.rows[block] = (lo, hi)
        self._rounds[number] = granted
        self._next_round, self._granted = number + 1, offset + tokens
        if number == 0:
            # Before the send: the reply may be handled while this task waits in `send`.
            self.status.move(TransferStatus.WAITING_FOR_INPUT)
            await self.link.send(
                Grant(
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
            )
        else:
            await self.link.send(
                RequestMoreCache(
                    transfer_id=self.transfer_id,
                    round=number,
                    stream_offset=offset,
                    tokens=tokens,
                    blocks=blocks,
                    landing_offset=landing,
                )
            )

    async def _allocate(self, n_blocks: int) -> list[int]:
        """Up to `n_blocks` blocks now; when none are free, wait (bounded) for at least one."""
        if n_blocks == 0:
            return []
        ids = self._pool.try_allocate(min(n_blocks, self._pool.free_blocks), self._tag)
        if ids:
            return ids
        self._local_waits += 1
        try:
            deadline = trio.current_time() + self._config.pressure_timeout
            ids = await self._pool.allocate_wait(1, self._tag, deadline=deadline)
        finally:
            self._local_waits -= 1
            self._touch()
        return ids + (self._pool.try_allocate(min(n_blocks - 1, self._pool.free_blocks), self._tag) or [])

    # ------------------------------------------------------------------ incoming
    def handle(self, message: ReceiverBound) -> None:
        """A message from the sender (called by the endpoint's link reader; never blocks)."""
        if self._failure is not None or self.status.terminal:
            return
        self._touch()
        try:
            match message:
                case ChunkDone():
                    self._on_chunk_done(message)
                case TotalAnnounce():
                    self._set_total(message.total_tokens)
                    self._sender_header = message.header
                    self._wake()
                case Abort():
                    self._peer_fenced = True
                    self._fail(message.reason, f"sender aborted: {message.detail}")
                case AbortAck():
                    pass
                case StatusUpdate():
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
        capacity = None
        if self._borrowed is not None:
            capacity = len(self._borrowed) * self._bs - self._borrowed_offset
        elif self._consume is None:
            capacity = self._pool.num_blocks * self._bs
        if capacity is not None and total > capacity:
            self._fail(
                FailureReason.TOO_LARGE, f"{total} tokens cannot fit: the receiver can hold {capacity}"
            )
        self._total = total

    def _on_chunk_done(self, message: ChunkDone) -> None:
        granted = self._rounds.get(message.round)
        if granted is None:
            if message.round < self._next_round:
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
        granted.landed, granted.tokens = True, message.tokens
        self._received += message.tokens
        self._data_rounds += message.tokens > 0
        self._sender_header = message.header
        if self._borrowed is None:
            keep = self._pool.blocks_for(message.tokens)
            if keep < len(granted.blocks):
                self._pool.free(granted.blocks[keep:], self._tag)
                granted.blocks = granted.blocks[:keep]
        self.status.move(TransferStatus.TRANSFERRING)
        self._landed_send.send_nowait(
            LandedRound(
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
        )
        if self._received >= self._total:
            self._landed_send.close()
        self._wake()

    def _verify(self, granted: _Round, message: ChunkDone) -> bool:
        if message.checksum is None:
            raise ProtocolViolation(f"round {message.round}: checksums are required, ChunkDone has none")
        runs = plan_runs(
            granted.blocks,
            granted.landing_offset,
            granted.blocks,
            granted.landing_offset,
            message.tokens,
            self._bs,
        )
        actual = checksum_runs(self.storage, runs, self._buffers, source=False)
        if actual != message.checksum:
            self._fail(
                FailureReason.CORRUPTED,
                f"round {message.round}: checksum 0x{actual:08x}, sender sent 0x{message.checksum:08x}",
            )
            return False
        return True

    def claim(self, round: int, buffer: str, dst_row: int, rows: int) -> bool:
        """Landing check for bulk bytes (see `transport.link.Landing`)."""
        if self._failure is not None:
            return False
        granted = self._rounds.get(round)
        if granted is None:
            self._fail(FailureReason.PROTOCOL_ERROR, f"bytes for round {round}, which was never granted")
            return False
        if granted.landed:
            return False
        if buffer not in self._buffer_set:
            self._fail(FailureReason.PROTOCOL_ERROR, f"bytes for buffer {buffer!r}, not selected")
            return False
        row, end = dst_row, dst_row + rows
        while row < end:
            block, first = divmod(row, self._bs)
            last = min(end - block * self._bs, self._bs)
            span = granted.rows.get(block)
            if span is None or first < span[0] or last > span[1]:
                self._fail(
                    FailureReason.PROTOCOL_ERROR,
                    f"round {round}: bytes for rows {first}..{last} of block {block}, which are not granted",
                )
                return False
            row = (block + 1) * self._bs
        self._touch()
        return True

    # ------------------------------------------------------------------ liveness
    def _touch(self) -> None:
        self._last_progress = trio.current_time()

    def _wake(self) -> None:
        self._wake_granter.set()

    async def _watchdog(self) -> None:
        timeout = self._config.progress_timeout
        while True:
            await trio.sleep_until(self._last_progress + timeout)
            if self._local_waits:
                self._touch()
            elif trio.current_time() >= self._last_progress + timeout:
                self._fail(
                    FailureReason.NO_PROGRESS,
                    f"nothing from the sender for {timeout} s in {self.status.status.value}",
                )
                return

    async def _ticker(self) -> None:
        """While this side holds things up (waiting for blocks or its consumer), tell the sender."""
        while True:
            await trio.sleep(self._config.progress_timeout / 3)
            if self._local_waits:
                try:
                    await self.link.send(
                        StatusUpdate(
                            transfer_id=self.transfer_id, status=self.status.status, detail="receiver busy"
                        )
                    )
                except LinkError as exc:
                    self._fail(FailureReason.LINK_LOST, str(exc))
                    return

    # ------------------------------------------------------------------ failure
    def link_lost(self, detail: str) -> None:
        self._peer_fenced = True
        self._fail(FailureReason.LINK_LOST, detail)

    def _fail(self, reason: FailureReason, detail: str) -> None:
        if self._failure is not None or self.status.terminal:
            return
        self._failure = (reason, detail)
        if self._scope is not None:
            self._scope.cancel()

    def _release(self, granted: _Round) -> None:
        if not granted.released and self._borrowed is None and granted.blocks:
            self._pool.free(granted.blocks, self._tag)
        granted.released = True

    async def _clean_up_failure(self) -> None:
        """Shielded by the caller. Ends `Failed`; every block back, or quarantined until the fence."""
        assert self._failure is not None
        reason, detail = self._failure
        self.status.move(TransferStatus.FAILED)
        self.host.end_receiver(self)
        self._landed_send.close()
        if not self._peer_fenced and not self.link.is_closed:
            abort = Abort(transfer_id=self.transfer_id, reason=reason, detail=detail)
            with trio.move_on_after(self._config.fence_timeout):
                try:
                    await self.link.send(abort)
                except LinkError as exc:
                    # A link that cannot carry the Abort is closed, and a closed link is the fence.
                    _log.info("transfer.abort_undelivered", transfer_id=self.transfer_id, error=str(exc))
        if self.link.is_closed:
            await self.link.quiesce()
        fenced = self._peer_fenced or self.link.is_closed
        in_flight: list[int] = []
        writes_pending = False
        for granted in self._rounds.values():
            if granted.landed or fenced:
                self._release(granted)
                continue
            writes_pending = True
            if self._borrowed is None and not granted.released:
                in_flight.extend(granted.blocks)
                granted.released = True
        if writes_pending:
            fence = self.host.open_fence(self.link, self.transfer_id, in_flight, self._tag)
            if self._borrowed is not None:
                await fence.wait()

    def _report(self) -> TransferReport:
        reason, detail = self._failure if self._failure is not None else (None, "")
        return TransferReport(
            transfer_id=self.transfer_id,
            role="receiver",
            peer=self.link.peer or "?",
            status=self.status.status,
            rounds=self._data_rounds,
            grants=self._next_round,
            tokens=self._received,
            bytes=self._received * self._bytes_per_token,
            seconds=trio.current_time() - self._started,
            started_at=self._started_wall,
            ended_at=time.time(),
            reason=reason,
            detail=detail,
        )

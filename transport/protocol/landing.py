"""Where a receiver's rounds land: granted rounds, their landing checks, and what consumers see.

A `GrantedRound` is one grant: stream tokens `[offset, offset + tokens)` landing at token
`landing_offset` of `blocks`. It knows, per block, which rows the grant covers, so a bulk frame can be
checked against it before a byte is written (two rounds may share a block when a borrowed landing starts
mid-block). `Landings` keeps a transfer's rounds and the blocks behind them: *owned* (allocated per
round from the pool, `min(want, free)`, waiting bounded by `pressure_timeout` only when none are free)
or *borrowed* (slices of the caller's allocation — in the endpoint's pool, or in storage the caller
names for this receive: `TransferEndpoint.receive(..., into=...)`). `grant_size` is the sizing rule (architecture §5.2-5.4).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, final

import msgspec
import torch
import trio

from messages.transfer import TransferReport
from transport.bulk.runs import checksum_runs, plan_runs
from transport.config import TransferConfig
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage
from transport.protocol.liveness import Liveness


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
        """The round's tokens, one fresh `[tokens, *shape]` tensor per transferred buffer."""
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


CLEARED_KEPT: Final = 8  # segment lists `GrantedRound.refusal_of` remembers


@dataclass(slots=True)
class GrantedRound:
    number: int
    offset: int
    tokens: int
    blocks: tuple[int, ...]
    landing_offset: int
    block_size: int
    landed: bool = False
    released: bool = False
    # The last segment lists found granted: a write's buffers repeat them (a round's frames per buffer).
    cleared: list[Sequence[tuple[int, int]]] = field(default_factory=list)
    index: dict[int, int] = field(init=False)  # block -> its position in `blocks`

    def __post_init__(self) -> None:
        self.index = dict(zip(self.blocks, range(len(self.blocks)), strict=True))

    def checksum(self, storage: PoolStorage, tokens: int, buffers: Sequence[str]) -> int:
        """CRC-32 of the round's first `tokens` landed tokens (`transport.bulk.runs.checksum_runs`)."""
        own = (self.blocks, self.landing_offset)
        return checksum_runs(storage, plan_runs(*own, *own, tokens, self.block_size), buffers, source=False)

    def refusal_of(self, segments: Sequence[tuple[int, int]]) -> str | None:
        """Why the first refused `(dst_row, rows)` segment of flat rows is not this grant's — some of
        its rows lie outside the granted tokens — or None when every segment is granted."""
        if any(segments == known for known in self.cleared):
            return None
        size, position, start = self.block_size, self.index.get, self.landing_offset
        end = start + self.tokens  # the granted tokens are [start, end) of `blocks`
        for dst_row, rows in segments:
            block, first = divmod(dst_row, size)
            stop = first + rows  # a row of `block`, or past its end when the segment spans blocks
            while True:
                last = stop if stop <= size else size
                at = position(block)
                if at is None or first < start - at * size or last > end - at * size:
                    return (
                        f"round {self.number}: bytes for rows {first}..{last} of block {block}, "
                        "which are not granted"
                    )
                if stop <= size:
                    break
                block, first, stop = block + 1, 0, stop - size
        self.cleared = [segments, *self.cleared[: CLEARED_KEPT - 1]]
        return None


def grant_size(
    *,
    first: bool,
    expected: int | None,
    default_tokens: int,
    cap_tokens: float,
    total: int | None,
    granted: int,
    room: float,
) -> int:
    """Tokens the next grant asks for (0: none now). Round 0: the exact length when known, else the
    default; later rounds: what remains of a known total. Always within the per-round cap and `room`
    (what a borrowed allocation has left; unbounded for owned landings)."""
    if first:
        want: float = expected if expected is not None else (room if math.isfinite(room) else default_tokens)
    elif total is None:
        return 0
    else:
        want = total - granted
    return int(max(0, min(want, cap_tokens, room)))


@final
class Landings:
    """The rounds one receiver granted, and the blocks behind them (owned under `tag`, or borrowed)."""

    def __init__(
        self,
        pool: BlockPool,
        config: TransferConfig,
        tag: str,
        *,
        borrowed: Sequence[int] | None,
        borrowed_offset: int,
        expected: int | None,
    ) -> None:
        self.pool, self.config, self.tag, self.expected = pool, config, tag, expected
        self.block_size = pool.block_size
        self.borrowed = None if borrowed is None else tuple(borrowed)
        self.borrowed_offset = borrowed_offset
        self.rounds: dict[int, GrantedRound] = {}
        self.next_round = 0
        self.granted = 0
        self.outstanding = 0  # rounds granted and not landed yet

    def capacity(self, consuming: bool) -> int | None:
        """Most tokens this landing can ever hold (None: unbounded, rounds are consumed and freed)."""
        if self.borrowed is not None:
            return len(self.borrowed) * self.block_size - self.borrowed_offset
        return None if consuming else self.pool.num_blocks * self.block_size

    def next_tokens(self, total: int | None) -> int:
        """Tokens the next grant asks for now; 0 when it must wait (window full, total unknown)."""
        if self.next_round > 0 and self.outstanding >= self.config.window:
            return 0
        cap = self.config.round_cap_blocks
        room: float = math.inf
        if self.borrowed is not None:
            room = len(self.borrowed) * self.block_size - self.borrowed_offset - self.granted
        return grant_size(
            first=self.next_round == 0,
            expected=self.expected,
            default_tokens=self.config.default_grant_blocks * self.block_size,
            cap_tokens=math.inf if cap is None else cap * self.block_size,
            total=total,
            granted=self.granted,
            room=room,
        )

    async def take(self, tokens: int, liveness: Liveness) -> GrantedRound:
        """Record the next round for `tokens` tokens (fewer when the pool has fewer blocks free).
        Raises `AllocationTimeout` when no block frees up before the pressure deadline."""
        size, offset = self.block_size, self.granted
        if self.borrowed is None:
            blocks = tuple(await self._allocate(self.pool.blocks_for(tokens), liveness))
            tokens, landing = min(tokens, len(blocks) * size), 0
        else:
            start = self.borrowed_offset + offset
            first, landing = divmod(start, size)
            blocks = self.borrowed[first : -(-(start + tokens) // size)]
        granted = GrantedRound(self.next_round, offset, tokens, blocks, landing, size)
        self.rounds[granted.number] = granted
        self.next_round, self.granted = granted.number + 1, offset + tokens
        self.outstanding += 1
        return granted

    async def _allocate(self, n_blocks: int, liveness: Liveness) -> list[int]:
        if n_blocks == 0:
            return []
        ids = self.pool.try_allocate(min(n_blocks, self.pool.available_blocks), self.tag)
        if ids:
            return ids
        with liveness.local_wait():
            deadline = trio.current_time() + self.config.pressure_timeout
            ids = await self.pool.allocate_wait(1, self.tag, deadline=deadline)
        return ids + (self.pool.try_allocate(min(n_blocks - 1, self.pool.available_blocks), self.tag) or [])

    def land(self, granted: GrantedRound, tokens: int) -> None:
        """Round `granted` landed `tokens` tokens; owned blocks it did not need go back at once."""
        granted.landed, granted.tokens = True, tokens
        self.outstanding -= 1
        if self.borrowed is None:
            keep = self.pool.blocks_for(tokens)
            if keep < len(granted.blocks):
                self.pool.free(granted.blocks[keep:], self.tag)
                granted.blocks = granted.blocks[:keep]

    def release(self, granted: GrantedRound) -> None:
        if not granted.released and self.borrowed is None and granted.blocks:
            self.pool.free(granted.blocks, self.tag)
        granted.released = True

    def kept(self, owner: str | None) -> list[int]:
        """All landed blocks in token order, handed over to `owner` when the session owned them."""
        if self.borrowed is not None:
            return list(self.borrowed)
        blocks = [block for number in sorted(self.rounds) for block in self.rounds[number].blocks]
        if owner is not None and owner != self.tag and blocks:
            self.pool.hand_over(blocks, self.tag, owner)
        return blocks

    def settle_failure(self, fenced: bool) -> tuple[list[int], bool]:
        """Free what no write can still reach; return the owned blocks a write may still reach (to
        quarantine) and whether any round (owned or borrowed) still awaits its fence."""
        in_flight: list[int] = []
        pending = False
        for granted in self.rounds.values():
            if granted.landed or fenced:
                self.release(granted)
                continue
            pending = True
            if self.borrowed is None and not granted.released:
                in_flight.extend(granted.blocks)
                granted.released = True
        return in_flight, pending


def check_landing_request(
    transfer_id: str,
    layout_names: tuple[str, ...],
    buffers: Sequence[str] | None,
    storage: PoolStorage,
    blocks: Sequence[int] | None,
    landing_offset: int,
) -> tuple[str, ...]:
    """The selected buffer names; `ValueError` naming the bad value for unknown buffers or a borrowed
    landing outside `storage` (the endpoint's pool, or the storage the receive lands in)."""
    names = layout_names if buffers is None else tuple(buffers)
    unknown = [name for name in names if name not in layout_names]
    if unknown or not names:
        raise ValueError(
            f"transfer {transfer_id!r}: unknown buffers {unknown}; the layout has {list(layout_names)}"
        )
    if blocks is not None:
        bad = [block for block in blocks if not 0 <= block < storage.num_blocks]
        if bad or not 0 <= landing_offset < max(1, len(blocks)) * storage.block_size:
            raise ValueError(
                f"transfer {transfer_id!r}: landing blocks {bad} outside the pool or landing_offset "
                f"{landing_offset} outside {len(blocks)} blocks"
            )
    return names

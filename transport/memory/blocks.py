"""The block allocator: fixed-size blocks, owners, leak checks; an allocation is taken, checked, handed
over and freed by set and list operations, not a Python step per block.

Pure Python (no torch): it hands out *block ids*; the bytes live in a separate storage object
(`transport.memory.storage`). An allocation is a list of ids that is, in general, not contiguous — a token
`t` of an allocation lives in block `ids[t // block_size]`, row `t % block_size`.

Invariants (checked by `check_invariants`, exercised by the hypothesis tests):
- every block is either free (on the free list, no owner) or owned by exactly one owner;
- `used_blocks + free_blocks == num_blocks`, and `used_blocks` is derived from the owner table;
- a `Reclaimer` (the prefix cache) may hold blocks it gives back when an allocation is short: they
  count in `available_blocks`, and `try_allocate`/`allocate_wait` take them before refusing or waiting;
- a block is never freed twice, nor freed by someone other than its owner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol, final

import trio

QUARANTINE_PREFIX = "quarantine:"


class BlockPoolError(Exception):
    """Base class of allocator errors."""


@final
class PoolExhausted(BlockPoolError):
    """Not enough free blocks right now (raised by the non-waiting `allocate`)."""


@final
class AllocationTimeout(BlockPoolError):
    """`allocate_wait` could not get its blocks before its deadline."""


@final
class OwnershipError(BlockPoolError):
    """A block was freed or handed over by someone who does not own it, or freed twice."""


class Reclaimer(Protocol):
    """Blocks held only to be reused (the prefix cache, `transport.memory.prefix_cache`), given back
    when an allocation is short: they count as available."""

    @property
    def reclaimable(self) -> int:
        """Blocks `reclaim` could free now."""
        ...

    def reclaim(self, n_blocks: int) -> int:
        """Free up to `n_blocks` blocks into the pool (with `BlockPool.free`); returns how many."""
        ...


@final
class _Waiter:
    __slots__ = ("event", "n_blocks")

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.event = trio.Event()


@final
class BlockPool:
    """`num_blocks` blocks of `block_size` tokens each.

    Waiters (`allocate_wait`) are served first come, first served: a waiter that does not fit holds
    back later ones, so a large grant is not starved by a stream of small ones.
    """

    def __init__(self, num_blocks: int, block_size: int, *, name: str = "pool") -> None:
        if num_blocks < 1:
            raise ValueError(f"pool {name!r}: num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"pool {name!r}: block_size must be >= 1, got {block_size}")
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: the lowest ids are handed out first on a fresh pool.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Owner -> its blocks; a block in no set is free. Sets, so that a whole allocation is checked,
        # taken and returned by set operations rather than a Python step per block.
        self._owned: dict[str, set[int]] = {}
        self._waiters: deque[_Waiter] = deque()
        self._reclaimer: Reclaimer | None = None

    def set_reclaimer(self, reclaimer: Reclaimer | None) -> None:
        """Let `reclaimer` give blocks back when an allocation is short (one at most)."""
        self._reclaimer = reclaimer

    def reclaimable_changed(self) -> None:
        """The reclaimer holds more reclaimable blocks: a waiter they satisfy may go on."""
        self._wake_head()

    # ------------------------------------------------------------------ queries
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def available_blocks(self) -> int:
        """Free blocks plus those the reclaimer would give back for an allocation."""
        return len(self._free) + (self._reclaimer.reclaimable if self._reclaimer is not None else 0)

    @property
    def allocatable_blocks(self) -> int:
        """The blocks a `try_allocate` can take now: the available ones, none while a waiter is queued
        (it goes first)."""
        return 0 if self._waiters else self.available_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks held by any owner, quarantined ones included."""
        return self.num_blocks - len(self._free)

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(ids) for owner, ids in self._owned.items() if owner.startswith(QUARANTINE_PREFIX))

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens."""
        if tokens < 0:
            raise ValueError(f"token count must be >= 0, got {tokens}")
        return -(-tokens // self.block_size)

    def owner_of(self, block_id: int) -> str | None:
        return next((owner for owner, ids in self._owned.items() if block_id in ids), None)

    def owned_by(self, owner: str) -> list[int]:
        return sorted(self._owned.get(owner, ()))

    def owners(self) -> dict[str, int]:
        """Owner → number of blocks it holds."""
        return {owner: len(ids) for owner, ids in self._owned.items()}

    def leaks(self) -> dict[str, int]:
        """Everything still allocated; empty when the pool is back to all-free."""
        return self.owners()

    # ------------------------------------------------------------------ allocation
    def try_allocate(self, n_blocks: int, owner: str) -> list[int] | None:
        """`n_blocks` blocks for `owner`, or None if not enough are free (or waiters are queued)."""
        self._check_count(n_blocks)
        if self._waiters or not self._make_room(n_blocks):
            return None
        return self._take(n_blocks, owner)

    def allocate(self, n_blocks: int, owner: str) -> list[int]:
        """`n_blocks` blocks for `owner`; raises `PoolExhausted` when they are not free now."""
        ids = self.try_allocate(n_blocks, owner)
        if ids is None:
            raise PoolExhausted(
                f"pool {self.name!r}: {n_blocks} blocks requested for {owner!r}, "
                f"{self.free_blocks} of {self.num_blocks} free"
            )
        return ids

    async def allocate_wait(self, n_blocks: int, owner: str, *, deadline: float) -> list[int]:
        """`n_blocks` blocks for `owner`, waiting for frees until the trio clock reaches `deadline`.

        Raises `AllocationTimeout` at the deadline (never before), and `PoolExhausted` at once when the
        request is larger than the whole pool. Cancellation: if cancelled while waiting, nothing is
        allocated and the waiter leaves the queue; blocks granted in the same tick as the cancellation
        are not lost because allocation happens only after the wait returns.
        """
        self._check_count(n_blocks)
        if n_blocks > self.num_blocks:
            raise PoolExhausted(
                f"pool {self.name!r}: {n_blocks} blocks requested for {owner!r}, "
                f"but the pool has only {self.num_blocks}"
            )
        ids = self.try_allocate(n_blocks, owner)
        if ids is not None:
            try:
                await trio.lowlevel.checkpoint()
            except BaseException:  # cancelled at the checkpoint: the caller never sees these blocks
                self.free(ids, owner)
                raise
            return ids
        waiter = _Waiter(n_blocks)
        self._waiters.append(waiter)
        try:
            with trio.move_on_at(deadline):
                while True:
                    await waiter.event.wait()
                    if self._waiters and self._waiters[0] is waiter and self._make_room(n_blocks):
                        self._waiters.popleft()
                        ids = self._take(n_blocks, owner)
                        self._wake_head()
                        return ids
                    waiter.event = trio.Event()
            raise AllocationTimeout(
                f"pool {self.name!r}: {n_blocks} blocks for {owner!r} not available before the deadline "
                f"({self.free_blocks} of {self.num_blocks} free)"
            )
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._wake_head()

    def free(self, ids: Iterable[int], owner: str) -> None:
        """Return `ids` (all owned by `owner`) to the pool. All-or-nothing: checks before changing."""
        ids = list(ids)
        if ids:
            held = self._check_owned(ids, owner, "free")
            held.difference_update(ids)
            self._free.extend(ids)
            if not held:
                del self._owned[owner]
        self._wake_head()

    def free_owner(self, owner: str) -> int:
        """Free every block `owner` holds; returns how many. Idempotent."""
        ids = list(self._owned.get(owner, ()))
        if ids:
            self.free(ids, owner)
        return len(ids)

    def hand_over(self, ids: Sequence[int], old_owner: str, new_owner: str) -> None:
        """Move ownership of `ids` without copying or freeing (e.g. migrated KV becomes decode cache)."""
        if not ids:
            return
        held = self._check_owned(ids, old_owner, "hand over")
        held.difference_update(ids)
        self._owned.setdefault(new_owner, set()).update(ids)
        if not held:
            del self._owned[old_owner]

    def quarantine(self, ids: Sequence[int], owner: str, fence: str) -> str:
        """Hold `ids` aside until `release_quarantine(fence)`: a write into them may still be in flight."""
        quarantine_owner = QUARANTINE_PREFIX + fence
        self.hand_over(ids, owner, quarantine_owner)
        return quarantine_owner

    def release_quarantine(self, fence: str) -> int:
        return self.free_owner(QUARANTINE_PREFIX + fence)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError(f"pool {self.name!r}: duplicate ids on the free list")
        if not free_set <= set(range(self.num_blocks)):
            raise AssertionError(f"pool {self.name!r}: an id on the free list is not a block")
        owned_total = 0
        seen: set[int] = set()
        for owner, ids in self._owned.items():
            if not ids:
                raise AssertionError(f"pool {self.name!r}: empty owner entry {owner!r}")
            for block_id in ids:
                if block_id in free_set or block_id in seen or not 0 <= block_id < self.num_blocks:
                    raise AssertionError(f"pool {self.name!r}: block {block_id} owner table disagrees")
            seen |= ids
            owned_total += len(ids)
        if owned_total + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"pool {self.name!r}: {owned_total} owned + {len(self._free)} free != {self.num_blocks}"
            )

    # ------------------------------------------------------------------ internals
    def _check_count(self, n_blocks: int) -> None:
        if n_blocks < 0:
            raise ValueError(f"pool {self.name!r}: block count must be >= 0, got {n_blocks}")

    def _check_owned(self, ids: Sequence[int], owner: str, action: str) -> set[int]:
        """`owner`'s set of blocks when `ids` are distinct blocks all held by `owner`; else raises
        `OwnershipError` naming the first offending id."""
        held = self._owned.get(owner)
        if held is not None and held.issuperset(ids) and len(set(ids)) == len(ids):
            return held
        seen: set[int] = set()
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise OwnershipError(f"pool {self.name!r}: cannot {action} block {block_id}: no such block")
            if block_id in seen:
                raise OwnershipError(f"pool {self.name!r}: block {block_id} listed twice in one {action}")
            seen.add(block_id)
            actual = self.owner_of(block_id)
            if actual != owner:
                state = "free" if actual is None else f"owned by {actual!r}"
                raise OwnershipError(
                    f"pool {self.name!r}: {owner!r} cannot {action} block {block_id}: it is {state}"
                )
        raise AssertionError(f"pool {self.name!r}: the blocks of {owner!r} disagree with the owner table")

    def _take(self, n_blocks: int, owner: str) -> list[int]:
        if n_blocks == 0:
            return []
        ids = self._free[-n_blocks:][::-1]  # as popping them one by one would give them
        del self._free[-n_blocks:]
        self._owned.setdefault(owner, set()).update(ids)
        return ids

    def _make_room(self, n_blocks: int) -> bool:
        """Whether `n_blocks` are free, once the reclaimer gave back what it can of the shortfall."""
        short = n_blocks - len(self._free)
        if short > 0 and self._reclaimer is not None and self._reclaimer.reclaimable >= short:
            self._reclaimer.reclaim(short)
        return n_blocks <= len(self._free)

    def _wake_head(self) -> None:
        if self._waiters and self._waiters[0].n_blocks <= self.available_blocks:
            self._waiters[0].event.set()

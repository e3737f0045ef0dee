"""The prefix cache: full KV blocks kept after their request, found again by a chained key (architecture §4.1).

Pure Python (no torch), over one `BlockPool`. A *key* names a full block's content: `block_keys` hashes
the parent block's key, the block's token ids and whatever else its KV depends on (`extras`: the
images whose embeddings it covers) under the model's identity, with every field length-prefixed — two
different contents never share a key by construction (short of a 256-bit hash collision).

Cached blocks are owned in the pool by `CACHE_OWNER`. A request *borrows* the longest cached prefix of
its keys (`acquire`: a reference per block; a borrowed block's ancestors are borrowed too, so an
unreferenced block's descendants are all unreferenced). Once its whole prompt is computed, `publish`
puts its new full blocks in the cache at once, still referenced by it (a key already cached keeps its
first block); when it ends, `release` drops its references and frees the rest — or `keep` (a decode
replica's finished turn) adds its full blocks, prompt and answer, unreferenced, then releases. Only
`publish` and `keep` add blocks: KV is cached only once every layer of it was written.

Eviction: only unreferenced blocks, least recently used first, leaves before parents — when an
allocation of the pool is short of blocks (the cache is the pool's `Reclaimer`), or to keep the cache
within `max_blocks`. Unreferenced cached blocks therefore count as available (`BlockPool.available_
blocks`): with the cache on, every allocation that would have fit without it still fits.

Reporting: every key cached or evicted bumps `version` and enters a bounded journal; `changes_since`
gives the net keys added and removed after a version (what a node tells the others, as deltas), or None
when the journal no longer reaches back — the reader then takes `recent_keys`, a bounded whole view.

Invariants (checked by `check_invariants`, exercised by the hypothesis state machine):
- every entry's block is owned by `CACHE_OWNER`, and the owner holds exactly the entries' blocks;
- an entry's parent is cached; `children` counts the cached entries naming it as parent;
- `refs` of an entry equals the number of live borrowings that include it; a referenced entry's parent
  is referenced;
- `evictable_blocks` is the number of unreferenced entries.
Single Trio thread; nothing here awaits.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import final

from transport.memory.blocks import BlockPool

CACHE_OWNER = "prefix-cache"
KEY_BYTES = 32
JOURNAL = 8192  # changes kept for `changes_since`


def block_keys(
    model: bytes, token_ids: Sequence[int], block_size: int, extras: Sequence[bytes] = ()
) -> list[bytes]:
    """The chained keys of the full blocks of `token_ids` (a trailing partial block has none).

    `model` names the model (weights and dtype): KV of another model never matches. `extras[i]` is
    what else block `i`'s KV depends on (missing or empty: nothing)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[bytes] = []
    parent = b""
    for index in range(len(token_ids) // block_size):
        digest = hashlib.blake2b(digest_size=KEY_BYTES)
        extra = extras[index] if index < len(extras) else b""
        for part in (model, parent, extra):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
        for token in token_ids[index * block_size : (index + 1) * block_size]:
            digest.update(int(token).to_bytes(8, "little", signed=True))
        parent = digest.digest()
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Entry:
    block: int
    parent: bytes | None
    refs: int = 0
    children: int = 0
    tick: int = 0


@final
@dataclass(slots=True)
class _Borrowing:
    """What one owner's request holds of the cache: its full blocks' keys, the first `borrowed` of
    which are borrowed cached blocks."""

    keys: list[bytes]
    borrowed: int
    blocks: list[int] = field(default_factory=list)


@final
class PrefixCache:
    """See the module docstring. `max_blocks`: the most blocks it keeps (None: as many as the pool
    spares). `enabled` False: it looks nothing up and keeps nothing (`release` just frees)."""

    def __init__(self, pool: BlockPool, *, max_blocks: int | None = None, enabled: bool = True) -> None:
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.pool = pool
        self.enabled = enabled and max_blocks != 0
        self.max_blocks = max_blocks
        self._entries: dict[bytes, _Entry] = {}
        self._borrowings: dict[str, _Borrowing] = {}
        self._unreferenced = 0
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, bytes]] = []  # heap of (tick, key); stale items skipped
        self.version = 0
        self._journal: deque[tuple[int, bool, bytes]] = deque(maxlen=JOURNAL)  # (version, added, key)
        # Counters (monotonic): prompt tokens looked up and found (kept by whoever looks up), blocks
        # evicted.
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        if self.enabled:
            pool.set_reclaimer(self)

    # ------------------------------------------------------------------ queries
    @property
    def cached_blocks(self) -> int:
        return len(self._entries)

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks no request references: what eviction can return to the pool."""
        return self._unreferenced

    @property
    def reclaimable(self) -> int:
        return self._unreferenced

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are cached (nothing changes)."""
        count = 0
        for key in keys:
            if key not in self._entries:
                break
            count += 1
        return count

    def peek(self, keys: Sequence[bytes], *, limit: int) -> tuple[list[int], list[int]]:
        """What `acquire(…, keys, limit=limit)` would borrow now, nothing changing: its blocks (empty when
        disabled), and those of them no request references (borrowing them takes them out of
        `reclaimable`)."""
        if not self.enabled:
            return [], []
        entries = [self._entries[key] for key in keys[: min(self.match(keys), max(0, limit))]]
        return [entry.block for entry in entries], [entry.block for entry in entries if entry.refs == 0]

    def holds(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def borrowings(self) -> dict[str, int]:
        """Owner → blocks it borrowed and has not released (the leak check reads it)."""
        return {owner: r.borrowed for owner, r in self._borrowings.items() if r.borrowed}

    # ------------------------------------------------------------------ a request's life
    def acquire(self, owner: str, keys: Sequence[bytes], *, limit: int) -> list[int]:
        """Borrow the longest cached prefix of `keys`, at most `limit` blocks, for `owner`; returns
        their block ids (in order). `owner`'s full blocks are remembered (`keys`), so that `release`
        can keep them. Disabled: borrows nothing and remembers nothing."""
        if not self.enabled:
            return []
        if owner in self._borrowings:
            raise ValueError(f"prefix cache: {owner!r} already holds a borrowing")
        count = min(self.match(keys), max(0, limit))
        tick = next(self._clock)
        blocks = []
        for key in keys[:count]:
            entry = self._entries[key]
            if entry.refs == 0:
                self._unreferenced -= 1
            entry.refs += 1
            entry.tick = tick
            blocks.append(entry.block)
        self._borrowings[owner] = _Borrowing(list(keys), count, blocks)
        return list(blocks)  # the caller's copy: `publish` extends the borrowing's own

    def publish(self, owner: str, table: Sequence[int]) -> int:
        """`owner`'s prompt has been computed into `table`: its full blocks after the borrowed ones join
        the cache at once, still referenced by `owner` (others may borrow them while it migrates). Stops
        at a key already cached (that copy stays; the rest joins at `release`) and at the size bound.
        Returns how many joined."""
        record = self._borrowings.get(owner)
        if record is None:
            return 0
        if list(table[: record.borrowed]) != record.blocks:
            raise ValueError(
                f"prefix cache: {owner!r} publishes a table that does not start with its borrowed blocks"
            )
        tick = next(self._clock)
        parent = record.keys[record.borrowed - 1] if record.borrowed else None
        wanted: list[bytes] = []
        for key in record.keys[record.borrowed : len(table)]:
            if key in self._entries:
                break
            wanted.append(key)
        if self.max_blocks is not None:  # within the bound: older unreferenced blocks make room
            over = len(self._entries) + len(wanted) - self.max_blocks
            if over > 0:
                self.evict(over)
            wanted = wanted[: max(0, self.max_blocks - len(self._entries))]
        joined: list[int] = []
        for key in wanted:
            block = table[record.borrowed + len(joined)]
            self._entries[key] = _Entry(block, parent, refs=1, tick=tick)
            self._note(True, key)
            if parent is not None:
                self._entries[parent].children += 1
            joined.append(block)
            parent = key
        if joined:
            self.pool.hand_over(joined, owner, CACHE_OWNER)
            record.borrowed += len(joined)
            record.blocks.extend(joined)
        return len(joined)

    def release(self, owner: str, table: Sequence[int]) -> None:
        """`owner`'s request ended: its blocks `table` go back — the cached ones it borrowed or
        published (first in `table`, as `acquire` and `publish` left them) lose its reference, the rest
        are freed (a prompt whose blocks were never published, say cancelled between two chunks, leaves
        nothing in the cache). An owner with no borrowing (or a disabled cache) has its table freed."""
        record = self._borrowings.pop(owner, None)
        if record is None:
            self.pool.free(table, owner)
            return
        if list(table[: record.borrowed]) != record.blocks:
            self._borrowings[owner] = record
            raise ValueError(
                f"prefix cache: {owner!r} releases a table that does not start with its borrowed blocks"
            )
        tick = next(self._clock)
        for key in record.keys[: record.borrowed]:
            entry = self._entries[key]
            entry.refs -= 1
            entry.tick = tick
            if entry.refs == 0:
                self._unreferenced += 1
        for key in record.keys[: record.borrowed]:  # the leaves among them become evictable
            self._push_if_leaf(key)
        self.pool.free(table[record.borrowed :], owner)
        if self.max_blocks is not None and len(self._entries) > self.max_blocks:
            self.evict(len(self._entries) - self.max_blocks)
        self.pool.reclaimable_changed()

    def keep(self, owner: str, keys: Sequence[bytes], table: Sequence[int]) -> int:
        """`owner`'s request ended and its first `len(keys)` blocks of `table` hold the KV `keys` name (a
        decode replica's finished turn: its prompt and its answer): those not cached yet join the cache,
        unreferenced (a key already cached keeps that copy and `owner`'s block is freed); then the rest
        goes back as in `release` (what `owner` borrowed or published keeps its place). Returns how many
        joined. Disabled, or keys that disagree with what `owner` borrowed: just `release`."""
        record = self._borrowings.get(owner)
        start = 0 if record is None else record.borrowed
        if (
            not self.enabled
            or len(keys) > len(table)
            or (record is not None and record.keys[:start] != list(keys[:start]))
            or (record is not None and list(table[:start]) != record.blocks)
        ):
            self.release(owner, table)
            return 0
        tick = next(self._clock)
        parent = keys[start - 1] if start else None
        joined: list[bytes] = []
        for key, block in zip(keys[start:], table[start : len(keys)], strict=True):
            if key not in self._entries:
                self._entries[key] = _Entry(block, parent, tick=tick)
                self._note(True, key)
                self._unreferenced += 1
                if parent is not None:
                    self._entries[parent].children += 1
                joined.append(key)
            parent = key
        blocks = {self._entries[key].block for key in joined}
        self.pool.hand_over(list(blocks), owner, CACHE_OWNER)
        for key in joined:
            self._push_if_leaf(key)
        self.release(owner, [block for block in table if block not in blocks])
        if self.max_blocks is not None and len(self._entries) > self.max_blocks:
            self.evict(len(self._entries) - self.max_blocks)
        self.pool.reclaimable_changed()  # (`release` without a borrowing does not say it)
        return len(joined)

    # ------------------------------------------------------------------ eviction
    def reclaim(self, n_blocks: int) -> int:
        """`Reclaimer`: evict up to `n_blocks` unreferenced blocks for an allocation that is short."""
        return self.evict(n_blocks)

    def evict(self, n_blocks: int) -> int:
        """Free up to `n_blocks` unreferenced cached blocks, least recently used leaves first; returns
        how many were freed."""
        freed: list[int] = []
        while len(freed) < n_blocks and self._leaves:
            tick, key = heapq.heappop(self._leaves)
            entry = self._entries.get(key)
            if entry is None or entry.refs or entry.children or entry.tick != tick:
                continue  # stale: evicted, referenced again, grown a child, or used since
            del self._entries[key]
            self._note(False, key)
            self._unreferenced -= 1
            freed.append(entry.block)
            if entry.parent is not None:
                self._entries[entry.parent].children -= 1
                self._push_if_leaf(entry.parent)
        if freed:
            self.pool.free(freed, CACHE_OWNER)
            self.evicted_blocks += len(freed)
        return len(freed)

    def clear(self) -> int:
        """Forget every entry and every borrowing, and free the cache's blocks: only when every owner's
        blocks are freed too (a replica's pools emptied after a crash). Returns the blocks freed."""
        self._entries.clear()
        self._borrowings.clear()
        self._leaves.clear()
        self._unreferenced = 0
        self.version += 1
        self._journal.clear()  # no reader can follow this by deltas: they take the whole view
        return self.pool.free_owner(CACHE_OWNER)

    # ------------------------------------------------------------------ reporting
    def changes_since(self, version: int, *, limit: int) -> tuple[list[bytes], list[bytes]] | None:
        """The keys cached and evicted after `version` (net of each other), or None when the journal
        does not reach back that far or they are more than `limit` in all."""
        if version == self.version:
            return [], []
        if version > self.version or not self._journal or self._journal[0][0] > version + 1:
            return None
        added: dict[bytes, None] = {}
        removed: dict[bytes, None] = {}
        for changed, was_added, key in reversed(self._journal):
            if changed <= version:
                break
            if key not in added and key not in removed:  # the newest change of each key wins
                (added if was_added else removed)[key] = None
        if len(added) + len(removed) > limit:
            return None
        return list(reversed(added)), list(reversed(removed))

    def recent_keys(self, limit: int) -> list[bytes]:
        """At most `limit` cached keys, the most recently used first."""
        ranked = sorted(self._entries.items(), key=lambda item: -item[1].tick)[:limit]
        return [key for key, _ in ranked]

    def _note(self, added: bool, key: bytes) -> None:
        self.version += 1
        self._journal.append((self.version, added, key))

    def _push_if_leaf(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.refs == 0 and entry.children == 0:
            heapq.heappush(self._leaves, (entry.tick, key))

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        owned = set(self.pool.owned_by(CACHE_OWNER))
        blocks = [e.block for e in self._entries.values()]
        if len(set(blocks)) != len(blocks) or set(blocks) != owned:
            raise AssertionError("prefix cache: entries and the pool's cache owner disagree")
        children: dict[bytes, int] = {}
        refs: dict[bytes, int] = {}
        for record in self._borrowings.values():
            for key in record.keys[: record.borrowed]:
                refs[key] = refs.get(key, 0) + 1
        for entry in self._entries.values():
            if entry.parent is not None:
                if entry.parent not in self._entries:
                    raise AssertionError("prefix cache: an entry's parent is not cached")
                children[entry.parent] = children.get(entry.parent, 0) + 1
                if entry.refs and not self._entries[entry.parent].refs:
                    raise AssertionError("prefix cache: a referenced entry's parent is not referenced")
        for key, entry in self._entries.items():
            if entry.children != children.get(key, 0):
                raise AssertionError("prefix cache: children count disagrees")
            if entry.refs != refs.get(key, 0):
                raise AssertionError("prefix cache: reference count disagrees with the borrowings")
        if self._unreferenced != sum(1 for e in self._entries.values() if not e.refs):
            raise AssertionError("prefix cache: evictable count disagrees")
        if self.max_blocks is not None and len(self._entries) > self.max_blocks:
            raise AssertionError("prefix cache: over its size bound")

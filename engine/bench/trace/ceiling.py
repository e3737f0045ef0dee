"""What a prefix cache of a given size can reach on a trace: a plain model of the cache, replayed offline.

`model_hit_rate(requests, block_tokens, capacity, rule)` replays the requests one at a time, in arrival
order, through a model of `transport/memory/prefix_cache.py`: a request's full blocks are chained keys
(a block is the same only after the same blocks), it borrows the longest cached prefix of them — at most
all but its last token's block, which must run — and then its other full blocks join the cache, stopping
at one already cached; to stay within `capacity` blocks the cache evicts leaves (a block no cached block
continues) that the request does not use; a block that finds no room is not kept. The hit rate is the
blocks borrowed over all the requests' blocks (the bench's own measure).

The rules: `lru` — the leaf least recently used goes first (what the cache does); `belady` — Belady's
offline rule: the leaf needed again furthest in the future goes first, and a block never needed again is
not kept. No online rule (one that does not know the future) does better than Belady's on a cache of single
blocks; here it is the reference the trace's own bound (an unbounded cache) overstates at small sizes.
The model runs requests one at a time; the node overlaps them (a prompt arriving while another runs).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, final

NEVER: Final = 1 << 62
Rule = Literal["lru", "belady"]


class TraceRequest(Protocol):
    @property
    def prompt(self) -> list[int]: ...
    @property
    def hash_ids(self) -> list[int]: ...


@final
@dataclass(slots=True)
class _Block:
    parent: int | None
    children: int = 0
    stamp: int = 0  # lru: the last use; belady: minus the next use


@final
@dataclass(slots=True)
class _Model:
    capacity: int
    rule: Rule
    uses: dict[int, list[int]]  # key -> the requests that hold it (belady)
    blocks: dict[int, _Block] = field(default_factory=dict)
    leaves: list[tuple[int, int]] = field(default_factory=list)  # heap of (stamp, key); stale skipped

    def stamp(self, key: int, now: int) -> int:
        if self.rule == "lru":
            return now
        uses = self.uses[key]
        later = bisect.bisect_right(uses, now)
        return -(uses[later] if later < len(uses) else NEVER)

    def touch(self, key: int, now: int) -> None:
        block = self.blocks[key]
        block.stamp = self.stamp(key, now)
        if not block.children:
            heapq.heappush(self.leaves, (block.stamp, key))

    def evict(self, count: int, keep: set[int]) -> None:
        held: list[tuple[int, int]] = []
        while count > 0 and self.leaves:
            stamp, key = heapq.heappop(self.leaves)
            block = self.blocks.get(key)
            if block is None or block.children or block.stamp != stamp:
                continue
            if key in keep:
                held.append((stamp, key))
                continue
            del self.blocks[key]
            count -= 1
            if block.parent is not None:
                parent = self.blocks[block.parent]
                parent.children -= 1
                if not parent.children:
                    heapq.heappush(self.leaves, (parent.stamp, block.parent))
        for item in held:
            heapq.heappush(self.leaves, item)

    def serve(self, now: int, keys: Sequence[int], limit: int) -> int:
        hit = 0
        for key in keys:
            if key not in self.blocks:
                break
            hit += 1
        hit = min(hit, limit)
        for key in keys[:hit]:
            self.touch(key, now)
        wanted: list[int] = []
        for key in keys[hit:]:
            if key in self.blocks or (self.rule == "belady" and self.stamp(key, now) == -NEVER):
                break
            wanted.append(key)
        over = len(self.blocks) + len(wanted) - self.capacity
        if over > 0:
            self.evict(over, set(keys[:hit]))
        wanted = wanted[: max(0, self.capacity - len(self.blocks))]
        parent = keys[hit - 1] if hit else None
        for key in wanted:
            self.blocks[key] = _Block(parent)
            if parent is not None:
                self.blocks[parent].children += 1
            parent = key
        for key in wanted:
            self.touch(key, now)
        return hit


def chained_keys(requests: Sequence[TraceRequest], block_tokens: int) -> list[list[int]]:
    """Each request's full blocks as chained keys: one number per distinct (parent key, hash id)."""
    names: dict[tuple[int, int], int] = {}
    out = []
    for request in requests:
        keys: list[int] = []
        parent = -1
        for hash_id in request.hash_ids[: len(request.prompt) // block_tokens]:
            parent = names.setdefault((parent, hash_id), len(names))
            keys.append(parent)
        out.append(keys)
    return out


def model_hit_rate(requests: Sequence[TraceRequest], block_tokens: int, capacity: int, rule: Rule) -> float:
    """See the module docstring."""
    chains = chained_keys(requests, block_tokens)
    uses: dict[int, list[int]] = {}
    for now, keys in enumerate(chains):
        for key in keys:
            uses.setdefault(key, []).append(now)
    model = _Model(capacity, rule, uses)
    hits = sum(
        model.serve(now, keys, (len(request.prompt) - 1) // block_tokens)
        for now, (request, keys) in enumerate(zip(requests, chains, strict=True))
    )
    total = sum(len(request.hash_ids) for request in requests)
    return hits / total if total else 0.0

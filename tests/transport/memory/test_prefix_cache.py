"""PrefixCache: chained block keys, borrowing by reference, LRU leaf-first eviction (architecture §4.1)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from transport.memory.blocks import BlockPool
from transport.memory.prefix_cache import CACHE_OWNER, PrefixCache, block_keys

MODEL = b"test-model"


def computed(cache: PrefixCache, owner: str, table: list[int]) -> None:
    """`owner`'s prompt ran into `table` (its blocks join the cache) and the request ended."""
    cache.publish(owner, table)
    cache.release(owner, table)


def test_keys_chain_and_separate_contents() -> None:
    keys = block_keys(MODEL, [1, 2, 3, 4, 5], 2)
    assert len(keys) == 2  # the partial block has no key
    assert block_keys(MODEL, [1, 2, 3, 4], 2) == keys
    assert block_keys(MODEL, [9, 2, 3, 4], 2)[1] != keys[1]  # a different parent: a different key
    assert block_keys(b"other", [1, 2, 3, 4], 2) != keys
    assert block_keys(MODEL, [1, 2, 3, 4], 2, [b"", b"image"])[0] == keys[0]
    assert block_keys(MODEL, [1, 2, 3, 4], 2, [b"", b"image"])[1] != keys[1]
    # Length-prefixed fields: no two splits of the same bytes into model and extra collide.
    assert block_keys(b"ab", [1, 2], 2, [b"c"]) != block_keys(b"a", [1, 2], 2, [b"bc"])


def test_a_second_request_borrows_the_prefix_and_a_computed_prompt_joins_the_cache() -> None:
    pool = BlockPool(8, 2)
    cache = PrefixCache(pool)
    first = block_keys(MODEL, [1, 2, 3, 4, 5], 2)
    assert cache.acquire("a", first, limit=2) == []
    table = pool.allocate(3, "a")
    computed(cache, "a", table)
    assert cache.cached_blocks == 2 and pool.owners() == {CACHE_OWNER: 2}
    second = block_keys(MODEL, [1, 2, 3, 4, 9, 9], 2)
    borrowed = cache.acquire("b", second, limit=2)
    assert borrowed == table[:2]
    assert cache.evictable_blocks == 0
    rest = pool.allocate(1, "b")
    computed(cache, "b", borrowed + rest)
    assert cache.cached_blocks == 3  # its third block, computed, is kept too
    cache.check_invariants()
    pool.check_invariants()


def test_eviction_is_lru_leaf_first_and_only_when_short() -> None:
    pool = BlockPool(4, 1)
    cache = PrefixCache(pool)
    for owner, tokens in (("a", [1, 2]), ("b", [7])):
        cache.acquire(owner, block_keys(MODEL, tokens, 1), limit=0)
        computed(cache, owner, pool.allocate(len(tokens), owner))
    assert pool.free_blocks == 1 and pool.available_blocks == 4
    got = pool.try_allocate(2, "c")  # short by one: the oldest leaf goes — block [1, 2]'s second
    assert got is not None
    keys = block_keys(MODEL, [1, 2], 1)
    assert cache.holds(keys[0]) and not cache.holds(keys[1])
    assert cache.evicted_blocks == 1
    cache.check_invariants()


def test_size_bound() -> None:
    pool = BlockPool(16, 1)
    cache = PrefixCache(pool, max_blocks=3)
    cache.acquire("a", block_keys(MODEL, [1, 2, 3, 4, 5], 1), limit=0)
    computed(cache, "a", pool.allocate(5, "a"))
    assert cache.cached_blocks == 3 and pool.used_blocks == 3
    cache.check_invariants()


def test_disabled_cache_keeps_nothing() -> None:
    pool = BlockPool(4, 1)
    cache = PrefixCache(pool, enabled=False)
    assert cache.acquire("a", block_keys(MODEL, [1, 2], 1), limit=1) == []
    computed(cache, "a", pool.allocate(2, "a"))
    assert pool.used_blocks == 0 and cache.cached_blocks == 0


async def test_a_waiting_reservation_takes_blocks_freed_to_the_cache() -> None:
    pool = BlockPool(2, 1)
    cache = PrefixCache(pool)
    cache.acquire("a", block_keys(MODEL, [1, 2], 1), limit=0)
    table = pool.allocate(2, "a")
    got: list[int] = []

    async def wait_for_two() -> None:
        got.extend(await pool.allocate_wait(2, "b", deadline=trio.current_time() + 10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_two)
        await trio.testing.wait_all_tasks_blocked()
        computed(cache, "a", table)  # into the cache, not the free list: the waiter must still get them
    assert sorted(got) == sorted(table)
    assert cache.cached_blocks == 0
    cache.check_invariants()


def test_release_of_a_foreign_table_is_refused() -> None:
    pool = BlockPool(4, 1)
    cache = PrefixCache(pool)
    cache.acquire("a", block_keys(MODEL, [1], 1), limit=0)
    computed(cache, "a", pool.allocate(1, "a"))
    cache.acquire("b", block_keys(MODEL, [1, 2], 1), limit=1)
    with pytest.raises(ValueError, match="does not start with its borrowed blocks"):
        cache.release("b", pool.allocate(2, "b"))


# ---------------------------------------------------------------------- against a model
BLOCK = 2
NUM_BLOCKS = 12


class CacheMachine(RuleBasedStateMachine):
    """The cache against a plain model: a dict of key → [parent, refs, tick], eviction by the smallest
    (tick, key) among unreferenced leaves. Every request that fits without a cache fits with it."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.max_blocks: int | None = None
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.cache = PrefixCache(self.pool, max_blocks=self.max_blocks)
        self.model: dict[bytes, list] = {}  # key -> [parent, refs, tick]
        self.tick = 0
        self.live: dict[str, tuple[list[bytes], int, list[int]]] = {}
        self.numbers = 0
        self.cache_off_used = 0
        self.arrived: set[str] = set()

    def _model_evict(self, n: int) -> None:
        for _ in range(n):
            children = {entry[0] for entry in self.model.values() if entry[0] is not None}
            leaves = [(e[2], k) for k, e in self.model.items() if e[1] == 0 and k not in children]
            if not leaves:
                return
            del self.model[min(leaves)[1]]

    @rule(target=requests, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def start(self, tokens: list[int]) -> str:
        self.numbers += 1
        owner = f"r{self.numbers}"
        keys = block_keys(MODEL, tokens, BLOCK)
        need = self.pool.blocks_for(len(tokens))
        limit = (len(tokens) - 1) // BLOCK
        borrowed = self.cache.acquire(owner, keys, limit=limit)
        self.tick += 1
        count = 0
        for key in keys[:limit]:
            if key not in self.model:
                break
            self.model[key][1] += 1
            self.model[key][2] = self.tick
            count += 1
        assert len(borrowed) == count
        short = need - count - self.pool.free_blocks
        evictable = sum(1 for e in self.model.values() if e[1] == 0)
        rest = self.pool.try_allocate(need - count, owner)
        if short > 0 and evictable >= short:
            self._model_evict(short)
        fits_without_cache = self.cache_off_used + need <= NUM_BLOCKS
        if fits_without_cache:
            assert rest is not None, "a request that fits without the cache was refused"
        if rest is None:
            self.cache.release(owner, borrowed)
            self._model_release(keys[:count], keys, count, len(borrowed))
            return owner
        self.live[owner] = (keys, count, borrowed + rest)
        self.cache_off_used += need
        return owner

    def _model_release(
        self, borrowed_keys: list[bytes], keys: list[bytes], count: int, table_len: int
    ) -> None:
        self.tick += 1
        for key in borrowed_keys:
            self.model[key][1] -= 1
            self.model[key][2] = self.tick

    @rule(target=requests, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def arrive(self, tokens: list[int]) -> str:
        """A request whose KV arrived from elsewhere (a decode replica's migration): no borrowing."""
        self.numbers += 1
        owner = f"r{self.numbers}"
        need = self.pool.blocks_for(len(tokens))
        short = need - self.pool.free_blocks
        evictable = sum(1 for e in self.model.values() if e[1] == 0)
        table = self.pool.try_allocate(need, owner)
        if short > 0 and evictable >= short:
            self._model_evict(short)
        if self.cache_off_used + need <= NUM_BLOCKS:
            assert table is not None, "a request that fits without the cache was refused"
        if table is not None:
            self.live[owner] = (block_keys(MODEL, tokens, BLOCK), 0, table)
            self.arrived.add(owner)
            self.cache_off_used += need
        return owner

    @rule(owner=requests)
    def publish(self, owner: str) -> None:
        """Its prompt ran: its full blocks join the cache, still referenced by it."""
        if owner not in self.live or owner in self.arrived:
            return
        keys, count, table = self.live[owner]
        joined = self.cache.publish(owner, table)
        self.tick += 1
        parent = keys[count - 1] if count else None
        wanted = []
        for key in keys[count : len(table)]:
            if key in self.model:
                break
            wanted.append(key)
        if self.max_blocks is not None:
            over = len(self.model) + len(wanted) - self.max_blocks
            if over > 0:
                self._model_evict(over)
            wanted = wanted[: max(0, self.max_blocks - len(self.model))]
        expected = 0
        for key in wanted:
            self.model[key] = [parent, 1, self.tick]
            parent = key
            expected += 1
        assert joined == expected
        self.live[owner] = (keys, count + joined, table)

    @rule(owner=consumes(requests))
    def finish(self, owner: str) -> None:
        if owner not in self.live:
            return
        keys, count, table = self.live.pop(owner)
        self.cache_off_used -= len(table)
        self.cache.release(owner, table)
        self._model_release(keys[:count], keys, count, len(table))

    @rule(owner=consumes(requests))
    def keep(self, owner: str) -> None:
        """It ended and its full blocks are worth keeping (a decode replica's finished turn): those not
        cached join the cache unreferenced, then it releases."""
        if owner not in self.live:
            return
        keys, count, table = self.live.pop(owner)
        self.cache_off_used -= len(table)
        joined = self.cache.keep(owner, keys, table)
        self.tick += 1
        parent = keys[count - 1] if count else None
        expected = 0
        for key in keys[count:]:
            if key not in self.model:
                self.model[key] = [parent, 0, self.tick]
                expected += 1
            parent = key
        assert joined == expected
        self._model_release(keys[:count], keys, count, len(table))

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        before = self.cache.cached_blocks
        freed = self.cache.evict(n)
        self._model_evict(n)
        assert self.cache.cached_blocks == before - freed

    @invariant()
    def agrees(self) -> None:
        self.cache.check_invariants()
        self.pool.check_invariants()
        assert set(self.cache.keys()) == set(self.model)
        assert self.cache.evictable_blocks == sum(1 for e in self.model.values() if e[1] == 0)
        assert self.pool.used_blocks == self.cache.cached_blocks + sum(
            len(t) - c for _, c, t in self.live.values()
        )

    def teardown(self) -> None:
        for owner, (_, _, table) in list(self.live.items()):
            self.cache.release(owner, table)
        self.cache.evict(NUM_BLOCKS)
        assert self.pool.leaks() == {}


class BoundedCacheMachine(CacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.max_blocks = 3
        self.cache = PrefixCache(self.pool, max_blocks=3)

    def _model_release(
        self, borrowed_keys: list[bytes], keys: list[bytes], count: int, table_len: int
    ) -> None:
        super()._model_release(borrowed_keys, keys, count, table_len)
        if len(self.model) > 3:
            self._model_evict(len(self.model) - 3)


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
BoundedCacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_cache_against_model = CacheMachine.TestCase
test_bounded_cache_against_model = BoundedCacheMachine.TestCase


def test_changes_since_a_version_are_net_and_bounded() -> None:
    pool = BlockPool(8, 1)
    cache = PrefixCache(pool)
    assert cache.changes_since(0, limit=10) == ([], [])
    cache.acquire("a", block_keys(MODEL, [1, 2], 1), limit=0)
    computed(cache, "a", pool.allocate(2, "a"))
    first = cache.version
    keys = block_keys(MODEL, [1, 2], 1)
    assert cache.changes_since(0, limit=10) == (keys, [])
    assert cache.changes_since(0, limit=1) is None  # more than the limit: the reader takes a whole view
    cache.evict(1)  # the leaf goes
    assert cache.changes_since(first, limit=10) == ([], [keys[1]])
    assert cache.changes_since(0, limit=10) == ([keys[0]], [keys[1]])
    assert cache.recent_keys(10) == [keys[0]]
    cache.clear()
    assert cache.changes_since(first, limit=10) is None  # the journal no longer reaches back

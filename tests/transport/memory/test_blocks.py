"""BlockPool: the pure-Python allocator of architecture §4."""

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.memory.blocks import AllocationTimeout, BlockPool, OwnershipError, PoolExhausted


def test_fresh_pool_counts() -> None:
    pool = BlockPool(10, 16, name="kv")
    assert (pool.used_blocks, pool.free_blocks) == (0, 10)
    assert pool.blocks_for(0) == 0
    assert pool.blocks_for(16) == 1
    assert pool.blocks_for(17) == 2


def test_fragmented_allocation_is_not_contiguous() -> None:
    pool = BlockPool(8, 4)
    a = pool.allocate(3, "a")
    b = pool.allocate(3, "b")
    pool.free([a[0], a[2]], "a")
    c = pool.allocate(4, "c")
    assert sorted(c) != list(range(min(c), min(c) + 4))
    assert set(c).isdisjoint(b)
    assert pool.used_blocks == 8
    pool.check_invariants()


def test_wrong_owner_and_double_free_are_refused() -> None:
    pool = BlockPool(4, 4, name="emb")
    ids = pool.allocate(2, "a")
    with pytest.raises(
        OwnershipError, match=rf"pool 'emb': 'b' cannot free block {ids[0]}: it is owned by 'a'"
    ):
        pool.free(ids, "b")
    pool.free(ids, "a")
    with pytest.raises(OwnershipError, match=rf"cannot free block {ids[0]}: it is free"):
        pool.free(ids[:1], "a")
    assert pool.leaks() == {}


def test_exhausted_message_names_counts() -> None:
    pool = BlockPool(4, 4, name="kv")
    pool.allocate(3, "a")
    with pytest.raises(PoolExhausted, match=r"pool 'kv': 2 blocks requested for 'b', 1 of 4 free"):
        pool.allocate(2, "b")


def test_hand_over_and_quarantine() -> None:
    pool = BlockPool(6, 2)
    ids = pool.allocate(3, "transfer:1")
    pool.hand_over(ids, "transfer:1", "request:1")
    assert pool.owners() == {"request:1": 3}
    pool.quarantine(ids[:2], "request:1", "t1")
    assert pool.quarantined_blocks == 2
    assert pool.release_quarantine("t1") == 2
    pool.free_owner("request:1")
    assert pool.used_blocks == 0
    pool.check_invariants()


async def test_allocate_wait_fails_at_the_deadline_not_before(autojump_clock: trio.testing.MockClock) -> None:
    pool = BlockPool(4, 4)
    pool.allocate(4, "hog")
    start = trio.current_time()
    with pytest.raises(AllocationTimeout, match=r"2 blocks for 'w' not available before the deadline"):
        await pool.allocate_wait(2, "w", deadline=start + 5.0)
    assert trio.current_time() == pytest.approx(start + 5.0)
    assert pool.owners() == {"hog": 4}


async def test_allocate_wait_cancelled_at_once_allocates_nothing() -> None:
    """The blocks are free, but the caller is cancelled at the call's checkpoint: none stay allocated."""
    pool = BlockPool(4, 4)
    with trio.CancelScope() as scope:
        scope.cancel()
        await pool.allocate_wait(2, "w", deadline=trio.current_time() + 10)
    assert scope.cancelled_caught
    assert pool.owners() == {} and pool.free_blocks == 4


async def test_allocate_wait_succeeds_when_blocks_are_freed(autojump_clock: trio.testing.MockClock) -> None:
    pool = BlockPool(4, 4)
    hog = pool.allocate(4, "hog")
    got: list[int] = []

    async def waiter() -> None:
        got.extend(await pool.allocate_wait(3, "w", deadline=trio.current_time() + 10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(4)
        assert got == []
        pool.free(hog, "hog")
    assert len(got) == 3
    assert trio.current_time() == pytest.approx(4)


async def test_waiters_are_first_come_first_served(autojump_clock: trio.testing.MockClock) -> None:
    pool = BlockPool(4, 1)
    hog = pool.allocate(4, "hog")
    order: list[str] = []

    async def waiter(name: str, n: int, delay: float) -> None:
        await trio.sleep(delay)
        await pool.allocate_wait(n, name, deadline=trio.current_time() + 100)
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "big", 3, 0)
        nursery.start_soon(waiter, "small", 1, 1)
        await trio.sleep(2)
        pool.free(hog[:1], "hog")  # 1 free: fits "small" but "big" is first
        await trio.sleep(1)
        assert order == []
        pool.free(hog[1:], "hog")
    assert order == ["big", "small"]


async def test_cancelled_waiter_leaves_no_trace(autojump_clock: trio.testing.MockClock) -> None:
    pool = BlockPool(2, 1)
    hog = pool.allocate(2, "hog")
    with trio.move_on_after(1):
        await pool.allocate_wait(2, "w", deadline=trio.current_time() + 100)
    pool.free(hog, "hog")
    assert pool.try_allocate(2, "x") is not None


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 8), st.integers(0, 3)), max_size=80),
)
def test_random_alloc_free_keeps_invariants(num_blocks: int, ops: list[tuple[bool, int, int]]) -> None:
    pool = BlockPool(num_blocks, 8)
    held: dict[str, list[int]] = {}
    for is_alloc, n, owner_no in ops:
        owner = f"o{owner_no}"
        if is_alloc:
            ids = pool.try_allocate(n, owner)
            if ids is None:
                assert n > pool.free_blocks
            else:
                assert len(set(ids)) == n
                held.setdefault(owner, []).extend(ids)
        elif held.get(owner):
            part = held[owner][: max(1, n)]
            pool.free(part, owner)
            held[owner] = held[owner][len(part) :]
        pool.check_invariants()
        assert pool.used_blocks == sum(len(v) for v in held.values())
    for owner, ids in held.items():
        pool.free(ids, owner)
    assert pool.leaks() == {}
    assert pool.free_blocks == num_blocks

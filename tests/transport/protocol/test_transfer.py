"""The resumable transfer, end to end through real endpoints, blocks and bytes (inproc unless named)."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.layout import PoolLayout
from messages.transfer import Grant, RequestMoreCache
from tests.transport.harness import (
    Collector,
    Source,
    as_bytes,
    assert_same_bytes,
    embedding_layout,
    endpoint_pair,
    kv_layout,
    poisoned_storage,
    random_storage,
    send_all,
    shuffled_pool,
)
from tests.waiting import wait_until
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, open_endpoint
from transport.links.inproc.link import InprocNetwork
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage

# The seeds' scenarios: block size 128, default grant 8 blocks (1024 tokens).
SEED_SCENARIOS = [
    pytest.param(500, None, 1, id="500-one-round"),
    pytest.param(2000, None, 2, id="2000-two-rounds"),
    pytest.param(10_000, None, 2, id="10000-two-rounds"),
    pytest.param(10_000, 8, 10, id="10000-cap8-ten-rounds"),
]


@pytest.mark.parametrize("kind", ["inproc", "inproc-threads"])
@pytest.mark.parametrize(("total", "cap", "rounds"), SEED_SCENARIOS)
async def test_seed_scenarios_inproc(kind: str, total: int, cap: int | None, rounds: int) -> None:
    layout = embedding_layout()
    source = Source(layout, total, seed=total)
    storage, pool = random_storage(layout, 100, seed=1), shuffled_pool(100, 128, seed=2)
    config = TransferConfig(default_grant_blocks=8, round_cap_blocks=cap)
    collector = Collector()
    async with (
        endpoint_pair(kind, source, storage, pool, config=config) as pair,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(send_all, pair.sender, "t", source)
        result = await pair.receiver.receive("t", peer=pair.link, consume=collector)
    assert (result.report.rounds, result.report.grants) == (
        rounds,
        rounds,
    )  # grants == 1: no REQUEST_MORE_CACHE
    assert next(r.tokens for r in collector.rounds) == min(total, 1024)
    assert_same_bytes(collector.data(), source.expected())
    assert result.report.bytes == total * layout.bytes_per_token
    assert pool.used_blocks == 0


def untouched_rows_are_poisoned(storage: PoolStorage, written: set[int]) -> bool:
    for tensor in storage.tensors.values():
        rows = tensor.view(storage.num_blocks * storage.block_size, -1).view(torch.uint8)
        keep = torch.ones(rows.shape[0], dtype=torch.bool)
        keep[list(written)] = False
        if not bool((rows[keep] == 0x5A).all()):
            return False
    return True


def rows_of(blocks: list[int] | tuple[int, ...], offset: int, tokens: int, block_size: int) -> set[int]:
    return {
        blocks[(offset + t) // block_size] * block_size + (offset + t) % block_size for t in range(tokens)
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 16),
    total=st.integers(0, 300),
    window=st.integers(1, 4),
    default_grant=st.integers(1, 6),
    cap=st.none() | st.integers(1, 5),
    mode=st.sampled_from(["keep", "consume", "borrowed"]),
    fragmentation=st.lists(st.tuples(st.integers(1, 4), st.booleans()), max_size=12),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["inproc", "inproc-threads"]),
)
def test_random_transfers_land_identical_data_and_nothing_else(
    kind: str,
    block_size: int,
    total: int,
    window: int,
    default_grant: int,
    cap: int | None,
    mode: str,
    fragmentation: list[tuple[int, bool]],
    seed: int,
) -> None:
    check_random_transfer(
        kind,
        embedding_layout(block_size=block_size, hidden=3),
        total=total,
        window=window,
        default_grant=default_grant,
        cap=cap,
        mode=mode,
        fragmentation=fragmentation,
        seed=seed,
    )


def check_random_transfer(
    transport: str,
    layout: PoolLayout,
    *,
    total: int,
    window: int,
    default_grant: int,
    cap: int | None,
    mode: str,
    fragmentation: list[tuple[int, bool]],
    seed: int,
) -> None:
    """One random transfer over `transport` into a fragmented, poisoned pool: the data lands identical,
    no row outside the allocation is touched, and every block returns. `mode`: keep, consume, borrowed."""
    block_size = layout.block_size
    source = Source(layout, total, seed=seed)
    need = -(-total // block_size)
    num_blocks = need + 2 + sum(n for n, _keep in fragmentation)
    storage, pool = poisoned_storage(layout, num_blocks), BlockPool(num_blocks, block_size)
    rng = random.Random(seed)
    held: list[int] = []
    for n, keep in fragmentation:  # allocate and free in random order: a fragmented free list
        ids = pool.allocate(n, "other")
        rng.shuffle(ids)
        (held.extend if keep else lambda got: pool.free(got, "other"))(ids)
    config = TransferConfig(default_grant_blocks=default_grant, round_cap_blocks=cap, window=window)
    landing_offset = rng.randrange(block_size)
    borrowed = (
        pool.allocate(-(-(landing_offset + total) // block_size), "request") if mode == "borrowed" else None
    )
    collector = Collector()

    async def scenario() -> set[int]:
        async with (
            endpoint_pair(transport, source, storage, pool, config=config) as pair,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(send_all, pair.sender, "t", source)
            result = await pair.receiver.receive(
                "t",
                peer=pair.link,
                consume=collector if mode == "consume" else None,
                blocks=borrowed,
                landing_offset=landing_offset if borrowed else 0,
                expected_tokens=total if borrowed else None,
                owner="request",
            )
        if mode == "consume":
            assert_same_bytes(collector.data() if total else {}, source.expected() if total else {})
            return set().union(
                *(rows_of(r.blocks, r.landing_offset, r.tokens, block_size) for r in collector.rounds)
            )
        offset = landing_offset if borrowed else 0
        assert_same_bytes(as_bytes(storage.gather(result.blocks, offset, total)), source.expected())
        written = rows_of(result.blocks, offset, total, block_size)
        pool.free(result.blocks, "request")
        return written

    written = trio.run(scenario)
    assert untouched_rows_are_poisoned(storage, written)
    pool.free(held, "other")
    assert pool.used_blocks == 0
    pool.check_invariants()


async def test_a_transfer_larger_than_the_whole_pool_completes_when_each_round_is_consumed() -> None:
    layout = embedding_layout(block_size=16)
    source = Source(layout, 16 * 40 + 5, seed=3)
    storage, pool = random_storage(layout, 6, seed=4), shuffled_pool(6, 16, seed=5)
    collector = Collector()
    async with (
        endpoint_pair("inproc", source, storage, pool, config=TransferConfig(window=2)) as pair,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(send_all, pair.sender, "big", source)
        result = await pair.receiver.receive("big", peer=pair.link, consume=collector)
    assert result.report.rounds > 6
    assert_same_bytes(collector.data(), source.expected())
    assert pool.used_blocks == 0


async def test_sender_and_receiver_storage_never_alias() -> None:
    layout = embedding_layout()
    source = Source(layout, 300, seed=6)
    storage, pool = random_storage(layout, 8, seed=7), shuffled_pool(8, 128, seed=8)
    for start, end in source.storage.memory_ranges():
        for other_start, other_end in storage.memory_ranges():
            assert end <= other_start or other_end <= start
    async with endpoint_pair("inproc", source, storage, pool) as pair, trio.open_nursery() as nursery:
        nursery.start_soon(send_all, pair.sender, "t", source)
        result = await pair.receiver.receive("t", peer=pair.link, owner="r")
    before = as_bytes(storage.gather(result.blocks, 0, 300))
    for tensor in source.storage.tensors.values():
        tensor.view(torch.uint8).fill_(0)
    assert_same_bytes(as_bytes(storage.gather(result.blocks, 0, 300)), before)


async def test_kv_layer_ranges_from_two_senders_land_in_one_allocation() -> None:
    """ZigZag's shape: layers [0, 1) from one prefill replica, [1, 2) from another, one decode allocation."""
    layout = kv_layout(layers=2)
    first, second = Source(layout, 70, seed=9), Source(layout, 70, seed=10)
    storage, pool = poisoned_storage(layout, 12), shuffled_pool(12, 16, seed=11)
    network = InprocNetwork()
    blocks = pool.allocate(5, "request:1")  # all-or-nothing, exact length
    async with (
        open_endpoint("prefill-a", first.storage, first.pool, inproc=network) as a,
        open_endpoint("prefill-b", second.storage, second.pool, inproc=network) as b,
        open_endpoint("decode", storage, pool, inproc=network) as decode,
    ):
        links = [await decode.connect(a.listen_inproc()), await decode.connect(b.listen_inproc())]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, a, "r1:kv:0", first)
            nursery.start_soon(send_all, b, "r1:kv:1", second)
            for link, transfer_id, layers in (
                (links[0], "r1:kv:0", ("k0", "v0")),
                (links[1], "r1:kv:1", ("k1", "v1")),
            ):
                receive = partial(
                    decode.receive, peer=link, blocks=blocks, expected_tokens=70, buffers=layers
                )
                nursery.start_soon(receive, transfer_id)
    pool.hand_over(blocks, "request:1", "decode-cache:1")
    landed = as_bytes(storage.gather(blocks, 0, 70))
    assert_same_bytes({k: landed[k] for k in ("k0", "v0")}, first.expected(("k0", "v0")))
    assert_same_bytes({k: landed[k] for k in ("k1", "v1")}, second.expected(("k1", "v1")))
    assert pool.owners() == {"decode-cache:1": 5}


async def test_owner_channel_seam_and_early_total_open_the_window_before_the_data() -> None:
    layout = embedding_layout(block_size=16)
    source = Source(layout, 16 * 9, seed=12)
    storage, pool = random_storage(layout, 20, seed=13), shuffled_pool(20, 16, seed=14)
    control_send, control = trio.open_memory_channel[SenderDelivery](64)
    config = TransferConfig(default_grant_blocks=1, round_cap_blocks=2, window=3)
    seen: list[type] = []
    async with endpoint_pair(
        "inproc", source, storage, pool, config=config, sender_control=control_send
    ) as pair:
        enc, lang, link = pair.sender, pair.receiver, pair.link

        async def replica() -> None:  # the owner: its command channel, then the session
            async for delivery in control:
                seen.append(type(delivery.message))
                enc.deliver(delivery)

        async def sender() -> None:
            async with enc.open_send("t") as session:
                session.announce_total(source.tokens)
                await wait_until(  # before any data moved
                    lambda: seen.count(RequestMoreCache) >= 2,
                    "the window (round 0 and 2 more) opening",
                    5,
                    interval=0.001,
                )
                await session.send(source.ids, total_tokens=source.tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(replica)
            nursery.start_soon(sender)
            collector = Collector()
            result = await lang.receive("t", peer=link, consume=collector)
            nursery.cancel_scope.cancel()
    assert seen[0] is Grant
    assert result.report.rounds == 5
    assert_same_bytes(collector.data(), source.expected())

"""The resumable transfer over UCX: the protocol suite's scenarios and properties (its faults
are in test_transfer_ucx_failures.py), run on CPU over UCX's shared-memory and TCP transports
(`UCX_TLS=sm,tcp`, the `ucx_env` fixture).

Real time throughout: the UCX progress task waits on the worker's file descriptor, which a mock clock
cannot jump, so deadlines here are short real ones.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transport.harness import (
    Collector,
    Source,
    as_bytes,
    assert_same_bytes,
    device_bundles_on_cpu,
    embedding_layout,
    endpoint_pair,
    kv_layout,
    poisoned_storage,
    random_storage,
    send_all,
    shuffled_pool,
)
from tests.transport.protocol.test_transfer import SEED_SCENARIOS, check_random_transfer
from transport.config import TransferConfig
from transport.endpoint import open_endpoint

pytestmark = pytest.mark.usefixtures("ucx_env")


@pytest.mark.parametrize("kind", ["ucx", "ucx-receiver-copies", "ucx-sender-copies"])
@pytest.mark.parametrize(("total", "cap", "rounds"), SEED_SCENARIOS)
async def test_seed_scenarios_over_ucx(kind: str, total: int, cap: int | None, rounds: int) -> None:
    layout = embedding_layout()
    source = Source(layout, total, seed=total)
    storage, pool = random_storage(layout, 100, seed=1), shuffled_pool(100, 128, seed=2)
    config = TransferConfig(default_grant_blocks=8, round_cap_blocks=cap)
    collector = Collector()
    async with endpoint_pair(kind, source, storage, pool, config=config) as pair:
        assert pair.link.link_id.startswith("ucx-")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, pair.sender, "t", source)
            result = await pair.receiver.receive("t", peer=pair.link, consume=collector)
    assert (result.report.rounds, result.report.grants) == (rounds, rounds)
    assert_same_bytes(collector.data(), source.expected())
    assert pool.used_blocks == 0


@settings(max_examples=28, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 5, 16, 64]),
    hidden=st.sampled_from([3, 4096]),  # 16 KiB rows: runs of whole blocks go direct, others packed
    total=st.integers(0, 300),
    window=st.integers(1, 4),
    cap=st.none() | st.integers(1, 5),
    mode=st.sampled_from(["keep", "consume", "borrowed"]),
    fragmentation=st.lists(st.tuples(st.integers(1, 4), st.booleans()), max_size=8),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["ucx", "ucx-mixed", "ucx-receiver-copies", "ucx-sender-copies"]),
    bundles=st.booleans(),
)
def test_random_transfers_over_ucx_land_identical_data_and_nothing_else(
    block_size: int,
    hidden: int,
    total: int,
    window: int,
    cap: int | None,
    mode: str,
    fragmentation: list[tuple[int, bool]],
    seed: int,
    kind: str,
    bundles: bool,
) -> None:
    """`bundles`: the sender packs device bundles (`harness.device_bundles_on_cpu`); the receiver lands
    them in one buffer it scatters (`ucx-receiver-copies`), or straight into the rows by an I/O-vector
    receive (the others). 16 KiB rows under plain `ucx` travel in read groups (`transport.links.ucx.reads`)."""
    with device_bundles_on_cpu() if bundles else nullcontext():
        check_random_transfer(
            kind,
            embedding_layout(block_size=block_size, hidden=hidden),
            total=total,
            window=window,
            default_grant=2,
            cap=cap,
            mode=mode,
            fragmentation=fragmentation,
            seed=seed,
        )


async def test_kv_layer_ranges_from_two_ucx_senders_land_in_one_allocation_without_aliasing() -> None:
    layout = kv_layout(layers=2)
    first, second = Source(layout, 70, seed=9), Source(layout, 70, seed=10)
    storage, pool = poisoned_storage(layout, 12), shuffled_pool(12, 16, seed=11)
    blocks = pool.allocate(5, "request:1")
    async with (
        open_endpoint("prefill-a", first.storage, first.pool) as a,
        open_endpoint("prefill-b", second.storage, second.pool) as b,
        open_endpoint("decode", storage, pool) as decode,
    ):
        links = [
            await decode.connect(await a.listen_on("ucx")),
            await decode.connect(await b.listen_on("ucx")),
        ]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, a, "r1:kv:0", first)
            nursery.start_soon(send_all, b, "r1:kv:1", second)
            for link, transfer_id, layers in (
                (links[0], "r1:kv:0", ("k0", "v0")),
                (links[1], "r1:kv:1", ("k1", "v1")),
            ):

                async def receive(link=link, transfer_id=transfer_id, layers=layers) -> None:
                    await decode.receive(
                        transfer_id, peer=link, blocks=blocks, expected_tokens=70, buffers=layers
                    )

                nursery.start_soon(receive)
    landed = as_bytes(storage.gather(blocks, 0, 70))
    assert_same_bytes({k: landed[k] for k in ("k0", "v0")}, first.expected(("k0", "v0")))
    assert_same_bytes({k: landed[k] for k in ("k1", "v1")}, second.expected(("k1", "v1")))
    for tensor in (*first.storage.tensors.values(), *second.storage.tensors.values()):
        tensor.view(torch.uint8).fill_(0)  # the senders' blocks change; what landed does not
    assert_same_bytes(as_bytes(storage.gather(blocks, 0, 70)), landed)
    pool.free(blocks, "request:1")
    assert pool.used_blocks == 0

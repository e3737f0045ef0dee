"""A receive that lands in storage the receiver names (`receive(..., into=...)`): the bytes go straight
into the caller's own tensor, never into the endpoint's pool; a link cut mid-transfer fails the receive
only after its fence (nothing writes into the caller's memory afterwards), and the same transfer
received again over a new link into the same place completes it byte for byte. Over inproc (rounds
copied in the event loop and on the copy lane), tcp and ucx (the `ucx_env` fixture)."""

from __future__ import annotations

import zlib

import pytest
import torch
import trio

from messages.layout import BufferSpec, PoolLayout
from messages.transfer import FailureReason
from tests.transport.harness import Source, endpoint_pair, poisoned_storage, send_all, settle
from transport.config import TransferConfig
from transport.errors import TransferFailed
from transport.faults import FaultPlan
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage

LAYOUT = PoolLayout(block_size=16, buffers=(BufferSpec(name="bytes", shape=(64,), dtype="uint8"),))
TOKENS = 200  # 12.5 blocks: the last block of the caller's storage is partly written
BLOCKS = 13
CONFIG = TransferConfig(default_grant_blocks=2, round_cap_blocks=2, window=2)
KINDS = ["inproc", "inproc-threads", "tcp", "ucx"]


def source_bytes(source: Source) -> torch.Tensor:
    return source.storage.gather(source.ids, 0, TOKENS)["bytes"].reshape(-1)


def crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().numpy().tobytes())


def own_storage() -> tuple[torch.Tensor, PoolStorage]:
    """The caller's tensor (poisoned) and a pool of the layout laid over it."""
    target = torch.full((BLOCKS * 16 * 64,), 0x5A, dtype=torch.uint8)
    return target, PoolStorage(LAYOUT, BLOCKS, over={"bytes": target})


@pytest.mark.parametrize("kind", KINDS)
async def test_a_transfer_lands_in_the_named_storage_and_not_in_the_pool(
    kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "ucx":
        request.getfixturevalue("ucx_env")
    source = Source(LAYOUT, TOKENS, seed=3)
    pool_storage, pool = poisoned_storage(LAYOUT, 2), BlockPool(2, 16)
    target, into = own_storage()
    async with (
        endpoint_pair(kind, source, pool_storage, pool, config=CONFIG) as pair,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(send_all, pair.sender, "piece", source)
        result = await pair.receiver.receive(
            "piece", peer=pair.link, blocks=range(BLOCKS), into=into, expected_tokens=TOKENS
        )
    assert result.report.rounds > 1 and result.total_tokens == TOKENS
    landed = target[: TOKENS * 64]
    assert crc(landed) == crc(source_bytes(source)) and torch.equal(landed, source_bytes(source))
    assert bool((target[TOKENS * 64 :] == 0x5A).all())  # rows past the transfer untouched
    assert bool((pool_storage.tensors["bytes"] == 0x5A).all()) and pool.used_blocks == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_link_cut_mid_transfer_is_fenced_and_received_again_into_the_same_place(
    kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "ucx":
        request.getfixturevalue("ucx_env")
    source = Source(LAYOUT, TOKENS, seed=5)
    target, into = own_storage()
    cut = FaultPlan(drop_link_after_bytes=3 * 16 * 64 + 100)  # inside the second round
    pool_storage, pool = poisoned_storage(LAYOUT, 2), BlockPool(2, 16)
    async with endpoint_pair(kind, source, pool_storage, pool, config=CONFIG, faults=cut) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send_failing, pair.sender, source)
            with pytest.raises(TransferFailed) as failed:
                await pair.receiver.receive("piece", peer=pair.link, blocks=range(BLOCKS), into=into)
        assert failed.value.report.reason is FailureReason.LINK_LOST
        after_failure = target.clone()  # the receive returned after its fence: nothing lands from here on
        await settle()
        assert torch.equal(target, after_failure)
    assert not torch.equal(target[: TOKENS * 64], source_bytes(source))  # a part landed, not all of it

    async with (
        endpoint_pair(kind, source, pool_storage, pool, config=CONFIG) as pair,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(send_all, pair.sender, "piece", source)
        await pair.receiver.receive("piece", peer=pair.link, blocks=range(BLOCKS), into=into)
    assert crc(target[: TOKENS * 64]) == crc(source_bytes(source))
    assert bool((pool_storage.tensors["bytes"] == 0x5A).all()) and pool.used_blocks == 0


async def _send_failing(sender: object, source: Source) -> None:
    with pytest.raises(TransferFailed):
        await send_all(sender, "piece", source)  # type: ignore[arg-type]


async def test_a_receive_into_named_storage_needs_borrowed_blocks_of_the_layout() -> None:
    source = Source(LAYOUT, TOKENS, seed=7)
    _target, into = own_storage()
    other = PoolStorage(
        PoolLayout(block_size=16, buffers=(BufferSpec(name="bytes", shape=(32,), dtype="uint8"),)), 2
    )
    async with endpoint_pair("inproc", source, poisoned_storage(LAYOUT, 2), BlockPool(2, 16)) as pair:
        with pytest.raises(ValueError, match="borrowed blocks in it and this endpoint's layout"):
            await pair.receiver.receive("a", peer=pair.link, into=into)
        with pytest.raises(ValueError, match="borrowed blocks in it and this endpoint's layout"):
            await pair.receiver.receive("b", peer=pair.link, blocks=[0], into=other)
        with pytest.raises(ValueError, match="outside the pool"):
            await pair.receiver.receive("c", peer=pair.link, blocks=[BLOCKS], into=into)


def test_storage_over_a_tensor_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 2048 contiguous uint8 elements"):
        PoolStorage(LAYOUT, 2, over={"bytes": torch.zeros(2047, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="has none"):
        PoolStorage(LAYOUT, 2, over={})

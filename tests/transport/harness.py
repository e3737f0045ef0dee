"""Shared pieces of the transfer tests: layouts, random storage, shuffled pools, endpoint pairs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import torch
import trio

from messages.layout import BufferSpec, PoolLayout
from tests.waiting import WAIT_SECONDS, deadline
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.faults import NO_FAULTS, FaultPlan
from transport.links.inproc.link import InprocNetwork
from transport.links.ucx.worker import UcxWorker
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage
from transport.protocol.landing import LandedRound
from transport.protocol.link import Link


def embedding_layout(block_size: int = 128, hidden: int = 8) -> PoolLayout:
    return PoolLayout(
        block_size=block_size,
        buffers=(
            BufferSpec(name="embeds", shape=(hidden,), dtype="float32"),
            BufferSpec(name="token_ids", shape=(), dtype="int64"),
            BufferSpec(name="positions", shape=(3,), dtype="int64"),
        ),
    )


def kv_layout(layers: int = 2, block_size: int = 16) -> PoolLayout:
    return PoolLayout(
        block_size=block_size,
        buffers=tuple(
            BufferSpec(name=f"{kind}{layer}", shape=(2, 4), dtype="bfloat16")
            for layer in range(layers)
            for kind in ("k", "v")
        ),
    )


def random_storage(layout: PoolLayout, num_blocks: int, seed: int) -> PoolStorage:
    """Every byte of every buffer random (deterministic in `seed`)."""
    storage = PoolStorage(layout, num_blocks)
    generator = torch.Generator().manual_seed(seed)
    for tensor in storage.tensors.values():
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))
    return storage


def on_device(storage: PoolStorage, device: str) -> PoolStorage:
    """`storage`'s bytes in a new storage on `device` (itself when that is where it already is)."""
    if torch.device(device) == storage.device:
        return storage
    moved = PoolStorage(storage.layout, storage.num_blocks, device=device)
    for name, tensor in storage.tensors.items():
        moved.tensors[name].copy_(tensor)
    return moved


def poisoned_storage(layout: PoolLayout, num_blocks: int) -> PoolStorage:
    storage = PoolStorage(layout, num_blocks)
    for tensor in storage.tensors.values():
        tensor.view(torch.uint8).fill_(0x5A)
    return storage


def shuffled_pool(num_blocks: int, block_size: int, seed: int) -> BlockPool:
    """A pool whose free list is in random order: allocations are scattered block lists."""
    pool = BlockPool(num_blocks, block_size)
    ids = pool.allocate(num_blocks, "shuffle")
    random.Random(seed).shuffle(ids)
    pool.free(ids, "shuffle")
    return pool


@dataclass
class Source:
    """A sender's pool holding `tokens` random tokens in scattered blocks (deterministic in `seed`)."""

    layout: PoolLayout
    tokens: int
    seed: int
    spare_blocks: int = 4
    device: str = "cpu"
    storage: PoolStorage = field(init=False)
    pool: BlockPool = field(init=False)
    ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        blocks = -(-self.tokens // self.layout.block_size)
        num_blocks = blocks + self.spare_blocks
        self.storage = on_device(random_storage(self.layout, num_blocks, self.seed), self.device)
        self.pool = shuffled_pool(num_blocks, self.layout.block_size, self.seed)
        self.ids = self.pool.allocate(blocks, "source")

    def expected(
        self, buffers: tuple[str, ...] | None = None, tokens: int | None = None
    ) -> dict[str, torch.Tensor]:
        """The bytes of the first `tokens` (default: all) source tokens."""
        count = self.tokens if tokens is None else tokens
        return as_bytes(self.storage.gather(self.ids, 0, count, buffers))


def as_bytes(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Byte views, so NaN patterns in random floats compare equal to themselves."""
    return {name: tensor.contiguous().view(torch.uint8) for name, tensor in data.items()}


def assert_same_bytes(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"buffer {name!r} differs"


class Collector:
    """A consume step that copies each landed round out, in stream order; `wait_rounds` waits for them."""

    def __init__(self) -> None:
        self.parts: list[dict[str, torch.Tensor]] = []
        self.rounds: list[LandedRound] = []
        self._landed = trio.Event()  # set (and replaced) each time a round lands

    async def __call__(self, landed: LandedRound) -> None:
        assert landed.offset == sum(r.tokens for r in self.rounds)
        self.rounds.append(landed)
        self.parts.append(as_bytes(landed.gather()))
        self._landed.set()
        self._landed = trio.Event()

    async def wait_rounds(self, count: int, seconds: float = WAIT_SECONDS) -> None:
        """Until `count` rounds have landed here; fails naming them after `seconds`."""
        landed = lambda: f"{len(self.rounds)} landed"  # noqa: E731
        with deadline(f"{count} rounds landing in the collector", seconds, detail=landed):
            while len(self.rounds) < count:
                await self._landed.wait()

    def data(self) -> dict[str, torch.Tensor]:
        return {name: torch.cat([part[name] for part in self.parts]) for name in self.parts[0]}


@dataclass
class Pair:
    sender: TransferEndpoint
    receiver: TransferEndpoint
    link: Link


@asynccontextmanager
async def endpoint_pair(
    kind: str,
    source: Source,
    receiver_storage: PoolStorage,
    receiver_pool: BlockPool,
    *,
    config: TransferConfig | None = None,
    sender_config: TransferConfig | None = None,
    faults: FaultPlan = NO_FAULTS,
    sender_control: trio.MemorySendChannel[SenderDelivery] | None = None,
) -> AsyncIterator[Pair]:
    """A sending endpoint on `source` and a receiving one, linked over `kind` ("inproc", "tcp", "ucx",
    "cuda-ipc", "inproc-threads": inproc with every round copied through the link's copy lane, or
    "ucx-mixed" / "ucx-receiver-copies" / "ucx-sender-copies": ucx with `ucx_copies` "mixed" (UCX's own
    rendezvous reads direct pieces), "receiver" (bundles land in a host chunk the receiver unpacks) or
    "sender" (the sender writes direct pieces into scattered receives); plain "ucx" is the default,
    "cma": the receiver reads pieces of 16 KiB and more itself)."""
    if kind == "inproc-threads":
        kind, config = "inproc", msgspec.structs.replace(config or TransferConfig(), inproc_thread_bytes=1)
        sender_config = sender_config and msgspec.structs.replace(sender_config, inproc_thread_bytes=1)
    copies = {"ucx-mixed": "mixed", "ucx-receiver-copies": "receiver", "ucx-sender-copies": "sender"}
    if kind in copies:
        config = msgspec.structs.replace(config or TransferConfig(), ucx_copies=copies[kind])
        kind = "ucx"
    network = InprocNetwork()
    async with (
        open_endpoint(
            "sender",
            source.storage,
            source.pool,
            config=sender_config or config,
            faults=faults,
            inproc=network,
            sender_control=sender_control,  # the owner's command channel, when given
        ) as sender,
        open_endpoint("receiver", receiver_storage, receiver_pool, config=config, inproc=network) as receiver,
    ):
        address = await listen(sender, kind)
        link = await receiver.connect(address)
        yield Pair(sender, receiver, link)


async def listen(endpoint: TransferEndpoint, kind: str) -> str:
    """Start `endpoint` listening over transport `kind`; its address."""
    if kind == "inproc":
        return endpoint.listen_inproc()
    if kind == "tcp":
        return await endpoint.listen_tcp()
    assert kind in ("ucx", "cuda-ipc"), kind
    return await endpoint.listen_on("ucx" if kind == "ucx" else "cuda-ipc")


async def send_all(endpoint: TransferEndpoint, transfer_id: str, source: Source) -> None:
    async with endpoint.open_send(transfer_id) as session:
        await session.send(source.ids, total_tokens=source.tokens)


async def settle() -> None:
    """Let fence watchers and small control sends run (quarantine release happens there): a fixed pause,
    not a wait for a condition, for a test that then checks what must have happened by now or what
    must not have (a block still quarantined). A test waiting for something to happen uses
    `tests.waiting.wait_until`."""
    for _ in range(20):
        await trio.sleep(0.01)


async def check_kv_in_borrowed_blocks_and_an_aborted_round(kind: str, device: str = "cpu") -> None:
    """A KV layout over `kind` lands in a borrowed allocation (identical bytes); then a transfer whose
    sender stalls is given up by the receiver, its round fenced; every block comes back."""
    layout = kv_layout(layers=2)
    source = Source(layout, 200, seed=9, device=device)
    storage, pool = on_device(poisoned_storage(layout, 40), device), shuffled_pool(40, 16, seed=11)
    blocks = pool.allocate(13, "request:1")
    config = TransferConfig(default_grant_blocks=2, round_cap_blocks=2, window=2)
    async with endpoint_pair(kind, source, storage, pool, config=config) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, pair.sender, "kv", source)
            await pair.receiver.receive("kv", peer=pair.link, blocks=blocks, expected_tokens=200)
        assert_same_bytes(as_bytes(storage.gather(blocks, 0, 200)), source.expected())
        pool.free(blocks, "request:1")

        async def stalled_sender() -> None:
            async with pair.sender.open_send("aborted") as session:
                session.announce_total(200)
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stalled_sender)
            with trio.move_on_after(0.3):
                await pair.receiver.receive("aborted", peer=pair.link, consume=Collector())
            await settle()
            nursery.cancel_scope.cancel()
        await settle()
    assert (pool.used_blocks, pool.quarantined_blocks) == (0, 0)


def _always(_device: torch.device, _cuda_capable: bool) -> bool:
    return True


@contextmanager
def device_bundles_on_cpu() -> Iterator[None]:
    """UCX links pack CPU pools as they pack GPU pools their UCX reaches (`transport.bulk.device_bundles`):
    the policy that picks the path (`bundles_on_device`, true only for CUDA pools) switched on, so the
    path itself — one gathered bundle per message, received into one buffer and scattered — runs on CPU
    over real UCX, all but its streams and events."""
    with pytest.MonkeyPatch.context() as patch:
        for module in ("transport.links.ucx.link", "transport.links.ucx.frames"):
            patch.setattr(f"{module}.bundles_on_device", _always)
        yield


class SenderProcess:
    """`tests.transport.sender_process` running as a child process."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""
        self.address = ""

    async def line(self) -> dict[str, object]:
        assert self.process.stdout is not None
        with deadline("a reply line from the sender process", 60):
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some()
                if not chunk:
                    raise EOFError("sender process ended without a reply")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        parsed: dict[str, object] = json.loads(line)
        return parsed


@asynccontextmanager
async def sender_process(
    params: dict[str, object], env: dict[str, str] | None = None
) -> AsyncIterator[SenderProcess]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.transport.sender_process"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    child = SenderProcess(process)
    try:
        assert process.stdin is not None
        await process.stdin.send_all(json.dumps(params).encode() + b"\n")
        child.address = str((await child.line())["address"])
        yield child
    finally:
        with trio.CancelScope(shield=True):
            if process.stdin is not None:
                await process.stdin.aclose()
            with trio.move_on_after(10):  # it exits once stdin closes; killed below if it does not
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


@asynccontextmanager
async def two_workers() -> AsyncIterator[tuple[UcxWorker, Any, UcxWorker, Any]]:
    """A sending and a receiving worker, each progressed by its task, with an endpoint to the other."""
    async with trio.open_nursery() as nursery:
        sender, receiver = UcxWorker("sender"), UcxWorker("receiver")
        await nursery.start(sender.run)
        await nursery.start(receiver.run)
        yield sender, sender.connect(receiver.address), receiver, receiver.connect(sender.address)
        nursery.cancel_scope.cancel()

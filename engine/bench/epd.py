"""epd: the embedding transfer's own time span when it needs k REQUEST_MORE_CACHE rounds, vs one round.

Cases `{inproc,tcp}_10000_tokens_k{2,4,8}` (figures and machine in docs/benchmarks.md): the embeddings of
a 10 000-row image (the tiny vision encoder's output for 1600×1600 pixels, or random rows of
`--hidden` floats) go from an encode endpoint to a language endpoint with exactly the code the node
runs — `replicas.embedding.send_embeddings` on the encode side, `EmbeddingAssembler.consume` on the
language side, the owned-consumed landing mode, both pools' free lists shuffled so every allocation is
a scattered block list. The language side's round-0 grant is already waiting when the data is ready, as
in the node (it granted as soon as it took the request); the span runs from the encode side starting to
send (`on_sending`, after the rows are in its pool) to the language side's last round consumed — the
same span the node reports as the transfer's `seconds`. k rounds are forced by setting both the default
grant and the per-round cap to ⌈blocks / k⌉; the baseline is the same transfer with a default grant
large enough for one round. Project and baseline alternate (`alternate`), each a median over `--repeats`.
`tcp` runs both endpoints in this process over loopback sockets, as a node with `--transport tcp` does.
Goal: time ratio ≤ 1.15 for every k.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch
import trio

from engine.bench.rows import Row, alternate, row
from engine.bench.transfer import Portal, trio_thread
from engine.bench.transfer_peer import fragmented_pool
from messages.transfer import Grant
from replicas.embedding import EmbeddingAssembler, send_embeddings
from replicas.model import ImageEmbedding, ImageGrid, embedding_layout, tiny_model
from replicas.model.vision import image_positions
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.links.inproc.link import InprocNetwork
from transport.memory.storage import PoolStorage
from transport.protocol.link import Link

BENCH = "epd"
TOKENS = 10_000
GRID = ImageGrid(t=1, h=100, w=100)
BLOCK_SIZE = 128
IMAGE_TOKEN = 258
GRANT_WAIT = 10.0  # seconds the sender waits for the receiver's round-0 grant before giving up
Transport = Literal["inproc", "tcp"]
_transfer_ids = itertools.count(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per figure (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--hidden", type=int, default=128, help="embedding width (128: the tiny model's, real encoder output)"
    )
    parser.add_argument("--transports", default="inproc,tcp", help="comma-separated: inproc, tcp")


def _embeddings(hidden: int) -> list[ImageEmbedding]:
    if hidden == 128:
        model = tiny_model()
        assert model.vision is not None
        pixels = np.random.default_rng(5).integers(0, 256, (16 * GRID.h, 16 * GRID.w, 3), dtype=np.uint8)
        return model.vision.encode([pixels])
    generator = torch.Generator().manual_seed(5)
    return [
        ImageEmbedding(
            grid=GRID,
            embeds=torch.randn(GRID.rows, hidden, generator=generator),
            token_ids=torch.full((GRID.rows,), IMAGE_TOKEN, dtype=torch.int64),
            positions=image_positions(GRID),
        )
    ]


@dataclass
class Encoder:
    """The encode side: one endpoint over a scattered pool, whose sender-bound messages (grants and
    REQUEST_MORE_CACHE) come through an owner's channel as in a replica; each transfer writes and sends
    the rows."""

    endpoint: TransferEndpoint
    storage: PoolStorage
    embeddings: list[ImageEmbedding]
    granted: dict[str, trio.Event] = field(default_factory=dict)

    async def forward(self, deliveries: trio.MemoryReceiveChannel[SenderDelivery]) -> None:
        async for delivery in deliveries:
            self.endpoint.deliver(delivery)
            if isinstance(delivery.message, Grant):
                self.granted.setdefault(delivery.message.transfer_id, trio.Event()).set()

    async def send(self, transfer_id: str, stamps: dict[str, float]) -> int:
        pool = self.endpoint.pool
        async with self.endpoint.open_send(transfer_id) as session:
            with trio.fail_after(GRANT_WAIT):  # the language side's round 0 is waiting, as in the node
                await self.granted.setdefault(transfer_id, trio.Event()).wait()
            del self.granted[transfer_id]
            report = await send_embeddings(
                session,
                pool,
                self.storage,
                self.embeddings,
                request_id=transfer_id,
                owner="bench",
                pressure_timeout=GRANT_WAIT,
                on_sending=lambda: stamps.__setitem__("start", time.perf_counter()),
            )
        return report.rounds


@dataclass
class Language:
    """The language side with its own endpoint config (the grant sizes) and link to the encoder."""

    endpoint: TransferEndpoint
    link: Link
    rounds: int = 0

    async def receive_once(self, encoder: Encoder, check: bool = False) -> float:
        """Seconds of one transfer's own span (see the module docstring)."""
        transfer_id = f"epd-{next(_transfer_ids)}"
        stamps: dict[str, float] = {}
        assembler = EmbeddingAssembler(transfer_id, [256, IMAGE_TOKEN], IMAGE_TOKEN, max_tokens=32768)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(encoder.send, transfer_id, stamps)
            result = await self.endpoint.receive(transfer_id, peer=self.link, consume=assembler.consume)
            stamps["end"] = time.perf_counter()
        self.rounds = result.report.rounds
        if check:
            landed = assembler.finish().embeds
            expected = torch.cat([embedding.embeds for embedding in encoder.embeddings])
            if not torch.equal(landed, expected):
                raise RuntimeError(f"{transfer_id}: the landed embeddings differ from the encoder's")
        return stamps["end"] - stamps["start"]


async def _open_encoder(
    portal: Portal, transport: Transport, network: InprocNetwork, embeddings: list[ImageEmbedding]
) -> tuple[Encoder, str]:
    hidden = int(embeddings[0].embeds.shape[1])
    blocks = 2 * math.ceil(TOKENS / BLOCK_SIZE)
    storage = PoolStorage(embedding_layout(hidden, BLOCK_SIZE), blocks)
    pool = fragmented_pool(blocks, BLOCK_SIZE, seed=31)

    async def hold(task_status: trio.TaskStatus[tuple[Encoder, str]] = trio.TASK_STATUS_IGNORED) -> None:
        control, deliveries = trio.open_memory_channel[SenderDelivery](math.inf)
        name = f"encode-{transport}/emb"
        async with open_endpoint(name, storage, pool, inproc=network, sender_control=control) as endpoint:
            address = endpoint.listen_inproc() if transport == "inproc" else await endpoint.listen_tcp()
            encoder = Encoder(endpoint, storage, embeddings)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(encoder.forward, deliveries)
                task_status.started((encoder, address))

    return await portal.nursery.start(hold)


async def _open_language(
    portal: Portal, name: str, address: str, network: InprocNetwork, hidden: int, config: TransferConfig
) -> Language:
    blocks = 2 * math.ceil(TOKENS / BLOCK_SIZE)
    storage = PoolStorage(embedding_layout(hidden, BLOCK_SIZE), blocks)
    pool = fragmented_pool(blocks, BLOCK_SIZE, seed=32)

    async def hold(task_status: trio.TaskStatus[Language] = trio.TASK_STATUS_IGNORED) -> None:
        async with open_endpoint(name, storage, pool, config=config, inproc=network) as endpoint:
            task_status.started(Language(endpoint, await endpoint.connect(address)))
            await trio.sleep_forever()

    return await portal.nursery.start(hold)


def _rows(
    portal: Portal, transport: Transport, embeddings: list[ImageEmbedding], repeats: int
) -> Iterator[Row]:
    network = InprocNetwork()
    hidden = int(embeddings[0].embeds.shape[1])
    encoder, address = portal.call(_open_encoder, portal, transport, network, embeddings)
    blocks = math.ceil(TOKENS / BLOCK_SIZE)

    def language(name: str, grant_blocks: int, cap: int | None) -> Language:
        config = TransferConfig(default_grant_blocks=grant_blocks, round_cap_blocks=cap)
        side = portal.call(
            _open_language, portal, f"{name}-{transport}/emb", address, network, hidden, config
        )
        portal.call(side.receive_once, encoder, True)  # a checked run: the rows arrive intact
        return side

    one_round = language("k1", blocks, None)
    nbytes = TOKENS * embedding_layout(hidden, BLOCK_SIZE).bytes_per_token

    def millis(side: Language) -> float:
        return portal.call(side.receive_once, encoder) * 1e3

    for k in (2, 4, 8):
        grant = math.ceil(blocks / k)
        rounds = language(f"k{k}", grant, grant)
        project, baseline = alternate(partial(millis, rounds), partial(millis, one_round), repeats)
        note = (
            f"{rounds.rounds} rounds of <= {grant} blocks vs {one_round.rounds}; {nbytes} bytes "
            f"(hidden {hidden}); {nbytes / project / 1e6:.2f} GB/s vs {nbytes / baseline / 1e6:.2f} GB/s"
        )
        yield row(
            BENCH,
            f"{transport}_{TOKENS}_tokens_k{k}",
            "time_vs_one_round",
            "lower",
            project,
            baseline,
            "one round (ms)",
            unit="ms",
            note=note,
        )


def run(args: argparse.Namespace) -> Iterable[Row]:
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 15)
    embeddings = _embeddings(args.hidden)
    with trio_thread() as portal:
        for transport in args.transports.split(","):
            if transport not in ("inproc", "tcp"):
                raise SystemExit(f"--transports: unknown transport {transport!r} (inproc, tcp)")
            yield from _rows(portal, transport, embeddings, repeats)

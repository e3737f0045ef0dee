"""The relay transfer: a batch's hidden states and rotary positions between two prefill replicas.

Every replica that can serve prefill has a relay pool (`{replica}/relay` endpoint): per token `hidden
[hidden_size]` in the model's dtype and `positions [3]` int64 (a text model's one position repeated).
The NewPrefill replica stages the batch into blocks of its pool when it offers it (`stage`, at offer time
so the offer never waits for room) and streams them with the resumable transfer (`send_staged`); the
OldPrefill replica receives them in consumed rounds straight into the batch's tensors (`receive`). The
bytes are counted in the fabric's flow counters as kind `relay`.

Cancellation: `send_staged` returns its blocks to the pool whatever happens (the transport fences them
until no write can still land); `receive` leaves nothing allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch

from messages.commands import RelayOffer
from messages.layout import BufferSpec, PoolLayout
from messages.transfer import TransferReport
from replicas.fabric import Fabric
from replicas.model import PrefillSequence
from replicas.model.config import ModelConfig
from transport.endpoint import TransferEndpoint
from transport.protocol.landing import LandedRound

RELAY_BLOCK_SIZE = 16


def relay_layout(config: ModelConfig, block_size: int = RELAY_BLOCK_SIZE) -> PoolLayout:
    return PoolLayout(
        block_size=block_size,
        buffers=(
            BufferSpec(name="hidden", shape=(config.hidden_size,), dtype=config.dtype),
            BufferSpec(name="positions", shape=(3,), dtype="int64"),
        ),
    )


def relay_pool_blocks(max_batch_tokens: int, block_size: int = RELAY_BLOCK_SIZE) -> int:
    """Room for two batches of `max_batch_tokens` (one being sent while the next is staged)."""
    return 2 * math.ceil(max_batch_tokens / block_size)


def batch_positions(sequences: Sequence[PrefillSequence]) -> torch.Tensor:
    """`[sum T, 3]` int64 rotary positions of a batch (a 1-D position repeated on the three axes)."""
    pieces = []
    for seq in sequences:
        if seq.positions is None:
            piece = torch.arange(seq.cached_tokens, seq.cached_tokens + seq.num_tokens, dtype=torch.int64)
        else:
            piece = seq.positions.to(torch.int64).cpu()
        pieces.append(piece[:, None].expand(-1, 3) if piece.dim() == 1 else piece)
    return torch.cat(pieces)


@final
@dataclass(frozen=True, slots=True)
class Staged:
    """A batch staged in the relay pool: `blocks` owned by `owner` until `send_staged` returns."""

    blocks: list[int]
    owner: str
    tokens: int


def stage(
    endpoint: TransferEndpoint, owner: str, hidden: torch.Tensor, positions: torch.Tensor
) -> Staged | None:
    """Copy a batch into the relay pool behind `endpoint`; None when the pool has no room for it now."""
    tokens = int(hidden.shape[0])
    blocks = endpoint.pool.try_allocate(math.ceil(tokens / endpoint.pool.block_size), owner)
    if blocks is None:
        return None
    endpoint.storage.scatter(blocks, 0, {"hidden": hidden, "positions": positions})
    return Staged(blocks, owner, tokens)


async def send_staged(endpoint: TransferEndpoint, transfer_id: str, staged: Staged) -> TransferReport:
    """Stream a staged batch as `transfer_id`; raises the transport's `TransferError` on failure."""
    try:
        async with endpoint.open_send(transfer_id) as session:
            return await session.send(staged.blocks, total_tokens=staged.tokens)
    finally:
        endpoint.pool.free(staged.blocks, staged.owner)


@final
@dataclass(frozen=True, slots=True)
class Received:
    hidden: torch.Tensor
    positions: torch.Tensor
    report: TransferReport


async def receive(endpoint: TransferEndpoint, fabric: Fabric, offer: RelayOffer) -> Received:
    """Receive an offered batch into fresh tensors at `endpoint`. Raises `TransferError`, `LinkError`,
    `HandshakeRefused` or `UnknownEndpoint` (the NewPrefill replica is gone)."""
    spec = endpoint.storage.layout.buffer("hidden")
    hidden = torch.empty(
        offer.total_tokens, *spec.shape, dtype=endpoint.storage.tensors["hidden"].dtype, device="cpu"
    )
    positions = torch.empty(offer.total_tokens, 3, dtype=torch.int64)

    async def consume(landed: LandedRound) -> None:
        data = landed.gather()
        rows = slice(landed.offset, landed.offset + landed.tokens)
        hidden[rows] = data["hidden"].cpu()
        positions[rows] = data["positions"].cpu()

    link = await fabric.link(endpoint, offer.source_endpoint)
    result = await endpoint.receive(
        offer.transfer_id, peer=link, consume=consume, expected_tokens=offer.total_tokens
    )
    return Received(hidden, positions, result.report)

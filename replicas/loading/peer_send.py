"""The sending side of a peer weight copy (blitz): a replica that holds the weights serves a piece.

A loading replica sends `SendWeights(piece, byte_offset, ...)` to a replica holding a fully loaded
model — or, in a multicast chain, to the replica loading just before it, once that one holds the piece
(`holds`); the actor's dispatch calls `send_weights`, which checks the request at once (a refusal is the
command's outcome) and starts a helper task in the replica's nursery. The helper opens the transfer's
sending session first (so the receiver's grant finds it, and any failure reaches the receiver as an
abort), takes the piece's wire bytes (`Wire`: the checkpoint tensors, `replicas.loading.split` — fused
weights split back, packed ones made dense — back to back as the wire has them: a view of the model's
own storage when they already lie there so, else one buffer they are copied into once) and sends bytes
`[byte_offset, byte_offset + n)` of the piece: while `byte_offset` is within the piece's whole 1 MiB
blocks, `n` up to `DIRECT_PART_BYTES` of them, sent from the wire bytes where they lie (nothing
staged); past them, the rest of the piece (less than a block), staged in the replica's staging pool
(a bounded wait for blocks when other copies hold them; at most half the pool, `part_bytes`). The header
(`messages.weights.WeightsHeader`) carries the piece's tensor table. The receiver asks for the next part
as soon as the first round of this one has landed.

The helper keeps a reference to the model it sends from, so a replica scaled down meanwhile still
finishes the part. The wire bytes of the last pieces asked for are cached per model (a piece of several
parts is made once), and a piece's first part starts making the next piece's in a worker thread, so the
unpacking of packed weights runs while the previous piece is on the wire.

Cancellation: when the replica stops, the helper is cancelled; leaving the session aborts the transfer
(the receiver learns why) and the staging blocks are freed on every path. Transfer failures are the
receiver's to report; this side only logs them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Final, final

import structlog
import torch
import trio

from messages.commands import SendWeights
from messages.peer_codec import encode_header
from messages.weights import WeightPiece, WeightsHeader, WeightTensor
from replicas.inbox import CommandRefused
from replicas.loading.pieces import checkpoint_pieces, tensor_table
from replicas.loading.split import model_piece
from replicas.loading.staging import (
    BLOCK_BYTES,
    BUFFER,
    ROW_BYTES,
    WEIGHTS_LAYOUT,
    WeightStaging,
    rows_for,
    settle,
    stage,
)
from replicas.model.llama import Model
from replicas.ports import Actor
from transport.config import TransferConfig
from transport.endpoint import TransferEndpoint
from transport.errors import TransferError
from transport.memory.blocks import AllocationTimeout
from transport.memory.host_memory import landing_buffer
from transport.memory.storage import PoolStorage

_log = structlog.get_logger("replicas.loading")
THREAD_BYTES: Final = 1 << 20  # staging copies at least this large run in a worker thread
CACHED_PIECES: Final = 3  # the piece being sent, the next one (split ahead), one spare
DIRECT_PART_BYTES: Final = 64 << 20  # the most one part sent from the piece's own bytes carries
Tensors = list[tuple[str, torch.Tensor]]


@final
class _Split:
    """A piece's wire bytes, made in a worker thread; `done` is set when `wire` is (None: the split
    failed or was cancelled, a later request splits again)."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.wire: Wire | None = None


_split_cache: weakref.WeakKeyDictionary[Model, OrderedDict[WeightPiece, _Split]] = weakref.WeakKeyDictionary()


def send_weights(
    replica: Actor,
    model: Model | None,
    staging: WeightStaging,
    endpoint: TransferEndpoint,
    transfer: TransferConfig,
    command: SendWeights,
) -> None:
    """Serve `command` from `model` through the staging pool behind `endpoint` (called by the actor's
    dispatch, in the main loop). Raises `CommandRefused` (`not_found`: no fully loaded weights here;
    `bad_request`: a piece or offset the model lacks)."""
    if model is None or not holds(model, command.piece):
        raise CommandRefused(
            "not_found",
            f"{replica.name} ({replica.state.value}) does not hold {command.piece.label} of the weights to send",
        )
    try:
        table = tensor_table(model.config, command.piece)
    except ValueError as exc:
        raise CommandRefused("bad_request", f"{replica.name}: {command.piece.label}: {exc}") from None
    total = table[-1].offset + table[-1].nbytes
    if command.byte_offset >= total:
        raise CommandRefused(
            "bad_request",
            f"{replica.name}: {command.piece.label} has {total} bytes; asked from byte {command.byte_offset}",
        )
    replica.spawn(_send, replica.name, model, staging, endpoint, transfer, command, table)
    if command.byte_offset == 0:  # the piece's first part: split the next piece while this one moves
        following = _following(model, command.piece)
        if following is not None and holds(model, following):
            replica.spawn(_split, model, following)


def _following(model: Model, piece: WeightPiece) -> WeightPiece | None:
    """The piece a copy asks for after `piece` (checkpoint order), or None after the last."""
    pieces = checkpoint_pieces(model.config)
    at = pieces.index(piece) if piece in pieces else len(pieces)
    return pieces[at + 1] if at + 1 < len(pieces) else None


def part_bytes(staging: WeightStaging) -> int:
    """The most bytes one part carries: half the staging pool, so the next part is staged while the
    last one is on the wire (the receiver asks for it as soon as the last one's first round landed)."""
    return max(ROW_BYTES, staging.capacity_bytes // 2 // ROW_BYTES * ROW_BYTES)


def holds(model: Model, piece: WeightPiece) -> bool:
    """Whether `model` — fully loaded, or still loading (the replica before another in a chain) — holds
    `piece` already."""
    match piece.kind:
        case "embeddings":
            return True
        case "layer":
            return (
                piece.layer is not None
                and piece.layer < len(model.layers)
                and model.layers[piece.layer] is not None
            )
        case "norm":
            return model.final_norm is not None
        case "head":
            return model.lm_head is not None
    return False


async def _send(
    replica: str,
    model: Model,
    staging: WeightStaging,
    endpoint: TransferEndpoint,
    config: TransferConfig,
    command: SendWeights,
    table: tuple[WeightTensor, ...],
) -> None:
    """One part of one piece (see the module docstring)."""
    total = table[-1].offset + table[-1].nbytes
    owner = f"weights:{command.transfer_id}"
    try:
        async with endpoint.open_send(command.transfer_id, peer=command.destination_endpoint) as session:
            wire = await _split(model, command.piece)
            start = command.byte_offset
            direct = wire.storage is not None and start < wire.direct_bytes and start % ROW_BYTES == 0
            if direct:
                nbytes = min(wire.direct_bytes - start, DIRECT_PART_BYTES)
            else:
                nbytes = min(total - start, part_bytes(staging))
            rows = rows_for(nbytes)
            header = encode_header(
                WeightsHeader(
                    model=model.name,
                    piece=command.piece,
                    piece_bytes=total,
                    offset=start,
                    nbytes=nbytes,
                    tensors=table,
                )
            )
            session.announce_total(rows, header)
            if direct:  # from the piece's wire bytes where they lie: nothing staged
                assert wire.storage is not None
                blocks = range(wire.storage.num_blocks)
                await session.send(
                    blocks,
                    total_tokens=rows,
                    source_offset=start // ROW_BYTES,
                    header=header,
                    source=wire.storage,
                )
                return
            deadline = trio.current_time() + config.pressure_timeout
            ids = await staging.pool.allocate_wait(staging.pool.blocks_for(rows), owner, deadline=deadline)
            try:
                if nbytes >= THREAD_BYTES:
                    await trio.to_thread.run_sync(stage, staging.storage, ids, [wire.bytes], start, nbytes)
                else:
                    stage(staging.storage, ids, [wire.bytes], start, nbytes)
                await session.send(ids, total_tokens=rows, header=header)
            finally:
                staging.pool.free(ids, owner)
    except (TransferError, AllocationTimeout) as exc:
        _log.info(
            "weights.send_failed",
            replica=replica,
            transfer_id=command.transfer_id,
            piece=command.piece.label,
            error=str(exc),
        )


@final
class Wire:
    """A piece's bytes in wire order (`tensor_table`): `bytes`, a uint8 tensor of the piece's length —
    a view of the model's own storage when its tensors lie there back to back as the wire has them (a
    piece a peer copy landed, the embedding table), else a buffer of its own the split tensors were
    copied into once (packed weights made dense, fused ones split) — and `storage`, a pool of the
    weights layout laid over its whole blocks (`direct_bytes` of them; None when it has none): parts
    within them are sent from there, the rest (less than a block) staged. Read-only."""

    def __init__(self, tensors: Tensors, total: int) -> None:
        parts = [tensor for _, tensor in tensors]
        view = _back_to_back(parts, total)
        if view is None:  # the transform's output, copied once into the piece's wire order
            view = _buffer(total, parts[0].device)
            at = 0
            for part in parts:
                size = part.numel() * part.element_size()
                view[at : at + size].copy_(part.reshape(-1).view(torch.uint8))
                at += size
            settle(view.device)  # on a GPU: copied before the transport reads it
        self.bytes = view
        blocks = total // BLOCK_BYTES
        self.direct_bytes = blocks * BLOCK_BYTES
        self.storage = (
            PoolStorage(WEIGHTS_LAYOUT, blocks, device=view.device, over={BUFFER: view[: self.direct_bytes]})
            if blocks
            else None
        )


def _back_to_back(parts: list[torch.Tensor], total: int) -> torch.Tensor | None:
    """The bytes of `parts` as one uint8 view of their storage when they lie there contiguous, back to
    back, in order; None otherwise."""
    first = parts[0]
    at = first.data_ptr()
    for part in parts:
        if not part.is_contiguous() or part.data_ptr() != at or part.device != first.device:
            return None
        if part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        at += part.numel() * part.element_size()
    head = first.reshape(-1).view(torch.uint8)
    return torch.as_strided(head, (total,), (1,), head.storage_offset())  # within the storage: checked


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return (
        landing_buffer(nbytes)
        if device.type == "cpu"
        else torch.empty(nbytes, dtype=torch.uint8, device=device)
    )


async def _split(model: Model, piece: WeightPiece) -> Wire:
    """The piece's wire bytes (`Wire`), made once per piece (a small per-model cache; the first part of
    a piece makes the next one's ahead, so a copy finds it made). A request that finds it under way
    waits for it."""
    cache = _split_cache.setdefault(model, OrderedDict())
    entry = cache.get(piece)
    if entry is not None:
        cache.move_to_end(piece)
        await entry.done.wait()
        if entry.wire is not None:
            return entry.wire
    entry = cache[piece] = _Split()
    while len(cache) > CACHED_PIECES:
        cache.popitem(last=False)
    try:
        entry.wire = await trio.to_thread.run_sync(_wire, model, piece)
    finally:
        entry.done.set()
    return entry.wire


def _wire(model: Model, piece: WeightPiece) -> Wire:
    table = tensor_table(model.config, piece)
    return Wire(model_piece(model, piece), table[-1].offset + table[-1].nbytes)

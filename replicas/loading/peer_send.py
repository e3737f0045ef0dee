"""The sending side of a peer weight copy (blitz): a replica that holds the weights serves a piece.

A loading replica sends `SendWeights(piece, byte_offset, ...)` to a replica holding a fully loaded
model — or, in a multicast chain, to the replica loading just before it, once that one holds the piece
(`holds`); the actor's dispatch calls `send_weights`, which checks the request at once (a refusal is the
command's outcome) and starts a helper task in the replica's nursery. The helper opens the transfer's
sending session first (so the receiver's grant finds it, and any failure reaches the receiver as an
abort), takes the piece's checkpoint tensors from the model (`replicas.loading.split`: fused weights
split back, packed ones made dense), allocates staging blocks (a bounded wait when other copies hold
them), stages bytes `[byte_offset, byte_offset + n)` of the piece — `n` as many as half the staging pool
holds (`part_bytes`: two parts are staged at once when the receiver asks ahead), at most the rest of the
piece — and sends them; the header (`messages.weights.WeightsHeader`) carries the
piece's tensor table. The receiver asks for the next part as soon as the first round of this one has landed.

The helper keeps a reference to the model it sends from, so a replica scaled down meanwhile still
finishes the part. The split tensors of the last pieces asked for are cached per model (a piece of
several parts is split once), and a piece's first part starts splitting the next piece in a worker
thread, so the unpacking of packed weights runs while the previous piece is on the wire.

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
from replicas.loading.staging import ROW_BYTES, WeightStaging, rows_for, stage
from replicas.model.llama import Model
from replicas.ports import Actor
from transport.config import TransferConfig
from transport.endpoint import TransferEndpoint
from transport.errors import TransferError
from transport.memory.blocks import AllocationTimeout

_log = structlog.get_logger("replicas.loading")
THREAD_BYTES: Final = 1 << 20  # staging copies at least this large run in a worker thread
CACHED_PIECES: Final = 3  # the piece being sent, the next one (split ahead), one spare
Tensors = list[tuple[str, torch.Tensor]]


@final
class _Split:
    """A piece's checkpoint tensors, split in a worker thread; `done` is set when `tensors` is (None: the
    split failed or was cancelled, a later request splits again)."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.tensors: Tensors | None = None


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
    nbytes = min(total - command.byte_offset, part_bytes(staging))
    rows = rows_for(nbytes)
    header = encode_header(
        WeightsHeader(
            model=model.name,
            piece=command.piece,
            piece_bytes=total,
            offset=command.byte_offset,
            nbytes=nbytes,
            tensors=table,
        )
    )
    owner = f"weights:{command.transfer_id}"
    try:
        async with endpoint.open_send(command.transfer_id, peer=command.destination_endpoint) as session:
            session.announce_total(rows, header)
            tensors = await _split(model, command.piece)
            deadline = trio.current_time() + config.pressure_timeout
            ids = await staging.pool.allocate_wait(staging.pool.blocks_for(rows), owner, deadline=deadline)
            try:
                parts = [tensor for _, tensor in tensors]
                if nbytes >= THREAD_BYTES:
                    await trio.to_thread.run_sync(
                        stage, staging.storage, ids, parts, command.byte_offset, nbytes
                    )
                else:
                    stage(staging.storage, ids, parts, command.byte_offset, nbytes)
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


async def _split(model: Model, piece: WeightPiece) -> Tensors:
    """The piece's checkpoint tensors, split once per piece (a small per-model cache; the first part of a
    piece splits the next one ahead, so a copy finds it split). A request that finds the split under
    way waits for it."""
    cache = _split_cache.setdefault(model, OrderedDict())
    entry = cache.get(piece)
    if entry is not None:
        cache.move_to_end(piece)
        await entry.done.wait()
        if entry.tensors is not None:
            return entry.tensors
    entry = cache[piece] = _Split()
    while len(cache) > CACHED_PIECES:
        cache.popitem(last=False)
    try:
        entry.tensors = await trio.to_thread.run_sync(model_piece, model, piece)
    finally:
        entry.done.set()
    return entry.tensors

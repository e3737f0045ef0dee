"""The receiving side of a peer weight copy (blitz): a loading replica pulls pieces from a replica that
holds them, over the replicas' transport links.

`PeerSource.fetch(piece)` moves one piece as one or more *parts* — up to 64 MiB of the piece's whole
blocks, or its last partial block (`replicas.loading.peer_send`): it takes the link from its own
`{replica}/weights` endpoint to the peer's (`Fabric.link`, made once per pair), asks the peer with
`SendWeights(piece, byte_offset)` for the first part and, as soon as a part's first round landed (its
header tells where it ends), for the next one, so the sender prepares a part while the last one is on
the wire.

Where the bytes land: the piece's own buffer. Over inproc, tcp and ucx links the buffer — rounded up to
whole staging blocks (`BLOCK_BYTES`; the tail is never read, and on the CPU never touched but for the
last row's padding; a piece under half its rounded size, a final norm say, is cloned out of it once
landed, a copy of a few KiB) — is laid out as a pool of the weights layout (`PoolStorage(over=...)`) and each
part is received straight into its rows (`TransferEndpoint.receive(into=...)`, a borrowed landing from
the part's first row): no staging block of this replica, no copy-out. Rounds, deadlines, aborts and
REQUEST_MORE_CACHE are the transport's as for any borrowed landing; a failed receive returns only after
its fence, so nothing writes into the buffer afterwards. Over cuda-ipc (the sender writes into this
replica's shared staging pool) each part is received in the consumed mode instead: staging blocks are
granted, each landed round is copied out into the piece's buffer and the blocks are granted again.

Either way the header is checked on every round against the tensor table this side computes from its
own config (names, dtype, shapes, offsets, the part's place in the piece), and a piece is handed on only
once every part landed and checked: a piece whose part failed is dropped whole (the copy goes on from
that piece with the next source under `auto`), never half-installed. Each landed part's bytes are
counted on the fabric as `weights` from the peer to this replica. The piece's tensors are then views of
the buffer, in the serving dtype on this replica's device (`_cut`): the weights are served from where
they landed.

Failures — the peer stopped or refused, the link dropped, a deadline passed, a header disagreed — raise
`SourceFailed("peer", piece, reason)`. Cancellation: the receive aborts (the transport returns or
quarantines its blocks, or waits for the fence of a borrowed landing) and `Cancelled` propagates.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Final, final

import torch
import trio

from messages.commands import SendWeights
from messages.log.scaling import WeightsSourceName
from messages.peer_codec import PeerCodecError, decode_header
from messages.weights import WeightPiece, WeightsHeader, WeightTensor
from replicas.fabric import Fabric, UnknownEndpoint
from replicas.inbox import CommandRefused, new_command_id
from replicas.loading.pieces import tensor_table
from replicas.loading.sources import SourceFailed
from replicas.loading.staging import (
    BLOCK_BYTES,
    BUFFER,
    ROW_BYTES,
    WEIGHTS_LAYOUT,
    copy_out,
    rows_for,
    weights_endpoint_name,
)
from replicas.model.config import ModelConfig
from replicas.ports import NodeSignal, PeerReplica
from replicas.states import ReplicaState
from transport.endpoint import TransferEndpoint
from transport.errors import HandshakeRefused, LinkError, TransferError
from transport.memory.host_memory import landing_buffer
from transport.memory.storage import PoolStorage, torch_dtype
from transport.protocol.landing import LandedRound

THREAD_BYTES: Final = 1 << 20  # rounds at least this large are copied out in a worker thread
_transfer_numbers = itertools.count(1)


@final
class WeightsMismatch(Exception):
    """A weight transfer's header or length disagrees with what this replica expects (names both)."""


@final
class PeerGone(Exception):
    """The peer replica stopped running."""


@final
class PartLanding:
    """The `consume` step of one part: checks each round's header and, unless the round landed in
    `buffer` itself (`in_place`), copies its bytes there."""

    def __init__(
        self,
        buffer: torch.Tensor,
        model: str,
        piece: WeightPiece,
        table: tuple[WeightTensor, ...],
        offset: int,
        *,
        in_place: bool = False,
    ) -> None:
        self.buffer, self.model, self.piece, self.table, self.offset = buffer, model, piece, table, offset
        self.in_place = in_place
        self.header: WeightsHeader | None = None
        self._raw: bytes | None = None
        self.rows = 0
        self.copied = 0
        # Called once, when the part's header first landed and checked (the receiver asks ahead).
        self.on_header: Callable[[WeightsHeader], Awaitable[None]] | None = None

    async def consume(self, landed: LandedRound) -> None:
        first = self.header is None
        header = self._check(landed)
        if first and self.on_header is not None:
            await self.on_header(header)
        if landed.offset != self.rows:
            raise WeightsMismatch(
                f"{self.piece.label}: a round starts at row {landed.offset}, {self.rows} landed"
            )
        start = landed.offset * ROW_BYTES
        if self.in_place:  # the bytes are in the piece's buffer already: count them
            self.copied += min(landed.tokens * ROW_BYTES, header.nbytes - start)
            self.rows += landed.tokens
            return
        args = (landed.storage, landed.blocks, landed.landing_offset, landed.tokens)
        rest = (self.buffer, header.offset + start, header.nbytes - start)
        if landed.tokens * ROW_BYTES >= THREAD_BYTES:
            self.copied += await trio.to_thread.run_sync(copy_out, *args, *rest)
        else:
            self.copied += copy_out(*args, *rest)
        self.rows += landed.tokens

    def _check(self, landed: LandedRound) -> WeightsHeader:
        raw = bytes(landed.header)
        if self.header is not None and raw == self._raw:
            return self.header
        if self.header is not None:
            raise WeightsMismatch(f"{self.piece.label}: the header changed between rounds")
        try:
            header = decode_header(landed.header, WeightsHeader)
        except PeerCodecError as exc:
            raise WeightsMismatch(f"{self.piece.label}: {exc}") from None
        problems = []
        if header.model != self.model:
            problems.append(f"model {header.model!r}, expected {self.model!r}")
        if header.piece != self.piece:
            problems.append(f"piece {header.piece.label}, expected {self.piece.label}")
        if header.tensors != self.table:
            problems.append(f"tensor table {_describe(header.tensors)}, expected {_describe(self.table)}")
        total = self.buffer.numel()
        if header.piece_bytes != total or header.offset != self.offset:
            problems.append(
                f"bytes from {header.offset} of {header.piece_bytes}, expected from {self.offset} of {total}"
            )
        if not 0 < header.nbytes <= total - self.offset or landed.total_tokens != rows_for(header.nbytes):
            problems.append(f"a part of {header.nbytes} bytes in {landed.total_tokens} rows")
        if problems:
            raise WeightsMismatch(f"weights header of {self.piece.label}: " + "; ".join(problems))
        self.header, self._raw = header, raw
        return header

    def finish(self) -> int:
        """The part's bytes, once all landed (raises `WeightsMismatch` otherwise)."""
        if self.header is None or self.copied != self.header.nbytes:
            expected = None if self.header is None else self.header.nbytes
            raise WeightsMismatch(f"{self.piece.label}: {self.copied} of {expected} bytes landed")
        return self.copied


def _describe(table: tuple[WeightTensor, ...]) -> str:
    return ", ".join(f"{t.name} {t.dtype}{list(t.shape)}@{t.offset}" for t in table[:3]) + (
        f", … ({len(table)} tensors)" if len(table) > 3 else ""
    )


PEER_FAILURES = (
    TransferError,
    LinkError,
    HandshakeRefused,
    UnknownEndpoint,
    CommandRefused,
    WeightsMismatch,
    PeerGone,
)


@final
class PeerSource:
    """Pieces from replica `peer` into replica `replica`, landing at its weights `endpoint` (see the
    module docstring); `timeout`: how long the peer may take to start a part."""

    name: WeightsSourceName = "peer"

    def __init__(
        self,
        replica: str,
        peer: PeerReplica,
        *,
        endpoint: TransferEndpoint,
        fabric: Fabric,
        config: ModelConfig,
        device: torch.device,
        model_name: str,
        timeout: float,
        changes: NodeSignal | None = None,
    ) -> None:
        self.replica = replica
        self.peer = peer
        self._changes = changes  # given: the peer is loading too (a chain); wait for each piece there
        self._endpoint = endpoint
        self._fabric = fabric
        self.config = config
        self.device = device
        self.model_name = model_name
        self._timeout = timeout
        self.bytes = 0  # landed and counted on the fabric

    async def fetch(self, piece: WeightPiece) -> dict[str, torch.Tensor]:
        try:
            return await self._fetch(piece)
        except PEER_FAILURES as exc:
            raise SourceFailed("peer", piece, str(exc)) from exc

    async def _fetch(self, piece: WeightPiece) -> dict[str, torch.Tensor]:
        endpoint = self._endpoint
        table = tensor_table(self.config, piece)
        total = table[-1].offset + table[-1].nbytes
        if self._changes is not None:
            await self._landed_there(piece, self._changes)
        link = await self._fabric.link(endpoint, weights_endpoint_name(self.peer.name))
        in_place = link.lands_in_named_storage
        blocks = -(-total // BLOCK_BYTES)
        whole = _piece_buffer(blocks * BLOCK_BYTES if in_place else total, self.device)
        buffer = whole[:total]
        into = (
            PoolStorage(WEIGHTS_LAYOUT, blocks, device=self.device, over={BUFFER: whole})
            if in_place
            else None
        )
        asked = await self._ask(piece, 0)
        offset = 0
        while offset < total:
            transfer_id = asked
            landing = PartLanding(buffer, self.model_name, piece, table, offset, in_place=in_place)

            async def ahead(header: WeightsHeader) -> None:
                # The sender stages the next part while this one lands (pipelined parts).
                nonlocal asked
                following = header.offset + header.nbytes
                if following < total:
                    if in_place and following % ROW_BYTES:
                        raise WeightsMismatch(
                            f"{piece.label}: a part ends at byte {following}, inside a row of {ROW_BYTES} bytes"
                        )
                    asked = await self._ask(piece, following)

            landing.on_header = ahead
            if into is None:
                await endpoint.receive(transfer_id, peer=link, consume=landing.consume)
            else:
                row = offset // ROW_BYTES  # parts start at whole rows (checked above for each next part)
                await endpoint.receive(
                    transfer_id,
                    peer=link,
                    consume=landing.consume,
                    blocks=range(blocks),
                    landing_offset=row,
                    into=into,
                )
            nbytes = landing.finish()
            self._fabric.count_bytes(self.peer.name, self.replica, "weights", nbytes)
            self.bytes += nbytes
            offset += nbytes
            if offset < total and asked == transfer_id:
                raise WeightsMismatch(f"{piece.label}: the next part from byte {offset} was not asked for")
        if whole.numel() > 2 * total:  # a piece smaller than a block: not held in a block's worth of memory
            buffer = buffer.clone()
        return _cut(buffer, table)

    async def _ask(self, piece: WeightPiece, offset: int) -> str:
        """Ask the peer to send the part of `piece` from byte `offset`; the transfer's id."""
        # Looked at in the step that posts the command (a local `ask` posts before it checkpoints): a
        # peer that stops after it refuses what it was sent (`replica_failed`) instead of timing out.
        if not self.peer.snapshot().running:
            raise PeerGone(f"{self.peer.name} is not running (state {self.peer.state.value})")
        transfer_id = f"{self.replica}/weights/{next(_transfer_numbers)}"
        command = SendWeights(
            command_id=new_command_id(),
            transfer_id=transfer_id,
            piece=piece,
            destination_endpoint=self._endpoint.name,
            byte_offset=offset,
        )
        await self.peer.ask(command, timeout=self._timeout)
        return transfer_id

    async def _landed_there(self, piece: WeightPiece, changes: NodeSignal) -> None:
        """Until the peer — loading too, before this replica in a chain — holds `piece`. Raises
        `PeerGone` when it stopped or failed, or landed nothing for `timeout` seconds. It wakes on the
        node's change signal, which a loading replica notifies at each piece it lands."""
        peer = self.peer

        def holds() -> bool:
            snap = peer.snapshot()
            if snap.serves_weights:
                return True
            if not snap.running or snap.state is ReplicaState.INACTIVE:
                raise PeerGone(f"{peer.name} stopped loading (state {snap.state.value}) before {piece.label}")
            if piece.kind == "embeddings":
                return snap.weights_bytes_loaded > 0
            if piece.kind == "layer":
                assert piece.layer is not None
                return (snap.loaded_layers or 0) > piece.layer
            return False  # the final norm and head: once it holds the whole model

        with trio.move_on_after(self._timeout):
            while not holds():
                event = trio.Event()
                stop = changes.watch(event.set)
                try:
                    await event.wait()
                finally:
                    stop()
            return
        if not holds():
            raise PeerGone(f"{peer.name} did not land {piece.label} within {self._timeout:g} s")

    async def aclose(self) -> None:
        return None


def _piece_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A piece's buffer of `nbytes` on `device`: on the CPU on huge pages (`landing_buffer`), so its first
    writes take a fault per 2 MiB instead of per 4 KiB."""
    if device.type == "cpu":
        return landing_buffer(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _cut(buffer: torch.Tensor, table: tuple[WeightTensor, ...]) -> dict[str, torch.Tensor]:
    """The tensors of a piece's bytes, as views of the buffer: no copy. The builder fuses q, k, v (and
    gate, up), which lie back to back in it, as they lie (`replicas.model.layers.fuse_layer`), packs the
    large ones into storage of their own, and clones the small ones out of a buffer left mostly unused,
    so the buffer lives on only as the weights it holds."""
    return {
        t.name: buffer[t.offset : t.offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape) for t in table
    }

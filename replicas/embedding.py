"""Image embeddings through the resumable transfer: the encode side's rows, the language side's assembly.

Both halves are plain functions and objects over a `BlockPool`, a `PoolStorage` and a transfer session,
with no replica in sight, so the replicas, the tests and the `epd` benchmark run the same code.

- **Encode side** (`send_embeddings`): announce the true length and the header (the image grids) as
  soon as the encoder is done, allocate exactly that many rows in the encode replica's own embedding
  pool (a bounded wait under memory pressure), write them, send them as the grants come, and free the
  blocks however the transfer ends.
- **Language side** (`EmbeddingAssembler`): the receiver's `consume` step. The receiver granted the
  default allocation before anyone knew the length; each landed round is copied out of the landing
  blocks into one tensor per buffer (then the transport frees or re-grants those blocks), so any number
  of rounds works with a pool smaller than one request. `finish` reads the header from the last round,
  lays out the prompt with `layout_prompt` and checks that what landed agrees with it. The language
  side never computes an embedding length itself: the length is the sender's `total_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, final

import msgspec
import numpy as np
import torch
import trio

from messages.embedding import EmbeddingHeader, GridShape
from messages.peer_codec import PeerCodecError, decode_header, encode_header
from messages.transfer import TransferReport
from replicas.model import ImageEmbedding, ImageGrid, InvalidBatchError, embedding_rows, layout_prompt
from replicas.model.vision import image_positions
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage
from transport.protocol.landing import LandedRound
from transport.protocol.sender import SendSession

THREAD_BYTES: Final = 4 * 1024 * 1024  # copies at least this large run in a worker thread


@final
class EmbeddingMismatch(Exception):
    """What landed cannot be the request's input: a bad header, rows that disagree with the grids, a
    length over the context. The message names the values."""


@final
class PromptTooLong(Exception):
    """The sender announced more embedding rows than the context holds (the request's `bad_request`)."""


@final
class EncodePoolTooSmall(Exception):
    """The encode replica's embedding pool can never hold this request's rows."""


def embedding_header(request_id: str, grids: Sequence[ImageGrid]) -> msgspec.Raw:
    """The transfer header (opaque to the transport) for a request's image grids."""
    shapes = [GridShape(t=grid.t, h=grid.h, w=grid.w) for grid in grids]
    return encode_header(EmbeddingHeader(request_id=request_id, grids=shapes))


def read_header(raw: msgspec.Raw) -> EmbeddingHeader:
    try:
        return decode_header(raw, EmbeddingHeader)
    except PeerCodecError as exc:
        raise EmbeddingMismatch(f"embedding transfer header: {exc}") from None


# ---------------------------------------------------------------------------------------------- encode side
async def send_embeddings(
    session: SendSession,
    pool: BlockPool,
    storage: PoolStorage,
    embeddings: Sequence[ImageEmbedding],
    *,
    request_id: str,
    owner: str,
    pressure_timeout: float,
    on_sending: Callable[[], None] | None = None,
) -> TransferReport:
    """Send `embeddings` (one request's images, in prompt order) through `session`.

    Raises `EncodePoolTooSmall` when the pool can never hold them, `AllocationTimeout` when no room
    frees up within `pressure_timeout`, `TransferFailed` / `TransferTimeout` from the transfer.
    Cancellation: the blocks are freed on every exit path (no write out of them is in flight by then:
    `send` returns or raises only after its last write)."""
    total = sum(embedding.grid.rows for embedding in embeddings)
    header = embedding_header(request_id, [embedding.grid for embedding in embeddings])
    session.announce_total(total, header)  # the receiver can open its window while we allocate
    needed = pool.blocks_for(total)
    if needed > pool.num_blocks:
        raise EncodePoolTooSmall(
            f"{total} embedding rows need {needed} blocks of {pool.block_size}; the encode pool "
            f"{pool.name!r} has {pool.num_blocks} (raise --embedding-pool-blocks)"
        )
    ids = await pool.allocate_wait(needed, owner, deadline=trio.current_time() + pressure_timeout)
    try:
        nbytes = total * storage.layout.bytes_per_token
        if nbytes >= THREAD_BYTES:
            await trio.to_thread.run_sync(_write_rows, storage, ids, embeddings)
        else:
            _write_rows(storage, ids, embeddings)
        if on_sending is not None:
            on_sending()
        return await session.send(ids, total_tokens=total, header=header)
    finally:
        pool.free(ids, owner)


def _landing_runs(
    blocks: Sequence[int], block_size: int, landing_offset: int, count: int
) -> list[tuple[int, int]]:
    """`(flat row, rows)` runs of tokens `[landing_offset, landing_offset + count)` of the allocation
    `blocks`, consecutive blocks merged: one Python step per block, never per token."""
    runs: list[tuple[int, int]] = []
    token, end = landing_offset, landing_offset + count
    while token < end:
        index, row = divmod(token, block_size)
        rows = min(block_size - row, end - token)
        flat = blocks[index] * block_size + row
        if runs and runs[-1][0] + runs[-1][1] == flat:
            runs[-1] = (runs[-1][0], runs[-1][1] + rows)
        else:
            runs.append((flat, rows))
        token += rows
    return runs


def _landing_rows(blocks: Sequence[int], block_size: int, landing_offset: int, count: int) -> np.ndarray:
    """Flat storage rows of tokens `[landing_offset, landing_offset + count)` of the allocation `blocks`
    (token t lives in block `blocks[t // block_size]`, row `t % block_size`). NumPy: a round's index costs a
    few microseconds, not the dozen small torch ops that dominate a small round's copy."""
    tokens = np.arange(landing_offset, landing_offset + count, dtype=np.int64)
    ids = np.asarray(blocks, dtype=np.int64)
    return ids[tokens // block_size] * block_size + tokens % block_size


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _write_rows(storage: PoolStorage, ids: list[int], embeddings: Sequence[ImageEmbedding]) -> None:
    start = 0
    for embedding in embeddings:
        storage.scatter(ids, start, embedding_rows(embedding))
        start += embedding.grid.rows


# ---------------------------------------------------------------------------------------------- language side
@final
@dataclass(frozen=True, slots=True)
class EmbeddedPrompt:
    """A request's input once its embeddings landed: what `PrefillSequence` takes, and the grids."""

    token_ids: list[int]
    positions: torch.Tensor
    next_position: int
    embeds: torch.Tensor
    embed_indices: torch.Tensor
    grids: list[ImageGrid]


@final
class EmbeddingAssembler:
    """The receiver's `consume` step for one request, then its prompt layout (module docstring).

    `max_tokens` bounds the rows a sender may announce (the context length): the rows are assembled in
    host memory sized by the sender's total. `on_round(landed, seconds)` is told of each consumed round.
    Not thread-safe; the copy of a large round runs in a worker thread that is never abandoned."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        image_token_id: int,
        *,
        max_tokens: int,
        on_round: Callable[[LandedRound], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.image_token_id = image_token_id
        self.max_tokens = max_tokens
        self.on_round = on_round
        self.rows: dict[str, torch.Tensor] = {}
        self.total: int | None = None
        self.filled = 0
        self.rounds = 0
        self.header: msgspec.Raw | None = None
        self.first_round_at: float | None = None
        self._bytes: dict[str, memoryview] = {}  # CPU pools: the rows' bytes, per buffer
        self._row_bytes: dict[str, int] = {}
        self._bytes_per_token = 0

    async def consume(self, landed: LandedRound) -> None:
        """Copy one landed round into place (the transport frees its blocks afterwards)."""
        if self.total is None:
            self._start(landed)
        elif landed.total_tokens != self.total:
            raise EmbeddingMismatch(
                f"request {self.request_id}: round {landed.round} says {landed.total_tokens} rows, "
                f"earlier rounds said {self.total}"
            )
        if landed.offset != self.filled:
            raise EmbeddingMismatch(
                f"request {self.request_id}: round {landed.round} starts at row {landed.offset}, "
                f"{self.filled} rows had landed"
            )
        if self.first_round_at is None:
            self.first_round_at = time.time()
        if landed.tokens:
            if landed.tokens * self._bytes_per_token >= THREAD_BYTES:
                await trio.to_thread.run_sync(self._copy, landed)
            elif self._bytes:
                self._copy_bytes(landed)
            else:
                self._copy(landed)
        self.filled += landed.tokens
        self.rounds += landed.tokens > 0
        self.header = landed.header
        if self.on_round is not None:
            self.on_round(landed)

    def _start(self, landed: LandedRound) -> None:
        total = landed.total_tokens
        if total > self.max_tokens:
            raise PromptTooLong(
                f"request {self.request_id}: the images give {total} embedding rows, more than the "
                f"context of {self.max_tokens} tokens"
            )
        self.total = total
        storage = landed.storage
        self._bytes_per_token = storage.layout.bytes_per_token
        for name in landed.buffers:
            flat = storage.flat(name)
            self.rows[name] = torch.empty((total, *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
        if storage.device.type == "cpu":
            self._row_bytes = {name: storage.row_bytes[name] for name in self.rows}
            self._bytes = {name: _tensor_bytes(rows) for name, rows in self.rows.items()}

    def _copy_bytes(self, landed: LandedRound) -> None:
        """A round on the event loop, CPU pools: one `memcpy` per run of consecutive landing blocks
        (a round's fixed cost is a few microseconds, not an index build and a torch call per buffer).
        Large rounds go to `_copy` in a worker thread instead: memoryview copies hold the GIL."""
        storage = landed.storage
        runs = _landing_runs(landed.blocks, storage.block_size, landed.landing_offset, landed.tokens)
        for name, target in self._bytes.items():
            source, row_bytes = storage.buffer_bytes(name), self._row_bytes[name]
            at = landed.offset * row_bytes
            for row, rows in runs:
                size = rows * row_bytes
                target[at : at + size] = source[row * row_bytes : row * row_bytes + size]
                at += size

    def _copy(self, landed: LandedRound) -> None:
        storage, start, count = landed.storage, landed.offset, landed.tokens
        rows = _landing_rows(landed.blocks, storage.block_size, landed.landing_offset, count)
        index = torch.from_numpy(rows).to(storage.device)
        for name, target in self.rows.items():
            torch.index_select(storage.flat(name), 0, index, out=target[start : start + count])

    def finish(self) -> EmbeddedPrompt:
        """The request's input: prompt laid out with the header's grids, rows checked against them.
        Raises `EmbeddingMismatch` naming what disagrees."""
        if self.total is None or self.header is None or self.filled != self.total:
            raise EmbeddingMismatch(
                f"request {self.request_id}: {self.filled} of {self.total} embedding rows landed"
            )
        header = read_header(self.header)
        if header.request_id != self.request_id:
            raise EmbeddingMismatch(
                f"request {self.request_id}: the embedding header is for request {header.request_id}"
            )
        grids = [ImageGrid(t=shape.t, h=shape.h, w=shape.w) for shape in header.grids]
        rows = sum(grid.rows for grid in grids)
        if rows != self.total:
            raise EmbeddingMismatch(
                f"request {self.request_id}: the header's {len(grids)} grids hold {rows} rows, "
                f"the transfer carried {self.total}"
            )
        try:
            layout = layout_prompt(self.prompt_ids, grids, self.image_token_id)
        except InvalidBatchError as exc:
            raise EmbeddingMismatch(f"request {self.request_id}: {exc}") from None
        self._check_rows(grids)
        indices = [torch.arange(start, start + count) for start, count in layout.image_spans]
        return EmbeddedPrompt(
            token_ids=layout.token_ids,
            positions=layout.positions,
            next_position=layout.next_position,
            embeds=self.rows["embeds"],
            embed_indices=torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64),
            grids=grids,
        )

    def _check_rows(self, grids: Sequence[ImageGrid]) -> None:
        """The landed `token_ids` are all the image token and the landed `positions` are each image's
        grid coordinates, image after image."""
        tokens, positions = self.rows.get("token_ids"), self.rows.get("positions")
        if tokens is None or positions is None or "embeds" not in self.rows:
            raise EmbeddingMismatch(
                f"request {self.request_id}: landed buffers {sorted(self.rows)}; "
                "expected embeds, token_ids and positions"
            )
        start = 0
        for index, grid in enumerate(grids):
            end = start + grid.rows
            if not bool((tokens[start:end] == self.image_token_id).all()):
                raise EmbeddingMismatch(
                    f"request {self.request_id}: image {index}: landed token ids are not all the image "
                    f"token {self.image_token_id}"
                )
            expected = image_positions(grid).to(positions.device)
            if not torch.equal(positions[start:end], expected):
                raise EmbeddingMismatch(
                    f"request {self.request_id}: image {index}: landed positions disagree with its grid "
                    f"t={grid.t} h={grid.h} w={grid.w}"
                )
            start = end

"""A replica's weight staging pool, behind its third transfer endpoint `{replica}/weights`.

Weights cross the transfer links as plain bytes: the pool has one buffer, `bytes` (uint8), a row of
`ROW_BYTES` per "token" and `BLOCK_ROWS` rows per block (1 MiB); `ReplicaSettings.weights_pool_blocks`
blocks of it (4 MiB by default) on the replica's device. A sending replica stages a piece's bytes into
its blocks (`stage`) and sends them with the resumable transfer; a receiving replica lands rounds in its
own blocks and copies each out (`copy_out`), re-granting the blocks, so a part larger than its pool still
arrives (REQUEST_MORE_CACHE rounds). The last row of a part is padded; the padding is never read.

Every copy is a torch `copy_` between views, so the same code serves CPU and CUDA pools; on CUDA each
function waits for its copies before it returns (`settle`). Synchronous: callers decide where they run
(a large copy in a worker thread, never abandoned) and so what a cancellation waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, final

import torch

from messages.layout import BufferSpec, PoolLayout
from transport.endpoint import TransferEndpoint
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage

ROW_BYTES: Final = 4096
BLOCK_ROWS: Final = 256
BLOCK_BYTES: Final = ROW_BYTES * BLOCK_ROWS
BUFFER: Final = "bytes"
WEIGHTS_LAYOUT: Final = PoolLayout(
    block_size=BLOCK_ROWS, buffers=(BufferSpec(name=BUFFER, shape=(ROW_BYTES,), dtype="uint8"),)
)


def weights_endpoint_name(replica: str) -> str:
    return f"{replica}/weights"


def rows_for(nbytes: int) -> int:
    return -(-nbytes // ROW_BYTES)


@final
class WeightStaging:
    """The staging pool of replica `name` (see the module docstring); `endpoint` is set while it runs."""

    def __init__(self, name: str, blocks: int, device: str | torch.device) -> None:
        self.endpoint_name = weights_endpoint_name(name)
        self.pool = BlockPool(blocks, BLOCK_ROWS, name=self.endpoint_name)
        self.storage = PoolStorage(WEIGHTS_LAYOUT, blocks, device=device)
        self.endpoint: TransferEndpoint | None = None

    @property
    def capacity_bytes(self) -> int:
        return self.pool.num_blocks * BLOCK_BYTES


def _block_bytes(storage: PoolStorage, block: int) -> torch.Tensor:
    return storage.tensors[BUFFER][block].view(-1)


def stage(
    storage: PoolStorage, blocks: Sequence[int], tensors: Sequence[torch.Tensor], start: int, nbytes: int
) -> None:
    """Write bytes `[start, start + nbytes)` of `tensors` laid back to back (each contiguous) into the
    allocation `blocks` from its first byte on. Blocking for a large part: run it in a worker thread."""
    if nbytes > len(blocks) * BLOCK_BYTES:
        raise ValueError(f"{nbytes} bytes do not fit in {len(blocks)} staging blocks")
    at, written = 0, 0  # `at`: the first byte of the current tensor in the piece
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        lo, hi = max(start, at), min(start + nbytes, at + size)
        if lo < hi:
            source = tensor.reshape(-1).view(torch.uint8)[lo - at : hi - at]
            _write(storage, blocks, written, source)
            written += hi - lo
        at += size
    if written != nbytes:
        raise ValueError(f"bytes [{start}, {start + nbytes}) lie outside the piece's {at} bytes")
    settle(storage.device)


def _write(storage: PoolStorage, blocks: Sequence[int], offset: int, source: torch.Tensor) -> None:
    """Copy `source` (uint8) to byte `offset` of the allocation `blocks`, block by block."""
    done = 0
    while done < source.numel():
        index, within = divmod(offset + done, BLOCK_BYTES)
        count = min(BLOCK_BYTES - within, source.numel() - done)
        _block_bytes(storage, blocks[index])[within : within + count].copy_(source[done : done + count])
        done += count


def copy_out(
    storage: PoolStorage,
    blocks: Sequence[int],
    landing_offset: int,
    rows: int,
    target: torch.Tensor,
    target_offset: int,
    limit: int,
) -> int:
    """Copy `rows` landed rows, which start at row `landing_offset` of the allocation `blocks`, into the
    uint8 tensor `target` from byte `target_offset` on, at most `limit` bytes (the part's end: the last
    row's padding is dropped). Returns the bytes copied."""
    copied, row = 0, landing_offset
    end = landing_offset + rows
    while row < end and copied < limit:
        index, within = divmod(row, BLOCK_ROWS)
        count = min(BLOCK_ROWS - within, end - row)
        size = min(count * ROW_BYTES, limit - copied)
        source = _block_bytes(storage, blocks[index])[within * ROW_BYTES : within * ROW_BYTES + size]
        target[target_offset + copied : target_offset + copied + size].copy_(source)
        copied += size
        row += count
    settle(storage.device)
    return copied


def settle(device: torch.device) -> None:
    """On CUDA, wait for this thread's copies to finish: the transport reads staged blocks, and grants
    consumed ones again, right after these functions return."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()

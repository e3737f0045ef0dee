"""What a UCX link sends after a bulk descriptor: the messages carrying one direct frame's or one bundle's
bytes, chosen by where the sender's pool is (`transport.links.ucx.link` posts them on the bulk tag, in order,
right after the descriptor).

- a bundle gathered on the GPU already (`transport.bulk.device_bundles`): one message from that buffer;
- a bundle of a host pool: one message gathered by UCX from the rows (an I/O vector, `bundle_vector`);
- a bundle of any other pool: packed into a host chunk (`transport.bulk.staging`), one message from it;
- a direct frame: one message per piece, straight from the rows (host or GPU memory).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from transport.bulk.device_bundles import message_buffer
from transport.bulk.frame_plan import Frame
from transport.bulk.staging import HostChunk, HostChunks, pack_bundle
from transport.bulk.write import BulkWrite
from transport.links.ucx.frames import flipped_copy, payload_rows
from transport.links.ucx.landing import ZEROS_ADDRESS, bundle_vector

# One message: its body, and what owns the memory an I/O-vector body points into (None for a buffer).
Payload = tuple[object, object]
Chunk = HostChunk | torch.Tensor  # a bundle's bytes, in host memory or on the pool's GPU


def frame_payloads(
    bulk: BulkWrite, frames: Sequence[Frame], corrupt: bool, gathered: torch.Tensor | None, chunks: HostChunks
) -> tuple[list[Payload], Chunk | None, int]:
    """The messages of `frames` (a direct frame alone, or a bundle of packed ones; `gathered`: that
    bundle on the device), the chunk they read until sent (None: the rows themselves), and their bytes.
    `corrupt` flips the first byte sent, never in the sender's rows (a device bundle came flipped)."""
    frame = frames[0]
    if gathered is not None:
        return [(message_buffer(gathered), None)], gathered, gathered.numel()
    if frame.packed and not corrupt and bulk.source.device.type == "cpu":
        parts = [(f.name, f.row_bytes, f.sources(), f.length) for f in frames]
        vector = bundle_vector(bulk.source, parts, ZEROS_ADDRESS)
        return [(vector, bulk.source)], None, sum(vector[1::2])
    if frame.packed:
        chunk, length = pack_bundle(bulk.source, frames, chunks)
        if corrupt:
            chunk.view[0] ^= 0xFF
        return [(chunk.view[:length], None)], chunk, length
    payloads: list[Payload] = []
    for piece in frame.pieces:
        rows = payload_rows(bulk.source, frame.name, piece.src_row, piece.rows)
        payloads.append((flipped_copy(rows) if corrupt else rows, None))
        corrupt = False
    return payloads, None, frame.length


def shortened(body: object, keep: object) -> Payload:
    """Message `body` a byte short (fault injection): an I/O vector copied with its last segment a byte
    shorter (dropped when one byte long), a buffer sliced."""
    if isinstance(body, array.array):
        vector = array.array("Q", body)
        if vector[-1] > 1:
            vector[-1] -= 1
        else:
            del vector[-2:]
        return vector, keep
    assert isinstance(body, memoryview | bytearray | torch.Tensor)
    return body[:-1], keep

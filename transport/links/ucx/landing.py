"""Where a UCX link's bulk bytes land: the receives one frame descriptor calls for.

The link's reader reads descriptors in order and posts, for each, the receives of the bytes that follow
it on the bulk tag (one message per segment of a direct frame, one per bundle of packed frames):

- `scattered`: when the landing claimed every frame, the pool is in host memory, the sender is a
  process of this host the link can watch (`transport.links.ucx.peer_process`) and `TransferConfig.ucx_copies`
  says so (bundles unless "receiver", direct frames only with "sender"): each message straight into its
  rows, however scattered, by a receive with an I/O vector (`transport.links.ucx.scatter`): no unpack, and a
  direct piece is written by the sender (no copy on this thread; a gathered bundle still comes through
  UCX's shared-memory fragments). A bundle's alignment gaps land in a scratch buffer.
- `direct`: a direct frame the landing claimed, into block memory UCX can reach (host memory, or GPU
  memory when UCX has CUDA transports), one contiguous receive per segment; UCX reads the sender's rows
  (from this process, between processes of one host).
- `into_device`: packed frames the landing claimed, for a pool on a GPU that UCX reaches, into one
  device buffer; `land` then scatters it into the rows on the GPU (`transport.bulk.device_bundles`).
- `through_chunk`: anything else — packed frames without those paths, GPU pools UCX cannot reach,
  frames whose round is gone — into a host chunk; `land` then unpacks the claimed frames' rows.
"""

from __future__ import annotations

import array
import ctypes
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Final

import torch
import trio

from transport.bulk.device_bundles import landing_buffer, message_buffer, scatter, written
from transport.bulk.frame_plan import BUNDLE_ALIGN, bundle_starts
from transport.bulk.staging import HostChunk, HostChunks, unpack
from transport.links.ucx.frames import Descriptor, payload_rows
from transport.links.ucx.worker import UcxWorker
from transport.memory.storage import PoolStorage

# Where a bundle's alignment gaps (fewer than BUNDLE_ALIGN bytes each) land (nobody reads them), and
# what a sender sends for them.
_GAP: Final = ctypes.create_string_buffer(BUNDLE_ALIGN)
_GAP_ADDRESS: Final = ctypes.addressof(_GAP)
_ZEROS: Final = ctypes.create_string_buffer(BUNDLE_ALIGN)
ZEROS_ADDRESS: Final = ctypes.addressof(_ZEROS)
WRITER_CHECK_SECONDS: Final = 0.05
VECTORISED_STRETCHES: Final = 80


@dataclass(slots=True)
class Landing:
    """One descriptor's receives; `chunk` (and `rows`, each claimed frame's rows with where its bytes
    start in the chunk) when it lands through host memory or a device buffer."""

    requests: list[Any]
    chunk: HostChunk | torch.Tensor | None = None
    rows: list[tuple[PoolStorage, str, list[tuple[int, int]], int]] = field(default_factory=list)


def scattered(
    worker: UcxWorker,
    endpoint: Any,
    on: int,
    storage: PoolStorage,
    frames: Sequence[Descriptor],
    names: Sequence[str],
    row_bytes: Sequence[int],
    landings: deque[Landing],
) -> None:
    """Receives straight into the claimed rows of host `storage`, as I/O vectors."""
    first, requests = frames[0], _listed(Landing([]), landings)
    if not first.packed:
        base, width = storage.tensors[names[0]].data_ptr(), row_bytes[first.buffer]
        for row, rows in first.segments:
            vector = array.array("Q", (base + row * width, rows * width))
            requests.append(worker.receive_scattered(endpoint, on, vector, storage))
        return
    parts = [(n, row_bytes[f.buffer], f.segments, f.length) for f, n in zip(frames, names, strict=True)]
    requests.append(
        worker.receive_scattered(endpoint, on, bundle_vector(storage, parts, _GAP_ADDRESS), storage)
    )


def _listed(landing: Landing, landings: deque[Landing]) -> list[Any]:
    """`landing` appended to `landings` before any of its receives is posted — a post that fails halfway
    leaves the ones before it where `UcxLink.quiesce` waits for them — and its list of receives."""
    landings.append(landing)
    return landing.requests


def bundle_vector(
    storage: PoolStorage, parts: Sequence[tuple[str, int, Sequence[tuple[int, int]], int]], gap_address: int
) -> array.array[int]:
    """A bundle's bytes as an I/O vector (`transport.links.ucx.scatter.io_vector`) over host `storage`: each
    part (buffer name, row bytes, `(row, rows)` stretches, bytes) from its aligned start (`bundle_starts`),
    the gaps at `gap_address`."""
    starts, _length = bundle_starts([length for _name, _width, _stretches, length in parts])
    vector = array.array("Q")
    end = 0
    for start, (name, width, stretches, length) in zip(starts, parts, strict=True):
        if start > end:
            vector.extend((gap_address, start - end))
        vector.extend(stretch_entries(storage.tensors[name].data_ptr(), width, stretches))
        end = start + length
    return vector


def stretch_entries(base: int, width: int, stretches: Sequence[tuple[int, int]]) -> array.array[int]:
    """The I/O-vector entries `(base + row * width, rows * width)` of `(row, rows)` stretches. Many
    stretches (a KV frame has one per block): torch scales them in place, in 15-20 µs however many,
    where a Python loop takes 25 µs for 128 and 60 µs for 256; below `VECTORISED_STRETCHES` the loop is
    faster (7 µs against 14 for 32: a small model's 512-token prompt)."""
    if len(stretches) < VECTORISED_STRETCHES:
        return array.array(
            "Q", [value for row, rows in stretches for value in (base + row * width, rows * width)]
        )
    entries = array.array("Q", chain.from_iterable(stretches))
    values = torch.frombuffer(entries, dtype=torch.int64)  # addresses and lengths are below 2**63
    values.mul_(width)
    values[0::2].add_(base)
    return entries


def direct(
    worker: UcxWorker,
    endpoint: Any,
    on: int,
    storage: PoolStorage,
    frame: Descriptor,
    name: str,
    landings: deque[Landing],
) -> None:
    """A direct frame's receives, one per segment, into the rows of `storage`."""
    requests = _listed(Landing([]), landings)
    if storage.device.type == "cpu":
        base, width = storage.tensors[name].data_ptr(), storage.row_bytes[name]
        pieces = [(base + row * width, rows * width) for row, rows in frame.segments]
        worker.receive_host(endpoint, on, pieces, storage, requests)
        return
    for row, rows in frame.segments:
        requests.append(worker.receive(endpoint, on, payload_rows(storage, name, row, rows)))


def into_device(
    worker: UcxWorker,
    endpoint: Any,
    on: int,
    frames: Sequence[Descriptor],
    storage: PoolStorage,
    names: Sequence[str],
    landings: deque[Landing],
) -> None:
    """A bundle of packed frames, all claimed in GPU `storage`, received into a new device buffer
    (`device_bundles.landing_buffer`)."""
    starts, length = bundle_starts([frame.length for frame in frames])
    bundle = landing_buffer(storage.device, length)
    rows = [(storage, name, f.segments, start) for f, name, start in zip(frames, names, starts, strict=True)]
    _listed(Landing([], bundle, rows), landings).append(worker.receive(endpoint, on, message_buffer(bundle)))


def through_chunk(
    worker: UcxWorker,
    endpoint: Any,
    on: int,
    chunks: HostChunks,
    frames: Sequence[Descriptor],
    targets: Sequence[tuple[PoolStorage, str] | None],
    row_bytes: Sequence[int],
    landings: deque[Landing],
) -> None:
    """Receives into a host chunk; `targets[i]` is where frame i's rows go once landed (None: nowhere,
    its round is gone or refused it)."""
    first = frames[0]
    starts, length = bundle_starts([frame.length for frame in frames])
    chunk = chunks.take(length)
    landing = Landing([], chunk)
    for frame, target, start in zip(frames, targets, starts, strict=True):
        if target is not None:
            storage, name = target
            landing.rows.append((storage, name, frame.segments, start))
    requests = _listed(landing, landings)
    if first.packed:
        requests.append(worker.receive(endpoint, on, chunk.view[:length]))
        return
    width, at = row_bytes[first.buffer], 0
    for _row, rows in first.segments:
        requests.append(worker.receive(endpoint, on, chunk.view[at : at + rows * width]))
        at += rows * width


async def settle(worker: UcxWorker, landings: Sequence[Landing], writer_gone: Callable[[], bool]) -> bool:
    """Wait until every receive of `landings` completed (a cancelled one completes too), or until
    `writer_gone()` — asked every `WRITER_CHECK_SECONDS` — says the process that would complete the rest
    has exited (a scattered receive UCX has matched completes only when its sender writes it); False
    then. Cancellable: callers shield it."""
    for landing in landings:
        while True:
            with trio.move_on_after(WRITER_CHECK_SECONDS):
                await worker.wait(landing.requests, check=False)
                break
            if writer_gone():
                return False
    return True


async def land(landing: Landing, chunks: HostChunks) -> None:
    """After its receives completed: a chunk's rows unpacked into their storage and the chunk given
    back, or a device bundle scattered into its rows on the GPU. Returns once they are in place (also
    when cancelled while the scatter runs, then raises: `device_bundles.written`)."""
    chunk = landing.chunk
    if isinstance(chunk, torch.Tensor):
        await written(scatter(chunk, landing.rows), chunk.numel())
    elif chunk is not None:
        for storage, name, segments, at in landing.rows:
            unpack(storage, name, segments, chunk, at)
        chunks.give(chunk)

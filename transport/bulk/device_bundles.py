"""A bundle of packed frames as one buffer on the pool's GPU: how a UCX link moves a GPU pool's rows
when UCX reaches GPU memory itself (CUDA transports in `UCX_TLS`).

UCX moves each message between GPU buffers by a CUDA IPC rendezvous, about 23 µs however small the
message (raw ucxx on an H100 80GB HBM3: 128 messages of 2 MiB in 3.0 ms, one of 256 MiB in 0.35 ms). A
piece per message, a fragmented pool costs a message per block and buffer: 384 for the benchmark's
256 MiB of 128 embedding blocks, which moved at 14-23 GB/s that way (`gpu_pool_ucx` of
`python -m engine.bench transfer --only gpu`, same GPU). So such a link packs on the device instead, in
frames and bundles of up to `DEVICE_BUNDLE_BYTES` (`frame_plan.DEVICE_SIZES`); only a piece that fills a
bundle alone still goes as its own message:

- `gather`: the sender's rows of each frame, one `index_select` each, into one new device buffer, each
  frame from its aligned start (`bundle_starts`; the gaps zeroed: the buffer is recycled memory);
- `scatter`: a received bundle's frames, one `index_copy_` each, into the claimed rows.

Both queue their work on the device's `runs.transfer_stream`, after the work already queued on the
current stream (what wrote the source rows, or last read the target rows), and return the event that
completes with it, for the caller to await (`gpu_copy.copies_done`): a stream `synchronize` on the event
loop would also wait for the model steps other replicas queued meanwhile. Buffers are allocated on that
stream by torch's caching allocator, so steady traffic reuses the same memory (and UCX its IPC
mappings). On a CPU pool both run synchronously and return no event (the tests' device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Final, TypeVar, final

import torch

from transport.bulk.frame_plan import DEVICE_BUNDLE_BYTES, Frame, bundle_starts
from transport.bulk.gpu_copy import copies_done, indexed
from transport.bulk.runs import transfer_stream
from transport.bulk.staging import row_groups, rows_view
from transport.memory.storage import PoolStorage

# A GPU pool's piece of at least this many bytes goes as its own message: gathering it would cost a
# device copy on each side to save one message.
DEVICE_DIRECT_MIN_BYTES: Final = DEVICE_BUNDLE_BYTES

# Where a landed bundle's frame goes: storage, buffer name, `(row, rows)` stretches, its start in the bundle.
Target = tuple[PoolStorage, str, Sequence[tuple[int, int]], int]
Event = torch.cuda.Event | None
_T = TypeVar("_T")


def bundles_on_device(device: torch.device, cuda_capable: bool) -> bool:
    """Whether a UCX link packs a pool on `device` into device bundles (`cuda_capable`: its UCX moves
    CUDA memory itself). Not with torch's `cudaMallocAsync` allocator: it orders a free on the
    allocating stream only, so a landing buffer could come back while its scatter still reads it."""
    return device.type == "cuda" and cuda_capable and not _stream_ordered_allocator()


@functools.cache
def _stream_ordered_allocator() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_allocator_backend() != "native"


def is_direct_on_device(piece_bytes: int) -> bool:
    """The `direct` of a link that packs on the device (`frame_plan.plan_frames`)."""
    return piece_bytes >= DEVICE_DIRECT_MIN_BYTES


async def gather(storage: PoolStorage, frames: Sequence[Frame], corrupt: bool = False) -> torch.Tensor:
    """`launch_gather`, returning once the bundle is written (cancelled meanwhile, it still waits for
    the gather, then raises)."""
    bundle, done = launch_gather(storage, frames, corrupt)
    await written(done, bundle.numel())
    return bundle


def launch_gather(
    storage: PoolStorage, frames: Sequence[Frame], corrupt: bool = False
) -> tuple[torch.Tensor, Event]:
    """The packed `frames` of `storage`'s rows as one new uint8 buffer on its device (`bundle_starts`
    layout), and the event that completes once it is written (None: written on return). `corrupt`
    flips its first byte (fault injection; the sender's rows stay as they are)."""
    starts, length = bundle_starts([frame.length for frame in frames])

    def work() -> torch.Tensor:
        bundle = torch.empty(length, dtype=torch.uint8, device=storage.device)
        end = 0
        for frame, start in zip(frames, starts, strict=True):
            if start > end:
                bundle[end:start].zero_()
            groups, index = row_groups(storage.flat(frame.name), frame.sources())
            torch.index_select(groups, 0, index, out=rows_view(bundle, groups, index.numel(), start))
            end = start + frame.length
        if corrupt:
            bundle[:1].bitwise_xor_(0xFF)
        return bundle

    return _queued(storage.device, work)


def landing_buffer(device: torch.device, length: int) -> torch.Tensor:
    """A new uint8 buffer of `length` bytes on `device` for UCX to receive a bundle into. On a GPU it
    comes from a stream of its own, on which nothing is ever queued: torch's caching allocator hands a
    block to an allocation on that stream only once the work of every stream that used it is done
    (`scatter` records its use), so nothing still reads or writes the buffer when UCX — outside any
    stream's order — writes into it."""
    if device.type != "cuda":
        return torch.empty(length, dtype=torch.uint8, device=device)
    with torch.cuda.stream(_landing_stream(indexed(device))):
        return torch.empty(length, dtype=torch.uint8, device=device)


@final
class RoundWork:
    """`current_work` once per round: each direct piece of a round waits for the same event (a new one
    per piece would wait again for whatever model steps were queued meanwhile)."""

    def __init__(self) -> None:
        self._round: tuple[int, int] | None = None
        self._event: Event = None

    def event(self, device: torch.device, landing_key: int, round: int) -> Event:
        if self._round != (landing_key, round):
            self._round, self._event = (landing_key, round), current_work(device)
        return self._event


def current_work(device: torch.device) -> Event:
    """An event after the work queued so far on `device`'s current stream (None off CUDA): what UCX
    reading or writing a pool's rows directly (a direct piece) must wait for — whatever wrote the rows
    it sends, or last read the rows it lands in."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def scatter(bundle: torch.Tensor, targets: Sequence[Target]) -> Event:
    """`bundle`'s frames into their rows (`targets`, on `bundle`'s device); the event that completes
    once they are written (None: written on return)."""

    def work() -> None:
        if bundle.device.type == "cuda":  # allocated on the landing stream (`landing_buffer`)
            bundle.record_stream(torch.cuda.current_stream(bundle.device))
        for storage, name, stretches, start in targets:
            groups, index = row_groups(storage.flat(name), stretches)
            groups.index_copy_(0, index, rows_view(bundle, groups, index.numel(), start))

    return _queued(bundle.device, work)[1]


def message_buffer(bundle: torch.Tensor) -> torch.Tensor | memoryview:
    """`bundle` as UCX takes it: a CUDA tensor (its CUDA array interface), or the bytes of a CPU one."""
    if bundle.device.type == "cuda":
        return bundle
    return memoryview(bundle.numpy()).cast("B")  # type: ignore[arg-type]


async def written(event: Event, nbytes: int) -> None:
    """Return once the work before `event` (`nbytes` of copies in all) is done; at once for None.
    Cancelled meanwhile, it still waits for that work, then raises (`gpu_copy.copies_done`)."""
    if event is not None:
        await copies_done(event, nbytes)


@functools.cache
def _landing_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _queued(device: torch.device, work: Callable[[], _T]) -> tuple[_T, Event]:
    """`work()` with its device work queued on `device`'s transfer stream — after what the current
    stream has queued (whatever wrote the source rows or last read the target rows) — and the event
    recorded after it; off CUDA it just runs."""
    if device.type != "cuda":
        return work(), None
    stream = transfer_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        result = work()
        event = torch.cuda.Event()
        event.record(stream)
    return result, event

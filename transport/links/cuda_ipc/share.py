"""Sharing a GPU pool with another process of the host, for the cuda-ipc transport.

Handles come from torch's own CUDA IPC path — `torch.multiprocessing.reductions.reduce_tensor` on the
receiver's buffer tensors, `rebuild_cuda_tensor` in the sender — rather than `cudaIpcGetMemHandle`
through ctypes: torch's caching allocator hands out pieces of larger allocations, and its path already
knows the allocation a tensor lives in, its offset, the reference counting that keeps the memory alive
while another process maps it, and a cache so one process opens a handle once. A process cannot open its
own handles, so a pool shared within one process (replicas of one node) is looked up in `_exported`.

Setup messages travel length-prefixed (u32) before the link's first TCP frame, read to the exact byte.
`copy_rows` is the sender's device copy: a `copy_` per run, or for many one copy by groups of rows.
"""

from __future__ import annotations

import os
import socket
import struct
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, final

import msgspec
import torch
import trio

from messages.cuda_ipc import PoolShare, SharedBuffer, ShareVerdict
from transport.bulk.runs import GroupIndex, Run, block_index, group_index
from transport.errors import LinkClosed
from transport.memory.storage import PoolStorage, torch_dtype

MAX_SETUP_BYTES: Final = 1024 * 1024
FEW_RUNS: Final = 4  # up to this many runs per buffer, one copy_ each
_LENGTH: Final = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()
_share_decoder = msgspec.msgpack.Decoder(PoolShare)
_verdict_decoder = msgspec.msgpack.Decoder(ShareVerdict)
# Tensors this process shared, by (handle, storage offset, tensor offset): for a sender in this process.
_exported: weakref.WeakValueDictionary[tuple[bytes, int, int], torch.Tensor] = weakref.WeakValueDictionary()


@final
class ShareRefused(Exception):
    """The sender cannot map the receiver's pool; the message says why."""


def host_id() -> str:
    """This host: its name and boot id (a CUDA IPC handle opens only on the host, and boot, that made it)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else '?'}"


def share_pool(storage: PoolStorage) -> PoolShare:
    """IPC handles of every buffer of `storage` (on a CUDA device)."""
    from torch.multiprocessing.reductions import reduce_tensor

    buffers = []
    for spec in storage.layout.buffers:
        tensor = storage.tensors[spec.name]
        _rebuild, args = reduce_tensor(tensor)
        # (cls, size, stride, offset, storage cls, dtype, device, handle, storage bytes, storage offset,
        #  requires_grad, ref counter handle, ref counter offset, event handle, event sync required)
        _cls, size, stride, offset, _storage_cls, _dtype, device, handle, nbytes, storage_offset = args[:10]
        ref_handle, ref_offset, event_handle, event_sync = args[11:15]
        _exported[(handle, storage_offset, offset)] = tensor
        buffers.append(
            SharedBuffer(
                name=spec.name,
                dtype=spec.dtype,
                shape=tuple(size),
                stride=tuple(stride),
                offset=offset,
                device=device,
                handle=handle,
                storage_bytes=nbytes,
                storage_offset=storage_offset,
                ref_counter_handle=ref_handle,
                ref_counter_offset=ref_offset,
                event_handle=event_handle,
                event_sync_required=event_sync,
            )
        )
    return PoolShare(host=host_id(), pid=os.getpid(), buffers=tuple(buffers))


def open_share(share: PoolShare, storage: PoolStorage) -> dict[str, torch.Tensor]:
    """The receiver's buffers mapped into this process, each flat (`[rows, *shape]`), checked against
    the sender's layout. Raises `ShareRefused` naming the reason."""
    if share.host != host_id():
        raise ShareRefused(
            f"cuda-ipc needs one host: the receiver is on {share.host}, the sender on {host_id()}"
        )
    if storage.device.type != "cuda" or not torch.cuda.is_available():
        raise ShareRefused(f"cuda-ipc needs the sender's pool on a GPU; it is on {storage.device}")
    specs = {spec.name: spec for spec in storage.layout.buffers}
    mapped = {}
    for buffer in share.buffers:
        spec = specs.get(buffer.name)
        shape = tuple(buffer.shape)
        if spec is None or buffer.dtype != spec.dtype or len(shape) < 2 or shape[2:] != spec.shape:
            raise ShareRefused(
                f"cuda-ipc: the receiver's buffer {buffer.name!r} is not laid out as the sender's"
            )
        tensor = _open(share, buffer)
        try:
            mapped[buffer.name] = tensor.view(buffer.shape[0] * buffer.shape[1], *spec.shape)
        except RuntimeError as exc:  # a shape or strides that do not describe whole rows
            raise ShareRefused(
                f"cuda-ipc: the receiver's buffer {buffer.name!r} is not whole rows: {exc}"
            ) from exc
    if set(mapped) != {spec.name for spec in storage.layout.buffers}:
        raise ShareRefused(f"cuda-ipc: the receiver shared buffers {sorted(mapped)}")
    return mapped


def _open(share: PoolShare, buffer: SharedBuffer) -> torch.Tensor:
    if share.pid == os.getpid():
        tensor = _exported.get((buffer.handle, buffer.storage_offset, buffer.offset))
        if tensor is None:
            raise ShareRefused(f"cuda-ipc: buffer {buffer.name!r} was shared from this process and is gone")
        return tensor
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(buffer.shape),
            buffer.stride,
            buffer.offset,
            torch.storage.TypedStorage,
            torch_dtype(buffer.dtype),
            buffer.device,
            buffer.handle,
            buffer.storage_bytes,
            buffer.storage_offset,
            False,
            buffer.ref_counter_handle,
            buffer.ref_counter_offset,
            buffer.event_handle,
            buffer.event_sync_required,
        )
    except RuntimeError as exc:
        raise ShareRefused(f"cuda-ipc: cannot open the receiver's buffer {buffer.name!r}: {exc}") from exc


def copy_rows(source: torch.Tensor, target: torch.Tensor, indices: RowIndices) -> None:
    """The round's rows (`indices`) from flat `source` into flat `target`, asynchronously on the current
    stream, byte for byte. A few runs or blocks (or peer copies between GPUs): one `copy_` per run. More
    on one device: one copy through the round's `GroupIndex` (`transport.bulk.gpu_copy`) — a launch per run
    (microseconds each, hundreds per round) would dominate. Never `torch._foreach_copy_`: it moves
    bfloat16 and half through float, which changes the bytes of NaN payloads."""
    if indices.few() or source.device != target.device:
        for run in indices.runs():
            target[run.dst_row : run.dst_row + run.rows].copy_(
                source[run.src_row : run.src_row + run.rows], non_blocking=True
            )
        return
    indices.get(source, target).copy(source, target)


@final
class RowIndices:
    """One round's rows, for all of its buffers (which have the same row counts on each side): its
    `runs`, planned only if a path needs them, and its `GroupIndex`, built once — from the block ids
    when the round moves `whole_blocks` of `block_size` rows (`BulkWrite.whole_blocks`: no run is
    planned), else from the runs."""

    def __init__(
        self,
        runs: Callable[[], Sequence[Run]],
        whole_blocks: tuple[Sequence[int], Sequence[int]] | None = None,
        block_size: int = 1,
    ) -> None:
        self.runs, self._whole_blocks, self._block_size = runs, whole_blocks, block_size
        self._built: GroupIndex | None = None

    def few(self) -> bool:
        """Whether the round has at most `FEW_RUNS` pieces (blocks, when it moves whole blocks)."""
        pieces = len(self._whole_blocks[0]) if self._whole_blocks is not None else len(self.runs())
        return pieces <= FEW_RUNS

    def get(self, source: torch.Tensor, target: torch.Tensor) -> GroupIndex:
        if self._built is None:
            devices = (source.device, target.device)
            if self._whole_blocks is not None:
                self._built = block_index(*self._whole_blocks, self._block_size, devices)
            else:
                self._built = group_index(self.runs(), (int(source.shape[0]), int(target.shape[0])), devices)
        return self._built


# ---------------------------------------------------------------------- setup messages on the socket
def encode_setup(message: PoolShare | ShareVerdict) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def decode_share(body: bytes | bytearray) -> PoolShare:
    return _share_decoder.decode(body)


def decode_verdict(body: bytes | bytearray) -> ShareVerdict:
    return _verdict_decoder.decode(body)


async def send_setup(sock: socket.socket, message: PoolShare | ShareVerdict) -> None:
    data = memoryview(encode_setup(message))
    while data:
        try:
            data = data[sock.send(data) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def receive_setup(sock: socket.socket) -> bytearray:
    """One length-prefixed setup body, read to its last byte and no further (the link's frames follow)."""
    length = _LENGTH.unpack(await _receive_exactly(sock, _LENGTH.size))[0]
    if length > MAX_SETUP_BYTES:
        raise msgspec.DecodeError(f"cuda-ipc setup message of {length} bytes, over {MAX_SETUP_BYTES}")
    return await _receive_exactly(sock, length)


async def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        try:
            count = sock.recv_into(view[got:])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        if count == 0:
            raise LinkClosed("the peer closed the connection during the cuda-ipc setup")
        got += count
    return buffer

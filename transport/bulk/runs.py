"""A bulk write as *runs*: maximal stretches where source and destination rows are both consecutive.

A buffer tensor is `[num_blocks, block_size, *shape]`, so its flat rows (`block * block_size + row`) are
contiguous in memory, and a run is one contiguous byte range on each side: one `copy_` (inproc) or one
bulk frame (tcp). Planning walks block boundaries, not tokens: at most one iteration per source block
plus one per destination block.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, final

import torch

from transport.bulk.gpu_copy import copy_groups, indexed
from transport.memory.storage import PoolStorage

# Runs at least this large are copied by torch; smaller ones by memcpy (CPU) or index ops (devices).
TORCH_COPY_BYTES: Final = 64 * 1024


@final
@dataclass(slots=True)
class Run:
    """Flat rows `[src_row, src_row + rows)` of the source go to `[dst_row, dst_row + rows)`.
    Mutable only while `plan_runs` extends it."""

    src_row: int
    dst_row: int
    rows: int


def _check_range(side: str, ids: Sequence[int], offset: int, count: int, block_size: int) -> None:
    capacity = len(ids) * block_size
    if offset < 0 or count < 0 or offset + count > capacity:
        raise ValueError(
            f"{side} token range [{offset}, {offset + count}) outside its {len(ids)} blocks "
            f"of {block_size} tokens ({capacity} tokens)"
        )


def check_ranges(
    src_ids: Sequence[int],
    src_offset: int,
    dst_ids: Sequence[int],
    dst_offset: int,
    count: int,
    block_size: int,
) -> None:
    """`ValueError` naming the side whose token range lies outside its blocks."""
    _check_range("source", src_ids, src_offset, count, block_size)
    _check_range("destination", dst_ids, dst_offset, count, block_size)


def plan_runs(
    src_ids: Sequence[int],
    src_offset: int,
    dst_ids: Sequence[int],
    dst_offset: int,
    count: int,
    block_size: int,
) -> list[Run]:
    """Runs moving tokens `[src_offset, +count)` of allocation `src_ids` to `[dst_offset, +count)` of `dst_ids`."""
    check_ranges(src_ids, src_offset, dst_ids, dst_offset, count, block_size)
    skip = src_offset % block_size
    if count and skip == dst_offset % block_size:
        blocks = -(-(skip + count) // block_size)
        first_src, first_dst = src_offset // block_size, dst_offset // block_size
        src_blocks, dst_blocks = (
            src_ids[first_src : first_src + blocks],
            dst_ids[first_dst : first_dst + blocks],
        )
        return _in_step(src_blocks, dst_blocks, skip, count, block_size)
    runs: list[Run] = []
    src, dst, left = src_offset, dst_offset, count
    while left:
        src_block, src_in = divmod(src, block_size)
        dst_block, dst_in = divmod(dst, block_size)
        rows = min(block_size - src_in, block_size - dst_in, left)
        src_row = src_ids[src_block] * block_size + src_in
        dst_row = dst_ids[dst_block] * block_size + dst_in
        if runs:
            last = runs[-1]
            if last.src_row + last.rows == src_row and last.dst_row + last.rows == dst_row:
                last.rows += rows
                src, dst, left = src + rows, dst + rows, left - rows
                continue
        runs.append(Run(src_row, dst_row, rows))
        src, dst, left = src + rows, dst + rows, left - rows
    return runs


def _in_step(
    src_blocks: Sequence[int], dst_blocks: Sequence[int], skip: int, count: int, block_size: int
) -> list[Run]:
    """`plan_runs` when both sides cross block boundaries at the same tokens (the usual case: both
    offsets block-aligned): the blocks the tokens cover, paired, one step each, trimmed by `skip` rows
    at the head and to `count` rows in all."""
    runs: list[Run] = []
    last = Run(-1, -1, 0)
    for src_block, dst_block in zip(src_blocks, dst_blocks, strict=True):
        src_row, dst_row = src_block * block_size, dst_block * block_size
        if src_row == last.src_row + last.rows and dst_row == last.dst_row + last.rows:
            last.rows += block_size
        else:
            last = Run(src_row, dst_row, block_size)
            runs.append(last)
    head = runs[0]
    head.src_row, head.dst_row, head.rows = head.src_row + skip, head.dst_row + skip, head.rows - skip
    runs[-1].rows -= len(src_blocks) * block_size - skip - count
    return runs


@final
@dataclass(frozen=True, slots=True)
class GroupIndex:
    """A write's runs as one gather and one scatter: flat rows taken `group` at a time — the largest
    count dividing every run's start on both sides, every run's length and both buffers' row counts
    (a pool's whole blocks, usually) — and the group numbers on each side. Fewer, larger index entries
    than one per row: 512 blocks of 128 rows are 512 entries, not 65 536."""

    group: int
    src: torch.Tensor
    dst: torch.Tensor

    def copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """The runs' rows of flat `source` into flat `target` (queued on the current stream on a GPU):
        one kernel on one GPU, else through a temporary (`transport.bulk.gpu_copy`)."""
        copy_groups(source, target, self.group, self.src, self.dst)


def group_index(
    runs: Sequence[Run], rows: tuple[int, int], devices: tuple[torch.device, torch.device]
) -> GroupIndex:
    """`GroupIndex` of `runs` between buffers of `rows` flat rows (source, target) on `devices`."""
    if not runs:
        empty = torch.empty(0, dtype=torch.int64)
        return GroupIndex(math.gcd(*rows), empty.to(devices[0]), empty.to(devices[1]))
    lengths = [run.rows for run in runs]
    starts = _int64([run.src_row for run in runs] + [run.dst_row for run in runs])
    # The lengths' and row counts' gcd divides every start in the usual case (whole blocks): one
    # vectorised check instead of a gcd over a thousand starts.
    group = math.gcd(*rows, *set(lengths))
    if group > 1 and bool((starts % group).any()):
        group = math.gcd(group, *starts.tolist())
    return _on_devices(group, _numbers(starts.view(2, -1), lengths, group), devices)


def block_index(
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    block_size: int,
    devices: tuple[torch.device, torch.device],
) -> GroupIndex:
    """`GroupIndex` of whole blocks paired in order (groups of one block): the block ids themselves, with
    no `Run` to read (`group_index` reads one per run)."""
    return _on_devices(block_size, _int64([*src_blocks, *dst_blocks]).view(2, -1), devices)


def _on_devices(group: int, both: torch.Tensor, devices: tuple[torch.device, torch.device]) -> GroupIndex:
    """`GroupIndex` of source (`both[0]`) and target (`both[1]`) group numbers moved to `devices`."""
    if devices[0] == devices[1]:  # one copy to the device, queued: no wait for the stream's work
        count = both.shape[1]
        if count % 2:  # each row 16-byte aligned: Triton compiles the kernel again for an unaligned one
            both = torch.cat((both, both.new_zeros(2, 1)), dim=1)
        both = both.to(devices[0], non_blocking=True)
        return GroupIndex(group, both[0, :count], both[1, :count])
    return GroupIndex(group, both[0].to(devices[0]), both[1].to(devices[1]))


def group_numbers(starts: list[int], lengths: list[int], group: int = 1) -> torch.Tensor:
    """The groups of `group` rows covering `[start, start + length)` of each stretch, in order (every
    row with `group` 1), with no Python step per entry."""
    if not starts:
        return torch.empty(0, dtype=torch.int64)
    return _numbers(_int64(starts).view(1, -1), lengths, group)[0]


def _int64(values: list[int]) -> torch.Tensor:
    if not values:  # `frombuffer` refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _numbers(starts: torch.Tensor, lengths: list[int], group: int) -> torch.Tensor:
    """`group_numbers` of each row of `starts` (`[sides, stretches]`) with the same `lengths`."""
    firsts = starts // group
    if lengths.count(lengths[0]) == len(lengths):  # runs of one length (whole blocks): a grid
        per_run = lengths[0] // group
        if per_run == 1:
            return firsts
        return (firsts.unsqueeze(2) + torch.arange(per_run)).view(firsts.shape[0], -1)
    # Every entry is one more than the one before it, except at a run's first: a cumulative sum of ones
    # with each run's jump put in (a handful of whole-tensor ops; `repeat_interleave` took milliseconds
    # for a hundred runs on the host of an H100 80GB HBM3 machine).
    counts = [length // group for length in lengths]
    if 0 in counts:
        kept = [run for run, count in enumerate(counts) if count]
        firsts, counts = firsts[:, kept], [counts[run] for run in kept]
    if not counts:
        return firsts
    lasts = firsts[:, :-1] + (_int64(counts[:-1]) - 1)
    jumps = torch.cat((firsts[:, :1], firsts[:, 1:] - lasts), dim=1)
    steps = torch.ones(firsts.shape[0], sum(counts), dtype=torch.int64)
    steps.index_copy_(1, _int64(list(itertools.accumulate(counts[:-1], initial=0))), jumps)
    return steps.cumsum(1)


def copy_runs(src: PoolStorage, dst: PoolStorage, runs: Sequence[Run], buffers: Sequence[str]) -> int:
    """Copy `runs` of each buffer from `src` to `dst` storage; returns the bytes copied, once they are
    copied (blocking: a worker thread's call). See `launch_copy_runs`."""
    copied, done = launch_copy_runs(src, dst, runs, buffers)
    if done is not None:
        done.synchronize()
    return copied


def launch_copy_runs(
    src: PoolStorage, dst: PoolStorage, runs: Sequence[Run], buffers: Sequence[str]
) -> tuple[int, torch.cuda.Event | None]:
    """Copy `runs` of each buffer from `src` to `dst` storage, no temporary; returns the bytes and, when
    a pool is on a GPU, the event that completes with the copies (the caller's write fence, architecture §5.7:
    `gpu_copy.copies_done` in Trio, `synchronize` in a thread) — None when they are done on return.

    CPU: a run of at least `TORCH_COPY_BYTES` is one `copy_`; smaller runs are one `memcpy` each through
    the buffers' memoryviews (a torch call costs microseconds, a memoryview slice assignment a fraction
    of one). Other devices: one `copy_` per run, or for small runs one gather and one scatter per buffer
    (`GroupIndex`, built once). On CUDA they are queued on the device's `transfer_stream`, after the work
    already queued on the current streams of both pools' devices (whatever wrote the source rows), and
    the event waits for nothing queued later: a stream `synchronize` here held the event loop of a GPU
    node until the model steps its other replicas queued meanwhile were done (docs/transports.md).
    """
    if not runs:
        return 0, None
    devices = [device for device in (src.device, dst.device) if device.type == "cuda"]
    if not devices:
        return _copy_each(src, dst, runs, buffers), None
    stream = transfer_stream(devices[-1])
    for device in dict.fromkeys(devices):
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # index tensors and temporaries belong to this stream, too
        copied = _copy_each(src, dst, runs, buffers)
        done = torch.cuda.Event()
        done.record(stream)
    return copied, done


def transfer_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a process's inproc copies on `device` run on: one per device, apart from the streams
    the model's work is queued on (`cuda` and `cuda:0` are one device: one stream)."""
    return _transfer_stream(indexed(device))


@functools.cache
def _transfer_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _copy_each(src: PoolStorage, dst: PoolStorage, runs: Sequence[Run], buffers: Sequence[str]) -> int:
    total_rows = sum(r.rows for r in runs)
    on_cpu = src.device.type == "cpu" and dst.device.type == "cpu"
    index: GroupIndex | None = None
    byte_ranges: dict[int, tuple[list[Run], list[tuple[int, int, int]]]] = {}
    copied = 0
    for name in buffers:
        src_flat, dst_flat = src.flat(name), dst.flat(name)
        row_bytes = src.row_bytes[name]
        copied += total_rows * row_bytes
        if on_cpu:
            ranges = byte_ranges.get(row_bytes)
            if ranges is None:  # buffers of one row width (a KV layout's) share the runs' byte ranges
                ranges = byte_ranges[row_bytes] = _byte_ranges(runs, row_bytes)
            large, small = ranges
            for run in large:
                dst_flat[run.dst_row : run.dst_row + run.rows].copy_(
                    src_flat[run.src_row : run.src_row + run.rows]
                )
            src_bytes, dst_bytes = src.buffer_bytes(name), dst.buffer_bytes(name)
            for dst_at, src_at, size in small:
                dst_bytes[dst_at : dst_at + size] = src_bytes[src_at : src_at + size]
        elif total_rows * row_bytes < TORCH_COPY_BYTES * len(runs):
            if index is None:
                rows = (src.num_blocks * src.block_size, dst.num_blocks * dst.block_size)
                index = group_index(runs, rows, (src.device, dst.device))
            index.copy(src_flat, dst_flat)
        else:
            for run in runs:
                dst_flat[run.dst_row : run.dst_row + run.rows].copy_(
                    src_flat[run.src_row : run.src_row + run.rows]
                )
    return copied


def _byte_ranges(runs: Sequence[Run], row_bytes: int) -> tuple[list[Run], list[tuple[int, int, int]]]:
    """The runs `copy_runs` gives torch (at least `TORCH_COPY_BYTES`), and the others as `(dst_at,
    src_at, size)` byte ranges for `memcpy`, made once per row width: 16 MiB of a KV layout's 4 KiB
    pieces (8 buffers) copied in 2.70 ms instead of 2.92 (medians of 7 alternating batches)."""
    large = [run for run in runs if run.rows * row_bytes >= TORCH_COPY_BYTES]
    small = [
        (run.dst_row * row_bytes, run.src_row * row_bytes, run.rows * row_bytes)
        for run in runs
        if run.rows * row_bytes < TORCH_COPY_BYTES
    ]
    return large, small


def run_bytes(storage: PoolStorage, name: str, row: int, rows: int) -> memoryview:
    """The bytes of flat rows `[row, row + rows)` of buffer `name` (CPU storage), writable in place."""
    row_bytes = storage.row_bytes[name]
    return storage.buffer_bytes(name)[row * row_bytes : (row + rows) * row_bytes]


def checksum_runs(storage: PoolStorage, runs: Sequence[Run], buffers: Sequence[str], *, source: bool) -> int:
    """CRC-32 of the runs' bytes on one side, buffer by buffer in token order (CPU storage only)."""
    crc = 0
    for name in buffers:
        for run in runs:
            crc = zlib.crc32(run_bytes(storage, name, run.src_row if source else run.dst_row, run.rows), crc)
    return crc

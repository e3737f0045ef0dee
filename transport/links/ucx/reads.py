"""Read frames: a UCX link's host pieces that the receiver reads from the sender's memory itself.

When both ends of a UCX link run on one host, the receiver's pool is in host memory and
`TransferConfig.ucx_copies` is `"cma"`, the receiver checks at connect time that it may read the sender's
memory (`transport.links.ucx.cma.readable`) and tells the sender so (a `reads` body,
`transport.links.ucx.frames`). From then on the sender describes every piece of its host pool of at least
`READ_MIN_BYTES` in *read frames*, grouped per round (`read_groups`), and sends no bytes for them; smaller
rows still travel in bundles of packed frames, after the round's read groups.

- The receiver (`read_group`) claims each frame's rows, reads the claimed ones with `process_vm_readv`,
  several frames and scattered pieces per call, at most `READ_SLICE_BYTES` at a time (other tasks run
  between calls, as between UCX's copies), and answers with a receipt. A frame whose round is gone is
  not read at all.
- The sender (`Receipts`) keeps each group's rows until its receipt comes: a round's `write` that ends
  the transfer waits for it, as it waits for its sends. If the link closes first, the waits end failed
  (`Receipt.check_error`); the rows are the owner's again. A receiver reads only while its link is open,
  between its reader's awaits, so a sender that closes the link gets no later reads — except from a
  receiver stopped mid-read for longer than `link_timeout`, the same as a UCX rendezvous read; the
  `checksums` option detects such a round.

A read copies once, on the receiver's core (as UCX's own rendezvous read does), with no message per
piece and no progress event per 512 KiB.
"""

from __future__ import annotations

import array
import bisect
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Final, final

import numpy as np
import trio

from transport.bulk.frame_plan import HOST_SIZES, MAX_BUNDLE_FRAMES, SEGMENT, Frame, plan_bundles
from transport.bulk.write import BulkWrite
from transport.links.ucx.cma import IOV_MAX, cut, ends, read
from transport.links.ucx.frames import READ_GROUP_BYTES, Descriptor, UcxFrameError, framing
from transport.links.ucx.scatter import UcpFailed
from transport.memory.storage import PoolStorage
from transport.protocol.link import Landing

# A piece this large goes in a read frame: below it, pinning its pages costs more than UCX's fragments
# (64 MiB as 4 KiB pieces read at 3.1 GB/s, as 32 KiB pieces at 8.4, as 2 MiB pieces at 13.6).
READ_MIN_BYTES: Final = 16 * 1024
# The most bytes one `process_vm_readv` copies: about 1.3 ms here, so other tasks wait no longer.
READ_SLICE_BYTES: Final = 16 * 1024 * 1024
# A group this large takes its reader longer than the worker's poll window
# (`transport.protocol.link.POLL_SECONDS`, 0.5 ms) even at 16 GB/s: its sender waits for the receipt without
# polling.
PATIENT_BYTES: Final = 8 * 1024 * 1024
# A write with at most this many pieces under `READ_MIN_BYTES` has them read too (`reads_of`).
FEW_SMALL_PIECES: Final = 64
# A read group of at most this many pieces has its I/O vectors built in Python (`_vectors`): below it
# numpy's fixed cost is more than Python's per piece (in isolation 12 against 4 µs at 12 pieces, 13
# against 12 at 48; in a transfer both cost several times that).
PYTHON_VECTOR_PIECES: Final = 32


def reads_piece(piece_bytes: int) -> bool:
    """The `direct` of a link whose receiver reads: which pieces go in read frames."""
    return piece_bytes >= READ_MIN_BYTES


def reads_every_piece(_piece_bytes: int) -> bool:
    """The `direct` of a write with few small pieces (`reads_of`)."""
    return True


def reads_of(bulk: BulkWrite, index: Mapping[str, int], row_bytes: Sequence[int]) -> Callable[[int], bool]:
    """Which pieces of `bulk` its reading peer reads: those of `READ_MIN_BYTES` and more — or all of
    them, when at most `FEW_SMALL_PIECES` are smaller: those then ride in the read group instead of
    costing a bundle of their own (a descriptor, a message, a receive to post and to wait for)."""
    widths = Counter(row_bytes[index[name]] for name in bulk.buffers)
    small = 0
    for run in bulk.runs:
        for width, buffers in widths.items():
            if run.rows * width < READ_MIN_BYTES:
                small += buffers
                if small > FEW_SMALL_PIECES:
                    return reads_piece
    return reads_every_piece


def write_plan(
    bulk: BulkWrite, index: Mapping[str, int], row_bytes: Sequence[int], reads: bool, cuda_capable: bool
) -> Iterator[tuple[bool, list[Frame]]]:
    """A UCX link's write as bundles, each with whether it is a read group: read groups of a host pool's
    pieces for a peer that `reads`, otherwise the frames of `transport.links.ucx.frames.framing`."""
    if reads and bulk.source.device.type == "cpu":
        return read_groups(plan_bundles(bulk, index, row_bytes, reads_of(bulk, index, row_bytes), HOST_SIZES))
    direct, sizes = framing(bulk.source.device, cuda_capable)
    return ((False, bundle) for bundle in plan_bundles(bulk, index, row_bytes, direct, sizes))


def read_groups(bundles: Iterable[list[Frame]]) -> Iterator[tuple[bool, list[Frame]]]:
    """`transport.bulk.frame_plan.plan_bundles`' output with its direct frames gathered into read groups —
    `(True, frames)`, up to `READ_GROUP_BYTES` and `MAX_BUNDLE_FRAMES` frames — ahead of its bundles of
    packed frames, `(False, bundle)`, as they were: the receiver starts reading before it posts the
    bundles' receives (`ucx_1block_us` 411–421 µs against 417–446 with the bundle first: three
    alternating pairs, within a 2-vCPU VM's run-to-run spread)."""
    group: list[Frame] = []
    packed: list[list[Frame]] = []
    size = 0
    for bundle in bundles:
        if bundle[0].packed:
            packed.append(bundle)
            continue
        frame = bundle[0]
        if group and (size + frame.length > READ_GROUP_BYTES or len(group) == MAX_BUNDLE_FRAMES):
            yield True, group
            group, size = [], 0
        group.append(frame)
        size += frame.length
    if group:
        yield True, group
    for bundle in packed:
        yield False, bundle


@final
class Receipt:
    """What a sender waits for after a read group (the `completed` / `check_error` of a UCX request).
    `patient`: the group is large enough (`PATIENT_BYTES`) that its receipt cannot come within the
    worker's poll window, so the sender need not poll for it (`UcxWorker.wait`)."""

    __slots__ = ("completed", "failure", "frames", "patient")

    def __init__(self, frames: int, nbytes: int) -> None:
        self.frames, self.completed, self.failure = frames, False, ""
        self.patient = nbytes >= PATIENT_BYTES

    def check_error(self) -> None:
        if self.failure:
            raise UcpFailed(self.failure)


@final
class Receipts:
    """A sending link's read groups that wait for their receipts, oldest first."""

    def __init__(self) -> None:
        self._waiting: deque[Receipt] = deque()

    def expect(self, frames: int, nbytes: int) -> Receipt:
        receipt = Receipt(frames, nbytes)
        self._waiting.append(receipt)
        return receipt

    def answered(self, frames: int) -> None:
        """A receipt for `frames` read frames came. Raises `UcxFrameError` when it answers no group
        waiting, or another count than the oldest group's."""
        if not self._waiting:
            raise UcxFrameError(f"a receipt for {frames} read frames, with no read group waiting")
        oldest = self._waiting[0]
        if oldest.frames != frames:
            raise UcxFrameError(
                f"a receipt for {frames} read frames; the oldest read group has {oldest.frames}"
            )
        self._waiting.popleft().completed = True

    def fail_all(self, reason: str) -> None:
        """The link closed: every group waiting ends, failed with `reason`."""
        while self._waiting:
            receipt = self._waiting.popleft()
            receipt.failure = f"no receipt for a read group: {reason}"
            receipt.completed = True


async def read_group(
    pid: int,
    landing: Landing | None,
    frames: Sequence[Descriptor],
    names: Sequence[str],
    check_open: Callable[[], None],
    *,
    lanes: int = 1,
) -> None:
    """Read the claimed frames of a read group from process `pid` into `landing`'s storage: at most
    `READ_SLICE_BYTES` and `IOV_MAX` pieces per call, each call on up to `lanes` threads
    (`transport.links.ucx.cma.read`), a checkpoint between calls, `check_open()` (raises once the link closed)
    before each. Raises `transport.links.ucx.cma.CmaFailed` for a read the kernel refuses
    (the sender's memory is not where it said, or the process is gone)."""
    if landing is None:
        return
    claimed = [
        (frame, name)
        for frame, name in zip(frames, names, strict=True)
        if landing.claim(frame.round, name, frame.segments)
    ]
    if not claimed:
        return
    local, remote = _vectors(landing.storage, claimed)
    for index, (here, there, length) in enumerate(_calls(local, remote)):
        if index:
            await trio.lowlevel.checkpoint()
        check_open()
        read(pid, here, there, length, lanes=lanes)


def _vectors(
    storage: PoolStorage, claimed: Sequence[tuple[Descriptor, str]]
) -> tuple[array.array[int], array.array[int]]:
    """Both sides' I/O vectors of the claimed read frames, entry k of one the same piece as entry k of the
    other: `_few_vectors` for a group of at most `PYTHON_VECTOR_PIECES` pieces (a one-block transfer's
    three in 11 µs, where numpy took 54 µs in the same transfers), else `_table_vectors`."""
    if sum(len(frame.segments) for frame, _ in claimed) <= PYTHON_VECTOR_PIECES:
        return _few_vectors(storage, claimed)
    return _table_vectors(storage, claimed)


def _table_vectors(
    storage: PoolStorage, claimed: Sequence[tuple[Descriptor, str]]
) -> tuple[array.array[int], array.array[int]]:
    """`_vectors` from the frames' tables as they came, numpy computing every address and length in one
    pass (a KV round's 1 920 pieces in 16 frames: about 40 µs, where converting the parsed tuples alone
    took 240 µs; torch took 0.6 ms in a transfer, its small ops slowed by its intra-op threads on a busy
    host)."""
    rows, sources = array.array("q"), array.array("q")
    counts, widths, bases, source_bases = [], [], [], []
    for frame, name in claimed:
        count = len(frame.segments)
        rows.frombytes(frame.read_table[: SEGMENT.size * count])  # a copy at memory speed: no int objects
        sources.frombytes(frame.read_table[SEGMENT.size * count :])
        counts.append(count)
        widths.append(storage.row_bytes[name])
        bases.append(storage.tensors[name].data_ptr())
        source_bases.append(frame.source_base)
    if sys.byteorder != "little":
        rows.byteswap()
        sources.byteswap()
    per_piece = np.array(counts)
    width = np.repeat(np.array(widths, dtype=np.int64), per_piece)
    pairs = np.frombuffer(rows, dtype=np.int64).reshape(-1, 2)  # addresses are below 2**63
    lengths = pairs[:, 1] * width
    local = np.empty_like(pairs)
    local[:, 0] = pairs[:, 0] * width + np.repeat(np.array(bases, dtype=np.int64), per_piece)
    local[:, 1] = lengths
    remote = np.empty_like(pairs)
    remote[:, 0] = np.frombuffer(sources, dtype=np.int64) * width
    remote[:, 0] += np.repeat(np.array(source_bases, dtype=np.int64), per_piece)
    remote[:, 1] = lengths
    return array.array("Q", local.tobytes()), array.array("Q", remote.tobytes())


def _few_vectors(
    storage: PoolStorage, claimed: Sequence[tuple[Descriptor, str]]
) -> tuple[array.array[int], array.array[int]]:
    """`_vectors` from the frames' parsed segments and source rows, one piece at a time."""
    local, remote = array.array("Q"), array.array("Q")
    for frame, name in claimed:
        width, base = storage.row_bytes[name], storage.tensors[name].data_ptr()
        for (row, rows), source_row in zip(frame.segments, frame.source_rows, strict=True):
            length = rows * width
            local.extend((base + row * width, length))
            remote.extend((frame.source_base + source_row * width, length))
    return local, remote


def _calls(
    local: array.array[int], remote: array.array[int]
) -> Iterator[tuple[array.array[int], array.array[int], int]]:
    """Matching vectors `local` and `remote` as calls of at most `READ_SLICE_BYTES` and `IOV_MAX` entries
    each, a piece cut where a call ends inside it."""
    piece_ends = ends(local)  # the same for `remote`: its pieces have the same lengths
    start, first = 0, 0
    while start < piece_ends[-1]:
        end = min(start + READ_SLICE_BYTES, piece_ends[-1])
        last = bisect.bisect_left(piece_ends, end)
        if last - first >= IOV_MAX:
            last = first + IOV_MAX - 1
            end = piece_ends[last]
        yield cut(local, piece_ends, start, end), cut(remote, piece_ends, start, end), end - start
        start, first = end, bisect.bisect_right(piece_ends, end)

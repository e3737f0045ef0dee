"""Read frames (`transport.links.ucx.cma`, `transport.links.ucx.reads`): cross-memory reads land scattered rows exactly,
refusals are named, receipts answer groups in order. Reads from this very process (the kernel's call is
the same for any process it may read); between processes: test_transfer_ucx_processes.py."""

from __future__ import annotations

import array
import ctypes
import itertools
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transport.harness import embedding_layout, poisoned_storage, random_storage, shuffled_pool
from tests.waiting import wait_until_blocking
from transport.bulk.frame_plan import plan_bundles
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig, UcxCopies
from transport.endpoint import open_endpoint
from transport.errors import LinkClosed
from transport.links.ucx import cma
from transport.links.ucx.cma import (
    CHUNK_BYTES,
    IOV_MAX,
    PROBE_ADDRESS,
    PROBE_BYTES,
    CmaFailed,
    read,
    readable,
)
from transport.links.ucx.connect import _reads
from transport.links.ucx.frames import UcxFrameError, descriptor_body, parse_descriptors
from transport.links.ucx.reads import (
    FEW_SMALL_PIECES,
    READ_SLICE_BYTES,
    Receipts,
    _few_vectors,
    _table_vectors,
    _vectors,
    read_group,
    read_groups,
    reads_every_piece,
    reads_of,
    reads_piece,
    write_plan,
)
from transport.links.ucx.scatter import UcpFailed
from transport.memory.storage import PoolStorage

LAYOUT = embedding_layout(block_size=16, hidden=1024)  # 4 KiB rows: a block's embeds are 64 KiB
NAMES = [spec.name for spec in LAYOUT.buffers]
ROW_BYTES = [spec.bytes_per_token for spec in LAYOUT.buffers]


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """Rows as bytes: random bits make NaNs, which equal nothing as floats."""
    return rows.contiguous().view(torch.uint8)


def _vector(pieces: Sequence[tuple[int, int]]) -> array.array[int]:
    return array.array("Q", [value for piece in pieces for value in piece])


def test_a_read_lands_scattered_pieces_in_order() -> None:
    source = bytes(random.Random(1).randbytes(64 * 1024))
    landed = ctypes.create_string_buffer(len(source))
    held = ctypes.create_string_buffer(source, len(source))
    base, into = ctypes.addressof(held), ctypes.addressof(landed)
    cuts = [(0, 4096), (40960, 8192), (4096, 36864), (49152, 16384)]  # source ranges, read in this order
    remote = _vector([(base + start, length) for start, length in cuts])
    at = 0
    local_pieces = []
    for _start, length in cuts:
        local_pieces.append((into + at, length))
        at += length
    read(os.getpid(), _vector(local_pieces), remote, len(source))
    assert landed.raw == b"".join(source[start : start + length] for start, length in cuts)


def _cuts(data: st.DataObject, total: int, pieces: int) -> list[tuple[int, int]]:
    """`total` bytes cut into at most `pieces` ranges `(start, length)`, in order."""
    bounds = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=pieces - 1)))
    edges = [0, *bounds, total]
    return [(start, end - start) for start, end in itertools.pairwise(edges)]


@settings(max_examples=20, deadline=None)
@given(data=st.data(), lanes=st.integers(1, 5), extra=st.integers(0, 3 * CHUNK_BYTES))
def test_a_read_on_several_lanes_lands_exactly_what_one_lane_would(
    data: st.DataObject, lanes: int, extra: int
) -> None:
    """Both vectors cut anywhere (a lane's share may begin or end inside a piece on either side), the
    source pieces read in shuffled order: every byte lands where one lane would put it."""
    total = 2 * CHUNK_BYTES + extra
    source = random.Random(extra).randbytes(total)
    held = ctypes.create_string_buffer(source, total)
    landed = ctypes.create_string_buffer(total)
    pieces = _cuts(data, total, 40)
    order = data.draw(st.permutations(range(len(pieces))))
    remote = _vector([(ctypes.addressof(held) + pieces[i][0], pieces[i][1]) for i in order])
    local = _vector([(ctypes.addressof(landed) + start, length) for start, length in _cuts(data, total, 40)])
    read(os.getpid(), local, remote, total, lanes=lanes)
    assert landed.raw == b"".join(source[pieces[i][0] : pieces[i][0] + pieces[i][1]] for i in order)


def test_a_lane_that_fails_fails_the_read_with_its_reason_once() -> None:
    """Half the source, then all of it, unmapped: whichever lane meets it, the caller's read raises the
    first failed chunk's error, each reason once (lanes failing alike add no notes)."""
    size = 4 * CHUNK_BYTES
    held, landed = ctypes.create_string_buffer(size), ctypes.create_string_buffer(2 * size)
    local = _vector([(ctypes.addressof(landed), 2 * size)])
    pid = os.getpid()
    efault = rf"^reading process {pid}'s memory: EFAULT: Bad address$"  # pytest matches notes too
    for unmapped_from in (size, 0):
        remote = [(ctypes.addressof(held), size), (16, size)][unmapped_from // size :]
        remote += [(16, size)] * (2 - len(remote))
        with pytest.raises(CmaFailed, match=efault):
            read(pid, local, _vector(remote), 2 * size, lanes=3)


def test_refused_reads_name_the_process_and_the_kernels_reason() -> None:
    landed = ctypes.create_string_buffer(64)
    local = _vector([(ctypes.addressof(landed), 64)])
    pid = os.getpid()
    with pytest.raises(CmaFailed, match=rf"^reading process {pid}'s memory: EFAULT: Bad address$"):
        read(pid, local, _vector([(16, 64)]), 64)  # no process maps its first page
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True, timeout=60
    )
    dead = int(gone.stdout)
    with pytest.raises(CmaFailed, match=rf"^reading process {dead}'s memory: ESRCH: No such process$"):
        read(dead, local, _vector([(16, 64)]), 64)
    with pytest.raises(ValueError, match=rf"^I/O vectors of {IOV_MAX + 1} and 1 entries; at most {IOV_MAX}$"):
        read(pid, _vector([(ctypes.addressof(landed), 0)] * (IOV_MAX + 1)), local, 64)


def test_the_probe_reads_back_only_at_the_senders_probe_address() -> None:
    assert readable(os.getpid(), PROBE_ADDRESS) is None
    other = ctypes.create_string_buffer(b"x" * len(PROBE_BYTES), len(PROBE_BYTES))
    why = readable(os.getpid(), ctypes.addressof(other))
    assert (
        why
        == f"process {os.getpid()}'s probe read back as {other.raw!r}: not a zigzag sender at that address"
    )
    assert readable(os.getpid(), 16) == f"reading process {os.getpid()}'s memory: EFAULT: Bad address"


def test_receipts_answer_read_groups_oldest_first_and_fail_when_the_link_closes() -> None:
    receipts = Receipts()
    with pytest.raises(UcxFrameError, match=r"^a receipt for 2 read frames, with no read group waiting$"):
        receipts.answered(2)
    first, second, third = receipts.expect(2, 64), receipts.expect(1, 32), receipts.expect(3, 96)
    with pytest.raises(UcxFrameError, match=r"^a receipt for 1 read frames; the oldest read group has 2$"):
        receipts.answered(1)
    receipts.answered(2)
    assert (first.completed, second.completed) == (True, False)
    first.check_error()
    receipts.fail_all("link x: the peer closed it")
    assert second.completed and third.completed
    with pytest.raises(UcpFailed, match=r"^no receipt for a read group: link x: the peer closed it$"):
        third.check_error()


class _Rounds:
    """The landing of one receiver session, as `ReceiveSession.claim` decides: rounds in `open` claim."""

    def __init__(self, storage: PoolStorage, open_rounds: set[int]) -> None:
        self.storage, self.open, self.claimed = storage, open_rounds, 0

    def claim(self, round: int, buffer: str, segments: Sequence[tuple[int, int]]) -> bool:
        self.claimed += 1
        return round in self.open


def _write(seed: int, count: int, blocks: int = 64) -> BulkWrite:
    rng = random.Random(seed)
    need = -(-count // 16)
    return BulkWrite(
        source=random_storage(LAYOUT, blocks, seed=seed),
        source_ids=rng.sample(range(blocks), need),
        source_offset=0,
        dest_ids=rng.sample(range(blocks), need),
        dest_offset=0,
        count=count,
        buffers=tuple(NAMES),
        landing_key=7,
        round=3,
    )


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), count=st.integers(1, 1000))
async def test_a_read_group_lands_every_claimed_row_and_nothing_else(seed: int, count: int) -> None:
    """Plan a write as a reading peer gets it, parse its read groups back, read them from this process:
    every row read lands where its run says, no other row changes. Read are the pieces of 16 KiB and
    more, or every piece of a write with few (`FEW_SMALL_PIECES`) smaller ones."""
    bulk = _write(seed, count)
    index = {name: place for place, name in enumerate(NAMES)}
    target, expected = poisoned_storage(LAYOUT, 64), poisoned_storage(LAYOUT, 64)
    landing = _Rounds(target, {3})
    read_rows = {name: 0 for name in NAMES}
    for is_read, group in write_plan(bulk, index, ROW_BYTES, reads=True, cuda_capable=False):
        if not is_read:
            continue
        bases = [bulk.source.tensors[frame.name].data_ptr() for frame in group]
        frames = parse_descriptors(descriptor_body(group, 7, 3, bases), ROW_BYTES)
        names = [NAMES[frame.buffer] for frame in frames]
        await read_group(os.getpid(), landing, frames, names, lambda: None)
        for frame, name in zip(frames, names, strict=True):
            for (row, rows), source_row in zip(frame.segments, frame.source_rows, strict=True):
                expected.flat(name)[row : row + rows] = bulk.source.flat(name)[source_row : source_row + rows]
                read_rows[name] += rows
    small = sum((run.rows < 4) + 2 for run in bulk.runs)  # embeds under 16 KiB, and every other piece
    read_all = small <= FEW_SMALL_PIECES
    assert reads_of(bulk, index, ROW_BYTES) is (reads_every_piece if read_all else reads_piece)
    if read_all:
        assert read_rows == {name: count for name in NAMES}
    else:  # every embeds run of at least 4 rows (16 KiB), each from where its run says
        embeds = sum(run.rows for run in bulk.runs if run.rows >= 4)
        assert read_rows == {"embeds": embeds, "token_ids": 0, "positions": 0}
    for run in (run for run in bulk.runs if read_all or run.rows >= 4):
        landed = expected.flat("embeds")[run.dst_row : run.dst_row + run.rows]
        assert torch.equal(
            _bytes(landed), _bytes(bulk.source.flat("embeds")[run.src_row : run.src_row + run.rows])
        )
    for name in NAMES:
        assert torch.equal(_bytes(target.flat(name)), _bytes(expected.flat(name)))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), count=st.integers(1, 300))  # 3 to about 60 pieces
def test_both_ways_of_building_a_groups_vectors_build_the_same(seed: int, count: int) -> None:
    """Python from the parsed tuples, numpy from the raw tables: the same I/O vectors for every read group
    of a write, small (at most `PYTHON_VECTOR_PIECES` pieces, which `_vectors` builds in Python) or not."""
    bulk = _write(seed, count)
    index = {name: place for place, name in enumerate(NAMES)}
    target = poisoned_storage(LAYOUT, 64)
    for is_read, group in write_plan(bulk, index, ROW_BYTES, reads=True, cuda_capable=False):
        if not is_read:
            continue
        bases = [bulk.source.tensors[frame.name].data_ptr() for frame in group]
        frames = parse_descriptors(descriptor_body(group, 7, 3, bases), ROW_BYTES)
        claimed = [(frame, NAMES[frame.buffer]) for frame in frames]
        few, table = _few_vectors(target, claimed), _table_vectors(target, claimed)
        assert few == table
        local, remote = few
        assert len(local) == len(remote) == 2 * sum(len(frame.segments) for frame in frames)
        assert _vectors(target, claimed) == few


async def test_a_group_larger_than_a_slice_is_read_in_slices_and_stops_once_the_link_closed() -> None:
    layout = embedding_layout(block_size=4, hidden=1024 * 1024)  # 4 MiB rows, 16 MiB a block
    source, target = random_storage(layout, 4, seed=3), poisoned_storage(layout, 4)
    bulk = BulkWrite(
        source=source,
        source_ids=[2, 0],
        source_offset=0,
        dest_ids=[1, 3],
        dest_offset=0,
        count=8,
        buffers=("embeds",),
        landing_key=7,
        round=0,
    )
    widths = [spec.bytes_per_token for spec in layout.buffers]
    ((is_read, group),) = read_groups(plan_bundles(bulk, {"embeds": 0}, widths, reads_piece))
    assert is_read and sum(frame.length for frame in group) == 2 * READ_SLICE_BYTES
    frames = parse_descriptors(descriptor_body(group, 7, 0, [source.tensors["embeds"].data_ptr()]), widths)
    calls = 0

    def check_open() -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise LinkClosed("link x: closed")

    with pytest.raises(LinkClosed, match=r"^link x: closed$"):
        await read_group(os.getpid(), _Rounds(target, {0}), frames, ["embeds"], check_open)
    assert calls == 2  # one slice read, the second never
    gone = _Rounds(target, set())  # a round no longer open: nothing is read
    await read_group(os.getpid(), gone, frames, ["embeds"], lambda: None)
    await read_group(os.getpid(), None, frames, ["embeds"], lambda: None)  # a transfer no longer here
    assert gone.claimed == 1
    assert torch.equal(_bytes(target.flat("embeds")[4:8]), _bytes(source.flat("embeds")[8:12]))
    poisoned = poisoned_storage(layout, 4).flat("embeds")
    assert torch.equal(_bytes(target.flat("embeds")[12:16]), _bytes(poisoned[12:16]))


@pytest.mark.parametrize("copies", ["cma", "mixed"])
async def test_a_receiver_reads_the_sender_only_when_told_to_and_the_probe_reads_back(
    copies: UcxCopies,
) -> None:
    """`ucx_copies` "cma" and a probe that reads back: the receiver reads. A probe that does not (here:
    an address no process maps) is logged with the kernel's reason (the link then works as "mixed":
    `UcxLink.accepted`)."""
    storage, pool = random_storage(LAYOUT, 4, seed=9), shuffled_pool(4, 16, seed=9)
    async with open_endpoint("receiver", storage, pool, config=TransferConfig(ucx_copies=copies)) as endpoint:
        with structlog.testing.capture_logs() as logs:
            assert _reads(endpoint, os.getpid(), PROBE_ADDRESS) is (copies == "cma")
            assert not _reads(endpoint, os.getpid(), 16)
    expected = [
        {
            "event": "transfer.ucx_cma_refused",
            "endpoint": "receiver",
            "pid": os.getpid(),
            "reason": f"reading process {os.getpid()}'s memory: EFAULT: Bad address",
            "log_level": "info",
        }
    ]
    assert logs == (expected if copies == "cma" else [])


def test_an_interrupted_read_returns_only_once_no_lane_reads_any_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while the caller reads its chunk: `read` raises it only after the other lanes' chunks in
    progress are done, and no lane starts another (the caller's memory is its own again)."""
    caller = threading.get_ident()
    started: list[int] = []
    finished: list[int] = []

    def read_part(pid: int, local: array.array[int], remote: array.array[int], nbytes: int) -> None:
        if threading.get_ident() == caller:
            wait_until_blocking(lambda: started, "a lane starting a chunk", interval=0.001)
            raise KeyboardInterrupt
        started.append(nbytes)
        time.sleep(0.05)
        finished.append(nbytes)

    monkeypatch.setattr(cma, "_read_part", read_part)
    size = 16 * CHUNK_BYTES
    vector = _vector([(1 << 40, size)])
    with pytest.raises(KeyboardInterrupt):
        read(os.getpid(), vector, vector, size, lanes=2)
    assert finished == started and len(started) == 1  # waited for, and no chunk after the interrupt

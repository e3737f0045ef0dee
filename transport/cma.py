"""Reading another process's memory with the kernel's cross-memory attach (`process_vm_readv`, issue 7).

Between two processes of one host, UCX moves a large message by the receiver reading the sender's
memory with this same call (its `cma` transport, "zero-copy read from remote" in `UCX_PROTO_INFO=y`), in
fragments of about 512 KiB, one progress event each. `read` takes both sides' I/O vectors whole: a
frame's scattered pieces in one call (`transport.ucx_reads`). On the 2-vCPU VM of docs/benchmarks.md,
64 MiB as 32 shuffled 2 MiB pieces read in 4.9 ms where raw ucxx moved one contiguous 64 MiB message
in 5.7 ms; as 2 048 pieces of 32 KiB, in 8.0 ms.

One thread does not reach the memory's bandwidth: the kernel pins each source page and copies it on the
calling thread. `read` with `lanes` > 1 cuts a large call into that many parts of equal bytes and reads
all but the first on threads of Trio's thread cache while the caller reads the first; 64 MiB of 2 MiB
pieces in 3.1–5.0 ms on two threads against 5.8–6.8 ms on one (the same VM, docs/benchmarks.md).

The kernel allows the call where `ptrace` would be allowed (same user, and Yama's `ptrace_scope`), so a
receiver first reads a probe the sender names (`PROBE`, `readable`) and falls back to UCX if that fails.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import errno
import itertools
import os
import threading
from functools import partial
from typing import Any, Final, final

import outcome
import trio

IOV_MAX: Final = 1024  # the most entries of one I/O vector that Linux takes in one call
# A lane's share of a call below this is read on the caller's thread: handing it to another thread
# (20–60 µs) would cost more than the copy saves.
LANE_MIN_BYTES: Final = 1024 * 1024
# What a sender exposes for the receiver's probe read, at an address it sends in its UCX accept body.
PROBE_BYTES: Final = b"zigzag cma probe"
_PROBE: Final = ctypes.create_string_buffer(PROBE_BYTES, len(PROBE_BYTES))
PROBE_ADDRESS: Final = ctypes.addressof(_PROBE)


@final
class CmaFailed(Exception):
    """A cross-memory read failed or came short; the message says which process and why."""


def _libc_call() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return function


_process_vm_readv: Final = _libc_call()


def read(pid: int, local: array.array[int], remote: array.array[int], nbytes: int, *, lanes: int = 1) -> None:
    """Copy `nbytes` from process `pid`'s memory at I/O vector `remote` into this process's `local`.

    Both vectors are flat `Q` arrays of `(address, length)` pairs (`transport.ucp_scatter.io_vector`), each
    adding up to `nbytes`, at most `IOV_MAX` entries each. With `lanes` > 1 and at least `LANE_MIN_BYTES`
    a lane, the call is cut into `lanes` parts of equal bytes, read at once on this thread and
    `lanes - 1` threads of Trio's cache. Blocks this thread until every part is read (about 0.1 ms per
    MiB on one lane): no part outlives the call, so the caller owns `local` again when it returns, even
    when it raises. Raises `CmaFailed` for any error or a short read (the first part's that failed; the
    others' as notes): the data in `local` is then undefined."""
    if _process_vm_readv is None:
        raise CmaFailed("process_vm_readv is not available on this system")
    entries_local, entries_remote = len(local) // 2, len(remote) // 2
    if entries_local > IOV_MAX or entries_remote > IOV_MAX:
        raise ValueError(f"I/O vectors of {entries_local} and {entries_remote} entries; at most {IOV_MAX}")
    lanes = max(1, min(lanes, nbytes // LANE_MIN_BYTES))
    if lanes == 1:
        _read_part(pid, local, remote, nbytes)
        return
    cuts = [nbytes * part // lanes for part in range(lanes + 1)]
    parts = [
        (_cut(local, start, end), _cut(remote, start, end), end - start)
        for start, end in itertools.pairwise(cuts)
    ]
    outcomes: list[outcome.Outcome[None] | None] = [None] * lanes
    finished = threading.Semaphore(0)
    for index in range(1, lanes):
        trio.lowlevel.start_thread_soon(
            partial(_read_part, pid, *parts[index]),
            partial(_deliver, outcomes, index, finished),
            name="zigzag cma read",
        )
    outcomes[0] = outcome.capture(_read_part, pid, *parts[0])
    for _ in range(1, lanes):
        finished.acquire()
    failures = [result.error for result in outcomes if isinstance(result, outcome.Error)]
    if failures:
        first = failures[0]
        for other in failures[1:]:
            first.add_note(f"another part of the same read: {other}")
        raise first


def _deliver(
    outcomes: list[outcome.Outcome[None] | None],
    index: int,
    finished: threading.Semaphore,
    result: outcome.Outcome[None],
) -> None:
    """A lane's thread: its part's outcome, then the caller's wake-up."""
    outcomes[index] = result
    finished.release()


def _cut(vector: array.array[int], start: int, end: int) -> array.array[int]:
    """The entries of I/O vector `vector` that cover its bytes `[start, end)`, the end ones trimmed."""
    ends = list(itertools.accumulate(vector[1::2]))
    first = bisect.bisect_right(ends, start)
    last = bisect.bisect_left(ends, end)
    part = vector[2 * first : 2 * last + 2]
    skip = start - (ends[first] - vector[2 * first + 1])
    part[0] += skip
    part[1] -= skip
    part[-1] -= ends[last] - end
    return part


def _read_part(pid: int, local: array.array[int], remote: array.array[int], nbytes: int) -> None:
    local_address, _ = local.buffer_info()
    remote_address, _ = remote.buffer_info()
    got = _process_vm_readv(pid, local_address, len(local) // 2, remote_address, len(remote) // 2, 0)
    if got < 0:
        code = ctypes.get_errno()
        raise CmaFailed(
            f"reading process {pid}'s memory: {errno.errorcode.get(code, code)}: {os.strerror(code)}"
        )
    if got != nbytes:
        raise CmaFailed(f"reading process {pid}'s memory: {got} of {nbytes} bytes (its memory ends there)")


def readable(pid: int, probe_address: int) -> str | None:
    """None when this process may read process `pid`'s memory (its `PROBE_BYTES` at `probe_address`
    read back as they are); otherwise why not, for the log."""
    landed = ctypes.create_string_buffer(len(PROBE_BYTES))
    local = array.array("Q", (ctypes.addressof(landed), len(PROBE_BYTES)))
    remote = array.array("Q", (probe_address, len(PROBE_BYTES)))
    try:
        read(pid, local, remote, len(PROBE_BYTES))
    except CmaFailed as exc:
        return str(exc)
    if landed.raw != PROBE_BYTES:
        return f"process {pid}'s probe read back as {landed.raw!r}: not a zigzag sender at that address"
    return None

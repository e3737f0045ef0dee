"""Reading another process's memory with the kernel's cross-memory attach (`process_vm_readv`).

Between two processes of one host, UCX moves a large message by the receiver reading the sender's
memory with this same call (its `cma` transport, "zero-copy read from remote" in `UCX_PROTO_INFO=y`), in
fragments of about 512 KiB, one progress event each. `read` takes both sides' I/O vectors whole: a
frame's scattered pieces in one call (`transport.links.ucx.reads`). On a 2-vCPU VM, 64 MiB as 32
shuffled 2 MiB pieces read in 4.9 ms where raw ucxx moved one contiguous 64 MiB message in 5.7 ms; as
2 048 pieces of 32 KiB, in 8.0 ms.

One thread does not reach the memory's bandwidth: the kernel pins each source page and copies it on the
calling thread. `read` with `lanes` > 1 cuts a large call into chunks that the caller and threads of
Trio's thread cache claim one at a time; 64 MiB of 2 MiB pieces in 4.2–5.2 ms on two lanes against
5.1–5.9 ms on one (the same VM).

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
from typing import Any, Final, final

import outcome
import trio

IOV_MAX: Final = 1024  # the most entries of one I/O vector that Linux takes in one call
# What a lane claims at a time when several read one call (`read`): about 0.1 ms of copying, so a lane
# never waits long for another's last chunk; a call smaller than two is read on the caller's thread.
CHUNK_BYTES: Final = 1024 * 1024
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

    Both vectors are flat `Q` arrays of `(address, length)` pairs (`transport.links.ucx.scatter.io_vector`),
    each adding up to `nbytes`, at most `IOV_MAX` entries each. With `lanes` > 1 and at least two
    `CHUNK_BYTES`, the call is cut into chunks that this thread and `lanes - 1` threads of Trio's cache read,
    each claiming the next chunk when it is free (`_SharedRead`). Blocks this thread until every
    chunk is read (about 0.1 ms per MiB on one lane): no read outlives the call, so the caller owns
    `local` again when it returns, even when it raises. Raises `CmaFailed` for any error or a short read
    (the first chunk's that failed; other reasons as notes): the data in `local` is then undefined."""
    if _process_vm_readv is None:
        raise CmaFailed("process_vm_readv is not available on this system")
    entries_local, entries_remote = len(local) // 2, len(remote) // 2
    if entries_local > IOV_MAX or entries_remote > IOV_MAX:
        raise ValueError(f"I/O vectors of {entries_local} and {entries_remote} entries; at most {IOV_MAX}")
    if lanes == 1 or nbytes < 2 * CHUNK_BYTES:
        _read_part(pid, local, remote, nbytes)
        return
    cuts = [*range(0, nbytes, CHUNK_BYTES), nbytes]
    local_ends, remote_ends = ends(local), ends(remote)
    shared = _SharedRead(
        pid,
        [
            (cut(local, local_ends, start, end), cut(remote, remote_ends, start, end), end - start)
            for start, end in itertools.pairwise(cuts)
        ],
    )
    for _ in range(min(lanes, len(cuts) - 1) - 1):
        trio.lowlevel.start_thread_soon(shared.lane, _report, name="zigzag cma read")
    shared.run()


@final
class _SharedRead:
    """One `read` on several lanes. Chunks are claimed one at a time by whichever lane is free, so a lane
    whose thread starts late (its core busy) reads fewer of them instead of holding the read up. The
    caller is a lane too; once no chunk is left it waits only for chunks other lanes are reading at that
    moment: a thread that starts later finds the read closed and touches no memory.

    Invariant: after `run` returns or raises, no lane reads into the caller's memory."""

    def __init__(self, pid: int, chunks: list[tuple[array.array[int], array.array[int], int]]) -> None:
        self._pid, self._chunks, self._next = pid, chunks, 0
        self._lock = threading.Lock()  # guards everything below
        self._reading = 0  # other lanes inside `lane`
        self._closed = False
        self._failures: list[tuple[int, BaseException]] = []
        self._idle = threading.Event()

    def lane(self) -> None:
        """Another thread's lane."""
        with self._lock:
            if self._closed:
                return
            self._reading += 1
        result = outcome.capture(self._drain)
        with self._lock:
            if isinstance(result, outcome.Error):  # not a refused read (`_drain` keeps those): a defect
                self._failures.append((len(self._chunks), result.error))
            self._reading -= 1
            if self._closed and not self._reading:
                self._idle.set()

    def run(self) -> None:
        """The caller's lane, then the wait for the others (also when interrupted: `_close`); raises the
        first failed chunk's error."""
        try:
            self._drain()
        finally:
            self._close()
        if self._failures:
            failures = [error for _index, error in sorted(self._failures, key=lambda failure: failure[0])]
            first, seen = failures[0], {str(failures[0])}
            for other in failures[1:]:  # chunks read at once often fail alike: each reason once
                if str(other) not in seen:
                    seen.add(str(other))
                    first.add_note(f"another chunk of the same read: {other}")
            raise first

    def _close(self) -> None:
        """No chunk is started after this; returns once none is being read."""
        with self._lock:
            self._closed = True
            others = self._reading
        if others:
            try:
                self._idle.wait()
            except BaseException:  # a KeyboardInterrupt: a lane may still write the caller's memory
                self._idle.wait()
                raise

    def _drain(self) -> None:
        """Read chunks until none is left (or one failed: the others are not started)."""
        while True:
            with self._lock:
                if self._closed or self._failures or self._next == len(self._chunks):
                    return
                index, self._next = self._next, self._next + 1
            try:
                _read_part(self._pid, *self._chunks[index])
            except CmaFailed as exc:  # handed to the caller's thread, which raises it
                with self._lock:
                    self._failures.append((index, exc))


def _report(result: outcome.Outcome[None]) -> None:
    result.unwrap()  # `lane` raises nothing: it hands every error to the caller


def ends(vector: array.array[int]) -> list[int]:
    """Where each entry of I/O vector `vector` ends, in bytes from its start."""
    return list(itertools.accumulate(vector[1::2]))


def cut(vector: array.array[int], ends: list[int], start: int, end: int) -> array.array[int]:
    """The entries of I/O vector `vector` (`ends`: `ends(vector)`) that cover its bytes `[start, end)`,
    the end ones trimmed."""
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

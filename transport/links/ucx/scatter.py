"""Scattered receives, gathered sends and length-checked receives straight from libucp:
UCP's I/O-vector datatype, which ucxx lacks, and the received length, which ucxx does not report.

ucxx 0.52 receives a message into one contiguous buffer only. A packed bundle's bytes belong to rows
scattered over block memory, so they used to land in a host chunk and be copied again into the rows, on
the receiving replica's own thread. `ucp_tag_recv_nbx` also takes an I/O vector (`ucp_dt_iov_t[]`): the
message lands in the rows themselves. And with an I/O vector on the receiving side UCX picks another
rendezvous protocol between processes of one host — the *sender* writes the bytes (CMA
`process_vm_writev`) instead of the receiver reading them — so the copy runs on the sender's core and the
receiver's thread stays free for its Python. Raw, 64 MiB in 64 messages into 2048 scattered 32 KiB rows:
7.3–8.2 ms this way, 9.0–9.6 ms into contiguous buffers (on a 2-vCPU VM). `ucp_tag_send_nbx` takes
one too: a bundle goes out from the rows where they are, without being packed into a chunk first.

That protocol is why `transport.links.ucx.link` posts scattered receives only to a peer process it can watch:
a receive the sender has begun to write completes only when the sender says so, and cannot be cancelled. If
the sender dies first it never completes — but a dead process writes nothing, so its blocks are safe once
`process_gone(peer)` says so (`UcxLink.quiesce`).

The same call with UCP's contiguous datatype (`ContiguousReceive`) is ucxx's own `tag_recv` plus one
thing ucxx leaves out (rapidsai/ucxx#104): the received length is checked, so a message shorter than its
receive fails it instead of leaving the rest of the rows stale. `transport.links.ucx.worker` posts every
bulk receive into host memory that way (control messages are received at their probed size).

This module calls seven functions of the libucp (and libucs) that ucxx already loaded (found by soname;
never loaded a second time), on the worker and endpoint handles ucxx exposes, through ctypes:
`ucp_tag_recv_nbx`, `ucp_tag_send_nbx`, `ucp_request_check_status`, `ucp_tag_recv_request_test` (a
receive checks the message filled it: a shorter one is an error, not stale rows),
`ucp_request_cancel`, `ucp_request_free` and `ucs_status_string`. `_RequestParam` mirrors
`ucp_request_param_t` of UCX 1.x (checked against the ucp.h of the UCX that ucxx 0.52 bundles, 1.21);
the tests land real bytes through it.
"""

from __future__ import annotations

import array
import ctypes
import functools
import os
from collections.abc import Iterable
from typing import Any, Final, final

_IN_PROGRESS: Final = 1
_OK: Final = 0
_FIELD_DATATYPE: Final = 1 << 3
_NO_IMMEDIATE: Final = 1 << 16  # UCP_OP_ATTR_FLAG_NO_IMM_CMPL
_DATATYPE_IOV: Final = 2
_DATATYPE_BYTES: Final = (1 << 3) | 0  # ucp_dt_make_contig(1): contiguous bytes
_ALL_TAG_BITS: Final = (1 << 64) - 1
_ERROR_POINTERS: Final = 100  # UCS_ERR_LAST: a status pointer at or above 2**64 - 100 is an error code


class _RequestParam(ctypes.Structure):
    """`ucp_request_param_t` (ucp.h, UCX 1.x), the fields up to `memh`."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class _TagRecvInfo(ctypes.Structure):
    """`ucp_tag_recv_info_t`."""

    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


class _Iov(ctypes.Structure):
    """`ucp_dt_iov_t`."""

    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


@final
class UcpFailed(Exception):
    """An operation posted straight through UCP could not be posted, or ended in error (cancelled, a
    message longer or shorter than its receive)."""


_U64: Final = ctypes.c_uint64


def _bind(function: Any, restype: Any, *argtypes: Any) -> Any:
    """`function` of a loaded library, with its C signature set."""
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


@final
class _Ucp:
    """The libucp (and libucs) functions this module calls, with their C signatures."""

    def __init__(self) -> None:
        ucp = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD)  # ucxx's own copy, already loaded
        ucs = ctypes.CDLL("libucs.so.0", mode=os.RTLD_NOLOAD)
        pointer, param, status = (
            ctypes.c_void_p,
            ctypes.POINTER(_RequestParam),
            ctypes.c_int8,
        )  # a packed enum
        # (worker, buffer, count, tag, tag mask, param) and (endpoint, buffer, count, tag, param)
        self.recv = _bind(ucp.ucp_tag_recv_nbx, pointer, pointer, pointer, ctypes.c_size_t, _U64, _U64, param)
        self.send = _bind(ucp.ucp_tag_send_nbx, pointer, pointer, pointer, ctypes.c_size_t, _U64, param)
        self.check_status = _bind(ucp.ucp_request_check_status, status, pointer)
        self.recv_test = _bind(ucp.ucp_tag_recv_request_test, status, pointer, ctypes.POINTER(_TagRecvInfo))
        self.cancel = _bind(ucp.ucp_request_cancel, None, pointer, pointer)
        self.free = _bind(ucp.ucp_request_free, None, pointer)
        self.status_string = _bind(ucs.ucs_status_string, ctypes.c_char_p, status)
        self.iov_param = _RequestParam(op_attr_mask=_FIELD_DATATYPE, datatype=_DATATYPE_IOV)
        self.receive_param = _RequestParam(
            op_attr_mask=_FIELD_DATATYPE | _NO_IMMEDIATE, datatype=_DATATYPE_IOV
        )
        self.contiguous_param = _RequestParam(
            op_attr_mask=_FIELD_DATATYPE | _NO_IMMEDIATE, datatype=_DATATYPE_BYTES
        )
        # Sends may complete at once (an eager message is copied out inside the call): no request.
        self.contiguous_send_param = _RequestParam(op_attr_mask=_FIELD_DATATYPE, datatype=_DATATYPE_BYTES)

    def describe(self, status: int) -> str:
        text = self.status_string(status)
        return f"{text.decode() if text else 'unknown status'} ({status})"


@functools.cache
def _ucp() -> _Ucp:
    """Bound on first use, after ucxx has loaded libucp (`transport.links.ucx.library.libucxx`). Raises
    `UcpFailed` (not cached) when that library is not found under the soname it should have."""
    try:
        return _Ucp()
    except OSError as exc:
        raise UcpFailed(f"libucp, as ucxx loaded it, not found: {exc}") from exc


class _UcpRequest:
    """One posted tag operation on an I/O vector (`io_vector`: address and length of each segment, in
    message order) or on one contiguous buffer.

    Quacks like a ucxx request where `UcxWorker` needs it (`completed`, `check_error`). Invariant: the
    UCP request is freed exactly once, when `completed` first sees it done; `keep` (what owns the memory
    the operation points into) and the I/O vector stay referenced by this object until then."""

    __slots__ = ("_error", "_iov", "_keep", "_request", "_worker", "_worker_handle")

    def __init__(
        self,
        worker: Any,
        worker_handle: int,
        iov: ctypes.Array[_Iov] | None,
        pointer: int | None,
        keep: object,
    ) -> None:
        if pointer is not None and pointer >= (1 << 64) - _ERROR_POINTERS:
            raise UcpFailed(f"{self._what} not posted: {_ucp().describe(pointer - (1 << 64))}")
        self._worker = worker  # the ucxx worker stays alive while its request may be touched
        self._worker_handle = worker_handle
        self._iov: ctypes.Array[_Iov] | None = iov
        self._keep: object = keep
        self._request: int | None = pointer  # None: completed at once (UCS_OK)
        self._error: str | None = None

    _what = "operation"

    @property
    def completed(self) -> bool:
        request = self._request
        if request is None:
            return True
        ucp = _ucp()
        status, problem = self._status(ucp, request)
        if status == _IN_PROGRESS:
            return False
        ucp.free(request)
        self._request = None
        self._iov = self._keep = None
        self._error = ucp.describe(status) if status != _OK else problem
        return True

    def _status(self, ucp: _Ucp, request: int) -> tuple[int, str | None]:
        """The request's status, and what is wrong with it beyond that (None: nothing)."""
        return ucp.check_status(request), None

    def check_error(self) -> None:
        """Raise `UcpFailed` if the completed operation ended in error."""
        if self._error is not None:
            raise UcpFailed(self._error)

    def cancel(self) -> None:
        """Ask UCX to cancel: a receive not yet matched (or a send UCX can still take back) completes in
        error on the next progress; one whose bytes are already moving goes on until they are in."""
        if not self.completed:
            assert self._request is not None
            _ucp().cancel(self._worker_handle, self._request)


def io_vector(segments: Iterable[tuple[int, int]]) -> array.array[int]:
    """`(address, length)` segments as an I/O vector: the flat `Q` array the classes below take (an
    array, not a list of tuples: a bundle has hundreds of segments, and ctypes structs cost ~1 µs each)."""
    return array.array("Q", [value for segment in segments for value in segment])


def _iov(vector: array.array[int]) -> ctypes.Array[_Iov]:
    return (_Iov * (len(vector) // 2)).from_buffer(vector)


class _Receive(_UcpRequest):
    """A tag receive that checks the message filled it: ucxx's own receive reports no length, and a
    shorter message would leave the rest of its rows stale."""

    __slots__ = ("_expected",)
    _what = "receive"
    _expected: int

    def _status(self, ucp: _Ucp, request: int) -> tuple[int, str | None]:
        info = _TagRecvInfo()
        status = ucp.recv_test(request, ctypes.byref(info))
        if status == _OK and info.length != self._expected:
            return status, f"a message of {info.length} bytes for a receive of {self._expected}"
        return status, None


@final
class ScatteredReceive(_Receive):
    """A tag receive of the next message tagged exactly `tag` on ucxx `worker`, into I/O vector `vector`."""

    __slots__ = ()

    def __init__(self, worker: Any, tag: int, vector: array.array[int], keep: object) -> None:
        ucp, iov = _ucp(), _iov(vector)
        self._expected = sum(vector[1::2])
        # Never completed at once, so `_status` always sees the message's length.
        handle = handle_of(worker)
        pointer = ucp.recv(handle, iov, len(iov), tag, _ALL_TAG_BITS, ucp.receive_param)
        super().__init__(worker, handle, iov, pointer, keep)


@final
class ContiguousReceive(_Receive):
    """A tag receive of the next message tagged exactly `tag` on ucxx `worker`, into the `length` bytes
    at `address` (memory that `keep` owns). The same UCP call as ucxx's `tag_recv` — UCX finds the
    memory's type and picks the same protocol — with the message's length checked."""

    __slots__ = ()

    def __init__(self, worker: Any, tag: int, address: int, length: int, keep: object) -> None:
        ucp = _ucp()
        self._expected = length
        handle = handle_of(worker)
        # Never completed at once, so `_status` always sees the message's length.
        pointer = ucp.recv(handle, address, length, tag, _ALL_TAG_BITS, ucp.contiguous_param)
        super().__init__(worker, handle, None, pointer, keep)


@final
class GatheredSend(_UcpRequest):
    """A tag send of I/O vector `vector`'s bytes, back to back, as one message on ucxx `endpoint` (of
    ucxx `worker`)."""

    __slots__ = ()
    _what = "send"

    def __init__(self, worker: Any, endpoint: Any, tag: int, vector: array.array[int], keep: object) -> None:
        ucp, iov = _ucp(), _iov(vector)
        pointer = ucp.send(handle_of(endpoint), iov, len(iov), tag, ucp.iov_param)
        super().__init__(worker, handle_of(worker), iov, pointer, keep)


@final
class ContiguousSend(_UcpRequest):
    """A tag send of the `length` bytes at `address` (memory that `keep` owns) as one message on ucxx
    `endpoint` (of ucxx `worker`): ucxx's own `tag_send` without its request object. That took 10 µs a
    message warm and 76-96 µs for the first one after a bulk copy had flushed the caches (a transfer's
    grant); posted this way the whole first send took 29 µs, most of it UCP's. An eager message (control
    messages are) completes inside the call."""

    __slots__ = ()
    _what = "send"

    def __init__(self, worker: Any, endpoint: Any, tag: int, address: int, length: int, keep: object) -> None:
        ucp = _ucp()
        pointer = ucp.send(handle_of(endpoint), address, length, tag, ucp.contiguous_send_param)
        super().__init__(worker, handle_of(worker), None, pointer, keep)

    @classmethod
    def of_bytes(cls, worker: Any, endpoint: Any, tag: int, body: bytes) -> ContiguousSend:
        """The send of `body`, from where its bytes are (ctypes points at the object's own buffer)."""
        address = ctypes.cast(ctypes.c_char_p(body), ctypes.c_void_p).value or 0
        return cls(worker, endpoint, tag, address, len(body), body)


def handle_of(ucxx_object: Any) -> int:
    """The UCP handle (`ucp_worker_h`, `ucp_ep_h`) of a ucxx `UCXWorker` or `UCXEndpoint`."""
    return int(ucxx_object.handle)

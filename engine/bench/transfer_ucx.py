"""The transfer benchmark's UCX cases: zigzag over ucx against raw ucxx between two processes.

- `ucx_64MiB`: one 64 MiB embedding transfer (4096-wide rows, 128-token blocks, both free lists
  shuffled, unknown length: default grant then more rounds, window of grants) from a sender process
  over `--transport ucx`, against the raw ucxx core API moving the same number of bytes between two
  processes: one tag receive into a preallocated buffer, one tag send from another process, both
  workers busy-polled during the transfer. GB/s, higher is better; goal ratio >= 0.85.
  The receiver reads the sender's pieces on two threads by default (`ucx_read_lanes`); raw ucxx copies on
  one, so `ucx_64MiB_one_lane` is the same transfer read on the receiver's thread alone.
- `ucx_64MiB_mixed`: `ucx_64MiB` with `ucx_copies` "mixed" (UCX's own rendezvous reads the direct
  pieces, 512 KiB a progress event; the default, "cma", reads them with a few `process_vm_readv` calls of
  zigzag's) against the same raw ucxx message.
- `ucx_64MiB_sender_writes`: `ucx_64MiB` with `ucx_copies` "sender" (scattered receives: the sender
  writes each piece into the receiver's rows) against the same raw ucxx message: which of the two
  protocols suits this host.
- `ucx_64MiB_vs_iov`: that sender-writes transfer against raw UCP with the same protocol (the receive
  takes an I/O vector, so UCX has the sender write the bytes): the best this host's UCX does for these
  bytes that way, GB/s, higher is better.
- `ucx_kv_64MiB` (not with `--quick`): the KV layout, 16-token blocks of 32 KiB per buffer (read by the
  receiver by default; with "mixed", packed frames that land straight in their rows), length unknown
  (two rounds); `ucx_kv_64MiB_known`: the same with the length known, as a decode replica receives its
  prompt's KV (one round);
  `ucx_kv_64MiB_receiver_copies`: the same with `ucx_copies` "receiver" (each bundle lands in a host chunk
  the receiver unpacks).
- `ucx_1block_us`: one 516 KiB block (what a transfer costs beyond its bytes), µs, against a raw ucxx
  request and a reply of the same bytes; lower is better.
- `ucx_kv_small_us`: the KV of a 512-token prompt of a small model (1 MiB: 8 buffers of 256-byte rows,
  4 KiB per buffer and block, all packed), µs, against a raw ucxx request and a 1 MiB reply.
- `ucx_kv_512blocks_us` (not with `--quick`): the same model's KV for an 8192-token prompt (16 MiB in
  512 blocks, one round), µs, against a raw ucxx request and a 16 MiB reply: per-block work at scale.

UCX runs over `--ucx-tls` (default `sm`: shared memory, what one host offers without a NIC or GPU);
the benchmark sets `UCX_TLS` for itself and its children, as the entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Final

import numpy as np
import trio

from engine.bench.rows import Row, alternate, row, warmed
from engine.bench.transfer_peer import RAW_BYTES, Source, peer_process, serve_grants
from transport.endpoint import SenderDelivery, open_endpoint
from transport.links.ucx.library import libucxx
from transport.links.ucx.scatter import ScatteredReceive, io_vector

BENCH = "transfer"
ADDRESS: Final = 1  # raw baseline tags: the receiver's worker address, a request, the payload
REQUEST: Final = 2
PAYLOAD: Final = 3


def _poll_until(worker: Any, done: Callable[[], bool], idle: float | None = None) -> None:
    """Progress `worker` until `done()`; between events sleep on its fd when `idle` (blocking mode)."""
    while not done():
        worker.progress()
        if not done() and idle is not None and worker.arm():
            select.select([worker.epoll_file_descriptor], [], [], idle)


def _raw_worker(blocking: bool) -> tuple[Any, Any, Any]:
    """A worker on its own context: the raw baseline shares nothing with zigzag's UCX."""
    lib = libucxx()
    from ucxx._lib.arr import Array

    worker = lib.UCXWorker(lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP)))
    if blocking:
        worker.init_blocking_progress_mode()
    return lib, worker, Array


def _raw_sender(addresses: queue.Queue[bytes], stop: threading.Event) -> None:
    """The baseline's sender (a thread of the sender process): each request, a little-endian u64 byte
    count, gets that many bytes of the payload."""
    lib, worker, array = _raw_worker(blocking=True)
    addresses.put(worker.address.tobytes())
    peer = bytearray(4096)
    first = worker.tag_recv(array(memoryview(peer)), lib.UCXXTag(ADDRESS))
    _poll_until(worker, lambda: first.completed or stop.is_set(), idle=0.5)
    if stop.is_set():
        return
    length = int.from_bytes(peer[:4], "little")
    endpoint = lib.UCXEndpoint.create_from_worker_address(
        worker, lib.UCXAddress.create_from_buffer(bytes(peer[4 : 4 + length])), False
    )
    payload = np.frombuffer(os.urandom(RAW_BYTES), dtype=np.uint8).copy()
    request = bytearray(8)
    replies: dict[int, Any] = {}

    def completed(request: Any) -> Callable[[], bool]:
        return lambda: bool(request.completed) or stop.is_set()

    while not stop.is_set():
        asked = worker.tag_recv(array(memoryview(request)), lib.UCXXTag(REQUEST))
        _poll_until(worker, completed(asked), idle=0.5)
        if asked.completed:
            size = int.from_bytes(request, "little")
            reply = replies.setdefault(size, payload[:size])
            _poll_until(worker, completed(endpoint.tag_send(array(reply), lib.UCXXTag(PAYLOAD))))


async def _serve(source: Source, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """`source` on a sending endpoint listening over ucx, served as `serve_source` serves it on tcp."""
    send, receive = trio.open_memory_channel[SenderDelivery](1024)
    async with open_endpoint(
        f"{source.name}-sender", source.storage, source.pool, sender_control=send
    ) as endpoint:
        task_status.started(await endpoint.listen_on("ucx"))
        await serve_grants(endpoint, receive, source.ids, source.tokens)


def serve_ucx_sender() -> None:
    """The sender process: `python -c 'from engine.bench.transfer_ucx import serve_ucx_sender; ...'`.
    Reads `{"layouts": [...]}` on stdin, prints addresses and checksums as one JSON line, serves until
    stdin closes."""
    params = json.loads(sys.stdin.readline())
    addresses: queue.Queue[bytes] = queue.Queue()
    stop = threading.Event()
    raw = threading.Thread(target=_raw_sender, args=(addresses, stop))
    raw.start()
    try:
        trio.run(_serve_sender, params["layouts"], addresses.get())
    finally:
        stop.set()
        raw.join()


async def _serve_sender(layouts: list[str], raw_address: bytes) -> None:
    ready: dict[str, object] = {"raw": raw_address.hex()}
    async with trio.open_nursery() as nursery:
        for name in layouts:
            source = Source(name)
            ready[name] = await nursery.start(_serve, source)
            ready[f"{name}_crc"] = source.crc
        print(json.dumps(ready), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()


class RawReceiver:
    """The baseline's receiving side, in this process's main thread on its own UCX context."""

    def __init__(self, sender_address: str) -> None:
        self.lib, self.worker, self.array = _raw_worker(blocking=False)
        lib = self.lib
        self.endpoint = lib.UCXEndpoint.create_from_worker_address(
            self.worker, lib.UCXAddress.create_from_buffer(bytes.fromhex(sender_address)), False
        )
        own = self.worker.address.tobytes()
        hello = self.endpoint.tag_send(self.array(len(own).to_bytes(4, "little") + own), lib.UCXXTag(ADDRESS))
        _poll_until(self.worker, lambda: hello.completed)
        self.buffer = np.ones(RAW_BYTES, dtype=np.uint8)  # touched: no page faults in the timing
        self._arrays: dict[int, tuple[Any, Any]] = {}
        self._whole_buffer = io_vector([(int(self.buffer.ctypes.data), RAW_BYTES)])

    def gbps(self) -> float:
        return RAW_BYTES / self._exchange(RAW_BYTES) / 1e9

    def scattered_gbps(self) -> float:
        """As `gbps`, received by a UCP receive with an I/O vector (`transport.links.ucx.scatter`): UCX then
        has the sender write the bytes, the protocol zigzag's scattered receives get."""
        return RAW_BYTES / self._exchange(RAW_BYTES, scattered=True) / 1e9

    def median_us(self, nbytes: int) -> float:
        """Median µs of 50 request/reply exchanges with `nbytes` in the reply."""
        return statistics.median([self._exchange(nbytes) * 1e6 for _ in range(50)])

    def _exchange(self, nbytes: int, *, scattered: bool = False) -> float:
        """Seconds for one request and its reply of `nbytes`, received into the front of `buffer`."""
        lib = self.lib
        if nbytes not in self._arrays:  # made once: the timing holds the exchange only
            self._arrays[nbytes] = (
                self.array(self.buffer[:nbytes]),
                self.array(nbytes.to_bytes(8, "little")),
            )
        landed, ask = self._arrays[nbytes]
        start = time.perf_counter()
        if scattered:  # the whole buffer: `scattered_gbps` only
            received: Any = ScatteredReceive(self.worker, PAYLOAD, self._whole_buffer, self.buffer)
        else:
            received = self.endpoint.tag_recv(landed, lib.UCXXTag(PAYLOAD))
        asked = self.endpoint.tag_send(ask, lib.UCXXTag(REQUEST))
        _poll_until(self.worker, lambda: received.completed and asked.completed)
        seconds = time.perf_counter() - start
        received.check_error()
        return seconds


def ucx_rows(portal: Any, args: argparse.Namespace, repeats: int, receiver_factory: Any) -> Iterator[Row]:
    """The rows, alternating zigzag and raw; `receiver_factory` builds `transfer.Receiver`s."""
    os.environ["UCX_TLS"] = args.ucx_tls  # this process's and its children's UCX, set by the entry point
    # (layout, case, receiver overrides): the overridden cases are the default's with another setting, or
    # (`known_length`) with the length passed as a decode replica passes its prompt's.
    one_lane: dict[str, Any] = {"ucx_read_lanes": 1}
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("emb4096", "ucx_64MiB", {}),
        ("emb4096", "ucx_64MiB_one_lane", one_lane),
        ("emb4096", "ucx_64MiB_mixed", {"ucx_copies": "mixed"}),
        ("emb4096", "ucx_64MiB_sender_writes", {"ucx_copies": "sender"}),
    ] + (
        []
        if args.quick
        else [
            ("kv", "ucx_kv_64MiB", {}),
            ("kv", "ucx_kv_64MiB_known", {"known_length": True}),
            ("kv", "ucx_kv_64MiB_receiver_copies", {"ucx_copies": "receiver"}),
        ]
    )
    layouts = ["emb4096", "block", "kv_small"] + ([] if args.quick else ["kv", "kv_long"])
    with peer_process("engine.bench.transfer_ucx:serve_ucx_sender", {"layouts": layouts}) as (_child, ready):
        raw = RawReceiver(str(ready["raw"]))
        raw.gbps()
        if bool((raw.buffer == 1).all()):
            raise RuntimeError("the raw ucxx baseline received nothing")
        for source_name, case, config in cases:
            receiver = receiver_factory(f"{case}-receiver", source_name, **config)
            portal.call(receiver.open, portal, ready[source_name], None)
            receiver.checked(portal, ready[f"{source_name}_crc"])
            project, baseline = alternate(warmed(partial(receiver.gbps, portal)), warmed(raw.gbps), repeats)
            how = "".join(f", {key} {value}" for key, value in config.items() if key != "known_length")
            how += ", length known" if config.get("known_length") else ""
            goal = "no goal" if config else "goal >= 0.85"
            note = (
                f"{receiver.nbytes} bytes in {receiver.rounds} rounds, {source_name} layout, "
                f"UCX_TLS={args.ucx_tls}{how}; baseline {RAW_BYTES} bytes in one tag message; {goal}"
            )
            yield row(
                BENCH,
                case,
                "GB/s",
                "higher",
                project,
                baseline,
                "raw ucxx tag send/recv",
                unit="GB/s",
                note=note,
            )
            if case == "ucx_64MiB_sender_writes":
                yield _against_the_write_protocol(portal, receiver, raw, repeats, args)
        small = [("block", "ucx_1block_us", "one block"), ("kv_small", "ucx_kv_small_us", "")]
        for source_name, case, what in small + (
            [] if args.quick else [("kv_long", "ucx_kv_512blocks_us", "")]
        ):
            yield _small_row(portal, args, repeats, receiver_factory, ready, raw, source_name, case, what)


def _against_the_write_protocol(
    portal: Any, receiver: Any, raw: RawReceiver, repeats: int, args: argparse.Namespace
) -> Row:
    """`ucx_64MiB_vs_iov`: the `ucx_64MiB_sender_writes` transfer against raw UCP receiving with an I/O
    vector."""
    project, baseline = alternate(warmed(partial(receiver.gbps, portal)), warmed(raw.scattered_gbps), repeats)
    note = (
        f"{receiver.nbytes} bytes, emb4096 layout, UCX_TLS={args.ucx_tls}; baseline {RAW_BYTES} bytes in one "
        "tag message received with an I/O vector, which UCX has the sender write (zigzag's protocol there)"
    )
    return row(
        BENCH,
        "ucx_64MiB_vs_iov",
        "GB/s",
        "higher",
        project,
        baseline,
        "raw ucp tag send / I/O-vector receive",
        unit="GB/s",
        note=note,
    )


def _small_row(
    portal: Any,
    args: argparse.Namespace,
    repeats: int,
    receiver_factory: Any,
    ready: dict[str, Any],
    raw: RawReceiver,
    source_name: str,
    case: str,
    what: str,
) -> Row:
    """`case`: one small transfer of layout `source_name` from the sender process, µs (median of 50
    per figure), against a raw ucxx request and a reply of the same bytes."""
    receiver = receiver_factory(f"{case}-receiver", source_name)
    portal.call(receiver.open, portal, ready[source_name], None)
    receiver.checked(portal, ready[f"{source_name}_crc"])
    project, baseline = alternate(
        warmed(partial(receiver.median_us, portal)), warmed(partial(raw.median_us, receiver.nbytes)), repeats
    )
    what = what or f"{receiver.rounds} rounds, {source_name} layout"
    note = f"{receiver.nbytes} bytes, {what}, UCX_TLS={args.ucx_tls}; baseline: a raw ucxx request and reply"
    return row(
        BENCH,
        case,
        "us",
        "lower",
        project,
        baseline,
        "raw ucxx request/reply",
        unit="us",
        note=note,
    )

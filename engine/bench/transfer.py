"""transfer: the resumable block transfer over inproc and tcp, against a contiguous copy and a raw socket.

Cases (figures and machine in docs/benchmarks.md):
- `inproc_64MiB`: one embedding transfer between two in-process endpoints vs one contiguous torch
  `copy_` of the same bytes, same thread count. GB/s, higher is better.
- `tcp_tls_64MiB`: `tcp_64MiB` over links admitted by the cluster secret and speaking TLS
  (`--transfer-tls`, a throwaway CA made with `openssl`; skipped without it) vs the same without.
- `tcp_64MiB`: the same from a sender process over loopback TCP vs a raw blocking socket that
  `recv_into`s one preallocated buffer from a sender in that process. GB/s, higher is better.
- `resume_tcp_8MiB_k{2,4,8}`: 8 MiB over tcp, the receiver's grants capped so it takes k rounds; time
  over the one-round time (lower is better). `_k8_window1`: one grant per round trip (the seeds'
  design). `resume_tcp_8MiB_k8_extra_us_per_round`: extra µs per round, window vs window 1.
- `inproc_kv_64MiB`, `tcp_kv_64MiB` (not with `--quick`): a KV layout, 16-token blocks of 64 KiB.
- `inproc_kv_512blocks`, `tcp_kv_512blocks` (not with `--quick`): the KV of an 8192-token prompt of a
  small model (16 MiB in 512 blocks of 32 KiB, 8 buffers of 256-byte rows, length known: one round) vs
  a contiguous `copy_` / the raw socket: what per-block work costs when a transfer has many blocks.
- `inproc_1block_us`: one 128-token embedding block (516 KiB) between two in-process endpoints, µs per
  transfer, vs the least a Trio replica pair could do: a request through a memory channel, a task that
  `copy_`s the same bytes, a reply. Lower is better; it is what a transfer costs beyond its bytes.
- `ucx_64MiB`, `ucx_kv_64MiB` (`engine.bench.transfer_ucx`): zigzag over ucx vs raw ucxx between two
  processes (`ucx_64MiB_mixed`: with UCX's own reads; `ucx_64MiB_sender_writes`: the sender writing);
  `cuda_ipc_1GiB`, `cuda_ipc_1GiB_known` (one round: the receiver knows the length),
  `gpu_pool_tcp`, `gpu_pool_ucx` (`engine.bench.transfer_gpu`): GPU pools,
  skipped with a note on stderr without a CUDA device.

Every transfer is the real protocol: unknown length (default grant, then more rounds with a window of
grants), both pools' free lists shuffled so every allocation is a scattered block list, the sender a
replica-like owner receiving grants through its channel. Project and baseline alternate (`alternate`),
each figure a median over `--repeats`; trio runs in a helper thread so the timings are taken inside it.
"""

from __future__ import annotations

import argparse
import queue
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, final

import torch
import trio

from engine.bench.rows import Row, alternate, row, warmed
from engine.bench.transfer_peer import (
    KNOWN_LENGTH,
    LAYOUTS,
    RAW_BYTES,
    Source,
    crc_of,
    fragmented_pool,
    peer_process,
    serve_source,
    throwaway_pki,
    tls_config,
    tokens_for,
)
from transport.config import TransferConfig
from transport.endpoint import TransferEndpoint, open_endpoint
from transport.links.inproc.link import InprocNetwork
from transport.links.ucx.library import INSTALL_HINT, ucx_installed
from transport.memory.storage import PoolStorage
from transport.protocol.link import Link

BENCH = "transfer"
T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="5 repeats, no 64 MiB KV cases")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per figure (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, project and baselines")
    parser.add_argument("--window", type=int, default=4, help="grant window of the receivers")
    parser.add_argument(
        "--only",
        default="inproc,tcp,resume,ucx,gpu",
        help="comma-separated case groups: inproc, tcp, resume, ucx, gpu (ucx: the ucx extra; gpu: CUDA)",
    )
    parser.add_argument("--ucx-tls", default="sm", help="UCX_TLS of the ucx cases (default: shared memory)")


@final
class Portal:
    """A trio loop in a helper thread; `call` runs an async function there and returns its result."""

    def __init__(self, token: trio.lowlevel.TrioToken, nursery: trio.Nursery) -> None:
        self.token, self.nursery = token, nursery

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args, trio_token=self.token)


@contextmanager
def trio_thread() -> Iterator[Portal]:
    started: queue.Queue[Portal] = queue.Queue()
    stop = threading.Event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            started.put(Portal(trio.lowlevel.current_trio_token(), nursery))
            await trio.to_thread.run_sync(stop.wait)
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(main,))
    thread.start()
    try:
        yield started.get()
    finally:
        stop.set()
        thread.join()


@final
class Receiver:
    """A receiving endpoint with its own shuffled pool and one link to a sender."""

    def __init__(
        self, name: str, source_name: str, config: TransferConfig, known_length: bool = False
    ) -> None:
        """`known_length`: pass the length as a decode replica does (one round), whatever the layout's
        default (`KNOWN_LENGTH`)."""
        self.name, self.layout, self.config = name, LAYOUTS[source_name], config
        self.tokens = tokens_for(source_name)
        self.expected = self.tokens if known_length or source_name in KNOWN_LENGTH else None
        num_blocks = 2 * -(-self.tokens // self.layout.block_size)
        self.storage = PoolStorage(self.layout, num_blocks)
        self.pool = fragmented_pool(num_blocks, self.layout.block_size, seed=21)
        self.endpoint: TransferEndpoint | None = None
        self.link: Link | None = None
        self.count = 0
        self.rounds = 0

    @property
    def nbytes(self) -> int:
        return self.tokens * self.layout.bytes_per_token

    async def open(self, portal: Portal, address: str, network: InprocNetwork | None) -> None:
        async def hold(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with open_endpoint(
                self.name, self.storage, self.pool, config=self.config, inproc=network
            ) as ep:
                self.endpoint, self.link = ep, await ep.connect(address)
                task_status.started()
                await trio.sleep_forever()

        await portal.nursery.start(hold)

    async def receive_once(self, crc: bool = False) -> tuple[float, int | None]:
        """Seconds for one whole transfer, and the checksum of what landed when asked."""
        assert self.endpoint is not None and self.link is not None
        self.count += 1
        start = time.perf_counter()
        result = await self.endpoint.receive(
            f"{self.name}-{self.count}", peer=self.link, owner="bench", expected_tokens=self.expected
        )
        seconds = time.perf_counter() - start
        landed = crc_of(self.storage, result.blocks, self.tokens) if crc else None
        self.pool.free(result.blocks, "bench")
        self.rounds = result.report.rounds
        return seconds, landed

    def checked(self, portal: Portal, expected_crc: int) -> None:
        _seconds, landed = portal.call(self.receive_once, True)
        if landed != expected_crc:
            raise RuntimeError(
                f"{self.name}: received bytes differ from the sender's (crc {landed} != {expected_crc})"
            )

    def gbps(self, portal: Portal) -> float:
        seconds, _ = portal.call(self.receive_once)
        return self.nbytes / seconds / 1e9

    def median_us(self, portal: Portal, transfers: int = 50) -> float:
        """Median µs per transfer over `transfers` back-to-back ones (the one-block rows)."""

        async def median() -> float:
            return statistics.median([(await self.receive_once())[0] * 1e6 for _ in range(transfers)])

        return portal.call(median)


def _config(args: argparse.Namespace, **overrides: Any) -> TransferConfig:
    return TransferConfig(window=args.window, **overrides)


def inproc_rows(portal: Portal, args: argparse.Namespace, repeats: int) -> Iterator[Row]:
    network = InprocNetwork()
    cases = (("emb4096", "inproc_64MiB"), ("kv", "inproc_kv_64MiB"), ("kv_long", "inproc_kv_512blocks"))
    for source_name, case in cases:
        if args.quick and source_name != "emb4096":
            continue
        source = Source(source_name)
        sender = portal.call(portal.nursery.start, serve_source, source, network)
        receiver = Receiver(f"{case}-receiver", source_name, _config(args))
        portal.call(receiver.open, portal, sender.address, network)
        receiver.checked(portal, source.crc)
        contiguous_from = torch.ones(receiver.nbytes, dtype=torch.uint8)
        contiguous_to = torch.zeros(receiver.nbytes, dtype=torch.uint8)

        def copy_gbps(src: torch.Tensor = contiguous_from, dst: torch.Tensor = contiguous_to) -> float:
            start = time.perf_counter()
            dst.copy_(src)
            return src.numel() / (time.perf_counter() - start) / 1e9

        project, baseline = alternate(partial(receiver.gbps, portal), copy_gbps, repeats)
        note = f"{receiver.nbytes} bytes in {receiver.rounds} rounds, {source_name} layout"
        yield row(
            BENCH, case, "GB/s", "higher", project, baseline, "contiguous torch copy_", unit="GB/s", note=note
        )
    yield one_block_row(portal, args, repeats, network)


def one_block_row(portal: Portal, args: argparse.Namespace, repeats: int, network: InprocNetwork) -> Row:
    """`inproc_1block_us`: each figure the median of 50 transfers (µs), against a minimal exchange."""
    source = Source("block")
    sender = portal.call(portal.nursery.start, serve_source, source, network)
    receiver = Receiver("inproc_1block-receiver", "block", _config(args))
    portal.call(receiver.open, portal, sender.address, network)
    receiver.checked(portal, source.crc)
    requests, served = trio.open_memory_channel[None](0), trio.open_memory_channel[None](0)
    copy_from = torch.ones(receiver.nbytes, dtype=torch.uint8)
    copy_to = torch.zeros(receiver.nbytes, dtype=torch.uint8)

    async def serve() -> None:
        async for _ in requests[1]:
            copy_to.copy_(copy_from)
            await served[0].send(None)

    portal.call(_start_soon, portal.nursery, serve)

    async def minimal_us() -> float:
        figures = []
        for _ in range(50):
            start = time.perf_counter()
            await requests[0].send(None)
            await served[1].receive()
            figures.append((time.perf_counter() - start) * 1e6)
        return statistics.median(figures)

    project, baseline = alternate(
        partial(receiver.median_us, portal), partial(portal.call, minimal_us), repeats
    )
    note = f"{receiver.nbytes} bytes, one block; baseline: a memory-channel request, a task's copy_, a reply"
    return row(
        BENCH,
        "inproc_1block_us",
        "us",
        "lower",
        project,
        baseline,
        "trio request/copy/reply",
        unit="us",
        note=note,
    )


async def _start_soon(nursery: trio.Nursery, fn: Callable[[], Awaitable[None]]) -> None:
    nursery.start_soon(fn)


def tcp_rows(portal: Portal, args: argparse.Namespace, repeats: int, ready: dict[str, Any]) -> Iterator[Row]:
    raw = socket.create_connection(("127.0.0.1", ready["raw"]))
    raw_buffer = memoryview(bytearray(RAW_BYTES))

    def raw_gbps() -> float:
        start = time.perf_counter()
        raw.sendall(b"g")
        got = 0
        while got < RAW_BYTES:
            got += raw.recv_into(raw_buffer[got:])
        return RAW_BYTES / (time.perf_counter() - start) / 1e9

    with raw:
        cases = (("emb4096", "tcp_64MiB"), ("kv", "tcp_kv_64MiB"), ("kv_long", "tcp_kv_512blocks"))
        for source_name, case in cases:
            if args.quick and source_name != "emb4096":
                continue
            receiver = Receiver(f"{case}-receiver", source_name, _config(args))
            portal.call(receiver.open, portal, ready[source_name], None)
            receiver.checked(portal, ready[f"{source_name}_crc"])
            project, baseline = alternate(warmed(partial(receiver.gbps, portal)), warmed(raw_gbps), repeats)
            note = f"{receiver.nbytes} bytes in {receiver.rounds} rounds, {source_name} layout"
            yield row(
                BENCH,
                case,
                "GB/s",
                "higher",
                project,
                baseline,
                "raw socket recv_into",
                unit="GB/s",
                note=note,
            )


def tls_row(
    portal: Portal, args: argparse.Namespace, repeats: int, ready: dict[str, Any], tls: dict[str, Any]
) -> Row:
    """`tcp_tls_64MiB`: the 64 MiB embedding transfer over a TLS link against the same over plain tcp."""
    secured = Receiver("tcp_tls_64MiB-receiver", "emb4096", tls_config(tls, "receiver", window=args.window))
    plain = Receiver("tcp_tls_64MiB-plain-receiver", "emb4096", _config(args))
    portal.call(secured.open, portal, ready["emb4096_tls"], None)
    portal.call(plain.open, portal, ready["emb4096"], None)
    secured.checked(portal, ready["emb4096_tls_crc"])
    project, baseline = alternate(
        warmed(partial(secured.gbps, portal)), warmed(partial(plain.gbps, portal)), repeats
    )
    note = (
        f"{secured.nbytes} bytes in {secured.rounds} rounds; TLS 1.3 ({_cipher()}), both certificates checked"
    )
    return row(
        BENCH,
        "tcp_tls_64MiB",
        "GB/s",
        "higher",
        project,
        baseline,
        "tcp_64MiB (no TLS)",
        unit="GB/s",
        note=note,
    )


def _cipher() -> str:
    """The cipher a TLS 1.3 link of this Python agrees on by default."""
    return ssl.create_default_context().get_ciphers()[0]["name"]


def resume_rows(
    portal: Portal, args: argparse.Namespace, repeats: int, ready: dict[str, Any]
) -> Iterator[Row]:
    blocks = -(-tokens_for("emb1024") // LAYOUTS["emb1024"].block_size)
    one_round = Receiver("resume-k1", "emb1024", _config(args, default_grant_blocks=blocks))
    portal.call(one_round.open, portal, ready["emb1024"], None)
    one_round.checked(portal, ready["emb1024_crc"])
    extra: dict[int, float] = {}
    for k, window in ((2, args.window), (4, args.window), (8, args.window), (8, 1)):
        cap = -(-blocks // k)
        config = TransferConfig(window=window, default_grant_blocks=cap, round_cap_blocks=cap)
        receiver = Receiver(f"resume-k{k}-w{window}", "emb1024", config)
        portal.call(receiver.open, portal, ready["emb1024"], None)
        receiver.checked(portal, ready["emb1024_crc"])

        def millis(r: Receiver) -> float:
            return portal.call(r.receive_once)[0] * 1e3

        project, baseline = alternate(partial(millis, receiver), partial(millis, one_round), repeats)
        extra[window] = (project - baseline) * 1e3 / (receiver.rounds - 1)
        case = f"resume_tcp_8MiB_k{k}" + ("_window1" if window == 1 else "")
        note = (
            f"{receiver.rounds} rounds vs {one_round.rounds}, window {window}; "
            f"{receiver.nbytes / project / 1e6:.2f} GB/s vs {receiver.nbytes / baseline / 1e6:.2f} GB/s"
        )
        yield row(
            BENCH,
            case,
            "time_vs_one_round",
            "lower",
            project,
            baseline,
            "one round (ms)",
            unit="ms",
            note=note,
        )
    yield row(
        BENCH,
        "resume_tcp_8MiB_k8_extra_us_per_round",
        "extra_us_per_round",
        "lower",
        extra[args.window],
        extra[1],
        "window 1 (seeds)",
        unit="us",
        note=f"window {args.window} vs window 1",
    )


def run(args: argparse.Namespace) -> Iterable[Row]:
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 15)
    groups = set(args.only.split(","))
    with trio_thread() as portal:
        if "inproc" in groups:
            yield from inproc_rows(portal, args, repeats)
        if groups & {"tcp", "resume"}:
            with tempfile.TemporaryDirectory() as directory:
                tls = throwaway_pki(Path(directory)) if "tcp" in groups else None
                if tls is None and "tcp" in groups:
                    print("transfer: tcp_tls_64MiB skipped: no openssl command", file=sys.stderr)
                params = {"threads": args.threads, "tls": tls}
                with peer_process("engine.bench.transfer_peer:serve_sender", params) as (_child, ready):
                    if "tcp" in groups:
                        yield from tcp_rows(portal, args, repeats, ready)
                        if tls is not None:
                            yield tls_row(portal, args, repeats, ready, tls)
                    if "resume" in groups:
                        yield from resume_rows(portal, args, repeats, ready)
        if "ucx" in groups:
            yield from extra_rows("ucx", portal, args, repeats)
        if "gpu" in groups:
            yield from extra_rows("gpu", portal, args, repeats)


def extra_rows(group: str, portal: Portal, args: argparse.Namespace, repeats: int) -> Iterator[Row]:
    """The ucx and gpu cases, or a note on stderr saying why they were skipped."""
    if group == "ucx":
        if not ucx_installed():
            print(f"transfer: ucx cases skipped: ucxx is not installed ({INSTALL_HINT})", file=sys.stderr)
            return
        from engine.bench.transfer_ucx import ucx_rows

        yield from ucx_rows(
            portal,
            args,
            repeats,
            lambda name, source, known_length=False, **config: Receiver(
                name, source, _config(args, **config), known_length
            ),
        )
        return
    from engine.bench.transfer_gpu import gpu_rows

    yield from gpu_rows(portal, args, repeats)

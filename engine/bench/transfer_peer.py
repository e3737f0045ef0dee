"""The sending side of the transfer benchmark: layouts, fragmented source pools, a replica-like owner.

`serve_sender` is the child process of the tcp cases: one sending endpoint per layout on loopback, and a
raw blocking socket sender for the baseline; given `tls` parameters (`throwaway_pki`), one more for the
64 MiB embedding layout whose links need the cluster secret and speak TLS (`--transfer-tls`). It reads one JSON line of parameters on stdin, prints one
JSON line (addresses and source checksums), and serves until its stdin closes.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import torch
import trio

from messages.layout import BufferSpec, DType, PoolLayout
from messages.transfer import Grant
from transport.auth.credentials import Credentials
from transport.auth.tls import TlsFiles
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.links.inproc.link import InprocNetwork
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage

MiB: Final = 1024 * 1024


def _embedding_layout(hidden: int) -> PoolLayout:
    return PoolLayout(
        block_size=128,
        buffers=(
            BufferSpec(name="embeds", shape=(hidden,), dtype="float32"),
            BufferSpec(name="token_ids", shape=(), dtype="int64"),
            BufferSpec(name="positions", shape=(3,), dtype="int64"),
        ),
    )


def _kv_layout(layers: int, shape: tuple[int, ...], dtype: DType) -> PoolLayout:
    return PoolLayout(
        block_size=16,
        buffers=tuple(
            BufferSpec(name=f"{kind}{layer}", shape=shape, dtype=dtype)
            for layer in range(layers)
            for kind in ("k", "v")
        ),
    )


LAYOUTS: Final = {
    "emb4096": _embedding_layout(4096),
    "emb1024": _embedding_layout(1024),
    "block": _embedding_layout(1024),  # one 128-token block: what a transfer costs beyond its bytes
    "kv": _kv_layout(layers=8, shape=(8, 128), dtype="bfloat16"),
    # A small model's KV (the built-in tiny model's shape): 4 layers, 256-byte rows, 4 KiB pieces.
    "kv_small": _kv_layout(layers=4, shape=(2, 32), dtype="float32"),
    # The same model's KV for an 8192-token prompt: 512 blocks, what per-block work costs at scale.
    "kv_long": _kv_layout(layers=4, shape=(2, 32), dtype="float32"),
}
PAYLOAD_BYTES: Final = {
    "emb4096": 64 * MiB,
    "emb1024": 8 * MiB,
    "block": 128 * _embedding_layout(1024).bytes_per_token,
    "kv": 64 * MiB,
    "kv_small": 1 * MiB,  # a 512-token prompt
    "kv_long": 16 * MiB,
}
RAW_BYTES: Final = 64 * MiB
# Layouts whose receiver knows the length, as a decode replica knows its prompt's (architecture §5.5: KV grants
# are all-or-nothing): one round. The others start with the default grant, as an embedding transfer does
# (`kv` too: its rows were first recorded that way).
KNOWN_LENGTH: Final = frozenset({"kv_small", "kv_long"})


def tokens_for(name: str) -> int:
    return PAYLOAD_BYTES[name] // LAYOUTS[name].bytes_per_token


def fragmented_pool(num_blocks: int, block_size: int, seed: int) -> BlockPool:
    """A pool whose free list is in random order, so every allocation is a scattered block list."""
    pool = BlockPool(num_blocks, block_size)
    ids = pool.allocate(num_blocks, "shuffle")
    random.Random(seed).shuffle(ids)
    pool.free(ids, "shuffle")
    return pool


def filled_storage(layout: PoolLayout, num_blocks: int, seed: int) -> PoolStorage:
    storage = PoolStorage(layout, num_blocks)
    generator = torch.Generator().manual_seed(seed)
    for tensor in storage.tensors.values():
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))
    return storage


def crc_of(storage: PoolStorage, ids: list[int], tokens: int) -> int:
    crc = 0
    for tensor in storage.gather(ids, 0, tokens).values():
        crc = zlib.crc32(tensor.contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


class Source:
    """A sender pool holding one payload of `name`'s layout in scattered blocks."""

    def __init__(self, name: str) -> None:
        layout = LAYOUTS[name]
        self.name, self.tokens = name, tokens_for(name)
        blocks = -(-self.tokens // layout.block_size)
        self.pool = fragmented_pool(2 * blocks, layout.block_size, seed=11)
        self.storage = filled_storage(layout, 2 * blocks, seed=12)
        self.ids = self.pool.allocate(blocks, "source")
        self.crc = crc_of(self.storage, self.ids, self.tokens)


async def serve_source(
    source: Source,
    network: InprocNetwork | None,
    config: TransferConfig | None = None,
    task_status: trio.TaskStatus[TransferEndpoint] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`source` on a sending endpoint (loopback tcp, or `network`), served by `serve_grants`."""
    send, receive = trio.open_memory_channel[SenderDelivery](1024)
    async with open_endpoint(
        f"{source.name}-sender",
        source.storage,
        source.pool,
        config=config,
        inproc=network,
        sender_control=send,
    ) as endpoint:
        if network is None:
            await endpoint.listen_tcp()
        else:
            endpoint.listen_inproc()
        task_status.started(endpoint)
        await serve_grants(endpoint, receive, source.ids, source.tokens)


async def serve_grants(
    endpoint: TransferEndpoint,
    deliveries: trio.MemoryReceiveChannel[SenderDelivery],
    ids: list[int],
    tokens: int,
) -> None:
    """A replica-like owner: sender-bound messages come through its channel (architecture §3); a grant for a
    new transfer id opens a session that sends the `tokens` in blocks `ids`."""
    async with trio.open_nursery() as sends:
        async for delivery in deliveries:
            endpoint.deliver(delivery)
            if isinstance(delivery.message, Grant):
                sends.start_soon(_send_payload, endpoint, delivery.message.transfer_id, ids, tokens)


async def _send_payload(endpoint: TransferEndpoint, transfer_id: str, ids: list[int], tokens: int) -> None:
    async with endpoint.open_send(transfer_id) as session:
        await session.send(ids, total_tokens=tokens)


@contextmanager
def peer_process(
    entry: str, params: dict[str, Any]
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """A benchmark's sender process running `entry` ("module:function"): `params` as its first stdin
    line, its first stdout line (addresses, checksums) yielded with it; its stdin closed at the end,
    which ends it."""
    module, function = entry.split(":")
    child = subprocess.Popen(
        [sys.executable, "-c", f"from {module} import {function}; {function}()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(json.dumps(params) + "\n")
        child.stdin.flush()
        yield child, json.loads(child.stdout.readline())
    finally:
        child.stdin.close()
        child.wait(timeout=120)


def throwaway_pki(directory: Path) -> dict[str, Any] | None:
    """A CA, a certificate for each side and a secret in `directory`, made with the `openssl` command
    (None without it): the `tls` parameters of `serve_sender`, and the receiver's files (`tls_config`)."""
    if shutil.which("openssl") is None:
        return None

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl(
        "req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=bench-ca"
    )
    files = {}
    for side in ("sender", "receiver"):
        openssl("req", *curve, "-keyout", f"{side}.key", "-out", f"{side}.csr", "-subj", f"/CN={side}")
        (directory / f"{side}.ext").write_text(f"subjectAltName=DNS:{side}\n")
        openssl(
            *("x509", "-req", "-in", f"{side}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"),
            *("-days", "1", "-extfile", f"{side}.ext", "-out", f"{side}.crt"),
        )
        files[side] = [
            str(directory / "ca.crt"),
            str(directory / f"{side}.crt"),
            str(directory / f"{side}.key"),
        ]
    return {"secret": secrets.token_hex(32), **files}


def tls_config(tls: dict[str, Any], side: str, **knobs: Any) -> TransferConfig:
    """A transfer config whose links need `tls`'s secret and speak TLS with `side`'s certificate."""
    credentials = Credentials(secret=tls["secret"].encode(), tls=TlsFiles(*tls[side]))
    return TransferConfig(admission=credentials.admission(side, tls=True), **knobs)


def serve_sender() -> None:
    params = json.loads(sys.stdin.readline())
    torch.set_num_threads(params["threads"])
    trio.run(_serve_sender, params.get("tls"))


async def _serve_sender(tls: dict[str, Any] | None) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_sender, args=(listener,), daemon=True).start()
    ready: dict[str, object] = {"raw": listener.getsockname()[1]}
    async with trio.open_nursery() as nursery:
        for name in LAYOUTS:
            source = Source(name)
            endpoint = await nursery.start(serve_source, source, None)
            ready[name] = endpoint.address
            ready[f"{name}_crc"] = source.crc
        if tls is not None:  # the same payload as emb4096's (the same seeds), over TLS
            source = Source("emb4096")
            endpoint = await nursery.start(serve_source, source, None, tls_config(tls, "sender"))
            ready["emb4096_tls"], ready["emb4096_tls_crc"] = endpoint.address, source.crc
        print(json.dumps(ready), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()


def _raw_sender(listener: socket.socket) -> None:
    """The baseline's sender: one connection; each request byte is answered with the whole payload."""
    payload = memoryview(bytearray(random.randbytes(RAW_BYTES)))
    connection, _ = listener.accept()
    with connection:
        while connection.recv(1):
            connection.sendall(payload)

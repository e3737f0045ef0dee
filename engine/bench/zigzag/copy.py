"""The `zigzag` benchmark's weight-copy rows: a replica's own copy of the weights from each source, through
a real node, against a raw copy of the same bytes on the same path.

One uncapped node process (`--replicas prefill=1,decode=1`, inproc transport; `--copy-model`: the tiny
model from a model cache in the benchmark's folder, or a random Llama checkpoint of `engine.bench.model`). For each of `--copy-repeats` rounds and each source (`peer`, `host`, `disk`):
`scale prefill 2` (`stop_the_world`, that source), wait until the new replica serves, read bytes and
seconds from its `weights_copy_finished` event (the copy's own span: every piece fetched, landed and
assembled), then scale back to 1 and send the parked replica to `Inactive`, so the next scale copies
again. Right after each copy the benchmark's process runs the raw copy:

- `host`: a torch copy (`.to(device, copy=True)`, a clone) of the same checkpoint tensors, as the node's
  host copy holds them (the serving dtype, float32);
- `disk`: reading the checkpoint's safetensors file into one preallocated buffer (unbuffered `readinto`;
  the page cache is warm for both sides);
- `peer`: one transfer of the same bytes over the same transport (two inproc endpoints of the weight
  staging layout, length known, one round).

`--copy-device cuda` serves the node on the GPU (float32) and names it; its `_cuda` rows compare `host`
with a pinned host-to-device copy and `peer` with a device-to-device copy of the same tensors.

GB/s per copy; each figure the median over the rounds. The raw copies run on one torch thread: with
torch's default (one per core) a copy of a few hundred KB wakes the intra-op pool, which on a busy host
costs more than the copy; the node keeps its default. Goal: ≥ 0.8 of the raw copy.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Final

import trio

from engine.bench.nodes import node_process, read_events
from engine.bench.rows import Row, row
from messages.log.scaling import WeightsSourceName

if TYPE_CHECKING:
    from engine.client import ControlClient

BENCH: Final = "zigzag"
SOURCES: Final[tuple[WeightsSourceName, ...]] = ("peer", "host", "disk")
BASELINES: Final = {
    "peer": "one inproc transfer of the same bytes",
    "host": "torch clone of the same tensors",
    "disk": "readinto of the safetensors file",
}
GPU_BASELINES: Final = {
    "peer": "device-to-device copy of the same tensors",
    "host": "pinned host-to-device copy of the same tensors",
    "disk": "readinto of the safetensors file",
}
STATE_SECONDS: Final = 60.0


def copy_rows(args: argparse.Namespace, directory: Path) -> Iterator[Row]:
    import torch

    node_threads = torch.get_num_threads()  # the node runs with torch's default, as this process does
    torch.set_num_threads(1)
    try:
        gpu = args.copy_device == "cuda"
        with copy_checkpoint(args.copy_model, directory) as (model, checkpoint, options):
            log_file = directory / "weights-copy.jsonl"
            log_file.unlink(missing_ok=True)
            if gpu:  # float32 as the checkpoint: the node's copy and the raw one move the same bytes
                options = [*options, "--device", "cuda", "--dtype", "float32"]
            with node_process(log_file, ["--replicas", "prefill=1,decode=1", *options]) as address:
                project, baseline, nbytes = trio.run(_measure, address, log_file, checkpoint, args)
        where = f"on {torch.cuda.get_device_name()}, " if gpu else ""
    finally:
        torch.set_num_threads(node_threads)
    for source in SOURCES:
        note = (
            f"uncapped; {where}model {model}, {nbytes[source]} bytes per copy, measured through a node "
            f"(weights_copy_finished bytes / seconds; torch's default {node_threads} threads), the raw copy "
            f"on one torch thread; median of {len(project[source])}; goal >= 0.8"
        )
        case = f"weights_copy_{source}" + ("" if model == "tiny" else f"_{model}") + ("_cuda" if gpu else "")
        yield row(BENCH, case, "GB/s", "higher",
                  statistics.median(project[source]), statistics.median(baseline[source]),
                  (GPU_BASELINES if gpu else BASELINES)[source], unit="GB/s", note=note)  # fmt: skip


@contextmanager
def copy_checkpoint(model: str, directory: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """(model, its safetensors file, the node's options to serve it): the tiny model's checkpoint in a model
    cache of the benchmark's folder, or a random Llama checkpoint of `engine.bench.model.CONFIGS`."""
    if model == "tiny":
        from replicas.loading.tiny_checkpoint import TINY_FILE, tiny_checkpoint

        cache = directory / "model-cache"
        checkpoint = tiny_checkpoint(cache) / TINY_FILE  # written here first; the node finds it readable
        yield model, checkpoint, ["--model-cache", str(cache)]
        return
    from engine.bench.e2e import _model_source

    with _model_source(model) as source:
        yield model, Path(source) / "model.safetensors", ["--model", source]


async def _measure(
    address: str, log_file: Path, checkpoint: Path, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int]]:
    from engine.client import ControlClient

    project: dict[str, list[float]] = {source: [] for source in SOURCES}
    baseline: dict[str, list[float]] = {source: [] for source in SOURCES}
    nbytes: dict[str, int] = {}
    raw = RawCopies(checkpoint, args.copy_device)
    async with ControlClient.connect(address) as client, raw.peer_endpoints():
        await _wait(client, lambda states: set(states.values()) == {"Prefill", "Decode"}, "serving")
        for attempt in range(args.copy_repeats + 1):  # the first round warms both sides up
            for source in SOURCES:
                seconds, copied = await _node_copy(client, log_file, source)
                raw_gbps = await raw.measure(source)
                if attempt:
                    project[source].append(copied / seconds / 1e9)
                    baseline[source].append(raw_gbps)
                    nbytes[source] = copied
        await client.shutdown()
    return project, baseline, nbytes


async def _node_copy(client: ControlClient, log_file: Path, source: WeightsSourceName) -> tuple[float, int]:
    """Scale a second prefill replica up from `source`, wait, scale it back down to `Inactive`; the copy's
    (seconds, bytes) from its `weights_copy_finished` event."""
    copies_before = len(read_events(log_file, "weights_copy_finished"))
    result = await client.scale("prefill", 2, mode="stop_the_world", source=source)
    (started,) = result.started
    if started.source != source:
        raise RuntimeError(f"scale source {source}: the node started {started}")
    new = started.replica
    await _wait(client, lambda states: states.get(new) == "Prefill", f"{new} serving", loading=new)
    with trio.fail_after(STATE_SECONDS):
        while len(finished := read_events(log_file, "weights_copy_finished")) <= copies_before:  # noqa: ASYNC110
            await trio.sleep(0.01)
    event = finished[-1]
    if event["status"] != "success":
        raise RuntimeError(f"weight copy from {source} did not succeed: {event}")
    await client.scale("prefill", 1)
    states = await _wait(client, lambda states: "ShuttingNull" in states.values(), "a replica parked")
    parked = next(name for name, state in states.items() if state == "ShuttingNull")
    await client.transition(parked, "Inactive")
    await _wait(client, lambda states: states.get(parked) == "Inactive", f"{parked} Inactive")
    return float(event["seconds"]), int(event["bytes"])


async def _wait(
    client: ControlClient, holds: Callable[[dict[str, str]], bool], what: str, *, loading: str | None = None
) -> dict[str, str]:
    """Poll `status` until `holds(states by replica)`; a `loading` replica back in `Inactive` with an
    error (its copy failed) raises naming the error."""
    with trio.fail_after(STATE_SECONDS):
        while True:
            status = await client.status()
            states: dict[str, str] = {replica.name: replica.state for replica in status.replicas}
            if holds(states):
                return states
            for replica in status.replicas:
                if replica.name == loading and replica.state == "Inactive" and replica.last_error:
                    raise RuntimeError(f"waiting for {what}: {replica.name}: {replica.last_error}")
            await trio.sleep(0.01)


class RawCopies:
    """The raw copies of the same bytes, in the benchmark's process."""

    def __init__(self, checkpoint: Path, device: str = "cpu") -> None:
        from safetensors.torch import load_file

        self.checkpoint = checkpoint
        self.device = device
        self.tensors = load_file(str(checkpoint))
        # On a GPU: host is a pinned host-to-device copy, peer a device-to-device copy.
        self.pinned = [t.pin_memory() for t in self.tensors.values()] if device == "cuda" else []
        self.on_device = [t.to(device) for t in self.tensors.values()] if device == "cuda" else []
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.file_bytes = checkpoint.stat().st_size
        self.buffer = bytearray(self.file_bytes)
        self.receive: Callable[[], Awaitable[float]] | None = None
        self.peer_bytes = 0

    async def measure(self, source: str) -> float:
        """GB/s of one raw copy from `source`."""
        if self.device == "cuda" and source in ("host", "peer"):
            import torch

            torch.cuda.synchronize()
            started = time.perf_counter()
            if source == "host":
                copies = [tensor.to("cuda") for tensor in self.pinned]
            else:
                copies = [tensor.clone() for tensor in self.on_device]
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            del copies
            return self.nbytes / seconds / 1e9
        if source == "host":
            started = time.perf_counter()
            copies = [tensor.to(tensor.device, copy=True) for tensor in self.tensors.values()]
            seconds = time.perf_counter() - started
            del copies
            return self.nbytes / seconds / 1e9
        if source == "disk":
            with self.checkpoint.open("rb", buffering=0) as file:
                started = time.perf_counter()
                view, read = memoryview(self.buffer), 0
                while read < self.file_bytes and (got := file.readinto(view[read:])):
                    read += got
                seconds = time.perf_counter() - started
            return read / seconds / 1e9
        assert self.receive is not None
        seconds = await self.receive()
        return self.peer_bytes / seconds / 1e9

    @asynccontextmanager
    async def peer_endpoints(self) -> AsyncIterator[None]:
        """Two inproc endpoints of the weight staging layout: the sender holds the bytes in its blocks
        (served by a replica-like owner, `serve_grants`); `receive` times one whole transfer."""
        from engine.bench.transfer_peer import serve_grants
        from replicas.loading.staging import BLOCK_ROWS, ROW_BYTES, WEIGHTS_LAYOUT, rows_for
        from transport.endpoint import SenderDelivery, open_endpoint
        from transport.links.inproc.link import InprocNetwork
        from transport.memory.blocks import BlockPool
        from transport.memory.storage import PoolStorage

        rows = rows_for(self.nbytes)
        blocks = -(-rows // BLOCK_ROWS)
        self.peer_bytes = rows * ROW_BYTES
        network = InprocNetwork()
        send, deliveries = trio.open_memory_channel[SenderDelivery](1024)
        sender_pool, receiver_pool = BlockPool(blocks, BLOCK_ROWS), BlockPool(blocks, BLOCK_ROWS)
        ids = sender_pool.allocate(blocks, "source")
        sender_storage = PoolStorage(WEIGHTS_LAYOUT, blocks)
        receiver_storage = PoolStorage(WEIGHTS_LAYOUT, blocks)
        numbers = itertools.count(1)
        async with open_endpoint(
            "bench-peer/weights", sender_storage, sender_pool, inproc=network, sender_control=send
        ) as sender:
            address = sender.listen_inproc()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_grants, sender, deliveries, ids, rows)
                async with open_endpoint(
                    "bench-loading/weights", receiver_storage, receiver_pool, inproc=network
                ) as receiver:
                    link = await receiver.connect(address)

                    async def receive() -> float:
                        started = time.perf_counter()
                        result = await receiver.receive(
                            f"weights-{next(numbers)}", peer=link, owner="bench", expected_tokens=rows
                        )
                        seconds = time.perf_counter() - started
                        receiver_pool.free(result.blocks, "bench")
                        return seconds

                    self.receive = receive
                    yield
                nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------------ the multicast chain
CHAIN: Final = 3


def chain_rows(args: argparse.Namespace, directory: Path) -> Iterator[Row]:
    """`--only chain`: the time to load `CHAIN` replicas from one peer as a multicast chain against the
    time to load one, on one node whose peer copies run at an **emulated** speed (`--chain-gb-per-s`, so
    that a copy takes long next to the node's own overheads); the median over `--copy-repeats` rounds
    after one that warms up. The k copies' span runs from the first's `weights_copy_started` to the last
    `weights_copy_finished`; one copy's is its own `seconds`. Goal: ≤ 1.3."""
    with copy_checkpoint(args.copy_model, directory) as (model, _, options):
        log_file = directory / "weights-chain.jsonl"
        log_file.unlink(missing_ok=True)
        speed = f"peer_gb_per_s={args.chain_gb_per_s:g}"
        node = ["--replicas", "prefill=1,decode=1", "--emulated-speed", speed, *options]
        with node_process(log_file, node) as address:
            chains, ones = trio.run(_chains, address, log_file, args.copy_repeats)
    note = (
        f"emulated peer copies ({speed}), model {model}, one node; k = {CHAIN} replicas started by one "
        f"`scale` from one peer (a chain) against one; median of {len(chains)}; goal <= 1.3"
    )
    case = f"weights_chain_{CHAIN}" + ("" if model == "tiny" else f"_{model}")
    yield row(BENCH, case, "seconds", "lower", statistics.median(chains), statistics.median(ones),
              "loading one replica from the same peer", unit="s", note=note)  # fmt: skip


async def _chains(address: str, log_file: Path, repeats: int) -> tuple[list[float], list[float]]:
    from engine.client import ControlClient

    chains: list[float] = []
    ones: list[float] = []
    async with ControlClient.connect(address) as client:
        await _wait(client, lambda states: set(states.values()) == {"Prefill", "Decode"}, "serving")
        for attempt in range(repeats + 1):
            for k, into in ((1, ones), (CHAIN, chains)):
                seconds = await _load_k(client, log_file, k)
                if attempt:
                    into.append(seconds)
        await client.shutdown()
    return chains, ones


async def _load_k(client: ControlClient, log_file: Path, k: int) -> float:
    """Scale prefill from 1 to 1 + k from a peer, wait, scale back, park the new replicas `Inactive`;
    the copies' span (see `chain_rows`)."""
    copies_before = len(read_events(log_file, "weights_copy_started"))
    result = await client.scale("prefill", 1 + k, mode="stop_the_world", source="peer")
    new = [started.replica for started in result.started]
    await _wait(client, lambda states: all(states.get(name) == "Prefill" for name in new), "serving")
    with trio.fail_after(STATE_SECONDS):
        while len(finished := read_events(log_file, "weights_copy_finished")) < copies_before + k:  # noqa: ASYNC110
            await trio.sleep(0.01)
    started = read_events(log_file, "weights_copy_started")[copies_before:]
    ours = finished[copies_before:]
    if any(event["status"] != "success" for event in ours):
        raise RuntimeError(f"a weight copy did not succeed: {ours}")
    span = float(ours[0]["seconds"]) if k == 1 else max(e["ts"] for e in ours) - min(e["ts"] for e in started)
    await client.scale("prefill", 1)
    await _wait(client, lambda states: list(states.values()).count("ShuttingNull") == k, "replicas parked")
    status = await client.status()
    for replica in status.replicas:
        if replica.state == "ShuttingNull":
            await client.transition(replica.name, "Inactive")
    await _wait(client, lambda states: "ShuttingNull" not in states.values(), "replicas Inactive")
    return span

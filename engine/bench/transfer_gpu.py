"""The transfer benchmark's GPU cases. They need a CUDA device; without one they are skipped with a note
on stderr. Figures, measured on an NVIDIA H100 80GB HBM3 (`python -m engine.bench transfer --only gpu`):
docs/benchmarks.md.

- `cuda_ipc_1GiB`: 1 GiB of embedding rows (4096 wide, 128-token blocks, both free lists shuffled) from a
  sender process's GPU pool into this process's over `cuda-ipc`, against a raw device-to-device `copy_`
  of 1 GiB by the sender process into a buffer of this process mapped through CUDA IPC (timed there,
  synchronised). GB/s, higher is better; goal ratio >= 0.85.
- `cuda_ipc_1GiB_known`: the same, the receiver knowing the length (a KV handoff knows its prompt's):
  one round, no round trip for the total.
- `gpu_copy_1GiB`: the cuda-ipc sender's device copy alone, in this process: 512 of 1 024 shuffled 2 MiB
  blocks of one pool into another (`runs.block_index` + `transport.bulk.gpu_copy`: one Triton kernel, or two
  passes without Triton), index built in the call, against one contiguous `copy_` of the same GiB; both
  synchronised. On an H100 80GB HBM3: 0.71-0.87 of the contiguous copy.
- `gpu_pool_tcp`, `gpu_pool_ucx`: 256 MiB between GPU pools of two processes over tcp / ucx (staged
  through pinned host memory unless UCX has CUDA transports), beside this host's pinned host → device
  copy bandwidth (GB/s; the ratio shows how close a network transport gets to the PCIe copy alone).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Final

import msgspec
import torch
import trio

from engine.bench.rows import Row, alternate, row
from engine.bench.transfer_peer import LAYOUTS, filled_storage, fragmented_pool, peer_process, serve_grants
from messages.cuda_ipc import PoolShare
from messages.layout import BufferSpec, PoolLayout
from transport.bulk import gpu_copy
from transport.bulk.runs import block_index
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.links.cuda_ipc.share import open_share, share_pool
from transport.links.ucx.library import ucx_installed
from transport.memory.storage import PoolStorage

BENCH = "transfer"
GiB: Final = 1024**3
LAYOUT: Final = LAYOUTS["emb4096"]
SIZES: Final = {"cuda-ipc": GiB, "tcp": 256 * 1024**2, "ucx": 256 * 1024**2}


def _tokens(kind: str) -> int:
    return SIZES[kind] // LAYOUT.bytes_per_token


def _gpu_pool(layout: PoolLayout, tokens: int, seed: int) -> tuple[PoolStorage, Any, list[int]]:
    """A GPU pool twice the payload, filled with random bytes, shuffled free list; the payload's blocks."""
    blocks = -(-tokens // layout.block_size)
    host = filled_storage(layout, 2 * blocks, seed)
    storage = PoolStorage(layout, 2 * blocks, device="cuda")
    for name, tensor in host.tensors.items():
        storage.tensors[name].copy_(tensor)
    pool = fragmented_pool(2 * blocks, layout.block_size, seed)
    return storage, pool, pool.allocate(blocks, "source")


# ---------------------------------------------------------------------- the sender process
async def _serve(kind: str, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    tokens = _tokens(kind)
    storage, pool, ids = _gpu_pool(LAYOUT, tokens, seed=12)
    send, receive = trio.open_memory_channel[SenderDelivery](1024)
    async with open_endpoint(f"gpu-{kind}-sender", storage, pool, sender_control=send) as endpoint:
        if kind == "tcp":
            address = await endpoint.listen_tcp()
        else:
            address = await endpoint.listen_on("ucx" if kind == "ucx" else "cuda-ipc")
        task_status.started(address)
        await serve_grants(endpoint, receive, ids, tokens)


def serve_gpu_sender() -> None:
    """The sender process: prints its addresses; then each stdin line `{"share": …}` maps a buffer of the
    parent, and each `{"copy": true}` copies 1 GiB into it and prints the seconds; ends at EOF."""
    kinds = json.loads(sys.stdin.readline())["kinds"]
    trio.run(_serve_gpu_sender, kinds)


async def _serve_gpu_sender(kinds: list[str]) -> None:
    async with trio.open_nursery() as nursery:
        ready = {kind: await nursery.start(_serve, kind) for kind in kinds}
        print(json.dumps(ready), flush=True)
        source = torch.empty(GiB, dtype=torch.uint8, device="cuda").random_(0, 256)
        target: torch.Tensor | None = None
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            command = json.loads(line)
            if "share" in command:
                share = msgspec.json.decode(command["share"], type=PoolShare)
                target = open_share(share, _raw_storage(blocks=1))["raw"]
            elif target is not None:
                torch.cuda.synchronize()
                start = time.perf_counter()
                target.view(-1).copy_(source)
                torch.cuda.synchronize()
                print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
        nursery.cancel_scope.cancel()


def _raw_storage(blocks: int = GiB // (1024 * 1024)) -> PoolStorage:
    """1 GiB as a one-buffer pool, so the cuda-ipc share and open paths serve the baseline too (the
    sender checks a share against a one-block pool of the same layout)."""
    layout = PoolLayout(block_size=1024, buffers=(BufferSpec(name="raw", shape=(1024,), dtype="uint8"),))
    return PoolStorage(layout, blocks, device="cuda")


# ---------------------------------------------------------------------- this process
class GpuReceiver:
    """A receiving endpoint with a shuffled GPU pool and one link to a sender."""

    def __init__(self, kind: str, known: bool = False) -> None:
        self.kind, self.tokens, self.known = kind, _tokens(kind), known
        storage, self.pool, ids = _gpu_pool(LAYOUT, self.tokens, seed=21)
        self.pool.free(ids, "source")
        self.storage, self.count, self.rounds = storage, 0, 0
        self.endpoint: TransferEndpoint | None = None
        self.link: Any = None

    async def open(self, nursery: trio.Nursery, address: str) -> None:
        async def hold(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with open_endpoint(
                f"gpu-{self.kind}", self.storage, self.pool, config=TransferConfig()
            ) as ep:
                self.endpoint, self.link = ep, await ep.connect(address)
                task_status.started()
                await trio.sleep_forever()

        await nursery.start(hold)

    async def receive_once(self) -> float:
        assert self.endpoint is not None
        self.count += 1
        start = time.perf_counter()
        expected = self.tokens if self.known else None
        result = await self.endpoint.receive(
            f"gpu-{self.kind}{'-known' if self.known else ''}-{self.count}",
            peer=self.link,
            owner="bench",
            expected_tokens=expected,
        )
        seconds = time.perf_counter() - start
        self.pool.free(result.blocks, "bench")
        self.rounds = result.report.rounds
        return seconds

    def gbps(self, portal: Any) -> float:
        return self.tokens * LAYOUT.bytes_per_token / portal.call(self.receive_once) / 1e9


def _pinned_to_device_gbps() -> float:
    host = torch.empty(SIZES["tcp"], dtype=torch.uint8, pin_memory=True)
    device = torch.empty(SIZES["tcp"], dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return SIZES["tcp"] / (time.perf_counter() - start) / 1e9


def gpu_copy_row(repeats: int) -> Row:
    """`gpu_copy_1GiB` (see the module docstring)."""
    device, blocks, rows, width = torch.device("cuda"), 1024, 128, 4096
    source = torch.empty(blocks * rows, width, dtype=torch.float32, device=device).random_()
    target = torch.zeros_like(source)
    rng = random.Random(3)
    src_ids, dst_ids = rng.sample(range(blocks), blocks // 2), rng.sample(range(blocks), blocks // 2)
    nbytes = blocks // 2 * rows * width * source.element_size()
    contiguous_source, contiguous_target = source.view(-1)[: nbytes // 4], target.view(-1)[: nbytes // 4]

    def gbps(copy: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - start) / 1e9

    def one_pass() -> None:
        block_index(src_ids, dst_ids, rows, (device, device)).copy(source, target)

    kernel = gpu_copy.prepare(device)  # as an endpoint does as it opens: until then copies take two passes
    project, baseline = alternate(
        partial(gbps, one_pass), partial(gbps, partial(contiguous_target.copy_, contiguous_source)), repeats
    )
    way = "one Triton kernel" if kernel is not None else "two passes (no Triton)"
    note = f"512 of 1024 shuffled 2 MiB blocks, {way}, index built in the call, one GPU"
    return row(
        BENCH,
        "gpu_copy_1GiB",
        "GB/s",
        "higher",
        project,
        baseline,
        "contiguous copy_",
        unit="GB/s",
        note=note,
    )


def gpu_rows(portal: Any, args: argparse.Namespace, repeats: int) -> Iterator[Row]:
    if not torch.cuda.is_available():
        print(
            "transfer: gpu cases skipped: no CUDA device (torch.cuda.is_available() is false)",
            file=sys.stderr,
        )
        return
    yield gpu_copy_row(repeats)
    kinds = ["cuda-ipc", "tcp"] + (["ucx"] if ucx_installed() else [])
    with peer_process("engine.bench.transfer_gpu:serve_gpu_sender", {"kinds": kinds}) as (child, ready):
        assert child.stdin is not None and child.stdout is not None
        storage = _raw_storage()  # the baseline's target, in this process
        child.stdin.write(json.dumps({"share": msgspec.json.encode(share_pool(storage)).decode()}) + "\n")
        child.stdin.flush()

        def raw_gbps() -> float:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write('{"copy": true}\n')
            child.stdin.flush()
            return GiB / json.loads(child.stdout.readline())["seconds"] / 1e9

        for kind, known in [(kind, False) for kind in kinds] + [("cuda-ipc", True)]:
            receiver = GpuReceiver(kind, known)
            portal.call(receiver.open, portal.nursery, ready[kind])
            baseline_fn, name = (
                (raw_gbps, "raw copy_ into an IPC buffer")
                if kind == "cuda-ipc"
                else (_pinned_to_device_gbps, "pinned host→device copy_")
            )
            project, baseline = alternate(partial(receiver.gbps, portal), baseline_fn, repeats)
            case = ("cuda_ipc_1GiB" if kind == "cuda-ipc" else f"gpu_pool_{kind}") + (
                "_known" if known else ""
            )
            length = "length known" if known else "length unknown"
            note = f"{SIZES[kind]} bytes in {receiver.rounds} rounds ({length}), fragmented GPU pools, two processes"
            yield row(BENCH, case, "GB/s", "higher", project, baseline, name, unit="GB/s", note=note)

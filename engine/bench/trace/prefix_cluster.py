"""prefix --nodes N: the prefix cache across N nodes, KV-aware routing against round-robin with local caches.

The trace of `engine.bench.trace.prefix` (scaled the same way) replayed on N node processes on loopback,
each `--replicas prefill=1,decode=1` with its own prefix cache of the same size as the one-node run's
(`--cache-fraction` of the trace's distinct blocks: the N caches hold N times that together), arrivals N
times as fast (the time scale divided by N: each node gets the one-node run's rate). The client deals
the requests to the nodes in turn (request i to node i mod N). Two ways:

- **kv-aware**: the N nodes form one cluster on a local etcd (`engine.cluster.demo.local_cluster`,
  transport tcp); each node's router weighs every prefill replica of the cluster by the prefix it holds
  against its queue (`--prefix-route-weight`, 1): a conversation goes back to the node that cached it.
- **round-robin**: N separate nodes, each with only its own cache: a request is served where it was dealt.

Rows (kv-aware against round-robin): prefill tokens computed, TTFT p50 and p99, hit rate (blocks borrowed /
the trace's blocks, from every node's `prefill_started` events), the prompts whose cached prefix was
pulled from another replica (`prefill_started.cached_from` naming a replica; docs/prefix-cache.md), and
the kv-aware hit rate against the trace's bound. Pulls are the nodes' own choice: the kv-aware way makes
them wherever the nodes do.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Final, Protocol

import trio

from engine.bench.nodes import node_process, read_events
from engine.bench.rows import Row, row
from engine.client import ControlClient
from engine.client.cluster import ClusterDemoFailed, shutdown_cluster, wait_serving
from engine.cluster.demo import local_cluster, node_log_file
from engine.config import ReplicaCounts

BENCH: Final = "prefix"
SERVE_SECONDS: Final = 120.0
DRAIN_SECONDS: Final = 300.0
TRANSPORT: Final = "tcp"


class _Request(Protocol):
    """What the replay needs of `engine.bench.trace.prefix.Request` (which imports this module)."""

    @property
    def at(self) -> float: ...
    @property
    def prompt(self) -> list[int]: ...
    @property
    def hash_ids(self) -> list[int]: ...
    @property
    def output_tokens(self) -> int: ...


def run_cluster(
    args: argparse.Namespace,
    requests: Sequence[_Request],
    options: Sequence[str],
    *,
    case: str,
    bound: float,
) -> Iterator[Row]:
    """See the module docstring; `requests` already scaled for N nodes, `options` every node's (no
    `--replicas`)."""
    nodes = args.nodes
    with tempfile.TemporaryDirectory(prefix="zigzag-prefix-cluster-") as scratch:
        directory = args.logs or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        aware = trio.run(_kv_aware, requests, options, nodes, directory)
        spread = _round_robin(requests, options, nodes, directory)
    note = f"{nodes} nodes on loopback, each prefill=1,decode=1; requests dealt in turn"
    yield row(
        BENCH,
        case,
        "prefill tokens computed",
        "lower",
        aware.computed,
        spread.computed,
        "round-robin",
        note=note,
    )
    yield row(BENCH, case, "TTFT p50", "lower", aware.ttft_p50, spread.ttft_p50, "round-robin", unit="s")
    yield row(BENCH, case, "TTFT p99", "lower", aware.ttft_p99, spread.ttft_p99, "round-robin", unit="s")
    yield row(BENCH, case, "hit rate (blocks)", "higher", aware.hit_rate, spread.hit_rate, "round-robin")
    yield row(
        BENCH, case, "prompts with a pulled prefix", "higher", aware.pulled, spread.pulled, "round-robin"
    )
    yield row(BENCH, case, "hit rate vs bound", "higher", aware.hit_rate, bound, "trace's bound")


class _Figures:
    def __init__(self, computed: float, ttfts: list[float], hit_rate: float, pulled: int) -> None:
        ttfts = sorted(ttfts)
        self.computed = computed
        self.pulled = pulled
        self.ttft_p50 = statistics.median(ttfts)
        self.ttft_p99 = ttfts[min(len(ttfts) - 1, -(-99 * len(ttfts) // 100) - 1)]
        self.hit_rate = hit_rate


async def _kv_aware(
    requests: Sequence[_Request], options: Sequence[str], nodes: int, directory: Path
) -> _Figures:
    log_file = directory / "prefix-kv-aware.jsonl"
    children = [(f"node-{index}", ReplicaCounts(prefill=1, decode=1)) for index in range(nodes)]
    every = [*options, "--transport", TRANSPORT, "--prefix-route-weight", "1"]
    async with local_cluster(directory, children, every, log_file=str(log_file)) as cluster:
        addresses = [child.address for child in cluster.children]
        assert all(address is not None for address in addresses)
        async with ControlClient.connect(str(addresses[0])) as first:
            await wait_serving(first, nodes, SERVE_SECONDS)
            ttfts = await _send_all([str(address) for address in addresses], requests)
            await shutdown_cluster(first)
            cluster.stopping = True
    if cluster.failures:
        raise ClusterDemoFailed("; ".join(cluster.failures))
    logs = [Path(node_log_file(str(log_file), node_id)) for node_id, _ in children]
    return _figures(requests, ttfts, logs, options)


def _round_robin(
    requests: Sequence[_Request], options: Sequence[str], nodes: int, directory: Path
) -> _Figures:
    logs = [directory / f"prefix-round-robin.node-{index}.jsonl" for index in range(nodes)]
    with ExitStack() as stack:
        for log in logs:
            log.unlink(missing_ok=True)
        addresses = [
            stack.enter_context(node_process(log, [*options, "--replicas", "prefill=1,decode=1"]))
            for log in logs
        ]
        ttfts = trio.run(_send_all_and_stop, addresses, requests)
    return _figures(requests, ttfts, logs, options)


async def _send_all_and_stop(addresses: list[str], requests: Sequence[_Request]) -> dict[str, float]:
    for address in addresses:
        async with ControlClient.connect(address) as client:
            await wait_serving(client, 1, SERVE_SECONDS)
    ttfts = await _send_all(addresses, requests)
    for address in addresses:
        async with ControlClient.connect(address) as client:
            await client.shutdown()
    return ttfts


async def _send_all(addresses: list[str], requests: Sequence[_Request]) -> dict[str, float]:
    """Each request at its arrival time to node i mod N; request id → TTFT (seconds)."""
    ttfts: dict[str, float] = {}
    async with trio.open_nursery() as connections:
        clients = []
        for address in addresses:
            clients.append(await connections.start(_connected, address))
        for index, client in enumerate(clients):  # unrecorded first calls, sharing no block with the trace
            await client.generate_result(input_ids=[index + 1] * 40, max_tokens=2, ignore_eos=True)
        started = trio.current_time() + 0.1

        async def one(index: int, request: _Request) -> None:
            await trio.sleep_until(started + request.at)
            result = await clients[index % len(clients)].generate_result(
                input_ids=request.prompt, max_tokens=request.output_tokens, ignore_eos=True
            )
            assert result.timings.ttft_s is not None
            ttfts[result.request_id] = result.timings.ttft_s

        with trio.fail_after(max((r.at for r in requests), default=0.0) + DRAIN_SECONDS):
            async with trio.open_nursery() as nursery:
                for index, request in enumerate(requests):
                    nursery.start_soon(one, index, request)
        connections.cancel_scope.cancel()
    return ttfts


async def _connected(
    address: str, task_status: trio.TaskStatus[ControlClient] = trio.TASK_STATUS_IGNORED
) -> None:
    async with ControlClient.connect(address) as client:
        task_status.started(client)
        await trio.sleep_forever()


def _figures(
    requests: Sequence[_Request], ttfts: dict[str, float], logs: list[Path], options: Sequence[str]
) -> _Figures:
    started = {e["request_id"]: e for log in logs for e in read_events(log, "prefill_started")}
    ours = [started[request_id] for request_id in ttfts if request_id in started]
    if len(ours) != len(ttfts):
        raise RuntimeError(f"{len(ttfts) - len(ours)} requests have no prefill_started event in the logs")
    block = int(options[list(options).index("--kv-block-size") + 1])
    cached = sum(e.get("cached_tokens", 0) for e in ours) // block
    return _Figures(
        computed=float(sum(e["tokens"] - e.get("cached_tokens", 0) for e in ours)),
        ttfts=list(ttfts.values()),
        hit_rate=cached / sum(len(r.hash_ids) for r in requests),
        pulled=sum(e.get("cached_from") not in (None, "local") for e in ours),
    )

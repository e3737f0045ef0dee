"""The e2e benchmark's cluster side (`--nodes N`, N ≥ 2): the same requests through N node processes.

`cluster_side` starts etcd and N child nodes in a temporary directory (`engine.cluster.demo.local_cluster`:
roles as the demo's `role_plan` — node-0 decodes, node-1 encodes when the model has a vision encoder,
node-2 prefills, further nodes add decode and prefill replicas in turn — the benchmark's model,
transport tcp), connects a client to node-0 and waits until every node's replicas serve. It yields a
function that sends one run's requests (`engine.bench.e2e.sides.drive`) through node-0, which routes them
across the cluster; the cluster stays up through every run of the benchmark's model, so its first run
is a warm-up like the other sides'. When the block ends it sends `shutdown {"cluster": true}` and raises
`ClusterDemoFailed` when a node did not exit with code 0.

`cluster_rows` compares the cluster's figures with those of the one-process node of the same run:
`baseline` is the one-process figure and `ratio` = cluster / one-process.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

from engine.bench.e2e.sides import BENCH, E2eRow, Sample, Side, drive, with_nodes
from engine.bench.rows import row
from engine.client import ControlClient
from engine.client.cluster import ClusterDemoFailed, shutdown_cluster, wait_serving
from engine.cluster.demo import local_cluster, role_plan

ONE_PROCESS: Final = "one-process-node"
TRANSPORT: Final = "tcp"

RunCluster = Callable[[list[list[int]]], Awaitable[tuple[float, list[Sample]]]]


def plan_text(nodes: int, *, vision: bool) -> str:
    plan = role_plan(nodes, vision=vision)
    return "; ".join(f"node-{index} {counts}" for index, counts in enumerate(plan))


@asynccontextmanager
async def cluster_side(
    source: str, args: argparse.Namespace, *, vision: bool
) -> AsyncIterator[RunCluster | None]:
    """See the module docstring; yields None when `args.nodes` is below 2 (no cluster side)."""
    if args.nodes < 2:
        yield None
        return
    plan = role_plan(args.nodes, vision=vision)
    children = [(f"node-{index}", counts) for index, counts in enumerate(plan)]
    options = ["--model", source, "--transport", TRANSPORT, "--log-level", "warning"]
    with tempfile.TemporaryDirectory(prefix="zigzag-bench-cluster-") as directory:
        async with local_cluster(Path(directory), children, options) as cluster:
            address = cluster.children[0].address
            assert address is not None
            async with ControlClient.connect(address) as client:
                await wait_serving(client, args.nodes)

                async def run(prompts: list[list[int]]) -> tuple[float, list[Sample]]:
                    return await drive(client, prompts, args)

                yield run
                await shutdown_cluster(client)
                cluster.stopping = True
        if cluster.failures:
            raise ClusterDemoFailed("; ".join(cluster.failures))


def cluster_rows(
    name: str, args: argparse.Namespace, one_process: Side, cluster: Side, *, vision: bool
) -> Iterable[E2eRow]:
    """Requests/s, TTFT p50 and p99 and the mean KV-transfer share of TTFT of the cluster, each beside
    the one-process node's (`baseline`; ratio = cluster / one-process)."""
    note = (
        f"model {name}, {args.requests} requests, concurrency {args.concurrency}, prompts "
        f"{args.prompt_min}-{args.prompt_max} tokens, {args.max_tokens} new tokens, {args.nodes} node "
        f"processes on a local etcd ({plan_text(args.nodes, vision=vision)}), transport {TRANSPORT}; "
        f"baseline: the one-process node (prefill=1,decode=1, transport {args.transport}); "
        f"median of {args.repeats}"
    )
    case = f"{name}-c{args.concurrency}-{args.nodes}nodes-{TRANSPORT}"
    rate = statistics.median(cluster.rates)
    one_rate = statistics.median(one_process.rates)
    rows = [
        row(BENCH, case, "requests_per_s", "higher", rate, one_rate, ONE_PROCESS, unit="req/s", note=note)
    ]
    for q in (0.5, 0.99):
        mine, theirs = cluster.quantile(_ttft, q), one_process.quantile(_ttft, q)
        rows.append(
            row(
                BENCH,
                case,
                f"ttft_p{int(q * 100)}_s",
                "lower",
                mine,
                theirs,
                ONE_PROCESS,
                unit="s",
                note=note,
            )
        )
    rows.append(
        row(
            BENCH,
            case,
            "kv_transfer_share_of_ttft_mean",
            "lower",
            cluster.kv_share_mean(),
            one_process.kv_share_mean(),
            ONE_PROCESS,
            unit="fraction",
            note=note + "; goal <= 0.10",
        )
    )
    return [with_nodes(plain, args.nodes) for plain in rows]


def _ttft(sample: Sample) -> float | None:
    return sample.ttft

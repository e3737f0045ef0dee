"""A cluster for the end-to-end tests: a real etcd and several `python -m engine.node` processes.

`cluster_nodes` starts the nodes side by side (`--cluster URL --node-id NAME`), waits until every node
lists every replica of the cluster serving, and kills what is left when the block ends. The transport is
`tcp` unless `ZIGZAG_TRANSPORT` names `ucx` (CI runs the cluster suite again over UCX).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from engine.client import ControlClient
from engine.cluster.local_etcd import LocalEtcd
from messages.control_replies import StatusResult
from tests.node.harness import SERVING_STATES, NodeProcess, launch_node, wait_status

LEASE_TTL = 2  # seconds: a dead node is noticed within this (plus a watch round trip)


def cluster_transport() -> str:
    return "ucx" if os.environ.get("ZIGZAG_TRANSPORT") == "ucx" else "tcp"


def cluster_options(etcd: LocalEtcd, node_id: str, replicas: str, *extra: str) -> tuple[str, ...]:
    return (
        "--cluster",
        etcd.url,
        "--node-id",
        node_id,
        "--lease-ttl",
        str(LEASE_TTL),
        "--replicas",
        replicas,
        "--transport",
        cluster_transport(),
        *extra,
    )


@asynccontextmanager
async def cluster_nodes(
    directory: Path, etcd: LocalEtcd, layout: Sequence[tuple[str, str]], *extra: str, joining: int = 0
) -> AsyncIterator[dict[str, NodeProcess]]:
    """Nodes `(node_id, replicas)` of one cluster, every replica serving when the block starts
    (`joining`: replicas the cluster already has, on nodes started before)."""
    nodes: dict[str, NodeProcess] = {}
    try:
        for node_id, replicas in layout:
            nodes[node_id] = launch_node(directory, *cluster_options(etcd, node_id, replicas, *extra))
        for node in nodes.values():
            node.await_listening()
        expected = joining + sum(_count(replicas) for _, replicas in layout)
        for node in nodes.values():
            async with node.client() as client:
                await wait_cluster_serving(client, expected)
        yield nodes
    finally:
        for node in nodes.values():
            if node.exit_code is None:
                node.kill()


async def wait_cluster_serving(client: ControlClient, replicas: int) -> StatusResult:
    def serving(status: StatusResult) -> bool:
        states = [r.state for r in status.replicas]
        return len(states) == replicas and all(state in SERVING_STATES for state in states)

    return await wait_status(client, serving, f"{replicas} replicas of the cluster serving")


def _count(replicas: str) -> int:
    return sum(int(part.partition("=")[2]) for part in replicas.split(","))

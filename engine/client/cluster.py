"""A client's view of a cluster of nodes: waiting until every node serves, shutting it down, a line per
node — what the demos and the benchmarks that start clusters share (`engine.demo`, `engine.cluster.demo`,
`engine.bench`)."""

from __future__ import annotations

import itertools
from typing import Final, final

import trio

from engine.client.control_client import ControlClient
from messages.control import ShutdownRequest
from messages.control_replies import ShutdownResult, StatusResult
from replicas.states import SETTLED

READY_SECONDS: Final = 120.0  # every node's replicas loaded and serving
POLL_SECONDS: Final = 0.1
SERVING: Final = frozenset(state.value for state in SETTLED)


@final
class ClusterDemoFailed(Exception):
    """A node did not start, serve or stop as it should; the message says which and why."""


def _serving(status: StatusResult, nodes: int) -> bool:
    listed = {replica.node for replica in status.replicas}
    return len(listed) >= nodes and all(replica.state in SERVING for replica in status.replicas)


async def wait_serving(client: ControlClient, nodes: int, seconds: float = READY_SECONDS) -> StatusResult:
    """Poll `status` until it lists replicas of at least `nodes` nodes and every one serves; raise
    `ClusterDemoFailed` with what it saw last after `seconds`."""
    status = await client.status()
    with trio.move_on_after(seconds):
        for _ in itertools.count():
            if _serving(status, nodes):
                return status
            await trio.sleep(POLL_SECONDS)
            status = await client.status()
    listed = sorted({str(replica.node) for replica in status.replicas})
    states = ", ".join(f"{replica.name} ({replica.state})" for replica in status.replicas)
    raise ClusterDemoFailed(
        f"the cluster did not serve within {seconds:g} s: {len(listed)} of {nodes} nodes listed "
        f"({', '.join(listed)}); replicas {states or 'none'}"
    )


async def shutdown_cluster(client: ControlClient) -> ShutdownResult:
    """`shutdown {"cluster": true}`: every other node of the cluster shuts down, then the one asked."""
    async for reply in client.replies(ShutdownRequest(id="cluster-shutdown", cluster=True)):
        if isinstance(reply, ShutdownResult):
            return reply
        raise ClusterDemoFailed(f"shutdown: unexpected reply {type(reply).__name__}")
    raise ClusterDemoFailed("shutdown: no reply")


def node_lines(status: StatusResult) -> list[str]:
    """One line per node of `status`: its id, process id and replicas."""
    nodes: dict[str, tuple[int | None, list[str]]] = {}
    for replica in status.replicas:
        nodes.setdefault(str(replica.node), (replica.pid, []))[1].append(replica.name)
    return [
        f"demo: node {node} pid {pid}: {', '.join(sorted(names))}"
        for node, (pid, names) in sorted(nodes.items())
    ]

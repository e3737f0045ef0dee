"""Real `python -m engine.node` processes for the EPD tests (tests/node/harness.py underneath).

    with start_nodes(tmp_dir, {"n8": [], "tcp": ["--transport", "tcp"]}) as nodes:
        node = nodes["n8"]                       # node.address, node.events("transfer_round")
        async with node.client() as client:      # inside a trio test
            await wait_serving(client)

`start_nodes` launches every node at once (their imports and weight loads overlap), then reads each
one's listening line; when the block ends it stops each node through its socket and asserts exit code 0
(the node drained and found no leaked block). Every wait has a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from engine.client import ControlClient
from messages.control_replies import StatusResult
from tests.node.harness import NodeProcess, launch_node, wait_serving, wait_states, wait_status

Node = NodeProcess

__all__ = ["Node", "start_nodes", "wait_blocks_returned", "wait_serving", "wait_states"]


@contextmanager
def start_nodes(directory: Path, options: Mapping[str, Sequence[str]]) -> Iterator[dict[str, Node]]:
    """One node per entry (name → extra options of `python -m engine.node`), stopped (exit code 0
    asserted) when the block ends unless a test stopped it itself; all killed if the block raised."""
    nodes = {name: launch_node(directory, *extra) for name, extra in options.items()}
    try:
        for node in nodes.values():
            node.await_listening()
        yield nodes
    except BaseException:
        for node in nodes.values():
            if node.exit_code is None:
                node.kill()
        raise
    try:
        for node in nodes.values():
            if node.exit_code is None:
                node.stop()
    finally:  # a node that failed to stop must not leave the others running
        for node in nodes.values():
            node.kill()


async def wait_blocks_returned(client: ControlClient) -> StatusResult:
    """Until no replica holds a block (quarantined blocks come back after their fence)."""
    return await wait_status(
        client,
        lambda status: all(replica.used_blocks == 0 for replica in status.replicas),
        "every replica's blocks returned",
    )

"""A node served inside the test's own trio run (`engine.node.Node`), over its real control socket.

For the checks that need to look inside the node: the vision encoder's call counter. The node is the
one `python -m engine.node` runs (same config parser, replicas, router, control server); only the
process boundary is missing. Leaving the block shuts it down and checks that its exit code is 0 (no
leaked block).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, final

import trio

from engine.config import parse_node_config
from engine.http.metrics import NodeMetrics
from engine.logging import open_event_log
from engine.logs import Aggregator
from engine.node import Node

STOP_TIMEOUT = 60.0


@final
class ServedNode:
    def __init__(self, node: Node, address: str, log_file: Path) -> None:
        self.node = node
        self.address = address
        self.log_file = log_file

    def events(self, *names: str) -> list[dict[str, Any]]:
        events = [json.loads(line) for line in self.log_file.read_bytes().splitlines() if line.strip()]
        return [event for event in events if not names or event["event"] in names]


@asynccontextmanager
async def served_node(directory: Path, *options: str) -> AsyncIterator[ServedNode]:
    log_file = directory / "node.jsonl"
    argv = [
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--log-file",
        str(log_file),
        "--no-log-console",
        *options,
    ]
    config = parse_node_config(argv, {})
    aggregator, metrics = Aggregator(keep_requests=False), NodeMetrics()
    log = open_event_log(
        file=config.log.file,
        level=config.log.level,
        console=None,
        observers=[aggregator.add, metrics.observe],
    )
    exit_codes: list[int] = []
    try:
        node = Node(config, log, aggregator, metrics)

        async def serve(task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED) -> None:
            exit_codes.append(await node.serve(task_status=task_status))

        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve)
            try:
                yield ServedNode(node, str(address), log_file)
            finally:
                node.request_shutdown("test finished")
                nursery.cancel_scope.deadline = trio.current_time() + STOP_TIMEOUT
    finally:
        log.close()
    assert exit_codes == [0], f"node exit codes {exit_codes} (1 = leaked blocks)"

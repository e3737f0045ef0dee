"""A real `python -m engine.node` for the EPD tests, started as a subprocess and driven over its socket.

    with start_nodes(tmp_dir, {"n8": [], "tcp": ["--transport", "tcp"]}) as nodes:
        node = nodes["n8"]                       # node.address, node.events("transfer_round")
        async with node.client() as client:      # inside a trio test
            await wait_serving(client)

`start_nodes` starts every node at once (their imports and weight loads overlap), reads each one's
`{"listening": ...}` stdout line, and at the end of the block sends `shutdown` over a blocking socket
and checks the exit code: 0 means the node drained and found no leaked block. Every wait has a deadline.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any, final

import trio

from engine.client import ControlClient
from messages.control_replies import StatusResult

START_TIMEOUT = 90.0
STATE_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0
SERVING = frozenset({"Encode", "Prefill", "Decode"})


@final
class Node:
    """One running node process."""

    def __init__(
        self, name: str, process: subprocess.Popen[bytes], log_file: Path, stderr_file: Path
    ) -> None:
        self.name = name
        self.process = process
        self.log_file = log_file
        self.stderr_file = stderr_file
        self.address = ""
        self.exit_code: int | None = None

    def stderr(self) -> str:
        return self.stderr_file.read_text(errors="replace") if self.stderr_file.exists() else ""

    def events(self, *names: str) -> list[dict[str, Any]]:
        """The log's events so far (those named, when names are given)."""
        found = []
        for line in self.log_file.read_bytes().splitlines():
            if line.strip():
                event = json.loads(line)
                if not names or event["event"] in names:
                    found.append(event)
        return found

    def client(self) -> AbstractAsyncContextManager[ControlClient]:
        return ControlClient.connect(self.address)

    def read_address(self, deadline: float) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.process.poll() is not None:
                raise AssertionError(f"node {self.name} did not start: {self.stderr()[-3000:]}")
            ready, _, _ = select.select([stdout], [], [], min(left, 0.5))
            if ready:
                line += stdout.read1(4096)  # type: ignore[attr-defined]
        self.address = json.loads(line.split(b"\n")[0])["listening"]

    def stop(self) -> int:
        """Shut the node down through its socket and return its exit code (killing it past the deadline)."""
        if self.exit_code is not None:
            return self.exit_code
        if self.process.poll() is None and self.address:
            host, _, port = self.address.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=STOP_TIMEOUT) as sock:
                    sock.sendall(b'{"op": "shutdown", "id": "epd-tests"}\n')
                    sock.recv(65536)
            except OSError:
                self.process.terminate()
        try:
            self.exit_code = self.process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_code = self.process.wait(timeout=STOP_TIMEOUT)
        return self.exit_code


@contextmanager
def start_nodes(directory: Path, options: Mapping[str, Sequence[str]]) -> Iterator[dict[str, Node]]:
    """Start one node per entry (name → extra options), yield them, then stop them and check that each
    exited 0 (no leaked block)."""
    nodes: dict[str, Node] = {}
    try:
        for name, extra in options.items():
            log_file, stderr_file = directory / f"{name}.jsonl", directory / f"{name}.stderr"
            command = [
                sys.executable,
                "-m",
                "engine.node",
                "--listen",
                "127.0.0.1:0",
                "--log-file",
                str(log_file),
                "--no-log-console",
                "--shutdown-drain-deadline",
                "10",
                *extra,
            ]
            with stderr_file.open("wb") as errors:
                process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors)
            nodes[name] = Node(name, process, log_file, stderr_file)
        deadline = time.monotonic() + START_TIMEOUT
        for node in nodes.values():
            node.read_address(deadline)
        yield nodes
        codes = {name: node.stop() for name, node in nodes.items()}
        bad = {name: code for name, code in codes.items() if code != 0}
        assert not bad, f"nodes exited non-zero (1 = leaked blocks): {bad}; " + " | ".join(
            f"{name}: {nodes[name].stderr()[-2000:]}" for name in bad
        )
    finally:
        for node in nodes.values():
            if node.process.poll() is None:
                node.process.kill()
                node.process.wait(timeout=STOP_TIMEOUT)
            if node.process.stdout is not None:
                node.process.stdout.close()


async def wait_states(client: ControlClient, wanted: Mapping[str, frozenset[str]]) -> StatusResult:
    """Poll `status` until each named replica is in one of its wanted states."""
    with trio.fail_after(STATE_TIMEOUT):
        while True:
            status = await client.status()
            states = {replica.name: replica.state for replica in status.replicas}
            if all(states.get(name) in allowed for name, allowed in wanted.items()):
                return status
            await trio.sleep(0.05)


async def wait_serving(client: ControlClient) -> StatusResult:
    """Poll `status` until every replica serves its role."""
    with trio.fail_after(STATE_TIMEOUT):
        while True:
            status = await client.status()
            if all(replica.state in SERVING for replica in status.replicas):
                return status
            await trio.sleep(0.05)


async def wait_blocks_returned(client: ControlClient) -> StatusResult:
    """Poll `status` until no replica holds a block (quarantined blocks come back after their fence)."""
    with trio.fail_after(STATE_TIMEOUT):
        while True:
            status = await client.status()
            if all(replica.used_blocks == 0 for replica in status.replicas):
                return status
            await trio.sleep(0.05)

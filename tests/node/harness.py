"""A real node for the end-to-end tests: `python -m engine.node` as a subprocess, driven over its socket.

    with node_process(directory, "--replicas", "prefill=1,decode=2") as node:
        ...                                     # node.address, node.events(...), node.stderr()
        async with node.client() as client:     # an engine.client.ControlClient (inside a trio test)
            await wait_serving(client)
            ...

`start_node` runs `python -m engine.node --listen 127.0.0.1:0 --log-file DIR/node-N.jsonl
--no-log-console [options]` and reads the `{"listening": ...}` line from its stdout (the node prints it
once the control socket is bound); stderr (tracebacks only, the console log is off) goes to a file that
every failure message quotes. `NodeProcess.stop` sends `shutdown` (or SIGTERM) and asserts the exit
code — 0 means the node drained and found no leaked block — killing the process if it does not exit
within its deadline. `node_process` stops the node when its block ends, unless the test already did.

Every wait here has a deadline (no test can hang); no assertion depends on how fast anything runs.
The stop is synchronous (a blocking socket), so session-scoped fixtures can use it outside any trio run.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any, Literal, final

import pytest

from engine.client import ControlClient
from messages.control_replies import ReplicaStatus, StatusResult
from tests.waiting import wait_until, wait_until_blocking

START_TIMEOUT = 60.0  # process start + imports + binding the socket (a loaded CI machine is slow)
STATE_TIMEOUT = 60.0  # replicas loading weights, draining, reviving
STOP_TIMEOUT = 60.0  # shutdown: drain (deadline 10 s by default here) + leak check + exit
SERVING_STATES = frozenset({"Prefill", "Decode", "Encode"})
REPO_ROOT = Path(__file__).resolve().parents[2]
_node_numbers = itertools.count(1)

StopHow = Literal["shutdown", "sigterm"]


def default_transport() -> str:
    """The transport a node started without `--transport` moves blocks over: the entry point's default
    (inproc) unless `ZIGZAG_TRANSPORT` names another, as the entry point reads it — so the node and EPD
    suites run over any transport, e.g. `ZIGZAG_TRANSPORT=ucx UCX_TLS=sm,tcp pytest tests/node tests/epd`
    (`auto` is inproc inside one node)."""
    chosen = os.environ.get("ZIGZAG_TRANSPORT", "inproc")
    return "inproc" if chosen == "auto" else chosen


class NodeFailed(AssertionError):
    """The node process misbehaved (exited early, did not start, did not stop, wrong exit code)."""


@final
class NodeProcess:
    """A running `python -m engine.node`; see the module docstring."""

    def __init__(self, process: subprocess.Popen[bytes], address: str, log_file: Path, stderr_file: Path):
        self.process = process
        self.address = address
        self.http_url: str | None = None  # the HTTP API's URL from the listening line
        self.log_file = log_file
        self.stderr_file = stderr_file
        self.exit_code: int | None = None
        self.unready: str | None = None  # what `check_ready` found wrong, once it failed

    # ------------------------------------------------------------------ looking at it
    def stderr(self) -> str:
        return self.stderr_file.read_text(errors="replace") if self.stderr_file.exists() else ""

    def events(self, *names: str) -> list[dict[str, Any]]:
        """The log's events so far (only those named, when names are given), as decoded JSON objects.

        A line the node is still writing (no newline yet) is left for the next call."""
        found = []
        *complete, _unfinished = self.log_file.read_bytes().split(b"\n")
        for line in complete:
            if line.strip():
                event = json.loads(line)
                if not names or event["event"] in names:
                    found.append(event)
        return found

    async def wait_event(
        self, name: str, predicate: Callable[[dict[str, Any]], bool], *, timeout: float = STATE_TIMEOUT
    ) -> dict[str, Any]:
        """The first logged `name` event that satisfies `predicate`, polling the log until `timeout`."""
        found = await wait_until(
            lambda: [event for event in self.events(name) if predicate(event)],
            f"a matching {name} event in the log",
            timeout,
            interval=0.02,
        )
        return found[0]

    def check_ready(self, timeout: float = 20.0) -> None:
        """Blocking: fail unless every replica serves, unlocked, idle, with no block held, within
        `timeout`. For a node shared by several tests (each must leave it so); once a check failed, the
        later ones fail at once, naming the first failure, instead of each test timing out on its own."""
        if self.unready is not None:
            pytest.fail(f"the shared node was left unready by an earlier test: {self.unready}")
        last: list[object] = []

        def ready() -> bool:
            (status,) = self.send_lines(b'{"op":"status","id":"ready"}\n', replies=1)
            wrong = [
                replica
                for replica in status.get("replicas", [])
                if replica["state"] not in SERVING_STATES
                or replica["lock_reasons"]
                or replica["used_blocks"]
                or replica["work_queue"]
                or replica["migration_queue"]
            ]
            last[:] = [wrong or status]
            return not wrong and status.get("type") == "result"

        try:
            wait_until_blocking(
                ready, "the shared node ready (serving, unlocked, idle)", timeout, interval=0.05
            )
        except AssertionError:
            self.unready = json.dumps(last[0])[:2000]
            pytest.fail(f"the shared node is not ready after {timeout} s: {self.unready}")

    def diagnosis(self) -> str:
        """What a failure message should show: the exit code, stderr's tail and the log's errors."""
        errors = [
            json.dumps(e)[:400]
            for e in self.events()
            if e["event"] in ("pool_leak", "replica_failed", "control_handler_error", "request_failed")
        ]
        return (
            f"node {self.address} (exit code {self.process.poll()}); log {self.log_file}\n"
            f"--- stderr (tail) ---\n{self.stderr()[-4000:]}\n--- error events (last 20) ---\n"
            + "\n".join(errors[-20:])
        )

    def client(self, **options: Any) -> AbstractAsyncContextManager[ControlClient]:
        """A `ControlClient` connected to this node (`async with node.client() as client:`)."""
        return ControlClient.connect(self.address, **options)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host, int(port)

    def await_listening(self) -> None:
        """Blocking: read the node's listening line into `address` (killing the node if none comes)."""
        try:
            self.address, self.http_url = _read_listening_line(self.process)
        except NodeFailed as exc:
            self.kill()
            raise NodeFailed(f"{exc}\n{self.diagnosis()}") from None

    # ------------------------------------------------------------------ stopping it
    def stop(self, how: StopHow = "shutdown", *, expect_exit: int = 0) -> int:
        """Ask the node to stop (`shutdown` op or SIGTERM) unless it already exited, wait, and assert
        its exit code."""
        if self.exit_code is None and self.process.poll() is None:
            if how == "shutdown":
                reply = self.send_lines(b'{"op":"shutdown","id":"harness-shutdown"}\n', replies=1)
                if reply[0].get("type") != "result":
                    raise NodeFailed(f"shutdown refused: {reply}\n{self.diagnosis()}")
            else:
                self.process.send_signal(signal.SIGTERM)
        code = self.wait_exit() if self.exit_code is None else self.exit_code
        if code != expect_exit:
            raise NodeFailed(f"the node exited with {code}, expected {expect_exit}\n{self.diagnosis()}")
        return code

    def wait_exit(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait for the process to exit; kill it (and fail) if it does not within `timeout`."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise NodeFailed(
                f"the node did not exit within {timeout} s; killed\n{self.diagnosis()}"
            ) from None
        self.exit_code = code
        self._close_pipes()
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT)
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.process.stdout is not None:
            self.process.stdout.close()

    def send_lines(
        self, data: bytes, *, replies: int, timeout: float = STATE_TIMEOUT
    ) -> list[dict[str, Any]]:
        """Blocking: open a connection, send `data`, read `replies` reply lines (no trio needed)."""
        with socket.create_connection(self.host_port, timeout=timeout) as sock:
            sock.sendall(data)
            buffer = b""
            lines: list[dict[str, Any]] = []
            deadline = time.monotonic() + timeout
            while len(lines) < replies:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    raise NodeFailed(f"connection closed after {lines}\n{self.diagnosis()}")
                buffer += chunk
                while b"\n" in buffer and len(lines) < replies:
                    line, buffer = buffer.split(b"\n", 1)
                    lines.append(json.loads(line))
            return lines


def node_command(log_file: Path, options: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "engine.node",
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--log-file",
        str(log_file),
        "--no-log-console",
        "--shutdown-drain-deadline",
        "10",
        *options,
    ]


def start_node(directory: Path, *options: str) -> NodeProcess:
    """Start a node with `options` (flags of `python -m engine.node`) and wait for its listening line."""
    node = launch_node(directory, *options)
    node.await_listening()
    return node


def launch_node(directory: Path, *options: str) -> NodeProcess:
    """Start a node process without waiting for it (its `address` is empty until `await_listening`):
    several nodes launched first and awaited after start up side by side."""
    number = next(_node_numbers)
    log_file = directory / f"node-{os.getpid()}-{number}.jsonl"
    stderr_file = log_file.with_suffix(".stderr")
    with stderr_file.open("wb") as stderr:
        process = subprocess.Popen(
            node_command(log_file, options),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=REPO_ROOT,
        )
    return NodeProcess(process, "", log_file, stderr_file)


def _read_listening_line(process: subprocess.Popen[bytes]) -> tuple[str, str | None]:
    """The control address and HTTP URL in the node's `{"listening": ..., "http": ...}` stdout line
    (other lines before it are skipped)."""
    assert process.stdout is not None
    descriptor = process.stdout.fileno()
    deadline = time.monotonic() + START_TIMEOUT
    pending = b""
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(message, dict) and "listening" in message:
                http = message.get("http")
                return str(message["listening"]), None if http is None else str(http)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NodeFailed(f"no listening line within {START_TIMEOUT} s")
        ready, _, _ = select.select([descriptor], [], [], remaining)
        if ready:
            chunk = os.read(descriptor, 65536)
            if not chunk:
                raise NodeFailed(f"the node exited before listening (exit code {process.wait()})")
            pending += chunk


@contextmanager
def node_process(directory: Path, *options: str, stop: StopHow = "shutdown") -> Iterator[NodeProcess]:
    """A started node, stopped (exit code 0 asserted) when the block ends — unless the block stopped it
    (and checked its exit code) itself; killed if the block raised."""
    node = start_node(directory, *options)
    try:
        yield node
    except BaseException:
        if node.exit_code is None:
            node.kill()
        raise
    if node.exit_code is None:
        node.stop(stop)


# ---------------------------------------------------------------------- waiting on status (async)
async def wait_status(
    client: ControlClient,
    predicate: Callable[[StatusResult], bool],
    what: str,
    *,
    timeout: float = STATE_TIMEOUT,
    interval: float = 0.02,
) -> StatusResult:
    """Poll `status` until `predicate` holds; fail naming `what` and the last status after `timeout`."""
    last: StatusResult | None = None

    async def holds() -> StatusResult | None:
        nonlocal last
        last = await client.status()
        return last if predicate(last) else None

    return await wait_until(holds, what, timeout, interval=interval, detail=lambda: f"last status: {last}")


def by_name(status: StatusResult) -> dict[str, ReplicaStatus]:
    return {replica.name: replica for replica in status.replicas}


async def wait_states(client: ControlClient, wanted: Mapping[str, str | frozenset[str]]) -> StatusResult:
    """Until each named replica is in its wanted state (or one of a set of states)."""

    def holds(status: StatusResult) -> bool:
        states = {name: replica.state for name, replica in by_name(status).items()}
        return all(
            states.get(name) in (want if isinstance(want, frozenset) else {want})
            for name, want in wanted.items()
        )

    return await wait_status(client, holds, f"states {dict(wanted)}")


async def wait_serving(client: ControlClient) -> StatusResult:
    """Until every replica serves (weights loaded: Prefill, Decode or Encode)."""
    return await wait_status(
        client,
        lambda status: all(replica.state in SERVING_STATES for replica in status.replicas),
        "every replica serving",
    )


def is_idle(status: StatusResult) -> bool:
    """No replica holds a block or has queued work (every request's blocks are back)."""
    return all(
        replica.used_blocks == 0 and replica.work_queue == 0 and replica.migration_queue == 0
        for replica in status.replicas
    )


async def wait_idle(client: ControlClient, *, nodes: set[str] | None = None) -> StatusResult:
    """Until no replica holds a block or has queued work (every request's blocks are back) and, when
    `nodes` is given, the status lists the replicas of exactly those nodes (a killed node's leave only
    once its lease has ended)."""
    if nodes is None:
        return await wait_status(client, is_idle, "every replica idle with used_blocks 0")
    return await wait_status(
        client,
        lambda status: is_idle(status) and {replica.node for replica in status.replicas} == nodes,
        f"every replica idle with used_blocks 0, on nodes {sorted(nodes)} only",
    )

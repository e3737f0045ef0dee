"""A node process on a host of an `engine.hosts.network.Network`: start, kill -9, restart.

    node = HostNode(network, "a", "pre-a", ["--cluster", url, "--replicas", "prefill=1,decode=0"], logs)
    await node.start()           # python -m engine.node inside a's namespace; returns once it listens
    node.address                 # its control socket, on a's own address
    await node.kill()            # SIGKILL, as a crash; `start()` again runs it anew, same --node-id

The node listens (control socket and peer links) on its host's address (`--listen ADDR:0`,
`--cluster-host ADDR`), HTTP off, its log in `logs/{node_id}-{n}.jsonl` (n counts its starts) and
stderr beside it; `env` is added to its environment (`ZIGZAG_ETCD_PASSWORD`). `start` waits for the `{"listening": ...}` stdout line; a node that exits first or
prints none within `START_SECONDS` raises `NodeStartFailed` with its exit code and the tail of its
stderr (`exit_code` tells, e.g. 2 for a node id still in use by a lease that has not ended).

Cancellation: `start` kills the process it started when it is cancelled; `kill` is shielded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, final

import trio

from engine.control.listening import listening_address
from engine.hosts.network import Network

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
START_SECONDS: Final = 90.0  # a fresh interpreter importing torch on a loaded machine, joining etcd
KILL_SECONDS: Final = 20.0
_TAIL_CHARS: Final = 3000


@final
class NodeStartFailed(Exception):
    """The node did not listen: `exit_code` (None when it was still running) and its stderr's tail."""

    def __init__(self, message: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@final
class HostNode:
    """See the module docstring."""

    def __init__(
        self,
        network: Network,
        host: str,
        node_id: str,
        options: Sequence[str],
        logs: Path,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.network = network
        self.env = dict(env or {})  # added to this process's environment (secrets kept off the command line)
        self.host = host
        self.node_id = node_id
        self.options = list(options)
        self.logs = logs
        self.starts = 0
        self.process: trio.Process | None = None
        self.address: str | None = None
        self.log_files: list[Path] = []

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def command(self, log_file: Path) -> list[str]:
        ip = self.network.address(self.host)
        argv = [
            sys.executable,
            "-m",
            "engine.node",
            "--listen",
            f"{ip}:0",
            "--http",
            "off",
            "--cluster-host",
            ip,
            "--node-id",
            self.node_id,
            "--log-file",
            str(log_file),
            "--no-log-console",
            *self.options,
        ]
        return self.network.command(self.host, argv)

    async def start(self) -> str:
        """Run the node and return its control address once it listens (see the module docstring)."""
        if self.running:
            raise RuntimeError(f"node {self.node_id} is running")
        self.starts += 1
        log_file = self.logs / f"{self.node_id}-{self.starts}.jsonl"
        stderr_path = log_file.with_suffix(".stderr")
        self.log_files.append(log_file)
        self.address = None
        with stderr_path.open("wb") as stderr:
            self.process = await trio.lowlevel.open_process(
                self.command(log_file),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=REPO_ROOT,
                env=os.environ | self.env,
            )
        try:
            self.address = await self._listening(stderr_path)
        except BaseException:
            await self.kill()
            raise
        return self.address

    async def _listening(self, stderr_path: Path) -> str:
        process = self.process
        assert process is not None and process.stdout is not None
        with trio.move_on_after(START_SECONDS):
            address = await listening_address(process.stdout)
            if address is not None:
                return address
            with trio.move_on_after(KILL_SECONDS):
                await process.wait()
            raise NodeStartFailed(
                f"node {self.node_id} on {self.host} exited (code {process.returncode}) before "
                f"it listened; stderr: {_tail(stderr_path)}",
                process.returncode,
            )
        raise NodeStartFailed(
            f"node {self.node_id} on {self.host} did not listen within {START_SECONDS:g} s; stderr: "
            f"{_tail(stderr_path)}",
            None,
        )

    async def kill(self) -> None:
        """SIGKILL the process (when it runs) and reap it; shielded and bounded."""
        process = self.process
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGKILL)
                with trio.move_on_after(KILL_SECONDS):
                    await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()
        self.address = None

    async def wait_exit(self, seconds: float) -> int | None:
        """The exit code once the process ends within `seconds` (None: it still runs)."""
        process = self.process
        if process is None:
            return None
        with trio.move_on_after(seconds):
            await process.wait()
        return process.returncode


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-_TAIL_CHARS:]
    except OSError as error:
        return f"(cannot read {path}: {error})"

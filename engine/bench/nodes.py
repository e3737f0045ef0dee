"""A node as its own process for the benchmarks that compare runs of whole nodes (`zigzag`).

`node_process(log_file, options)` starts `python -m engine.node --listen 127.0.0.1:0 --http off
--log-file LOG --no-log-console [options]`, reads the control address from its `{"listening": ...}`
stdout line and yields it; when the block ends it waits for the process to exit (the caller sends
`shutdown` through its client), killing it after `STOP_SECONDS`. A node that exits early or never
listens raises `NodeFailed` with the tail of its stderr. `read_events(log_file)` reads the node's JSON
log (complete lines only).

On Linux the node gets SIGTERM when the benchmark's process dies, however it dies (`kill`, a crash):
a benchmark stopped from outside leaves no node running. `node_process` must be entered on the thread
that lives as long as the benchmark (the main thread, before `trio.run`): the signal follows the thread
that started the child.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, NoReturn

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
START_SECONDS: Final = 60.0
STOP_SECONDS: Final = 30.0
_PR_SET_PDEATHSIG: Final = 1


class NodeFailed(RuntimeError):
    """The node process did not start or stop as it should; the message quotes its stderr."""


@contextmanager
def node_process(log_file: Path, options: Sequence[str]) -> Iterator[str]:
    """See the module docstring."""
    stderr_file = log_file.with_suffix(".stderr")
    command = [
        sys.executable,
        "-m",
        "engine.node",
        "--listen",
        "127.0.0.1:0",
        "--http",
        "off",
        "--log-file",
        str(log_file),
        "--no-log-console",
        *options,
    ]
    with stderr_file.open("wb") as stderr:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=REPO_ROOT,
            preexec_fn=_dies_with_parent(),
        )
    try:
        yield _listening_address(process, stderr_file)
        try:
            process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            raise NodeFailed(f"the node did not exit within {STOP_SECONDS} s; killed") from None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _dies_with_parent() -> Callable[[], None] | None:
    """A function for the child, between fork and exec, that asks Linux for SIGTERM when the parent dies."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def ask() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return ask


def _listening_address(process: subprocess.Popen[bytes], stderr_file: Path) -> str:
    assert process.stdout is not None
    descriptor = process.stdout.fileno()
    deadline = time.monotonic() + START_SECONDS
    pending = b""
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(message, dict) and "listening" in message:
                return str(message["listening"])
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([descriptor], [], [], remaining)[0]:
            _fail(stderr_file, f"did not listen within {START_SECONDS} s")
        chunk = os.read(descriptor, 65536)
        if not chunk:
            _fail(stderr_file, f"exited before listening (exit code {process.wait()})")
        pending += chunk


def _fail(stderr_file: Path, why: str) -> NoReturn:
    tail = stderr_file.read_text(errors="replace")[-3000:]
    raise NodeFailed(f"the node {why}; stderr:\n{tail}")


def read_events(log_file: Path, *names: str) -> list[dict[str, Any]]:
    """The log's events (only those named, when names are given), as decoded JSON objects."""
    found: list[dict[str, Any]] = []
    if not log_file.exists():
        return found
    for line in log_file.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line the node was still writing
        if isinstance(event, dict) and (not names or event.get("event") in names):
            found.append(event)
    return found

"""The line a node prints on stdout once its control socket listens (`{"listening": ADDRESS, "http":
URL}`, architecture §7), read by whoever starts node processes (the cluster demo, the test hosts)."""

from __future__ import annotations

import json

import trio


async def listening_address(stdout: trio.abc.ReceiveStream) -> str | None:
    """The address of the first `{"listening": ...}` line on a node's `stdout` (other lines are
    skipped), or None when the stream ends first (the node exited). Waits as long as it takes: the
    caller sets the deadline."""
    pending = b""
    while True:
        line, newline, rest = pending.partition(b"\n")
        if not newline:
            chunk = await stdout.receive_some(65536)
            if not chunk:
                return None
            pending += chunk
            continue
        pending = rest
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(message, dict) and "listening" in message:
            return str(message["listening"])

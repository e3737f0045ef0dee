"""A raw TCP connection to a node's control socket: bytes in, reply lines out, for input no client sends."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, final

import trio

from tests.node.harness import START_TIMEOUT, STATE_TIMEOUT, NodeProcess
from tests.waiting import deadline


@final
class RawConnection:
    """Bytes in, decoded reply lines out: for input no client would send. Every read has a deadline."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buffer = b""

    async def send(self, data: bytes) -> None:
        with deadline("the node taking a raw line", STATE_TIMEOUT):
            await self.stream.send_all(data)

    async def reply(self, timeout: float = STATE_TIMEOUT) -> dict[str, Any]:
        """The next reply line, decoded; fails if the connection closes or nothing comes in time."""
        line = await self._line(timeout)
        assert line is not None, "the node closed the connection"
        decoded = json.loads(line)
        assert isinstance(decoded, dict), decoded
        return decoded

    async def ask(self, data: bytes) -> dict[str, Any]:
        """Send one line and return the one reply it gets (the connection must have nothing else in flight)."""
        await self.send(data)
        return await self.reply()

    async def closed(self, timeout: float = STATE_TIMEOUT) -> list[dict[str, Any]]:
        """The replies left before the node closes the connection (fails if it does not close in time)."""
        replies = []
        while (line := await self._line(timeout)) is not None:
            replies.append(json.loads(line))
        return replies

    async def _line(self, timeout: float) -> bytes | None:
        with deadline("a reply line (or the end of the connection) from the node", timeout):
            while b"\n" not in self._buffer:
                chunk = await self.stream.receive_some(65536)
                if not chunk:
                    assert not self._buffer, f"connection closed inside a line: {self._buffer[:200]!r}"
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line


@asynccontextmanager
async def raw_connection(
    node: NodeProcess, *, receive_buffer: int | None = None
) -> AsyncIterator[RawConnection]:
    """A plain TCP connection to `node`; `receive_buffer` shrinks SO_RCVBUF (a client that reads little)."""
    sock = trio.socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    with deadline(f"a raw connection to the node at {node.address}", START_TIMEOUT):
        await sock.connect(node.host_port)
    stream = trio.SocketStream(sock)
    try:
        yield RawConnection(stream)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()

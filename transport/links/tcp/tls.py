"""TLS on a TCP transfer link (`--transfer-tls`, docs/security.md): `TlsSocket` stands in for the link's
non-blocking socket, speaking TLS through an `ssl.SSLObject` over memory BIOs, so the link's reader and
writers (`transport.links.tcp.link`) stay as they are — they call `sendmsg`, `recvmsg_into` and wait on
the same file descriptor.

- `sendmsg(parts)` encrypts up to `BATCH_BYTES` of the parts and sends the records; when the socket takes
  only some of them it raises `BlockingIOError` (the caller waits until it is writable and calls again
  with the same parts), and the call that sends the last of them returns how much of the parts they
  carried. Ciphertext is never dropped or sent twice.
- `recvmsg_into(buffers)` decrypts into the buffers, in order, what the socket has; it raises
  `BlockingIOError` only when it has no byte for them (so a caller that then waits for the socket to be
  readable never waits on bytes already decrypted), and returns 0 at the end of the stream.

`wrap` runs the handshake on a connected socket, both certificates verified against the cluster's CA
(`transport.auth.tls`); the caller bounds it with a deadline.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from typing import Any, Final, cast, final

import trio

from transport.errors import LinkBroken

BATCH_BYTES: Final = 256 * 1024
RECEIVE_BYTES: Final = 256 * 1024


def _bytes_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@final
class TlsSocket:
    """See the module docstring. Owns the socket (closing closes it)."""

    def __init__(
        self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO
    ):
        self._sock, self._tls, self._incoming, self._outgoing = sock, tls, incoming, outgoing
        self._out = memoryview(b"")  # records not yet sent
        self._carried = 0  # plaintext bytes those records carry

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def sendmsg(self, parts: Sequence[Any], /) -> int:
        if not self._out:
            taken = 0
            for part in parts:
                view = _bytes_view(part)[: BATCH_BYTES - taken]
                if len(view):
                    self._tls.write(view)
                    taken += len(view)
                if taken >= BATCH_BYTES:
                    break
            self._out, self._carried = memoryview(self._outgoing.read()), taken
        while self._out:
            sent = self._sock.send(self._out)  # BlockingIOError: the caller waits, then calls again
            self._out = self._out[sent:]
        carried, self._carried = self._carried, 0
        return carried

    def recvmsg_into(self, buffers: Sequence[Any], /) -> tuple[int, list[Any], int, Any]:
        count = 0
        for buffer in buffers:
            view = _bytes_view(buffer)
            while len(view):
                try:
                    got = cast(int, self._tls.read(len(view), view))  # with a buffer: a count
                except ssl.SSLWantReadError:
                    if self._fill():
                        continue
                    if count:
                        return count, [], 0, None
                    raise BlockingIOError from None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    got = 0
                if got == 0:  # the end of the stream
                    return count, [], 0, None
                count += got
                view = view[got:]
        return count, [], 0, None

    def _fill(self) -> bool:
        """Feed what the socket has to the TLS object; False when it has nothing now."""
        try:
            data = self._sock.recv(RECEIVE_BYTES)
        except BlockingIOError:
            return False
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()
        return True


async def wrap(sock: socket.socket, context: ssl.SSLContext, *, server_side: bool, peer: str) -> TlsSocket:
    """`sock` speaking TLS once the handshake passed; raises `LinkBroken` naming why it did not (a
    certificate the CA did not sign, the peer closing)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=server_side)
    while True:
        try:
            tls.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        except ssl.SSLError as exc:
            await _send_all(sock, outgoing.read())  # the alert, so the peer learns why
            raise LinkBroken(f"TLS handshake with {peer} failed: {exc}") from None
        await _send_all(sock, outgoing.read())
        if done:
            return TlsSocket(sock, tls, incoming, outgoing)
        await trio.lowlevel.wait_readable(sock)
        try:
            data = sock.recv(RECEIVE_BYTES)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise LinkBroken(f"TLS handshake with {peer}: receive failed: {exc}") from None
        if not data:
            raise LinkBroken(f"{peer} closed the link during the TLS handshake")
        incoming.write(data)


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
        except OSError as exc:
            raise LinkBroken(f"TLS handshake: send failed: {exc}") from None

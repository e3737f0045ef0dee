"""Opening an authenticated link over a byte stream (docs/security.md).

`admit_dialer` and `admit_listener` run on a freshly connected stream, before any frame: TLS first when
the credentials hold TLS files (a `trio.SSLStream`, both certificates verified), then the secret's
challenge–response (`transport.auth.challenge`) when they hold a secret. Each message of the exchange
goes with a one-byte length (none is longer than `MAX_MESSAGE_BYTES`), and the listener ends it with a
verdict byte, so the dialer knows it was admitted before it sends a frame and neither side reads past the
exchange. The caller bounds the whole with a deadline (a silent dialer must not hold a listener's task).

`SocketPipe` runs the exchange on a plain non-blocking socket (the TCP transfer link's).

Raises `AuthFailed` naming why: a bad MAC, a certificate that does not verify or names no node, a name
that differs between the certificate and the secret's exchange, or (dialer) a listener that is not the
node it meant to reach.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import Final, Protocol, final

import trio

from transport.auth.challenge import (
    MAX_MESSAGE_BYTES,
    AuthFailed,
    Purpose,
    answer,
    check_answer,
    check_proof,
    encode_answer,
    encode_hello,
    new_hello,
    parse_answer,
    parse_hello,
)
from transport.auth.credentials import Credentials
from transport.auth.tls import certificate_name

ADMITTED: Final = b"\x01"
REFUSED: Final = b"\x00"


class Pipe(Protocol):
    """What the exchange needs of a stream (a `trio.abc.Stream` is one)."""

    async def send_all(self, data: bytes) -> None: ...
    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray: ...


@final
@dataclass(frozen=True, slots=True)
class Admitted:
    """An authenticated link: the stream to use from now on (TLS-wrapped when TLS is on), the other
    side's proven name (None when no credential is configured) and the session key that keys the frame
    MACs (None without a secret)."""

    stream: trio.abc.Stream
    peer: str | None
    key: bytes | None


async def admit_dialer(
    stream: trio.abc.Stream, credentials: Credentials, *, purpose: Purpose, name: str, expect: str | None
) -> Admitted:
    """This side dialled: prove `name` to the listener and check it is `expect` (any member when None)."""
    peer: str | None = None
    if credentials.client_tls is not None:
        stream, peer = await _tls(stream, credentials.client_tls, server_side=False)
    key = None
    if credentials.secret is not None:
        hello = new_hello(purpose, name)
        await _send(stream, encode_hello(hello))
        reply = parse_answer(await _receive(stream))
        proof, key = check_answer((credentials.secret, *credentials.also), hello, reply)
        await _send(stream, proof)
        if await _exactly(stream, 1) != ADMITTED:
            raise AuthFailed(f"{reply.name!r} refused this node's proof of the cluster secret")
        peer = _agree(peer, reply.name)
    if expect is not None and peer is not None and peer != expect:
        raise AuthFailed(f"dialled node {expect!r}, but {peer!r} answered")
    return Admitted(stream=stream, peer=peer, key=key)


async def admit_listener(
    stream: trio.abc.Stream, credentials: Credentials, *, purpose: Purpose, name: str
) -> Admitted:
    """This side accepted: check the dialer holds the credentials; its proven name is `Admitted.peer`."""
    peer: str | None = None
    if credentials.server_tls is not None:
        stream, peer = await _tls(stream, credentials.server_tls, server_side=True)
    key = None
    if credentials.secret is not None:
        hello = parse_hello(await _receive(stream))
        if hello.purpose != purpose:
            raise AuthFailed(f"{hello.name!r} opened a {hello.purpose} link where {purpose} links listen")
        reply, key = answer(credentials.secret, hello, name)
        await _send(stream, encode_answer(reply))
        proof = await _receive(stream)
        try:
            check_proof(credentials.secret, hello, reply, proof)
        except AuthFailed:
            await stream.send_all(REFUSED)
            raise
        await stream.send_all(ADMITTED)
        peer = _agree(peer, hello.name)
    return Admitted(stream=stream, peer=peer, key=key)


async def _tls(
    stream: trio.abc.Stream, context: ssl.SSLContext, *, server_side: bool
) -> tuple[trio.SSLStream, str]:
    wrapped = trio.SSLStream(stream, context, server_side=server_side)
    try:
        await wrapped.do_handshake()
    except trio.BrokenResourceError as exc:
        raise AuthFailed(f"TLS handshake failed: {exc.__cause__ or exc}") from None
    name = certificate_name(wrapped.getpeercert())
    if name is None:
        raise AuthFailed("the other side's certificate names no node (no DNS subjectAltName or commonName)")
    return wrapped, name


def _agree(certified: str | None, claimed: str) -> str:
    if certified is not None and certified != claimed:
        raise AuthFailed(f"the certificate names {certified!r}, the secret's exchange {claimed!r}")
    return claimed


async def _send(pipe: Pipe, message: bytes) -> None:
    await pipe.send_all(bytes([len(message)]) + message)


async def _receive(pipe: Pipe) -> bytes:
    (length,) = await _exactly(pipe, 1)
    if length > MAX_MESSAGE_BYTES:
        raise AuthFailed(f"an authentication message of {length} bytes, over {MAX_MESSAGE_BYTES}")
    return await _exactly(pipe, length)


async def _exactly(pipe: Pipe, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        try:
            chunk = await pipe.receive_some(count - len(data))
        except trio.BrokenResourceError as exc:
            raise AuthFailed(f"the link broke during authentication: {exc.__cause__ or exc}") from None
        if not chunk:
            raise AuthFailed("the other side closed the link during authentication")
        data += chunk
    return bytes(data)


@final
class SocketPipe(trio.abc.Stream):
    """A plain non-blocking stdlib socket as a stream, for the exchange only: it never closes the socket,
    which its owner keeps using afterwards."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._sock)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            view = view[sent:]

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self._sock)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while True:
            try:
                return self._sock.recv(max_bytes or 65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._sock)
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc

    async def send_eof(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()  # the owner closes the socket

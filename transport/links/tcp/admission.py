"""Admitting a TCP transfer link (docs/security.md): with the cluster secret (`TransferConfig.admission`)
the socket's first bytes are the secret's challenge–response (`transport.auth.streams`, purpose
`transfer`), before the §5.1 handshake and so before any grant; without it every link is taken. With
`--transfer-tls` (the admission's TLS contexts) a TLS handshake follows, both certificates verified, and
the link speaks TLS from then on (`transport.links.tcp.tls`).

The accepting side runs it in a task of its own within the handshake timeout — a silent dialer holds
no one else's accept — and closes a socket that fails, logging `transfer.link_refused` with the dialer's
address and the reason.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import structlog
import trio

from transport.auth.challenge import AuthFailed
from transport.auth.credentials import LinkAdmission
from transport.auth.streams import SocketPipe, admit_dialer, admit_listener
from transport.config import TransferConfig
from transport.errors import LinkBroken
from transport.links.tcp.sockets import LinkSocket, accept
from transport.links.tcp.sockets import connect as connect_socket
from transport.links.tcp.tls import wrap

_log = structlog.get_logger("transport.tcp")


async def accept_all(
    listener: socket.socket,
    config: TransferConfig,
    endpoint: str,
    nursery: trio.Nursery,
    adopt: Callable[[LinkSocket], None],
) -> None:
    """Accept sockets on `listener` forever; `adopt` each, once admitted (at once without a secret)."""
    while True:
        sock = await accept(listener)
        if config.admission is None:
            adopt(sock)
        else:
            nursery.start_soon(
                _admit_accepted, sock, config.admission, endpoint, config.handshake_timeout, adopt
            )


async def _admit_accepted(
    sock: socket.socket,
    admission: LinkAdmission,
    endpoint: str,
    timeout: float,
    adopt: Callable[[LinkSocket], None],
) -> None:
    admitted_socket = await admitted(sock, admission, endpoint, timeout)
    if admitted_socket is not None:
        adopt(admitted_socket)


async def connect(host: str, port: int, admission: LinkAdmission | None, address: str) -> LinkSocket:
    """A socket to the listener at `address` (`host:port`), admitted when there is a secret (and
    speaking TLS with `--transfer-tls`); raises `OSError` when nothing listens there, `LinkBroken` when
    it is not admitted."""
    sock = await connect_socket(host, port)
    if admission is None:
        return sock
    try:
        return await admit(sock, admission, address)
    except BaseException:
        sock.close()
        raise


async def admitted(
    sock: socket.socket, admission: LinkAdmission, endpoint: str, timeout: float
) -> LinkSocket | None:
    """The accepting side: the socket to serve once the dialer proved the secret (and passed the TLS
    handshake); None when it did not (logged, the socket closed)."""
    try:
        remote = "{}:{}".format(*sock.getpeername()[:2])
    except OSError:
        remote = "?"
    try:
        with trio.fail_after(timeout):
            await admit_listener(
                SocketPipe(sock), admission.credentials, purpose="transfer", name=admission.name
            )
            if admission.server_tls is None:
                return sock
            return await wrap(sock, admission.server_tls, server_side=True, peer=remote)
    except (AuthFailed, trio.TooSlowError, trio.BrokenResourceError, LinkBroken) as exc:
        reason = str(exc) or f"it did not authenticate within {timeout} s"
        _log.warning("transfer.link_refused", endpoint=endpoint, remote=remote, reason=reason)
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise


async def admit(sock: socket.socket, admission: LinkAdmission, address: str) -> LinkSocket:
    """The dialling side: prove the secret to the listener at `address` (then the TLS handshake with
    `--transfer-tls`); raises `LinkBroken` naming why when either side does not prove it."""
    try:
        await admit_dialer(
            SocketPipe(sock), admission.credentials, purpose="transfer", name=admission.name, expect=None
        )
    except (AuthFailed, trio.BrokenResourceError) as exc:
        raise LinkBroken(f"the transfer link to {address} was not admitted: {exc}") from None
    if admission.client_tls is None:
        return sock
    return await wrap(sock, admission.client_tls, server_side=False, peer=address)

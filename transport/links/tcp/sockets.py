"""Sockets of the TCP transport (`transport.links.tcp.link`): non-blocking stdlib sockets with `TCP_NODELAY`,
opened, accepted and connected under Trio (cancellable while waiting)."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Sequence
from typing import Any, Protocol

import trio


class LinkSocket(Protocol):
    """What a TCP link uses of its socket: a plain one, or TLS over it (`transport.links.tcp.tls`)."""

    def fileno(self) -> int: ...
    def close(self) -> None: ...
    def sendmsg(self, buffers: Sequence[Any], /) -> int: ...
    def recvmsg_into(self, buffers: Sequence[Any], /) -> tuple[int, list[Any], int, Any]: ...


def tcp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setblocking(False)
    sock.bind((host, port))
    sock.listen(128)
    return sock


async def accept(listener: socket.socket) -> socket.socket:
    """The next connection; cancellable while waiting."""
    while True:
        try:
            sock, _address = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


async def connect(host: str, port: int) -> socket.socket:
    """A connected socket to `host:port` (IPv4); raises `OSError` naming the address."""
    infos = await trio.socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    address = infos[0][4]
    sock = tcp_socket()
    try:
        error = sock.connect_ex(address)
        if error == errno.EINPROGRESS:
            await trio.lowlevel.wait_writable(sock)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except BaseException:
        sock.close()
        raise
    if error:
        sock.close()
        raise OSError(error, f"cannot connect to {host}:{port}: {os.strerror(error)}")
    return sock

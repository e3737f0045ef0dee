"""Listen addresses: the control socket's (``HOST:PORT`` — TCP; ``[v6]:PORT`` for IPv6 literals — or
``unix:PATH``) and the HTTP API's (``--http``: ``HOST:PORT`` or ``off``): values of the configuration,
which the control server and the client read."""

from __future__ import annotations

import ipaddress
from typing import final

import msgspec


@final
class TcpAddress(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@final
class UnixAddress(msgspec.Struct, frozen=True, kw_only=True):
    path: str

    def __str__(self) -> str:
        return f"unix:{self.path}"


Address = TcpAddress | UnixAddress


def parse_address(text: str) -> Address:
    """Parse ``HOST:PORT``, ``[V6]:PORT`` or ``unix:PATH``; ValueError names the text and the problem.

    Port 0 is allowed: a server then binds a free port (its bound address tells which).
    """
    if text.startswith("unix:"):
        path = text.removeprefix("unix:")
        if not path:
            raise ValueError(f"address {text!r}: unix: needs a socket path, e.g. unix:/tmp/zigzag.sock")
        return UnixAddress(path=path)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {text!r}: expected HOST:PORT (e.g. 127.0.0.1:7340) or unix:PATH")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(
            f"address {text!r}: expected HOST:PORT (e.g. 127.0.0.1:7340) or unix:PATH, with no scheme; "
            "an IPv6 host goes in brackets, e.g. [::1]:7340"
        )
    if not host:
        raise ValueError(f"address {text!r}: the host is empty")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"address {text!r}: port {port_text!r} is not a number from 0 to 65535")
    return TcpAddress(host=host, port=int(port_text))


def parse_http(value: str) -> tuple[str, int] | None:
    """`--http`: `HOST:PORT`, or `off` (None). Raises `ValueError` naming the value."""
    if value == "off":
        return None
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http {value!r}: expected HOST:PORT (port 0: any free port) or off")
    return host.strip("[]"), int(port)


def loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def exposed(address: Address) -> bool:
    """Whether other hosts may reach `address` (a TCP address not on loopback)."""
    return isinstance(address, TcpAddress) and not loopback(address.host)

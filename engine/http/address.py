"""The `--http` setting: where the HTTP API listens, or `off` (light: the config imports it)."""

from __future__ import annotations


def parse_http(value: str) -> tuple[str, int] | None:
    """`--http`: `HOST:PORT`, or `off` (None). Raises `ValueError` naming the value."""
    if value == "off":
        return None
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http {value!r}: expected HOST:PORT (port 0: any free port) or off")
    return host.strip("[]"), int(port)

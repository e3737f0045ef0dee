"""The control socket's token (`--control-token-file`, docs/security.md): each connection's first line
must carry it; a connection without it, with another, or with a request in its place gets one
`unauthorized` error, is logged and closed before any request is read; the client sends it for you."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from engine.client import ControlClient
from engine.client.control_client import ControlProtocolError
from engine.config import ConfigError, parse_node_config
from engine.config.address import TcpAddress
from engine.control.server import ControlServer
from engine.logging import open_event_log
from tests.control.conftest import Handler, RawClient, limits
from tests.waiting import deadline

TOKEN = b"control-token-0123456789"
STATUS = b'{"op": "status", "id": "s"}'


async def test_only_connections_that_open_with_the_token_are_served(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    log_path = tmp_path / "events.jsonl"
    log = open_event_log(file=str(log_path), level="debug", console=None)
    handler = Handler()
    server = ControlServer(handler, limits(), log, TOKEN)
    handler.server = server
    address = await nursery.start(server.serve, TcpAddress(host="127.0.0.1", port=0))

    async with ControlClient.connect(address, token=TOKEN) as client:
        await client.status()
    for first_line in (STATUS, b'{"token": "wrong"}', b"not json", b'{"token": "' + b"x" * 5000 + b'"}'):
        raw = await RawClient.open(address)
        await raw.send(first_line, STATUS)
        reply = await raw.reply()
        assert (reply["id"], reply["code"]) == (None, "unauthorized"), reply
        with deadline("the node closing the unauthorized connection", 10):
            assert await raw.reader.next_line() is None  # closed: the status after it was never read
        await raw.aclose()
    with pytest.raises(ControlProtocolError, match="the node answered unauthorized"):
        async with ControlClient.connect(address, token=b"another-token-0123456") as client:
            await client.status()
    async with ControlClient.connect(address, token=TOKEN) as client:
        await client.status()
    log.flush()
    reasons = [line for line in log_path.read_text().splitlines() if '"client_disconnected"' in line]
    assert sum('"unauthorized"' in line for line in reasons) == 5


def test_a_control_socket_off_loopback_needs_a_token() -> None:
    with pytest.raises(ConfigError, match=r"reachable from other hosts: give --control-token-file"):
        parse_node_config(["--listen", "0.0.0.0:7340"])
    for listen in ("127.0.0.1:7340", "[::1]:7340", "localhost:7340", "unix:/tmp/zz.sock"):
        parse_node_config(["--listen", listen])
    parse_node_config(["--listen", "10.1.2.3:7340", "--control-token-file", "token"])

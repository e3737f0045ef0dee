"""HTTP/1.1 as written: a request sent with `Connection: close` gets its whole response, then the end of
the connection — streamed or not. A raw socket reads to EOF (the server closing is the condition; the
deadline only keeps a broken server from hanging the test)."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from tests.http.conftest import API_KEY
from tests.node.harness import NodeProcess
from tests.waiting import deadline


async def _read_to_eof(node: NodeProcess, body: dict[str, object]) -> bytes:
    assert node.http_url is not None
    url = urlsplit(node.http_url)
    assert url.hostname is not None and url.port is not None
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: {url.hostname}:{url.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    stream = await trio.open_tcp_stream(url.hostname, url.port)
    async with stream:
        await stream.send_all(head.encode() + payload)
        received = bytearray()
        with deadline("the server to close the connection after its response", 60):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return bytes(received)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_connection_close_ends_the_connection_after_the_response(
    node: NodeProcess, http: httpx.AsyncClient, stream: bool
) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": stream}
    received = await _read_to_eof(node, body)
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"connection: close" in head.lower()
    if stream:
        assert b"data: [DONE]" in rest and rest.endswith(b"0\r\n\r\n")  # the last chunk, then EOF
    else:
        assert json.loads(rest)["choices"][0]["finish_reason"] == "length"

"""The access line through a real node: one `http_access` event per HTTP request — method, path,
status, seconds, and for a generation its id and token counts — in the log file (the console shows the
same events: tests/control/test_logging.py); `--disable-log-requests` turns the lines off."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.http.conftest import API_KEY
from tests.node.harness import NodeProcess, node_process
from tests.waiting import wait_until

CHAT = [{"role": "user", "content": "hi there"}]


async def _access(node: NodeProcess, path: str, *, seen: int = 0) -> dict:
    """The access line of the next request to `path`, once more than `seen` are logged (each request's
    line is written as its response ends: a client may read the response first)."""

    async def logged() -> dict | None:
        lines = [e for e in node.events("http_access") if e["path"] == path]
        return lines[-1] if len(lines) > seen else None

    return await wait_until(logged, f"the access line of {path}", 30, interval=0.05)


async def test_each_request_gets_one_access_line(node: NodeProcess, http: httpx.AsyncClient) -> None:
    reply = await http.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    line = await _access(node, "/v1/completions")
    assert line["method"] == "POST" and line["status"] == 200 and line["seconds"] > 0
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"] == 3
    assert line["peer"] is not None
    assert line["request_id"] in {e["request_id"] for e in node.events("request_finished")}

    async with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True},
    ) as streamed:
        assert streamed.status_code == 200
        body = b"".join([chunk async for chunk in streamed.aiter_bytes()])
    assert body.endswith(b"data: [DONE]\n\n")
    line = await _access(node, "/v1/chat/completions")
    assert line["status"] == 200 and line["completion_tokens"] == 2

    two = await http.post(
        "/v1/completions",
        json={"prompt": ["one", "and two"], "n": 2, "max_tokens": 2, "ignore_eos": True, "temperature": 0},
    )
    assert two.status_code == 200, two.text
    line = await _access(node, "/v1/completions", seen=1)  # four choices: the line counts them all
    assert line["prompt_tokens"] == two.json()["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == two.json()["usage"]["completion_tokens"] == 8

    missing = await http.get("/v1/nowhere")
    assert missing.status_code == 404
    line = await _access(node, "/v1/nowhere")
    assert line["method"] == "GET" and line["status"] == 404 and line["request_id"] is None
    unauthorized = await http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert unauthorized.status_code == 401
    assert (await _access(node, "/v1/models"))["status"] == 401


@pytest.fixture(scope="module")
def quiet_node(tmp_path_factory: pytest.TempPathFactory):
    directory: Path = tmp_path_factory.mktemp("quiet")
    with node_process(directory, "--api-key", API_KEY, "--disable-log-requests") as served:
        yield served


async def test_disable_log_requests_turns_the_lines_off(quiet_node: NodeProcess) -> None:
    assert quiet_node.http_url is not None
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=quiet_node.http_url, headers=headers, timeout=30) as client:

        async def healthy() -> bool:
            return (await client.get("/health")).status_code == 200

        await wait_until(healthy, "the node's /health to answer 200", 60, interval=0.1)
        reply = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        await quiet_node.wait_event("request_finished", lambda _: True, timeout=30)
    assert quiet_node.events("http_access") == []

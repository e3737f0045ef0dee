"""A failure after a stream began: the client gets one SSE `error` event in vLLM's shape, then
`data: [DONE]`, and the node serves on."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.node.harness import node_process
from tests.waiting import wait_until


async def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error_event(tmp_path: Path) -> None:
    # The decode replica's task raises after 40 passes over its inbox: while it decodes this request.
    with node_process(tmp_path, "--fault", "fail_replica:replica=decode-0,after_steps=40") as node:
        assert node.http_url is not None
        async with httpx.AsyncClient(base_url=node.http_url, timeout=60) as http:

            async def healthy() -> bool:
                return (await http.get("/health")).status_code == 200

            await wait_until(healthy, "the node's /health to answer 200", 60, interval=0.1)
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2000,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                events = [
                    line[len("data: ") :] async for line in reply.aiter_lines() if line.startswith("data: ")
                ]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert (error["code"], error["type"]) == (500, "InternalServerError")
            assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all("choices" in json.loads(event) for event in events[:-2])
            assert node.events("replica_failed")

"""One real node per test module, serving the HTTP API on a free port with an API key; the official
`openai` client talks to it (`AsyncOpenAI` runs on trio through httpx)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.model.text.test_chat_template import QWEN2_TEMPLATE
from tests.node.harness import NodeProcess, node_process
from tests.waiting import wait_until

API_KEY = "zz-test-key"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    directory: Path = tmp_path_factory.mktemp("http")
    with node_process(directory, "--api-key", API_KEY) as served:
        assert served.http_url is not None
        yield served


@contextmanager
def tool_node(directory: Path) -> Iterator[NodeProcess]:
    """A node whose chat template is Qwen2.5's (it renders `tools`, calls and tool results) and whose
    replies are parsed for `<tool_call>` tags (`--tool-call-parser hermes`)."""
    template = directory / "qwen2.jinja"
    template.write_text(QWEN2_TEMPLATE)
    with node_process(
        directory, "--api-key", API_KEY, "--chat-template", str(template), "--tool-call-parser", "hermes"
    ) as served:
        assert served.http_url is not None
        yield served


@pytest.fixture
async def http(node: NodeProcess) -> AsyncIterator[httpx.AsyncClient]:
    """A plain HTTP client (with the key), once the node is healthy."""
    assert node.http_url is not None
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=node.http_url, headers=headers, timeout=30) as client:

        async def healthy() -> bool:
            return (await client.get("/health")).status_code == 200

        await wait_until(healthy, "the node's /health to answer 200", 60, interval=0.1)
        yield client


@pytest.fixture
async def client(node: NodeProcess, http: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{node.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=60
    ) as api:
        yield api
